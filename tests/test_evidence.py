"""Evidence, not votes, on real peers: a peer that lies only on decode steps (honest on the
replays that localize a fault) is convicted by the receipts it signed for the user's session, for
that client, and by a canary's signed receipts, reported with them, for everyone; a
fresh client that never checked anything convicts it from the report alone; a forged report
convicts nobody and discredits its signer; a canary's frames look like a user's to a peer; and
canaries speculate as users do, so a peer that lies only to sessions that draft is convicted."""

import dataclasses
import logging
import time

import torch
import uvloop

from p2pfusion.client.generate.canary import Canaries
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.generate.draft import Speculation
from p2pfusion.dht.records import FaultReport
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.net.receipts import Evidence
from tests.conftest import reference_model
from tests.swarm import running_peers, start_peer, stop_peer
from tests.test_verify import IDS, NEW, lie, noise

HOPS = [(0, 1), (1, 3), (3, 4)]


def on_decode_only(corrupt):
    """A liar that hides: it corrupts one-token steps after the prefill, and answers the prefills
    that replay a session (to find who is at fault) honestly."""

    def forward(out):
        return corrupt(out) if out.shape[1] == 1 else out

    return forward


async def client(source, maddrs, verify: float, canaries: float = 0.0, speculate: str = "auto"):
    swarm = await join_swarm(maddrs, client_mode=True)
    model = RemoteCausalLM.build(source, swarm, compression="none", verify=verify, canaries=canaries, speculate=speculate)
    return swarm, model


async def hiding_liar(source):
    async with running_peers(source, HOPS) as (peers, maddrs):
        liar = await start_peer(source, maddrs, (1, 3), throughput="1000")  # routes go through it first
        lie(liar, on_decode_only(noise))
        try:
            swarm, model = await client(source, maddrs, verify=1.0)
            try:
                result = await model.generate(IDS, NEW, stop_at_eos=False, decode=False)
                suspects, caught = dict(model.core.distrust.suspects), set(model.core.access().distrusted)
                await model.canaries.wait()  # the canaries owed to the suspects
                await model.canaries.wait()
                canary = await Canaries(model.core, model.speculates, seed=1).run(through=liar.swarm.peer_id)
            finally:
                await swarm.shutdown()
            reports = await peers[0].swarm.fault_reports(peers[0].model, [liar.swarm.peer_id])
            forger = peers[2].swarm  # its key stands in for a stranger's
            # the DHT refuses a report whose receipt its accused did not sign; a real receipt with
            # made-up tokens is stored, and left to readers to judge
            stored = [await forger.report_faulty(peers[2].model, tampered(reports[0][1])),
                      await forger.report_faulty(peers[2].model, framed(canary, peers[0].swarm.peer_id))]
            swarm, fresh = await client(source, maddrs, verify=0.0)  # checks nothing itself
            try:
                trusting = await fresh.generate(IDS, NEW, stop_at_eos=False, decode=False)
                distrusted = fresh.core.access().distrusted
                discredited = fresh.core.distrust.discredited
            finally:
                await swarm.shutdown()
        finally:
            await stop_peer(liar)
    return liar.swarm.peer_id, result, (suspects, caught), canary, reports, trusting, distrusted, (forger.writer_id, discredited, stored)


def tampered(report: FaultReport) -> FaultReport:
    """A valid report with the accused's output sketch changed: its signature no longer holds."""
    receipt = report.evidence.receipt
    forged = dataclasses.replace(receipt, output=bytes(len(receipt.output)))
    return dataclasses.replace(report, evidence=dataclasses.replace(report.evidence, receipt=forged))


def framed(canary, honest: str) -> FaultReport:
    """An honest peer's real, signed receipt of a canary's decode step, with other tokens given as
    the canary's: recomputed from those, its output is far off, but so is its own input."""
    mine = sorted((r for r in canary.receipts if r.peer_id == honest), key=lambda r: r.step)
    receipt = mine[-1]
    tokens = [(t + 1) % 256 for t in canary.tokens[:receipt.offset + receipt.tokens]]
    evidence = Evidence(tokens, canary.certs[honest], receipt, [(r.offset, r.tokens, r.rows) for r in mine[:-1]])
    return FaultReport(honest, receipt.start, receipt.end, 1.0, evidence, time.time())


def test_a_liar_honest_on_replays_is_convicted_by_its_receipts(tiny_models, caplog):
    source = tiny_models["llama"]
    caplog.set_level(logging.INFO, logger="p2pfusion")
    liar, result, (suspects, caught), canary, reports, trusting, distrusted, (forger, discredited, stored) = uvloop.run(
        hiding_liar(source))
    with torch.no_grad():
        out = reference_model(source).generate(torch.tensor([IDS]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    expected = out[0, len(IDS):].tolist()
    assert result.token_ids == expected and result.rewinds >= 1
    # the replays found no one; the receipts it signed for the user's session convict it at once,
    # for this client only (they hold the user's states), and canaries are owed to it for evidence
    assert caught == {liar} and liar in suspects
    assert any("signed a wrong result for layers 1:3 at position" in r.getMessage() for r in caplog.records)
    assert liar in canary.route and set(canary.convicted) == {liar} and canary.reported == {liar}
    assert canary.convicted[liar].output_error > 5 * canary.convicted[liar].bar  # far over: noise of 1%, a bar of 0.06%
    assert [report.peer_id for _, report in reports] == [liar]
    assert reports[0][1].evidence.tokens[:len(canary.tokens) - 1] == canary.tokens[:len(reports[0][1].evidence.tokens)]
    # one report, judged by the fresh client itself; the forged ones convict no one and discredit their signer
    assert trusting.token_ids == expected and distrusted == {liar} and discredited == {forger}
    assert stored == [False, True]
    assert any("signed a wrong result for layers 1:3 in a canary session" in r.getMessage() for r in caplog.records)


def recording(peer, seen: dict) -> None:
    """Note in `seen["now"]` what a peer can tell of each frame it serves: its kind, its tensor's
    shape, which optional fields it holds, and the session's settings."""
    server = peer.server
    take = server._on_frame

    async def on_frame(session, frame, writer):
        header, tensor = frame
        seen["now"].append((
            header.get("kind"), None if tensor is None else tuple(tensor.shape), header.get("keep"),
            header.get("mask") is None, header.get("positions") is None, header.get("params"), len(header.get("receipts", [])),
            len(header.get("certs", [])), session.batch, session.purpose, session.compression,
            sorted(session.downstream_peers),
        ))
        return await take(session, frame, writer)

    server._on_frame = on_frame


async def wire_patterns(source):
    async with running_peers(source, HOPS) as (peers, maddrs):
        canary_frames, user_frames = [], []
        seen = {"now": canary_frames}
        recording(peers[1], seen)
        # without drafts, a canary steps one token at a time, as such a user does, frame for frame
        swarm, model = await client(source, maddrs, verify=0.0, speculate="off")
        try:
            canary = await Canaries(model.core, model.speculates, seed=3).run()
            prompt = canary.prompt
            seen["now"] = user_frames
            ids = [(7 * i + 3) % 256 for i in range(prompt)]
            await model.generate(ids, len(canary.tokens) - prompt, stop_at_eos=False, decode=False)
        finally:
            await swarm.shutdown()
    return canary, canary_frames, user_frames


def test_a_canary_looks_like_a_user_to_a_peer(tiny_models):
    canary, canary_frames, user_frames = uvloop.run(wire_patterns(tiny_models["llama"]))
    assert not canary.convicted and not canary.avoided and len(canary.route) == 3
    assert canary_frames == user_frames
    assert [f[0] for f in canary_frames][-1] == "close" and any(f[1] == (1, 1, 64) for f in canary_frames)


def on_drafts_only(corrupt):
    """A liar that lies only to sessions that speculate: it corrupts steps of a token and its drafts
    (2 to 9 positions), never a prefill or a plain decode step."""

    def forward(out):
        return corrupt(out) if 2 <= out.shape[1] <= 9 else out

    return forward


async def drafting_canaries(source, prompt):
    async with running_peers(source, HOPS) as (peers, maddrs):
        seen = {"now": []}
        recording(peers[1], seen)
        swarm, model = await client(source, maddrs, verify=0.0)  # users speculate: so do canaries
        try:
            canaries = Canaries(model.core, model.speculates, seed=4)
            canaries.prompt = lambda room, least=0: prompt  # a text that repeats itself drafts well
            honest = await canaries.run()
            lie(peers[1], on_drafts_only(noise))
            lying = await canaries.run()
        finally:
            await swarm.shutdown()
    return honest, lying, seen["now"], peers[1].swarm.peer_id


def test_canaries_speculate_as_users_do_and_convict_a_liar_to_drafts(tiny_models, monkeypatch):
    source = tiny_models["llama"]
    # as many drafts as the lookup finds, so that some fall however this machine's timing prices them
    monkeypatch.setattr(Speculation, "size", lambda self, available: available if self.one_step is not None else 0)
    with torch.no_grad():
        ref = reference_model(source)
        loop = ref.generate(torch.tensor([IDS]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[0].tolist()
    honest, lying, frames, liar = uvloop.run(drafting_canaries(source, loop + loop))
    # steps of a token and its drafts, and the positions of those that fell dropped, as a user's
    assert any(kind == "step" and 2 <= shape[1] <= 9 for kind, shape, *_ in frames)
    assert any(keep is not None for _, _, keep, *_ in frames)
    assert not honest.convicted and not honest.avoided  # receipts of drafts that fell hold honest peers to nothing
    assert set(lying.convicted) == {liar} and lying.reported == {liar}
