"""Verification on real peers: a peer that lies about its layers' output is caught, named, reported
with the evidence of a canary's receipts, and routed around, and the user still gets transformers'
own tokens."""

import asyncio
import logging
import time

import torch
import uvloop

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.dht.swarm import join_swarm
from tests.conftest import reference_model
from tests.swarm import running_peers, start_peer, stop_peer

IDS = [3, 17, 42, 99, 5, 250, 7, 1]
NEW = 10


def lie(peer, corrupt) -> None:
    """The real peer with its stage's forward patched, as a modified `run-peer` would be."""
    stage = peer.server.stage
    honest = getattr(stage, "honest_forward", stage.forward)
    stage.honest_forward = honest
    stage.forward = honest if corrupt is None else lambda *args, **kwargs: corrupt(honest(*args, **kwargs))


def noise(out: torch.Tensor) -> torch.Tensor:
    return out + 0.01 * out.norm(dim=-1, keepdim=True) / out.shape[-1] ** 0.5 * torch.randn_like(out)


async def generate(source, maddrs, verify: float, observed: dict[str, float] | None = None):
    swarm = await join_swarm(maddrs, client_mode=True)
    try:
        model = RemoteCausalLM.build(source, swarm, compression="none", verify=verify)
        model.core.health.observed = dict(observed or {})  # what routing prefers, whatever earlier runs saw
        result = await model.generate(IDS, NEW, stop_at_eos=False, decode=False)
        await model.canaries.wait()  # the canary owed to a peer caught
        return result, model.core.access().distrusted, swarm.writer_id
    finally:
        await swarm.shutdown()


async def scenario(source):
    # two peers serve layers 1:3; the liar claims to be faster, so routes go through it first
    async with running_peers(source, [(0, 1), (1, 3), (3, 4)]) as (peers, maddrs):
        liar = await start_peer(source, maddrs, (1, 3), throughput="1000")
        lie(liar, None)
        try:
            honest = await generate(source, maddrs, verify=1.0)  # every step checked: no false alarm
            lie(liar, torch.zeros_like)
            # seen slow: routed through the honest peer, and the liar lies as the checking route
            checker = await generate(source, maddrs, verify=0.2, observed={liar.swarm.peer_id: 1e-3})
            reports = await peers[0].swarm.fault_reports(peers[0].model, [liar.swarm.peer_id])
            lie(liar, noise)
            # the next clients read the report and check its evidence themselves: the liar is avoided
            reported = await generate(source, maddrs, verify=0.2)
            trusting = await generate(source, maddrs, verify=0.0)
        finally:
            await stop_peer(liar)
    return liar.swarm.peer_id, honest, checker, reports, reported, trusting


def test_liar_is_caught_named_reported_and_avoided(tiny_models, caplog):
    source = tiny_models["llama"]
    caplog.set_level(logging.WARNING, logger="p2pfusion")
    liar, honest, checker, reports, reported, trusting = uvloop.run(scenario(source))
    ref = reference_model(source)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([IDS]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    expected = expected[0, len(IDS):].tolist()

    result, distrusted, _ = honest
    assert result.token_ids == expected and result.rewinds == 0 and not distrusted
    for result, distrusted, _ in (checker, reported, trusting):
        assert result.token_ids == expected and result.rewinds == 0 and distrusted == {liar}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and liar in r.getMessage()]
    assert sum("returned wrong results for layers 1:3" in w for w in warnings) == 1
    assert sum("signed a wrong result for layers 1:3 in a canary session" in w for w in warnings) == 1
    # the report's evidence is the canary's receipt, signed by the liar
    assert [(reporter, report.peer_id) for reporter, report in reports] == [(checker[2], liar)]
    assert reports[0][1].evidence.receipt.peer_id == liar and reports[0][1].error > 1e-3


async def tarpit_backups(source):
    """Fake warm backups of every layer, claiming 1e9 steps/s, at an address that accepts and never
    answers: a checking route prefers backups and the fastest claims, so each check met one first."""
    held = []

    async def accept(reader, writer):
        held.append(writer)

    tarpit = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = tarpit.sockets[0].getsockname()[1]
    async with running_peers(source, [(0, 2), (2, 4)]) as (peers, maddrs):
        liar = await start_peer(source, maddrs, (2, 4), throughput="1000")
        lie(liar, noise)
        fakes = [await join_swarm(maddrs) for _ in range(3)]  # a record is bound to its signer: a node each
        try:
            for node in fakes:
                await node.announce(PeerRecord(
                    source.key, node.peer_id, [], 0, 4, PeerState.BACKUP, 1e9, None, "tarpit",
                    data_addrs=[f"127.0.0.1:{port}"], since=time.time(),
                ))
            caught = await generate(source, maddrs, verify=1.0)
        finally:
            for node in fakes:
                await node.shutdown()
            await stop_peer(liar)
            tarpit.close()
    return liar.swarm.peer_id, caught


def test_records_that_never_answer_cost_a_ping_not_a_check(tiny_models, caplog):
    source = tiny_models["llama"]
    caplog.set_level(logging.WARNING, logger="p2pfusion")
    liar, (result, distrusted, _) = uvloop.run(tarpit_backups(source))
    with torch.no_grad():
        expected = reference_model(source).generate(
            torch.tensor([IDS]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, len(IDS):].tolist()
    assert result.token_ids == expected and result.rewinds >= 1 and liar in distrusted
    assert not any("checking routes failed" in r.getMessage() for r in caplog.records)
