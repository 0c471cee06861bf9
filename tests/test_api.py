"""`p2pfusion api` through the official `openai` client: a real API process on real peer processes
of a tiny chat model (one character per token), checked against transformers' greedy output.

One swarm serves the module: peers of model A on layers 0:2 and 2:4, and one peer of model B (other
weights) on layers 0:2 only, so that an API of B meets a gap. The API of A runs as `p2pfusion api`;
the API of B, with a key, runs in this process (the test also reads peer records through it).
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.generation.logits_process import TopPLogitsWarper

from p2pfusion.api.app import base_url, create_app, listen, model_names, server
from p2pfusion.api.guard import APILimits
from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.client.generate.sampling import choose_token, nucleus
from p2pfusion.client.generate.stops import StopText
from p2pfusion.client.generate.swarm_lm import SwarmLM
from p2pfusion.models.source import ModelSource, resolve_model
from tests.conftest import COMMON, reference_model
from tests.api_process import api_url, launch_api
from tests.swarm import peers_in_background
from tests.tiny_chat import char_tokenizer

POSITIONS = 8192  # room for a reply that lasts long after the disconnect test is done with it
TOKENS = 8
KEY = "sesame"
PEER_OPTIONS = ["--throughput", "100", "--session-limit", str(POSITIONS)]


def _chat_model(folder: Path, seed: int) -> ModelSource:
    """A random tiny chat model that never ends a reply by itself (no EOS token, where a random model
    would end its replies at random): a reply lasts until its max_tokens or a stop string."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**COMMON, "max_position_embeddings": POSITIONS, "eos_token_id": None})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    char_tokenizer(256).save_pretrained(folder)
    return resolve_model(str(folder))


async def _serve_in_process(lm: SwarmLM, api_key: str | None):
    sock = listen("127.0.0.1", 0)
    http = server(create_app(lm, model_names(lm), APILimits(() if api_key is None else (api_key,))))
    return http, asyncio.create_task(http.serve(sockets=[sock])), base_url(sock) + "/v1"


async def _stop_server(http, task: asyncio.Task) -> None:
    http.should_exit = True
    await task


class Swarm:
    def __init__(self, a: ModelSource, b: ModelSource, url: str, gap_url: str, loop: BackgroundLoop, lm: SwarmLM):
        self.a, self.b, self.url, self.gap_url, self.loop, self.lm = a, b, url, gap_url, loop, lm
        self.tokenizer = lm.tokenizer
        self.reference = reference_model(a)

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, **options)

    def sessions(self) -> list[int]:
        """The open sessions each peer of model A announces."""
        records = self.loop.run(self.lm.model.core.swarm.lookup(self.a.key))
        return [r.sessions for r in sorted(records, key=lambda r: r.start)]

    def greedy(self, ids: list[int], tokens: int = TOKENS) -> list[int]:
        with torch.no_grad():
            out = self.reference.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
        return out[0, len(ids):].tolist()

    def chat_reference(self, messages: list[dict], tokens: int = TOKENS) -> tuple[list[int], list[int]]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return ids, self.greedy(ids, tokens)

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, forks):
    """Model B's peer starts the swarm in this process (a moment, torch being loaded here already),
    so that A's peer processes and A's API process, which take seconds each to start, all start at once."""
    root = tmp_path_factory.mktemp("api")
    a, b = _chat_model(root / "tiny-chat-a", 0), _chat_model(root / "tiny-chat-b", 1)
    with peers_in_background(b, [(0, 2)]) as (_, maddrs, loop):
        peers = LocalSwarm(model=str(a.folder), maddrs=list(maddrs), forks=forks)
        api_log = root / "api.log"
        api = None
        try:
            started = [peers.launch((0, 2), PEER_OPTIONS), peers.launch((2, 4), PEER_OPTIONS)]
            api = launch_api(["--initial-peers", maddrs[0], "--model", str(a.folder)], api_log, forks)
            lm = loop.run(SwarmLM.connect(maddrs, b, verify=0.0))
            http, task, gap_url = loop.run(_serve_in_process(lm, KEY))
            try:
                for proc in started:
                    peers.wait_ready(proc)
                yield Swarm(a, b, api_url(api, api_log) + "/v1", gap_url, loop, lm)
            finally:
                loop.run(_stop_server(http, task))
                loop.run(lm.close())
        finally:
            if api is not None:
                api.terminate()
                api.wait(15)
            peers.stop()


def test_models_list_shows_the_model_and_its_coverage(swarm):
    client = swarm.client()
    listed = client.models.list().data
    assert [m.id for m in listed] == [swarm.a.name]
    assert listed[0].key == swarm.a.key
    assert listed[0].coverage == {"layers": 4, "served": 4, "gaps": [], "peers": 2}
    assert client.models.retrieve(swarm.a.key).id == swarm.a.name


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_completion_is_transformers_greedy_reply(swarm):
    ids, reference = swarm.chat_reference(_user("hello there"))
    reply = swarm.client().chat.completions.create(
        model=swarm.a.name, messages=_user("hello there"), max_tokens=TOKENS, temperature=0
    )
    assert reply.object == "chat.completion" and reply.model == swarm.a.name
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == swarm.text(reference)
    assert choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(reference))
    assert reply.usage.total_tokens == len(ids) + len(reference)


def test_streamed_chat_sends_role_deltas_finish_and_usage(swarm):
    ids, reference = swarm.chat_reference(_user("stream it"))
    chunks = list(swarm.client().chat.completions.create(
        model=swarm.a.key, messages=_user("stream it"), max_completion_tokens=TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == swarm.text(reference)
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 2) + ["length"]
    usage = chunks[-1]
    assert usage.choices == []
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (len(ids), len(reference))


def test_completion_streamed_raw_is_openai_sse(swarm):
    """The bytes of a stream: `data: ` lines, blank-line separated, ending with `data: [DONE]`."""
    prompt = "Once upon a time"
    reference = swarm.greedy(swarm.tokenizer(prompt)["input_ids"])
    body = {"model": swarm.a.name, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "stream": True}
    with httpx2.stream("POST", f"{swarm.url}/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e and not e.startswith(":")]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == swarm.text(reference)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    whole = swarm.client().completions.create(model=swarm.a.name, prompt=prompt, max_tokens=TOKENS, temperature=0)
    assert whole.choices[0].text == swarm.text(reference)
    assert whole.usage.completion_tokens == len(reference)


def test_eight_requests_at_once_each_get_their_greedy_reply(swarm):
    prompts = [f"question {i}: {word}" for i, word in enumerate("abcdefgh")]
    client = swarm.client()

    def ask(prompt: str) -> str:
        asked = dict(model=swarm.a.name, messages=_user(prompt), max_tokens=TOKENS, temperature=0)
        return client.chat.completions.create(**asked).choices[0].message.content

    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(ask, prompts))
    assert replies == [swarm.text(swarm.chat_reference(_user(p))[1]) for p in prompts]


def test_stop_strings_end_the_text_and_a_stream_never_shows_a_stop_string(swarm):
    """The greedy reply to "hello there" is 'ıÝřÝřĲrÝ': "řĲ" first starts at its 5th character, and
    the 3rd, "ř" alone, may begin it until the next token says it does not."""
    _, reference = swarm.chat_reference(_user("hello there"))
    full = swarm.text(reference)
    stop = full[4:6]
    assert full.index(stop) == 4 and full[2] == stop[0]
    client = swarm.client()
    asked = dict(model=swarm.a.name, messages=_user("hello there"), max_tokens=TOKENS, temperature=0, stop=[stop, "zz"])
    whole = client.chat.completions.create(**asked)
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (full[:4], "stop")
    assert whole.usage.completion_tokens < TOKENS
    chunks = list(client.chat.completions.create(**asked, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[:4]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a stop string that never completes: what was held back comes at the end
    chunks = list(client.chat.completions.create(**{**asked, "stop": full[3] + "Q"}, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sampling_with_a_seed_repeats(swarm):
    client = swarm.client()
    asked = dict(model=swarm.a.name, prompt="seeded", max_tokens=TOKENS, temperature=1.5, top_p=0.9, seed=7)
    first, second = (client.completions.create(**asked).choices[0].text for _ in range(2))
    assert first == second and len(first) == TOKENS


def test_errors_have_openai_statuses_and_shape(swarm):
    client = swarm.client()
    chat = dict(model=swarm.a.name, messages=_user("hi"), max_tokens=2)
    for bad, param in [({"n": 2}, "n"), ({"temperature": 5}, "temperature"), ({"messages": []}, "messages"),
                       ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"presence_penalty": 1}, "presence_penalty")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**{**chat, **bad})
        assert caught.value.body["param"] is not None and caught.value.body["param"].startswith(param), bad
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(**{**chat, "model": "gpt-4o"})
    assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=swarm.a.name, prompt="a" * POSITIONS, max_tokens=2)
    assert caught.value.status_code == 413 and "prompt too long" in caught.value.message

    for method, path, status in [("GET", "/chat/completions", 405), ("PUT", "/models", 405), ("GET", "/nothing", 404)]:
        response = httpx2.request(method, swarm.url + path, timeout=10)
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    response = httpx2.post(swarm.url + "/completions", content=b"{not json", timeout=10)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_api_key_and_a_gap_in_the_swarm(swarm):
    """Model B's API wants a key, and B's layers 2:4 have no peer: 503, with a hint to retry."""
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=swarm.gap_url, api_key="wrong", max_retries=0).models.list()
    assert httpx2.get(swarm.gap_url + "/models", timeout=10).status_code == 401
    client = openai.OpenAI(base_url=swarm.gap_url, api_key=KEY, max_retries=0)
    [card] = client.models.list().data
    assert card.coverage == {"layers": 4, "served": 2, "gaps": [[2, 4]], "peers": 1}
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=swarm.b.name, messages=_user("hi"), max_tokens=2, stream=True)
    assert caught.value.status_code == 503 and "2:4" in caught.value.message
    assert int(caught.value.response.headers["retry-after"]) > 0


def test_a_client_leaving_mid_stream_ends_its_session_on_every_peer(swarm):
    """Each reply would take 8,000 tokens (over 15 s at the tiny model's few hundred tokens/s here):
    its session ends on both peers within seconds of the client leaving, mid-stream or while it
    waits for a whole answer."""
    stream = swarm.client().chat.completions.create(
        model=swarm.a.name, messages=_user("a long story"), max_tokens=8000, temperature=0, stream=True
    )
    for _, _ in zip(range(5), stream):
        pass
    _wait_for(lambda: swarm.sessions() == [1, 1], "both peers to announce the stream's session")
    stream.close()
    left = time.monotonic()
    _wait_for(lambda: swarm.sessions() == [0, 0], "both peers to close it")
    assert time.monotonic() - left < 10

    # a client that waits for a whole answer, and gives up
    patient = swarm.client(timeout=6.0)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            patient.chat.completions.create, model=swarm.a.name, messages=_user("a long story"), max_tokens=8000
        )
        _wait_for(lambda: swarm.sessions() == [1, 1], "both peers to announce the waiting request's session")
        with pytest.raises(openai.APITimeoutError):
            waiting.result()
    left = time.monotonic()
    _wait_for(lambda: swarm.sessions() == [0, 0], "both peers to close it")
    assert time.monotonic() - left < 10


def _wait_for(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.25)


def test_top_p_keeps_the_nucleus_transformers_keeps():
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits, top_p = torch.randn(64) * 3, float(torch.rand(1, generator=generator))
        kept = torch.isfinite(TopPLogitsWarper(top_p)(None, logits[None].clone())[0])
        assert torch.equal(nucleus(torch.softmax(logits, -1), top_p) > 0, kept)
        drawn = {choose_token(logits, 1.0, generator, top_p) for _ in range(20)}
        assert all(kept[token] for token in drawn)
    assert choose_token(logits, 1.0, generator, 0.0) == int(logits.argmax())


def test_stop_text_holds_back_what_may_begin_a_stop_string():
    text = StopText(["\n\nUser:", "END"])
    pieces = ["Hi", "\n", "\n", "Us", "ed", " E", "N", "DING", "more"]
    assert [text.add(piece) for piece in pieces] == ["Hi", "", "", "", "\n\nUsed", " ", "", "", ""]
    assert text.stopped



def test_each_kind_of_error_gets_its_own_status():
    """The swarm's trouble is a 503 to retry; the request's a 400 (413 when too long); this server's
    own (its model's files, its setup, a peer's failed proof) a 500, never a 503 that invites a retry."""
    from p2pfusion.api.errors import from_core
    from p2pfusion.errors import (
        ConfigError, ModelError, PeerBusy, PeerFailed, PromptTooLong, ProofError, RequestError, RouteError,
    )

    answers = {
        RouteError("layers 2:4 are not served"): (503, "swarm_unavailable"),
        PeerFailed("peer X died", "X"): (503, "swarm_unavailable"),
        PeerBusy("peer X busy", "X", retry_after=2.5): (503, "peers_busy"),
        PromptTooLong("prompt too long"): (413, "context_length_exceeded"),
        RequestError("temperature must be >= 0"): (400, None),
        ModelError("cannot read the tokenizer"): (500, "model_error"),
        ConfigError("cannot read swarm secret file"): (500, "server_misconfigured"),
        ProofError("the peer at that address is not X"): (500, "peer_proof_failed"),
    }
    for error, (status, code) in answers.items():
        answer = from_core(error)
        assert (answer.status, answer.body.error.code) == (status, code), error
    assert from_core(PeerBusy("busy", "X", retry_after=2.5)).headers == {"Retry-After": "3"}
