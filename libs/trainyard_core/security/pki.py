"""A development PKI: one CA and a certificate per principal, with the `cryptography` package.

`make run` keeps one under `.trainyard/pki/` and `make certs` writes one for deploy/; production brings its
own CA (docs/security.md). Layout of a directory:

    ca.pem, ca.key                     the CA (ECDSA P-256, 10 years)
    <kind>[-<name>].pem / .key         one leaf per principal: scheduler.pem, node-node-1.pem, tool-ops.pem
    job-issuer.pem, job-issuer.key     with `job_issuer=True`: the intermediate CA the scheduler mints job
                                       credentials with (pathLen 0, 1 year; `job_credentials.py`)

Each leaf (ECDSA P-256, 1 year by default) names its principal twice in its SANs: the URI
(`trainyard://node/node-1`, what the callee authorizes) and a DNS name (`node-1.node.trainyard.internal`,
what a caller verifies the server against), plus `localhost` and 127.0.0.1 for local tools. It is good for
both server and client authentication: every Trainyard process is both. Keys are written 0600.

`ensure(dir, principals)` is idempotent: it creates what is missing and re-issues a leaf that expires
within 30 days or was issued by another CA, and never touches a valid one.

The job issuer's subject carries the organizational unit `JOB_ISSUER_UNIT`: that is how a server tells a
certificate the job issuer signed (it may name only a `trainyard://job/...` principal) from one the CA
signed (which may name anything but a job). A site's own CA makes its job issuer the same way.

etcd's certificates are not Trainyard principals (they carry no `trainyard://` URI, so none of them can call
a Trainyard service): `ensure_etcd(dir, users)` adds, from the same CA,

    etcd-server.pem / .key             etcd's serving certificate: CN `etcd`, DNS localhost and 127.0.0.1-3
    etcd-user-<user>.pem / .key        a client certificate whose CN is the etcd user it logs in as (etcd
                                       takes the user from the CN under --client-cert-auth when no password
                                       is sent), e.g. etcd-user-trainyard.pem
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
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..contract import DNS_LABEL
from ..files import atomic_write_bytes
from .identity import SCHEME, InvalidPrincipal, Principal

CA_DAYS = 3650
LEAF_DAYS = 365
RENEW_BEFORE = dt.timedelta(days=30)
# The organizational unit in the subject of every job issuer (see the module docstring).
JOB_ISSUER_UNIT = "Trainyard job issuer"
JOB_ISSUER_NAME = "job-issuer"


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


_CA_USAGE = x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False)


def create_ca(directory: Path, common_name: str = "Trainyard development CA") -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CA_DAYS))
            # One intermediate may follow: the job issuer (path length 0 itself).
            .add_extension(x509.BasicConstraints(ca=True, path_length=1), critical=True)
            .add_extension(_CA_USAGE, critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "ca.pem", directory / "ca.key"
    _write_key(key_path, _key_pem(key))
    atomic_write_bytes(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


_LEAF_USAGE = x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False, content_commitment=False,
                           key_encipherment=False, data_encipherment=False, key_agreement=True, encipher_only=False,
                           decipher_only=False)


def _leaf(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, *, common_name: str,
          usages: Sequence[x509.ObjectIdentifier], sans: Sequence[x509.GeneralName], start: dt.datetime,
          days: int) -> tuple[bytes, bytes]:
    """A fresh EC key and its end-entity certificate signed by the CA: (certificate PEM, private key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(_LEAF_USAGE, critical=True)
               .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def issue(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, principal: Principal, *,
          days: int = LEAF_DAYS, not_before: dt.datetime | None = None,
          extra_dns: Sequence[str] = ()) -> tuple[bytes, bytes]:
    """A leaf for `principal`: (certificate PEM, private key PEM)."""
    sans: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(principal.uri), x509.DNSName(principal.dns_name),
        *(x509.DNSName(d) for d in extra_dns), x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    return _leaf(ca_cert, ca_key, common_name=principal.uri, sans=sans,
                 usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                 start=not_before or _now() - dt.timedelta(minutes=5), days=days)


# etcd members on loopback: one on 127.0.0.1, a 3-member test cluster on 127.0.0.1/.2/.3.
ETCD_SERVER_IPS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
ETCD_SERVER_CN = "etcd"


def issue_etcd(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, common_name: str, *,
               server: bool, dns: Sequence[str] = (), ips: Sequence[str] = (),
               days: int = LEAF_DAYS) -> tuple[bytes, bytes]:
    """An etcd certificate: (certificate PEM, private key PEM). A client certificate (`server=False`) names
    the etcd user in its CN and has no SANs; the server's names its addresses and is good for client
    authentication too (etcd dials itself with it for its HTTP gateway)."""
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server else \
        [ExtendedKeyUsageOID.CLIENT_AUTH]
    sans: list[x509.GeneralName] = [*(x509.DNSName(d) for d in dns),
                                    *(x509.IPAddress(ipaddress.ip_address(i)) for i in ips)]
    return _leaf(ca_cert, ca_key, common_name=common_name, usages=usages, sans=sans,
                 start=_now() - dt.timedelta(minutes=5), days=days)


def etcd_server_files(directory: Path) -> CertFiles:
    return CertFiles(cert=directory / "etcd-server.pem", key=directory / "etcd-server.key", ca=directory / "ca.pem")


def etcd_user_files(directory: Path, user: str) -> CertFiles:
    return CertFiles(cert=directory / f"etcd-user-{user}.pem", key=directory / f"etcd-user-{user}.key",
                     ca=directory / "ca.pem")


def _cn_still_good(path: Path, ca: x509.Certificate, common_name: str, dns: Sequence[str] = (),
                   ips: Sequence[str] = ()) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        cert.verify_directly_issued_by(ca)
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if [n.value for n in names] != [common_name] or cert.not_valid_after_utc - RENEW_BEFORE <= _now():
            return False
        if dns or ips:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            return set(san.get_values_for_type(x509.DNSName)) >= set(dns) and \
                {str(a) for a in san.get_values_for_type(x509.IPAddress)} >= set(ips)
        return True
    except Exception:  # unreadable, another CA's, no SANs: re-issue
        return False


def ensure_etcd(directory: Path, users: Iterable[str] = (), *, server_dns: Sequence[str] = ("localhost",),
                server_ips: Sequence[str] = ETCD_SERVER_IPS) -> tuple[CertFiles, dict[str, CertFiles]]:
    """The CA, etcd's server certificate and a client certificate per etcd user under `directory`, created or
    renewed where needed (as `ensure` does). Returns (server files, user → client files)."""
    if not (directory / "ca.pem").exists() or not (directory / "ca.key").exists():
        create_ca(directory)
    ca_cert, ca_key = _load_ca(directory)
    wanted = [(etcd_server_files(directory), ETCD_SERVER_CN, True)]
    for user in users:
        if not DNS_LABEL.matches(user):
            raise ValueError(f"etcd user {user!r} must be {DNS_LABEL.rule}")
        wanted.append((etcd_user_files(directory, user), user, False))
    for files, cn, server in wanted:
        if not (files.key.exists() and _cn_still_good(files.cert, ca_cert, cn, server_dns if server else (),
                                                      server_ips if server else ())):
            cert_pem, key_pem = issue_etcd(ca_cert, ca_key, cn, server=server,
                                           dns=server_dns if server else (), ips=server_ips if server else ())
            _write_key(files.key, key_pem)
            atomic_write_bytes(files.cert, cert_pem)
    return wanted[0][0], {cn: files for files, cn, server in wanted if not server}


def issue_job_issuer(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, *,
                     days: int = LEAF_DAYS) -> tuple[bytes, bytes]:
    """The job issuer: an intermediate CA under `ca_cert` that may sign leaves only (path length 0).
    (certificate PEM, private key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Trainyard job issuer"),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, JOB_ISSUER_UNIT)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_CA_USAGE, critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def is_job_issuer_name(name: x509.Name) -> bool:
    """Whether `name` (a certificate's issuer or subject) is a job issuer's."""
    return any(a.value == JOB_ISSUER_UNIT for a in name.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME))


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


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A certificate, its private key and the CA bundle, read from files and checked to belong together."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes
    cert: x509.Certificate
    key: PrivateKeyTypes
    cas: list[x509.Certificate]


def read_key_pair(cert_file: Path, key_file: Path, ca_file: Path,
                  error: type[ValueError] = ValueError) -> KeyPair:
    """Read the three files and check that each parses, that the key is the certificate's and that the
    certificate is signed directly by a CA of the bundle; `error` (with a message naming the file) otherwise."""
    try:
        cert_pem, key_pem, ca_pem = cert_file.read_bytes(), key_file.read_bytes(), ca_file.read_bytes()
    except OSError as exc:
        raise error(f"cannot read {exc.filename}: {exc.strerror}") from exc
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise error(f"{cert_file} is not a PEM certificate: {exc}") from exc
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise error(f"{key_file} is not an unencrypted PEM private key: {exc}") from exc
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, spki) != \
            cert.public_key().public_bytes(serialization.Encoding.DER, spki):
        raise error(f"{key_file} is not the private key of {cert_file}")
    try:
        cas = x509.load_pem_x509_certificates(ca_pem)
    except ValueError as exc:
        raise error(f"{ca_file} holds no PEM certificate: {exc}") from exc
    if not any(issued_by(cert, ca) for ca in cas):
        raise error(f"{cert_file} is not signed by any CA in {ca_file}")
    return KeyPair(cert_pem, key_pem, ca_pem, cert, key, cas)


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except Exception:  # any failure means "not this CA" (InvalidSignature, a non-CA, another key type)
        return False
    return True


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{directory / 'ca.key'} is not an EC key")
    return cert, key


def _still_good(path: Path, ca: x509.Certificate, principal: Principal | None) -> bool:
    """`principal` None: the job issuer."""
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        cert.verify_directly_issued_by(ca)
        named = is_job_issuer_name(cert.subject) if principal is None else principal_of(cert) == principal
        return named and cert.not_valid_after_utc - RENEW_BEFORE > _now()
    except Exception:  # unreadable, not ours, another CA's (InvalidSignature): re-issue
        return False


def job_issuer_files(directory: Path) -> tuple[Path, Path]:
    """(certificate, key) of the job issuer in a PKI directory."""
    return directory / f"{JOB_ISSUER_NAME}.pem", directory / f"{JOB_ISSUER_NAME}.key"


def ensure(directory: Path, principals: Iterable[Principal], *,
           job_issuer: bool = False) -> dict[Principal, CertFiles]:
    """The CA and a valid leaf for each principal under `directory`, created or renewed where needed; with
    `job_issuer`, the job issuer too (`job_issuer_files`). Job principals get no files here: the scheduler
    mints their certificates at launch."""
    if not (directory / "ca.pem").exists() or not (directory / "ca.key").exists():
        create_ca(directory)
    ca_cert, ca_key = _load_ca(directory)
    if job_issuer:
        issuer_cert, issuer_key = job_issuer_files(directory)
        if not (issuer_key.exists() and _still_good(issuer_cert, ca_cert, None)):
            cert_pem, key_pem = issue_job_issuer(ca_cert, ca_key)
            _write_key(issuer_key, key_pem)  # the key first, as for leaves
            atomic_write_bytes(issuer_cert, cert_pem)
    out = {}
    for principal in principals:
        if principal.kind == "job":
            raise ValueError(f"{principal}: job certificates are minted by the scheduler at launch (with the job "
                             "issuer), not kept in a PKI directory")
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
    parser.add_argument("principals", nargs="*", metavar="PRINCIPAL",
                        help="scheduler, gateway, checkpoint-store, node/<node_id> or tool/<name> "
                        "(or the full trainyard:// URI)")
    parser.add_argument("--job-issuer", action="store_true",
                        help="also the job issuer (job-issuer.pem/.key): the intermediate CA the scheduler mints "
                        "per-job worker credentials with (its job_issuer_cert_file/job_issuer_key_file)")
    parser.add_argument("--etcd-client", action="append", default=[], metavar="USER",
                        help="also etcd's server certificate and a client certificate whose CN is this etcd "
                        "user (repeatable), for etcd's --client-cert-auth")
    parser.add_argument("--etcd-server-dns", action="append", default=[], metavar="NAME",
                        help="a DNS name of the etcd members for their server certificate (repeatable; "
                        "localhost and 127.0.0.1-3 are always in it)")
    args = parser.parse_args(argv)
    if not args.principals and not args.etcd_client and not args.job_issuer:
        parser.error("name at least one PRINCIPAL, --job-issuer or --etcd-client")
    try:
        wanted = [Principal.parse(p if p.startswith(SCHEME) else SCHEME + p) for p in args.principals]
    except InvalidPrincipal as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        made = ensure(args.dir, wanted, job_issuer=args.job_issuer)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for principal, files in made.items():
        print(f"{principal.uri}\t{files.cert}\t{files.key}")
    if args.job_issuer:
        issuer_cert, issuer_key = job_issuer_files(args.dir)
        print(f"job issuer\t{issuer_cert}\t{issuer_key}")
    if args.etcd_client:
        try:
            server, users = ensure_etcd(args.dir, args.etcd_client, server_dns=["localhost", *args.etcd_server_dns])
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"etcd server\t{server.cert}\t{server.key}")
        for user, files in users.items():
            print(f"etcd user {user}\t{files.cert}\t{files.key}")
    os.chmod(args.dir, 0o700)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
