"""Operator commands of `trainyard-agent`, talking to a running agent over its gRPC API:

    trainyard-agent inject --agent HOST:PORT --gpu 3 --xid 79          # simulated GPUs only
    trainyard-agent inject --agent HOST:PORT --gpu 3 --ecc 12
    trainyard-agent inject --agent HOST:PORT --gpu 3 --fall-off-bus
    trainyard-agent inject --agent HOST:PORT --gpu 3 --thermal 95
    trainyard-agent set-health --agent HOST:PORT --gpu 3 --healthy --operator alice --reason "reseated"

With mTLS on the agent, add a tool certificate (one naming `trainyard://tool/<name>`) and the node the agent
is, which its certificate must name:

    trainyard-agent set-health --agent HOST:PORT --node-id gpu-node-01 --tls-cert ops.crt --tls-key ops.key \
        --tls-ca ca.crt --gpu 3 --healthy --operator alice --reason "reseated"

Each prints the GPU's health afterwards (one line). Exit codes: 0 done, 1 the agent refused or could not be
reached (its message is printed), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import grpc
import grpc.aio

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard_core.addresses import host_port
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import identity
from trainyard_core.security.identity import InvalidPrincipal, Principal
from trainyard_core.security.tls import ClientTls, TlsConfigError, read_files

COMMANDS = ("inject", "set-health")


def _address(value: str) -> str:
    if host_port(value) is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (the agent's gRPC address, e.g. "
                                         "127.0.0.1:50052; its ready file and log name the port)")
    return value


def _gpu(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not a GPU index (0, 1, ...)")
    return int(value)


def _positive(value: str) -> int:
    if not value.isdigit() or int(value) <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number")
    return int(value)


def _node_id(value: str) -> Principal:
    try:
        return identity.node(value)
    except InvalidPrincipal as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _check_tls(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    given = [f for f, v in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key), ("--tls-ca", args.tls_ca))
             if v]
    if given and len(given) != 3:
        parser.error("--tls-cert, --tls-key and --tls-ca go together (given: " + ", ".join(given) + ")")
    if given and args.node_id is None:
        parser.error("--node-id is required with --tls-cert/--tls-key/--tls-ca: the agent's certificate must name "
                     "the node you mean to reach")
    if args.node_id is not None and not given:
        parser.error("--node-id is only used with --tls-cert/--tls-key/--tls-ca")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainyard-agent", description="Operator commands of a running agent")
    sub = parser.add_subparsers(dest="command", required=True)
    inject = sub.add_parser("inject", help="inject a GPU fault (agents with simulated GPUs only)")
    set_health = sub.add_parser("set-health", help="mark a GPU healthy (after repair) or unhealthy; audited")
    for p in (inject, set_health):
        p.add_argument("--agent", required=True, type=_address, help="the agent's gRPC address, HOST:PORT")
        p.add_argument("--gpu", required=True, type=_gpu, help="GPU index on that node")
        p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the agent (default 10)")
        tls = p.add_argument_group("mTLS (an agent with tls_* settings refuses plaintext calls)")
        tls.add_argument("--tls-cert", help="your tool certificate (PEM), naming trainyard://tool/<name>")
        tls.add_argument("--tls-key", help="its private key (PEM)")
        tls.add_argument("--tls-ca", help="the deployment's CA bundle (PEM)")
        tls.add_argument("--node-id", type=_node_id, help="the node the agent is: its certificate must name "
                         "trainyard://node/<node id> (required with the --tls-* flags)")
    fault = inject.add_mutually_exclusive_group(required=True)
    fault.add_argument("--xid", type=_positive, help="an XID event, e.g. 79 (fallen off the bus) or 13")
    fault.add_argument("--ecc", type=_positive, metavar="N", help="N more uncorrectable ECC errors")
    fault.add_argument("--fall-off-bus", action="store_true", help="the GPU stops answering (XID 79)")
    fault.add_argument("--thermal", type=_positive, metavar="CELSIUS", help="set the GPU's temperature")
    state = set_health.add_mutually_exclusive_group(required=True)
    state.add_argument("--healthy", dest="healthy", action="store_true", help="back in service after repair")
    state.add_argument("--unhealthy", dest="healthy", action="store_false", help="take the GPU out of service")
    set_health.add_argument("--operator", required=True, help="who you are, for the audit log")
    set_health.add_argument("--reason", required=True, help="why, for the audit log")
    return parser


def inject_request(args: argparse.Namespace) -> agent_pb2.InjectFaultRequest:
    if args.xid is not None:
        return agent_pb2.InjectFaultRequest(gpu_index=args.gpu, kind="xid", xid=args.xid)
    if args.ecc is not None:
        return agent_pb2.InjectFaultRequest(gpu_index=args.gpu, kind="ecc", count=args.ecc)
    if args.fall_off_bus:
        return agent_pb2.InjectFaultRequest(gpu_index=args.gpu, kind="fall_off_bus")
    return agent_pb2.InjectFaultRequest(gpu_index=args.gpu, kind="thermal", temperature_c=args.thermal)


def describe(gpu: types_pb2.Gpu) -> str:
    health = types_pb2.GpuHealth.Name(gpu.health).removeprefix("GPU_HEALTH_").lower()
    line = f"GPU {gpu.index} ({gpu.uuid or 'no uuid'}): {health}, action {gpu.health_action or 'none'}"
    return f"{line}: {gpu.health_reason}" if gpu.health_reason else line


def _channel(args: argparse.Namespace, tls: ClientTls | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(args.agent)
    return secure_channel(args.agent, tls, args.node_id)


async def _call(args: argparse.Namespace, tls: ClientTls | None = None) -> types_pb2.Gpu:
    async with _channel(args, tls) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        if args.command == "inject":
            injected: agent_pb2.InjectFaultResponse = await stub.InjectFault(inject_request(args),
                                                                             timeout=args.timeout)
            return injected.gpu
        request = agent_pb2.SetGpuHealthRequest(gpu_index=args.gpu, healthy=args.healthy, operator=args.operator,
                                                reason=args.reason)
        answered: agent_pb2.SetGpuHealthResponse = await stub.SetGpuHealth(request, timeout=args.timeout)
        return answered.gpu


def main(argv: Sequence[str]) -> int:
    parser = _parser()
    args = parser.parse_args(list(argv))
    _check_tls(parser, args)
    tls: ClientTls | None = None
    if args.tls_cert:
        try:
            tls = ClientTls(read_files(args.tls_cert, args.tls_key, args.tls_ca))
        except TlsConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        gpu = asyncio.run(_call(args, tls))
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        hint = " (is the agent running at that address?)" if code == grpc.StatusCode.UNAVAILABLE else ""
        print(f"error: {code.name}: {exc.details()}{hint}", file=sys.stderr)
        return 1
    print(describe(gpu))
    return 0
