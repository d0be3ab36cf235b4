"""What each launch adds to its workers' environment for the checkpoint-store: the attempt's credential.

With `job_issuer_cert_file`/`job_issuer_key_file` set, every attempt gets a certificate for
`trainyard://job/<job_id>` naming the attempt and the job's team (`trainyard_core.security.job_credentials`),
minted when the attempt is first launched and shared by all its nodes, good for `job_credential_ttl_s`.
Without an issuer, workers get no credential and cannot reach a checkpoint-store that serves mTLS; a
scheduler running `insecure_plaintext` tells them instead that the store is plaintext. Without a
checkpoint-store (`checkpoint_store_address` empty) workers get neither.

The credential is added to the LaunchWorkers request only (`reconcile.Reconciler._launch`): it is never
written to etcd and never logged.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from pathlib import Path

from trainyard_core.security.job_credentials import PLAINTEXT_ENV, JobIssuer, JobIssuerError
from trainyard_core.settings import SettingsError

from .settings import SchedulerSettings


class WorkerCredentials:
    def __init__(self, issuer: JobIssuer | None, *, plaintext: bool, store: bool = True,
                 now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)) -> None:
        self._issuer = issuer
        self._plaintext = plaintext
        self._store = store
        self._now = now

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
        return self._issuer is not None

    def env(self, job_id: str, attempt: int, team: str) -> Mapping[str, str]:
        if not self._store:
            return {}
        if self._issuer is not None:
            return self._issuer.credential(job_id, attempt, team, self._now()).env()
        if self._plaintext:
            return {PLAINTEXT_ENV: "1"}
        return {}
