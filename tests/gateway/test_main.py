"""The `trainyard-gateway` process: settings errors, ready file, serving, clean exit on SIGTERM, no secret
in its output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from trainyard_core import gc_tuning
from trainyard_core.security import identity, pki
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.etcd_secure import as_flags
from trainyard_gateway.main import main
from trainyard_gateway.tokens import new_secret

GATEWAY = str(Path(sys.executable).parent / "trainyard-gateway")


def test_bad_settings_exit_2_without_echoing_the_secret(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_GATEWAY_BOOTSTRAP_ADMIN_TOKEN", "hunter2-not-a-token")
    assert main(["--http-port", "0"]) == 2
    err = capsys.readouterr().err
    assert "bootstrap_admin_token" in err and "hunter2" not in err
    monkeypatch.delenv("TRAINYARD_GATEWAY_BOOTSTRAP_ADMIN_TOKEN")
    assert main(["--http-port", "-3"]) == 2
    assert "http_port" in capsys.readouterr().err


def _wait_for_file(path: Path, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return dict(json.loads(path.read_text()))
        if proc.poll() is not None:
            raise AssertionError(f"gateway exited with {proc.returncode}: {proc.stderr.read().decode()}")  # type: ignore[union-attr]
        time.sleep(0.05)
    raise AssertionError(f"no ready file at {path} after {timeout}s")


def _tls(tmp_path: Path) -> list[str]:
    """The gateway's own certificate, as production runs it (mTLS on its gRPC server and clients)."""
    files = pki.ensure(tmp_path / "pki", [identity.GATEWAY])[identity.GATEWAY]
    return ["--tls-cert-file", str(files.cert), "--tls-key-file", str(files.key), "--tls-ca-file", str(files.ca)]


def test_a_process_without_certificates_or_insecure_plaintext_refuses_to_start(etcd_settings: dict[str, str]) -> None:
    proc = subprocess.run([GATEWAY, "--http-port", "0", "--grpc-port", "0", *as_flags(etcd_settings)],
                          env={**os.environ, "TRAINYARD_GATEWAY_BOOTSTRAP_ADMIN_TOKEN": new_secret()},
                          capture_output=True, timeout=60)
    assert proc.returncode == 2
    assert "tls_cert_file" in proc.stderr.decode() and "insecure_plaintext" in proc.stderr.decode()


def test_a_certificate_of_another_principal_is_refused_at_start(tmp_path: Path, etcd_settings: dict[str, str]) -> None:
    files = pki.ensure(tmp_path / "pki", [identity.SCHEDULER])[identity.SCHEDULER]
    proc = subprocess.run([GATEWAY, "--http-port", "0", "--grpc-port", "0", *as_flags(etcd_settings),
                           "--tls-cert-file", str(files.cert), "--tls-key-file", str(files.key),
                           "--tls-ca-file", str(files.ca)],
                          env={**os.environ, "TRAINYARD_GATEWAY_BOOTSTRAP_ADMIN_TOKEN": new_secret()},
                          capture_output=True, timeout=60)
    assert proc.returncode == 2
    assert "names trainyard://scheduler, but this service is trainyard://gateway" in proc.stderr.decode()


def test_process_serves_and_stops_on_sigterm(tmp_path: Path, etcd_settings: dict[str, str], key_prefix: str) -> None:
    secret = new_secret()
    ready = tmp_path / "ready.json"
    env = {**os.environ, "TRAINYARD_GATEWAY_BOOTSTRAP_ADMIN_TOKEN": secret}
    proc = subprocess.Popen(
        [GATEWAY, "--http-port", "0", "--grpc-port", "0", "--ready-file", str(ready),
         *as_flags(etcd_settings), "--etcd-prefix", key_prefix.rstrip("/"),
         "--scheduler-address", f"127.0.0.1:{free_port()}", *_tls(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ports = _wait_for_file(ready, proc)
        assert ports["http_port"] > 0 and ports["grpc_port"] > 0
        url = f"http://127.0.0.1:{ports['http_port']}"
        assert httpx.get(f"{url}/healthz").status_code == 503  # no scheduler behind it
        reply = httpx.get(f"{url}/v1/nodes", headers={"Authorization": f"Bearer {secret}"})
        assert reply.status_code == 503  # authenticated with the bootstrap token
        assert httpx.get(f"{url}/v1/nodes").status_code == 401
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    text = (out + err).decode()
    assert secret not in text
    assert "Traceback" not in text
    assert "/v1/nodes" in text  # the access log ran, with no token in it
    lines = [json.loads(t) for t in err.decode().splitlines() if t.startswith("{")]
    [tuned] = [line for line in lines if line["msg"] == "garbage collector tuned"]
    assert tuned["gc_thresholds"] == list(gc_tuning.THRESHOLDS)
    assert tuned["gc_frozen_objects"] > 10_000  # the start-up heap: modules, routes, models


def test_unreachable_etcd_is_a_clean_start_failure(tmp_path: Path) -> None:
    env = {**os.environ, "TRAINYARD_GATEWAY_BOOTSTRAP_ADMIN_TOKEN": new_secret()}
    proc = subprocess.run(
        [GATEWAY, "--http-port", "0", "--grpc-port", "0", "--etcd-endpoints", f"127.0.0.1:{free_port()}",
         "--etcd-insecure-plaintext", *_tls(tmp_path)],
        env=env, capture_output=True, timeout=60)
    assert proc.returncode == 1
    err = proc.stderr.decode()
    assert "etcd" in err and "Traceback" not in err
