"""Training the swarm's own weights: replicas of each stage step on their micro-batches and average
(DiLoCo), checked against local transformers training and hand-computed outer steps."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.run.replicas import astray, chains, served, split_rows, stages
from p2pfusion.client.route.session import RouteSession
from p2pfusion.client.run import driver
from p2pfusion.client.run.trainer import SwarmTrainer
from p2pfusion.dht.records import PeerState, RunCharter
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import PeerRefused, RequestError, RouteError
from p2pfusion.models.formats import layer_shapes
from p2pfusion.models.source import resolve_model
from p2pfusion.net import run_messages as t
from p2pfusion.net import averaging
from p2pfusion.net.averaging import AveragingFailed, GroupAverager
from p2pfusion.net.compression import Codec, Purpose
from p2pfusion.net.robust import _median, _opposed, robust_mean
from p2pfusion.net.run_calls import call, fetch_state
from p2pfusion.net.seals import convicted, digest
from p2pfusion.peer.balance import misfit, training_stage
from p2pfusion.peer.replica import OuterHyper
from p2pfusion.peer.run_owner import agreed, refusal
from policy_records import rec
from swarm import peers_in_background

LR = 1e-2
BATCHES = [torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(i)) for i in range(3)]


def _reference(source):
    """Local transformers training of the same layers: embeddings, final norm and head frozen, as the driver holds them."""
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).train()
    for name, param in model.named_parameters():
        param.requires_grad_(".layers." in name)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    return model, optimizer


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_one_replica_per_stage_with_h1_equals_local_training(tiny_models, family, tmp_path):
    source = tiny_models[family]
    model, optimizer = _reference(source)
    with peers_in_background(source, [(0, 1), (1, 3), (3, 4)], train="exact") as (peers, maddrs, loop):
        # inference never sees a training replica, nor lists its model as served
        assert loop.run(peers[0].swarm.lookup(source.key)) == [] and loop.run(peers[0].swarm.models()) == []
        with SwarmTrainer.connect(str(source.folder), maddrs, run="exact", sync_every=1, lr=LR, outer_lr=1.0, outer_momentum=0.0) as trainer:
            for ids in BATCHES:
                loss = trainer.step(ids)
                expected = model(input_ids=ids, labels=ids).loss
                expected.backward()
                optimizer.step()
                optimizer.zero_grad()
                assert abs(loss - expected.item()) <= 1e-5 * expected.item()
            assert (trainer.step_count, trainer.round) == (3, 3)
            saved = trainer.save_pretrained(tmp_path / "trained")
    trained = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).state_dict()
    # relative over all the weights at once: a key projection's bias has a gradient of zero in
    # exact arithmetic (softmax ignores a shift shared by all keys), so Adam turns rounding noise
    # of either side into steps of full size there, whatever the order of the sums
    expected = model.state_dict()
    error = sum(float((trained[n] - v).pow(2).sum()) for n, v in expected.items()) ** 0.5
    assert error <= 1e-5 * sum(float(v.pow(2).sum()) for v in expected.values()) ** 0.5
    assert set(trained) == set(expected)
    assert _relative(trained["model.layers.0.mlp.up_proj.weight"], _reference(source)[0].state_dict()["model.layers.0.mlp.up_proj.weight"]) > 1e-4


def test_an_outer_step_with_two_replicas_is_the_hand_computed_average(tiny_models, tmp_path):
    source = tiny_models["llama"]
    with peers_in_background(source, [(0, 2), (0, 2), (2, 4)], train="avg") as (peers, maddrs, loop):
        replicas = [p.training.replica for p in peers[:2]]
        start = [w.detach().clone() for w in replicas[0].weights]
        with SwarmTrainer.connect(str(source.folder), maddrs, run="avg", sync_every=100, lr=LR, outer_lr=0.7, outer_momentum=0.9) as trainer:
            for ids in BATCHES[:2]:
                trainer.step(ids)
            inner = [[w.detach().clone() for w in r.weights] for r in replicas]
            assert any(_relative(a, b) > 1e-6 for a, b in zip(*inner))  # each trained on its own micro-batches
            trainer.outer_step()
            for s, a, b, w0, w1 in zip(start, *inner, replicas[0].weights, replicas[1].weights):
                delta = s - (a + b) / 2
                expected = s - 0.7 * (delta + 0.9 * delta)  # Nesterov from zero momentum
                assert torch.allclose(w0.detach(), expected, rtol=0, atol=1e-6)
                # each adds the average's difference from its own values (hivemind's all-reduce sends
                # deltas), so the replicas agree to float32 rounding
                assert torch.allclose(w0.detach(), w1.detach(), rtol=0, atol=1e-7)
            assert trainer.averaged_bytes > 0
            assert trainer.evaluate(BATCHES[2]) > 0
            # training resumes from the saved folder: a new run's replica serves it
            saved = trainer.save_pretrained(tmp_path / "trained")
    resumed = resolve_model(str(saved))
    with peers_in_background(resumed, [(0, 4)], train="again") as (_, maddrs, _):
        with SwarmTrainer.connect(str(saved), maddrs, run="again", sync_every=1, lr=LR) as trainer:
            assert trainer.step(BATCHES[0]) > 0


def test_a_replica_killed_mid_window_is_left_out_and_a_joiner_gets_the_current_weights(tiny_models, forks):
    source = tiny_models["llama"]
    fixed = ["--throughput", "100", "--train", "churn"]
    with LocalSwarm(model=str(source.folder), forks=forks) as swarm:
        first = swarm.launch((0, 2), fixed)
        swarm.wait_ready(first)
        doomed, last = swarm.launch((0, 2), fixed), swarm.launch((2, 4), fixed)
        for proc in (doomed, last):
            swarm.wait_ready(proc)
        with SwarmTrainer.connect(str(source.folder), swarm.maddrs, run="churn", sync_every=3, lr=LR) as trainer:
            trainer.step(BATCHES[0])
            doomed.kill()
            doomed.wait()
            for ids in BATCHES[1:]:
                assert trainer.step(ids) > 0  # the step that met the dead replica ran again on the others
            assert trainer.redone >= 1 and trainer.round == 1
            joiner = swarm.launch((0, 2), fixed)
            swarm.wait_ready(joiner)
            trainer.step(BATCHES[0])
            run = trainer._run
            tiled = trainer._loop.run(run.replicas())
            assert len(tiled[0]) == 2  # the joiner serves the run, at its round
            shapes = layer_shapes(source.folder, 0, 2)
            weights = []
            for record in tiled[0]:
                request = t.FetchState("churn", source.key, 0, 2, weights_only=True)
                parts, end = trainer._loop.run(fetch_state(run.swarm.transport, record.peer_id, record.data_addrs, request, shapes))
                assert end.round == 1
                weights.append(parts["outer"])
            for name in weights[0]:
                assert torch.equal(weights[0][name], weights[1][name])


def test_bad_requests_are_refused_and_leave_the_weights_untouched(tiny_models):
    source = tiny_models["llama"]
    with peers_in_background(source, [(0, 4)], train="guard") as (peers, maddrs, loop):
        replica = peers[0].training.replica
        before = [w.detach().clone() for w in replica.weights]
        transport = peers[0].swarm.transport
        me, addrs = peers[0].swarm.peer_id, peers[0].record.data_addrs

        async def go():
            # the caller stands in for the run's driver: the replica obeys its charter's driver only
            assert await peers[0].swarm.publish_charter(RunCharter(source.key, "guard", me, [me], True, LR, 1.0, 1, time.time()))
            record = (await peers[0].swarm.lookup(source.key, "guard"))[0]
            assert record.train_run == "guard" and record.state == PeerState.ONLINE
            # inference on a training replica: one clear line
            session = RouteSession(transport, [record], 16)
            with pytest.raises(PeerRefused, match="trains run 'guard'"):
                await session.open()
            # a NaN gradient is refused, and counts for nothing
            session = RouteSession(transport, [record], 8, Codec.NONE, None, Purpose.TRAINING, 1)
            await session.open()
            try:
                step = await session.submit(torch.randn(1, 8, 64))
                await session.result(step)
                with pytest.raises(PeerRefused, match="NaN"):
                    await session.backward(torch.full((1, 8, 64), float("nan")), step)
            finally:
                await session.close()
            assert replica.micro == 0
            with pytest.raises(PeerRefused, match="backward passes"):
                await call(transport, me, addrs, t.ApplyStep("guard", 0, 0, 1, 1, LR))
            with pytest.raises(PeerRefused, match="trains run 'guard'"):
                await call(transport, me, addrs, t.Status("other"))
            # a joiner of another stage shape, or of other weights, gets nothing
            for request in (t.FetchState("guard", source.key, 0, 2), t.FetchState("guard", "llama-4x64-0000000000000000", 0, 4)):
                with pytest.raises(RequestError, match="refused to share its state"):
                    await fetch_state(transport, me, addrs, request, {})

        loop.run(go())
        assert all(torch.equal(a, b.detach()) for a, b in zip(before, replica.weights))
    with pytest.raises(RequestError, match="run name"):
        t.from_header({"kind": "status", "run": "bad name!"})
    with pytest.raises(RequestError, match="sync_every"):
        SwarmTrainer.connect(str(source.folder), ["/ip4/127.0.0.1/tcp/1/p2p/x"], run="r", sync_every=0)


def test_only_the_runs_driver_steers_its_replicas(tiny_models, tmp_path):
    """A stranger (not the run's driver, not a replica) runs a training session, steps with lr 100,
    averages the replica alone, reads its state: all refused, the weights untouched. The driver
    cannot pass its own bound either, and a second driver cannot take the run's name."""
    source = tiny_models["llama"]
    with peers_in_background(source, [(0, 4)], train="owned") as (peers, maddrs, loop):
        replica = peers[0].training.replica
        with SwarmTrainer.connect(str(source.folder), maddrs, run="owned", sync_every=100, lr=LR) as trainer:
            trainer.step(BATCHES[0])
            before = [w.detach().clone() for w in [*replica.weights, *replica.outer]]

            async def stranger() -> list[str]:  # one that proves who it is: its peer id is not the driver's
                node = await join_swarm(maddrs, client_mode=True, identity_path=str(tmp_path / "stranger.key"))
                refused = []
                try:
                    record = (await node.lookup(source.key, "owned"))[0]
                    session = RouteSession(node.transport, [record], 8, Codec.NONE, None, Purpose.TRAINING, 1)
                    with pytest.raises(PeerRefused) as caught:
                        await session.open()
                    refused.append(str(caught.value))
                    for request in (t.ApplyStep("owned", 0, 1, 0, 1, 100.0), t.DiscardStep("owned", 1),
                                    t.OuterStep("owned", 0, [record.peer_id], lr=5.0)):
                        with pytest.raises(PeerRefused) as caught:
                            await call(node.transport, record.peer_id, record.data_addrs, request)
                        refused.append(str(caught.value))
                    with pytest.raises(RequestError) as caught:
                        await fetch_state(node.transport, record.peer_id, record.data_addrs,
                                          t.FetchState("owned", source.key, 0, 4), layer_shapes(source.folder, 0, 4))
                    refused.append(str(caught.value))
                finally:
                    await node.shutdown()
                return refused

            refused = loop.run(stranger())
            assert "training sessions come from the run's driver" in refused[0]
            assert all("only the run's driver" in r for r in refused[1:4]), refused
            assert "the run's state is for its driver and its replicas" in refused[4]
            assert all(torch.equal(a, b.detach()) for a, b in zip(before, [*replica.weights, *replica.outer]))
            with pytest.raises(RequestError, match="max_lr"):
                trainer.step(BATCHES[1], lr=1.0)
            with pytest.raises(RequestError, match="belongs to driver"):
                SwarmTrainer.connect(str(source.folder), maddrs, run="owned", identity=str(tmp_path / "other.key"))
            assert trainer.step(BATCHES[1]) > 0 and replica.step == 2


def test_a_replica_whose_outer_step_went_otherwise_copies_the_weights_most_replicas_hold(tiny_models):
    """However an averaging round went otherwise for one replica (a member's tensors reached it late,
    past the others' wait for its echo; a retry among fewer members), the replicas of a stage must
    go on from the same outer weights: the driver sees the digests differ and the odd one copies
    the majority's weights before its next step."""
    source = tiny_models["llama"]
    with peers_in_background(source, [(0, 2), (0, 2), (0, 2), (2, 4)], train="astray") as (peers, maddrs, loop):
        replicas = [p.training.replica for p in peers[:3]]
        odd = replicas[2]
        honest = odd.outer_step
        odd.outer_step = lambda averaged, hyper: honest([a * 1.5 for a in averaged], hyper)  # another mean
        same = BATCHES[0][:1].repeat(3, 1)  # one row each, the same: no member's mean is left out
        with SwarmTrainer.connect(str(source.folder), maddrs, run="astray", sync_every=100, lr=LR) as trainer:
            trainer.step(same)
            trainer.outer_step()
            assert odd.digest != replicas[0].digest == replicas[1].digest
            trainer.step(same)  # it is told to copy, and is left out of this step meanwhile
            deadline = time.monotonic() + 30
            while odd.digest != replicas[0].digest and time.monotonic() < deadline:
                time.sleep(0.1)
            assert all(torch.equal(a, b) for a, b in zip(odd.outer, replicas[0].outer))
            odd.outer_step = honest
            trainer.step(same)
            assert odd.step == replicas[0].step  # back in the run's steps
            trainer.outer_step()
            assert odd.digest == replicas[0].digest == replicas[1].digest


def test_a_replica_the_others_left_out_sits_out_the_run_though_it_then_fails_the_round(tiny_models, monkeypatch):
    """A replica sends misshapen tensors: the others' means leave it out, and its own outer step
    then fails. Failing the round (a short reason) must not bring it back before the longer one
    ends, nor be asked again within the round; else it wastes micro-batches every few steps."""
    monkeypatch.setattr(driver, "AVOID_SECONDS", 0.2)
    source = tiny_models["llama"]
    with peers_in_background(source, [(0, 2), (0, 2), (0, 2), (2, 4)], train="misshapen") as (peers, maddrs, loop):
        replicas = [p.training.replica for p in peers[:3]]
        liar = replicas[2]
        honest = liar.pseudo_gradient
        liar.pseudo_gradient = lambda: [d.reshape(-1)[1:] for d in honest()]
        with SwarmTrainer.connect(str(source.folder), maddrs, run="misshapen", sync_every=100, lr=LR) as trainer:
            trainer.step(BATCHES[0])
            trainer.outer_step()
            assert replicas[0].digest == replicas[1].digest and liar.round == 0
            time.sleep(0.5)  # past AVOID_SECONDS, far from EVICT_SECONDS
            trainer.step(BATCHES[1])  # back in the run, it would be told to copy the others' weights now
            time.sleep(1.0)
            trainer.step(BATCHES[2])  # and would take this step
            assert replicas[0].step == 3 and (liar.step, liar.round) == (1, 0)


def test_micro_batches_spread_over_replicas_and_stages_must_tile():
    a, b = rec(0, 2, name="a"), rec(0, 2, name="b")
    c = rec(2, 4, name="c")
    tiled = stages([c, b, a], 4)
    assert [[r.peer_id for r in s] for s in tiled] == [["a", "b"], ["c"]]
    routes = chains(tiled, rows=8)
    assert [[r.peer_id for r in route] for route in routes] == [["a", "c"], ["b", "c"]]
    assert served(routes) == {"a": 1, "b": 1, "c": 2}
    assert chains(tiled, rows=1) == [[a, c]]
    assert split_rows(5, 2) == [(0, 2), (2, 5)]
    with pytest.raises(RouteError, match="layers 2:4"):
        stages([a, b], 4)
    with pytest.raises(RouteError, match="overlap"):
        stages([a, rec(1, 4, name="d")], 4)
    # after an outer step: the weights more than half the replicas hold, and who copies them
    x, y = b"x" * 32, b"y" * 32
    assert astray({"a": x, "b": x, "c": y}) == (x, ["c"])
    assert astray({"a": x, "b": y}) == (None, [])  # no majority: nobody copies anybody
    assert astray({"a": x, "b": x, "c": b""}) == (x, [])  # a replica that does not say is no vote
    assert astray({}) == (None, [])


def test_a_joining_replica_fills_a_gap_then_the_thinnest_stage():
    assert training_stage([], 30, 10) == (0, 10)
    run = [rec(0, 10, name="a"), rec(10, 20, name="b")]
    assert training_stage(run, 30, 10) == (20, 30)
    assert training_stage(run, 30, 4) == (20, 24)
    full = [*run, rec(20, 30, name="c"), rec(0, 10, name="d")]
    assert training_stage(full, 30, 10) == (10, 20)
    assert training_stage(full, 30, 5) is None
    assert training_stage([rec(0, 10, state=PeerState.OFFLINE)], 30, 10) == (0, 10)
    # a replica's range must match a stage exactly, or hold layers no replica holds
    assert misfit(full, 10, 20) is None and misfit(run, 20, 30) is None
    assert misfit(full, 5, 15) == (0, 10)

    with pytest.raises(RequestError, match="outer step settings"):
        OuterHyper(lr=0.7, momentum=1.5).check()


def test_an_averaging_round_with_a_dead_member_fails_cleanly_and_the_survivors_average_again():
    """A member that never sends: after the timeout the round fails on every survivor with their
    tensors unchanged, and a round of the survivors alone gives their average."""

    async def go():
        nodes = [await join_swarm([])]
        first = await nodes[0].maddrs()
        nodes += [await join_swarm(first) for _ in range(2)]
        averagers = [GroupAverager(n.transport, "test") for n in nodes[:2]]
        try:
            for averager in averagers:
                await averager.start()
            ids = [n.peer_id for n in nodes]
            await nodes[2].shutdown()  # named in the group, gone
            tensors = [[torch.full((300_000,), float(i)), torch.full((7,), 10.0 * i)] for i in range(2)]
            kept = [[x.clone() for x in ts] for ts in tensors]
            rounds = [a.average(b"with-dead", ts, ids, 1.0) for a, ts in zip(averagers, tensors)]
            for outcome in await asyncio.gather(*rounds, return_exceptions=True):
                assert isinstance(outcome, AveragingFailed)
            assert all(torch.equal(a, b) for ts, ks in zip(tensors, kept) for a, b in zip(ts, ks))
            rounds = [a.average(b"survivors", ts, ids[:2], 5.0) for a, ts in zip(averagers, tensors)]
            for averaged in await asyncio.gather(*rounds):
                assert torch.allclose(averaged.tensors[0], torch.full((300_000,), 0.5))
                assert torch.allclose(averaged.tensors[1], torch.full((7,), 5.0)) and averaged.left_out == []
            assert sum(a.wire_bytes for a in averagers) > 300_000 * 4
        finally:
            for averager in averagers:
                await averager.stop()
            for node in nodes[:2]:
                await node.shutdown()

    asyncio.run(go())


async def round_of_four(fourth: type[GroupAverager], tensors, group: bytes, timeout: float):
    """One averaging round of three honest members and a fourth of class `fourth`, each on a node
    of its own, with `tensors` (one list per member): the honest members' outcomes, and the
    fourth's peer id."""
    nodes = [await join_swarm([])]
    nodes += [await join_swarm(await nodes[0].maddrs()) for _ in range(3)]
    averagers = [GroupAverager(n.transport, "four") for n in nodes[:3]] + [fourth(nodes[3].transport, "four")]
    try:
        for averager in averagers:
            await averager.start()
        ids = [n.peer_id for n in nodes]
        outcomes = await asyncio.gather(
            *(a.average(group, ts, ids, timeout) for a, ts in zip(averagers, tensors)), return_exceptions=True
        )
        return outcomes[:3], ids[3]
    finally:
        for averager in averagers:
            await averager.stop()
        for node in nodes:
            await node.shutdown()


@pytest.mark.parametrize("poison", ["huge", "flipped", "shapes", "nan"])
def test_one_bad_member_of_four_barely_moves_the_average(poison):
    """Three honest members and one that sends huge values, the honest direction reversed, tensors
    of other shapes, or NaN: every honest member gets the same result, near the honest mean."""
    generator = torch.Generator().manual_seed(0)
    honest = [[torch.randn(50_000, generator=generator) * 0.1 + 1.0, torch.randn(3, 5, generator=generator) * 0.1 + 1.0]
              for _ in range(3)]
    bad = {"huge": [t * 1e6 for t in honest[0]], "flipped": [-3 * t for t in honest[0]],
           "shapes": [torch.ones(7), torch.ones(2)], "nan": [t * float("nan") for t in honest[0]]}[poison]
    results, liar = asyncio.run(round_of_four(GroupAverager, [*honest, bad], b"poisoned", 5.0))
    assert all(result.left_out == [liar] for result in results)  # every honest member names it
    results = [result.tensors for result in results]
    generator = torch.Generator().manual_seed(0)
    honest = [[torch.randn(50_000, generator=generator) * 0.1 + 1.0, torch.randn(3, 5, generator=generator) * 0.1 + 1.0]
              for _ in range(3)]
    flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in honest]
    mean = sum(flat) / 3
    # no further from the honest mean than an honest member is: as good as trusting any one of them
    spread = sorted(float((f - mean).norm()) for f in flat)[1]
    for result in results:
        assert all(torch.equal(a, b) for a, b in zip(result, results[0]))  # every honest member alike
        error = float((torch.cat([t.reshape(-1) for t in result]) - mean).norm())
        assert error < spread, (error, spread)


class TwoFaced(GroupAverager):
    """A member that sends each other member its own version of its tensors, each sealed by its own
    key (which it holds): honest-looking values a robust mean would keep."""

    async def _send(self, peer, group_id, tensors, compression, seal):
        self.versions = getattr(self, "versions", 0) + 1
        tensors = [t * (1 + 0.01 * self.versions) for t in tensors]
        await super()._send(peer, group_id, tensors, compression, self.seal(group_id, tensors))


class Framer(GroupAverager):
    """A member that echoes made-up digests for everyone else's seals, their signatures beside them."""

    async def _echo(self, round_):
        round_.seals = {p: (bytes(32), proof) for p, (_, proof) in round_.seals.items()}
        await super()._echo(round_)


class Missealed(GroupAverager):
    """A member whose seal is over other tensors than those it sends."""

    async def _send(self, peer, group_id, tensors, compression, seal):
        await super()._send(peer, group_id, tensors, compression, self.seal(group_id, [t + 1 for t in tensors]))


@pytest.mark.parametrize("liar", [TwoFaced, Framer, Missealed])
def test_a_member_that_sends_members_different_tensors_is_left_out_and_an_echo_frames_nobody(liar):
    """Three honest members and one that sends each a different version of its tensors (each
    sealed), one that echoes forged seals of the others, or one whose seal is not of its tensors:
    the honest members end alike, bit for bit, leaving out the two-faced and the missealed one,
    and nobody for the forged echoes."""
    generator = torch.Generator().manual_seed(1)
    tensors = [[torch.randn(20_000, generator=generator) * 0.1 + 1.0] for _ in range(4)]
    results, member = asyncio.run(round_of_four(liar, tensors, b"two-faced", 10.0))
    assert all(result.left_out == ([] if liar is Framer else [member]) for result in results)
    assert all(torch.equal(result.tensors[0], results[0].tensors[0]) for result in results)


class LateTwoFaced(GroupAverager):
    """A two-faced member that sends its other version to one member only after the others have
    stopped waiting for that member's echo: they never see the second seal."""

    async def _send(self, peer, group_id, tensors, compression, seal):
        victim = max(p for p in self._late_group if p != self.transport.peer_id)
        if peer == victim:  # once the others hold all tensors, and have stopped waiting for echoes
            round_ = self._rounds[group_id]
            while not set(round_.others) - {victim} <= set(round_.echoes):
                await asyncio.sleep(0.05)
            await asyncio.sleep(averaging.ECHO_WAIT + 0.5)
            tensors = [t * 1.01 for t in tensors]
            seal = self.seal(group_id, tensors)
        await super()._send(peer, group_id, tensors, compression, seal)

    async def average(self, group_id, tensors, peers, timeout, compression="none"):
        self._late_group = list(peers)
        return await super().average(group_id, tensors, peers, timeout, compression)


def test_a_member_two_faced_past_the_echo_wait_splits_the_round_and_is_proven_to_the_driver(monkeypatch):
    """The one member that got the late version sees both seals and leaves the liar out; the two that
    stopped waiting keep its first version. The late member's proof convicts the liar for anyone
    who knows the round, and without the liar's vote the two that agree are the majority the late
    one copies (the driver's `astray`)."""
    monkeypatch.setattr(averaging, "ECHO_WAIT", 0.5)
    generator = torch.Generator().manual_seed(2)
    tensors = [[torch.randn(20_000, generator=generator) * 0.1 + 1.0] for _ in range(4)]
    results, liar = asyncio.run(round_of_four(LateTwoFaced, tensors, b"late", 10.0))
    proven = [r for r in results if r.two_faced]
    early = [r for r in results if not r.two_faced]
    assert len(proven) == 1 and proven[0].left_out == [liar] and all(r.left_out == [] for r in early)
    assert convicted(proven[0].two_faced, "four", b"late") == {liar}
    assert convicted(proven[0].two_faced, "four", b"another round") == set()  # a proof holds for its round only
    assert torch.equal(early[0].tensors[0], early[1].tensors[0])
    assert not torch.equal(early[0].tensors[0], proven[0].tensors[0])
    digests = {f"early{i}": digest(r.tensors) for i, r in enumerate(early)} | {"late": digest(proven[0].tensors)}
    assert astray(digests) == (digest(early[0].tensors), ["late"])


def test_an_honest_pseudo_gradient_reversed_is_left_out_though_no_further_than_the_others():
    """Pseudo-gradients of a model far from trained: a shared direction under noise twice its size
    (cosines of about 0.2 between members, as measured). One member's own vector reversed is no
    further from the others than they are from each other, but points away from their median: it
    is left out. Honest members are all kept, and two of four reversed leave no majority to trust."""
    generator = torch.Generator().manual_seed(0)
    shared = torch.randn(20_000, generator=generator)
    honest = [shared + 2 * torch.randn(20_000, generator=generator) for _ in range(4)]
    assert robust_mean(honest).left_out == ()
    flipped = robust_mean([*honest[:3], -honest[3]])
    assert flipped.left_out == (3,)
    assert torch.allclose(flipped.value, robust_mean(honest[:3]).value)
    assert robust_mean([*honest[:2], -honest[2], -honest[3]]).left_out == ()
    # each member against the median of the others, found without sorting again: as by hand, ties too
    for members in range(3, 7):
        stacked = torch.randint(-2, 3, (members, 40), generator=generator).float()
        by_hand = [k for k in range(members) if float(stacked[k] @ _median(torch.cat([stacked[:k], stacked[k + 1:]]))) <= 0
                   or float(stacked[k].norm()) == 0]
        assert _opposed(stacked, stacked.sort(dim=0).values) == by_hand


def test_whom_a_replica_obeys_and_whose_state_a_joiner_copies():
    charter = RunCharter("m", "r", "QmDriver", ["QmA", "QmB"], False, 1e-3, 0.7, 10, 1.0)
    apply = t.ApplyStep("r", 0, 0, 1, 1, 1e-3)
    assert refusal(apply, charter, "QmDriver", "QmA") is None
    assert "only the run's driver" in refusal(apply, charter, "QmB", "QmA")
    assert "proved no peer id" in refusal(apply, charter, None, "QmA")
    assert "over the run's bound" in refusal(t.ApplyStep("r", 0, 0, 1, 1, 0.1), charter, "QmDriver", "QmA")
    assert "does not list" in refusal(t.OuterStep("r", 0, ["QmA", "QmX"]), charter, "QmDriver", "QmA")
    assert refusal(t.OuterStep("r", 0, ["QmA", "QmB"]), charter, "QmDriver", "QmA") is None
    fetch = t.FetchState("r", "m", 0, 4)
    assert refusal(fetch, charter, "QmB", "QmA") is None and refusal(fetch, charter, "QmX", "QmA", joining=True)
    assert refusal(fetch, replace(charter, open=True), "QmX", "QmA", joining=True) is None
    assert refusal("session", charter, "QmB", "QmA") is None and refusal("session", charter, "QmX", "QmA")
    assert refusal(t.Status("r", 3), None, None, "QmA") is None and refusal(apply, None, "QmDriver", "QmA")

    def answer(peer, round_, digest):
        return t.StateEnd("r", 0, 4, 5, round_, 0, 5, 3, 0, digest), rec(0, 4, name=peer)
    honest, liar = b"h" * 32, b"l" * 32
    answers = [answer("a", 2, honest), answer("b", 2, honest), answer("c", 7, liar)]
    assert [r.peer_id for _, r in agreed(answers)] == ["a", "b", "c"]  # claiming to be ahead wins nothing
    assert [r.peer_id for _, r in agreed(answers, 3)] == ["c"]
