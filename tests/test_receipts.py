"""Receipts and the judgement of their evidence, without a network (net/receipts.py,
client/checks/evidence.py): signatures that bind a receipt to its peer's identity, a history that
binds the session's earlier inputs, sketches that a recomputation lands within rounding of, and a
bar set by the signer's own format and codec."""

import dataclasses
import math

import pytest
import torch

from p2pfusion.client.checks.evidence import INPUT_BAR, inconsistent, judge_hop, judge_receipt, output_bar, standing
from p2pfusion.client.route.receipts import SignedSteps
from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.errors import ProofError
from p2pfusion.net.compression import Codec
from p2pfusion.net.identity import Identity
from p2pfusion.net.receipts import SKETCHED, Evidence, Receipt, ReceiptKey, rows_of, sketch
from p2pfusion.net.wire import WireError, decode_as, encode
from tests.receipts import HIDDEN, signed_steps

SIZES = [3, 1, 1]


@pytest.fixture(scope="module")
def key() -> ReceiptKey:
    return ReceiptKey(Identity.create())


def states(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    inputs = torch.randn(1, sum(SIZES), HIDDEN)
    return inputs, torch.tanh(inputs) * 3  # any function stands for the layers


def steps_of(receipts: list[Receipt]) -> list[tuple[int, int, torch.Tensor]]:
    return [(r.offset, r.tokens, rows_of(r.rows)) for r in receipts]


def test_a_receipt_is_bound_to_its_peer_and_content(key):
    inputs, outputs = states()
    receipt = signed_steps(key, inputs, outputs, SIZES)[-1]
    receipt.verify(key.cert.verify())
    assert decode_as(Receipt, encode(receipt)) == receipt
    with pytest.raises(ProofError):  # any field changed: the signature no longer holds
        dataclasses.replace(receipt, weights="int4").verify(key.cert.verify())
    other = ReceiptKey(Identity.create())
    with pytest.raises(ProofError):  # another peer's key
        receipt.verify(other.cert.verify())
    with pytest.raises(ProofError):  # a certificate claiming another peer id
        dataclasses.replace(other.cert, peer_id=key.peer_id).verify()
    with pytest.raises(ProofError):
        key.cert.verify(now=key.cert.expires + 1)
    with pytest.raises(WireError):  # sketches must cover the positions the receipt names
        decode_as(Receipt, {**encode(receipt), "tokens": 2})


def test_evidence_binds_the_earlier_inputs(key):
    inputs, outputs = states()
    receipts = signed_steps(key, inputs, outputs, SIZES)
    evidence = Evidence(list(range(5)), key.cert, receipts[-1], [(r.offset, r.tokens, r.rows) for r in receipts[:-1]])
    assert [(first, tokens) for first, tokens, _ in evidence.verify()] == [(0, 3), (3, 1), (4, 1)]
    forged_rows = bytes(len(receipts[0].rows))
    with pytest.raises(ProofError):  # other earlier inputs than those the peer signed
        dataclasses.replace(evidence, earlier=[(0, 3, forged_rows), (3, 1, receipts[1].rows)]).verify()
    with pytest.raises(ProofError):
        dataclasses.replace(evidence, earlier=[(0, 3, receipts[0].rows)]).verify()
    with pytest.raises(ProofError):  # the same rows at other positions: where each step began is signed too
        dataclasses.replace(evidence, earlier=[(0, 3, receipts[0].rows), (2, 1, receipts[1].rows)]).verify()


def test_a_recomputation_within_rounding_acquits_and_a_lie_convicts(key):
    inputs, outputs = states()
    recomputed_in = inputs + 1e-7 * torch.randn_like(inputs)  # another machine's float32
    recomputed_out = outputs + 1e-7 * torch.randn_like(outputs)
    receipts = signed_steps(key, inputs, outputs, SIZES)
    for receipt in receipts:
        part = slice(receipt.offset, receipt.offset + receipt.tokens)
        upto = [s for s in steps_of(receipts) if s[0] <= receipt.offset]
        assert not judge_receipt(receipt, upto, recomputed_in[:, :part.stop], recomputed_out[:, :part.stop]).guilty
    for size in (1e-3, 1e-2):  # a lie on the last step, as a fraction of the state's norm
        lied = outputs.clone()
        lied[:, -1] += size * outputs[:, -1].norm() * torch.nn.functional.normalize(torch.randn(HIDDEN), dim=0)
        receipts = signed_steps(key, inputs, lied, SIZES)
        judgement = judge_receipt(receipts[-1], steps_of(receipts), recomputed_in, recomputed_out)
        assert judgement.guilty and judgement.output_error > judgement.bar


def drafted(lie_at: int | None = None):
    """A session whose second step carried drafts, two of which fell (the third step begins
    where the first of them was): the canary's final inputs (6 positions), and what the peer was
    sent and returned at each of its 8 positions, its output at `lie_at` (of those 8) lied."""
    torch.manual_seed(0)
    final, fell = torch.randn(1, 6, HIDDEN), torch.randn(1, 2, HIDDEN)
    sent = torch.cat([final[:, :5], fell, final[:, 5:]], dim=1)
    returned = torch.tanh(sent) * 3
    if lie_at is not None:
        returned[:, lie_at] += 0.1 * returned[:, lie_at].norm()
    return final, sent, returned


def test_drafts_that_fell_are_not_judged_and_what_stands_is(key):
    final, sent, returned = drafted()
    receipts = signed_steps(key, sent, returned, [3, 4, 1], offsets=[0, 3, 5])
    steps = steps_of(receipts)
    assert standing(steps, 6) == [3, 2, 1] and standing(steps, 4) == [3, 1, 0]
    blocks = [(0, SKETCHED + 8, torch.zeros(SKETCHED, 8)), (SKETCHED, 1, torch.zeros(1, 8))]
    assert standing(blocks, SKETCHED + 1) is None  # a cut inside a step sketched by blocks

    def verdicts(receipts):
        steps, counts = steps_of(receipts), standing(steps_of(receipts), 6)
        known = [r.offset + n for r, n in zip(receipts, counts)]
        out = torch.tanh(final) * 3
        return [
            judge_receipt(r, steps[:i + 1], final[:, :k], out[:, :k]).guilty for i, (r, k) in enumerate(zip(receipts, known))
        ]

    assert verdicts(receipts) == [False, False, False]  # honest: the fallen drafts' outputs are not the canary's
    assert verdicts(signed_steps(key, sent, drafted(lie_at=6)[2], [3, 4, 1], offsets=[0, 3, 5])) == [False] * 3
    assert verdicts(signed_steps(key, sent, drafted(lie_at=4)[2], [3, 4, 1], offsets=[0, 3, 5])) == [False, True, False]
    lied = signed_steps(key, sent, drafted(lie_at=4)[2], [3, 4, 1], offsets=[0, 3, 5])
    evidence = Evidence(list(range(5)), key.cert, lied[1], [(0, 3, lied[0].rows)])
    assert [(first, count) for first, count, _ in evidence.verify()] == [(0, 3), (3, 4)]
    with pytest.raises(ProofError):  # a step placed elsewhere than the peer signed
        Evidence(list(range(5)), key.cert, lied[2], [(0, 3, lied[0].rows), (4, 4, lied[1].rows)]).verify()


def test_a_peer_given_other_inputs_is_not_convicted(key):
    """A framing client that fed a peer other states (or names other tokens) proves nothing: the
    peer's own input rows show its input was not the canary's."""
    inputs, outputs = states()
    receipts = signed_steps(key, inputs, outputs, SIZES)
    other_in, other_out = states(seed=1)
    judgement = judge_receipt(receipts[-1], steps_of(receipts), other_in, other_out)
    assert not judgement.guilty and judgement.input_error > INPUT_BAR and math.isnan(judgement.output_error)


def test_the_bar_is_the_signers_own_format_and_codec(key):
    inputs, outputs = states()
    base = signed_steps(key, inputs, outputs, SIZES)[-1]
    assert output_bar(base, 0.0) < 1e-3
    assert output_bar(dataclasses.replace(base, weights="int4"), 0.0) > 1
    assert output_bar(dataclasses.replace(base, codec=Codec.FLOAT16), 0.0) > 2e-2
    assert output_bar(dataclasses.replace(base, codec=Codec.TOPK), 0.0) == math.inf
    assert output_bar(base, 1e-3) > output_bar(base, 0.0) + 9e-3  # what its layers may grow of the input's error


def test_long_steps_are_sketched_in_blocks():
    torch.manual_seed(0)
    values = torch.randn(2, 100, HIDDEN)
    rows = sketch(values, b"seed")
    assert rows.shape == (SKETCHED, 8)
    assert torch.allclose(sketch(values + 1e-6, b"seed"), rows, atol=1e-4)
    assert sketch(values[:, :3], b"seed").shape == (6, 8)


def test_a_session_reads_the_codecs_its_hops_signed(key):
    """What a check's bar under `auto` rests on: this client's own sends and the hops' signed
    receipts; a receipt that does not verify, or a certificate in another's name, counts for none."""
    inputs, outputs = states()
    hop = PeerRecord("m", key.peer_id, [], 1, 3, PeerState.ONLINE, 1.0, None, "cpu")
    receipts = signed_steps(key, inputs, outputs, SIZES, codec=Codec.FLOAT16)
    receipts = [dataclasses.replace(r, session="s") for r in receipts]
    signed = SignedSteps("s", [hop])
    stranger = ReceiptKey(Identity.create())
    signed.take(receipts, [dataclasses.replace(stranger.cert, peer_id=key.peer_id), key.cert])
    for step in range(1, 4):
        signed.sent(step, Codec.NONE)
    assert signed.certs[key.peer_id] == key.cert
    assert signed.codecs(0, 5) is None  # re-sessioned: the signatures no longer hold
    receipts = signed_steps(key, inputs, outputs, SIZES, codec=Codec.FLOAT16, session="s")
    signed = SignedSteps("s", [hop])
    signed.take(receipts, [key.cert])
    for step in range(1, 4):
        signed.sent(step, Codec.NONE)
    assert signed.codecs(0, 5) == {Codec.NONE, Codec.FLOAT16}
    assert signed.codecs(0, 6) is None  # a position no receipt covers
    signed.take([dataclasses.replace(receipts[0], codec=Codec.NONE)], [])  # changed on the way: not signed so
    assert signed.codecs(0, 3) is None
    # drafts that fell: a step of 4 from position 3 and the next from 5 cover 3-6 twice, and 7 never
    final, sent, returned = drafted()
    signed = SignedSteps("s", [hop])
    signed.take(signed_steps(key, sent, returned, [3, 4, 1], session="s", offsets=[0, 3, 5]), [key.cert])
    for step in range(1, 4):
        signed.sent(step, Codec.NONE)
    assert signed.codecs(0, 7) == {Codec.NONE} and signed.codecs(0, 8) is None


def test_a_hop_is_judged_on_its_whole_session(key):
    """What a canary and a user's own session both rest on: a hop convicted on its first wrong
    receipt that stands, avoided for receipts of another format or out of chain, and unjudged
    (not signed) where its receipts are missing or not its own."""
    inputs, outputs = states()
    hop = PeerRecord("m", key.peer_id, [], 1, 3, PeerState.ONLINE, 1.0, None, "cpu")
    honest = signed_steps(key, inputs, outputs, SIZES)
    verdict = judge_hop(hop, honest, key.cert, inputs, outputs)
    assert verdict.signed and not verdict.avoid and verdict.judgement is None
    lied = outputs.clone()
    lied[:, 3] *= 1.01
    receipts = signed_steps(key, inputs, lied, SIZES)
    verdict = judge_hop(hop, receipts, key.cert, inputs, outputs)
    assert verdict.judgement.guilty and verdict.receipt == receipts[1] and verdict.kept == 1
    assert judge_hop(hop, receipts, key.cert, inputs[:, :3], outputs[:, :3]).judgement is None  # the lie not known yet
    assert not judge_hop(hop, receipts[:1] + receipts[2:], key.cert, inputs, outputs).signed  # a step's receipt missing
    assert not judge_hop(hop, receipts, ReceiptKey(Identity.create()).cert, inputs, outputs).signed
    assert judge_hop(hop, signed_steps(key, inputs, outputs, SIZES, weights="int4"), key.cert, inputs, outputs).avoid
    # a step left out of the history it chains: another input than the peer says its cache holds
    unchained = signed_steps(key, inputs, outputs, SIZES, offsets=[0, 3, 3])
    assert judge_hop(hop, unchained[:1] + unchained[2:], key.cert, inputs[:, :4], outputs[:, :4]).avoid
    # neighbours that disagree on the bytes between them are both named, and only they
    after = PeerRecord("m", "next", [], 3, 4, PeerState.ONLINE, 1.0, None, "cpu")
    first = PeerRecord("m", "first", [], 0, 1, PeerState.ONLINE, 1.0, None, "cpu")
    sent = [dataclasses.replace(r, peer_id="next", input_digest=r.output_digest) for r in honest]
    assert inconsistent([first, hop, after], honest + sent, "session-1") == set()
    sent[1] = dataclasses.replace(sent[1], input_digest=bytes(32))
    assert inconsistent([first, hop, after], honest + sent, "session-1") == {key.peer_id, "next"}
