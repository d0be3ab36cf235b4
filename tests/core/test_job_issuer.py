"""The job issuer and job principals: the dev PKI makes an intermediate CA that signs leaves only, job ids fit
the principal rules, minted certificates carry their claims, malformed claims and unusable issuer files are
refused with the reason, a rotated issuer is taken without a restart, and a server without a job binding
admits no job credential."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import grpc
import grpc.aio
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import NameOID

from trainyard.checkpoint.v1 import checkpoint_pb2, checkpoint_pb2_grpc
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core import contract
from trainyard_core.files import atomic_write_bytes
from trainyard_core.ids import new_id
from trainyard_core.rpc.server import CHANNEL_OPTIONS, start_grpc_server
from trainyard_core.security import identity, job_credentials, pki
from trainyard_core.security.identity import InvalidPrincipal, Principal
from trainyard_core.security.job_credentials import JobGrant, JobIssuer, JobIssuerError
from trainyard_core.security.tls import PeerIdentity, identify, target_name_option


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@pytest.fixture
def job_pki(pki_dir: Path) -> Path:
    pki.ensure(pki_dir, [], job_issuer=True)
    return pki_dir


def test_the_job_issuer_is_an_intermediate_ca_that_signs_leaves_only(job_pki: Path) -> None:
    cert_path, key_path = pki.job_issuer_files(job_pki)
    issuer = x509.load_pem_x509_certificate(cert_path.read_bytes())
    ca = x509.load_pem_x509_certificate((job_pki / "ca.pem").read_bytes())
    issuer.verify_directly_issued_by(ca)
    constraints = issuer.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca and constraints.path_length == 0
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.path_length == 1
    assert pki.is_job_issuer_name(issuer.subject) and not pki.is_job_issuer_name(ca.subject)
    assert oct(os.stat(key_path).st_mode & 0o777) == "0o600"
    before = cert_path.read_bytes()
    pki.ensure(job_pki, [], job_issuer=True)
    assert cert_path.read_bytes() == before, "a valid job issuer is never touched"
    # One of another CA is re-issued.
    other = job_pki.parent / "other"
    pki.ensure(other, [], job_issuer=True)
    atomic_write_bytes(cert_path, pki.job_issuer_files(other)[0].read_bytes())
    pki.ensure(job_pki, [], job_issuer=True)
    x509.load_pem_x509_certificate(cert_path.read_bytes()).verify_directly_issued_by(ca)


def test_the_pki_command_makes_the_job_issuer_and_refuses_job_principals(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert pki.main(["--dir", str(tmp_path / "p"), "--job-issuer", "scheduler"]) == 0
    assert "job issuer\t" in capsys.readouterr().out
    assert pki.job_issuer_files(tmp_path / "p")[0].exists()
    assert pki.main(["--dir", str(tmp_path / "p"), "job/job-abc"]) == 2
    assert "minted by the scheduler at launch" in capsys.readouterr().err


def test_every_valid_job_id_is_a_job_principal_with_no_dns_name() -> None:
    for job_id in (new_id("job"), "abc", "job-", "a" * 63, "job--x"):
        assert contract.ID.matches(job_id)
        principal = identity.job(job_id)
        assert Principal.parse(principal.uri) == principal
        with pytest.raises(ValueError, match="client-only"):
            _ = principal.dns_name
    for bad in ("Job-A", "1job", "ab", "a" * 64, "job_x", ""):
        with pytest.raises(InvalidPrincipal, match="job principal needs a name of 3-63"):
            identity.job(bad)
    with pytest.raises(InvalidPrincipal, match=r"trainyard://<node\|tool\|job>/<name>"):
        Principal.parse("trainyard://job/a/b")


def test_minted_claims_are_read_back_and_malformed_ones_refused(job_pki: Path) -> None:
    cert_path, key_path = pki.job_issuer_files(job_pki)
    material = job_credentials.load_issuer(cert_path, key_path, job_pki / "ca.pem")
    leaf_pem, _, _ = job_credentials.mint(material.cert, material.key, JobGrant("job-a", 7, "ml"), now=_now(),
                                          ttl=dt.timedelta(hours=1))
    leaf = x509.load_pem_x509_certificate(leaf_pem)
    assert identify(leaf) == PeerIdentity(identity.job("job-a"), JobGrant("job-a", 7, "ml"))
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH], "a job certificate never serves"
    assert not leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)

    def with_sans(*uris: str) -> x509.Certificate:
        key = material.key
        return (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")]))
                .issuer_name(material.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(_now()).not_valid_after(_now() + dt.timedelta(hours=1))
                .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]),
                               critical=False)
                .sign(key, hashes.SHA256()))

    job_a = "trainyard://job/job-a"
    for uris, why in (((job_a,), "must name its attempt once"),
                      ((job_a, "urn:trainyard:attempt:x"), "must name its attempt once"),
                      ((job_a, "urn:trainyard:attempt:1", "urn:trainyard:attempt:2"), "must name its attempt once"),
                      ((job_a, "urn:trainyard:attempt:1", "urn:trainyard:team:Bad_Team"), "names its team")):
        with pytest.raises(InvalidPrincipal, match=why):
            identify(with_sans(*uris))
    # The issuer's signature on anything but a job principal is refused.
    with pytest.raises(InvalidPrincipal, match="a job issuer signs job certificates only"):
        identify(with_sans("trainyard://node/node-1"))


def test_unusable_issuer_files_are_refused_naming_the_file(job_pki: Path, tmp_path: Path) -> None:
    cert_path, key_path = pki.job_issuer_files(job_pki)
    ca = job_pki / "ca.pem"
    scheduler = pki.files_for(job_pki, identity.SCHEDULER)
    cases = [
        ((tmp_path / "missing.pem", key_path, ca), "cannot read"),
        ((scheduler.cert, scheduler.key, ca), "is not a CA certificate"),
        ((job_pki / "ca.pem", job_pki / "ca.key", ca), "is not a job issuer"),
        ((cert_path, scheduler.key, ca), "is not the private key of"),
    ]
    other = tmp_path / "other"
    pki.ensure(other, [], job_issuer=True)
    cases.append(((cert_path, key_path, other / "ca.pem"), "is not signed by any CA in"))
    for files, why in cases:
        with pytest.raises(JobIssuerError, match=why):
            JobIssuer(*files, ttl_s=600)


def test_a_rotated_issuer_is_taken_at_the_next_mint(job_pki: Path, tmp_path: Path) -> None:
    cert_path, key_path = pki.job_issuer_files(job_pki)
    issuer = JobIssuer(cert_path, key_path, job_pki / "ca.pem", ttl_s=3600)
    first = issuer.credential("job-r", 0, "ml", _now())
    ca_cert, ca_key = pki._load_ca(job_pki)
    new_cert, new_key = pki.issue_job_issuer(ca_cert, ca_key)
    atomic_write_bytes(key_path, new_key, mode=0o600)
    # Half rotated (the key of the new issuer, the old certificate): the previous issuer keeps minting.
    assert issuer.credential("job-h", 0, "ml", _now()).cert_chain.endswith(cert_path.read_bytes())
    atomic_write_bytes(cert_path, new_cert)
    again = issuer.credential("job-r", 0, "ml", _now())
    assert again is not first and again.cert_chain.endswith(new_cert)
    leaf = x509.load_pem_x509_certificates(again.cert_chain)[0]
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(new_cert))


async def test_a_server_without_a_job_binding_admits_no_job_credential(job_pki: Path) -> None:
    class Nodes(scheduler_pb2_grpc.NodeServiceServicer):  # type: ignore[misc]
        async def ListNodes(self, request: object, context: object) -> scheduler_pb2.ListNodesResponse:
            return scheduler_pb2.ListNodesResponse()

    class Checkpoints(checkpoint_pb2_grpc.CheckpointServiceServicer):  # type: ignore[misc]
        async def GetCheckpoint(self, request: object, context: object) -> checkpoint_pb2.GetCheckpointResponse:
            return checkpoint_pb2.GetCheckpointResponse()

    def register(server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_NodeServiceServicer_to_server(Nodes(), server)
        checkpoint_pb2_grpc.add_CheckpointServiceServicer_to_server(Checkpoints(), server)

    # Serves CheckpointService's table rules, but with no job binding (job_binding not given).
    server = await start_grpc_server(host="127.0.0.1", port=0, register=register,
                                     service_names=["trainyard.scheduler.v1.NodeService",
                                                    "trainyard.checkpoint.v1.CheckpointService"],
                                     tls=pki.files_for(job_pki, identity.CHECKPOINT_STORE))
    cert_path, key_path = pki.job_issuer_files(job_pki)
    cred = JobIssuer(cert_path, key_path, job_pki / "ca.pem", ttl_s=600).credential("job-a", 0, "ml", _now())
    creds = grpc.ssl_channel_credentials(root_certificates=cred.ca, private_key=cred.key,
                                         certificate_chain=cred.cert_chain)
    try:
        async with grpc.aio.secure_channel(f"127.0.0.1:{server.port}", creds,
                                           options=[*CHANNEL_OPTIONS,
                                                    target_name_option(identity.CHECKPOINT_STORE)]) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await scheduler_pb2_grpc.NodeServiceStub(ch).ListNodes(scheduler_pb2.ListNodesRequest())
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "trainyard://job/job-a may not call" in (err.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await checkpoint_pb2_grpc.CheckpointServiceStub(ch).GetCheckpoint(
                    checkpoint_pb2.GetCheckpointRequest(checkpoint_id="ckpt-00000000000000000000"))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "this server does not bind job credentials" in (err.value.details() or "")
    finally:
        await server.stop(0)
