"""Coroutines that succeed or fail together (client/route/tasks.py)."""

import asyncio

import pytest

from p2pfusion.client.route.tasks import all_or_first_error
from p2pfusion.errors import PeerFailed


def test_results_in_order():
    async def value(x, delay):
        await asyncio.sleep(delay)
        return x

    assert asyncio.run(all_or_first_error([value(1, 0.02), value(2, 0.0)])) == [1, 2]


def test_first_error_cancels_the_others_at_once():
    cancelled = []

    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def fails():
        await asyncio.sleep(0.01)
        raise PeerFailed("the last hop did not answer", "peer-b")

    async def main():
        started = asyncio.get_running_loop().time()
        with pytest.raises(PeerFailed, match="did not answer"):
            await all_or_first_error([slow(), fails()])
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(main()) < 5
    assert cancelled == [True]
