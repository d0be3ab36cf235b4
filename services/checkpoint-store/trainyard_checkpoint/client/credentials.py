"""The worker's credential, re-read from its files when the agent replaces them.

The scheduler renews a running attempt's checkpoint-store credential past half its lifetime (an hour by
default) and the node's agent replaces the three files TRAINYARD_CHECKPOINT_CERT/_KEY/_CA name, each with
one rename (trainyard_agent.workers.credentials). A training process runs for weeks on one channel, so the
client looks again, as services do with their own certificates (trainyard_core.security.tls.ClientTls):

- before a call, at most once a second, it compares the files' stat signature (inode, size, mtime) with the
  one it read; when it changed, it reads them, and the service client builds a new channel with the new
  material (an established TLS connection keeps working past its certificate's notAfter, but a new one, after
  a reconnect, would be refused, so the channel is not left to find out);
- when a call fails with UNAVAILABLE (an expired certificate fails the TLS handshake, which is what a client
  sees of it) it looks at once, without the once-a-second limit, before it retries.

The three files are replaced one after the other, so a read can meet a new key beside the previous
certificate: such a read is not taken (the key must be the certificate's), and the next look reads again.
Reading at start (`read_files`) tries again for a moment for the same reason. A file that cannot be read or
holds something else keeps the material that works; nothing here logs a credential.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from trainyard_core.security.job_credentials import CA_ENV, CERT_ENV, KEY_ENV, is_pem, key_matches

from .errors import ConfigError

log = logging.getLogger(__name__)

Signature = tuple[tuple[int, int, int], ...]
# At start: a read that met a file half-way through a renewal is tried again this often, this long.
SETTLE_PAUSE_S = 0.05
SETTLE_FOR_S = 2.0


@dataclass(frozen=True, slots=True)
class WorkerTls:
    """The job's credential for mTLS to the checkpoint-store (PEM). Never logged: repr shows none of it.
    `files`: the (cert, key, ca) paths it was read from, when it came as files (the agent's way): the client
    reads them again when they change. None when it came as PEM, which cannot change."""

    cert_chain: bytes = field(repr=False)
    key: bytes = field(repr=False)
    ca: bytes = field(repr=False)
    files: tuple[str, str, str] | None = None

    @property
    def not_after(self) -> dt.datetime:
        return x509.load_pem_x509_certificates(self.cert_chain)[0].not_valid_after_utc

    @classmethod
    def parse(cls, cert: str, key: str, ca: str) -> WorkerTls:
        """Check the three values (ConfigError naming the variable, never its value). Each is PEM or the path
        of a PEM file (the agent gives paths; so does `trainyard local credential`)."""
        if not any(is_pem(v) for v in (cert, key, ca)):
            return read_files((cert, key, ca))
        return cls.check(_pem(CERT_ENV, cert).encode(), _pem(KEY_ENV, key).encode(), _pem(CA_ENV, ca).encode())

    @classmethod
    def check(cls, cert: bytes, key: bytes, ca: bytes, files: tuple[str, str, str] | None = None) -> WorkerTls:
        try:
            leaf = x509.load_pem_x509_certificates(cert)[0]
        except ValueError:
            raise ConfigError(f"{CERT_ENV} does not hold a PEM certificate") from None
        try:
            private = serialization.load_pem_private_key(key, password=None)
        except (ValueError, TypeError):
            raise ConfigError(f"{KEY_ENV} does not hold an unencrypted PEM private key") from None
        if not key_matches(leaf, private):
            raise KeyMismatch(f"{KEY_ENV} is not the key of the certificate in {CERT_ENV}")
        try:
            x509.load_pem_x509_certificates(ca)
        except ValueError:
            raise ConfigError(f"{CA_ENV} does not hold a PEM certificate") from None
        return cls(cert, key, ca, files)


class KeyMismatch(ConfigError):
    """The key is not the certificate's: a misconfiguration, or files read while they were being replaced."""


def _pem(name: str, value: str) -> str:
    if is_pem(value):
        return value
    try:
        return Path(value).read_text()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{name} is neither PEM nor a readable file: {exc}") from None


def signature(files: tuple[str, str, str]) -> Signature:
    out = []
    for path in files:
        st = os.stat(path)
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def read_files(files: tuple[str, str, str], *, settle_for_s: float | None = None) -> WorkerTls:
    """The credential in `files` (cert, key, ca); ConfigError naming the variable. A key that is not the
    certificate's is read again for up to `settle_for_s` (SETTLE_FOR_S: the agent may be replacing them)."""
    deadline = time.monotonic() + (SETTLE_FOR_S if settle_for_s is None else settle_for_s)
    while True:
        try:
            return _read(files)
        except KeyMismatch:
            if time.monotonic() >= deadline:
                raise
            time.sleep(SETTLE_PAUSE_S)


def _read(files: tuple[str, str, str]) -> WorkerTls:
    contents = []
    for name, path in zip((CERT_ENV, KEY_ENV, CA_ENV), files, strict=True):
        try:
            contents.append(Path(path).read_bytes())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{name} is neither PEM nor a readable file: {exc}") from None
    return WorkerTls.check(contents[0], contents[1], contents[2], files)


class CredentialSource:
    """The current credential of a client; `refresh()` re-reads it when its files changed. Thread-safe (the
    saver's writer threads share one service client)."""

    CHECK_EVERY_S = 1.0

    def __init__(self, tls: WorkerTls, *, check_every_s: float = CHECK_EVERY_S,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._tls = tls
        self._check_every_s = check_every_s
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._checked = monotonic()
        # Unknown: the files may have changed since `tls` was read from them, so the first look reads them.
        self._sig: Signature | None = None
        self.generation = 0

    @property
    def current(self) -> WorkerTls:
        return self._tls

    @property
    def reloads(self) -> bool:
        return self._tls.files is not None

    def refresh(self, *, now: bool = False) -> bool:
        """Re-read the files if they changed since the last read (at most every CHECK_EVERY_S unless `now`);
        True when the credential is a new one."""
        files = self._tls.files
        if files is None:
            return False
        with self._lock:
            mono = self._monotonic()
            if not now and mono - self._checked < self._check_every_s:
                return False
            self._checked = mono
            try:
                sig = signature(files)
            except OSError:
                return False  # removed (the attempt ended) or unreadable: keep what works
            if sig == self._sig:
                return False
            try:
                fresh = _read(files)
            except ConfigError as exc:
                # Mid-renewal (a new key beside the previous certificate), or not a credential: not taken; the
                # signature stays unread and the next call looks again, without waiting out the interval.
                log.debug("the checkpoint-store credential files are not usable yet: %s", exc.message)
                self._checked = mono - self._check_every_s
                return False
            self._sig = sig
            if (fresh.cert_chain, fresh.key, fresh.ca) == (self._tls.cert_chain, self._tls.key, self._tls.ca):
                return False
            self._tls = fresh
            self.generation += 1
        log.info("checkpoint-store credential files changed; using the new credential",
                 extra={"not_after": fresh.not_after.isoformat()})
        return True
