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
                 weights="float32", codec=Codec.NONE, session="session-1"):
    """The receipts a peer with `key` signs for one session's steps of `sizes` positions."""
    chain = ReceiptChain(key, session, start, end, weights)
    receipts, offset = [], 0
    for step, size in enumerate(sizes, 1):
        part = slice(offset, offset + size)
        receipts.append(chain.receipt(step, offset, inputs[:, part], outputs[:, part], codec))
        offset += size
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
    evidence = Evidence(list(range(5)), cert, last, [(r.tokens, r.rows) for r in receipts[:-1]])
    return FaultReport(last.peer_id, last.start, last.end, 0.25, evidence, time.time())
