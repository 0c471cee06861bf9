"""The one place a client is assembled: what every client of one model builds once and its sessions
share.

A `ClientCore` holds the model's local parts (config, the head: embeddings, final norm and LM
head; the tokenizer), the swarm node, what the client knows of peers (health, links, pings,
distrust) and its options. The generation engine (generate/causal_lm.py), the fine-tuning model
(tune/distributed.py), a training run's driver (run/trainer.py), the CLI and the HTTP API each
build on one; none of them assembles these parts itself. `connect` makes one and joins the swarm.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from p2pfusion.client.checks.distrust import Distrust
from p2pfusion.client.checks.forward import ForwardCheck
from p2pfusion.client.checks.local import Recomputer
from p2pfusion.client.checks.verifier import Verifier
from p2pfusion.client.options import ClientOptions
from p2pfusion.client.route.access import SwarmAccess
from p2pfusion.client.route.catalog import describe
from p2pfusion.client.route.failover import FAILOVER_TIMEOUT, GAP_POLL, ResilientSession
from p2pfusion.client.route.health import PeerHealth, load_observed, save_observed
from p2pfusion.client.route.params import SessionParams
from p2pfusion.client.route.planner import gaps_closing, longest_session
from p2pfusion.dht.swarm import SwarmNode, join_swarm
from p2pfusion.errors import ModelError, RequestError, RouteError
from p2pfusion.models.source import ModelSource, model_shape, resolve_model
from p2pfusion.models.stage import load_config, load_head, max_positions
from p2pfusion.net.compression import Purpose
from p2pfusion.net.links import LinkBook

log = logging.getLogger(__name__)

BACKGROUND_GRACE = 30.0  # seconds a leaving client waits for a canary under way
T = TypeVar("T")


class ClientCore:
    def __init__(self, source: ModelSource, options: ClientOptions | None = None, swarm: SwarmNode | None = None):
        self.source = source
        self.options = options if options is not None else ClientOptions()
        self.config = load_config(source)
        self.head = load_head(source, self.options.dtype)
        self.health = PeerHealth(observed=load_observed(source.key))
        self.recomputer = Recomputer(source, self.head, self.num_layers)  # the layers computed here, to check peers
        self.swarm = swarm
        self._tokenizer = None
        self._access: SwarmAccess | None = None
        self._distrust: Distrust | None = None
        self._reads: dict[str, asyncio.Task] = {}  # swarm reads in flight, shared by sessions opening together
        self._background: set[asyncio.Task] = set()  # work beside the user's (canaries), ended by `leave`
        self._swarm_limit: int | None = None  # the longest session the swarm accepted when last asked
        if self.options.trusted_peers is not None:
            log.info("routing only through %d trusted peers", len(self.options.trusted_peers))

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def max_positions(self) -> int:
        """The model's own positions; a session's length also follows what the swarm's peers accept."""
        return max_positions(self.config)

    def length_limit(self) -> tuple[int, str]:
        """The longest sequence to check a prompt against before any network traffic, and whose it
        is: the swarm's as `longest_session` last read it, else the model's own positions."""
        if self._swarm_limit is not None:
            return self._swarm_limit, "the swarm"
        return self.max_positions, "the model"

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.source.folder)
            except (OSError, ValueError) as exc:
                raise ModelError(f"cannot load the tokenizer of {self.source.name}: {exc}") from exc
        return self._tokenizer

    async def join(self, initial_peers: Sequence[str], identity_path: str | None = None) -> SwarmNode:
        """Join the swarm that `initial_peers` belong to (a private one with the options' secret),
        as the identity in `identity_path` if given (made there if missing), else a fresh one."""
        if not initial_peers:
            raise RequestError("initial_peers is empty: pass the multiaddr of at least one peer of the swarm")
        t0 = time.perf_counter()
        self.swarm = await join_swarm(
            list(initial_peers), client_mode=True, secret=self.options.swarm_secret, identity_path=identity_path
        )
        log.info("joined the swarm in %.1f s", time.perf_counter() - t0)
        return self.swarm

    def attach(self, swarm: SwarmNode) -> None:
        """Use `swarm`, a node joined already (`connect` joins while the model loads)."""
        self.swarm = swarm

    def access(self) -> SwarmAccess:
        """What this client's sessions share, for the swarm node it is attached to now."""
        if self.swarm is None:
            raise RequestError("this client is not attached to a swarm")
        if self._access is None or self._access.swarm is not self.swarm:
            options = self.options
            self._access = SwarmAccess(
                self.swarm, self.source.key, self.source.name, self.num_layers, self.health,
                LinkBook(self.swarm.transport), options.compression, trusted=options.trusted_peers,
                minimum=options.min_precision,
            )
            self._distrust = Distrust(self._access, self.recomputer)
        return self._access

    @property
    def distrust(self) -> Distrust:
        self.access()
        return self._distrust

    def shared(self, kind: str, read: Callable[[], Awaitable]) -> asyncio.Future:
        """`read()`, or the answer of the one of its kind in flight: a burst of sessions costs the
        DHT one read."""
        task = self._reads.get(kind)
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            task = self._reads[kind] = asyncio.ensure_future(read())
        return asyncio.shield(task)

    async def read_reports(self) -> None:
        """Other clients' fault reports (`Distrust.refresh`). Sessions opening before the first read
        has ended wait for it (it counts as done once started) rather than route through peers it
        would distrust; later reads run beside the sessions, which route by the verdicts so far: a
        DHT slowed by frozen nodes held every generation up to REPORT_TIMEOUT at each read."""
        reading = self.shared("distrust", self.distrust.refresh)
        if not self.distrust.read_once:
            await reading

    def session(
        self, length: int, params: SessionParams | None = None, purpose: Purpose = Purpose.INFERENCE, batch: int = 1,
        first: int = 0, through: str | None = None,
    ) -> ResilientSession:
        """A session through the layers from `first` on (and through peer `through`, if given),
        not opened yet (it opens on its first step)."""
        return ResilientSession(self.access(), length, params, purpose, batch, first, through)

    async def open_session(
        self, length: int, params: SessionParams | None = None, purpose: Purpose = Purpose.INFERENCE, batch: int = 1,
        first: int = 0, through: str | None = None,
    ) -> ResilientSession:
        """An open session, routed around the peers this client distrusts (other clients' reports read first)."""
        session = self.session(length, params, purpose, batch, first, through)
        await self.read_reports()
        return await session.open()

    def verifier(self, session: ResilientSession) -> Verifier | None:
        """What checks a session's results (None with verification off)."""
        if self.options.verify <= 0:
            return None
        return Verifier(session, self.distrust, self.options.verify, self.options.dtype, self.head_logits)

    def forward_check(self) -> ForwardCheck | None:
        """What checks a sample of training forwards (None with verification off)."""
        if self.options.verify <= 0:
            return None
        return ForwardCheck(self.distrust, self.options.verify, self.options.dtype)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy token after each position of final hidden states [batch, tokens, hidden]; safe
        to call from another thread."""
        return self.head_logits(hidden).argmax(dim=-1)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits [batch, tokens, vocab] for final hidden states; safe to call from
        another thread."""
        with torch.inference_mode():
            return self.head(inputs_embeds=hidden.to(self.options.dtype)).logits

    async def longest_session(self, first: int = 0) -> int:
        """The longest sequence a session from layer `first` can hold now (soft prompt included):
        the model's positions, or less where the peers of every route accept less."""

        async def read() -> int:
            deadline = time.monotonic() + FAILOVER_TIMEOUT
            while True:
                access = self.access()
                records = await access.records(first)
                banned = self.health.banned(records)
                try:
                    limit = longest_session(records, self.num_layers, self.max_positions, banned=banned, first=first)
                    break
                except RouteError as exc:
                    if not gaps_closing(records, self.num_layers, banned, first) or time.monotonic() > deadline:
                        raise
                    access.notice("coming", f"{exc}; peers are getting ready to serve them: waiting up to {FAILOVER_TIMEOUT:.0f} s")
                    await asyncio.sleep(GAP_POLL)
            if first == 0:
                self._swarm_limit = limit
            return limit

        return await self.shared(f"limit {first}", read)

    def save_observed(self) -> None:
        """Keep the peers' speeds this client observed for its next run (and `p2pfusion swarm`)."""
        save_observed(self.source.key, self.health.observed)

    def spawn(self, work: Awaitable) -> asyncio.Task:
        """Run `work` beside the user's requests until it ends or the client leaves."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def leave(self) -> None:
        """Let the work beside the user's end (a canary owed to a suspect reports what it finds),
        for BACKGROUND_GRACE seconds at most, save what was observed and leave the swarm."""
        if self._background:
            await asyncio.wait(self._background, timeout=BACKGROUND_GRACE)
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(self._background)
        self.save_observed()
        swarm, self.swarm = self.swarm, None
        if swarm is not None:
            await swarm.shutdown()


async def connect(
    initial_peers: Sequence[str], model: str | ModelSource | None = None, options: ClientOptions | None = None
) -> ClientCore:
    """A client of `model` (a folder, a .gguf file, a Hub id, or None for the default model) in the
    swarm `initial_peers` belong to. Loading reads (and may convert) weights: the caller's loop
    keeps serving meanwhile."""
    if not initial_peers:
        raise RequestError("initial_peers is empty: pass the multiaddr of at least one peer of the swarm")
    options = options if options is not None else ClientOptions()

    def load() -> ClientCore:
        return ClientCore(model if isinstance(model, ModelSource) else resolve_model(model), options)

    # the swarm is joined while the model loads: an unreachable peer or a wrong secret is said at
    # once, not after seconds of loading
    started = time.perf_counter()
    joining = asyncio.ensure_future(join_swarm(list(initial_peers), client_mode=True, secret=options.swarm_secret))
    loading = _in_daemon_thread(load)
    served = asyncio.ensure_future(_served(joining, model.folder if isinstance(model, ModelSource) else model))
    try:
        await asyncio.wait({joining, loading, served}, return_when=asyncio.FIRST_EXCEPTION)
        for task in (served, loading, joining):  # the first to fail is said at once, not after the others end
            if task.done() and task.exception() is not None:
                raise task.exception()
        swarm = await joining
        log.info("joined the swarm in %.1f s", time.perf_counter() - started)
        core = await loading
        served.cancel()  # the loaded model's key is the final word
    except BaseException:
        served.cancel()
        loading.cancel()  # its thread finishes on its own, or ends with the process
        if joining.done() and not joining.cancelled() and joining.exception() is None:
            await joining.result().shutdown()
        else:
            joining.cancel()
        raise
    core.attach(swarm)
    return core


async def _served(joining: asyncio.Future[SwarmNode], model: str | Path | None) -> None:
    """A RouteError as soon as the swarm's model list shows that it cannot serve `model`: models
    are listed and none has its shape, so none has its weights. Said while the model loads, since a
    first run's conversion and hashing take tens of seconds; the loaded model's key decides the rest."""
    swarm = await asyncio.shield(joining)
    shape = await asyncio.to_thread(model_shape, None if model is None else str(model))
    if shape is None:  # a Hub id: nothing to compare before it is downloaded
        return
    name, layers, hidden = shape
    listed = await swarm.models()
    # an empty list may be a read that timed out (a saturated 60-node swarm): the records' reads,
    # patient with a slow DHT (client/route/catalog.py), decide then
    if listed and not any((e.num_layers, e.hidden_size) == (layers, hidden) for e in listed):
        raise RouteError(
            f"the swarm serves no model like {name} ({layers} layers, hidden size {hidden}); it serves: {describe(listed)}"
        )


def _in_daemon_thread(work: Callable[[], T]) -> asyncio.Future[T]:
    """`work()` on a thread of its own, as a future of this loop. A daemon thread: a process that
    gives up on it (the swarm was unreachable) exits without waiting for it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            outcome = (work(), None)
        except BaseException as exc:  # handed over whole to the awaiting coroutine, which raises it
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for the result
            pass

    threading.Thread(target=run, name="load-model", daemon=True).start()
    return future
