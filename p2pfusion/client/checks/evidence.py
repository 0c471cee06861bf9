"""Judging a peer's signed receipts (net/receipts.py) against the client's own computation.

A canary's tokens are the client's own, so it can compute every hop's input and output itself
(client/checks/local.py). A receipt then convicts its signer when the peer's own input rows match
that computation (it received the canary's true states, by its own word) and its output sketch
does not. The bar is the rounding of the signer's weight format and of its output's codec, plus
what its layers may grow the input's rounding into, with a margin for what eight directions
estimate of a relative error. The same judgement runs on a fault report's evidence, by any client
that reads it: a report that does not hold discredits its signer. `judge_receipt` and `output_bar`
are pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from p2pfusion.client.checks.local import Recomputer
from p2pfusion.client.checks.policy import FORMAT_TOLERANCE, WIRE_TOLERANCE
from p2pfusion.dht.records import FaultReport
from p2pfusion.errors import ProofError, RequestError
from p2pfusion.net.receipts import Receipt, rows_of, session_seed, sketch

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


def judge_receipt(
    receipt: Receipt, steps: list[tuple[int, int, torch.Tensor]], inputs: torch.Tensor, output: torch.Tensor
) -> Judgement:
    """`steps`: (first position, positions, input rows) of the session at this peer up to the
    receipt's step; `inputs` the recomputed input of those positions [1, positions, hidden];
    `output` the recomputed output of the receipt's step [1, tokens, hidden]."""
    seed = session_seed(receipt.session, receipt.start)
    input_error = max(
        float(sketch_errors(rows, sketch(inputs[:, first:first + tokens], seed)).max()) for first, tokens, rows in steps
    )
    if not input_error <= INPUT_BAR:
        return Judgement(False, input_error, math.nan, math.nan)
    claimed = rows_of(receipt.output)
    output_error = float(sketch_errors(claimed, sketch(output, receipt.output_digest)).max())
    bar = output_bar(receipt, input_error)
    return Judgement(not output_error <= bar, input_error, output_error, bar)


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
    end = receipt.offset + receipt.tokens
    states = recomputer.states(evidence.tokens[:end], [receipt.start, receipt.end])
    if states is None:
        return None
    step = slice(receipt.offset, end)
    return judge_receipt(receipt, steps, states[receipt.start], states[receipt.end][:, step])
