"""One session on a peer: its state, the checks on what it receives, and how it packs what it sends.

An inference session keeps a KV cache and grows step by step. A training session keeps no cache:
each step is a full forward, whose input is kept until its `Backward` comes (at most MAX_SAVED
steps at once, so a client cannot fill the peer's memory), with its autograd graph when the peer's
training memory allows (otherwise the backward pass computes the forward again). Either kind may
carry its client's own parameters for these layers (its adapter's part), which lives and dies with the
session.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from p2pfusion.errors import RequestError
from p2pfusion.models.kv_cache import SessionCache
from p2pfusion.models.tuning import StageParams, layer_of, stage_params
from p2pfusion.models.stage import Graph, Stage
from p2pfusion.models.threads import one_thread
from p2pfusion.net import messages as m
from p2pfusion.net.codecs import ErrorFeedback, Packed, pack, unpack
from p2pfusion.net.compression import AUTO, Codec, Compression, LinkSpeed, Purpose, choose_codec
from p2pfusion.net.framing import UNLIMITED, FrameLimits
from p2pfusion.net.payloads import mask_from_wire, positions_from_wire, unflatten
from p2pfusion.net.receipts import ReceiptChain
from p2pfusion.peer.batching import UNIT_SEPARATOR

HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # a stage casts them to its own


@dataclass
class StepInputs:
    hidden: torch.Tensor
    mask: torch.Tensor | None
    positions: torch.Tensor | None
    params: StageParams | None = None  # the parameters this step ran with: a backward pass uses them too
    graph: Graph | None = None  # training: the forward's autograd graph, when memory allowed keeping it
    keep: int | None = None  # cached positions kept before this step's (None: all)
    cohort: m.Cohort | None = None  # the steps its client sent with it (a batchable step waits for them)


@dataclass
class Session:
    session_id: str
    length: int  # the most positions it may hold
    stage: Stage  # kept per session: sessions opened before a move finish on the old layers
    upstream: asyncio.StreamWriter
    purpose: Purpose = Purpose.INFERENCE
    compression: Compression = AUTO
    link: LinkSpeed | None = None  # to the next hop, or from the last hop to the client
    upstream_link: LinkSpeed | None = None  # to whoever sent us the session (gradients go there)
    cache: object | None = None
    position: int = 0  # positions its cache holds
    downstream: asyncio.StreamWriter | None = None
    next_peer: str | None = None
    sink: asyncio.StreamWriter | None = None
    relay: asyncio.Task | None = field(default=None, repr=False)
    saved: dict[int, StepInputs] = field(default_factory=dict)  # training: step -> its inputs
    params: StageParams | None = None  # its client's parameters for these layers
    compute_seconds: float = 0.0  # of the last step: the time budget of a training transfer
    feedback: dict[str, ErrorFeedback] = field(default_factory=dict)  # top-k residuals, per direction
    # the address its caps count against ("ip:<address>" or "circuit:<relay id>"): the sender's, or, relayed
    # by a listed peer, the client's as its first hop saw it (peer.admission.vouched_origin)
    source: str = "unknown"
    client: str = "unknown"  # whose share of compute its steps use (peer.batching.fairness_unit)
    batch: int = 1  # the most sequences an inference step may carry
    reserved: int = 0  # bytes of this peer's session memory held for it (see peer.admission)
    downstream_peers: frozenset[str] = frozenset()  # the route after this hop: whom the relay may name
    frame_limits: FrameLimits = UNLIMITED  # of the frames from the hop before
    expired: bool = False  # a hop after this one closed the session as idle
    receipts: ReceiptChain | None = None  # signs an inference session's steps

    def __post_init__(self):
        if not self.training:
            self.cache = self.stage.new_cache()

    @property
    def end_client(self) -> str:
        """The client this session comes from, as the next hop should be told."""
        return self.client.split(UNIT_SEPARATOR, 1)[-1]

    @property
    def training(self) -> bool:
        return self.purpose == Purpose.TRAINING

    def to_client(self, sink: asyncio.StreamWriter, link: LinkSpeed | None) -> None:
        """This hop is the route's last: results go to the client's own stream."""
        self.sink, self.link = sink, link

    def to_next_hop(self, writer: asyncio.StreamWriter, peer_id: str, relay: asyncio.Task) -> None:
        """Outputs go to `peer_id`; `relay` passes what it sends back on to our upstream."""
        self.downstream, self.next_peer, self.relay = writer, peer_id, relay

    def use_link(self, link: LinkSpeed | None) -> None:
        self.link = link

    def mark_expired(self) -> None:
        self.expired = True

    def ran(self, message: m.Step, inputs: StepInputs, seconds: float) -> None:
        """A step's forward is done: the cache grew by its tokens, or (training) its inputs wait
        for their backward pass."""
        self.compute_seconds = seconds
        if self.training:
            self.saved[message.step] = inputs
        else:
            self.position += inputs.hidden.shape[1]

    def sign(self, message: m.Step, hidden: torch.Tensor, out: torch.Tensor, packed: Packed) -> dict:
        """The receipts and certificates a step's output travels on with: those of the hops
        before, and this hop's own (with its certificate on the session's first step)."""
        if self.receipts is None or self.training:
            return {"receipts": message.receipts, "certs": message.certs}
        codec = Codec(packed.spec["codec"])
        sent = out if codec == Codec.NONE else unpack(packed.spec, packed.body())
        offset = self.position - hidden.shape[1]
        with one_thread():  # on the event loop's thread, which must make no OpenMP pool (models/threads.py)
            receipt = self.receipts.receipt(message.step, offset, hidden, sent, codec)
        certs = [*message.certs, self.receipts.key.cert] if offset == 0 else message.certs
        return {"receipts": [*message.receipts, receipt], "certs": certs}

    def end(self) -> list[StepInputs]:
        """Free what the session holds (the object may outlive this, in a task's frame); returns
        the training inputs whose graphs the peer's training memory should get back."""
        saved = list(self.saved.values())
        self.saved.clear()
        self.cache = None
        if self.relay is not None:
            self.relay.cancel()
        return saved

    def check_step(self, message: m.Step, tensor: torch.Tensor | None) -> StepInputs:
        stage = self.stage
        if tensor is None:
            raise RequestError("step carries no hidden states")
        if tensor.dtype not in HIDDEN_DTYPES:
            raise RequestError(f"hidden states must be float32, bfloat16 or float16, got {tensor.dtype}")
        if tensor.dim() != 3 or tensor.shape[0] < 1 or tensor.shape[1] < 1 or tensor.shape[2] != stage.hidden_size:
            raise RequestError(
                f"hidden states must have shape [batch, tokens, {stage.hidden_size}], got {list(tensor.shape)}"
            )
        batch, tokens = tensor.shape[:2]
        if not self.training and batch > self.batch:
            raise RequestError(f"a step carries {batch} sequences; this session was opened for at most {self.batch}")
        if batch * tokens > m.MAX_STEP_TOKENS:
            raise RequestError(f"a step holds at most {m.MAX_STEP_TOKENS} tokens (batch x length), got {batch * tokens}")
        offset = 0 if self.training else self.position
        if message.keep is not None:
            if self.training:
                raise RequestError("a training step keeps no cache to cut")
            if message.keep > self.position:
                raise RequestError(f"a step keeps {message.keep} positions, but this session holds {self.position}")
            if not isinstance(self.cache, SessionCache):
                raise RequestError("these layers keep a sliding-window cache, which cannot drop positions")
            offset = message.keep
        if offset + tokens > self.length:
            raise RequestError(f"session length {offset + tokens} exceeds the {self.length} it was opened for")
        if self.training and len(self.saved) >= m.MAX_SAVED:
            raise RequestError(f"{m.MAX_SAVED} training steps already await their backward pass")
        held = None if self.params is None else self.params.digest
        if message.params != held:
            raise RequestError(f"step expects parameters {message.params}, but this session holds {held}")
        finite = torch.isfinite(tensor)
        if not finite.all():
            # which hop computed them: the last one named in the step's timings, or the client
            sender = f"peer {message.timings[-1][0]}" if message.timings else "the client"
            raise RequestError(
                f"hidden states contain NaN or infinity ({int((~finite).sum())} of {finite.numel()} values "
                f"of step {message.step}, from {sender})"
            )
        mask = None if message.mask is None else mask_from_wire(message.mask, batch, offset + tokens)
        positions = None if message.positions is None else positions_from_wire(message.positions, batch, tokens)
        return StepInputs(tensor, mask, positions, self.params, keep=message.keep, cohort=message.cohort)

    def keep(self, length: int | None) -> None:
        """Forget the cached positions past `length` (checked by `check_step`); None keeps all."""
        if length is not None:
            self.cache.keep(length)
            self.position = length

    def set_params(self, message: m.Params, flat: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Keep the entries for this stage's layers; return the others, for the hops after us."""
        values = unflatten(flat, [shape for _, shape in message.entries])
        ours, rest = {}, {}
        for (name, _), value in zip(message.entries, values):
            (rest if layer_of(name) >= self.stage.end else ours)[name] = value.to(self.stage.dtype)
        self.params = stage_params(self.stage.module, self.stage.start, self.stage.end, ours, message.scaling, message.digest)
        return rest

    def take_saved(self, step: int, grad: torch.Tensor | None) -> tuple[StepInputs, torch.Tensor]:
        """The inputs kept for `step`, and its output's gradient once checked against them."""
        if not self.training:
            raise RequestError("backward: this is not a training session")
        if step not in self.saved:
            raise RequestError(f"backward: no forward of step {step} awaits its backward pass")
        hidden = self.saved[step].hidden  # kept until a valid gradient comes, so a client may send it again
        if grad is None or grad.dtype != hidden.dtype or grad.shape != hidden.shape:
            got = None if grad is None else (grad.dtype, list(grad.shape))
            raise RequestError(f"backward: the gradient must be {hidden.dtype} of shape {list(hidden.shape)}, got {got}")
        if not torch.isfinite(grad).all():
            raise RequestError("backward: the gradient contains NaN or infinity")
        return self.saved.pop(step), grad

    def backward_ran(self, seconds: float) -> None:
        self.compute_seconds = seconds

    def pack(self, tensor: torch.Tensor, upstream: bool = False) -> Packed:
        """Pack an output (downstream) or an input gradient (upstream) for its link."""
        link = self.upstream_link if upstream else self.link
        budget = self.compute_seconds if self.training else None
        choice = choose_codec(link, tensor.numel() * 4, self.purpose, self.compression, budget)
        if choice.codec == Codec.TOPK:
            feedback = self.feedback.setdefault("up" if upstream else "down", ErrorFeedback())
            return feedback.pack(tensor, choice.k)
        return pack(tensor, choice.codec, choice.k)
