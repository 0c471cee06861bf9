"""Checking a session's results against other peers, beside its generation.

A `Verifier` wraps one ResilientSession. It keeps the final hidden states the route returned for
every position. A check sends the positions since the last check through a second route that
avoids the session's peers where the swarm allows (its *shadow* session, kept open between checks,
so a check costs those positions only, as one prefill) and compares (client/checks/policy.py), with
the bar of the two routes' own weight formats, and the greedy tokens the client's head reads
from both at the positions that chose a token. Checks run beside the generation, as a task of
their own: the caller polls between steps (`poll`), goes on while a check runs, and rewinds when
one finds a wrong position; `finish` checks what is left when the generation ends. On a mismatch,
`Blame` (client/checks/blame.py) replays the inputs hop by hop to find the peer at fault.
`Distrust` (client/checks/distrust.py) keeps the peers not routed through.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable

import torch

from p2pfusion.client.checks.blame import Blame
from p2pfusion.client.checks.distrust import Distrust
from p2pfusion.client.checks.policy import (
    FLIP_FLOOR,
    alternative_route,
    first_mismatch,
    relative_errors,
    tolerance,
    total_variation,
    unchecked_layers,
)
from p2pfusion.client.route.failover import LONG_STEP_TIMEOUT, SCREEN_BUDGET, ResilientSession, cut, joined
from p2pfusion.client.route.planner import format_ranges
from p2pfusion.client.route.session import RouteSession
from p2pfusion.dht.records import PeerRecord
from p2pfusion.errors import PeerFailed, RouteError
from p2pfusion.models.threads import in_fresh_thread
from p2pfusion.net import messages as m
from p2pfusion.net.compression import Codec

log = logging.getLogger(__name__)

ATTEMPTS = 3  # checking routes tried before a check gives up
QUIET_SECONDS = 30.0  # a swarm with no second route is looked at again after this long

Logits = Callable[[torch.Tensor], torch.Tensor]  # final hidden states [b, t, h] -> the head's logits [b, t, vocab]


class Verifier:
    def __init__(
        self, session: ResilientSession, distrust: Distrust, rate: float, dtype: torch.dtype,
        logits: Logits | None = None, seed: int | None = None,
    ):
        self.session = session
        self.access = session.access
        self.blame = Blame(session, distrust, dtype)
        self.logits = logits  # the client's head, to compare what the routes' outputs choose
        self.rate = rate
        self.dtype = dtype
        self.off = tolerance(self.access.compression, dtype) == math.inf
        self.outputs: list[torch.Tensor] = []  # the route's output per step, beside session.history
        self.routes: list[tuple[PeerRecord, ...]] = []  # the route that computed each step
        self.computed_by: list[RouteSession] = []  # and the session on it, whose receipts name its codecs
        self.mask: torch.Tensor | None = None  # the last step's, covering the whole sequence
        self.checked = 0  # positions whose outputs another route confirmed
        self._shadow: RouteSession | None = None
        self._shadow_reused: set[str] = set()
        self._shadow_length = 0
        self._quiet_until = 0.0
        self._rng = random.Random(seed)
        self._running: asyncio.Task | None = None  # the check under way, beside the generation
        self._running_end = 0  # the positions it covers end before this one
        if self.off:
            log.warning("top-k compression loses too much to check peers' results: verification is off")

    async def step(
        self, hidden: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
        together: m.Cohort | None = None,
    ) -> torch.Tensor:
        out = await self.session.step(hidden, mask, positions, together)
        self.outputs.append(out)
        self.routes.append(tuple(self.session.session.route))
        self.computed_by.append(self.session.session)
        self.mask = mask
        return out

    def drawn(self) -> bool:
        """Whether a one-shot pass (a forward of a batch) is checked: at the verifier's rate."""
        return self._rng.random() < self.rate

    async def poll(self, continuous: bool = False) -> int | None:
        """Between steps, without waiting: the first wrong position that a check which has ended
        found (None: none), and a new check of the positions since the last one, started in the
        background at random with the verifier's rate, at the first call (which learns whether
        anything can check this session), and whenever none runs if `continuous` (a stream that
        shows only checked tokens)."""
        found = self._ended_check()
        if found is not None or self._running is not None or self.session.position <= self.checked:
            return found
        if time.monotonic() < self._quiet_until:  # nothing can check them: they count as checked
            self.checked = self.session.position
        elif continuous or self.checked == 0 or self._rng.random() < self.rate:
            self._running, self._running_end = asyncio.create_task(self._check()), self.session.position
        return None

    async def finish(self) -> int | None:
        """Wait for the check under way, then check every position not checked yet: the first
        wrong position, or None when all hold (or nothing can check them)."""
        if self._running is not None:
            await asyncio.wait([self._running])
            found = self._ended_check()
            if found is not None:
                return found
        return await self._check()

    def _ended_check(self) -> int | None:
        task = self._running
        if task is None or not task.done():
            return None
        self._running = None
        return task.result()  # a check's own bug surfaces in the generation, not as a peer's fault

    async def _stop_check(self) -> None:
        """Cancel the check under way; its shadow session's state is then unknown, so it goes too."""
        task, self._running = self._running, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
            await self._drop_shadow()
        elif task is not None and not task.cancelled() and task.exception() is not None:
            raise task.exception()

    async def _check(self) -> int | None:
        """Compare the outputs since the last check with another route's. Returns None when they
        agree (or nothing can check them), else the first wrong position, to rewind to."""
        for _ in range(ATTEMPTS):
            start, end = self.checked, self.session.position
            if start >= end or self.off or time.monotonic() < self._quiet_until:
                self.checked = end
                return None
            try:
                other = await self._shadow_outputs(start, end)
                if other is None:
                    self.checked = end
                    return None
                claimed = torch.cat(self.outputs, dim=1)[:, start:end]
                wire = self._codecs(start, end)
                peers = [*self._route_peers(start, end).values(), *self._shadow.route]
                errors = relative_errors(claimed, other, self._window_mask(start, end))
                bad = first_mismatch(errors, self.blame.bar(peers, codecs=wire))
                flip = None if bad is not None else await self._first_flip(
                    claimed, other, start, end, errors, self.blame.shift_bar(peers, codecs=wire),
                )
                if bad is None and flip is None:
                    self.checked = end
                    return None
                rewind = await self._mismatch(
                    start + (bad if flip is None else flip), end, float(errors.max()), flip is not None, wire
                )
                if rewind is None and flip is not None:
                    self.checked = end  # a near tie that honest rounding explains: nothing to redo
                    return None
            except PeerFailed as exc:
                self.session.failed(exc)
                await self._drop_shadow()
                continue
            except RouteError as exc:  # the swarm's records could not be read: no check this time
                log.warning("could not check the results of positions %d:%d: %s", start, end, exc)
                self.checked = end
                return None
            if rewind is not None:
                return rewind
        log.warning("could not check the results of positions %d:%d: the checking routes failed", start, end)
        self.checked = end
        return None

    async def _first_flip(
        self, claimed: torch.Tensor, other: torch.Tensor, start: int, end: int, errors: torch.Tensor, shift: float,
    ) -> int | None:
        """The first position of [start, end) that chose a token and where the client's head reads
        different greedy tokens from the two routes' outputs, or next-token distributions further
        apart than `shift` (total variation): a difference under the bar can still change the
        text, and a liar would aim for exactly that. Positions whose outputs differ by less than
        FLIP_FLOOR are not read: no token there turns on that little."""
        worst = errors.max(dim=0).values
        chose = [p - start for p in self._choosing(start, end) if worst[p - start] > FLIP_FLOOR]
        if self.logits is None or not chose:
            return None
        at = torch.tensor(chose)
        same, distance = await in_fresh_thread(self._read, claimed[:, at], other[:, at])
        differ = ~same | (distance > shift)
        mask = self._window_mask(start, end)
        if mask is not None:
            differ &= mask[:, at].bool()
        hits = differ.any(dim=0).nonzero()
        return None if hits.numel() == 0 else chose[int(hits[0, 0])]

    async def _near_tie(
        self, claimed: torch.Tensor, replayed: torch.Tensor | None, wire: frozenset[Codec] | None,
        route: tuple[PeerRecord, ...],
    ) -> bool:
        """Whether a flip at one position is honest rounding: the route's own hops, replayed, give
        its token again and a distribution within the bar of its own formats, or a state that
        differs from the claimed one by no more than the wire (`wire`: the codecs of both) and
        the compute dtype round (the same peers computed both, so their formats add nothing)."""
        if replayed is None:
            return True
        same, distance = await in_fresh_thread(self._read, claimed, replayed)
        if bool(same.all()) and float(distance.max()) <= self.blame.shift_bar(list(route), wire):
            return True
        return float(relative_errors(claimed, replayed).max()) <= tolerance(self.access.compression, self.dtype, (), wire)

    def _read(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whether the client's head chooses the same greedy token from final states `a` and `b`
        [batch, positions, hidden], and the total variation between the distributions it reads
        (both [batch, positions]); on a worker thread: a softmax over the vocabulary per row."""
        logits = self.logits(torch.cat([a, b]))
        rows = a.shape[0]
        return logits[:rows].argmax(dim=-1) == logits[rows:].argmax(dim=-1), total_variation(logits[:rows], logits[rows:])

    def _codecs(self, start: int, end: int) -> frozenset[Codec] | None:
        """The codecs the outputs of positions [start, end) depend on crossed the wire in, on the
        route that computed them and on the shadow, where the hops' receipts say (None: not known
        for all of them). Those of every earlier position count too: the hops' caches hold them,
        and attention reads them (a prefill sent rounded to float16 leaves 1e-4 to 2e-4 of error
        in later positions sent raw, on the default model)."""
        position, sessions = 0, set()
        for out, session in zip(self.outputs, self.computed_by):
            if position < end and position + out.shape[1] > start:
                sessions.add(session)
            position += out.shape[1]
        if len(sessions) != 1 or self._shadow is None:
            return None
        main, shadow = sessions.pop().signed.codecs(0, end), self._shadow.signed.codecs(0, end)
        return None if main is None or shadow is None else main | shadow

    def _choosing(self, start: int, end: int) -> list[int]:
        """The positions of [start, end) whose outputs chose a token: each step's last."""
        found, position = [], 0
        for out in self.outputs:
            position += out.shape[1]
            if start < position <= end:
                found.append(position - 1)
        return found

    async def keep(self, length: int) -> None:
        """Forget the outputs past `length` positions on this route too (a speculative step's
        rejected drafts). A check runs over positions decided before the step, so none is cut:
        should one be, it stops."""
        if self._running is not None and self._running_end > length:
            await self._stop_check()
        self.session.keep(length)
        self._cut(length)

    async def rewind(self, length: int) -> None:
        """Forget the outputs past `length` positions, with the session's inputs."""
        await self._stop_check()
        await self.session.rewind(length)
        self._cut(length)
        await self._drop_shadow()

    def _cut(self, length: int) -> None:
        self.outputs = cut(self.outputs, length)
        self.routes = self.routes[:len(self.outputs)]
        self.computed_by = self.computed_by[:len(self.outputs)]
        self.checked = min(self.checked, length)

    async def close(self) -> None:
        await self._stop_check()
        await self._drop_shadow()

    # the checking route

    def _route_peers(self, start: int, end: int) -> dict[str, PeerRecord]:
        """The records of the peers that computed positions [start, end)."""
        peers, position = {}, 0
        for out, route in zip(self.outputs, self.routes):
            if position < end and position + out.shape[1] > start:
                peers.update((r.peer_id, r) for r in route)
            position += out.shape[1]
        return peers

    def _step_at(self, position: int) -> int:
        """The index of the step that computed `position` (the last step's past the end)."""
        at = 0
        for i, out in enumerate(self.outputs):
            at += out.shape[1]
            if position < at:
                return i
        return len(self.outputs) - 1

    async def _shadow_outputs(self, start: int, end: int) -> torch.Tensor | None:
        primary = set(self._route_peers(start, end))
        if self._shadow is not None and {r.peer_id for r in self._shadow.route} & primary - self._shadow_reused:
            await self._drop_shadow()  # the session moved onto the shadow's peers
        if self._shadow is None:
            records = await self.blame.records()
            await self.blame.distrust.refresh()
            route = await self._checking_route(records, primary)
            reused = set() if route is None else {r.peer_id for r in route} & primary
            if route is None or len(reused) == len(route):
                if not self.access.reach.asking():  # else an answer may yet bring a second route
                    self._warn_unchecked([] if route is None else unchecked_layers(route, primary))
                    self._quiet_until = time.monotonic() + QUIET_SECONDS
                return None
            self._warn_unchecked(unchecked_layers(route, primary))
            self._shadow = await self.blame.open(route, self.session.length)
            self._shadow_reused, self._shadow_length = reused, 0
        inputs, positions = self._inputs(self._shadow_length, end)
        mask = None if self.mask is None else self.mask[:, :end]
        out = await self._shadow.step(inputs, LONG_STEP_TIMEOUT, mask, positions)
        done, self._shadow_length = self._shadow_length, end
        return out[:, start - done:]

    async def _checking_route(self, records: list[PeerRecord], primary: set[str]) -> list[PeerRecord] | None:
        """The checking route among peers that answer a ping: records that claim anything and never
        answer cost a ping each, not a check (unscreened, the fastest claims would win every
        check, and each would fail only after its timeout). Peers whose pings the session's own
        route search left running are left out too: a check waits for no stranger's answer."""
        access = self.access
        avoid, deadline = self.blame.avoided(records) | access.reach.asking(), time.monotonic() + SCREEN_BUDGET
        while True:
            route = alternative_route(
                records, access.num_layers, primary, avoid, access.health.observed, self.session.length,
                self.session.first,
            )
            unpinged = [r for r in route or () if r.peer_id not in primary and not access.reach.fresh(r.peer_id)]
            if not unpinged or time.monotonic() > deadline:
                return route
            silent = await access.reach.screen(access.swarm.transport, unpinged)
            for record in unpinged:
                if record.peer_id in silent:
                    access.health.failed(record.peer_id, record.since)
            avoid |= silent

    def _warn_unchecked(self, ranges: list[tuple[int, int]]) -> None:
        """Once per process and range (every request would say it again), the new ranges in one line."""
        new = [(start, end) for start, end in ranges if self.access.first_time(f"unchecked {start}:{end}")]
        if new:
            others = "no other peer you trust (--trusted-peers)" if self.access.trusted is not None else "no other peer"
            log.warning("layers %s cannot be verified: %s serves them", format_ranges(new), others)

    async def _drop_shadow(self) -> None:
        shadow, self._shadow, self._shadow_length = self._shadow, None, 0
        if shadow is not None:
            await shadow.close()

    def _inputs(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The session's inputs (embeddings, position ids or None) for positions [start, end)."""
        hidden, ids = joined(self.session.history)
        return hidden[:, start:end], None if ids is None else ids[:, start:end]

    def _window_mask(self, start: int, end: int) -> torch.Tensor | None:
        return None if self.mask is None else self.mask[:, start:end]

    # finding the peer at fault

    async def _mismatch(
        self, position: int, end: int, error: float, flip: bool = False, wire: frozenset[Codec] | None = None
    ) -> int | None:
        """The route's output at `position` differs from the checking route's (with `flip`, only in
        the token it chooses): find out who is wrong. Returns the position to rewind to, or None
        when the checking route was the wrong one, or, for a flip, when it is a near tie that
        honest rounding decides either way (`_near_tie`)."""
        checker = set() if self._shadow is None else {r.peer_id for r in self._shadow.route}
        await self._drop_shadow()
        at = self._step_at(position)
        route, computed = self.routes[at], self.computed_by[at]
        log.info(
            "results at position %d differ between two routes (%s); checking hop by hop",
            position, "in the token chosen or its probability" if flip else f"relative error {error:.2g}",
        )
        hidden, positions = self._inputs(0, end)
        every = None if self.mask is None else self.mask[:, :end]
        agreed, caught, sources = await self.blame.localize(list(route), hidden, positions, every)
        if caught & {r.peer_id for r in route}:
            return position
        claimed = torch.cat(self.outputs, dim=1)[:, position:end]
        # what the claimed states and their replay crossed the wire in, where receipts say
        wire = None if wire is None or self.blame.wire is None else wire | self.blame.wire
        if flip and await self._near_tie(
            claimed[:, :1], None if agreed is None else agreed[:, position:position + 1], wire, route,
        ):
            log.info("two routes' next tokens or their odds differ at position %d, a near tie the route's replay explains", position)
            return None
        mask = self._window_mask(position, end)
        bar = self.blame.bar([*route, *sources], codecs=wire)
        if not flip and agreed is not None and first_mismatch(relative_errors(claimed, agreed[:, position:end], mask), bar) is None:
            self.blame.ban(checker - {r.peer_id for r in route})  # the checking route erred, and not on replay
            return None
        if await self.blame.judge_receipts(computed, hidden, positions, every):
            return position  # a hop that replayed honestly signed the wrong result
        suspects = {r.peer_id for r in route} - self._shadow_reused
        log.warning(
            "the results at position %d were wrong, but no peer repeated the error; avoiding peers %s for a while",
            position, ", ".join(sorted(suspects)),
        )
        self.blame.ban(suspects)
        return position
