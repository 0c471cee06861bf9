"""A stage's steps on its compute thread: forwards (prefills in chunks), backward passes, and the
memory training sessions keep between them."""

from __future__ import annotations

import time

import torch

from p2pfusion.peer.scheduler import Scheduler, chunks
from p2pfusion.peer.session import Session, StepInputs

SMALL_STEP_ROWS = 8  # steps of at most this many positions (batch x tokens) run on `decode_threads`
PREFILL_CHUNK = 256  # positions per chunk of a prefill: a decoding step waits for at most one


class StageCompute:
    def __init__(self, decode_threads: int | None, training_memory: int, prefill_chunk: int = PREFILL_CHUNK):
        self.scheduler = Scheduler()
        self._all_threads = torch.get_num_threads()
        self._decode_threads = decode_threads or self._all_threads
        self.prefill_chunk = prefill_chunk
        # activations kept between training steps' forward and backward passes, across sessions;
        # beyond this, a backward pass computes its forward again instead
        self.training_memory = training_memory
        self.graph_bytes = 0

    async def forward(self, session: Session, inputs: StepInputs) -> tuple[torch.Tensor, float]:
        """A step's output and its seconds (queueing included). Chunks of one step run in order,
        but other sessions' steps may run between them; the KV cache makes the result the same."""
        t0 = time.perf_counter()
        batch, tokens = inputs.hidden.shape[:2]
        if session.training:
            out = await self._run(session, batch * tokens, self._train_forward, session, inputs)
        else:
            outs = [
                await self._run(session, batch * (b - a), self._infer, session, inputs, a, b)
                for a, b in chunks(tokens, batch, self.prefill_chunk)
            ]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        session.compute_seconds = time.perf_counter() - t0
        return out, session.compute_seconds

    async def backward(self, session: Session, inputs: StepInputs, grad: torch.Tensor):
        t0 = time.perf_counter()
        try:
            rows = inputs.hidden.shape[0] * inputs.hidden.shape[1]
            result = await self._run(session, rows, self._backward, session, inputs, grad)
        finally:
            self.release_graph(inputs)
        session.compute_seconds = time.perf_counter() - t0
        return result, session.compute_seconds

    async def _run(self, session: Session, rows: int, fn, *args):
        if self._runs_inline(session, rows):
            return fn(*args)
        return await self.scheduler.run(session.source, rows, fn, *args)

    def _runs_inline(self, session: Session, rows: int) -> bool:
        """A decoding step of a token or two runs on the event loop's own thread: handing it to the
        compute thread and back wakes two threads, which cost 0.3-0.7 ms of a 12 ms step here
        (docs/benchmarks.md). Only while the compute thread is idle, because steps must not
        interleave: an adapter hooks the shared module for the length of its step."""
        return not session.training and self.scheduler.idle and rows <= SMALL_STEP_ROWS

    def _threads_for(self, rows: int) -> None:
        """Runs just before each step; steps never overlap, so torch's process-wide setting is theirs."""
        threads = self._decode_threads if rows <= SMALL_STEP_ROWS else self._all_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

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
        self._threads_for(inputs.hidden.shape[0] * (b - a))
        offset = session.length + a
        mask = None if inputs.mask is None else inputs.mask[:, :session.length + b]
        positions = None if inputs.positions is None else inputs.positions[:, a:b]
        return session.stage.forward(inputs.hidden[:, a:b], offset, session.cache, mask, positions, inputs.adapter)

    def _train_forward(self, session: Session, inputs: StepInputs) -> torch.Tensor:
        self._threads_for(inputs.hidden.shape[0] * inputs.hidden.shape[1])
        stage = session.stage
        if self.graph_bytes >= self.training_memory:  # no room for a graph: the backward pass recomputes
            return stage.forward(inputs.hidden, 0, None, inputs.mask, inputs.positions, inputs.adapter)
        inputs.graph = stage.forward_for_backward(inputs.hidden, inputs.mask, inputs.positions, inputs.adapter)
        return inputs.graph.output.detach().cpu()

    def _backward(self, session: Session, inputs: StepInputs, grad: torch.Tensor):
        self._threads_for(inputs.hidden.shape[0] * inputs.hidden.shape[1])
        stage = session.stage
        graph = inputs.graph or stage.forward_for_backward(inputs.hidden, inputs.mask, inputs.positions, inputs.adapter)
        return stage.backward(graph, grad)

    def shutdown(self) -> None:
        self.scheduler.shutdown()
