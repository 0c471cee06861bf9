"""Chat completions and completions: an OpenAI request becomes one generation of `SwarmLM`, in a
session of its own, and its result a JSON answer or a stream of server-sent events.

A stream's response starts only once its first token came, so that anything failing before it (a
gap in the swarm, a prompt too long for the peers) is answered with its own status and not as a
200 stream that breaks. A client that goes away, mid-stream or while it waits, ends its generation
at once, and with it the session on every peer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from pydantic import BaseModel
from sse_starlette import EventSourceResponse

from p2pfusion.api import schemas
from p2pfusion.api.errors import APIError, from_core, unknown_model, unsupported
from p2pfusion.api.guard import APILimits, Users, user_of
from p2pfusion.client.generate.conversation import Generated
from p2pfusion.client.generate.swarm_lm import Correction, GenerationRequest, Piece, SwarmLM, TokenStream
from p2pfusion.client.route.session import serving
from p2pfusion.errors import P2PFusionError

log = logging.getLogger(__name__)

COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for completions (chat's is the rest of the context)
ROLES = {"developer": "system"}  # roles of OpenAI's API that chat templates know by another name
CLIENT_GONE = 499  # the status no one reads, of a request whose client left (nginx's name for it)
T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


@dataclass
class Job:
    """One request on its way: what it asked for, and how its answer is labelled."""

    id: str
    created: int
    chat: bool
    request: GenerationRequest
    streamed: bool
    include_usage: bool
    prompt_param: str  # the request's field holding the prompt, for errors about it


class Completions:
    def __init__(self, lm: SwarmLM, names: list[str], limits: APILimits):
        self.lm = lm
        self.names = names  # what a request's `model` may be: the display name, then the swarm key
        eos = lm.model.config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.keys = limits.api_keys
        self.users = Users(limits.requests_per_user)
        # one thread tokenizes, off the event loop: a long prompt takes seconds, and a tokenizer is
        # not safe to share between threads
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def chat(self, body: schemas.ChatCompletionRequest, request: Request) -> Response:
        self._check(body)
        messages = []
        for i, message in enumerate(body.messages):
            text = message.text()
            if text is None:
                raise unsupported(f"messages.{i}.content", "only text content is supported")
            messages.append({"role": ROLES.get(message.role, message.role), "content": text})
        wanted = body.max_completion_tokens or body.max_tokens
        return await self._serve(request, partial(self._job, messages, wanted, body, "messages"))

    async def complete(self, body: schemas.CompletionRequest, request: Request) -> Response:
        self._check(body)
        return await self._serve(
            request, partial(self._job, body.single_prompt(), body.max_tokens or COMPLETION_TOKENS, body, "prompt")
        )

    async def _serve(self, request: Request, job: Callable[[], Awaitable[Job]]) -> Response:
        """The answer to the job `job()` makes, counted against its user while it runs: until the
        answer is whole, or, streamed, until its stream ends."""
        user = user_of(request.scope, request.headers.get("authorization", ""), self.keys)
        await self.users.start(user)
        # the peers share this API's compute fairly among its users, not among its requests
        claim = serving.set("user-" + hashlib.sha256(user.encode()).hexdigest()[:16])
        response = None
        try:
            response = await self._answer(await job(), request)
            return response
        finally:
            serving.reset(claim)
            if isinstance(response, EventStream):
                response.on_close = partial(self.users.end, user)
            else:
                self.users.end(user)

    def _check(self, body: schemas.SamplingRequest) -> None:
        if body.model not in self.names:
            raise unknown_model(body.model, self.names[0], self.names[1])
        refused = body.unsupported()
        if refused is not None:
            raise unsupported(*refused)

    async def _job(self, prompt: str | list, max_tokens: int | None, body: schemas.SamplingRequest, param: str) -> Job:
        """Tokenize and check the request (a prompt too long is refused here, before any network
        traffic); without `max_tokens`, the generation may fill the context the swarm accepts."""
        lm = self.lm
        try:
            limit = await lm.model.core.longest_session()  # the length a prompt is checked against
            ids = await asyncio.get_running_loop().run_in_executor(self.tokenizing, lm.encode, prompt)
            if max_tokens is None:
                max_tokens = max(limit - len(ids), 1)
            request = lm.request(
                ids, max_tokens, 1.0 if body.temperature is None else body.temperature, body.seed,
                top_p=1.0 if body.top_p is None else body.top_p, stop=body.stops,
                hold_until_checked=body.hold_until_checked,
            )
        except TemplateError as exc:  # the model's chat template refuses these messages
            raise APIError(400, f"the model's chat template refused the messages: {exc}", param=param) from exc
        except P2PFusionError as exc:
            raise from_core(exc, param) from exc
        chat = param == "messages"
        return Job(
            f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), chat, request, bool(body.stream),
            body.include_usage, param,
        )

    async def _answer(self, job: Job, request: Request) -> Response:
        """The whole answer as JSON, or its stream once the first token came."""
        stream: TokenStream | None = TokenStream(self.lm, job.request)
        try:
            if job.streamed:
                first = await _unless_gone(request, anext(stream, None))
                response = EventStream(stream, self._events(job, stream, first))
                stream = None  # the response closes it from now on
                return response
            result = await _unless_gone(request, _whole_of(stream))
        except ClientGone:
            log.info("%s: the client left before its answer; its generation ends", job.id)
            return Response(status_code=CLIENT_GONE)
        except P2PFusionError as exc:
            raise from_core(exc, job.prompt_param) from exc
        finally:
            if stream is not None:
                await stream.aclose()
        finish = self._finish(job.request, result)
        _log(job, result, finish)
        return JSONResponse(self._whole(job, result, finish).model_dump())

    def _whole(self, job: Job, result: Generated, finish: str) -> BaseModel:
        usage = _usage(job, result)
        if job.chat:
            choice = schemas.ChatChoice(message=schemas.AssistantMessage(content=result.text), finish_reason=finish)
            return schemas.ChatCompletion(
                id=job.id, created=job.created, model=self.names[0], choices=[choice], usage=usage
            )
        choice = schemas.CompletionChoice(text=result.text, finish_reason=finish)
        return schemas.Completion(id=job.id, created=job.created, model=self.names[0], choices=[choice], usage=usage)

    async def _events(self, job: Job, stream: TokenStream, first: Piece | Correction | None) -> AsyncIterator[dict]:
        """The stream's events, as OpenAI sends them: (for chats) the role first, then each piece of
        text, then the finish reason, the usage if asked for, and `[DONE]`. A correction is a chunk
        of its own, with no text and a `correction` object (schemas.StreamCorrection)."""
        sent, ended = "", False
        try:
            if job.chat:
                yield self._chunk(job, schemas.Delta(role="assistant", content=""))
            piece = first
            while piece is not None:
                if isinstance(piece, Correction):
                    sent = piece.text
                    yield self._correction(job, piece)
                elif piece.text:
                    sent += piece.text
                    yield self._chunk(job, piece.text)
                piece = await anext(stream, None)
            result = stream.result
            rest = result.text[len(sent):]  # text held back while it might have begun a stop string
            if rest:
                yield self._chunk(job, rest)
            finish = self._finish(job.request, result)
            yield self._chunk(job, "", finish)
            if job.include_usage:
                yield self._chunk(job, None, usage=_usage(job, result))
            ended = True
            yield {"data": "[DONE]"}
            _log(job, result, finish)
        except P2PFusionError as exc:  # the stream has begun: the error goes as an event, as OpenAI's do
            ended = True
            log.warning("%s failed mid-stream: %s", job.id, exc)
            yield {"data": from_core(exc, job.prompt_param).body.model_dump_json()}
        finally:
            if not ended:
                log.info("%s: the client left mid-stream; its generation ends", job.id)

    def _chunk(
        self, job: Job, text: str | schemas.Delta | None, finish: str | None = None, usage: schemas.Usage | None = None
    ) -> dict:
        """One event: `text` None is the usage's own last chunk, with no choice."""
        common = dict(id=job.id, created=job.created, model=self.names[0], usage=usage)
        if job.chat:
            delta = text if isinstance(text, schemas.Delta) else schemas.Delta(content=text or None)
            choices = [] if text is None else [schemas.ChatChunkChoice(delta=delta, finish_reason=finish)]
            chunk: BaseModel = schemas.ChatCompletionChunk(choices=choices, **common)
        else:
            choices = [] if text is None else [schemas.CompletionChoice(text=text, finish_reason=finish)]
            chunk = schemas.Completion(choices=choices, **common)
        return {"data": chunk.model_dump_json()}

    def _correction(self, job: Job, correction: Correction) -> dict:
        common = dict(id=job.id, created=job.created, model=self.names[0])
        fix = schemas.StreamCorrection(kept_characters=len(correction.text), kept_tokens=correction.tokens)
        if job.chat:
            choices = [schemas.ChatChunkChoice(delta=schemas.Delta())]
            chunk: BaseModel = schemas.ChatCompletionCorrection(choices=choices, correction=fix, **common)
        else:
            chunk = schemas.CompletionCorrection(choices=[schemas.CompletionChoice(text="")], correction=fix, **common)
        log.warning("%s: verification withdrew streamed text after %d characters", job.id, fix.kept_characters)
        return {"data": chunk.model_dump_json()}

    def _finish(self, request: GenerationRequest, result: Generated) -> str:
        """`stop` when a stop string or the end of the reply ended the text, `length` when the token budget did."""
        if request.stop and result.text != self.lm.tokenizer.decode(result.token_ids, skip_special_tokens=True):
            return "stop"
        return "stop" if result.token_ids and result.token_ids[-1] in self.eos else "length"


def _usage(job: Job, result: Generated) -> schemas.Usage:
    prompt, completion = len(job.request.input_ids), len(result.token_ids)
    return schemas.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _log(job: Job, result: Generated, finish: str) -> None:
    seconds = result.token_times[-1] if result.token_times else 0.0
    log.info("%s: %d prompt tokens, %d new in %.2f s (%s)", job.id, len(job.request.input_ids), len(result.token_ids),
             seconds, finish)


class EventStream(EventSourceResponse):
    """Server-sent events whose generation ends with the response, however that ends: sent whole,
    the client gone (which cancels the events), a send that failed before the events began."""

    def __init__(self, stream: TokenStream, events: AsyncIterator[dict]):
        super().__init__(events, sep="\n")  # OpenAI's separator: some clients split on "\n\n" only
        self.stream = stream
        self.on_close: Callable[[], None] | None = None  # called once the generation has ended

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.stream.aclose()
            if self.on_close is not None:
                self.on_close()


async def _whole_of(stream: TokenStream) -> Generated:
    async for _ in stream:
        pass
    return stream.result


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) once the client closes its connection."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientGone
        return task.result()
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the request's body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
