"""etcd as production runs it, for the test fixtures: a member serving TLS only under --client-cert-auth, auth
on, `root` and one role per service user that may read and write one prefix (docs/security.md, "etcd").

`start_secure` issues the certificates (`pki.ensure_etcd`), starts the member and enables auth; the
`SecureEtcd` it returns gives a client's `EtcdOptions` for any of its users and the same as the services'
settings (`settings_of`), their flags and their environment. Users without a password log in by the CN of
their client certificate: no token to fetch or check per call, the cheapest way etcd authenticates.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from ..security import pki
from ..security.pki import CertFiles
from ..store.etcd_options import EtcdOptions
from .etcd import EtcdProcess, start_single, stop_and_clean
from .etcd_auth import ROOT, enable_auth

# The etcd user the services of a test log in as (its client certificate's CN), and the prefix its role reads
# and writes in the tests' etcd: every test's keys live under it (`fresh_prefix`).
SERVICE_USER = "trainyard"
TEST_KEYS = "/trainyard-test/"


def fresh_prefix() -> str:
    """A key prefix no other test uses, under the services' grant: `/trainyard-test/t-<hex>/`."""
    return f"{TEST_KEYS}t-{uuid.uuid4().hex[:12]}/"


@dataclass
class SecureEtcd:
    member: EtcdProcess
    pki_dir: Path
    server: CertFiles  # etcd's server certificate and the CA every client certificate chains to
    users: dict[str, CertFiles]  # etcd client certificates by CN (the etcd user each logs in as)
    prefix: str  # what the users' roles may read and write

    @property
    def endpoint(self) -> str:
        return self.member.endpoint

    def options(self, *, user: str = "", password: str | None = None, cert: str = SERVICE_USER,
                ca: Path | None = None) -> EtcdOptions:
        """A client presenting `cert`'s certificate: logged in as that CN, or as `user` with `password`."""
        files = self.users[cert]
        return EtcdOptions(endpoints=self.member.endpoint, ca_file=ca or self.server.ca, cert_file=files.cert,
                           key_file=files.key, user=user, password=SecretStr(password) if password else None)

    def root_options(self) -> EtcdOptions:
        """Every key, as etcdctl, member kills and drills need (the `root` certificate)."""
        return self.options(cert=ROOT)


def start_secure(directory: Path, prefix: str, users: Mapping[str, str | None], *,
                 certificates_for: Iterable[str] = (), extra_args: Sequence[str] = ()) -> SecureEtcd:
    """A TLS etcd with auth on whose `users` (name → password, or None for certificate login) may read and
    write `prefix` only. `certificates_for` names more client certificates to issue for CNs that are no etcd
    user. The PKI lives in `directory`/pki; the member's data on tmpfs. Stop it with `stop_secure`."""
    server, certs = pki.ensure_etcd(directory / "pki", [ROOT, *users, *certificates_for])
    member = start_single(tls=server, extra_args=extra_args)
    member.admin = certs[ROOT]
    try:
        enable_auth(member.endpoint, certs[ROOT], prefix, users)
    except BaseException:
        stop_and_clean(member)
        raise
    return SecureEtcd(member, directory / "pki", server, certs, prefix)


def stop_secure(etcd: SecureEtcd) -> None:
    stop_and_clean(etcd.member)


def settings_of(options: EtcdOptions) -> dict[str, str]:
    """The services' etcd settings (EtcdSettings field → value) that connect as `options` does; a plaintext
    etcd gets etcd_insecure_plaintext, as its settings validation demands."""
    out = {"etcd_endpoints": options.endpoints}
    for name, value in (("etcd_ca_file", options.ca_file), ("etcd_cert_file", options.cert_file),
                        ("etcd_key_file", options.key_file)):
        if value is not None:
            out[name] = str(value)
    if options.user:
        assert options.password is not None
        out["etcd_user"] = options.user
        out["etcd_password"] = options.password.get_secret_value()
    if not options.tls:
        out["etcd_insecure_plaintext"] = "true"
    return out


def as_flags(settings: Mapping[str, str]) -> list[str]:
    """The same settings as a service's command-line flags (`--etcd-ca-file PATH`, `--etcd-insecure-plaintext`)."""
    out: list[str] = []
    for name, value in settings.items():
        flag = name.replace("_", "-")
        if value in ("true", "false"):
            out.append(f"--{flag}" if value == "true" else f"--no-{flag}")
        else:
            out += [f"--{flag}", value]
    return out


def as_env(settings: Mapping[str, str], env_prefix: str) -> dict[str, str]:
    """The same settings as a service's environment (`TRAINYARD_SCHEDULER_` + `ETCD_CA_FILE`, ...)."""
    return {f"{env_prefix}{name.upper()}": value for name, value in settings.items()}
