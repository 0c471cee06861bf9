"""The client's result streams to the last hop of a route, paired with their sessions.

A client opens its result stream (`Subscribe`) and its session (`Open`, relayed hop by hop) at
the same time, so either may reach the last hop first: the session waits a moment for its
stream, and a stream that no session claims is closed after the same moment.
"""

from __future__ import annotations

import asyncio

from p2pfusion.errors import RequestError

SUBSCRIBE_WAIT = 10.0  # the last hop waits this long for the client's result stream, and it for the session


class ResultStreams:
    def __init__(self):
        self._writers: dict[str, asyncio.StreamWriter] = {}
        self._ready: dict[str, asyncio.Event] = {}

    def attach(self, session_id: str, writer: asyncio.StreamWriter) -> None:
        if session_id in self._writers:
            raise RequestError(f"subscribe: session {session_id} already has a result stream")
        self._writers[session_id] = writer
        self._ready.setdefault(session_id, asyncio.Event()).set()

    def detach(self, session_id: str) -> None:
        self._writers.pop(session_id, None)
        self._ready.pop(session_id, None)

    async def wait(self, session_id: str) -> asyncio.StreamWriter:
        """The session's result stream, once its client has opened it."""
        ready = self._ready.setdefault(session_id, asyncio.Event())
        try:
            await asyncio.wait_for(ready.wait(), SUBSCRIBE_WAIT)
        except TimeoutError:
            self._ready.pop(session_id, None)
            raise RequestError("open: the client opened no output stream to the last hop") from None
        return self._writers[session_id]
