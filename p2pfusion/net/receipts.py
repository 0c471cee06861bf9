"""Signed receipts: what a peer says it computed for each step, in a form anyone can check later.

For every step it runs, a peer signs a `Receipt` naming the session, the step, its layers, its
weight format and the codec its output left in, with sha256 digests of the input it received and
of the output it sent (both as the receiver decodes them), and two *sketches*: the states
projected onto SKETCH_WIDTH pseudo-random directions, per position (a step of more than
SKETCHED positions is cut into that many blocks, and each block's mean is projected, so a receipt
stays under 5 KB). A sketch is tolerant: a recomputation of the same layers on the same input lands
within rounding of it, so it can be checked without the tensor itself (TOPLOC's idea, with
projections instead of top-k values).

- The input rows use directions drawn from the session and layers, the same for every step; the
  receipt's `history` chains them with where each step began and how many positions it held
  (sha256 over the previous history, this step's offset and size, and its rows), so one receipt
  commits to every input the session's KV cache was built from, drafts that fell and left it
  (a step that begins before the last one ended) included.
- The output sketch uses directions drawn from the output's own digest, which the peer cannot know
  before it has fixed the output: a lie cannot be shaped to be invisible in the sketch.

Receipts are signed with a per-process Ed25519 key (about 50 µs a step; RSA would cost 1-2 ms),
which the peer's libp2p identity certifies once (`ReceiptCert`). A client that sent a canary
(synthetic tokens) can recompute every hop, and a receipt that its recomputation contradicts is
evidence (`Evidence`) that convicts its signer for any other client that recomputes it too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa

from p2pfusion.errors import ProofError
from p2pfusion.net.compression import Codec
from p2pfusion.net.wire import MAX_PEER_KEY_BYTES, MAX_PEER_SIG_BYTES, Bound, Length, WireError, encode

# DHT records hold receipts, and reading those must not load torch or hivemind (which loads torch):
# the CLI says what it does before that. Both are imported where a receipt is made or checked.
if TYPE_CHECKING:
    import torch

    from p2pfusion.net.identity import Identity

SKETCH_WIDTH = 8  # directions per position: 32 bytes of a sketch per position
SKETCHED = 64  # rows of a sketch at most: longer steps are sketched by the means of as many blocks
CERT_LIFETIME = 30 * 86400.0  # seconds a receipt key's certificate stays valid
CERT_PREFIX = b"p2pfusion receipt key:"
MAX_SKETCH_BYTES = SKETCHED * 4 * SKETCH_WIDTH
# the most a hop's receipt and certificate add to a step's header (a route has a hop per layer at most)
RECEIPT_BYTES = 2 * MAX_SKETCH_BYTES + MAX_PEER_KEY_BYTES + MAX_PEER_SIG_BYTES + 2048
MAX_EARLIER = 256  # earlier steps' rows an evidence may carry
MAX_CANARY_TOKENS = 1024

Digest = Annotated[bytes, Length(32, 32)]
Id = Annotated[str, Length(128, 1)]
Count = Annotated[int, Bound(0)]
Sketch = Annotated[bytes, Length(MAX_SKETCH_BYTES)]


def digest(values: torch.Tensor) -> bytes:
    """sha256 of a tensor's values as float32: what a receipt commits to."""
    return hashlib.sha256(values.detach().float().contiguous().numpy().tobytes()).digest()


def directions(seed: bytes, hidden: int) -> torch.Tensor:
    """SKETCH_WIDTH pseudo-random unit-variance directions [hidden, width], the same on every
    machine for the same seed (torch's CPU generator is specified)."""
    import torch

    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(seed).digest()[:7], "little"))
    return torch.randn(hidden, SKETCH_WIDTH, generator=generator)


def sketch(values: torch.Tensor, seed: bytes, drawn: torch.Tensor | None = None) -> torch.Tensor:
    """[batch, tokens, hidden] -> [rows, SKETCH_WIDTH]: the positions (sequence after sequence)
    projected on the seed's directions (`drawn`, if already drawn), one row each, or, past
    SKETCHED positions, the means of SKETCHED blocks of them."""
    import torch

    flat = values.detach().float().reshape(-1, values.shape[-1])
    if flat.shape[0] > SKETCHED:
        flat = torch.stack([block.mean(dim=0) for block in flat.tensor_split(SKETCHED)])
    return flat @ (directions(seed, flat.shape[-1]) if drawn is None else drawn)


def session_seed(session: str, start: int) -> bytes:
    return f"rows:{session}:{start}".encode()


def chain(history: bytes, offset: int, tokens: int, rows: bytes) -> bytes:
    return hashlib.sha256(history + struct.pack("<QQ", offset, tokens) + rows).digest()


def rows_of(data: bytes) -> torch.Tensor:
    """A sketch's bytes back as float32 [rows, SKETCH_WIDTH]."""
    if not data or len(data) % (4 * SKETCH_WIDTH):
        raise WireError(f"a sketch of {len(data)} bytes does not hold whole rows")
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.float32).view(-1, SKETCH_WIDTH)


def sketch_rows(batch: int, tokens: int) -> int:
    return min(batch * tokens, SKETCHED)


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().float().contiguous().numpy().tobytes()


@dataclass(frozen=True)
class ReceiptCert:
    """A peer's identity key vouching for its receipt key until `expires` (unix seconds)."""

    peer_id: Id
    key: Digest  # the Ed25519 public key, raw
    expires: float
    identity: Annotated[bytes, Length(MAX_PEER_KEY_BYTES)]  # libp2p public key protobuf
    signature: Annotated[bytes, Length(MAX_PEER_SIG_BYTES)]

    def message(self) -> bytes:
        return CERT_PREFIX + self.peer_id.encode() + self.key + struct.pack("<d", self.expires)

    def verify(self, now: float | None = None) -> ed25519.Ed25519PublicKey:
        """The receipt key it certifies; ProofError when it does not hold."""
        from google.protobuf.message import DecodeError
        from hivemind.proto import crypto_pb2

        from p2pfusion.net.identity import peer_id_of

        if peer_id_of(self.identity) != self.peer_id:
            raise ProofError(f"the receipt key's certificate is not peer {self.peer_id}'s key")
        if (time.time() if now is None else now) > self.expires:
            raise ProofError(f"peer {self.peer_id}'s receipt key expired")
        try:
            proto = crypto_pb2.PublicKey.FromString(self.identity)
            public = serialization.load_der_public_key(proto.data)
            if proto.key_type != crypto_pb2.KeyType.RSA or not isinstance(public, rsa.RSAPublicKey):
                raise ProofError(f"peer {self.peer_id}'s identity is not an RSA key")
            public.verify(self.signature, self.message(), padding.PKCS1v15(), hashes.SHA256())
            return ed25519.Ed25519PublicKey.from_public_bytes(self.key)
        except (ValueError, TypeError, DecodeError, InvalidSignature) as exc:
            raise ProofError(f"peer {self.peer_id}'s receipt key certificate does not hold: {exc!r}") from None


@dataclass(frozen=True)
class Receipt:
    session: Id
    step: Count
    peer_id: Id
    start: Count
    end: Count
    weights: Annotated[str, Length(16, 1)]
    codec: Codec  # of the output as sent: the sketch is of the values the next hop decoded
    offset: Count  # positions the session held before this step
    batch: Annotated[int, Bound(1)]
    tokens: Annotated[int, Bound(1)]
    input_digest: Digest
    rows: Sketch  # the input's sketch on the session's directions
    history: Digest  # chains every step's rows up to this one
    output_digest: Digest
    output: Sketch  # the output's sketch on the directions its digest draws
    signature: Annotated[bytes, Length(64)] = b""

    def check(self) -> None:
        size = 4 * SKETCH_WIDTH * sketch_rows(self.batch, self.tokens)
        if len(self.rows) != size or len(self.output) != size:
            raise WireError(f"a receipt of {self.batch}x{self.tokens} positions must carry sketches of {size} bytes")
        if self.start >= self.end:
            raise WireError(f"layer range {self.start}:{self.end} is empty")

    def signed_bytes(self) -> bytes:
        return msgpack.packb(encode(dataclasses.replace(self, signature=b"")), use_bin_type=True)

    def verify(self, key: ed25519.Ed25519PublicKey) -> None:
        try:
            key.verify(self.signature, self.signed_bytes())
        except InvalidSignature:
            raise ProofError(f"peer {self.peer_id}'s receipt of step {self.step} is not signed by its key") from None


class ReceiptKey:
    """A peer's receipt signing key, certified by its identity for CERT_LIFETIME."""

    def __init__(self, identity: Identity):
        self.peer_id = identity.peer_id
        self._key = ed25519.Ed25519PrivateKey.generate()
        raw = self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        unsigned = ReceiptCert(self.peer_id, raw, time.time() + CERT_LIFETIME, identity.public_key_proto, b"")
        self.cert = dataclasses.replace(
            unsigned, signature=identity.private_key.sign(unsigned.message(), padding.PKCS1v15(), hashes.SHA256())
        )

    def sign(self, receipt: Receipt) -> Receipt:
        return dataclasses.replace(receipt, signature=self._key.sign(receipt.signed_bytes()))


@dataclass
class ReceiptChain:
    """One session's receipts at one peer: the directions of its input rows, and their history."""

    key: ReceiptKey
    session: str
    start: int
    end: int
    weights: str
    history: bytes = b""
    _rows: torch.Tensor | None = None  # the directions of the input rows, drawn once

    def receipt(self, step: int, offset: int, inputs: torch.Tensor, sent: torch.Tensor, codec: Codec) -> Receipt:
        """The signed receipt of an inference step whose first position is the session's `offset`-th:
        `inputs` as received, `sent` the output as the next hop decodes it."""
        seed = session_seed(self.session, self.start)
        if self._rows is None:
            self._rows = directions(seed, inputs.shape[-1])
        rows = _bytes(sketch(inputs, seed, self._rows))
        batch, tokens = inputs.shape[0], inputs.shape[1]
        self.history = chain(self.history, offset, tokens, rows)
        out_digest = digest(sent)
        receipt = Receipt(
            self.session, step, self.key.peer_id, self.start, self.end, self.weights, codec, offset, batch, tokens,
            digest(inputs), rows, self.history, out_digest, _bytes(sketch(sent, out_digest)),
        )
        return self.key.sign(receipt)


@dataclass(frozen=True)
class Evidence:
    """A canary's proof that a peer computed wrong: the canary's tokens (synthetic, no user's
    data) up to where the receipt's step stands (its drafts that fell are not among them), the
    peer's certificate and its receipt of the step, and the session's earlier steps at that peer:
    first position, size in positions and input rows each (the receipt's history binds them)."""

    tokens: Annotated[list[Annotated[int, Bound(0)]], Length(MAX_CANARY_TOKENS, 1)]
    cert: ReceiptCert
    receipt: Receipt
    earlier: Annotated[list[tuple[Count, Annotated[int, Bound(1)], Sketch]], Length(MAX_EARLIER)]

    def check(self) -> None:
        if self.receipt.peer_id != self.cert.peer_id:
            raise WireError("the receipt and the certificate name different peers")
        if self.receipt.batch != 1 or self.receipt.offset >= len(self.tokens):
            raise WireError("the receipt covers positions the canary's tokens do not")

    def verify(self, now: float | None = None) -> list[tuple[int, int, torch.Tensor]]:
        """Check the signatures and the rows' chain: (first position, positions, input rows) of
        every step up to the receipt's, in order. ProofError when any of it does not hold."""
        self.receipt.verify(self.cert.verify(now))
        steps, history, end = [], b"", 0
        receipt = self.receipt
        for offset, tokens, rows in [*self.earlier, (receipt.offset, receipt.tokens, receipt.rows)]:
            history = chain(history, offset, tokens, rows)
            if rows_of(rows).shape[0] != sketch_rows(1, tokens) or offset > end:
                raise ProofError(f"the steps given for peer {receipt.peer_id} leave positions out or misstate their rows")
            steps.append((offset, tokens, rows_of(rows)))
            end = offset + tokens
        if history != receipt.history:
            raise ProofError(f"the rows given for peer {receipt.peer_id}'s earlier steps are not those it signed")
        return steps
