"""`trainyard local credential JOB_ID`: a job's checkpoint-store credential from the local cluster's job issuer,
for a script run by hand, written 0600 and read by the checkpoint client from the paths it prints."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from cryptography import x509

from trainyard_checkpoint.client.env import ClientSettings
from trainyard_cli.local import credential
from trainyard_core.security import identity, job_credentials, pki


def _args(workdir: Path, job_id: str, **kw: object) -> argparse.Namespace:
    return argparse.Namespace(job_id=job_id, attempt=kw.get("attempt", 0), team=kw.get("team", "admin"),
                              workdir=str(workdir))


def test_the_printed_variables_point_the_client_at_the_minted_credential(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pki.ensure(tmp_path / "pki", [], job_issuer=True)
    assert credential(_args(tmp_path, "job-demo", attempt=2, team="ml")) == 0
    exports = dict(line.removeprefix("export ").split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert set(exports) == {job_credentials.CERT_ENV, job_credentials.KEY_ENV, job_credentials.CA_ENV}
    assert oct(os.stat(exports[job_credentials.KEY_ENV]).st_mode & 0o777) == "0o600"
    settings = ClientSettings.from_env({"TRAINYARD_CHECKPOINT_STORE": "127.0.0.1:1", "TRAINYARD_JOB_ID": "job-demo",
                                        "TRAINYARD_ATTEMPT": "2", **exports})
    assert settings.tls is not None and not settings.insecure_plaintext
    leaf = x509.load_pem_x509_certificates(settings.tls.cert_chain)[0]
    assert job_credentials.grant_of(leaf, identity.job("job-demo")) == job_credentials.JobGrant("job-demo", 2, "ml")
    assert "BEGIN" not in repr(settings), "the settings' repr shows no key or certificate"


def test_it_says_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert credential(_args(tmp_path, "job-demo")) == 1
    assert "no job issuer" in capsys.readouterr().err
    pki.ensure(tmp_path / "pki", [], job_issuer=True)
    assert credential(_args(tmp_path, "Not A Job")) == 2
    assert "job principal needs a name of 3-63" in capsys.readouterr().err


def test_the_client_needs_a_credential_or_plaintext_said_out_loud(tmp_path: Path) -> None:
    from trainyard_checkpoint.client.errors import ConfigError

    base = {"TRAINYARD_CHECKPOINT_STORE": "127.0.0.1:1", "TRAINYARD_JOB_ID": "job-demo"}
    with pytest.raises(ConfigError, match="no checkpoint-store credential"):
        ClientSettings.from_env(base)
    with pytest.raises(ConfigError, match="TRAINYARD_CHECKPOINT_KEY, TRAINYARD_CHECKPOINT_CA not set"):
        ClientSettings.from_env({**base, job_credentials.CERT_ENV: "x"})
    with pytest.raises(ConfigError, match="exclude each other"):
        ClientSettings.from_env({**base, job_credentials.PLAINTEXT_ENV: "1", job_credentials.CERT_ENV: "x"})
    with pytest.raises(ConfigError, match="TRAINYARD_CHECKPOINT_CERT is neither PEM nor a readable file"):
        ClientSettings.from_env({**base, job_credentials.CERT_ENV: str(tmp_path / "none"),
                                 job_credentials.KEY_ENV: "k", job_credentials.CA_ENV: "c"})
    assert ClientSettings.from_env({**base, job_credentials.PLAINTEXT_ENV: "1"}).insecure_plaintext
