"""Start a real etcd (the Debian `etcd-server` package) on free loopback ports, data on tmpfs.

Used by the test fixtures, the benchmarks and the local cluster. Short raft timers make elections fast.

With `tls` (etcd's server certificate, e.g. `pki.ensure_etcd`), a member serves its clients over TLS only,
requires a client certificate signed by the CA (`--client-cert-auth`), and advertises https URLs; peer
traffic stays plaintext on loopback. `etcd_auth.enable_auth` then turns on etcd's users and roles.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..security.pki import CertFiles

ETCD_MISSING = (
    "etcd is not installed. On Debian/Ubuntu run: sudo apt-get install -y etcd-server "
    "(`make run` and `make test` do it when run as root)."
)

# What the local and test clusters run etcd with (docs/operations.md asks the same of production):
# the largest gang the API admits, contract.MAX_NODES, needs MAX_NODES + 3 operations in one transaction.
MAX_TXN_OPS = 4200
MAX_REQUEST_BYTES = 10 * 1024 * 1024
# History older than this is compacted away (docs/operations.md, "etcd space"): Trainyard's watchers reload from
# a fresh read after any broken watch, so they need seconds of history, and a time window bounds it whatever the
# write rate. `extra_args` may override it (a later flag wins).
AUTO_COMPACTION = ("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "5m")


def find_etcd() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if not path:
        raise RuntimeError(ETCD_MISSING)
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now whose UDP port of the same number is free too: a scheduler listens for liveness
    pulses on its gRPC port's number over UDP, and an agent's pulses leave from ephemeral UDP ports that a
    TCP-only check does not see."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                try:
                    u.bind((host, port))
                except OSError:
                    continue
            return port


def _tmp_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else \
        tempfile.gettempdir()


@dataclass
class EtcdProcess:
    name: str
    host: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    extra_args: list[str] = field(default_factory=list)
    tls: CertFiles | None = None  # etcd's server certificate and the CA its clients' certificates chain to
    admin: CertFiles | None = None  # the client certificate tools use (CN root once auth is on)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls is not None else 'http'}://{self.endpoint}"

    def etcdctl_tls(self) -> list[str]:
        """etcdctl's flags to reach this member as `admin` ([] for a plaintext member)."""
        if self.tls is None or self.admin is None:
            return []
        return ["--cacert", str(self.tls.ca), "--cert", str(self.admin.cert), "--key", str(self.admin.key)]

    def _tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        return ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key),
                "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]

    def start(self, initial_cluster: str | None = None, state: str = "new") -> None:
        cluster = initial_cluster or f"{self.name}=http://{self.host}:{self.peer_port}"
        scheme = "https" if self.tls is not None else "http"
        args = [
            find_etcd(), "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", f"{scheme}://{self.host}:{self.client_port}",
            "--advertise-client-urls", f"{scheme}://{self.host}:{self.client_port}", *self._tls_args(),
            "--listen-peer-urls", f"http://{self.host}:{self.peer_port}",
            "--initial-advertise-peer-urls", f"http://{self.host}:{self.peer_port}",
            "--initial-cluster", cluster, "--initial-cluster-state", state,
            "--heartbeat-interval", "10", "--election-timeout", "100",
            # A gang's placement is one transaction of nodes + 3 operations (the scheduler probes the limit
            # and refuses larger gangs at submit): room for the API's largest gang, as production configures.
            "--max-txn-ops", str(MAX_TXN_OPS), "--max-request-bytes", str(MAX_REQUEST_BYTES), *AUTO_COMPACTION,
            "--log-level", "warn", *self.extra_args,
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}:\n"
                                   + self.log_path.read_text()[-2000:])
            try:
                with socket.create_connection((self.host, self.client_port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"etcd did not listen on {self.endpoint} within {timeout}s; see {self.log_path}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_single(workdir: Path | None = None, host: str = "127.0.0.1", *, tls: CertFiles | None = None,
                 extra_args: Sequence[str] = ()) -> EtcdProcess:
    """One etcd member on free ports; data directory on tmpfs unless `workdir` is given."""
    base = Path(tempfile.mkdtemp(prefix="trainyard-etcd-", dir=str(workdir) if workdir else _tmp_root()))
    member = EtcdProcess(name="default", host=host, client_port=free_port(host), peer_port=free_port(host),
                         data_dir=base / "data", log_path=base / "etcd.log", tls=tls, extra_args=list(extra_args))
    member.start()
    member.wait_ready()
    return member


def start_cluster(size: int = 3, workdir: Path | None = None, *, tls: CertFiles | None = None,
                  admin: CertFiles | None = None, hosts: Sequence[str] | None = None,
                  log_dir: Path | None = None) -> list[EtcdProcess]:
    """`size` etcd members forming one cluster, member i on 127.0.0.(i+1) (the whole 127/8 is loopback
    on Linux) or on `hosts[i]`, each on free ports; data directories on tmpfs unless `workdir` is given, logs
    beside them unless `log_dir` is (etcd-m<i>.log there). Returns once every member listens; the cluster has
    a leader shortly after (short raft timers)."""
    base = Path(tempfile.mkdtemp(prefix="trainyard-etcd-cluster-", dir=str(workdir) if workdir else _tmp_root()))
    chosen = list(hosts) if hosts is not None else [f"127.0.0.{i + 1}" for i in range(size)]
    members = []
    for i, host in enumerate(chosen):
        log_path = log_dir / f"etcd-m{i + 1}.log" if log_dir is not None else base / f"m{i + 1}.log"
        members.append(EtcdProcess(name=f"m{i + 1}", host=host, client_port=free_port(host),
                                   peer_port=free_port(host), data_dir=base / f"m{i + 1}" / "data",
                                   log_path=log_path, tls=tls, admin=admin))
    for m in members:
        m.data_dir.parent.mkdir(parents=True, exist_ok=True)
    initial = ",".join(f"{m.name}=http://{m.host}:{m.peer_port}" for m in members)
    try:
        for m in members:
            m.start(initial_cluster=initial)
        for m in members:
            m.wait_ready()
    except BaseException:
        stop_cluster(members)
        raise
    return members


def endpoints(members: list[EtcdProcess]) -> str:
    """The client endpoints of a cluster, comma-separated, as the services' etcd_endpoints setting takes them."""
    return ",".join(m.endpoint for m in members)


def restart(member: EtcdProcess, members: list[EtcdProcess]) -> None:
    """Start a killed member again with its data (it rejoins the cluster it was part of)."""
    initial = ",".join(f"{m.name}=http://{m.host}:{m.peer_port}" for m in members)
    member.start(initial_cluster=initial, state="existing")
    member.wait_ready()


def stop_cluster(members: list[EtcdProcess]) -> None:
    for m in members:
        m.kill()
    if members:
        shutil.rmtree(members[0].data_dir.parent.parent, ignore_errors=True)


def stop_and_clean(member: EtcdProcess) -> None:
    member.kill()
    shutil.rmtree(member.data_dir.parent, ignore_errors=True)
