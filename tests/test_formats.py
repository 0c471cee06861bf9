"""Weight formats: what each costs and computes, without a network; then real peers on 127.0.0.1
holding their layers in float32, int4 and bfloat16, and clients that choose what they accept."""

import subprocess
import sys

import pytest
import torch

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.client.route.planner import refused_only
from p2pfusion.client.checks.policy import FORMAT_TOLERANCE, relative_errors
from p2pfusion.cli.options import FORMATS, unused_quantizers
from p2pfusion.dht.records import PeerRecord
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import RequestError
from p2pfusion.models.formats import WeightFormat, accepts, layer_sizes, load_settings, minimum_format
from p2pfusion.models.stage import load_config, load_stage
from p2pfusion.peer.memory import KV_RESERVE_TOKENS, SERVING_RESERVE, layers_that_fit
from tests.conftest import reference_model
from tests.policy_records import rec
from tests.swarm import named_swarm, start_peer, stop_peer

IDS = [3, 17, 42, 99, 5, 250, 7, 1]
NEW = 6


def test_the_cli_names_the_formats_in_order_of_precision():
    assert FORMATS == tuple(f.value for f in WeightFormat)
    assert [accepts(f, WeightFormat.BFLOAT16) for f in FORMATS] == [True, True, True, False, False]
    assert all(accepts(f, WeightFormat.INT4) for f in FORMATS)
    assert not accepts("int2", WeightFormat.INT4)  # a format this version does not know is never taken
    assert minimum_format("float32") == WeightFormat.FLOAT32
    with pytest.raises(RequestError, match="unknown weight format 'fp8'; choose one of float32, bfloat16"):
        minimum_format("fp8")


@pytest.mark.parametrize("quant, hidden", [(None, {"torchao", "bitsandbytes"}), ("int8", {"bitsandbytes"})])
def test_a_peer_process_imports_no_quantizer_but_its_own(tmp_path, quant, hidden):
    """transformers imports torchao whenever it is installed (some 80 MiB resident): a float32
    peer, or a client, must not carry it, and an int8 peer not bitsandbytes."""
    argv = ["run-peer", "--new-swarm", "--model", str(tmp_path / "absent"), *(["--quant", quant] if quant else [])]
    script = (
        "import sys; from p2pfusion.cli.main import main; code = main(sys.argv[1:]);"
        "import transformers.modeling_utils;"
        "print(code, sorted(k for k in ('torchao', 'bitsandbytes') if k in sys.modules and sys.modules[k] is None))"
    )
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120)
    assert done.stdout.split(maxsplit=1) == ["2", f"{sorted(hidden)}\n"], done.stderr[-500:]
    assert unused_quantizers("infer", None) == ["torchao", "bitsandbytes"]


def test_records_carry_the_format_and_refuse_a_malformed_one():
    value = rec(0, 4, name="p").to_value()
    assert PeerRecord.from_value({**value, "weights": "int4"}).weights == "int4"
    assert PeerRecord.from_value({k: v for k, v in value.items() if k != "weights"}).weights == "float32"
    for bad in ("", "x" * 17, "in t4", 4, None):
        assert PeerRecord.from_value({**value, "weights": bad}) is None


def test_layers_that_fit_leave_room_for_kv_caches():
    held = 1000 + SERVING_RESERVE
    assert layers_that_fit(held + 10 * (100 + KV_RESERVE_TOKENS), 1000, 100, 1, 10**6) == 10
    assert layers_that_fit(held + 10 * (100 + 50), 1000, 100, 1, 50) == 10  # sessions of at most 50 tokens
    assert layers_that_fit(held + 99, 1000, 100, 1, 1) == 0


@pytest.mark.parametrize("fmt", list(WeightFormat))
def test_each_format_is_as_big_as_planned_and_computes_close_to_float32(tiny_models, fmt):
    """The size a peer plans with (from the headers) is what the loaded layers take, within 10 %;
    their outputs stay within the verifier's bar for the format; a KV-cached decode step, a batched
    step and a training backward pass all run, in the sender's dtype."""
    source = tiny_models["llama"]
    dtype, quant = load_settings(fmt)
    stage = load_stage(source, 0, 4, dtype, quant=quant)
    planned = sum(layer_sizes(source.folder, 4, fmt, dtype))
    assert stage.format == fmt and abs(stage.parameter_bytes() - planned) <= 0.1 * planned
    exact = load_stage(source, 0, 4)
    torch.manual_seed(0)
    hidden = torch.randn(1, 9, load_config(source).hidden_size)
    reference = exact.forward(hidden, 0)
    cache = stage.new_cache()
    out = torch.cat([stage.forward(hidden[:, :8], 0, cache), stage.forward(hidden[:, 8:], 8, cache)], dim=1)
    assert out.dtype == torch.float32
    assert float(relative_errors(out, reference).max()) < min(FORMAT_TOLERANCE[fmt.value] / 4, 0.1)
    if stage.batchable:
        caches = [stage.new_cache(), stage.new_cache()]
        for c in caches:
            stage.forward(hidden[:, :8], 0, c)
        batched = stage.forward_batch([hidden[:, 8:], hidden[:, 8:]], caches, [None, None], [None, None])
        assert torch.allclose(batched[0], out[:, 8:], rtol=0.05, atol=0.05)
    graph = stage.forward_for_backward(hidden)
    grad, _ = stage.backward(graph, torch.ones_like(graph.output))
    assert grad.dtype == torch.float32 and grad.shape == hidden.shape and torch.isfinite(grad).all()
    assert fmt == WeightFormat.FLOAT32 or stage.parameter_bytes() < 0.6 * exact.parameter_bytes()


# real peers: "exact" serves every layer in float32, slowly; "q4" serves 0:2 in int4 and "half"
# 2:4 in bfloat16, each claiming ten times the speed; "f2" serves 0:2 in float32

LAYOUT = [
    ("exact", (0, 4), "100", {}),
    ("q4", (0, 2), "1000", {"quant": WeightFormat.INT4}),
    ("half", (2, 4), "1000", {"dtype": torch.bfloat16}),
    ("f2", (0, 2), "100", {}),
]


@pytest.fixture(scope="module")
def swarm(tiny_models):
    source = tiny_models["llama"]
    layout = [(name, layers, {"throughput": throughput, **options}) for name, layers, throughput, options in LAYOUT]
    with named_swarm(source, layout, "test-formats") as (loop, peers, client):
        with torch.no_grad():
            out = reference_model(source).generate(torch.tensor([IDS]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        yield source, loop, peers, client, out[0, len(IDS):].tolist()


def opened(peers) -> dict[str, int]:
    return {name: peer.server.sessions_opened for name, peer in peers.items()}


def generate(swarm, minimum: str, verify: float = 0.0):
    source, loop, _, client, _ = swarm
    model = RemoteCausalLM.build(source, client, compression="none", verify=verify, min_precision=minimum)
    return loop.run(model.generate(IDS, NEW, stop_at_eos=False, decode=False))


def test_peers_announce_their_format(swarm):
    _, _, peers, _, _ = swarm
    assert {name: peer.record.weights for name, peer in peers.items()} == {
        "exact": "float32", "q4": "int4", "half": "bfloat16", "f2": "float32",
    }


def test_an_exact_client_routes_through_float32_peers_only_and_gets_transformers_tokens(swarm):
    _, _, peers, _, expected = swarm
    before = opened(peers)
    assert generate(swarm, "float32").token_ids == expected
    after = opened(peers)
    assert after["q4"] == before["q4"] and after["half"] == before["half"] and after["exact"] > before["exact"]


def test_a_floor_keeps_out_only_the_formats_below_it(swarm):
    _, _, peers, _, _ = swarm
    before = opened(peers)
    assert len(generate(swarm, "bfloat16").token_ids) == NEW
    after = opened(peers)
    # layers 0:2 go to a float32 peer: "f2", or "exact" with the route leaving it after them
    float32 = after["f2"] + after["exact"] > before["f2"] + before["exact"]
    assert after["q4"] == before["q4"] and after["half"] > before["half"] and float32


def test_by_default_a_client_takes_the_fast_quantized_peers_and_verification_accepts_them(swarm):
    """A route of an int4 and a bfloat16 peer, checked at every step against the float32 ones: the
    check's bar follows the formats in the swarm, so honest quantized peers are not accused."""
    _, _, peers, _, _ = swarm
    before = opened(peers)
    result = generate(swarm, "int4", verify=1.0)
    after = opened(peers)
    assert after["q4"] > before["q4"] and after["half"] > before["half"]
    assert len(result.token_ids) == NEW and result.rewinds == 0


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("fmt", [WeightFormat.FLOAT32, WeightFormat.BFLOAT16, WeightFormat.INT8, WeightFormat.INT4])
def test_formats_on_cuda_compute_what_they_compute_on_cpu(tiny_models, fmt):
    source = tiny_models["llama"]
    dtype, quant = load_settings(fmt)
    torch.manual_seed(0)
    hidden = torch.randn(1, 9, load_config(source).hidden_size)
    reference = load_stage(source, 0, 4).forward(hidden, 0)
    stage = load_stage(source, 0, 4, dtype, "cuda", quant)
    cache = stage.new_cache()
    out = torch.cat([stage.forward(hidden[:, :8], 0, cache), stage.forward(hidden[:, 8:], 8, cache)], dim=1)
    assert out.device.type == "cpu" and out.dtype == torch.float32
    assert float(relative_errors(out, reference).max()) < min(FORMAT_TOLERANCE[fmt.value] / 4, 0.1)


@cuda
def test_a_bfloat16_gpu_peer_and_a_float32_gpu_peer_serve_one_route(tiny_models):
    source = tiny_models["llama"]
    loop = BackgroundLoop("test-formats-cuda")
    peers, maddrs = [], []

    async def start():
        for layers, dtype in (((0, 2), torch.float32), ((2, 4), torch.bfloat16)):
            peers.append(await start_peer(source, maddrs, layers, throughput="100", device="cuda:0", dtype=dtype))
            maddrs[:] = maddrs or await peers[-1].swarm.maddrs()

    try:
        loop.run(start())
        client = loop.run(join_swarm(maddrs, client_mode=True))
        model = RemoteCausalLM.build(source, client, compression="none", verify=0.0)
        result = loop.run(model.generate(IDS, NEW, stop_at_eos=False, decode=False))
        loop.run(client.shutdown())
        assert len(result.token_ids) == NEW and [p.record.weights for p in peers] == ["float32", "bfloat16"]
    finally:
        for peer in peers:
            loop.run(stop_peer(peer))
        loop.close()


def test_a_client_is_told_which_layers_only_refused_formats_serve():
    records = [rec(0, 2, name="a"), rec(2, 4, name="q", weights="int4"), rec(3, 6, name="h", weights="bfloat16")]
    accepted = [r for r in records if accepts(r.weights, WeightFormat.FLOAT32)]
    assert refused_only(records, accepted, 8) == ([(2, 6)], ["bfloat16", "int4"])  # 6:8 nobody serves
    accepted = [r for r in records if accepts(r.weights, WeightFormat.BFLOAT16)]
    assert refused_only(records, accepted, 8) == ([(2, 3)], ["int4"])
    assert refused_only(records, accepted, 8, first=3) == ([], ["int4"])  # the client runs 0:3 itself
