"""Per-job worker credentials: a short-lived client certificate for `trainyard://job/<job_id>`, minted by the
scheduler for each attempt it launches, with the job issuer (the intermediate CA `pki.issue_job_issuer`
makes), and bound by the checkpoint-store to that job, attempt and team.

A job certificate has
- the principal as its one `trainyard://` URI SAN (and its subject CN): `trainyard://job/<job_id>`;
- two more URI SANs the callee reads as claims: `urn:trainyard:attempt:<n>` (the attempt it was minted for)
  and `urn:trainyard:team:<team>` (the job's team);
- an EC P-256 key; notBefore one minute back (clock skew between hosts), notAfter `ttl_s` after minting,
  never past the issuer's own notAfter;
- client authentication only and no DNS SAN: a job never serves.

The chain (leaf, then the job issuer) and the key travel to the agents as PEM: in the launch request's
environment (`CERT_ENV`, `KEY_ENV`, with the CA bundle in `CA_ENV`), and in `RenewJobCredential` while the
attempt runs (the scheduler's credential_renewal.py renews it past half its lifetime). The agent checks it
(`check_credential`), writes it to files only the workers' identity may read and gives the workers the
paths; the checkpoint client re-reads them when they change. It is never stored: the job record in etcd
holds the job's own env only, and no log line carries a launch's env or a renewal's credential.

The issuer's key can sign job certificates only: a server refuses any other principal whose certificate the
job issuer signed, and any job principal whose certificate it did not (`tls.peer_identity`). Its own path
length is 0, so it cannot make another CA either.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..contract import TEAM
from .identity import InvalidPrincipal, Principal, job
from .pki import is_job_issuer_name, principal_of, read_key_pair

ATTEMPT_URN = "urn:trainyard:attempt:"
TEAM_URN = "urn:trainyard:team:"
# What a worker's checkpoint client reads (services/checkpoint-store/trainyard_checkpoint/client/env.py).
CERT_ENV = "TRAINYARD_CHECKPOINT_CERT"
KEY_ENV = "TRAINYARD_CHECKPOINT_KEY"
CA_ENV = "TRAINYARD_CHECKPOINT_CA"
# Set instead of the three above when the deployment runs without TLS (the scheduler's insecure_plaintext).
# Not ..._INSECURE_PLAINTEXT: under the checkpoint-store's old settings prefix that is the store's own
# insecure_plaintext setting, which a store started from a worker's environment would take.
PLAINTEXT_ENV = "TRAINYARD_CHECKPOINT_PLAINTEXT"
CREDENTIAL_ENVS = (CERT_ENV, KEY_ENV, CA_ENV)
NOT_BEFORE_SKEW = dt.timedelta(minutes=1)
MAX_ATTEMPT = 2**31 - 1


class JobIssuerError(ValueError):
    """The job issuer's files cannot be used; the message names the file and what is wrong."""


class InvalidCredential(ValueError):
    """Not a usable credential of the job and attempt it is given for; the message says why, never a value."""


@dataclass(frozen=True, slots=True)
class JobGrant:
    """What a verified job certificate grants: the job, the attempt it was minted for, the job's team."""

    job_id: str
    attempt: int
    team: str

    @property
    def principal(self) -> Principal:
        return job(self.job_id)


def grant_of(cert: x509.Certificate, principal: Principal) -> JobGrant:
    """The claims of a job certificate naming `principal`; InvalidPrincipal when they are missing or malformed."""
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    attempts = [u[len(ATTEMPT_URN):] for u in uris if u.startswith(ATTEMPT_URN)]
    teams = [u[len(TEAM_URN):] for u in uris if u.startswith(TEAM_URN)]
    if len(attempts) != 1 or not attempts[0].isdigit() or int(attempts[0]) > MAX_ATTEMPT:
        raise InvalidPrincipal(f"the certificate of {principal} must name its attempt once, as {ATTEMPT_URN}<n> "
                               f"(found {attempts})")
    if len(teams) > 1 or (teams and not TEAM.matches(teams[0])):
        raise InvalidPrincipal(f"the certificate of {principal} names its team as {TEAM_URN}<team> at most once, "
                               f"with a team of {TEAM.rule} (found {teams})")
    return JobGrant(principal.name, int(attempts[0]), teams[0] if teams else "")


@dataclass(frozen=True, slots=True)
class JobCredential:
    """A minted credential. `env()` is what the workers get; never log it (repr leaves the key out)."""

    grant: JobGrant
    cert_chain: bytes = field(repr=False)
    key: bytes = field(repr=False)
    ca: bytes = field(repr=False)
    not_after: dt.datetime

    def env(self) -> dict[str, str]:
        return {CERT_ENV: self.cert_chain.decode(), KEY_ENV: self.key.decode(), CA_ENV: self.ca.decode()}


def is_pem(value: str | bytes) -> bool:
    """Whether `value` is PEM text (else, in a worker's environment, the path of a file)."""
    head = value.lstrip()[:10]
    return (head.decode(errors="replace") if isinstance(head, bytes) else head).startswith("-----BEGIN")


def key_matches(cert: x509.Certificate, key: object) -> bool:
    """Whether `key` (a loaded private key) is the key of `cert`."""
    public = getattr(key, "public_key", None)
    if public is None:
        return False
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    return bool(public().public_bytes(der, spki) == cert.public_key().public_bytes(der, spki))


def check_credential(cert_chain: bytes, key: bytes, ca: bytes, *, job_id: str, attempt: int,
                     now: dt.datetime) -> JobGrant:
    """The grant of a credential an agent is given for the workers of (job_id, attempt): PEM that parses, the
    first certificate's own key, a job certificate of that job and attempt, not expired, and a CA bundle.
    InvalidCredential saying what is wrong (never a value: the key is a secret)."""
    try:
        chain = x509.load_pem_x509_certificates(cert_chain)
    except ValueError:
        raise InvalidCredential("the credential's cert_chain is not PEM certificates") from None
    leaf = chain[0]
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError):
        raise InvalidCredential("the credential's key is not an unencrypted PEM private key") from None
    if not key_matches(leaf, private):
        raise InvalidCredential("the credential's key is not the key of its certificate")
    try:
        principal = principal_of(leaf)
        grant = grant_of(leaf, principal) if principal.kind == "job" else None
    except InvalidPrincipal as exc:
        raise InvalidCredential(f"the credential's certificate is not a job certificate: {exc}") from None
    if grant is None:
        raise InvalidCredential(f"the credential's certificate names {principal}, not a job")
    if (grant.job_id, grant.attempt) != (job_id, attempt):
        raise InvalidCredential(f"the credential is for job {grant.job_id} attempt {grant.attempt}, not for job "
                                f"{job_id} attempt {attempt}")
    if leaf.not_valid_after_utc <= now:
        raise InvalidCredential(f"the credential expired at {leaf.not_valid_after_utc.isoformat()}")
    try:
        x509.load_pem_x509_certificates(ca)
    except ValueError:
        raise InvalidCredential("the credential's ca is not PEM certificates") from None
    return grant


def _signature(paths: tuple[Path, ...]) -> tuple[tuple[int, int, int], ...]:
    out = []
    for path in paths:
        st = path.stat()
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class IssuerMaterial:
    cert: x509.Certificate
    cert_pem: bytes
    key: ec.EllipticCurvePrivateKey
    ca_pem: bytes


def load_issuer(cert_file: Path, key_file: Path, ca_file: Path) -> IssuerMaterial:
    """Read and check the job issuer: a CA certificate with `pki.JOB_ISSUER_UNIT` in its subject, its EC key,
    signed directly by a CA of the bundle."""
    pair = read_key_pair(cert_file, key_file, ca_file, JobIssuerError)
    cert, key = pair.cert, pair.key
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise JobIssuerError(f"{key_file} is not an EC private key")
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is None or not constraints.ca:
        raise JobIssuerError(f"{cert_file} is not a CA certificate (basicConstraints CA:TRUE)")
    if not is_job_issuer_name(cert.subject):
        raise JobIssuerError(f"{cert_file} is not a job issuer: its subject has no OU \"Trainyard job issuer\", so "
                             "servers would refuse the certificates it signs")
    return IssuerMaterial(cert, pair.cert_pem, key, pair.ca_pem)


def mint(issuer_cert: x509.Certificate, issuer_key: ec.EllipticCurvePrivateKey, grant: JobGrant, *,
         now: dt.datetime, ttl: dt.timedelta) -> tuple[bytes, bytes, dt.datetime]:
    """A job certificate for `grant`: (leaf PEM, key PEM, notAfter)."""
    principal = grant.principal
    key = ec.generate_private_key(ec.SECP256R1())
    not_after = min(now + ttl, issuer_cert.not_valid_after_utc)
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(principal.uri),
                                    x509.UniformResourceIdentifier(f"{ATTEMPT_URN}{grant.attempt}")]
    if grant.team:
        sans.append(x509.UniformResourceIdentifier(f"{TEAM_URN}{grant.team}"))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, principal.uri)]))
            .issuer_name(issuer_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - NOT_BEFORE_SKEW).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=True, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                           critical=False)
            .sign(issuer_key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem, cert.not_valid_after_utc


class JobIssuer:
    """The scheduler's job issuer: mints one credential per (job, attempt), kept for the attempt's launches
    on every node and its renewals (bounded: the oldest are forgotten first). Files rotated on disk are taken
    at the next mint. Thread-safe. A fresh credential costs under 1 ms (0.96 ms measured on the shared
    development machine: a P-256 key, one signature, three stats), a cached one 0.06 ms, so it runs on the
    event loop."""

    CACHE_MAX = 4096

    def __init__(self, cert_file: Path, key_file: Path, ca_file: Path, *, ttl_s: float) -> None:
        self._paths = (cert_file, key_file, ca_file)
        self._ttl = dt.timedelta(seconds=ttl_s)
        self._lock = threading.Lock()
        self._material = load_issuer(*self._paths)  # a bad issuer at start fails the start, naming the file
        self._sig = _signature(self._paths)
        self._cache: OrderedDict[tuple[str, int], JobCredential] = OrderedDict()

    @property
    def ttl(self) -> dt.timedelta:
        return self._ttl

    def _current(self) -> IssuerMaterial:
        try:
            sig = _signature(self._paths)
        except OSError:
            return self._material  # mid-rotation: keep what works
        if sig != self._sig:
            try:
                self._material = load_issuer(*self._paths)
                self._sig = sig
                self._cache.clear()  # credentials of the old issuer may outlive a CA change; mint anew
            except JobIssuerError:
                pass  # a half-written rotation: the previous issuer stays until the files are whole
        return self._material

    def credential(self, job_id: str, attempt: int, team: str, now: dt.datetime) -> JobCredential:
        """The credential of this attempt: the one minted before while it has more than half its lifetime
        left, else a new one."""
        grant = JobGrant(job_id, attempt, team)
        key = (job_id, attempt)
        with self._lock:
            material = self._current()
            found = self._cache.get(key)
            if found is not None and found.grant == grant and found.not_after - now > self._ttl / 2:
                self._cache.move_to_end(key)
                return found
            cert_pem, key_pem, not_after = mint(material.cert, material.key, grant, now=now, ttl=self._ttl)
            made = JobCredential(grant, cert_pem + material.cert_pem, key_pem, material.ca_pem, not_after)
            self._cache[key] = made
            self._cache.move_to_end(key)
            while len(self._cache) > self.CACHE_MAX:
                self._cache.popitem(last=False)
            return made
