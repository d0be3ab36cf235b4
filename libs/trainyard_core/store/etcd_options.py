"""How a service reaches etcd: endpoints, TLS files and the etcd credential, as its settings give them.

Three ways to authenticate to an etcd that has auth on (docs/security.md, "etcd"):

- a password: `etcd_user` + `etcd_password`; the client logs in once per connection and sends the token
  etcd hands out with every call (a token etcd no longer knows, after its TTL or a restart, is renewed);
- a client certificate alone: etcd started with `--client-cert-auth` takes the user from the certificate's
  CN when no password is sent (`pki.ensure_etcd` issues `etcd-user-<user>.pem`);
- neither, against an etcd without auth.

TLS is on whenever `etcd_ca_file` is set: the members' certificates are verified against that bundle, and
`etcd_cert_file`/`etcd_key_file` (mTLS) are presented when given. Plaintext etcd needs a setting that says so
(`service.check_etcd`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from pydantic import SecretStr


@dataclass(frozen=True, slots=True)
class EtcdOptions:
    endpoints: str
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    user: str = ""
    password: SecretStr | None = None

    @property
    def tls(self) -> bool:
        return self.ca_file is not None

    @property
    def auth_mode(self) -> str:
        """"password", "certificate" (the user is the client certificate's CN) or "none"."""
        if self.user and self.password is not None:
            return "password"
        if self.cert_file is not None:
            return "certificate"
        return "none"

    def describe(self) -> dict[str, str]:
        """What to log about the connection: never the password."""
        return {"etcd_endpoints": self.endpoints, "etcd_tls": "on" if self.tls else "off",
                "etcd_auth": self.auth_mode, "etcd_user": self.user or common_name(self.cert_file) or ""}


def common_name(cert_file: Path | None) -> str | None:
    """The CN of a certificate file (the etcd user it logs in as under --client-cert-auth), None if unreadable."""
    if cert_file is None:
        return None
    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    except (OSError, ValueError):
        return None
    names = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(names[0].value) if names else None


def file_problems(options: EtcdOptions) -> str:
    """Why the TLS files cannot be used ("" when they can): each is readable and parses, and the key belongs
    to the certificate. Names the setting and the file."""
    files = [("etcd_ca_file", options.ca_file), ("etcd_cert_file", options.cert_file),
             ("etcd_key_file", options.key_file)]
    data: dict[str, bytes] = {}
    for setting, path in files:
        if path is None:
            continue
        try:
            data[setting] = path.read_bytes()
        except OSError as exc:
            return f"{setting} {path}: cannot read it: {exc.strerror}"
    if "etcd_ca_file" in data:
        try:
            x509.load_pem_x509_certificates(data["etcd_ca_file"])
        except ValueError as exc:
            return f"etcd_ca_file {options.ca_file} holds no PEM certificate: {exc}"
    if "etcd_cert_file" not in data:
        return ""
    try:
        cert = x509.load_pem_x509_certificate(data["etcd_cert_file"])
    except ValueError as exc:
        return f"etcd_cert_file {options.cert_file} is not a PEM certificate: {exc}"
    try:
        key = serialization.load_pem_private_key(data["etcd_key_file"], password=None)
    except (ValueError, TypeError) as exc:
        return f"etcd_key_file {options.key_file} is not an unencrypted PEM private key: {exc}"
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, spki) != \
            cert.public_key().public_bytes(serialization.Encoding.DER, spki):
        return f"etcd_key_file {options.key_file} is not the private key of etcd_cert_file {options.cert_file}"
    return ""
