"""Run on one node's host (its network namespace) with that node's certificate: what can it reach, and what may it
do? Prints one JSON object. Arguments: cert key ca own_node other_node other_agent scheduler etcd_port."""

import json
import socket
import sys
from pathlib import Path

import grpc

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.security import identity
from trainyard_core.security.tls import target_name_option

cert, key, ca, own, other, other_agent, scheduler, etcd_port = sys.argv[1:9]
creds = grpc.ssl_channel_credentials(Path(ca).read_bytes(), Path(key).read_bytes(), Path(cert).read_bytes())
out: dict[str, object] = {}


def code(call) -> str:  # type: ignore[no-untyped-def]
    try:
        call()
        return "OK"
    except grpc.RpcError as err:
        return f"{err.code().name}: {err.details()}"


with grpc.secure_channel(other_agent, creds, options=[target_name_option(identity.node(other))]) as ch:
    agent = agent_pb2_grpc.AgentServiceStub(ch)
    out["launch_on_other"] = code(lambda: agent.LaunchWorkers(
        agent_pb2.LaunchWorkersRequest(job_id="job-intruder", attempt=1, leader_epoch=2**62), timeout=10))
with grpc.secure_channel(scheduler, creds, options=[target_name_option(identity.SCHEDULER)]) as ch:
    nodes = scheduler_pb2_grpc.NodeServiceStub(ch)
    out["register_as_other"] = code(lambda: nodes.RegisterNode(scheduler_pb2.RegisterNodeRequest(
        node=types_pb2.Node(node_id=other, agent_address="10.0.0.1:1")), timeout=10))
# etcd listens on the control plane's loopback; a host's 127.0.0.1 is its own.
try:
    socket.create_connection(("127.0.0.1", int(etcd_port)), timeout=3).close()
    out["etcd_on_loopback"] = "reachable"
except OSError as err:
    out["etcd_on_loopback"] = type(err).__name__
out["own"] = own
print(json.dumps(out))
