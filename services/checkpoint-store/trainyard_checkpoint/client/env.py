"""The client's settings, read once from the worker environment Trainyard gives every worker.

| variable | meaning |
|---|---|
| `TRAINYARD_CHECKPOINT_STORE` | host:port of the checkpoint-store (required) |
| `TRAINYARD_CHECKPOINT_CERT`, `..._KEY` | the job's worker credential: certificate chain and key |
| `TRAINYARD_CHECKPOINT_CA` | the CA bundle the store is verified against (each: a file's path, or PEM) |
| `TRAINYARD_CHECKPOINT_PLAINTEXT` | `1`: a store that serves plaintext, no credential |
| `TRAINYARD_JOB_ID` | the job the checkpoints belong to (required) |
| `TRAINYARD_ATTEMPT` | the job's restart count (default 0) |
| `TRAINYARD_CHECKPOINT_THREADS` | writer threads (files) per rank (default 2) |
| `TRAINYARD_CHECKPOINT_CHUNK_BYTES` | bytes per checksum chunk (default 64 MiB) |
| `TRAINYARD_CHECKPOINT_KEEP_LAST`, `..._KEEP_EVERY_STEPS` | retention sent with each Begin (optional) |
| `TRAINYARD_CODE_VERSION` | recorded in each checkpoint's lineage (optional) |
| `TRAINYARD_CHECKPOINT_TIMEOUT_S` | deadline of one service call, and of the saver's collectives (default 600) |
| `TRAINYARD_TEST_KILL_AT`, `TRAINYARD_TEST_KILL_TRACE` | test hooks, see faults.py |

RANK and WORLD_SIZE are not read here: they come from torch.distributed's process group.

The agent gives the credential as three files, which it replaces when the scheduler renews the credential
(an hour's lifetime, renewed at half): the client re-reads them when they change (credentials.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from trainyard_core.security.job_credentials import CA_ENV, CERT_ENV, KEY_ENV, PLAINTEXT_ENV

from ..checksum import CHUNK_BYTES
from .credentials import WorkerTls
from .errors import ConfigError
from .faults import KillSpec, parse_kill_at

_TRUE = ("1", "true", "yes")


def transport_from_env(env: Mapping[str, str]) -> tuple[WorkerTls | None, bool]:
    """(credential, insecure_plaintext) from the worker environment: the credential, or plaintext said out
    loud; ConfigError otherwise."""
    given = {name: env.get(name, "").strip() for name in (CERT_ENV, KEY_ENV, CA_ENV)}
    present = [n for n, v in given.items() if v]
    plaintext = env.get(PLAINTEXT_ENV, "").strip().lower() in _TRUE
    if present and plaintext:
        raise ConfigError(f"{PLAINTEXT_ENV} and a credential ({', '.join(present)}) exclude each other")
    if present and len(present) < 3:
        raise ConfigError(f"{', '.join(n for n in given if n not in present)} not set: a checkpoint-store "
                          f"credential is {CERT_ENV}, {KEY_ENV} and {CA_ENV} together")
    if present:
        return WorkerTls.parse(given[CERT_ENV], given[KEY_ENV], given[CA_ENV]), False
    if plaintext:
        return None, True
    raise ConfigError(f"no checkpoint-store credential: {CERT_ENV}, {KEY_ENV} and {CA_ENV} are not set (the "
                      "scheduler sets them when it has a job issuer: its job_issuer_cert_file and "
                      f"job_issuer_key_file settings); {PLAINTEXT_ENV}=1 reaches a store that serves plaintext")


@dataclass(frozen=True, slots=True)
class Retention:
    keep_last: int = 0
    keep_every_steps: int = 0


@dataclass(frozen=True, slots=True)
class ClientSettings:
    store_address: str
    job_id: str
    attempt: int = 0
    thread_count: int = 2
    chunk_bytes: int = CHUNK_BYTES
    # fsync every file and the directory before commit; off only for benchmarks of the rest.
    sync_files: bool = True
    rpc_timeout_s: float = 60.0
    # Deadline of the async saver's collectives (a peer that died makes them fail after this).
    collective_timeout_s: float = 600.0
    restore_lease_ttl_s: int = 1800
    retention: Retention | None = None
    code_version: str = ""
    kill: KillSpec | None = field(default=None)
    # mTLS with the job's credential, or plaintext when said explicitly; exactly one.
    tls: WorkerTls | None = None
    insecure_plaintext: bool = False
    # The job's trace (W3C traceparent, TRAINYARD_TRACEPARENT): sent with every call to the checkpoint-store.
    traceparent: str = ""

    def __post_init__(self) -> None:
        if ":" not in self.store_address:
            raise ConfigError(f"checkpoint store address {self.store_address!r} must be host:port")
        if (self.tls is None) != self.insecure_plaintext:
            raise ConfigError("the checkpoint client needs a credential (tls) or insecure_plaintext=True, not "
                              "both and not neither")
        if not self.job_id:
            raise ConfigError("job_id is required")
        if self.thread_count < 1:
            raise ConfigError(f"thread_count must be >= 1, got {self.thread_count}")
        if self.chunk_bytes < 4096:
            raise ConfigError(f"chunk_bytes must be >= 4096, got {self.chunk_bytes}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientSettings:
        env = os.environ if environ is None else environ

        def required(name: str) -> str:
            value = env.get(name, "").strip()
            if not value:
                raise ConfigError(f"{name} is not set: the checkpoint client needs it (Trainyard sets it for "
                                  "every worker of a job)")
            return value

        def integer(name: str, default: int) -> int:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not an integer") from None

        keep_last = integer("TRAINYARD_CHECKPOINT_KEEP_LAST", 0)
        keep_every = integer("TRAINYARD_CHECKPOINT_KEEP_EVERY_STEPS", 0)
        timeout = float(integer("TRAINYARD_CHECKPOINT_TIMEOUT_S", 600))
        store_address, job_id = required("TRAINYARD_CHECKPOINT_STORE"), required("TRAINYARD_JOB_ID")
        tls, plaintext = transport_from_env(env)
        return cls(
            store_address=store_address,
            job_id=job_id,
            attempt=integer("TRAINYARD_ATTEMPT", 0),
            thread_count=integer("TRAINYARD_CHECKPOINT_THREADS", 2),
            chunk_bytes=integer("TRAINYARD_CHECKPOINT_CHUNK_BYTES", CHUNK_BYTES),
            rpc_timeout_s=min(timeout, 600.0),
            collective_timeout_s=timeout,
            retention=Retention(keep_last, keep_every) if keep_last or keep_every else None,
            code_version=env.get("TRAINYARD_CODE_VERSION", ""),
            kill=parse_kill_at(env.get("TRAINYARD_TEST_KILL_AT", ""), env.get("TRAINYARD_TEST_KILL_TRACE", "")),
            tls=tls,
            insecure_plaintext=plaintext,
            traceparent=env.get("TRAINYARD_TRACEPARENT", "").strip(),
        )
