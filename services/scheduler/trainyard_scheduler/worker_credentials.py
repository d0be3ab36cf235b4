"""What each launch adds to its workers' environment for the checkpoint-store: the attempt's credential.

With `job_issuer_cert_file`/`job_issuer_key_file` set, every attempt gets a certificate for
`trainyard://job/<job_id>` naming the attempt and the job's team (`trainyard_core.security.job_credentials`),
minted when the attempt is first launched and shared by all its nodes, good for `job_credential_ttl_s` (an
hour by default). While the attempt runs the leader renews it past half its lifetime
(`credential_renewal.py`, with `credential`), so the lifetime bounds how long a leaked credential is good
for, not how long an attempt may run. Without an issuer, workers get no credential and cannot reach a
checkpoint-store that serves mTLS; a scheduler running `insecure_plaintext` tells them instead that the
store is plaintext. Without a checkpoint-store (`checkpoint_store_address` empty) workers get neither.

The credential is added to the LaunchWorkers request only (`reconcile.Reconciler._launch`), and to the
renewals: it is never written to etcd and never logged. What each launch handed out is remembered here
(`launched`: when, and the earliest notAfter of the attempt's launches), so the renewal loop knows when the
nodes this leader launched need the next one without asking them.
"""

from __future__ import annotations

import datetime as dt
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from trainyard_core.security.job_credentials import PLAINTEXT_ENV, JobCredential, JobIssuer, JobIssuerError
from trainyard_core.settings import SettingsError

from .settings import SchedulerSettings


@dataclass(frozen=True, slots=True)
class Launched:
    """What this process's launches of one attempt handed out: the first launch's time and the earliest notAfter
    among them (epoch seconds)."""

    at: float
    not_after: float


class WorkerCredentials:
    """`now`: the clock credentials are minted by (tests move it). Launch records are bounded (the oldest go
    first); one forgotten only makes the renewal loop renew that attempt early."""

    LAUNCHED_MAX = 65_536

    def __init__(self, issuer: JobIssuer | None, *, plaintext: bool, store: bool = True,
                 now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)) -> None:
        self._issuer = issuer
        self._plaintext = plaintext
        self._store = store
        self._now = now
        self._launched: OrderedDict[tuple[str, int], Launched] = OrderedDict()

    @classmethod
    def from_settings(cls, s: SchedulerSettings) -> WorkerCredentials:
        """SettingsError naming the files when the job issuer cannot be used."""
        issuer = None
        if s.job_issuer_cert_file:
            try:
                issuer = JobIssuer(Path(s.job_issuer_cert_file), Path(s.job_issuer_key_file), Path(s.tls_ca_file),
                                   ttl_s=s.job_credential_ttl_s)
            except JobIssuerError as exc:
                raise SettingsError(f"job_issuer_cert_file/job_issuer_key_file: {exc}") from None
        return cls(issuer, plaintext=s.insecure_plaintext, store=bool(s.checkpoint_store_address))

    @property
    def minting(self) -> bool:
        """Whether launches carry a credential (and so the leader renews them)."""
        return self._issuer is not None and self._store

    @property
    def ttl_s(self) -> float:
        return self._issuer.ttl.total_seconds() if self._issuer is not None else 0.0

    def env(self, job_id: str, attempt: int, team: str) -> Mapping[str, str]:
        if not self._store:
            return {}
        if self._issuer is not None:
            now = self._now()
            cred = self._issuer.credential(job_id, attempt, team, now)
            self._note_launch(job_id, attempt, now.timestamp(), cred.not_after.timestamp())
            return cred.env()
        if self._plaintext:
            return {PLAINTEXT_ENV: "1"}
        return {}

    def credential(self, job_id: str, attempt: int, team: str) -> JobCredential:
        """The attempt's credential for a renewal: the issuer's latest while it has more than half its lifetime
        left, else a new one (which later launches of the attempt get too). Only while `minting`."""
        assert self._issuer is not None, "no job issuer: nothing to renew"
        return self._issuer.credential(job_id, attempt, team, self._now())

    def launched(self, job_id: str, attempt: int) -> Launched | None:
        return self._launched.get((job_id, attempt))

    def _note_launch(self, job_id: str, attempt: int, at: float, not_after: float) -> None:
        key = (job_id, attempt)
        seen = self._launched.get(key)
        self._launched[key] = Launched(at, not_after) if seen is None else \
            Launched(seen.at, min(seen.not_after, not_after))
        self._launched.move_to_end(key)
        while len(self._launched) > self.LAUNCHED_MAX:
            self._launched.popitem(last=False)
