"""A task watching etcd through EtcdStore.watch ends when it is cancelled as the watch's first response
arrives (real etcd). On Python 3.11 `asyncio.wait_for` returned that response and dropped the cancel, and the
watch went on under a caller that had been stopped (a mirror's stop would have waited for ever)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from trainyard_core.store import etcd as etcd_module
from trainyard_core.store.etcd import EtcdStore


async def test_a_cancel_landing_as_the_first_response_arrives_ends_the_watch(
        etcd_store: EtcdStore, key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    victim: list[asyncio.Task[None]] = []
    real = etcd_module.watch_responses

    def cancelled_at_the_first_response(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        responses = real(*args, **kwargs)

        async def relay() -> AsyncIterator[Any]:
            first = await anext(responses)
            victim[0].cancel()  # the caller is stopped as the first response arrives
            yield first
            async for response in responses:
                yield response
        return relay()

    monkeypatch.setattr(etcd_module, "watch_responses", cancelled_at_the_first_response)
    seen: list[str] = []

    async def watch() -> None:
        async for batch in etcd_store.watch(key_prefix):
            seen.extend(event.key for event in batch)

    victim.append(asyncio.create_task(watch()))
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(victim[0]), 10)  # TimeoutError before: the watch went on
    await etcd_store.put(key_prefix + "after", b"1")
    await asyncio.sleep(0.2)
    assert seen == []
