"""Entry point of `trainyard-scheduler`: wiring only."""

from __future__ import annotations

import asyncio

from trainyard_core import gc_tuning, service
from trainyard_core.settings import write_ready_file

from .app import SchedulerApp
from .settings import SchedulerSettings


async def serve(settings: SchedulerSettings, stop: asyncio.Event) -> None:
    gc_tuning.tune()
    app = SchedulerApp(settings)
    await app.start()
    gc_tuning.freeze_startup_heap()
    write_ready_file(settings.ready_file, grpc_port=app.grpc_port)
    try:
        await stop.wait()
    finally:
        await app.stop()


def main() -> int:
    return service.run(service="scheduler", settings_cls=SchedulerSettings, env_prefix="TRAINYARD_SCHEDULER_",
                       serve=serve)


if __name__ == "__main__":
    raise SystemExit(main())
