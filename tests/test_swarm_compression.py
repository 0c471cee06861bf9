"""Forced codecs through real peers: every hop applies the codec; auto on loopback stays exact."""

import torch
import uvloop

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.stage import load_stage
from p2pfusion.net.codecs import pack, unpack
from p2pfusion.net.compression import Codec
from tests.conftest import reference_model
from tests.swarm import running_peers

IDS = [3, 17, 42, 99, 5, 250, 7, 1]
RANGES = [(0, 2), (2, 4)]


async def _swarm_hidden(source, compressions):
    out = {}
    async with running_peers(source, RANGES) as (_, maddrs):
        swarm = await join_swarm(maddrs, client_mode=True)
        try:
            for compression in compressions:
                model = RemoteCausalLM.build(source, swarm, compression=compression)
                session = await model.open_session(16)
                try:
                    out[compression] = torch.cat([await session.step(model.embed(IDS)), await session.step(model.embed([11]))], 1)
                finally:
                    await session.close()
        finally:
            await swarm.shutdown()
    return out


def _simulated(source, codec: Codec, model: RemoteCausalLM) -> torch.Tensor:
    """The same two stages in this process, with the codec applied at all three crossings."""
    stages = [load_stage(source, *r) for r in RANGES]
    caches = [s.new_cache() for s in stages]

    def wire(x):
        packed = pack(x, codec)
        return unpack(packed.spec, packed.body())

    outs, position = [], 0
    for ids in (IDS, [11]):
        hidden = model.embed(ids)
        for stage, cache in zip(stages, caches):
            hidden = stage.forward(wire(hidden), position, cache)
        outs.append(wire(hidden))
        position += len(ids)
    return torch.cat(outs, 1)


def test_forced_codecs_apply_on_every_hop(tiny_models):
    source = tiny_models["llama"]
    got = uvloop.run(_swarm_hidden(source, ["auto", "int8", "float16"]))
    model = RemoteCausalLM.build(source)
    with torch.no_grad():
        exact = reference_model(source)(torch.tensor([IDS + [11]]), output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(model.head.model.norm(got["auto"]), exact, atol=1e-5, rtol=0)
    for codec in (Codec.INT8, Codec.FLOAT16):
        assert not torch.equal(got[codec.value], got["auto"])  # lossy, so the codec really ran
        torch.testing.assert_close(got[codec.value], _simulated(source, codec, model), atol=1e-6, rtol=0)
    assert (got["int8"] - got["auto"]).abs().max() < 0.05 * got["auto"].abs().max()
