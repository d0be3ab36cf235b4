"""Turn on etcd's own authentication for Trainyard: what an operator does with etcdctl (docs/security.md,
"etcd"), done through etcd's Auth API for the test fixtures and the local cluster.

`enable_auth` creates the `root` user with the `root` role, a role that may read and write the Trainyard
prefix and nothing else, one user per entry of `users` holding that role (with a password, or none: such a
user logs in with a client certificate whose CN is its name, under etcd's --client-cert-auth), and then
enables auth. It is idempotent: run against an etcd whose auth is already on, it connects as root (the
`admin` client certificate, CN `root`) and puts back whatever is missing.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc
from aetcd import rpc

from ..security.pki import CertFiles
from ..store.api import prefix_end

ROOT = "root"
# What etcd answers, in its own words, when a step was done before (idempotent re-runs).
_DONE_BEFORE = ("already exists", "already granted", "role is already granted")


def role_name(user: str) -> str:
    """The role of a Trainyard etcd user: `<user>-rw`, read/write on the prefix only."""
    return f"{user}-rw"


def _once(call: object, request: object) -> None:
    try:
        call(request, timeout=10)  # type: ignore[operator]
    except grpc.RpcError as exc:
        details = exc.details() or ""
        if not any(s in details for s in _DONE_BEFORE):
            raise


def enable_auth(endpoint: str, admin: CertFiles, prefix: str, users: Mapping[str, str | None]) -> None:
    """Users (name → password, or None for certificate-only login) that may read and write keys under
    `prefix` only; `root`; then auth on. `admin` is a client certificate whose CN is `root`."""
    creds = grpc.ssl_channel_credentials(root_certificates=admin.ca.read_bytes(),
                                         private_key=admin.key.read_bytes(),
                                         certificate_chain=admin.cert.read_bytes())
    with grpc.secure_channel(endpoint, creds) as channel:
        auth = rpc.AuthStub(channel)
        _once(auth.UserAdd, rpc.AuthUserAddRequest(name=ROOT, options=rpc.auth_pb2.UserAddOptions(no_password=True)))
        _once(auth.RoleAdd, rpc.AuthRoleAddRequest(name=ROOT))
        _once(auth.UserGrantRole, rpc.AuthUserGrantRoleRequest(user=ROOT, role=ROOT))
        for user, password in users.items():
            role = role_name(user)
            _once(auth.RoleAdd, rpc.AuthRoleAddRequest(name=role))
            perm = rpc.auth_pb2.Permission(permType=rpc.auth_pb2.Permission.READWRITE, key=prefix.encode(),
                                           range_end=prefix_end(prefix).encode())
            _once(auth.RoleGrantPermission, rpc.AuthRoleGrantPermissionRequest(name=role, perm=perm))
            if password is None:
                add = rpc.AuthUserAddRequest(name=user, options=rpc.auth_pb2.UserAddOptions(no_password=True))
            else:
                add = rpc.AuthUserAddRequest(name=user, password=password)
            _once(auth.UserAdd, add)
            if password is not None:
                # A re-run with a new password (the local cluster's file was replaced) takes it.
                auth.UserChangePassword(rpc.AuthUserChangePasswordRequest(name=user, password=password), timeout=10)
            _once(auth.UserGrantRole, rpc.AuthUserGrantRoleRequest(user=user, role=role))
        auth.AuthEnable(rpc.AuthEnableRequest(), timeout=10)
