"""The server side of bench/grpc_accept.py: a grpc.aio server in its own process whose event loop runs
`busy` background tasks, each burning `burn_us` of CPU per step. Prints its port, waits for a line on stdin,
starts the burners, prints `ready`, records when each call's handler starts until `calls` have started,
prints those times (JSON), and stops at the next line on stdin."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainyard_core.waits import completes_within


class _Recorder(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.starts: list[float] = []
        self.enough = asyncio.Event()
        self.wanted = 0

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        self.starts.append(time.perf_counter())
        if self.wanted and len(self.starts) >= self.wanted:
            self.enough.set()
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def _burn(burn_s: float) -> None:
    while True:
        began = time.perf_counter()
        while time.perf_counter() - began < burn_s:
            pass
        await asyncio.sleep(0)


async def _main(calls: int, busy: int, burn_us: float) -> None:
    server = grpc.aio.server()
    recorder = _Recorder()
    health_pb2_grpc.add_HealthServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # the client's warm-up call is done: measure from here
    recorder.starts.clear()
    recorder.wanted = calls
    burners = [asyncio.create_task(_burn(burn_us / 1e6)) for _ in range(busy)]
    await asyncio.sleep(0.05)
    print("ready", flush=True)
    try:
        await completes_within(recorder.enough.wait(), 120)  # fewer calls than asked: the client says so
    finally:
        for task in burners:
            task.cancel()
        print(json.dumps(recorder.starts), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)  # the client has closed its channel
        await server.stop(None)


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
