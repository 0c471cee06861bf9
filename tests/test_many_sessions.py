"""Many sessions at once from one client process, through real peers on 127.0.0.1: each session's
tokens are exactly those of transformers generating its prompt alone, whether the sessions start
together or come and go, with adapters or without, from asyncio tasks or from threads."""

import asyncio
import random
import threading

import pytest
import torch
import uvloop

from p2pfusion.client.tune.adapter import Adapter, TuningConfig
from p2pfusion.client.generate.swarm_lm import SwarmLM, SwarmLMSync
from p2pfusion.errors import RequestError
from tests.conftest import reference_model
from tests.finetune_refs import LocalReference, randomize
from tests.swarm import peers_in_background
from tests.tiny_chat import with_chat_tokenizer

RANGES = [(0, 2), (2, 4)]
EOS = 2  # LlamaConfig's default, which the tiny models keep


@pytest.fixture(scope="module")
def source(tiny_models, tmp_path_factory):
    """The tiny llama with a tokenizer, so results carry their text."""
    return with_chat_tokenizer(tiny_models["llama"], tmp_path_factory.mktemp("many") / "llama")


@pytest.fixture(scope="module")
def swarm(source):
    """Two peers on a loop of their own thread for the whole module: (peers, bootstrap maddrs)."""
    with peers_in_background(source, RANGES) as (peers, maddrs, _):
        yield peers, maddrs


def _prompts(count: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) of different lengths."""
    rng = random.Random(seed)
    return [([rng.randrange(3, 256) for _ in range(rng.randrange(2, 24))], rng.randrange(4, 16)) for _ in range(count)]


def _expected(reference, cases) -> list[list[int]]:
    """transformers' greedy tokens, each prompt alone (with its KV cache, stopping at EOS)."""
    with torch.no_grad():
        return [
            reference.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=EOS)[0, len(ids):].tolist()
            for ids, n in cases
        ]


def _batched_steps(peers) -> int:
    """Session steps the peers ran inside batched forwards."""
    return sum(peer.server.compute.stats.batched_steps for peer in peers)


def _cohort_steps(peers) -> list[int]:
    return [peer.server.compute.stats.cohort_steps for peer in peers]


def _assert_batched(batched: int) -> None:
    """Some of the sessions' steps ran together, in one forward."""
    assert batched > 0


async def _at_once_and_staggered(source, swarm, together, staggered):
    peers, maddrs = swarm
    async with await SwarmLM.connect(maddrs, source, compression="none", verify=0.0) as lm:
        before, cohorts = _batched_steps(peers), _cohort_steps(peers)
        at_once = await asyncio.gather(*(lm.generate(ids, n) for ids, n in together))
        batched = _batched_steps(peers) - before
        # the client's cohorts reached every hop: the first from the client, the rest relayed
        assert all(now > then for now, then in zip(_cohort_steps(peers), cohorts))

        async def later(delay: float, ids: list[int], n: int):
            await asyncio.sleep(delay)  # joins while others decode; the short ones leave first
            return await lm.generate(ids, n)

        come_and_go = await asyncio.gather(*(later(0.03 * i, ids, n) for i, (ids, n) in enumerate(staggered)))
        pieces = [piece async for piece in lm.stream(*together[0])]
        served = sum(peer.server.tokens_done for peer in peers)
        async with lm.stream([7, 8, 9], 100, stop_at_eos=False) as stream:
            async for _ in stream:
                break  # leaving early ends the generation: its session closes on every peer
        for _ in range(50):
            if not any(peer.server.sessions for peer in peers):
                break
            await asyncio.sleep(0.1)
        assert not any(peer.server.sessions for peer in peers)
        assert sum(peer.server.tokens_done for peer in peers) - served < 20 * len(peers)  # not its 100 tokens
        with pytest.raises(RequestError, match="max_new_tokens"):
            await lm.generate([5, 6], 0)
        with pytest.raises(RequestError, match="token ids must be in 0..255"):
            await lm.generate([5, 256], 4)
        with pytest.raises(RequestError, match="a chat message is"):
            lm.stream([{"role": "user"}])
        assert lm.encode([{"role": "user", "content": "hi"}]) == lm.encode("hi", chat=True)
    return at_once, batched, come_and_go, pieces


def test_sixteen_sessions_at_once_and_staggered_match_transformers(source, swarm):
    together, staggered = _prompts(16, seed=1), _prompts(6, seed=2)
    at_once, batched, come_and_go, pieces = uvloop.run(_at_once_and_staggered(source, swarm, together, staggered))
    reference = reference_model(source)
    assert [g.token_ids for g in at_once] == _expected(reference, together)
    assert [g.token_ids for g in come_and_go] == _expected(reference, staggered)
    for generated in at_once + come_and_go:
        assert len(generated.token_times) == len(generated.token_ids)
        assert generated.token_times == sorted(generated.token_times)
        assert all(latency >= 0 for latency in generated.latencies)
    _assert_batched(batched)
    assert [p.token_id for p in pieces] == at_once[0].token_ids
    assert "".join(p.text for p in pieces) == at_once[0].text


def test_sync_api_from_threads_matches_transformers(source, swarm):
    cases = _prompts(6, seed=3)
    peers, maddrs = swarm
    before = _batched_steps(peers)
    with SwarmLMSync(maddrs, source, compression="none", verify=0.0) as lm:
        results: dict[int, list[int]] = {}

        def run(index: int, ids: list[int], n: int) -> None:
            results[index] = lm.generate(ids, n).token_ids

        threads = [threading.Thread(target=run, args=(i, *case)) for i, case in enumerate(cases)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        streamed = [piece.token_id for piece in lm.stream(*cases[0])]
    _assert_batched(_batched_steps(peers) - before)
    assert [results.get(i) for i in range(len(cases))] == _expected(reference_model(source), cases)
    assert streamed == results[0]


def _adapters(source) -> list[Adapter | None]:
    config = reference_model(source).config
    embeddings = reference_model(source).get_input_embeddings()
    lora = Adapter(config, TuningConfig("lora", rank=4, targets=("q_proj", "v_proj", "down_proj")), embeddings)
    deep = Adapter(config, TuningConfig("deep_prompt", prompt_tokens=3), embeddings)
    randomize(lora, seed=5, scale=0.2)
    randomize(deep, seed=6, scale=0.5)
    return [None, lora, deep]


def _reference_greedy(reference, ids: list[int], tokens: int) -> list[int]:
    """Greedy tokens by whole forwards (the local deep prompts apply to a forward's first positions)."""
    out = []
    with torch.no_grad():
        for _ in range(tokens):
            token = int(reference(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(token)
            if token == EOS:
                break
    return out


async def _with_adapters(source, swarm, cases):
    peers, maddrs = swarm
    before = _batched_steps(peers)
    async with await SwarmLM.connect(maddrs, source, compression="none", verify=0.0) as lm:
        results = await asyncio.gather(*(lm.generate(ids, n, adapter=adapter) for ids, n, adapter in cases))
    return [g.token_ids for g in results], _batched_steps(peers) - before


def test_sessions_with_and_without_adapters_at_once(source, swarm):
    adapters = _adapters(source)
    # the sessions without an adapter decode long enough to overlap, however late one's prefill
    # runs (a client's decode steps go first, and prefills at a lower OS priority)
    cases = [(ids, 32 if i % 3 == 0 else n, adapters[i % 3]) for i, (ids, n) in enumerate(_prompts(6, seed=4))]
    tokens, batched = uvloop.run(_with_adapters(source, swarm, cases))
    references = [reference_model(source)] + [LocalReference(source, a) for a in adapters[1:]]
    plain = references[0]
    for (ids, n, adapter), got in zip(cases, tokens):
        if adapter is None:
            expected = plain.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=EOS)[0, len(ids):].tolist()
        else:
            expected = _reference_greedy(references[adapters.index(adapter)], ids, n)
        assert got == expected, adapter and adapter.tuning.mode
    _assert_batched(batched)
