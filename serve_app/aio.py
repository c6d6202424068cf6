"""asyncio helpers the ingress and the replica share."""
from __future__ import annotations

import asyncio


async def all_or_none(awaitables: list) -> list:
    """Every awaitable's result in order, run together; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
