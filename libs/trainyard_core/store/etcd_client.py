"""aetcd's client on a TLS channel, with etcd's auth tokens renewed, and what etcd's refusals mean.

aetcd's `Client.connect` always opens an insecure channel and logs in once; `Client` here opens the channel
with the TLS credentials of `EtcdOptions` (or plaintext when there are none) and builds the same stubs, so
the rest of aetcd and `EtcdStore` work unchanged. Calls read `client.metadata` when they are made, so a
renewed token is used by the next call on the same channel.

etcd's simple tokens live `--auth-token-ttl` seconds (300 by default) after their last use and none survive
a member's restart; a call with such a token is answered "etcdserver: invalid auth token", and a change of
users or roles answers "etcdserver: revision of auth store is old". Both are refusals before anything is
applied, so `EtcdStore` logs in again and makes the call once more (`is_stale_token`, `Client.renew_token`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import aetcd
import aetcd.exceptions
import grpc
import grpc.aio
from aetcd import rpc, watcher
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ..errors import PermissionDenied, StoreOutOfSpace, Unavailable
from .etcd_options import EtcdOptions

log = logging.getLogger(__name__)

_STALE_TOKEN = ("invalid auth token", "revision of auth store is old")
_NO_SPACE = "database space exceeded"


def _text(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.details() or ""
    return str(exc)


def is_stale_token(exc: BaseException) -> bool:
    """etcd refused the call's token (expired, from before a restart, or from before an auth change)."""
    return isinstance(exc, grpc.aio.AioRpcError | aetcd.exceptions.ClientError | WatchRefused) and \
        any(s in _text(exc) for s in _STALE_TOKEN)


def is_permission_denied(exc: BaseException) -> bool:
    if isinstance(exc, grpc.aio.AioRpcError):
        return bool(exc.code() == grpc.StatusCode.PERMISSION_DENIED)
    return isinstance(exc, aetcd.exceptions.ClientError) and "permission denied" in str(exc)


def is_no_space(exc: BaseException) -> bool:
    """etcd's NOSPACE refusal (`ErrGRPCNoSpace`): its database reached `--quota-backend-bytes`. etcd answers it
    before applying anything, to puts, transactions that write and lease grants, until the alarm is disarmed."""
    return isinstance(exc, grpc.aio.AioRpcError | aetcd.exceptions.ClientError) and \
        _NO_SPACE in _text(exc)


def out_of_space(what: str, key: str, endpoint: str, exc: BaseException) -> StoreOutOfSpace:
    write = what if key.startswith("(") else f"{what} of {key}"  # "(lease)" names no key
    return StoreOutOfSpace(
        f"etcd is out of space: {write} was refused and not applied (etcd at {endpoint} raised its "
        f"NOSPACE alarm: its database reached --quota-backend-bytes). Reads still work; writes resume once an "
        f"operator compacts, defragments and disarms the alarm (docs/operations.md, \"etcd space\"). "
        f"etcd said: {_text(exc)}")


def is_login_refused(exc: BaseException) -> bool:
    """etcd refused the user name and password themselves."""
    return "authentication failed" in _text(exc) or "user name is empty" in _text(exc) \
        or "user name not found" in _text(exc)


class LoginRefused(Unavailable):
    """etcd refused the configured user and password (the service cannot work with them)."""


def denied(what: str, key: str, options: EtcdOptions, exc: BaseException) -> PermissionDenied:
    user = options.describe()["etcd_user"] or "(no user)"
    return PermissionDenied(f"etcd refused {what} of {key}: its user {user} may not; its role must grant "
                            f"readwrite on the Trainyard prefix (docs/security.md, etcd). etcd said: {_text(exc)}")


def explain_connect_failure(exc: BaseException, options: EtcdOptions, endpoint: str) -> str:
    """What a failed first call says about the settings ("" when it looks like an etcd that is down)."""
    said = _text(exc)
    if is_login_refused(exc):
        return (f"etcd_user/etcd_password: etcd at {endpoint} refused the login of {options.user!r}: {said}")
    if not options.tls:
        if "Socket closed" in said or "Connection reset" in said:
            return (f"etcd at {endpoint} closed the plaintext connection: it probably serves TLS; set etcd_ca_file "
                    f"(and etcd_cert_file/etcd_key_file, or etcd_user/etcd_password). gRPC said: {said}")
        return ""
    if "CERTIFICATE_VERIFY_FAILED" in said or "certificate verify failed" in said:
        return (f"etcd_ca_file {options.ca_file}: the certificate etcd at {endpoint} presented is not signed by "
                f"it or does not name that address. gRPC said: {said}")
    if "Tls handshake failed" in said or "Unwrap failed" in said or "BAD_CERTIFICATE" in said \
            or "Socket closed" in said or "WRONG_VERSION_NUMBER" in said:
        mine = f"etcd_cert_file {options.cert_file}" if options.cert_file else "no client certificate (etcd_cert_file)"
        return (f"etcd at {endpoint} refused the TLS connection: it was given {mine}; etcd under "
                f"--client-cert-auth takes only a certificate signed by a CA in its --trusted-ca-file (or it does "
                f"not serve TLS). gRPC said: {said}")
    return ""


def tls_signature(options: EtcdOptions) -> tuple[tuple[int, int, int], ...] | None:
    """(inode, size, mtime) of the client's TLS files, to notice a rotation; None without TLS or when one
    cannot be read (mid-rotation)."""
    files = [f for f in (options.ca_file, options.cert_file, options.key_file) if f is not None]
    if not files:
        return None
    try:
        return tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in (os.stat(f) for f in files))
    except OSError:
        return None


def tls_problem(options: EtcdOptions) -> str | None:
    """Why the TLS files cannot be used as they are now (a rotation half done: a certificate without its new
    key, a file that does not parse); None when they can."""
    try:
        if options.ca_file is not None:
            x509.load_pem_x509_certificates(options.ca_file.read_bytes())
        if options.cert_file is None or options.key_file is None:
            return None
        cert = x509.load_pem_x509_certificate(options.cert_file.read_bytes())
        key = serialization.load_pem_private_key(options.key_file.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        return f"{exc}"
    if cert.public_key().public_numbers() != key.public_key().public_numbers():  # type: ignore[union-attr]
        return f"etcd_key_file {options.key_file} is not the key of etcd_cert_file {options.cert_file}"
    return None


def channel_credentials(options: EtcdOptions) -> grpc.ChannelCredentials:
    """The TLS credentials `options` name (the CA, and the client certificate and key when set), for an asyncio
    channel or a blocking one (the lease thread's) alike."""
    assert options.ca_file is not None
    key = options.key_file.read_bytes() if options.key_file is not None else None
    cert = options.cert_file.read_bytes() if options.cert_file is not None else None
    return grpc.ssl_channel_credentials(root_certificates=options.ca_file.read_bytes(), private_key=key,
                                        certificate_chain=cert)


class Client(aetcd.Client):  # type: ignore[misc]  # aetcd ships no type information
    """aetcd's client over TLS (when `options` say so) with a renewable login token."""

    # aetcd's own attributes this class reads and sets
    _is_connecting: bool
    metadata: Any
    channel: Any

    def __init__(self, host: str, port: int, options: EtcdOptions, *, timeout: float) -> None:
        password = options.password.get_secret_value() if options.password is not None else None
        use_password = options.auth_mode == "password"
        super().__init__(host=host, port=port, username=options.user if use_password else None,
                         password=password if use_password else None, timeout=timeout,
                         connect_wait_timeout=timeout)
        self._etcd_options = options
        self._login_lock = asyncio.Lock()
        self.watchstub: Any = None
        self.logins = 0  # how many times this client logged in (tests read it)

    @property
    def uses_token(self) -> bool:
        return self._username is not None

    async def connect(self) -> None:
        """aetcd's connect (same stubs, same single-flight wait), on a TLS channel when configured."""
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            # etcd's own Go client takes answers of any size (MaxCallRecvMsgSize = MaxInt32); gRPC's default 4 MiB
            # would fail a range page of large records (a big gang's allocation is megabytes) as if the member
            # were down.
            options = [*self._options.items(), ("grpc.max_receive_message_length", 2**31 - 1)]
            if self._etcd_options.tls:
                self.channel = grpc.aio.secure_channel(target, channel_credentials(self._etcd_options), options=options)
            else:
                self.channel = grpc.aio.insecure_channel(target, options=options)
            if self.uses_token:
                await self._login()
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self.watchstub = rpc.WatchStub(self.channel)
            self._watcher = watcher.Watcher(self.watchstub, timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False

    async def _login(self) -> None:
        self.auth_stub = rpc.AuthStub(self.channel)
        resp = await self.auth_stub.Authenticate(
            rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
        self.metadata = (("token", resp.token),)
        self.logins += 1

    async def renew_token(self, stale: Any) -> None:
        """Log in again unless another call already has since `stale` (the metadata the refused call sent)."""
        async with self._login_lock:
            if self.metadata is not stale:
                return
            await self._login()
            log.info("etcd: auth token renewed", extra={"endpoint": f"{self._host}:{self._port}",
                                                         "etcd_user": self._username})


class WatchRefused(Exception):
    """etcd cancelled a watch as it created it; `reason` is its cancel_reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def watch_responses(client: Client, key: bytes, range_end: bytes,
                          start_revision: int) -> AsyncGenerator[Any, None]:
    """One watch on a stream of its own, with the client's current token (aetcd's shared watch stream keeps
    the token it was opened with, and a watch etcd cancels at creation, e.g. for that token having expired,
    leaves aetcd's caller waiting forever). Raises WatchRefused when etcd cancels the watch as it creates it."""
    hold = asyncio.Event()

    async def requests() -> AsyncIterator[rpc.WatchRequest]:
        yield rpc.WatchRequest(create_request=rpc.WatchCreateRequest(key=key, range_end=range_end,
                                                                      start_revision=start_revision))
        await hold.wait()  # the stream stays open until the call is cancelled

    call = client.watchstub.Watch(requests(), metadata=client.metadata)
    try:
        async for resp in call:
            if resp.created and resp.canceled and not resp.compact_revision:
                raise WatchRefused(resp.cancel_reason)
            yield resp
    finally:
        call.cancel()
