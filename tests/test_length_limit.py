"""One length limit, learned from the peers a client may route through: a prompt longer than the
swarm accepts fails before any session opens, and a generation past it stops there, as transformers
stops at max_length."""

import logging

import pytest
import torch
import uvloop

from p2pfusion import AutoDistributedModelForCausalLM
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.route.planner import find_route, longest_session
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import RequestError, RouteError
from tests.conftest import reference_model
from tests.policy_records import rec
from tests.swarm import peers_in_background, start_peer, stop_peer
from tests.forked_cli import forked_async
from tests.test_cli_errors import assert_one_line_error
from tests.tiny_chat import with_chat_tokenizer

LIMIT = 16
LONG = list(range(3, 3 + 20))
SHORT = [3, 17, 42, 99, 5, 250, 7, 1, 60, 61]


def test_the_limit_is_the_longest_any_route_accepts():
    records = [rec(0, 2, session_limit=16), rec(0, 2, session_limit=64, name="long"), rec(2, 4, session_limit=128)]
    assert longest_session(records, 4, positions=8192) == 64
    assert longest_session(records, 4, positions=32) == 32  # the model's positions bound it too
    assert [r.peer_id for r in find_route(records, 4, length=64)][0] == "long"
    with pytest.raises(RouteError, match="no peer accepting sessions of 65 tokens serves layers 0:2"):
        find_route(records, 4, length=65)
    with pytest.raises(RouteError, match="no peer serves layers 2:4"):
        longest_session(records[:2], 4, positions=8192)


async def _through_mixed_peers(source, max_new_tokens: int):
    """Stage 0:2 has a fast peer that accepts 16 tokens and a slow one that accepts 64."""
    short = await start_peer(source, [], (0, 2), session_limit=16, throughput="1000")
    initial = await short.swarm.maddrs()
    peers = [short]
    try:
        for layers in ((0, 2), (2, 4)):
            peers.append(await start_peer(source, initial, layers, session_limit=64))
        swarm = await join_swarm(initial, client_mode=True)
        try:
            result = await RemoteCausalLM.build(source, swarm).generate(LONG, max_new_tokens, stop_at_eos=False, decode=False)
        finally:
            await swarm.shutdown()
        return result, [peer.server.sessions_opened for peer in peers]
    finally:
        for peer in peers:
            await stop_peer(peer)


def test_a_long_session_routes_around_peers_that_accept_less(tiny_models, caplog):
    with caplog.at_level(logging.WARNING):
        result, opened = uvloop.run(_through_mixed_peers(tiny_models["llama"], 60))
    assert len(result.token_ids) == 64 - len(LONG)
    assert "the swarm accepts 64 tokens: generating 44 new tokens, not 60" in caplog.text
    assert opened == [0, 1, 1]  # not through the faster peer that accepts only 16


@pytest.fixture(scope="module")
def short_swarm(tiny_models, tmp_path_factory):
    """Two tiny-model peers that accept sessions of at most LIMIT tokens."""
    source = with_chat_tokenizer(tiny_models["llama"], tmp_path_factory.mktemp("limit") / "tiny-chat")
    with peers_in_background(source, [(0, 2), (2, 4)], session_limit=LIMIT) as (peers, maddrs, _):
        yield source, peers, maddrs


def _opened(peers) -> int:
    return sum(peer.server.sessions_opened for peer in peers)


async def _generate(source, maddrs, ids, max_new_tokens):
    swarm = await join_swarm(maddrs, client_mode=True)
    try:
        return await RemoteCausalLM.build(source, swarm, verify=0.0).generate(ids, max_new_tokens, stop_at_eos=False)
    finally:
        await swarm.shutdown()


def test_generation_follows_the_swarms_limit(short_swarm, caplog):
    source, peers, maddrs = short_swarm
    before = _opened(peers)
    with pytest.raises(RequestError, match=f"^prompt too long: 20 tokens, the swarm accepts {LIMIT}$"):
        uvloop.run(_generate(source, maddrs, LONG, 4))
    assert _opened(peers) == before  # refused before any session opened

    with caplog.at_level(logging.WARNING):
        result = uvloop.run(_generate(source, maddrs, SHORT, 20))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"the swarm accepts {LIMIT} tokens: generating 6 new tokens, not 20"]
    ref = reference_model(source)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([SHORT]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert result.token_ids == expected[0, len(SHORT):].tolist()


def test_python_api_follows_the_swarms_limit(short_swarm, caplog):
    source, peers, maddrs = short_swarm
    model = AutoDistributedModelForCausalLM.from_pretrained(str(source.folder), initial_peers=maddrs)
    try:
        before = _opened(peers)
        with pytest.raises(RequestError, match=f"^prompt too long: 20 tokens, the swarm accepts {LIMIT}$"):
            model.generate(torch.tensor([LONG]), max_new_tokens=4)
        assert _opened(peers) == before
        with caplog.at_level(logging.WARNING):
            out = model.generate(torch.tensor([SHORT]), max_new_tokens=20, min_new_tokens=6, do_sample=False)
        assert f"the swarm accepts {LIMIT} tokens: generating 6 new tokens, not 20" in caplog.text
        with torch.no_grad():
            expected = reference_model(source).generate(
                torch.tensor([SHORT]), max_length=LIMIT, min_length=LIMIT, do_sample=False
            )
        assert out.tolist() == expected.tolist()
        assert _opened(peers) == before + len(peers)  # one session, through both peers
    finally:
        model.close()


def test_infer_refuses_a_prompt_longer_than_the_swarm_accepts(short_swarm, forks):
    source, peers, maddrs = short_swarm
    before = _opened(peers)
    argv = ["infer", "--initial-peers", maddrs[0], "--model", str(source.folder), "x" * 30]  # a token per character
    done = uvloop.run(forked_async(forks, argv))
    result = (done.returncode, done.stderr)
    assert_one_line_error(result, f"prompt too long: 30 tokens, the swarm accepts {LIMIT}")
    assert _opened(peers) == before
