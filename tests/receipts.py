"""Receipts and fault reports made here, for tests of their rules (real keys, made-up states)."""

import dataclasses
import time

import torch

from p2pfusion.dht.records import FaultReport
from p2pfusion.net.compression import Codec
from p2pfusion.net.identity import Identity
from p2pfusion.net.receipts import Evidence, ReceiptChain, ReceiptKey

HIDDEN = 16


def signed_steps(key: ReceiptKey, inputs: torch.Tensor, outputs: torch.Tensor, sizes: list[int], start=1, end=3,
                 weights="float32", codec=Codec.NONE, session="session-1", offsets: list[int] | None = None):
    """The receipts a peer with `key` signs for one session's steps of `sizes` positions, which
    `inputs` and `outputs` hold one after the other; each step begins at its `offsets` (by default
    where the one before ended; earlier: drafts of the one before fell)."""
    chain = ReceiptChain(key, session, start, end, weights)
    receipts, taken, offset = [], 0, 0
    for step, size in enumerate(sizes, 1):
        offset = offset if offsets is None else offsets[step - 1]
        part = slice(taken, taken + size)
        receipts.append(chain.receipt(step, offset, inputs[:, part], outputs[:, part], codec))
        taken, offset = taken + size, offset + size
    return receipts


def fault(accused: str | None = None, identity: Identity | None = None, key: ReceiptKey | None = None) -> FaultReport:
    """A well-formed report against `accused` (a receipt of its own, signed or not by `identity`),
    or against the peer whose receipt `key` signs its receipts."""
    key = key or ReceiptKey(identity or Identity.create())
    torch.manual_seed(0)
    inputs, outputs = torch.randn(1, 5, HIDDEN), torch.randn(1, 5, HIDDEN)
    receipts = signed_steps(key, inputs, outputs, [3, 1, 1])
    cert = key.cert
    if accused is not None:
        receipts = [dataclasses.replace(r, peer_id=accused) for r in receipts]
        cert = dataclasses.replace(cert, peer_id=accused)
    last = receipts[-1]
    evidence = Evidence(list(range(5)), cert, last, [(r.offset, r.tokens, r.rows) for r in receipts[:-1]])
    return FaultReport(last.peer_id, last.start, last.end, 0.25, evidence, time.time())
