"""`trainyard local up`: the whole Trainyard on one machine — a real etcd, the scheduler, the
checkpoint-store, the gateway and simulated GPU nodes — each as its own process, logs under
.trainyard/logs/. Serves until Ctrl-C, then stops everything it started.

`LocalCluster` is also what the end-to-end tests and benchmarks start.

mTLS is on, as in production: a development CA and one certificate per principal (each service, each
simulated node, and `trainyard://tool/local` for tests and drills) are kept under <workdir>/pki/ (created
once, renewed when near expiry), with the job issuer the scheduler mints each job attempt's
checkpoint-store credential with, so workers reach the checkpoint-store over mTLS too.

etcd serves TLS only and requires client certificates, with auth on: the services log in as `trainyard`, the
CN of <workdir>/pki/etcd-user-trainyard.pem, whose role reads and writes /trainyard/ only; tests and drills
reach every key as `root` (etcd-user-root.pem, `etcd_options()`). No password exists anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio

from trainyard_core.files import atomic_write_bytes
from trainyard_core.rpc.server import CHANNEL_OPTIONS, secure_channel
from trainyard_core.security import identity, pki
from trainyard_core.security.identity import Principal
from trainyard_core.security.job_credentials import CA_ENV, CERT_ENV, KEY_ENV, JobCredential, JobIssuer
from trainyard_core.security.tls import ClientTls, target_name_option
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing.etcd import EtcdProcess, find_etcd, free_port, stop_cluster
from trainyard_core.testing.etcd_auth import ROOT
from trainyard_core.testing.netns import HostNetwork

from .local_etcd import ETCD_PREFIX, ETCD_USER, start_etcd

# Two nodes of one model, so a newcomer's first multi-node job (the minimal spec, one model per gang) runs,
# and one of another model, so heterogeneous placement is on show.
DEFAULT_NODES = (("node-1", "h100x8"), ("node-2", "h100x8"), ("node-3", "a100x4"))


@dataclass
class Proc:
    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    ready_path: Path
    popen: subprocess.Popen[bytes] | None = None
    ports: dict[str, int] = field(default_factory=dict)

    def start(self) -> None:
        self.ready_path.unlink(missing_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.popen = subprocess.Popen(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def wait_ready(self, timeout: float = 60.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.popen.returncode} while starting; "
                                   f"last lines of {self.log_path}:\n{tail(self.log_path)}")
            if self.ready_path.exists():
                self.ports = json.loads(self.ready_path.read_text())
                return self.ports
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} was not ready after {timeout}s; see {self.log_path}:\n{tail(self.log_path)}")

    def stop(self, timeout: float = 15.0) -> None:
        p = self.popen
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def kill(self) -> None:
        p = self.popen
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


class LocalCluster:
    def __init__(self, workdir: Path, *, gateway_port: int = 8080, nodes: Sequence[tuple[str, str]] = DEFAULT_NODES,
                 stop_grace_s: float = 5.0, node_timeout_s: float = 2.5, log_format: str = "json",
                 etcd_members: int = 1, schedulers: int = 1, heartbeat_interval_ms: int = 30_000,
                 tls: bool = True, netns: bool = False, control_plane_netns: bool = False,
                 trace_dir: Path | None = None) -> None:
        """`etcd_members` 1 (one member on 127.0.0.1) or 3 (127.0.0.1/.2/.3, a quorum that survives one
        loss); `schedulers` replicas (the first to win the election leads, the others stand by; agents
        and the gateway are given every replica's address). `tls=False` runs every service with
        insecure_plaintext (benchmarks compare the two). `netns=True` runs each node's agent and workers on a host
        of its own: a network namespace with one address on a bridge (trainyard_core.testing.netns, root only);
        the scheduler and checkpoint-store then listen on the bridge address, etcd stays on loopback.
        `control_plane_netns=True` (implies `netns`) gives each scheduler replica, the checkpoint-store and the
        gateway a host of its own too, and puts etcd on addresses of the bridge (the root namespace), so that
        the chaos suite can cut any of them from any other (tests/chaos/netfaults.py). `trace_dir`: every process
        appends its spans there (trace_exporter <trace_dir>/<name>.spans.jsonl); None: no spans recorded."""
        if etcd_members not in (1, 3):
            raise ValueError("etcd_members must be 1 or 3")
        if schedulers < 1:
            raise ValueError("schedulers must be at least 1")
        self.etcd_members = etcd_members
        self.scheduler_count = schedulers
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.etcd_cluster: list[EtcdProcess] = []
        self.scheduler_addresses: list[str] = []
        self.workdir = workdir.resolve()
        self.gateway_port = gateway_port
        self.nodes = list(nodes)
        self.stop_grace_s = stop_grace_s
        self.node_timeout_s = node_timeout_s
        self.log_format = log_format
        self.token = "ty_dev_" + secrets.token_urlsafe(24)
        self.etcd: EtcdProcess | None = None
        self.procs: dict[str, Proc] = {}
        self.url = ""
        self.scheduler_address = ""
        self.checkpoint_store_address = ""
        self.tls = tls
        self.pki_dir = self.workdir / "pki"
        self.tool = identity.tool("local")
        self.netns = netns or control_plane_netns
        self.control_plane_netns = control_plane_netns
        self.network: HostNetwork | None = None
        self.trace_dir = trace_dir.resolve() if trace_dir is not None else None

    def _principals(self) -> list[Principal]:
        return [identity.SCHEDULER, identity.GATEWAY, identity.CHECKPOINT_STORE, self.tool,
                *(identity.node(n) for n, _ in self.nodes)]

    def _tls(self, principal: Principal) -> dict[str, str]:
        if not self.tls:
            return {"insecure_plaintext": "true"}
        return pki.files_for(self.pki_dir, principal).settings()

    def _job_issuer(self) -> dict[str, str]:
        """The scheduler's job issuer settings (none without TLS: workers are then told the store is
        plaintext)."""
        if not self.tls:
            return {}
        cert, key = pki.job_issuer_files(self.pki_dir)
        return {"job_issuer_cert_file": str(cert), "job_issuer_key_file": str(key)}

    def write_job_credential(self, job_id: str, attempt: int, team: str) -> dict[str, str]:
        """`job_credential` written to <workdir>/credentials/ (0600); the client's variables naming the files."""
        cred = self.job_credential(job_id, attempt, team)
        directory = self.workdir / "credentials"
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        base = directory / f"{job_id}-{attempt}"
        key_path, cert_path = base.with_suffix(".key"), base.with_suffix(".pem")
        atomic_write_bytes(key_path, cred.key, mode=0o600)
        atomic_write_bytes(cert_path, cred.cert_chain)
        return {CERT_ENV: str(cert_path), KEY_ENV: str(key_path), CA_ENV: str(self.pki_dir / "ca.pem")}

    def job_credential(self, job_id: str, attempt: int, team: str) -> JobCredential:
        """A checkpoint-store credential for `job_id` minted with this cluster's job issuer, as the scheduler
        mints its workers' (for tests and drills that read a job's checkpoints as its workers do)."""
        cert, key = pki.job_issuer_files(self.pki_dir)
        issuer = JobIssuer(cert, key, self.pki_dir / "ca.pem", ttl_s=3600)
        return issuer.credential(job_id, attempt, team, dt.datetime.now(dt.UTC))

    def _etcd_settings(self) -> dict[str, str]:
        if not self.tls:
            return {"etcd_insecure_plaintext": "true"}
        files = pki.etcd_user_files(self.pki_dir, ETCD_USER)
        return {"etcd_prefix": ETCD_PREFIX, "etcd_ca_file": str(files.ca), "etcd_cert_file": str(files.cert),
                "etcd_key_file": str(files.key)}

    def etcd_options(self, user: str = ROOT) -> EtcdOptions:
        """How tests and drills reach this cluster's etcd: as `root` (every key) or as the services' user."""
        if not self.tls:
            return EtcdOptions(endpoints=self.etcd_endpoints)
        files = pki.etcd_user_files(self.pki_dir, user)
        return EtcdOptions(endpoints=self.etcd_endpoints, ca_file=files.ca, cert_file=files.cert, key_file=files.key)

    @property
    def tool_files(self) -> pki.CertFiles:
        """The certificate of `trainyard://tool/local`, for tests and drills that call services directly."""
        return pki.files_for(self.pki_dir, self.tool)

    def channel(self, address: str, expected: Principal) -> grpc.aio.Channel:
        """An mTLS channel as the local tool principal to the service at `address` that must be `expected`."""
        if not self.tls:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return secure_channel(address, ClientTls(self.tool_files), expected)

    def sync_channel(self, address: str, expected: Principal) -> grpc.Channel:
        """The same for synchronous gRPC code."""
        if not self.tls:
            return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        tls = ClientTls(self.tool_files)
        return grpc.secure_channel(address, tls.credentials(), options=[*CHANNEL_OPTIONS, target_name_option(expected)])

    def _proc(self, name: str, module: str, env_prefix: str, settings: dict[str, str]) -> Proc:
        logs = self.workdir / "logs"
        run = self.workdir / "run"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
        env.update({f"{env_prefix}{k.upper()}": v for k, v in settings.items()})
        env[f"{env_prefix}READY_FILE"] = str(run / f"{name}.ready")
        env[f"{env_prefix}LOG_FORMAT"] = self.log_format
        if self.trace_dir is not None:
            env[f"{env_prefix}TRACE_EXPORTER"] = str(self.trace_dir / f"{name}.spans.jsonl")
        env["PYTHONUNBUFFERED"] = "1"
        return Proc(name=name, args=[sys.executable, "-m", module], env=env, log_path=logs / f"{name}.log",
                    ready_path=run / f"{name}.ready")

    def start(self) -> None:
        """Start everything; if any part fails to come up, stop what did start and re-raise."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        find_etcd()
        for sub in ("logs", "run", "etcd", "checkpoints", "agents"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        if self.trace_dir is not None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
        pki.ensure(self.pki_dir, self._principals(), job_issuer=True)
        self.pki_dir.chmod(0o700)
        if self.netns:
            # The hosts first: in the control-plane mode etcd listens on the bridge.
            roots = self.etcd_members if self.control_plane_netns else 0
            self.network = HostNetwork(self._host_names(), root_addresses=roots).create()
        etcd_hosts = self.network.root_addresses if self.network is not None and self.control_plane_netns else []
        self.etcd_cluster = start_etcd(self.workdir, self.pki_dir, members=self.etcd_members, hosts=etcd_hosts,
                                       tls=self.tls)
        self.etcd = self.etcd_cluster[0]
        common = {"etcd_endpoints": self.etcd_endpoints, **self._etcd_settings()}

        # Where the nodes reach the control plane: loopback, the bridge when nodes are hosts of their own, or
        # each service's own host in the control-plane mode (address_of).
        host = self.address_of("checkpoint-store")
        ckpt_port = free_port()
        self.scheduler_addresses = [f"{self.address_of(name)}:{free_port()}" for name in self.scheduler_names]
        self.scheduler_address = ",".join(self.scheduler_addresses)
        self.checkpoint_store_address = f"{host}:{ckpt_port}"
        for i, address in enumerate(self.scheduler_addresses):
            name = "scheduler" if i == 0 else f"scheduler-{i + 1}"
            self.procs[name] = self._proc(name, "trainyard_scheduler.main", "TRAINYARD_SCHEDULER_", {
                **common, "listen_host": address.rsplit(":", 1)[0], "listen_port": address.rsplit(":", 1)[1],
                "advertise_address": address,
                "stop_grace_s": str(self.stop_grace_s), "node_timeout_s": str(self.node_timeout_s),
                "heartbeat_interval_ms": str(self.heartbeat_interval_ms), "reconcile_interval_s": "0.5",
                "checkpoint_store_address": self.checkpoint_store_address, **self._tls(identity.SCHEDULER),
                # The embedded history store: every replica on this machine opens the same SQLite file.
                "history_url": f"sqlite+aiosqlite:///{self.workdir / 'history.db'}",
                **self._job_issuer()})
        self.procs["checkpoint-store"] = self._proc(
            "checkpoint-store", "trainyard_checkpoint.main", "TRAINYARD_CHECKPOINT_STORE_",
            {**common, "listen_host": host, "listen_port": str(ckpt_port),
             "storage_url": (self.workdir / "checkpoints").as_uri(),
             # The local tool reads the checkpoints of the bootstrap token's jobs (its team is "admin").
             "tool_teams": f"{self.tool.name}:admin", **self._tls(identity.CHECKPOINT_STORE)})
        gw_port = self.gateway_port
        if gw_port and not self.control_plane_netns and not port_free("127.0.0.1", gw_port):
            print(f"port {gw_port} is in use; the gateway takes a free port instead", file=sys.stderr)
            gw_port = 0
        gw = self._proc("gateway", "trainyard_gateway.main", "TRAINYARD_GATEWAY_", {
            **common, "http_port": str(gw_port), "grpc_port": "0", "scheduler_address": self.scheduler_address,
            "checkpoint_store_address": self.checkpoint_store_address, **self._tls(identity.GATEWAY)})
        # The one place a bootstrap token exists: an operator token for the developer (production creates its
        # first token with `python -m trainyard_gateway.tokens_admin`). The rate limit per token stays on, far
        # above what a sandbox sends (the benchmarks poll a job every 5 ms with this token).
        gw.env["TRAINYARD_GATEWAY_BOOTSTRAP_ADMIN_TOKEN"] = self.token
        gw.env["TRAINYARD_GATEWAY_RATE_LIMIT_PER_S"] = "1000"
        gw.env["TRAINYARD_GATEWAY_RATE_LIMIT_BURST"] = "2000"
        self.procs["gateway"] = gw
        if self.control_plane_netns and self.network is not None:
            gw.env["TRAINYARD_GATEWAY_HTTP_HOST"] = gw.env["TRAINYARD_GATEWAY_GRPC_HOST"] = self.address_of("gateway")
            for name in (*self.scheduler_names, "checkpoint-store", "gateway"):
                self.procs[name].args = [*self.network.exec_prefix(name), *self.procs[name].args]
        for node_id, profile in self.nodes:
            self.procs[node_id] = self._agent_proc(node_id, profile)

        for name in (*self.scheduler_names, "checkpoint-store", "gateway", *[n for n, _ in self.nodes]):
            self.procs[name].start()
        for proc in self.procs.values():
            proc.wait_ready()
        self.url = f"http://{self.address_of('gateway')}:{self.procs['gateway'].ports['http_port']}"

    def _host_names(self) -> list[str]:
        """Who gets a host of its own: the nodes, and in the control-plane mode every service but etcd."""
        services = [*self.scheduler_names, "checkpoint-store", "gateway"] if self.control_plane_netns else []
        return [*(n for n, _ in self.nodes), *services]

    def address_of(self, name: str) -> str:
        """The address the process `name` (a node's agent, or a service) listens on."""
        if self.network is None:
            return "127.0.0.1"
        if name in self.network.hosts:
            return self.network.hosts[name].address
        # Only the nodes have hosts of their own: the control plane listens on the bridge, the gateway on loopback.
        return "127.0.0.1" if name == "gateway" else self.network.bridge_address

    @property
    def etcd_endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.etcd_cluster)

    @property
    def scheduler_names(self) -> list[str]:
        return ["scheduler" if i == 0 else f"scheduler-{i + 1}" for i in range(self.scheduler_count)]

    def _agent_proc(self, node_id: str, profile: str) -> Proc:
        proc = self._proc(node_id, "trainyard_agent.main", "TRAINYARD_AGENT_", {
            "node_id": node_id, "gpu_profile": profile, "scheduler_address": self.scheduler_address,
            "listen_port": "0", "state_dir": str(self.workdir / "agents" / node_id),
            "worker_env": "GLOO_SOCKET_IFNAME=lo", "stop_grace_s": str(self.stop_grace_s),
            "kill_workers_on_stop": "true", "labels": "rack=local,switch=leaf-1,spine=spine-1",
            # One person's development cluster: every team's workers run as that person, the agent's user
            # (separating teams needs root and a run_as mapping; docs/security.md, Tenants on the hosts).
            "single_tenant": "true",
            **self._tls(identity.node(node_id))})
        # Workers find `python` (with torch) in the environment Trainyard runs from, as on a real host
        # whose image carries the training environment.
        proc.env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), proc.env.get("PATH", "")])
        if self.network is not None:
            # Its own host: the agent listens on the namespace's address, gloo goes over its one interface.
            address = self.network.hosts[node_id].address
            proc.env["TRAINYARD_AGENT_LISTEN_HOST"] = address
            proc.env["TRAINYARD_AGENT_WORKER_ENV"] = "GLOO_SOCKET_IFNAME=eth0"
            proc.args = [*self.network.exec_prefix(node_id), *proc.args]
        return proc

    def restart(self, name: str, *, kill: bool = False) -> None:
        """Stop (SIGTERM, or SIGKILL with kill=True) and start one service again, same settings and ports."""
        proc = self.procs[name]
        proc.kill() if kill else proc.stop()
        proc.start()
        proc.wait_ready()

    def kill_node(self, node_id: str) -> list[int]:
        """Simulate the death of a host: SIGKILL its agent and every worker (and worker shim) the agent's
        records name, each by process group. Returns the pids of the workers killed."""
        self.procs[node_id].kill()
        killed = []
        for path in (self.workdir / "agents" / node_id).glob("jobs/*/attempt-*/workers.json"):
            try:
                workers = json.loads(path.read_text()).get("workers", [])
            except (OSError, ValueError):
                continue
            for w in workers:
                for pgid in {w.get("pgid"), w.get("shim_pid")} - {None}:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(int(pgid), signal.SIGKILL)
                if w.get("exit_code") is None and w.get("signal") is None:
                    killed.append(int(w["pid"]))
        return killed

    def stop(self) -> None:
        order = [n for n, _ in self.nodes] + ["gateway", "checkpoint-store", *self.scheduler_names]
        for name in order:
            if name in self.procs:
                self.procs[name].stop()
        if len(self.etcd_cluster) > 1:
            stop_cluster(self.etcd_cluster)
        elif self.etcd is not None:
            self.etcd.kill()
        if self.network is not None:
            self.network.close()
            self.network = None

    def write_env_file(self) -> Path:
        path = self.workdir / "local.env"
        path.write_text(f"TRAINYARD_URL={self.url}\nTRAINYARD_TOKEN={self.token}\n"
                        f"TRAINYARD_CHECKPOINT_STORE={self.checkpoint_store_address}\n")
        path.chmod(0o600)
        return path


@contextlib.contextmanager
def single_instance(workdir: Path) -> Iterator[None]:
    workdir.mkdir(parents=True, exist_ok=True)
    lock_path = workdir / "run.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip()
        os.close(fd)
        raise SystemExit(f"a local Trainyard cluster is already running from {workdir} ({holder}).\n"
                         "Use it (source .trainyard/local.env), or stop it with Ctrl-C in its terminal.") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}".encode())
    try:
        yield
    finally:
        os.close(fd)


def up(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir)
    nodes = [tuple(n.split("=", 1)) for n in args.node] if args.node else list(DEFAULT_NODES)
    with single_instance(workdir):
        cluster = LocalCluster(workdir, gateway_port=args.port, nodes=nodes)
        stop = False

        def on_signal(signum: int, frame: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        try:
            print("starting etcd, scheduler, checkpoint-store, gateway and "
                  f"{len(nodes)} simulated node(s): {', '.join(f'{n} ({p})' for n, p in nodes)} ...", flush=True)
            cluster.start()
            env_file = cluster.write_env_file()
            print(f"\nTrainyard is up.\n  gateway:  {cluster.url}\n  token:    {cluster.token} (operator)\n"
                  f"  checkpoint-store: {cluster.checkpoint_store_address}\n"
                  f"  logs:     {workdir / 'logs'}/\n  env file: {env_file}\n\n"
                  "In another terminal:\n  source .trainyard/local.env\n  .venv/bin/trainyard nodes\n\n"
                  "Press Ctrl-C to stop everything.", flush=True)
            while not stop:
                for name, proc in cluster.procs.items():
                    if proc.popen is not None and proc.popen.poll() is not None:
                        print(f"{name} exited with code {proc.popen.returncode}; see {proc.log_path}", flush=True)
                        stop = True
                time.sleep(0.5)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        finally:
            print("\nstopping ...", flush=True)
            cluster.stop()
            (workdir / "local.env").unlink(missing_ok=True)
            print("stopped.", flush=True)
    return 0


def credential(args: argparse.Namespace) -> int:
    """Mint a checkpoint-store credential for a job with the local cluster's job issuer, as the scheduler does
    for its workers, for a training script run by hand; print the variables that point the client at it."""
    workdir = Path(args.workdir)
    cluster = LocalCluster(workdir)
    if not pki.job_issuer_files(cluster.pki_dir)[0].exists():
        print(f"error: no job issuer under {cluster.pki_dir}: start the local cluster once (make run)", file=sys.stderr)
        return 1
    try:
        paths = cluster.write_job_credential(args.job_id, args.attempt, args.team)
    except (ValueError, OSError) as exc:  # an id that is no job id, an unreadable issuer
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, value in paths.items():
        print(f"export {name}={value}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    local = subparsers.add_parser("local", help="run a whole Trainyard cluster on this machine")
    sub = local.add_subparsers(dest="local_command", required=True)
    p = sub.add_parser("up", help="start etcd, all services and simulated nodes; serve until Ctrl-C")
    p.add_argument("--workdir", default=".trainyard", help="state, logs and local.env (default .trainyard)")
    p.add_argument("--port", type=int, default=8080, help="gateway HTTP port (default 8080; busy → a free one)")
    p.add_argument("--node", action="append", metavar="NAME=PROFILE",
                   help="a simulated node, e.g. node-1=h100x8 (repeatable; default "
                        "node-1=h100x8 node-2=h100x8 node-3=a100x4)")
    p.set_defaults(func=up)
    c = sub.add_parser("credential", help="a checkpoint-store credential for a job, for a training script run by "
                       "hand against the local cluster (prints export lines: eval \"$(trainyard local credential "
                       "JOB_ID)\")")
    c.add_argument("job_id", metavar="JOB_ID", help="the job id the script checkpoints as (TRAINYARD_JOB_ID)")
    c.add_argument("--attempt", type=int, default=0, help="the attempt (TRAINYARD_ATTEMPT; default 0)")
    c.add_argument("--team", default="admin", help="the job's team (default admin, the bootstrap token's)")
    c.add_argument("--workdir", default=".trainyard", help="the local cluster's directory (default .trainyard)")
    c.set_defaults(func=credential)
