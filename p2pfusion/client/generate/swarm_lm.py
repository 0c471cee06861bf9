"""Many generations at once from one process: `SwarmLM` for asyncio code, `SwarmLMSync` for threads.

Both are thin around the generation engine the CLI uses (`RemoteCausalLM`, generate/causal_lm.py)
on one client core (client/core.py): one swarm node and transport, one head and tokenizer, and one
record of peers' health, speed and trust serve every call, and each call gets a session of its
own. The synchronous API runs them on a loop of its own thread (client/loop.py), so calls from
many threads at once all run concurrently there, and nothing of the core (tokenizer included) is
ever used by two threads at once.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.generate.conversation import Generated
from p2pfusion.client.generate.stops import MAX_STOP_CHARS, MAX_STOPS, StopText, cut_at_stop
from p2pfusion.client.generate.text import TextPieces
from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.client.options import ClientOptions
from p2pfusion.client.tune.adapter import Adapter
from p2pfusion.errors import RequestError
from p2pfusion.models.source import ModelSource

# text, token ids, or chat messages ({"role": ..., "content": ...}) rendered with the chat template
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


@dataclass
class Piece:
    """One token of a stream, as it comes (or once checked, with `hold_until_checked`)."""

    token_id: int
    # what it adds to the text: empty while it ends inside a multi-byte character or may begin a
    # stop string (that text comes with a later piece; where the generation ends first, the
    # text the pieces lack is the end of the whole `Generated.text`)
    text: str
    seconds: float  # from the call's start to this token


@dataclass
class Correction:
    """Verification found that peers computed the results behind some tokens already streamed
    wrong (client/checks/verifier.py): only the first `tokens` of them stand, whose text is `text`
    (all the pieces' text so far after this correction); the corrected pieces follow."""

    tokens: int
    text: str
    seconds: float  # from the call's start to the correction


@dataclass
class GenerationRequest:
    """A generation's arguments, checked before any network traffic."""

    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    seed: int | None
    stop_at_eos: bool
    adapter: Adapter | None
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # the text ends before the first of these (client/generate/stops.py)
    hold: bool = False  # stream only tokens whose results are checked: no Correction ever comes


class SwarmLM:
    """The asyncio API. `await SwarmLM.connect(initial_peers)`, then `generate` or `stream` from as
    many tasks as you like; `close` (or `async with`) leaves the swarm."""

    def __init__(self, model: RemoteCausalLM, owns_swarm: bool = False):
        if model.core.swarm is None:
            raise RequestError("this model is not attached to a swarm")
        self.model = model
        self._owns_swarm = owns_swarm  # False: the swarm node is the caller's to shut down

    @classmethod
    async def connect(
        cls,
        initial_peers: Sequence[str],
        model: str | ModelSource | None = None,
        options: ClientOptions | None = None,
        **settings,
    ) -> SwarmLM:
        """Load the client's part of `model` (a folder, a .gguf file, a Hub id, or None for the
        default model) and join the swarm that `initial_peers` belong to. The client's options come
        as `options` or as keyword settings: `verify` (the chance that a step's results are checked
        against other peers; 0: never; each generation's end always is), `swarm_secret` (a private
        swarm's secret file), `trusted_peers` (route only through these peers: peer ids, or a
        trusted-peers file's path), `local_layers` (run at least the first K layers here, so no peer
        sees the token embeddings), `min_precision` (the least precise weight format a route may
        use; "float32": exact), `compression`, `dtype` (client/options.py)."""
        options = ClientOptions.of(options, settings)
        return cls(await RemoteCausalLM.connect(initial_peers, model, options), owns_swarm=True)

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def load_adapter(self, path: str | Path) -> Adapter:
        """Trained parameters saved by `save_adapter` (or PEFT), to pass as `adapter=` to calls."""
        return Adapter.load(path, self.model.config, self.model.source)

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """The token ids of a prompt; text with `chat` becomes one user message."""
        model = self.model
        if isinstance(prompt, str):
            return model.encode(prompt, chat)
        items = list(prompt) if isinstance(prompt, Sequence) else None
        if items and all(isinstance(item, Mapping) for item in items):
            for item in items:
                if not isinstance(item.get("role"), str) or not isinstance(item.get("content"), str):
                    raise RequestError("a chat message is {'role': str, 'content': str}")
            ids = model.chat_ids([{"role": item["role"], "content": item["content"]} for item in items])
        elif items is not None and all(isinstance(item, int) and not isinstance(item, bool) for item in items):
            vocab = model.head.get_input_embeddings().num_embeddings
            if any(not 0 <= item < vocab for item in items):
                raise RequestError(f"token ids must be in 0..{vocab - 1}")
            ids = items
        else:
            raise RequestError("a prompt is text, a list of token ids or a list of chat messages")
        model.check_prompt(ids)
        return ids

    def request(
        self, prompt: Prompt, max_new_tokens: int = 64, temperature: float = 0.0, seed: int | None = None,
        chat: bool = False, stop_at_eos: bool = True, adapter: Adapter | None = None, top_p: float = 1.0,
        stop: str | Sequence[str] = (), hold_until_checked: bool = False,
    ) -> GenerationRequest:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
            raise RequestError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 <= top_p <= 1:
            raise RequestError(f"top_p must be a number from 0 to 1, got {top_p!r}")
        stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, Sequence) else None
        if stops is None or not all(isinstance(s, str) and s for s in stops):
            raise RequestError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise RequestError(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError(f"seed must be an integer, got {seed!r}")
        if adapter is not None and not isinstance(adapter, Adapter):
            raise RequestError("adapter must be an Adapter (see load_adapter)")
        ids = self.encode(prompt, chat)
        if not isinstance(hold_until_checked, bool):
            raise RequestError(f"hold_until_checked must be true or false, got {hold_until_checked!r}")
        return GenerationRequest(
            ids, max_new_tokens, float(temperature), seed, stop_at_eos, adapter, float(top_p), stops, hold_until_checked
        )

    async def generate(
        self, prompt: Prompt, max_new_tokens: int = 64, temperature: float = 0.0, seed: int | None = None,
        *, chat: bool = False, stop_at_eos: bool = True, adapter: Adapter | None = None, top_p: float = 1.0,
        stop: str | Sequence[str] = (),
    ) -> Generated:
        """Up to `max_new_tokens` tokens after `prompt`, greedy at temperature 0 (sampled within the
        nucleus `top_p` otherwise); the text ends before the first `stop` string, and the tokens do
        soon after it. The result holds the tokens, their text and when each came (`token_times`,
        `latencies`); every result in it is checked at the client's verification rate."""
        request = self.request(prompt, max_new_tokens, temperature, seed, chat, stop_at_eos, adapter, top_p, stop)
        return await self.run(request)

    async def run(
        self, request: GenerationRequest, on_piece: Callable[[Piece | Correction], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> Generated:
        """`request`'s generation; `on_piece` gets each token as it comes (once checked, with the
        request's `hold`), with the text it adds, held back while that text may begin one of the
        request's stop strings, and a Correction when verification withdraws tokens it got.
        `stop()`, asked after each token, ends the generation early."""
        started = time.perf_counter()
        pieces = TextPieces(self.tokenizer)
        stops = StopText(request.stop)

        def shown(token: int) -> None:
            text = stops.add(pieces.add(token))
            if on_piece is not None:
                on_piece(Piece(token, text, time.perf_counter() - started))

        def withdrawn(kept: int) -> None:
            nonlocal stops
            stops = StopText(request.stop)
            text = stops.add(pieces.keep(kept))  # what the kept pieces showed, held text held again
            if on_piece is not None:
                on_piece(Correction(kept, text, time.perf_counter() - started))

        def stopping() -> bool:
            return stops.stopped or (stop is not None and stop())

        watched = on_piece is not None or bool(request.stop)
        result = await self.model.generate(
            request.input_ids, request.max_new_tokens, request.temperature, request.seed, shown if watched else None,
            request.stop_at_eos, adapter=request.adapter, top_p=request.top_p,
            stop=stopping if request.stop or stop is not None else None, on_rewind=withdrawn if watched else None,
            hold=request.hold,
        )
        result.text = cut_at_stop(result.text, request.stop)
        return result

    def stream(
        self, prompt: Prompt, max_new_tokens: int = 64, temperature: float = 0.0, seed: int | None = None,
        *, chat: bool = False, stop_at_eos: bool = True, adapter: Adapter | None = None, top_p: float = 1.0,
        stop: str | Sequence[str] = (), hold_until_checked: bool = False,
    ) -> TokenStream:
        """Like `generate`, token by token: `async for piece in client.stream(...)`; the stream's
        `result` is the whole Generated once it ends. Pieces come as tokens are chosen, while
        verification checks their results beside the generation; when a check finds some wrong, a
        Correction comes, then the corrected pieces. With `hold_until_checked`, pieces come only
        once checked (a stream that stalls while checks run, and is never corrected)."""
        request = self.request(
            prompt, max_new_tokens, temperature, seed, chat, stop_at_eos, adapter, top_p, stop, hold_until_checked
        )
        return TokenStream(self, request)

    async def close(self) -> None:
        if self._owns_swarm:
            await self.model.core.leave()

    async def __aenter__(self) -> SwarmLM:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class TokenStream:
    """A generation's tokens as they come; leaving it early (`aclose`, `async with`) ends the generation."""

    def __init__(self, lm: SwarmLM, request: GenerationRequest):
        self._lm = lm
        self.request = request
        self._queue: asyncio.Queue[Piece | Correction | None] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._ended = False
        self.result: Generated | None = None

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> Piece | Correction:
        if self._ended:
            raise StopAsyncIteration
        if self._task is None:
            # a piece reaches the reader one turn of the loop later: the steps that this turn sends
            # for the client's other sessions (a cohort, client/generate/lockstep.py) go out first,
            # not after each reader's work on the piece before them (an HTTP event, for the API)
            deliver = functools.partial(asyncio.get_running_loop().call_soon, self._queue.put_nowait)
            self._task = asyncio.create_task(self._lm.run(self.request, deliver, lambda: self._ended))
            self._task.add_done_callback(lambda _: self._queue.put_nowait(None))  # after the last piece: call_soon is in order
        piece = await self._queue.get()
        if piece is None:
            self._ended = True
            self.result = await self._task  # its error, if it failed, is the caller's
            raise StopAsyncIteration
        return piece

    async def aclose(self) -> None:
        self._ended = True  # the generation asks after each token: it ends even if the cancellation is lost
        task = self._task
        if task is not None and not task.done():
            # the generation closes its session on its way out. Before Python 3.12 a cancellation
            # that lands as an awaited `asyncio.wait_for` completes is lost; the flag above is not.
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def __aenter__(self) -> TokenStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class SwarmLMSync:
    """The synchronous API, safe to call from many threads at once: every call runs on one event
    loop thread of its own, where the calls of all threads run concurrently."""

    def __init__(
        self, initial_peers: Sequence[str], model: str | ModelSource | None = None, options: ClientOptions | None = None,
        **settings,
    ):
        """As `SwarmLM.connect`."""
        options = ClientOptions.of(options, settings)
        self._loop = BackgroundLoop("p2pfusion-lm")
        try:
            self.lm = self._run(SwarmLM.connect(initial_peers, model, options))
        except BaseException:
            self._loop.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self._loop.run(coro)

    @property
    def tokenizer(self):
        return self._run(_value(lambda: self.lm.tokenizer))

    def load_adapter(self, path: str | Path) -> Adapter:
        return self.lm.load_adapter(path)

    def generate(
        self, prompt: Prompt, max_new_tokens: int = 64, temperature: float = 0.0, seed: int | None = None,
        *, chat: bool = False, stop_at_eos: bool = True, adapter: Adapter | None = None, top_p: float = 1.0,
        stop: str | Sequence[str] = (),
    ) -> Generated:
        return self._run(self.lm.generate(
            prompt, max_new_tokens, temperature, seed, chat=chat, stop_at_eos=stop_at_eos, adapter=adapter,
            top_p=top_p, stop=stop,
        ))

    def stream(
        self, prompt: Prompt, max_new_tokens: int = 64, temperature: float = 0.0, seed: int | None = None,
        *, chat: bool = False, stop_at_eos: bool = True, adapter: Adapter | None = None, top_p: float = 1.0,
        stop: str | Sequence[str] = (), hold_until_checked: bool = False,
    ) -> Iterator[Piece | Correction]:
        """The tokens as they come (see `SwarmLM.stream`); breaking out of the loop ends the generation."""
        stream = self._run(_value(lambda: self.lm.stream(
            prompt, max_new_tokens, temperature, seed, chat=chat, stop_at_eos=stop_at_eos, adapter=adapter,
            top_p=top_p, stop=stop, hold_until_checked=hold_until_checked,
        )))
        try:
            while (piece := self._run(_next(stream))) is not None:
                yield piece
        finally:
            self._run(stream.aclose())

    def close(self) -> None:
        if not self._loop.loop.is_closed():
            try:
                self._run(self.lm.close())
            finally:
                self._loop.close()

    def __enter__(self) -> SwarmLMSync:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _value(make: Callable[[], Any]) -> Any:
    """`make()` on the loop's thread, where everything of the core runs."""
    return make()


async def _next(stream: TokenStream) -> Piece | Correction | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
