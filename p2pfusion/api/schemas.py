"""The API's requests and responses, in the shapes of OpenAI's API.

Requests ignore fields this server does not use (clients send many: `user`, `metadata`, ...), but
refuse the ones whose meaning it cannot honour (more than one choice, log probabilities, ...), so
that a client is never silently given something else than it asked for.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from p2pfusion.client.generate.stops import MAX_STOP_CHARS, MAX_STOPS

StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What chat completions and completions share."""

    model_config = ConfigDict(extra="ignore")

    # clients send null for "the default" as often as they leave a field out
    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: 1, as OpenAI's default
    top_p: float | None = Field(None, ge=0, le=1)  # None: 1
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)  # what torch's generator takes
    stop: Stop = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # p2pfusion's own: stream only text whose results verification checked, so no correction comes
    hold_until_checked: bool = False

    def unsupported(self) -> tuple[str, str] | None:
        """(parameter, why) of the first parameter set to something this server cannot do."""
        if self.n not in (None, 1):
            return "n", "n must be 1: this server generates one choice per request"
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                return name, f"{name} is not supported (only 0)"
        return None

    @property
    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str | None:
        """The message's text; None when it holds a part that is not text (an image, ...)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            return None
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs", "logprobs are not supported"
        return super().unsupported()


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def _listed(self) -> bool:
        """Whether `prompt` is a list of prompts (texts or token lists), not one list of token ids."""
        return isinstance(self.prompt, list) and bool(self.prompt) and not isinstance(self.prompt[0], int)

    def unsupported(self) -> tuple[str, str] | None:
        if self._listed() and len(self.prompt) != 1:
            return "prompt", "one prompt per request: this server generates one choice per request"
        if self.best_of not in (None, 1):
            return "best_of", "best_of must be 1"
        for name in ("echo", "suffix", "logprobs"):
            if getattr(self, name):
                return name, f"{name} is not supported"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt: text or token ids."""
        return self.prompt[0] if self._listed() else self.prompt


# --- responses ---------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class Answer(BaseModel):
    """An answer, or a chunk of a streamed one; each kind names its `object` and its choices (the
    fields stay in this order, OpenAI's)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: Usage | None = None  # a stream's chunks carry none, but the usage's own last one
    system_fingerprint: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class Delta(BaseModel):
    """A chunk's change to the message; fields it does not change are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class StreamCorrection(BaseModel):
    """Verification found results behind text already streamed wrong: only the first
    `kept_characters` of the text streamed so far (`kept_tokens` tokens) stand; corrected text
    follows in the next chunks."""

    index: int = 0
    kept_characters: int
    kept_tokens: int


class ChatCompletionCorrection(ChatCompletionChunk):
    correction: StreamCorrection


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: FinishReason | None = None


class Completion(Answer):
    """A whole completion, or (with `finish_reason` None until the last) one chunk of a stream."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class CompletionCorrection(Completion):
    correction: StreamCorrection


class Coverage(BaseModel):
    """How much of the model the swarm serves now, from its peers' records."""

    layers: int  # the model's decoder layers
    served: int  # of those, the ones some online peer serves
    gaps: list[tuple[int, int]]  # [start, end) ranges nobody serves: requests get 503 meanwhile
    peers: int  # online peers


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "p2pfusion"
    key: str  # the model's swarm key: its architecture and a digest of its weights
    coverage: Coverage


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
