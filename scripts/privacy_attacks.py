"""What a peer can recover of a prompt from the hidden states it receives: the attack harness.

A peer serving layers [s, e) receives hidden_states[s] of the prompt (transformers' numbering:
the input of layer s; for s = 0 the token embeddings), after the wire codec and any noise the
client adds (a `Sink`). Three attacks turn those states back into token ids:
1. nearest neighbour: each state against the embedding matrix (cosine and L2); exact at s = 0.
2. probe: ridge regression from the (standardized) state to the token's embedding, fitted on
   other text at the same depth and through the same sink, then the nearest embedding by cosine.
   It needs the weights only to make its training pairs; applying it is one matrix product.
3. exact: with the weights of layers [0, s), as SIPIT (arXiv 2510.15511) and "Hidden No More"
   (arXiv 2505.18332) do. The first token: a lookup in every token's state alone at position 0.
   Then position by position, with the prefix recovered so far in a KV cache, candidate tokens
   are run through layers [0, s) at that position, a batch of candidates at once; the candidate
   whose state is nearest the observed one wins. Candidates: the probe's 4 likeliest, then
   (SIPIT's gradient step) the tokens nearest the input embedding that Adam finds reproducing
   the observed state. It stops at the first candidate within `tolerance` (relative L2
   distance), or after `budget` candidates.
Used by scripts/bench_privacy.py and tests/test_privacy_attacks.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from p2pfusion.models.cache_arg import cache_arg
from p2pfusion.net.codecs import pack, unpack
from p2pfusion.net.compression import Codec

NN_CHUNK = 256  # states scored against the vocabulary at once: 256 x 49152 floats is 50 MB
BATCHES = (4, 32, 128)  # candidate batch sizes, then the last one repeated: most positions need the first only
REFINE_STEPS = 20
REFINE_LR = 0.07  # Adam's step, in units of the embeddings' RMS
GIVE_UP = 3  # positions in a row with no match before the exact attack stops searching
FULL_BATCH = 512  # candidates per forward when the whole vocabulary is searched


@dataclass(frozen=True)
class Sink:
    """What happens to hidden states between the client's layers and the peer's: Gaussian noise the
    client adds (std `noise` times each position's RMS), then the wire codec (pack, then unpack)."""

    codec: Codec = Codec.NONE
    noise: float = 0.0
    topk_share: float = 0.1  # top-k keeps this share of a message's entries

    @property
    def label(self) -> str:
        if self.noise:
            return f"noise {self.noise:g}" + ("" if self.codec == Codec.NONE else f" + {self.codec.value}")
        if self.codec == Codec.TOPK:
            return f"topk {self.topk_share:g}"
        return "raw" if self.codec == Codec.NONE else self.codec.value


RAW = Sink()


def apply_sink(hidden: torch.Tensor, sink: Sink, generator: torch.Generator | None = None) -> torch.Tensor:
    """`hidden` ([..., tokens, hidden], one message) as the peer receives it."""
    if sink.noise:
        rms = hidden.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
        noise = torch.randn(hidden.shape, generator=generator, dtype=torch.float32)
        hidden = hidden + (sink.noise * rms * noise).to(hidden.dtype)
    if sink.codec == Codec.NONE:
        return hidden
    packed = pack(hidden, sink.codec, k=max(1, round(sink.topk_share * hidden.numel())))
    return unpack(packed.spec, packed.body()).reshape(hidden.shape)


class _Reached(Exception):
    """Stops a forward pass at the layer whose input is wanted, carrying that input."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("reached the split")
        self.hidden = hidden


def _run_to(model, depth: int, cache: DynamicCache | None, **inputs) -> torch.Tensor:
    """The input of layer `depth` (0 <= depth < layers) for `inputs` (input_ids or inputs_embeds,
    attention_mask, position_ids), without running the layers after it; a `cache` gets layers
    [0, depth) of these tokens."""

    def stop(module, args, layer_kwargs):
        raise _Reached(args[0] if args else layer_kwargs["hidden_states"])

    handle = model.model.layers[depth].register_forward_pre_hook(stop, with_kwargs=True)
    try:
        model.model(use_cache=cache is not None, **{cache_arg(type(model.model).forward): cache}, **inputs)
    except _Reached as reached:
        return reached.hidden
    finally:
        handle.remove()
    raise RuntimeError(f"layer {depth} never ran")


@torch.no_grad()
def states_at(model, ids: torch.Tensor, depth: int, cache: DynamicCache | None = None, **kwargs) -> torch.Tensor:
    """hidden_states[depth] of transformers' causal-LM `model` for `ids` [batch, tokens] (see
    `_run_to`; `kwargs`: attention_mask, position_ids)."""
    return _run_to(model, depth, cache, input_ids=ids, **kwargs)


@torch.no_grad()
def first_position_table(model, depths: list[int], batch: int = 1024) -> dict[int, torch.Tensor]:
    """hidden_states[s] of every token of the vocabulary alone at position 0, [vocab, hidden] for
    each s in `depths`. There a state depends on its token only, so an attacker computes this
    once per model and looks the first token up: a search would struggle, as deep layers turn
    the first position into the attention sink, nearly the same state whatever the token."""
    tables: dict[int, list[torch.Tensor]] = {s: [] for s in depths}

    def keep(depth):
        def hook(module, args, layer_kwargs):
            tables[depth].append((args[0] if args else layer_kwargs["hidden_states"])[:, 0])

        return hook

    handles = [model.model.layers[s].register_forward_pre_hook(keep(s), with_kwargs=True) for s in depths]
    try:
        for ids in torch.arange(model.get_input_embeddings().weight.shape[0]).split(batch):
            _run_to(model, max(depths), None, input_ids=ids[:, None])
    finally:
        for handle in handles:
            handle.remove()
    return {s: torch.cat(parts) for s, parts in tables.items()}


@torch.no_grad()
def nearest_neighbour(states: torch.Tensor, embeddings: torch.Tensor) -> dict[str, torch.Tensor]:
    """The nearest embedding row of each state [n, hidden], by cosine and by L2."""
    unit = torch.nn.functional.normalize(embeddings, dim=-1)
    norms = embeddings.pow(2).sum(-1)
    cosine, l2 = [], []
    for chunk in states.split(NN_CHUNK):
        cosine.append((torch.nn.functional.normalize(chunk, dim=-1) @ unit.T).argmax(-1))
        l2.append((norms - 2 * chunk @ embeddings.T).argmin(-1))
    return {"cosine": torch.cat(cosine), "l2": torch.cat(l2)}


@dataclass
class Probe:
    """Ridge regression from a standardized state to its token's embedding; ranks tokens by the
    cosine of their embedding with the predicted one."""

    mean: torch.Tensor
    scale: torch.Tensor
    weight: torch.Tensor  # [hidden, hidden]
    bias: torch.Tensor
    unit: torch.Tensor  # the embedding matrix, rows normalized

    @classmethod
    @torch.no_grad()
    def fit(cls, states: torch.Tensor, ids: torch.Tensor, embeddings: torch.Tensor, ridge: float = 1e-3) -> Probe:
        x = states.double()
        mean, scale = x.mean(0), x.std(0).clamp_min(1e-6)
        x = (x - mean) / scale
        y = embeddings[ids].double()
        target_mean = y.mean(0)
        gram = x.T @ x + ridge * len(x) * torch.eye(x.shape[1], dtype=x.dtype)
        weight = torch.linalg.solve(gram, x.T @ (y - target_mean))
        unit = torch.nn.functional.normalize(embeddings.float(), dim=-1)
        return cls(mean.float(), scale.float(), weight.float(), target_mean.float(), unit)

    def embedding(self, states: torch.Tensor) -> torch.Tensor:
        """The predicted embedding of each state's token: [n, hidden]."""
        return ((states.float() - self.mean) / self.scale) @ self.weight + self.bias

    @torch.no_grad()
    def ranking(self, states: torch.Tensor, k: int) -> torch.Tensor:
        """The `k` likeliest token ids of each state [n, hidden], likeliest first: [n, k]."""
        out = []
        for chunk in states.float().split(NN_CHUNK):
            predicted = self.embedding(chunk)
            scores = torch.nn.functional.normalize(predicted, dim=-1) @ self.unit.T
            out.append(scores.topk(min(k, scores.shape[-1]), dim=-1).indices)
        return torch.cat(out)


def _candidates_mask(prefix: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """A [1, 1, count, prefix + count] additive mask: each of `count` candidates, all at the same
    position after a cached prefix, sees the prefix and itself, not the other candidates."""
    allowed = torch.cat([torch.ones(count, prefix, dtype=torch.bool), torch.eye(count, dtype=torch.bool)], dim=1)
    return torch.zeros(count, prefix + count, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


@torch.no_grad()
def candidate_states(model, cache: DynamicCache, candidates: torch.Tensor, depth: int) -> torch.Tensor:
    """hidden_states[depth] of each candidate token placed after the prefix in `cache` (layers
    [0, depth) of it), all candidates in one forward pass: [candidates, hidden]. `cache` is
    left as it was."""
    t, count = cache.get_seq_length(), len(candidates)
    mask = _candidates_mask(t, count, model.dtype)
    positions = torch.full((1, count), t)
    out = states_at(model, candidates.long()[None], depth, cache, attention_mask=mask, position_ids=positions)
    cache.crop(-count)
    return out[0]


def refine(model, cache: DynamicCache, probe: Probe, target: torch.Tensor, depth: int) -> torch.Tensor:
    """SIPIT's step: the continuous input embedding at the next position whose state at `depth`
    comes nearest `target`, by Adam from the probe's guess; the tokens whose embeddings are nearest
    it are the likeliest candidates. The distance is taken in the probe's standardized units, or
    the few channels that reach 100 times the others would decide alone. `cache` holds the prefix
    and is left as it was."""
    scale = float(model.get_input_embeddings().weight.pow(2).mean().sqrt())
    x = probe.embedding(target[None])[0].requires_grad_(True)
    goal = (target - probe.mean) / probe.scale
    optimizer = torch.optim.Adam([x], lr=REFINE_LR * scale)
    position = torch.tensor([[cache.get_seq_length()]])
    with torch.enable_grad():
        for _ in range(REFINE_STEPS):
            out = _run_to(model, depth, copy.deepcopy(cache), inputs_embeds=x[None, None], position_ids=position)
            loss = ((out[0, 0] - probe.mean) / probe.scale - goal).pow(2).sum() / goal.pow(2).sum()
            (x.grad,) = torch.autograd.grad(loss, [x])  # not the weights' gradients
            optimizer.step()
    return x.detach()


def _nearest_order(x: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """Token ids by the nearness of their embedding to `x`, L2 and cosine orders interleaved."""
    by_l2 = (embeddings - x).pow(2).sum(-1).argsort()
    by_cosine = (torch.nn.functional.normalize(embeddings, dim=-1) @ x).argsort(descending=True)
    merged = torch.stack([by_l2, by_cosine], dim=1).reshape(-1)
    first = torch.full((len(embeddings),), len(merged)).scatter_reduce(0, merged, torch.arange(len(merged)), "amin")
    return first.argsort()


@dataclass
class Inversion:
    ids: list[int]
    tried: list[int]  # candidates run per position
    refined: int  # positions where the probe's first candidates missed and `refine` ran
    distance: list[float]  # relative L2 distance of the winner per position


@torch.no_grad()
def exact_attack(
    model, observed: torch.Tensor, depth: int, probe: Probe, tolerance: float, budget: int, first: torch.Tensor,
    full: bool = False,
) -> Inversion:
    """Invert one prompt's observed states [tokens, hidden] at `depth`. The first token: the
    nearest row of `first` (`first_position_table` at `depth`). At each later position: the
    probe's BATCHES[0] likeliest tokens; if none is within `tolerance`, `refine` from the probe's
    predicted embedding, then the tokens nearest the refined embedding, in batches, up to
    `budget` candidates in all. The nearest candidate wins, and joins the prefix. After GIVE_UP
    positions in a row without a candidate within `tolerance` the prefix is taken to be wrong
    (every later state depends on it), and the probe's guesses stand for the rest. With `full`,
    a position that the budget leaves without a match searches the rest of the vocabulary, which
    only the attacker's compute limits."""
    embeddings = model.get_input_embeddings().weight.detach()
    result = Inversion([], [], 0, [])
    cache = DynamicCache(config=model.config)
    for t in range(observed.shape[0]):
        if len(result.distance) >= GIVE_UP and min(result.distance[-GIVE_UP:]) > tolerance:
            rest = probe.ranking(observed[t:], 1)[:, 0].tolist()
            result.ids += rest
            result.tried += [0] * len(rest)
            result.distance += [float("inf")] * len(rest)
            break
        target = observed[t].float()
        norm = target.norm().clamp_min(1e-12)
        order = probe.ranking(target[None], BATCHES[0])[0]
        best, best_distance, tried = -1, float("inf"), 0
        if t == 0:
            distance = (first.float() - target).norm(dim=-1) / norm
            best, best_distance, tried = int(distance.argmin()), float(distance.min()), 1
        sizes = iter(BATCHES)
        while t and tried < budget and best_distance > tolerance:
            if tried == BATCHES[0]:
                result.refined += 1
                x = refine(model, cache, probe, target, depth)
                rest = _nearest_order(x, embeddings)
                order = torch.cat([order, rest[~torch.isin(rest, order)]])
            batch = order[tried : min(tried + next(sizes, BATCHES[-1]), budget)]
            distance = (candidate_states(model, cache, batch, depth).float() - target).norm(dim=-1) / norm
            winner = int(distance.argmin())
            if float(distance[winner]) < best_distance:
                best, best_distance = int(batch[winner]), float(distance[winner])
            tried += len(batch)
        if full and t and best_distance > tolerance:
            rest = torch.arange(len(embeddings))
            rest = rest[~torch.isin(rest, order[:tried])]
            for batch in rest.split(FULL_BATCH):
                distance = (candidate_states(model, cache, batch, depth).float() - target).norm(dim=-1) / norm
                winner = int(distance.argmin())
                if float(distance[winner]) < best_distance:
                    best, best_distance = int(batch[winner]), float(distance[winner])
                tried += len(batch)
                if best_distance <= tolerance:
                    break
        result.ids.append(best)
        result.tried.append(tried)
        result.distance.append(best_distance)
        states_at(model, torch.tensor([[best]]), depth, cache, position_ids=torch.tensor([[t]]))
    return result


def relative_error(clean: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """Per position: |received - clean| / |clean| ([..., tokens, hidden] -> [..., tokens])."""
    return (received.float() - clean.float()).norm(dim=-1) / clean.float().norm(dim=-1).clamp_min(1e-12)


def sink_tolerance(clean: torch.Tensor, received: torch.Tensor) -> float:
    """The exact attack's stopping distance for a sink: a little over what the sink itself moves
    99% of positions (the attacker measures that on its own text), plus float rounding."""
    return 1e-4 + 1.1 * float(relative_error(clean, received).quantile(0.99))


def token_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[list[int]]:
    """For each character span, the indices of the tokens (by their character offsets) overlapping it."""
    return [[i for i, (a, b) in enumerate(offsets) if a < end and b > start] for start, end in spans]


@dataclass
class Score:
    """Recovery over a set of prompts."""

    tokens: int = 0
    tokens_recovered: int = 0
    prompts: int = 0
    prompts_recovered: int = 0
    items: int = 0  # personal-data items
    items_recovered: int = 0

    def add(self, predicted: list[int], true: list[int], items: list[list[int]] = ()) -> None:
        hits = [p == t for p, t in zip(predicted, true)]
        self.tokens += len(true)
        self.tokens_recovered += sum(hits)
        self.prompts += 1
        self.prompts_recovered += all(hits) and len(predicted) == len(true)
        self.items += len(items)
        self.items_recovered += sum(all(hits[i] for i in item) for item in items)

    def rates(self) -> dict[str, float | None]:
        return {
            "tokens": _share(self.tokens_recovered, self.tokens),
            "prompts": _share(self.prompts_recovered, self.prompts),
            "items": _share(self.items_recovered, self.items),
        }


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None
