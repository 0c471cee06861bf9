"""What a session's hops signed of its steps (net/receipts.py), as the client keeps it: their
receipts and certificates as they came with each `Result`, and the codec this client sent each
step's inputs in. A canary judges the receipts (client/generate/canary.py); a check reads from them the
codecs the states it compares actually crossed the wire in (`codecs`), so that its bar under
`auto` compression is that of those codecs, not of any codec `auto` might have picked.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from p2pfusion.dht.records import PeerRecord
from p2pfusion.errors import ProofError
from p2pfusion.net.compression import Codec
from p2pfusion.net.receipts import Receipt, ReceiptCert


class SignedSteps:
    def __init__(self, session_id: str, route: list[PeerRecord]):
        self.session_id = session_id
        self.route = route
        self.receipts: list[Receipt] = []  # as they came, unchecked
        self.certs: dict[str, ReceiptCert] = {}  # the hops' receipt key certificates that hold, by peer id
        self._sent: dict[int, Codec] = {}  # step -> the codec this client sent its inputs in
        self._verified: set[int] = set()  # ids of the receipts (kept in `receipts`) whose signature holds
        self._keys: dict[str, Ed25519PublicKey] = {}  # the receipt keys those certificates certify

    def sent(self, step: int, codec: Codec) -> None:
        self._sent[step] = codec

    def take(self, receipts: list[Receipt], certs: list[ReceiptCert]) -> None:
        """A step's receipts, and the certificates that hold (a hop may pass on a false one
        in another's name: it takes the place of none)."""
        self.receipts.extend(receipts)
        for cert in certs:
            if cert.peer_id not in self._keys:
                try:
                    self._keys[cert.peer_id] = cert.verify()
                except ProofError:
                    continue
                self.certs[cert.peer_id] = cert

    def keep(self, length: int) -> None:
        """The positions past `length` were dropped: their receipts cover nothing any more."""
        self.receipts = [r for r in self.receipts if r.offset < length]
        kept = {id(r) for r in self.receipts}
        self._verified &= kept  # an id is only good while its receipt lives

    def codecs(self, start: int, end: int) -> frozenset[Codec] | None:
        """The codecs the states of positions [start, end) crossed the wire in on this route: this
        client's own sends, and each hop's output as its signed receipts say. None where a hop's
        receipts do not cover them or do not verify."""
        used: set[Codec] = set()
        for hop in self.route:
            covered = set()  # positions: a step's drafts that fell are covered again by the next
            for receipt in self.receipts:
                low, high = max(start, receipt.offset), min(end, receipt.offset + receipt.tokens)
                if receipt.peer_id != hop.peer_id or receipt.session != self.session_id or low >= high:
                    continue
                if not self._holds(receipt) or (hop is self.route[0] and receipt.step not in self._sent):
                    return None
                covered.update(range(low, high))
                used.add(receipt.codec)
                if hop is self.route[0]:
                    used.add(self._sent[receipt.step])
            if len(covered) < end - start:
                return None
        return frozenset(used)

    def _holds(self, receipt: Receipt) -> bool:
        """Whether the receipt is its peer's, by that peer's certificate (checked once)."""
        if id(receipt) in self._verified:
            return True
        key = self._keys.get(receipt.peer_id)
        try:
            if key is None:
                return False
            receipt.verify(key)
        except ProofError:
            return False
        self._verified.add(id(receipt))
        return True
