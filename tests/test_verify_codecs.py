"""Checks under `auto` compression against real peers: a comparison's bar follows the codecs that
every state it depends on crossed the wire in, the earlier positions' (which the hops' caches hold
and attention reads) as well as its own."""

import time

import torch
import uvloop

from p2pfusion.client.checks.blame import Blame
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.net.compression import Codec, LinkSpeed
from tests.conftest import reference_model
from tests.swarm import running_peers, start_peer, stop_peer

IDS = list(range(3, 43))
NEW = 12
SLOW = LinkSpeed(rtt=1e-3, bytes_per_second=2e6)  # a 40-token prefill goes as float16 on it, a token raw


async def scenario(source):
    async with running_peers(source, [(0, 2), (2, 4)]) as (_, maddrs):
        first = await start_peer(source, maddrs, (0, 2), throughput="1000")  # claims more: routes start on it
        last = await start_peer(source, maddrs, (2, 4), throughput="1000")
        swarm = await join_swarm(maddrs, client_mode=True)
        try:
            model = RemoteCausalLM.build(source, swarm, compression="auto", verify=1.0)
            access = model.core.access()
            access.links._links[first.swarm.peer_id] = (time.monotonic() + 1e6, SLOW)  # as if measured so
            result = await model.generate(IDS, NEW, stop_at_eos=False, decode=False)
            return result, access.distrusted, access.health.banned(await access.records(0))
        finally:
            await swarm.shutdown()
            await stop_peer(first)
            await stop_peer(last)


def test_a_prefill_sent_rounded_sets_the_bar_of_the_checks_after_it(tiny_models, monkeypatch):
    bars = []
    honest_bar = Blame.bar

    def bar(self, peers, hop=False, codecs=None):
        bars.append(codecs)
        return honest_bar(self, peers, hop, codecs)

    monkeypatch.setattr(Blame, "bar", bar)
    source = tiny_models["llama"]
    result, distrusted, banned = uvloop.run(scenario(source))
    ref = reference_model(source)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([IDS]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert result.token_ids == expected[0, len(IDS):].tolist()
    assert result.rewinds == 0 and not distrusted and not banned
    # every step was checked, decode steps (sent raw) as well: their states still read the prefill's
    assert len(bars) >= 2 and all(codecs is None or Codec.FLOAT16 in codecs for codecs in bars)
