"""The local cluster's etcd, as production runs it (docs/security.md, etcd): TLS only, client certificates
required, auth on, the services logging in as the CN of their etcd client certificate (`ETCD_USER`), whose role
has the prefix only; tests and drills reach every key as `root`. One member on loopback, three (a quorum that
survives one loss) on 127.0.0.1/.2/.3, or one member on each address of the root namespace's bridge when the
control plane has hosts of its own (`hosts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from trainyard_core.security import pki
from trainyard_core.testing.etcd import EtcdProcess, free_port, start_cluster
from trainyard_core.testing.etcd_auth import ROOT, enable_auth

# The etcd user every service of the local cluster logs in as (its client certificate's CN), and the prefix
# its role may read and write.
ETCD_USER = "trainyard"
ETCD_PREFIX = "/trainyard"


def start_etcd(workdir: Path, pki_dir: Path, *, members: int, hosts: Sequence[str], tls: bool) -> list[EtcdProcess]:
    """Start the members (logs under <workdir>/logs, data under <workdir>/etcd) and, with `tls`, turn auth on;
    the first member is the one `members == 1` means. `hosts`: the bridge addresses to listen on, or none."""
    etcd_tls, etcd_admin = None, None
    if tls:
        etcd_tls, users = pki.ensure_etcd(pki_dir, [ROOT, ETCD_USER], server_ips=(*pki.ETCD_SERVER_IPS, *hosts))
        etcd_admin = users[ROOT]
    if members == 1:
        host = hosts[0] if hosts else "127.0.0.1"
        etcd = EtcdProcess(name="local", host=host, client_port=free_port(host), peer_port=free_port(host),
                           data_dir=workdir / "etcd" / "data", log_path=workdir / "logs" / "etcd.log", tls=etcd_tls,
                           admin=etcd_admin)
        etcd.start()
        etcd.wait_ready()
        cluster = [etcd]
    elif hosts:
        cluster = start_cluster(len(hosts), workdir=workdir / "etcd", tls=etcd_tls, admin=etcd_admin, hosts=hosts,
                                log_dir=workdir / "logs")
    else:
        cluster = start_cluster(members, workdir=workdir / "etcd", tls=etcd_tls, admin=etcd_admin)
    if etcd_admin is not None:
        enable_auth(cluster[0].endpoint, etcd_admin, ETCD_PREFIX + "/", {ETCD_USER: None})
    return cluster
