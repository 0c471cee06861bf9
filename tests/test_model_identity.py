"""A model's swarm key comes from its weights: the same weights meet in one swarm whatever their
files are called or however they are sharded, other weights never do, and the digest is cached."""

import argparse
import asyncio
import json
import os
import re

import pytest
import torch
import uvloop
from transformers import AutoModelForCausalLM, LlamaConfig

from p2pfusion.cli.swarm_view import chosen_models, show_swarm
from p2pfusion.client.tune.adapter import Adapter, TuningConfig
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.route.catalog import RECORD_READS, model_records
from p2pfusion.dht.records import ModelEntry, PeerRecord, PeerState
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import RouteError
from p2pfusion.models.fingerprint import weight_files
from p2pfusion.models.source import resolve_model
from tests.conftest import COMMON, reference_model
from tests.forked_cli import forked_async
from tests.swarm import running_peers

IDS = [3, 17, 42, 99, 5]


def _model(seed: int, nudge: bool = False):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON))
    if nudge:  # one weight of one layer, by 1e-3: any change must give another key
        with torch.no_grad():
            model.model.layers[3].mlp.down_proj.weight[0, 0] += 1e-3
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The same weights twice (one file; many shards, another name), other weights, and other
    weights under the first one's name."""
    root = tmp_path_factory.mktemp("identity")
    same = _model(0)  # one model saved twice: threads other tests left may draw on torch's generator
    same.save_pretrained(root / "smol-a")
    same.save_pretrained(root / "renamed-copy", max_shard_size="40KB")
    _model(0, nudge=True).save_pretrained(root / "nudged")
    (root / "elsewhere").mkdir()
    _model(1).save_pretrained(root / "elsewhere" / "smol-a")
    return root


def test_same_weights_same_key_whatever_the_names_and_shards(folders):
    a, b = resolve_model(str(folders / "smol-a")), resolve_model(str(folders / "renamed-copy"))
    assert len(weight_files(a.folder)) == 1 and len(weight_files(b.folder)) > 3
    assert (a.name, b.name) == ("smol-a", "renamed-copy")
    assert re.fullmatch(r"llama-4x64-[0-9a-f]{16}", a.key)
    assert a.key == b.key


def test_other_weights_other_key(folders):
    a = resolve_model(str(folders / "smol-a"))
    nudged = resolve_model(str(folders / "nudged"))
    namesake = resolve_model(str(folders / "elsewhere" / "smol-a"))
    assert namesake.name == a.name
    assert len({a.key, nudged.key, namesake.key}) == 3


def test_digest_is_cached_by_path_size_and_mtime(folders, tmp_path, monkeypatch):
    monkeypatch.setenv("P2PFUSION_CACHE", str(tmp_path))
    folder = folders / "smol-a"
    key = resolve_model(str(folder)).key
    entries = list((tmp_path / "digests").glob("*.json"))
    assert len(entries) == 1
    # a second resolve takes the tensors' digests from the cache, not from the weights: a changed
    # cache entry changes the key
    saved = json.loads(entries[0].read_text())
    name = sorted(saved["tensors"])[0]
    saved["tensors"][name][2] = "0" * 64
    entries[0].write_text(json.dumps(saved))
    assert resolve_model(str(folder)).key != key
    # a weight file with another mtime is hashed again, and its entry replaced
    weights = weight_files(folder)[0]
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert resolve_model(str(folder)).key == key
    assert list((tmp_path / "digests").glob("*.json")) == entries
    assert json.loads(entries[0].read_text())["tensors"][name][2] != "0" * 64


def _greedy_reference(source, tokens: int) -> list[int]:
    model, ids = reference_model(source), list(IDS)
    with torch.no_grad():
        for _ in range(tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(IDS):]


async def _through_a_swarm_of(served, asked, other, capsys, forks):
    async with running_peers(served, [(0, 2), (2, 4)]) as (_, maddrs):
        swarm = await join_swarm(maddrs, client_mode=True)
        try:
            listed = await swarm.models()
            generated = await RemoteCausalLM.build(asked, swarm).generate(IDS, 8, stop_at_eos=False, decode=False)
            with pytest.raises(RouteError) as absent:
                await RemoteCausalLM.build(other, swarm).generate(IDS, 8, stop_at_eos=False, decode=False)
        finally:
            await swarm.shutdown()
        await show_swarm(argparse.Namespace(initial_peers=maddrs, model=str(asked.folder), json=True, probe=True, swarm_secret=None))
        view = json.loads(capsys.readouterr().out)
        cli = await forked_async(forks, ["swarm", "--model", str(other.folder), "--initial-peers", maddrs[0]])
    return listed, generated.token_ids, str(absent.value), view, (cli.returncode, cli.stdout, cli.stderr)


def test_a_copy_under_another_name_meets_in_one_swarm(folders, capsys, forks):
    served = resolve_model(str(folders / "smol-a"))
    asked = resolve_model(str(folders / "renamed-copy"))
    other = resolve_model(str(folders / "elsewhere" / "smol-a"))  # same name, other weights
    listed, tokens, absent, view, (code, out, err) = uvloop.run(_through_a_swarm_of(served, asked, other, capsys, forks))
    assert listed == [ModelEntry(served.key, "smol-a", 4, 64)]
    assert tokens == _greedy_reference(served, 8)
    assert absent == (
        f"the swarm serves no model with the weights of smol-a ({other.key}); "
        f"it serves: smol-a (key {served.key}, 4 layers)"
    )
    (model,) = view["models"]
    assert (model["model"], model["key"], model["num_layers"]) == ("smol-a", served.key, 4)
    assert [(p["layers"], p["weights"]) for p in model["peers"]] == [([0, 2], "float32"), ([2, 4], "float32")]
    assert all(p["observed_tokens_per_s"] > 0 for p in model["peers"])
    # `p2pfusion swarm` says the same, in one line
    assert (code, out) == (2, "")
    assert err.strip().splitlines()[-1] == f"p2pfusion: error: {absent}"


async def _records_that_come_late(delay: float):
    """A node lists a model now and writes its peer record `delay` seconds later; a fresh client
    reads the model's records meanwhile, and another client asks for a model nobody lists."""
    peer = await join_swarm([])
    try:
        maddrs = await peer.maddrs()
        client = await join_swarm(maddrs, client_mode=True)
        try:
            key = "llama-4x64-00000000000000aa"
            await peer.announce_model(ModelEntry(key, "late", 4, 64))
            record = PeerRecord(key, peer.peer_id, maddrs, 0, 4, PeerState.ONLINE, 10.0, None, "cpu")
            notices = []

            async def write_later():
                await asyncio.sleep(delay)
                await peer.announce(record)

            writer = asyncio.ensure_future(write_later())
            t0 = asyncio.get_running_loop().time()
            found = await model_records(client, key, "late", notices.append)
            waited = asyncio.get_running_loop().time() - t0
            await writer
            with pytest.raises(RouteError) as absent:
                await model_records(client, "llama-4x64-00000000000000bb", "other", notices.append)
            return found, waited, notices, str(absent.value)
        finally:
            await client.shutdown()
    finally:
        await peer.shutdown()


def test_a_listed_model_whose_records_come_late_is_read_again_until_they_do():
    """A busy DHT answers a read with nothing now and then (two of 22 generations failed so in the
    60-node churn run): while the swarm lists the model, a client reads on, and says so."""
    found, waited, notices, absent = uvloop.run(_records_that_come_late(RECORD_READS + 1.0))
    assert [(r.start, r.end) for r in found] == [(0, 4)]
    assert waited >= RECORD_READS + 1.0
    assert len(notices) == 1 and "reading again for up to 60 s" in notices[0]
    assert absent.startswith("the swarm serves no model with the weights of other (llama-4x64-00000000000000bb); "
                             "it serves: late (key llama-4x64-00000000000000aa, 4 layers)")


def test_choosing_a_model_in_the_swarm_view(folders):
    served = resolve_model(str(folders / "smol-a"))
    listed = [ModelEntry(served.key, "smol-a", 4, 64), ModelEntry("qwen2-4x64-0123456789abcdef", "tiny-qwen", 4, 64)]
    assert chosen_models("smol-a", listed) == listed[:1]
    assert chosen_models(served.key, listed) == listed[:1]
    assert chosen_models(str(folders / "renamed-copy"), listed) == listed[:1]
    with pytest.raises(RouteError, match=r"serves no model named gpt-5; it serves: smol-a \(key llama-4x64-.*tiny-qwen"):
        chosen_models("gpt-5", listed)
    with pytest.raises(RouteError, match="serves no model with the weights of nudged"):
        chosen_models(str(folders / "nudged"), listed)


def test_model_entries_from_the_dht_are_validated():
    good = {"key": "llama-4x64-0123456789abcdef", "name": "smol", "num_layers": 4, "hidden_size": 64}
    assert ModelEntry.from_value(good["key"], good) == ModelEntry(**good)
    bad = [
        ("other-key", good),  # listed under a subkey that is not its key
        (good["key"], {**good, "num_layers": True}),
        (good["key"], {**good, "num_layers": 0}),
        (good["key"], {**good, "hidden_size": 1 << 40}),
        (good["key"], {**good, "name": "smol\x1b[2J"}),  # would drive the terminal
        (good["key"], {**good, "name": "x" * 1000}),
        ("a key", {**good, "key": "a key"}),
        (good["key"], [good]),
    ]
    for subkey, value in bad:
        assert ModelEntry.from_value(subkey, value) is None, value


def test_an_adapter_knows_the_weights_it_was_saved_on(folders, tmp_path, caplog):
    a, copy = resolve_model(str(folders / "smol-a")), resolve_model(str(folders / "renamed-copy"))
    namesake = resolve_model(str(folders / "elsewhere" / "smol-a"))
    config = LlamaConfig(**COMMON)
    Adapter(config, TuningConfig("lora", rank=2)).save(tmp_path / "adapter", a)
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (saved["base_model_name_or_path"], saved["p2pfusion_model_key"]) == ("smol-a", a.key)
    with caplog.at_level("WARNING", logger="p2pfusion.client.tune.adapter"):
        Adapter.load(tmp_path / "adapter", config, copy)
        assert not caplog.records
        Adapter.load(tmp_path / "adapter", config, namesake)
    assert "trained on other weights" in caplog.text


def test_a_peer_offered_two_models_serves_the_one_nobody_serves(folders):
    """run-peer with --model given twice: with the first model served, it takes the second."""
    from p2pfusion.peer.service import _needed_most

    async def scenario():
        served, other = resolve_model(str(folders / "smol-a")), resolve_model(str(folders / "nudged"))
        async with running_peers(served, [(0, 4)]) as (_, maddrs):
            swarm = await join_swarm(maddrs, client_mode=True)
            try:
                return await _needed_most(swarm, [served, other]), other
            finally:
                await swarm.shutdown()

    chosen, other = uvloop.run(scenario())
    assert chosen == other
