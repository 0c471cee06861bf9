"""Which threads run torch, in peers and clients alike.

OpenMP (libgomp, in torch's Linux wheels) keeps a pool of workers for every thread that has run
parallel work, for as long as that thread lives, and once the pools hold more threads than the
machine has cores it cuts its workers' spin between ops to almost nothing, for every pool: each
op of a step then wakes its workers from sleep. On an Intel VM a 10-layer step went from
10.2-11.3 ms to 13.5-16.5 ms, its second thread doing a third less of the work, as soon as a
second thread had run one prefill on two threads (docs/benchmarks.md, Which threads a peer
decodes on). So a process keeps one long-lived thread for its latency-bound torch work (a peer's
compute thread, a client's event loop), and runs the rest on threads that end with the job
(`FreshThreads`, `in_fresh_thread`), taking their pools with them; small work on a thread that
must make no pool runs on it alone (`one_thread`), and what it only fills, Python fills (a link
probe's payload, net/probe.py). tests/test_openmp_pools.py checks a serving peer and a client.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager

import torch

# positions (batch x tokens) of a step small enough for the long-lived thread: a decode step and
# its drafts; larger ones (prompts) run on a thread of their own
SMALL_STEP_ROWS = 8


class FreshThreads(Executor):
    """Runs each job on a new thread that ends with it, so that the OpenMP pool the job's torch ops
    made ends too. Starting the thread and its pool costs a fraction of a millisecond: small
    beside a job of a few milliseconds or more; a peer's one-token steps, its most frequent job,
    keep their long-lived thread."""

    def __init__(self, name: str, initializer: Callable[[], None] | None = None):
        self._name = name
        self._initializer = initializer
        self._live: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()

        def run() -> None:
            try:
                if future.set_running_or_notify_cancel():
                    if self._initializer is not None:
                        self._initializer()
                    try:
                        future.set_result(fn(*args, **kwargs))
                    except BaseException as exc:  # the job's own error, raised again where it is awaited
                        future.set_exception(exc)
            finally:
                with self._lock:
                    self._live.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=self._name, daemon=True)
        with self._lock:
            self._live.add(thread)
        thread.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if wait:
            with self._lock:
                live = list(self._live)
            for thread in live:
                thread.join()


async def in_fresh_thread(fn: Callable, *args):
    """`fn(*args)` on a thread of its own that ends with it (`FreshThreads`)."""
    return await asyncio.get_running_loop().run_in_executor(FreshThreads(getattr(fn, "__name__", "job")), fn, *args)


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch ops on the calling thread alone, for small work on the event loop's thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
