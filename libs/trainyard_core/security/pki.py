"""A development PKI: one CA and a certificate per principal, with the `cryptography` package.

`make run` keeps one under `.trainyard/pki/` and `make certs` writes one for deploy/; production brings its
own CA (docs/security.md). Layout of a directory:

    ca.pem, ca.key                     the CA (ECDSA P-256, 10 years)
    <kind>[-<name>].pem / .key         one leaf per principal: scheduler.pem, node-node-1.pem, tool-ops.pem

Each leaf (ECDSA P-256, 1 year by default) names its principal twice in its SANs: the URI
(`trainyard://node/node-1`, what the callee authorizes) and a DNS name (`node-1.node.trainyard.internal`,
what a caller verifies the server against), plus `localhost` and 127.0.0.1 for local tools. It is good for
both server and client authentication: every Trainyard process is both. Keys are written 0600.

`ensure(dir, principals)` is idempotent: it creates what is missing and re-issues a leaf that expires
within 30 days or was issued by another CA, and never touches a valid one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..files import atomic_write_bytes
from .identity import SCHEME, InvalidPrincipal, Principal

CA_DAYS = 3650
LEAF_DAYS = 365
RENEW_BEFORE = dt.timedelta(days=30)


@dataclass(frozen=True, slots=True)
class CertFiles:
    """The three files a process needs for mTLS."""

    cert: Path
    key: Path
    ca: Path

    def settings(self) -> dict[str, str]:
        """These files as a service's settings (`tls_cert_file`, `tls_key_file`, `tls_ca_file`)."""
        return {"tls_cert_file": str(self.cert), "tls_key_file": str(self.key), "tls_ca_file": str(self.ca)}


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write_key(path: Path, pem: bytes) -> None:
    atomic_write_bytes(path, pem, mode=0o600)


def leaf_name(principal: Principal) -> str:
    return f"{principal.kind}-{principal.name}" if principal.name else principal.kind


def create_ca(directory: Path, common_name: str = "Trainyard development CA") -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "ca.pem", directory / "ca.key"
    _write_key(key_path, _key_pem(key))
    atomic_write_bytes(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def issue(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, principal: Principal, *,
          days: int = LEAF_DAYS, not_before: dt.datetime | None = None,
          extra_dns: Sequence[str] = ()) -> tuple[bytes, bytes]:
    """A leaf for `principal`: (certificate PEM, private key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or _now() - dt.timedelta(minutes=5)
    sans: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(principal.uri), x509.DNSName(principal.dns_name),
        *(x509.DNSName(d) for d in extra_dns), x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, principal.uri)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=True, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def principal_of(cert: x509.Certificate) -> Principal:
    """The one Trainyard principal a certificate names in its URI SANs."""
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    ours = [u for u in uris if u.startswith(SCHEME)]
    if len(ours) != 1:
        raise InvalidPrincipal(f"the certificate must name exactly one {SCHEME} URI in its SANs (found {ours})")
    return Principal.parse(ours[0])


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{directory / 'ca.key'} is not an EC key")
    return cert, key


def _still_good(path: Path, ca: x509.Certificate, principal: Principal) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        cert.verify_directly_issued_by(ca)
        return principal_of(cert) == principal and cert.not_valid_after_utc - RENEW_BEFORE > _now()
    except Exception:  # unreadable, not ours, another CA's (InvalidSignature): re-issue
        return False


def ensure(directory: Path, principals: Iterable[Principal]) -> dict[Principal, CertFiles]:
    """The CA and a valid leaf for each principal under `directory`, created or renewed where needed."""
    if not (directory / "ca.pem").exists() or not (directory / "ca.key").exists():
        create_ca(directory)
    ca_cert, ca_key = _load_ca(directory)
    out = {}
    for principal in principals:
        cert_path = directory / f"{leaf_name(principal)}.pem"
        key_path = directory / f"{leaf_name(principal)}.key"
        if not (key_path.exists() and _still_good(cert_path, ca_cert, principal)):
            cert_pem, key_pem = issue(ca_cert, ca_key, principal)
            _write_key(key_path, key_pem)  # the key first: a cert never names a key that is not there
            atomic_write_bytes(cert_path, cert_pem)
        out[principal] = CertFiles(cert=cert_path, key=key_path, ca=directory / "ca.pem")
    return out


def files_for(directory: Path, principal: Principal) -> CertFiles:
    name = leaf_name(principal)
    return CertFiles(cert=directory / f"{name}.pem", key=directory / f"{name}.key", ca=directory / "ca.pem")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainyard_core.security.pki",
                                     description="Create (once) a development CA and a certificate per "
                                     "principal; renew those that expire within 30 days.")
    parser.add_argument("--dir", required=True, type=Path, help="where ca.pem and the leaves live")
    parser.add_argument("principals", nargs="+", metavar="PRINCIPAL",
                        help="scheduler, gateway, checkpoint-store, node/<node_id> or tool/<name> "
                        "(or the full trainyard:// URI)")
    args = parser.parse_args(argv)
    try:
        wanted = [Principal.parse(p if p.startswith(SCHEME) else SCHEME + p) for p in args.principals]
    except InvalidPrincipal as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    made = ensure(args.dir, wanted)
    for principal, files in made.items():
        print(f"{principal.uri}\t{files.cert}\t{files.key}")
    os.chmod(args.dir, 0o700)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
