"""Coroutines run at once, where one failing makes the others pointless: a session's two openings,
a training step's chains."""

from __future__ import annotations

import asyncio


async def all_or_first_error(coros) -> list:
    """Every coroutine's result, run at once; or the first error, with the others cancelled."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
