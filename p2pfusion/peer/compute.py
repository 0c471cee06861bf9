"""A stage's steps on its compute thread: decode steps batched across sessions, prefills in
chunks, backward passes, and the memory training sessions keep between them."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

import torch

from p2pfusion.errors import RequestError
from p2pfusion.models.formats import QUANTS
from p2pfusion.models.threads import SMALL_STEP_ROWS
from p2pfusion.peer.scheduler import Scheduler, Stats
from p2pfusion.peer.session import Session, StepInputs
from p2pfusion.peer.threads import DecodeSettings, DecodeThreads

log = logging.getLogger(__name__)

PREFILL_CHUNK = 256  # positions per chunk of a prefill when no other session waits on this peer
SHARED_CHUNK_SECONDS = 0.05  # a chunk's compute while other sessions are open: what a step that runs alone may wait
MIN_CHUNK = 8
FIRST_SHARED_CHUNK = 32  # before this peer has timed a prefill
# Kept warm, the compute thread spins after a small step for twice the recent gap between steps,
# so that a session's next step finds it awake, and at most this long: a client that went quiet
# gets the cores back
LONGEST_WARM = 0.1
GRAIN = 32768  # elements per thread below which torch runs an op on fewer threads (at::internal::GRAIN_SIZE)


def spin(threads: int, until: float, stop: threading.Event | None = None) -> None:
    """Keep the calling thread's OpenMP workers busy until `until` (perf_counter) or `stop`: each
    pass is an op that torch splits across `threads`, microseconds long, so a step that arrives
    finds every worker awake."""
    kick = torch.zeros(threads * GRAIN)
    while time.perf_counter() < until and not (stop is not None and stop.is_set()):
        kick.add_(1.0)


class StageCompute:
    def __init__(
        self,
        decode: DecodeSettings | None,
        training_memory: int,
        prefill_chunk: int = PREFILL_CHUNK,
        shared: Callable[[], bool] = lambda: False,
    ):
        self.scheduler = Scheduler()
        self._all_threads = torch.get_num_threads()
        self._decode = DecodeThreads(decode or DecodeSettings(self._all_threads, False), self._all_threads)
        self._small_threads = self._decode.start  # what the latest small step ran on, which spinning keeps warm
        self._warm = decode is not None and decode.warm and decode.threads > 1
        self._shares_host = False  # other peers compute on this machine's cores (peer/upkeep.py)
        self._small_done: float | None = None  # when the last small step ended
        self._gap = LONGEST_WARM / 2  # between a small step's end and the next one's start, lately
        self.prefill_chunk = prefill_chunk
        self._shared = shared  # whether other sessions are open here, whose steps a long chunk would hold up
        self._row_seconds: float | None = None  # a prefill position's compute, lately
        # activations kept between training steps' forward and backward passes, across sessions;
        # beyond this, a backward pass computes its forward again instead
        self.training_memory = training_memory
        self.graph_bytes = 0

    @property
    def stats(self) -> Stats:
        return self.scheduler.stats

    @property
    def warm(self) -> bool:
        """Whether small steps keep the compute thread's threads spinning until the next one."""
        return self._warm and not self._shares_host

    def share_host(self, shared: bool) -> None:
        if shared != self._shares_host and self._warm:
            log.info("%s: one-token steps %s", "another peer serves from this machine" if shared
                     else "no other peer serves from this machine", "no longer spin" if shared else "spin again")
        self._shares_host = shared
        if shared:
            self.scheduler.stop_warm()

    @property
    def idle(self) -> bool:
        """Nothing runs on the compute thread, and nothing waits for it."""
        return self.scheduler.idle

    async def forward(self, session: Session, inputs: StepInputs) -> tuple[torch.Tensor, float]:
        """A step's output and its seconds (queueing included). A decode step runs batched with the
        other sessions' that are ready at the same time. Chunks of one step run in order, but other
        sessions' steps may run between them; the KV cache makes the result the same."""
        t0 = time.perf_counter()
        batch, tokens = inputs.hidden.shape[:2]
        small = not session.training and batch * tokens <= SMALL_STEP_ROWS
        if small and self._small_done is not None:
            self._gap = 0.7 * self._gap + 0.3 * (t0 - self._small_done)
        if session.training:
            out = await self.scheduler.run(session.client, batch * tokens, True, self._train_forward, session, inputs)
        elif self._batchable(session, inputs) and self._shared():
            out = await self.scheduler.run_batched(
                session.client, batch, id(session.stage), self._infer_batch, (session, inputs),
                None if inputs.cohort is None else (inputs.cohort.tag, inputs.cohort.size),
            )
        else:
            outs, a = [], 0
            beside = self._lets_others_run(session, inputs)
            while a < tokens:
                b = min(tokens, a + max(1, self._chunk_rows() // batch))
                rows = batch * (b - a)
                bulk = tokens > 1 and rows > SMALL_STEP_ROWS  # a few positions (drafts) run as decode steps do
                outs.append(await self.scheduler.run(
                    session.client, rows, bulk, self._infer, session, inputs, a, b, alone=not beside
                ))
                a = b
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        done = time.perf_counter()
        if small and self.warm:
            self._small_done = done
            self.scheduler.keep_warm(functools.partial(spin, self._small_threads), done + min(LONGEST_WARM, 2 * self._gap))
        return out, done - t0

    @staticmethod
    def _batchable(session: Session, inputs: StepInputs) -> bool:
        """A one-token step of a session that has a cache to batch with, and no adapter (an adapter
        hooks the shared module for its own step; such sessions run alone)."""
        cache = session.cache
        return (
            session.stage.batchable and inputs.params is None and inputs.hidden.shape[1] == 1
            and cache.length > 0 and cache.rows == inputs.hidden.shape[0]
        )

    def _chunk_rows(self) -> int:
        """Positions in the next prefill chunk: all the usual ones when no other session is open
        here; else as many as run in SHARED_CHUNK_SECONDS, so the others' steps are not held up."""
        if not self._shared():
            return self.prefill_chunk
        if self._row_seconds is None:
            return FIRST_SHARED_CHUNK
        return max(MIN_CHUNK, min(self.prefill_chunk, int(SHARED_CHUNK_SECONDS / self._row_seconds)))

    async def backward(self, session: Session, inputs: StepInputs, grad: torch.Tensor):
        t0 = time.perf_counter()
        try:
            rows = inputs.hidden.shape[0] * inputs.hidden.shape[1]
            result = await self.scheduler.run(session.client, rows, True, self._backward, session, inputs, grad)
        finally:
            self.release_graph(inputs)
        return result, time.perf_counter() - t0

    @staticmethod
    def _lets_others_run(session: Session, inputs: StepInputs) -> bool:
        """Whether an inference step may run beside other sessions' decode steps: it hooks no
        adapter on the shared module, its cache shares no buffer with other sessions' (it never
        ran batched), and its stage holds its weights as plain float tensors on the CPU (no
        quantized kernel's or device's own state to race on)."""
        stage = session.stage
        return (
            not session.training and inputs.params is None and stage.batchable and stage.device.type == "cpu"
            and stage.format not in QUANTS and not session.cache.grouped
        )

    def _threads_for(self, rows: int) -> int:
        """Runs just before each step, on the thread that runs it: torch's count is OpenMP's, kept per
        thread once that thread has run torch, so a decode step beside a chunk keeps its own."""
        threads = self._decode.threads(rows) if rows <= SMALL_STEP_ROWS else self._all_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def _timed(self, rows: int, threads: int, started: float) -> None:
        """A small step's forward, timed as served, for `DecodeThreads`."""
        self._small_threads = threads
        said = self._decode.timed(rows, threads, time.perf_counter() - started)
        if said:
            log.info("one-token steps: %s", said)

    def forget(self) -> None:
        """A session ended."""
        self.scheduler.stop_warm()  # the sessions still open warm it again with their next steps

    def keep_graph(self, inputs: StepInputs) -> None:
        if inputs.graph is not None and self.graph_bytes + inputs.graph.nbytes > self.training_memory:
            inputs.graph = None  # its memory goes now; the backward pass will recompute
        self.graph_bytes += 0 if inputs.graph is None else inputs.graph.nbytes

    def release_graph(self, inputs: StepInputs) -> None:
        if inputs.graph is not None:
            self.graph_bytes -= inputs.graph.nbytes
            inputs.graph = None

    def _infer(self, session: Session, inputs: StepInputs, a: int, b: int) -> torch.Tensor:
        """Tokens [a, b) of an inference step, after the session's cache and the step's tokens before a."""
        rows = inputs.hidden.shape[0] * (b - a)
        threads = self._threads_for(rows)
        offset = session.position + a
        mask = None if inputs.mask is None else inputs.mask[:, :session.position + b]
        positions = None if inputs.positions is None else inputs.positions[:, a:b]
        started = time.perf_counter()
        out = session.stage.forward(inputs.hidden[:, a:b], offset, session.cache, mask, positions, inputs.params)
        if rows <= SMALL_STEP_ROWS:
            self._timed(rows, threads, started)
        else:  # a prefill's pace, which sizes the chunks of the next ones
            pace = (time.perf_counter() - started) / rows
            self._row_seconds = pace if self._row_seconds is None else 0.7 * self._row_seconds + 0.3 * pace
        return out

    def _infer_batch(self, items: list[tuple[Session, StepInputs]]) -> list[torch.Tensor]:
        """One-token steps of several sessions of one stage, as one forward."""
        if len(items) == 1:
            session, inputs = items[0]
            return [self._infer(session, inputs, 0, 1)]
        rows = sum(inputs.hidden.shape[0] for _, inputs in items)
        threads = self._threads_for(rows)
        stage = items[0][0].stage
        started = time.perf_counter()
        outs = stage.forward_batch(
            [inputs.hidden for _, inputs in items],
            [session.cache for session, _ in items],
            [inputs.mask for _, inputs in items],
            [inputs.positions for _, inputs in items],
        )
        if rows <= SMALL_STEP_ROWS:
            self._timed(rows, threads, started)
        return outs

    def _train_forward(self, session: Session, inputs: StepInputs) -> torch.Tensor:
        self._threads_for(inputs.hidden.shape[0] * inputs.hidden.shape[1])
        stage = session.stage
        if self.graph_bytes >= self.training_memory:  # no room for a graph: the backward pass recomputes
            return stage.forward(inputs.hidden, 0, None, inputs.mask, inputs.positions, inputs.params)
        inputs.graph = stage.forward_for_backward(inputs.hidden, inputs.mask, inputs.positions, inputs.params)
        return inputs.graph.output.detach().cpu()

    def _backward(self, session: Session, inputs: StepInputs, grad: torch.Tensor):
        """The step's gradients. Its inputs, parameters and output gradient were checked finite, so
        NaN or infinity here is an overflow, which the same inputs give again, or a fault of this
        machine's compute (a race, a flaky card), which they need not: an adapter's step is
        computed once more from the kept inputs before its gradients are refused. A replica's
        weights have already added the bad ones to their `.grad`: its replica refuses that step."""
        self._threads_for(inputs.hidden.shape[0] * inputs.hidden.shape[1])
        stage = session.stage
        graph = inputs.graph or stage.forward_for_backward(inputs.hidden, inputs.mask, inputs.positions, inputs.params)
        grad_in, params = stage.backward(graph, grad)
        if _finite(grad_in, params) or stage.trains_weights:
            return grad_in, params
        log.warning("a backward pass on layers %d:%d gave NaN or infinity from finite inputs; computing it again",
                    stage.start, stage.end)
        graph = stage.forward_for_backward(inputs.hidden, inputs.mask, inputs.positions, inputs.params)
        grad_in, params = stage.backward(graph, grad)
        if not _finite(grad_in, params):
            raise RequestError(f"backward: layers {stage.start}:{stage.end} compute NaN or infinity from this step's inputs")
        log.warning("the backward pass on layers %d:%d, computed again, is finite", stage.start, stage.end)
        return grad_in, params

    def shutdown(self) -> None:
        self.scheduler.shutdown()


def _finite(grad_in: torch.Tensor, params: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in (grad_in, *params))
