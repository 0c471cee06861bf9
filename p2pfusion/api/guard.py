"""What the API takes from its users before any of it reaches a handler: which Host it answers,
how large and how slow a request body may be, and how many requests one user runs at once.

Anyone who can reach the port is a user, and an open API (no key) on 127.0.0.1 is reachable from
any web page a browser on this machine opens, through DNS rebinding: the page's own name resolves
to 127.0.0.1 and its requests carry that name as Host. So an API without keys answers only
requests addressed to an IP address, a local name or a name its operator allows.

A body is read by the guard, to its cap and within its time, before the app sees it: a body that
says it is too large is refused before a byte of it is read, one that turns out too large as soon
as it passes the cap, one that trickles in (a slowloris) when its time is up. Users are told apart
by API key where the API has several, else by address (an IPv6 /64 counts as one address); each
runs at most `requests_per_user` generations at once, so that no one user fills the share of
sessions each peer gives this API (peer/admission.py); a request past that waits a moment for a
slot (`Users`), then gets a 429. An address whose requests keep being refused (a 4xx other than
429: bodies too large, malformed, for another Host) waits before each of its next requests is
handled, ever longer (net/penalties.py): refusing is cheap, but thousands a second took this
process's whole core from everyone else.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from p2pfusion.api.errors import APIError
from p2pfusion.net.clients import source_of
from p2pfusion.net.penalties import Refusals

MIB = 1 << 20
LOCAL_NAMES = ("localhost",)  # and every name under .localhost, which resolvers keep on this machine
QUEUE_SECONDS = 2.0  # a request over its user's cap waits this long for a slot before its 429
BUSY_RETRY = 2  # seconds the 429 says to wait: generations end at any moment


@dataclass(frozen=True)
class APILimits:
    """What one API process accepts (the `p2pfusion api` options of the same names)."""

    api_keys: tuple[str, ...] = ()  # none: open to anyone who can reach it, from allowed Hosts only
    max_body: int = 4 * MIB  # bytes of one request body
    body_seconds: float = 30.0  # to send it in
    requests_per_user: int = 4  # generations one user runs at once
    allowed_hosts: tuple[str, ...] = ()  # Host names served besides IP addresses and local names; "*": any


def host_allowed(host_header: str, allowed: tuple[str, ...]) -> bool:
    """Whether a request addressed to `host_header` ("name" or "name:port") is one this API answers
    without a key: IP addresses (a rebinding page cannot make its requests carry one), local names,
    and the names in `allowed`."""
    if "*" in allowed:
        return True
    host = host_header.strip().lower()
    if host.startswith("["):  # [IPv6]:port
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    host = host.rstrip(".")
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return host in LOCAL_NAMES or host.endswith(".localhost") or host in {a.lower() for a in allowed}


def user_of(scope: Scope, authorization: str, keys: tuple[str, ...]) -> str:
    """Whom a request counts against: its API key's digest when the API has more than one key (a
    request without a valid key never gets this far), else the address it came from."""
    if len(keys) > 1:
        given = authorization.partition(" ")[2].strip()
        return "key:" + hashlib.sha256(given.encode()).hexdigest()[:16]
    return source_of(scope.get("client") or ("", 0))


class Users:
    """The generations each user runs now. A user at its cap waits up to `wait` seconds for one of
    its own to end, then gets a 429: a client that retries at once is slowed to a request per
    `wait` per connection, rather than costing this process a refusal per round trip."""

    def __init__(self, per_user: int, wait: float = QUEUE_SECONDS):
        self.per_user = per_user
        self.wait = wait
        self.running: dict[str, int] = {}
        self._freed: dict[str, asyncio.Event] = {}  # set when one of the user's generations ends

    async def start(self, user: str) -> None:
        """Count a generation of `user`'s, once the user runs fewer than its most."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        while self.running.get(user, 0) >= self.per_user:
            left = deadline - loop.time()
            if left <= 0:
                raise APIError(
                    429, f"you have {self.running[user]} requests running here, at most {self.per_user} at once: "
                    "retry when one ends", "rate_limit_error", code="too_many_requests",
                    headers={"Retry-After": str(BUSY_RETRY)},
                )
            freed = self._freed.setdefault(user, asyncio.Event())
            try:
                await asyncio.wait_for(freed.wait(), left)
            except TimeoutError:
                pass
        self.running[user] = self.running.get(user, 0) + 1

    def end(self, user: str) -> None:
        left = self.running[user] - 1
        if left:
            self.running[user] = left
        else:
            del self.running[user]
        freed = self._freed.pop(user, None)
        if freed is not None:
            freed.set()


class Guard:
    """ASGI middleware: refuses requests to other Hosts (without keys), and reads each request body
    to its cap and within its time before the app runs."""

    def __init__(self, app: ASGIApp, limits: APILimits):
        self.app = app
        self.limits = limits
        self.refusals = Refusals()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        source = source_of(scope.get("client") or ("", 0))
        await asyncio.sleep(self.refusals.pause(source, time.monotonic()))
        send = self._counting(send, source)
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        refused = self._refusal(headers)
        if refused is None and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            try:
                receive = await self._read_body(receive)
            except APIError as exc:
                refused = exc
        if refused is not None:
            await refused.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _counting(self, send: Send, source: str) -> Send:
        """`send`, counting the response against `source` when it refuses the request."""

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500 and message["status"] != 429:
                self.refusals.add(source, time.monotonic())
            await send(message)

        return counted

    def _refusal(self, headers: dict[str, str]) -> APIError | None:
        limits = self.limits
        host = headers.get("host", "")
        if not limits.api_keys and not host_allowed(host, limits.allowed_hosts):
            return APIError(
                403, f"requests to Host '{host[:100]}' are not served: without --api-key this API answers "
                "only requests to an IP address or a local name (start it with --allowed-hosts NAME to add one)",
                code="host_not_allowed",
            )
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limits.max_body):
            return self._too_large()
        return None

    def _too_large(self) -> APIError:
        return APIError(
            413, f"the request body is larger than this API takes ({self.limits.max_body / MIB:g} MiB, --max-body)",
            code="request_too_large",
        )

    async def _read_body(self, receive: Receive) -> Receive:
        """The body read whole (a 413 past the cap, a 408 past the time), and a `receive` that gives
        it to the app in one message, then passes on what comes after (a disconnect)."""
        chunks, size, more = [], 0, True
        try:
            async with asyncio.timeout(self.limits.body_seconds):
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise APIError(400, "the client left before its request was sent")
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.limits.max_body:
                        raise self._too_large()
                    chunks.append(chunk)
                    more = message.get("more_body", False)
        except TimeoutError:
            raise APIError(
                408, f"the request body did not arrive within {self.limits.body_seconds:g} s", code="request_timeout"
            ) from None
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        return replay
