"""Judging a peer's signed receipts (net/receipts.py) against the client's own computation.

A canary's tokens are the client's own, so it can compute every hop's input and output itself
(client/checks/local.py). A receipt then convicts its signer when the peer's own input rows match
that computation (it received the canary's true states, by its own word) and its output sketch
does not. The bar is the rounding of the signer's weight format and of its output's codec, plus
what its layers may grow the input's rounding into, with a margin for what eight directions
estimate of a relative error. The same judgement runs on a fault report's evidence, by any client
that reads it: a report that does not hold discredits its signer. A client also judges the
receipts of its own session, when a check found it wrong and no peer repeated the error on replay
(client/checks/blame.py): the verdict is its own, since the evidence holds the user's states.
`standing`, `judge_receipt`, `judge_hop`, `inconsistent` and `output_bar` are pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from p2pfusion.client.checks.local import Recomputer
from p2pfusion.client.checks.policy import FORMAT_TOLERANCE, WIRE_TOLERANCE
from p2pfusion.dht.records import FaultReport, PeerRecord
from p2pfusion.errors import ProofError, RequestError
from p2pfusion.net.receipts import Receipt, ReceiptCert, chain, rows_of, session_seed, sketch

# A receipt's input rows may differ from the recomputed input by the wire's rounding (float16 and
# bfloat16 codecs: 5e-4 to 5e-3) and the compute dtype's; past this its input was not the canary's
# and its output proves nothing about it.
INPUT_BAR = 2e-2
# How much a hop may grow the relative error of its input: noise of 1e-4 on a middle hop's output
# reached the last hop's as 4.6e-4 on the default model (client/checks/policy.py, HOP_SHARE).
AMPLIFY = 10.0
# Eight directions estimate a relative error within a factor of 2.24 either way, but for 1 time
# in a million (chi-square with 8 degrees of freedom).
SKETCH_MARGIN = 3.0


@dataclass(frozen=True)
class Judgement:
    guilty: bool
    input_error: float  # of the receipt's input rows against the recomputed input
    output_error: float  # of its output sketch against the recomputed output (nan: not compared)
    bar: float  # what the output error had to pass to convict


def sketch_errors(claimed: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per row relative L2 errors of two sketches [rows, width]; a non-finite claim is infinite."""
    errors = (claimed - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-30)
    return torch.where(torch.isfinite(errors), errors, torch.full_like(errors, math.inf))


def output_bar(receipt: Receipt, input_error: float) -> float:
    """The largest output error an honest peer of the receipt's format and codec shows, given an
    input off by `input_error`."""
    rounding = FORMAT_TOLERANCE.get(receipt.weights, math.inf) + WIRE_TOLERANCE[receipt.codec]
    return SKETCH_MARGIN * (rounding + AMPLIFY * input_error)


Step = tuple[int, int, torch.Tensor]  # first position, positions, input rows


def standing(steps: list[Step], known: int) -> list[int] | None:
    """How many positions of each step (in order) the session's cache still held at the last one,
    among its first `known` positions: a step that begins before the one before it ended dropped
    that one's later positions (drafts that fell). None when a cut falls in a step sketched by
    blocks, whose rows no longer say which positions they stand for."""
    counts, cut = [], known
    for first, count, rows in reversed(steps):
        kept = max(min(first + count, cut) - first, 0)
        cut = min(cut, first)
        if 0 < kept < count and rows.shape[0] != count:
            return None
        counts.append(kept)
    return counts[::-1]


def judge_receipt(receipt: Receipt, steps: list[Step], inputs: torch.Tensor, outputs: torch.Tensor) -> Judgement:
    """`steps`: (first position, positions, input rows) of the session at this peer, up to the
    receipt's step; `inputs` and `outputs` the recomputed input and output of the peer's layers
    at the positions the client knows the tokens of [1, known, hidden]. Only positions that stand
    are judged: those of drafts that fell were fed tokens the client no longer holds."""
    counts = standing(steps, inputs.shape[1])
    if not counts or not counts[-1]:
        return Judgement(False, math.nan, math.nan, math.nan)  # nothing of the step is known, or not which rows
    seed = session_seed(receipt.session, receipt.start)
    input_error = max(
        float(sketch_errors(rows[:kept], sketch(inputs[:, first:first + kept], seed)).max())
        for (first, _, rows), kept in zip(steps, counts) if kept
    )
    if not input_error <= INPUT_BAR:
        return Judgement(False, input_error, math.nan, math.nan)
    judged = counts[-1]  # all of a step sketched by blocks (`standing`)
    claimed = rows_of(receipt.output)[:judged]
    output = outputs[:, receipt.offset:receipt.offset + judged]
    output_error = float(sketch_errors(claimed, sketch(output, receipt.output_digest)).max())
    bar = output_bar(receipt, input_error)
    return Judgement(not output_error <= bar, input_error, output_error, bar)


@dataclass(frozen=True)
class HopVerdict:
    """What one hop's receipts of a session show against the client's computation of its layers."""

    signed: bool  # False: receipts missing or not its own (it did not sign, or a later hop changed them)
    avoid: bool = False  # receipts of another format than its record's, out of chain, or cut as no client cuts
    judgement: Judgement | None = None  # of the first receipt that convicts it
    receipt: Receipt | None = None  # that receipt
    kept: int = 0  # its positions that stand


def judge_hop(
    hop: PeerRecord, receipts: list[Receipt], cert: ReceiptCert | None, inputs: torch.Tensor, outputs: torch.Tensor,
) -> HopVerdict:
    """Judge a hop on its receipts of one session (in step order) against the recomputed input
    and output of its layers at the positions the client knows [1, known, hidden]: guilty on the
    first receipt that its own input rows say it computed wrong."""
    if cert is None or not receipts:
        return HopVerdict(False)
    try:
        key = cert.verify()
        for receipt in receipts:
            receipt.verify(key)
    except ProofError:
        return HopVerdict(False)
    if any(r.weights != hop.weights or r.batch != 1 for r in receipts):
        return HopVerdict(True, avoid=True)
    steps: list[Step] = []
    history, end = b"", 0
    for receipt in receipts:
        history = chain(history, receipt.offset, receipt.tokens, receipt.rows)
        if receipt.offset > end:
            return HopVerdict(False)  # a step's receipt is missing
        if receipt.history != history:
            return HopVerdict(True, avoid=True)
        steps.append((receipt.offset, receipt.tokens, rows_of(receipt.rows)))
        end = receipt.offset + receipt.tokens
    counts = standing(steps, inputs.shape[1])  # what stands of each step at the end
    if counts is None:
        return HopVerdict(True, avoid=True)
    for i, (receipt, kept) in enumerate(zip(receipts, counts)):
        if not kept:
            continue
        known = receipt.offset + kept
        judgement = judge_receipt(receipt, steps[:i + 1], inputs[:, :known], outputs[:, :known])
        if judgement.guilty:
            return HopVerdict(True, judgement=judgement, receipt=receipt, kept=kept)
    return HopVerdict(True)


def inconsistent(route: list[PeerRecord], receipts: list[Receipt], session_id: str) -> set[str]:
    """Neighbours whose digests of the bytes between them differ at some step: one of the two lies
    about what it sent or received, and nothing shows which."""
    signed = {(r.peer_id, r.step): r for r in receipts if r.session == session_id}
    found: set[str] = set()
    for a, b in zip(route, route[1:]):
        for (peer, step), sent in signed.items():
            got = signed.get((b.peer_id, step))
            if peer == a.peer_id and got is not None and got.input_digest != sent.output_digest:
                found |= {a.peer_id, b.peer_id}
    return found


def judge_report(report: FaultReport, recomputer: Recomputer, now: float | None = None) -> Judgement | None:
    """Whether a fault report convicts its accused, by this client's own computation of the
    canary's layers (None: they are too large to compute here). A report whose signatures or
    rows do not hold is not guilty."""
    evidence, receipt = report.evidence, report.evidence.receipt
    acquitted = Judgement(False, math.nan, math.nan, math.nan)
    if receipt.end > recomputer.num_layers or max(evidence.tokens) >= recomputer.vocab_size:
        return acquitted  # not this model's canary
    try:
        steps = evidence.verify(now)
    except (ProofError, RequestError):
        return acquitted
    states = recomputer.states(evidence.tokens[:receipt.offset + receipt.tokens], [receipt.start, receipt.end])
    if states is None:
        return None
    return judge_receipt(receipt, steps, states[receipt.start], states[receipt.end])
