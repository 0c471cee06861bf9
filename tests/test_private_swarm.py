"""A private swarm (--swarm-secret), with real peers on 127.0.0.1: its members serve each other
exactly, while a peer or client without the secret, or with another, is refused at the DHT and on
the data plane, direct or through libp2p; the swarm keeps serving through all of it. And the
`swarm-secret` command writes a private file it never overwrites."""

import asyncio
import logging
import os
import re
import stat

import pytest
import torch

from p2pfusion.cli.main import main
from p2pfusion.client.tune.distributed import AutoDistributedModelForCausalLM
from p2pfusion.client.generate.swarm_lm import SwarmLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import ConfigError, RouteError
from p2pfusion.net import messages as m
from p2pfusion.net.framing import read_frame, write_frame
from p2pfusion.net.secret import SecretProof, SwarmSecret, create_secret_file, load_secret
from p2pfusion.net.transport import Transport
from p2pfusion.net.wire import WireError, decode_as
from tests.conftest import reference_model
from tests.swarm import peers_in_background, start_peer
from tests.tiny_chat import with_chat_tokenizer

IDS = [3, 17, 42, 99, 5]
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def private(tiny_models, tmp_path_factory):
    """Two keyed peers of the tiny llama, for the whole module: (source, secret file, other secret
    file, bootstrap maddrs, peers, loop, transformers' greedy tokens)."""
    folder = tmp_path_factory.mktemp("private")
    source = with_chat_tokenizer(tiny_models["llama"], folder / "llama")
    mine, other = create_secret_file(folder / "swarm.secret"), create_secret_file(folder / "other.secret")
    with torch.no_grad():
        out = reference_model(source).generate(torch.tensor([IDS]), max_new_tokens=NEW_TOKENS, do_sample=False)
    secret = SwarmSecret.load(mine)
    with peers_in_background(source, [(0, 2), (2, 4)], swarm_secret=secret) as (peers, maddrs, loop):
        yield source, mine, other, maddrs, peers, loop, out[0, len(IDS):].tolist()


async def _generate(source, maddrs, secret_file) -> list[int]:
    async with await SwarmLM.connect(maddrs, source, compression="none", verify=0.0, swarm_secret=secret_file) as lm:
        return (await lm.generate(IDS, NEW_TOKENS, stop_at_eos=False)).token_ids


def test_keyed_clients_get_transformers_tokens(private):
    source, mine, _, maddrs, _, loop, expected = private
    assert loop.run(_generate(source, maddrs, mine)) == expected
    model = AutoDistributedModelForCausalLM.from_pretrained(str(source.folder), maddrs, swarm_secret=mine, verify=0.0)
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([IDS]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0, len(IDS):].tolist() == expected
    finally:
        model.close()


def test_nodes_without_the_secret_or_with_another_cannot_join(private, caplog):
    source, _, other, maddrs, _, loop, _ = private
    caplog.set_level(logging.INFO, logger="p2pfusion")
    with pytest.raises(RouteError, match="if the swarm is private, --swarm-secret must name its secret file"):
        loop.run(start_peer(source, maddrs, (0, 4)))
    with pytest.raises(RouteError, match="--swarm-secret must name its secret file$"):
        loop.run(join_swarm(maddrs, client_mode=True))
    with pytest.raises(RouteError, match=re.escape(f"this node's, from {other}, may not be theirs")):
        loop.run(_generate(source, maddrs, other))
    refusals = [r.getMessage() for r in caplog.records if r.name == "p2pfusion.net.secret"]
    assert any("DHT requests without the swarm secret" in line for line in refusals)
    assert any("DHT requests signed with another swarm secret" in line for line in refusals)
    assert not any(r.exc_info for r in caplog.records)


async def _outsider_sees_nothing(keyed_peer_id: str) -> tuple:
    """A keyless node of a swarm of its own asks a keyed peer directly: its ping and its search get
    no answer."""
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import PeerID

    from p2pfusion.dht.records import model_key

    node = await join_swarm([])
    try:
        peer = PeerID.from_base58(keyed_peer_id)
        protocol = node.dht.protocol
        return await protocol.call_ping(peer), await protocol.call_find(peer, [DHTID.generate(model_key("x"))])
    finally:
        await node.shutdown()


def test_a_keyless_node_gets_no_dht_answers(private):
    _, _, _, _, peers, loop, _ = private
    assert loop.run(_outsider_sees_nothing(peers[0].swarm.peer_id)) == (None, None)


async def _ask(maddrs, peer, secret, direct: bool, message) -> object:
    """`message` to the stage protocol of `peer`, from a bare transport holding `secret`, over a
    direct connection or a libp2p stream; its answer, or the error that ended the stream."""
    transport = await Transport.start(maddrs, "127.0.0.1", 0, None, client_mode=True, secret=secret)
    try:
        addrs = peer.swarm.transport.data_addrs if direct else []
        reader, writer = await transport.open(peer.swarm.peer_id, addrs, m.PROTOCOL)
        try:
            await write_frame(writer, m.to_header(message))
            header, _ = await asyncio.wait_for(read_frame(reader), 10)
            return m.from_header(header)
        except (EOFError, OSError) as exc:
            return exc
        finally:
            writer.close()
    finally:
        await transport.shutdown()


def test_streams_without_the_secret_are_closed_before_any_handler(private, caplog):
    _, mine, other, maddrs, peers, loop, _ = private
    caplog.set_level(logging.INFO, logger="p2pfusion")
    route = [m.Hop(p.swarm.peer_id, p.swarm.transport.data_addrs, p.record.start, p.record.end) for p in peers]
    opening = m.Open("s1", length=16, route=route)
    served = sum(peer.server.sessions_opened for peer in peers)
    for secret in (None, load_secret(other)):
        for direct in (True, False):
            for message in (m.Ping(), opening):
                answer = loop.run(_ask(maddrs, peers[0], secret, direct, message))
                assert isinstance(answer, (EOFError, OSError)), (secret, direct, message, answer)
    assert sum(peer.server.sessions_opened for peer in peers) == served
    lines = [r.getMessage() for r in caplog.records if r.name == "p2pfusion.net.secret"]
    assert any("streams with no proof of the swarm secret" in line for line in lines)
    assert any("streams with a wrong swarm secret" in line for line in lines)
    assert not any(r.exc_info for r in caplog.records)
    # the same transport with the secret is served, either way
    for direct in (True, False):
        assert isinstance(loop.run(_ask(maddrs, peers[0], load_secret(mine), direct, m.Ping())), m.Ack)


def test_a_proof_is_worth_nothing_elsewhere_later_or_twice():
    secret = SwarmSecret(os.urandom(32))
    proof = secret.proof("PeerA", m.PROTOCOL)
    assert secret.refusal(proof, "PeerB", m.PROTOCOL) == "a wrong swarm secret"
    assert secret.refusal(proof, "PeerA", "another.protocol") == "a wrong swarm secret"
    assert SwarmSecret(os.urandom(32)).refusal(proof, "PeerA", m.PROTOCOL) == "a wrong swarm secret"
    assert secret.refusal(proof, "PeerA", m.PROTOCOL) is None
    assert secret.refusal(proof, "PeerA", m.PROTOCOL) == "a replayed proof of the swarm secret"
    when = proof.t - 120_000
    stale = SecretProof(when, proof.n, secret._mac("PeerA", m.PROTOCOL, when, proof.n))
    assert secret.refusal(stale, "PeerA", m.PROTOCOL).startswith("a stale proof")
    with pytest.raises(WireError):  # malformed: refused before it is weighed
        decode_as(SecretProof, {"t": "x", "n": proof.n, "mac": proof.mac})


def test_the_swarm_secret_command_and_bad_files(tmp_path, capsys, caplog):
    path = tmp_path / "swarm.secret"
    assert main(["swarm-secret", str(path)]) == 0
    assert f"--swarm-secret {path}" in capsys.readouterr().out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert len(text) == 65 and text.endswith("\n") and bytes.fromhex(text.strip())
    assert main(["swarm-secret", str(path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert path.read_text() == text

    bad = tmp_path / "bad.secret"
    bad.write_text("not hex\n")
    for file, error in ((bad, "must hold 64 hex digits"), (tmp_path / "missing", "does not exist")):
        assert main(["swarm", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmPeer", "--swarm-secret", str(file)]) == 2
        err = capsys.readouterr().err
        assert error in err and len(err.strip().splitlines()) == 1
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="p2pfusion"):
        load_secret(path)
    assert "may be read by other users" in caplog.text
    with pytest.raises(ConfigError, match="32 bytes"):
        SwarmSecret(b"short")


def test_the_private_swarm_keeps_serving(private):
    source, mine, _, maddrs, _, loop, expected = private
    assert loop.run(_generate(source, maddrs, mine)) == expected
