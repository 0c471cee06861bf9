"""Seals and echoes of an averaging round (net/averaging.py): what each member proves it sent.

A member seals the tensors it sends with its identity key's signature over their digest, and
echoes the seals it received to the other members. Two seals of one member over different
digests in one round prove it sent different tensors to different members (`TwoSeals`, in net/run_messages.py): any
member that holds both leaves it out, and anyone who knows the round (its namespace and group)
can check the proof, as a run's driver does before it lets the other members outvote the ones
that saw it (client/run/replicas.py `astray`). Nobody can make such a proof against a member
without its key.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import torch

from p2pfusion.net import messages as m
from p2pfusion.net import wire
from p2pfusion.net.identity import PeerProof, ProofError, signer
from p2pfusion.net.run_messages import TwoSeals

log = logging.getLogger(__name__)

SEAL_PREFIX = b"p2pfusion averaging seal "


@dataclass(frozen=True)
class Echoed:
    member: m.Id
    digest: Annotated[bytes, wire.Length(32, 32)]
    sig: Annotated[bytes, wire.Length(wire.MAX_PEER_SIG_BYTES)]


def digest(tensors: Sequence[torch.Tensor]) -> bytes:
    """What a seal signs: the tensors' float32 values, in order."""
    hashed = hashlib.sha256()
    for tensor in tensors:
        hashed.update(tensor.float().contiguous().numpy().data)
    return hashed.digest()


def seal_message(namespace: str, group: bytes, values: bytes) -> bytes:
    return SEAL_PREFIX + namespace.encode() + b"\0" + group + values


def sealer(proof: PeerProof, namespace: str, group: bytes, values: bytes) -> str:
    """The member whose seal over `values` in this round `proof` is; ProofError when it is none."""
    return signer(proof, seal_message(namespace, group, values), "seal")


def equivocators(
    seals: dict[str, tuple[bytes, PeerProof]], echoes: dict[str, list[Echoed]], namespace: str, group: bytes
) -> dict[str, TwoSeals]:
    """The members that sealed another digest for an echoing member than for this one, with a
    signature that holds, and the proof (`seals`: what each member sealed here; `echoes`: what each
    echoing member says it got). Echoed seals that do not hold prove nothing about anyone."""
    found = {}
    for echoer, echoed in echoes.items():
        for seal in echoed:
            own = seals.get(seal.member)
            if own is None or seal.member == echoer or seal.digest == own[0] or seal.member in found:
                continue
            try:
                if sealer(PeerProof(own[1].key, seal.sig), namespace, group, seal.digest) == seal.member:
                    found[seal.member] = TwoSeals(seal.member, own[1].key, own[0], own[1].sig, seal.digest, seal.sig)
            except ProofError:
                log.warning("averaging: %s echoed a seal of %s that does not hold", echoer, seal.member)
    return found


def convicted(proofs: Sequence[TwoSeals], namespace: str, group: bytes) -> set[str]:
    """The members whose two seals in `proofs` hold for this round: a proof that does not hold
    convicts nobody."""
    guilty = set()
    for proof in proofs:
        if proof.first == proof.second:
            continue
        try:
            if all(sealer(PeerProof(proof.key, sig), namespace, group, values) == proof.member
                   for values, sig in ((proof.first, proof.first_sig), (proof.second, proof.second_sig))):
                guilty.add(proof.member)
        except ProofError:
            log.warning("a proof that %s sealed two digests does not hold", proof.member)
    return guilty
