"""mTLS for gRPC servers and clients, with certificates reloaded when they are rotated on disk.

Server side: `server_credentials(files)` requires a client certificate signed by the CA bundle, and gRPC
asks the fetcher for the current files at each new handshake; the fetcher re-reads them when any of the
three changed (size, mtime or inode), so a rotated certificate is served from the next connection on, with
no restart. A rotation that leaves a broken set (a key that does not match its certificate, a half-copied
file) keeps the previous set and logs why.

Client side: `ClientTls.credentials()` gives the current channel credentials; `ClientTls.generation`
changes when the files do, so a channel pool (`channels.py`) opens new channels with the new certificate
and retires the old ones. A client verifies the server's certificate against the principal it expects
(`target_name`: the principal's DNS name), not against the address it dialled: addresses move, principals
do not.

Peers: `peer_identity(context)` reads the principal from the verified certificate of the caller, and for a
job principal the claims of its certificate (`job_credentials.JobGrant`). The issuer of the leaf decides
what it may name: a certificate the job issuer signed names a job principal, and a job principal's
certificate is one the job issuer signed; anything else is refused (UNAUTHENTICATED, saying why).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509

from ..errors import Unauthenticated
from .identity import InvalidPrincipal, Principal
from .job_credentials import JobGrant, grant_of
from .pki import CertFiles, is_job_issuer_name, principal_of, read_key_pair

log = logging.getLogger(__name__)


class TlsConfigError(ValueError):
    """The certificate, key or CA files cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class TlsMaterial:
    cert: bytes
    key: bytes
    ca: bytes
    principal: Principal  # what our own certificate names


def _signature(files: CertFiles) -> tuple[tuple[int, int, int], ...]:
    out = []
    for path in (files.cert, files.key, files.ca):
        st = path.stat()
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def load(files: CertFiles) -> TlsMaterial:
    """Read and check the three files: each parses, the key matches the certificate, the certificate names a
    principal and is signed by one of the CA bundle's certificates."""
    pair = read_key_pair(files.cert, files.key, files.ca, TlsConfigError)
    cert = pair.cert
    try:
        principal = principal_of(cert)
    except InvalidPrincipal as exc:
        raise TlsConfigError(f"{files.cert}: {exc}") from exc
    return TlsMaterial(pair.cert_pem, pair.key_pem, pair.ca_pem, principal)


class _Reloading:
    """The newest good material for a set of files; re-read when they change."""

    def __init__(self, files: CertFiles) -> None:
        self.files = files
        self._lock = threading.Lock()  # gRPC calls the server fetcher from its own threads
        self._sig = _signature(files)
        self.material = load(files)  # a bad set at start fails the start
        self.generation = 0

    def refresh(self) -> bool:
        """Re-read if the files changed; True when new material was taken."""
        try:
            sig = _signature(self.files)
        except OSError as exc:
            log.warning("TLS files unreadable; keeping the current certificate", extra={"error": str(exc)})
            return False
        with self._lock:
            if sig == self._sig:
                return False
            try:
                material = load(self.files)
            except TlsConfigError as exc:
                # Rotation tools write the files one by one: a mismatched pair is usually a moment.
                log.warning("rotated TLS files are not usable yet; keeping the current certificate",
                            extra={"error": str(exc)})
                return False
            self._sig = sig
            if material.principal != self.material.principal:
                log.warning("the rotated certificate names another principal",
                            extra={"before": str(self.material.principal), "after": str(material.principal)})
            self.material = material
            self.generation += 1
            log.info("TLS certificate reloaded", extra={"cert_file": str(self.files.cert),
                                                        "principal": str(material.principal)})
            return True


def server_credentials(files: CertFiles) -> grpc.ServerCredentials:
    """Credentials that require and verify a client certificate, reloaded from `files` when they change."""
    source = _Reloading(files)

    def config(m: TlsMaterial) -> Any:
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.ca)

    def fetch() -> Any:
        return config(source.material) if source.refresh() else None
    return grpc.dynamic_ssl_server_credentials(config(source.material), fetch, require_client_authentication=True)


class ClientTls:
    """A client's certificate for mTLS, re-read when rotated (see `generation`)."""

    # Channel pools ask for the generation on every call; the files are looked at once a second at most.
    CHECK_EVERY_S = 1.0

    def __init__(self, files: CertFiles) -> None:
        self._source = _Reloading(files)
        self._creds: tuple[int, grpc.ChannelCredentials] | None = None
        self._checked = time.monotonic()

    @property
    def principal(self) -> Principal:
        return self._source.material.principal

    @property
    def generation(self) -> int:
        now = time.monotonic()
        if now - self._checked >= self.CHECK_EVERY_S:
            self._checked = now
            self._source.refresh()
        return self._source.generation

    def credentials(self) -> grpc.ChannelCredentials:
        gen = self.generation
        if self._creds is None or self._creds[0] != gen:
            m = self._source.material
            self._creds = (gen, grpc.ssl_channel_credentials(root_certificates=m.ca, private_key=m.key,
                                                             certificate_chain=m.cert))
        return self._creds[1]


def target_name_option(expected: Principal) -> tuple[str, str]:
    """The channel option that makes a client verify the server's certificate names `expected`."""
    return ("grpc.ssl_target_name_override", expected.dns_name)


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """Who called: the principal of its verified certificate, and for a job principal what it grants."""

    principal: Principal
    grant: JobGrant | None = None


class RefusedCertificate(InvalidPrincipal):
    """A certificate that names a principal its issuer may not vouch for, or malformed job claims."""


def identify(cert: x509.Certificate) -> PeerIdentity | None:
    """The identity a verified peer certificate gives: None when it names no principal; RefusedCertificate
    saying why when it names one it may not."""
    try:
        principal = principal_of(cert)
    except InvalidPrincipal:
        return None
    from_job_issuer = is_job_issuer_name(cert.issuer)
    if principal.kind == "job":
        if not from_job_issuer:
            raise RefusedCertificate(f"{principal}: a job's certificate must be signed by a job issuer, not by "
                                     f"{cert.issuer.rfc4514_string()}")
        try:
            return PeerIdentity(principal, grant_of(cert, principal))
        except InvalidPrincipal as exc:
            raise RefusedCertificate(str(exc)) from None
    if from_job_issuer:
        raise RefusedCertificate(f"{principal}: a job issuer signs job certificates only (this one names a "
                                 f"{principal.kind})")
    return PeerIdentity(principal)


# Parsing a certificate costs tens of microseconds; a peer's certificate is the same for every call on a
# connection, so the outcome is kept per certificate (bounded): an identity, a refusal (str), or None.
_PEERS: OrderedDict[bytes, PeerIdentity | str | None] = OrderedDict()
_PEERS_MAX = 4096
_PEERS_LOCK = threading.Lock()


def identity_of_peer_pem(pem: bytes) -> PeerIdentity | None:
    """None when the certificate names no principal; Unauthenticated when it names one it may not."""
    with _PEERS_LOCK:
        found = _PEERS.get(pem, ...)
        if found is not ...:
            _PEERS.move_to_end(pem)
    if found is ...:
        try:
            found = identify(x509.load_pem_x509_certificate(pem))
        except RefusedCertificate as exc:
            found = str(exc)
        except ValueError:  # not a certificate cryptography reads
            found = None
        with _PEERS_LOCK:
            _PEERS[pem] = found
            if len(_PEERS) > _PEERS_MAX:
                _PEERS.popitem(last=False)
    if isinstance(found, str):
        raise Unauthenticated(f"client certificate refused: {found}")
    return found


def principal_of_peer_pem(pem: bytes) -> Principal | None:
    found = identity_of_peer_pem(pem)
    return None if found is None else found.principal


def peer_identity(context: Any) -> PeerIdentity | None:
    """The identity of a call's peer, from its verified client certificate; None on a plaintext channel or
    a certificate that names no principal; Unauthenticated for a certificate that names one its issuer may
    not vouch for."""
    pems = context.auth_context().get("x509_pem_cert")
    if not pems:
        return None
    return identity_of_peer_pem(pems[0])


def peer_principal(context: Any) -> Principal | None:
    """The principal of a call's peer (see `peer_identity`)."""
    found = peer_identity(context)
    return None if found is None else found.principal


def read_files(cert: str, key: str, ca: str) -> CertFiles:
    return CertFiles(cert=Path(cert), key=Path(key), ca=Path(ca))
