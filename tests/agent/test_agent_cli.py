"""`trainyard-agent inject ...` and `trainyard-agent set-health ...` as real processes against a real agent
(simulated GPUs) registered with the real scheduler."""

from __future__ import annotations

import asyncio
import sys

import pytest

from tests.agent.agent_kit import Scheduler
from trainyard.common.v1 import types_pb2
from trainyard_agent.app import AgentApp
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.wait import eventually

PY = sys.executable


async def cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(PY, "-m", "trainyard_agent.main", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode().strip(), err.decode().strip()


async def test_inject_and_set_health(agent: AgentApp, scheduler: Scheduler) -> None:
    address = f"127.0.0.1:{agent.grpc_port}"
    await scheduler.registered()
    uuid = agent.health.get(3).uuid if agent.health is not None else ""

    code, out, err = await cli("inject", "--agent", address, "--gpu", "3", "--xid", "79")
    assert (code, err) == (0, "")
    assert out == f"GPU 3 ({uuid}): unhealthy, action reboot_host: XID 79: GPU has fallen off the bus"

    async def gpu_3(health: int) -> types_pb2.Gpu | None:
        node = await scheduler.node()
        return node.gpus[3] if node is not None and node.gpus[3].health == health else None

    await eventually(lambda: gpu_3(types_pb2.GPU_HEALTH_UNHEALTHY), what="the scheduler to see GPU 3 unhealthy")

    code, out, _ = await cli("set-health", "--agent", address, "--gpu", "3", "--healthy", "--operator", "alice",
                             "--reason", "reseated, dcgmi diag passed")
    assert (code, out) == (0, f"GPU 3 ({uuid}): healthy, action none")
    await eventually(lambda: gpu_3(types_pb2.GPU_HEALTH_HEALTHY), what="the scheduler to see GPU 3 healthy again")

    code, out, _ = await cli("inject", "--agent", address, "--gpu", "1", "--ecc", "12")
    assert (code, out.split(": ", 1)[1]) == (0, "unhealthy, action reset_gpu: 12 uncorrectable ECC errors (limit 10)")
    code, out, _ = await cli("inject", "--agent", address, "--gpu", "2", "--thermal", "95")
    assert code == 0 and "degraded, action none: thermal slowdown at 95 °C" in out
    code, out, _ = await cli("inject", "--agent", address, "--gpu", "4", "--fall-off-bus")
    # The event thread and the periodic poll race to see a GPU that fell off the bus: the reasons name both
    # (the XID and the lost GPU) in whichever order they arrived.
    assert code == 0 and "unhealthy, action reboot_host: " in out
    assert "XID 79: GPU has fallen off the bus" in out and "NVMLError_GpuIsLost" in out


@pytest.mark.parametrize("args,message", [
    (["inject", "--gpu", "3", "--xid", "79"], "the following arguments are required: --agent"),
    (["inject", "--agent", "h:1", "--gpu", "3"],
     "one of the arguments --xid --ecc --fall-off-bus --thermal is required"),
    (["inject", "--agent", "h:1", "--gpu", "3", "--xid", "79", "--ecc", "2"], "not allowed with argument --xid"),
    (["inject", "--agent", "nohost", "--gpu", "3", "--xid", "79"], "'nohost' is not HOST:PORT"),
    (["inject", "--agent", "h:1", "--gpu", "three", "--xid", "79"], "'three' is not a GPU index"),
    (["inject", "--agent", "h:1", "--gpu", "3", "--xid", "-4"], "'-4' is not a positive whole number"),
    (["set-health", "--agent", "h:1", "--gpu", "3", "--healthy", "--reason", "x"],
     "the following arguments are required: --operator"),
])
async def test_bad_arguments_exit_2(args: list[str], message: str) -> None:
    code, _, err = await cli(*args)
    assert code == 2 and message in err


async def test_the_agents_refusal_is_printed(agent: AgentApp) -> None:
    address = f"127.0.0.1:{agent.grpc_port}"
    code, out, err = await cli("inject", "--agent", address, "--gpu", "9", "--xid", "79")
    assert (code, out) == (1, "") and err == "error: INVALID_ARGUMENT: gpu_index 9 does not exist on this node " \
                                            "(it has 8 GPUs)"
    code, _, err = await cli("set-health", "--agent", address, "--gpu", "0", "--unhealthy", "--operator", "bob",
                             "--reason", " ")
    assert code == 1 and err.startswith("error: INVALID_ARGUMENT: reason is required")


async def test_no_agent_at_the_address() -> None:
    code, _, err = await cli("inject", "--agent", f"127.0.0.1:{free_port()}", "--gpu", "0", "--xid", "79",
                             "--timeout", "2")
    assert code == 1 and "(is the agent running at that address?)" in err
