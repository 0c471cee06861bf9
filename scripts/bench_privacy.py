#!/usr/bin/env python
"""What a peer serving layers [s, e) recovers of the prompt from the hidden states it receives.

The default model (SmolLM2-135M-Instruct, float32, transformers). Prompts: windows of held-out
CPython documentation (pydoc_data.topics: topics at sorted index 0, 4, 8, ... are held out, the
others train the probe) and synthetic notes full of personal data (names, e-mail addresses,
phone numbers, dates, account numbers; seeded). For each split depth s and each sink (the wire
codec, or Gaussian noise the client adds at a scale relative to each position's RMS), the three
attacks of scripts/privacy_attacks.py: nearest neighbour, probe, exact inversion with the
weights. The user's cost of a sink applied at layer s: greedy-token agreement (chat prompts,
batched transformers generate, a forward pre-hook on layer s applies the sink to each message)
and the held-out perplexity with the sink.
Usage: python scripts/bench_privacy.py [--quick] [--depths 8,15,29] [--budget N] [--exact-prompts N]
       [--full-search] [--raw-only] [--merge FULL.json] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import importlib.util
import json
import random
import statistics
import string
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pydoc_data.topics
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from p2pfusion.models.source import resolve_model
from p2pfusion.net.codecs import pack
from p2pfusion.net.compression import Codec

_spec = importlib.util.spec_from_file_location("privacy_attacks", Path(__file__).with_name("privacy_attacks.py"))
attacks = importlib.util.module_from_spec(_spec)
sys.modules["privacy_attacks"] = attacks  # dataclasses look their module up there
_spec.loader.exec_module(attacks)
Sink = attacks.Sink

DEPTHS = (0, 1, 2, 4, 8, 15, 29)
SINKS = (
    attacks.RAW,
    Sink(Codec.FLOAT16),
    Sink(Codec.INT8),
    Sink(Codec.TOPK, topk_share=0.1),
    *(Sink(noise=scale) for scale in (0.01, 0.1, 0.3, 1.0)),
)


@dataclass(frozen=True)
class Sizes:
    train_windows: int  # 128-token windows of training text for the probe
    text_prompts: int  # held-out windows of PROMPT_TOKENS tokens
    note_prompts: int  # notes with personal data
    exact_prompts: int  # of each kind, for the exact attack
    budget: int  # candidates per position for the exact attack
    sink_depths: tuple[int, ...]  # depths where sinks are measured (all attacks but exact, and the cost)
    exact_sink_depths: tuple[int, ...]  # depths where the exact attack runs through sinks
    ppl_windows: int  # held-out 128-token windows for perplexity
    gen_prompts: int
    gen_tokens: int


FULL = Sizes(96, 24, 24, 2, 256, DEPTHS, (2,), 8, 8, 32)
QUICK = Sizes(16, 4, 4, 1, 36, (2,), (2,), 2, 4, 16)
PROMPT_TOKENS = 48
WINDOW = 128

FIRST = ["Maria", "James", "Aisha", "Wei", "Olga", "Carlos", "Fatima", "Liam", "Priya", "Hiroshi", "Amara", "Lukas",
         "Sofia", "Mohammed", "Ingrid", "Tomasz", "Chloe", "Kwame", "Elena", "Rajesh"]
LAST = ["Jensen", "Okafor", "Nakamura", "Fernandez", "Kowalski", "Haddad", "Lindqvist", "Mbeki", "Rossi", "Chen",
        "Dubois", "Petrov", "Schneider", "Gupta", "O'Brien", "Alvarez", "Novak", "Yilmaz", "Murphy", "Tanaka"]
DOMAINS = ["example.org", "mailbox.net", "post.example.com", "inbox.eu"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
NOTES = [
    "Patient {name}, born {birth}, seen on {date}. Phone {phone}, e-mail {email}. Insurance number {account}. "
    "Reports chest pain on exertion; started atorvastatin 20 mg.",
    "Client {name} ({email}, {phone}) instructed us on {date} about the custody dispute. Retainer paid from "
    "account {account}; date of birth {birth}.",
    "HR note: employee {name}, date of birth {birth}, salary account {account}, personal e-mail {email}, mobile "
    "{phone}, was dismissed on {date} after the audit.",
    "Therapy session with {name} on {date}: discussed anxiety and debts. Contact {phone} or {email}. Born {birth}. "
    "Invoice to account {account}.",
]
SUMMARIZE = "Summarize this note in one sentence: "


def _date(rng: random.Random, years: tuple[int, int]) -> str:
    return f"{rng.randint(1, 28)} {rng.choice(MONTHS)} {rng.randint(*years)}"


def personal_note(rng: random.Random) -> tuple[str, list[tuple[int, int]]]:
    """A note and the character spans of its personal-data items."""
    first, last = rng.choice(FIRST), rng.choice(LAST)
    values = {
        "name": f"{first} {last}",
        "birth": _date(rng, (1940, 2005)),
        "date": _date(rng, (2023, 2026)),
        "phone": f"+{rng.randint(1, 49)} {rng.randint(100, 999)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}",
        "email": f"{first.lower()}.{last.lower().replace(chr(39), '')}{rng.randint(1, 99)}@{rng.choice(DOMAINS)}",
        "account": " ".join(f"{rng.randint(0, 9999):04d}" for _ in range(4)),
    }
    template, text, spans = rng.choice(NOTES), "", []
    for literal, field, _, _ in string.Formatter().parse(template):
        text += literal
        if field:
            spans.append((len(text), len(text) + len(values[field])))
            text += values[field]
    return text, spans


@dataclass
class Prompt:
    kind: str  # "text" or "personal"
    ids: list[int]
    items: list[list[int]]  # token indices of each personal-data item


def corpus() -> tuple[list[str], list[str]]:
    """(training texts, held-out texts) from CPython's pydoc topics."""
    names = sorted(pydoc_data.topics.topics)
    topics = [pydoc_data.topics.topics[name] for name in names]
    return [t for i, t in enumerate(topics) if i % 4], [t for i, t in enumerate(topics) if not i % 4]


def windows(tokenizer, texts: list[str], length: int, count: int, skip: int = 0) -> torch.Tensor:
    ids = [i for text in texts for i in tokenizer(text).input_ids]
    rows = [ids[a : a + length] for a in range(skip * length, len(ids) - length, length)][:count]
    return torch.tensor(rows)


def make_prompts(tokenizer, held_out: list[str], sizes: Sizes) -> list[Prompt]:
    texts = [t for t in held_out if len(tokenizer(t).input_ids) > PROMPT_TOKENS][: sizes.text_prompts]
    prompts = [Prompt("text", tokenizer(t).input_ids[:PROMPT_TOKENS], []) for t in texts]
    rng = random.Random(1)
    for _ in range(sizes.note_prompts):
        text, spans = personal_note(rng)
        encoded = tokenizer(text, return_offsets_mapping=True)
        prompts.append(Prompt("personal", encoded.input_ids, attacks.token_spans(encoded.offset_mapping, spans)))
    return prompts


@torch.inference_mode()
def states(model, ids: torch.Tensor, depths) -> dict[int, torch.Tensor]:
    """hidden_states[s] of each row of `ids` for each s in `depths`, each [rows, tokens, hidden]."""
    out = {s: [] for s in depths}
    for batch in ids.split(8):
        hidden = model(batch, output_hidden_states=True).hidden_states
        for s in depths:
            out[s].append(hidden[s])
    return {s: torch.cat(parts) for s, parts in out.items()}


def through(hidden: torch.Tensor, sink: Sink, generator: torch.Generator) -> torch.Tensor:
    """Each row of [rows, tokens, hidden] as one message through the sink."""
    return torch.stack([attacks.apply_sink(row[None], sink, generator)[0] for row in hidden])


class SinkAt:
    """Applies a sink to each row of the input of layer `depth` while in use (every forward)."""

    def __init__(self, model, depth: int, sink: Sink, seed: int):
        self.layer, self.sink, self.generator = model.model.layers[depth], sink, torch.Generator().manual_seed(seed)

    def _hook(self, module, args, kwargs):
        if args:
            return (through(args[0], self.sink, self.generator), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": through(kwargs["hidden_states"], self.sink, self.generator)}

    def __enter__(self):
        self.handle = self.layer.register_forward_pre_hook(self._hook, with_kwargs=True)

    def __exit__(self, *exc):
        self.handle.remove()


@torch.inference_mode()
def generate(model, batch, tokens: int) -> torch.Tensor:
    out = model.generate(**batch, max_new_tokens=tokens, do_sample=False, pad_token_id=model.config.pad_token_id)
    return out[:, batch["input_ids"].shape[1] :]


@torch.inference_mode()
def perplexity(model, rows: torch.Tensor) -> float:
    losses = [float(model(batch, labels=batch).loss) for batch in rows.split(4)]
    return float(torch.tensor(losses).mean().exp())


def agreement(got: torch.Tensor, reference: torch.Tensor) -> tuple[int, float]:
    """Rows identical, and the mean share of tokens generated before the first difference."""
    firsts = []
    for a, b in zip(got.tolist(), reference.tolist()):
        firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) / len(b))
    return sum(f == 1.0 for f in firsts), statistics.mean(firsts)


def run_attacks(model, embeddings, depth, sink, train, train_ids, prompts, observed, sizes, first, full=False) -> dict:
    """Scores of the three attacks on `prompts` at `depth` through `sink` (the exact attack only
    given `first`, the first-position table at `depth`; with `full`, searching the whole
    vocabulary where its budget finds no match)."""
    run_exact = first is not None
    generator = torch.Generator().manual_seed(depth * 101 + SINKS.index(sink))
    seen_train = through(train, sink, generator)
    seen = [attacks.apply_sink(h[None], sink, generator)[0] for h in observed]
    flat = torch.cat(seen)
    nn = attacks.nearest_neighbour(flat, embeddings)
    probe = attacks.Probe.fit(seen_train.reshape(-1, train.shape[-1]), train_ids.reshape(-1), embeddings)
    ranking = probe.ranking(flat, sizes.budget)
    truth = torch.tensor([i for p in prompts for i in p.ids])
    scores = {name: attacks.Score() for name in ("nn cosine", "nn l2", "probe", "exact")}
    start, tried, refined = 0, [], 0
    tolerance = attacks.sink_tolerance(train, seen_train)
    exact_left = {"text": sizes.exact_prompts, "personal": sizes.exact_prompts}
    for prompt, hidden in zip(prompts, seen):
        end = start + len(prompt.ids)
        for name, ids in (("nn cosine", nn["cosine"]), ("nn l2", nn["l2"]), ("probe", ranking[:, 0])):
            scores[name].add(ids[start:end].tolist(), prompt.ids, prompt.items)
        if run_exact and exact_left[prompt.kind]:
            exact_left[prompt.kind] -= 1
            inversion = attacks.exact_attack(model, hidden, depth, probe, tolerance, sizes.budget, first, full)
            scores["exact"].add(inversion.ids, prompt.ids, prompt.items)
            tried += inversion.tried
            refined += inversion.refined
        start = end
    in_budget = (ranking == truth[:, None]).any(-1).float().mean()
    best_nn = max(("nn cosine", "nn l2"), key=lambda n: scores[n].tokens_recovered)
    result = {
        "depth": depth, "sink": sink.label, "nn_metric": best_nn.split()[1], "nn": scores[best_nn].rates(),
        "probe": scores["probe"].rates(), "probe_in_budget": float(in_budget), "tolerance": tolerance,
        "wire_bytes_per_token": statistics.mean(pack(h[None], sink.codec, k=max(1, round(sink.topk_share * h.numel()))).nbytes
                                                / len(h) for h in observed),
    }
    if run_exact:
        result["exact"] = scores["exact"].rates()
        result["exact_candidates_per_position"] = statistics.mean(tried)
        result["exact_refined_share"] = refined / len(tried)
        result["exact_full_search"] = full
    return result


def fmt(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f} %"


def print_tables(records: list[dict], costs: dict, sizes: Sizes) -> None:
    print("\n## Raw hidden states: share recovered, per split depth s (tokens / whole prompts / personal items)\n")
    print("| s | nearest neighbour | probe | exact (weights) | exact candidates/position | exact, whole vocabulary "
          "| its candidates/position |")
    print("|---|---|---|---|---|---|---|")
    for r in records:
        if r["sink"] == "raw":
            row = [" / ".join(fmt(r[a][k]) for k in ("tokens", "prompts", "items")) if a in r else "—"
                   for a in ("nn", "probe", "exact", "exact_full")]
            cands = [f"{r[k]:.1f}" if k in r else "—" for k in ("exact_candidates_per_position", "exact_full_candidates")]
            print(f"| {r['depth']} | {' | '.join(row[:3])} | {cands[0]} | {row[3]} | {cands[1]} |")
    print("\n## Sinks: tokens recovered (personal items) and the user's cost, per split depth s\n")
    print(f"| s | sink | wire B/token | nearest neighbour | probe | exact (weights) | greedy prompts identical "
          f"(of {sizes.gen_prompts}) | tokens before 1st difference | perplexity ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        if r["depth"] not in sizes.sink_depths:
            continue
        cost = costs[(r["depth"], r["sink"])]
        cells = [f"{fmt(r[a]['tokens'])} ({fmt(r[a]['items'])})" if a in r else "—" for a in ("nn", "probe", "exact")]
        print(f"| {r['depth']} | {r['sink']} | {r['wire_bytes_per_token']:.0f} | {' | '.join(cells)} | "
              f"{cost['identical']} | {100 * cost['agreement']:.0f} % | {cost['ppl_ratio']:.3f} |")


def plot(records: list[dict], costs: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    raw = [r for r in records if r["sink"] == "raw"]
    for attack, label, marker in (("nn", "nearest neighbour", "o"), ("probe", "probe (ridge)", "o"),
                                  ("exact", "exact (weights), 256 candidates/position", "o"),
                                  ("exact_full", "exact (weights), whole vocabulary", "*")):
        points = [(r["depth"], 100 * r[attack]["tokens"]) for r in raw if attack in r]
        if points:
            left.plot(*zip(*points), marker=marker, label=label)
    left.set(xlabel="split depth s (layers the client runs before the peer)", ylabel="prompt tokens recovered (%)",
             title="Raw hidden states", ylim=(-3, 103))
    left.legend()
    for depth in sorted({r["depth"] for r in records if "exact" in r and r["sink"] != "raw"}):
        rows = [r for r in records if r["depth"] == depth]
        xs = [100 * costs[(depth, r["sink"])]["agreement"] for r in rows]
        for attack, marker, label in (("exact", "o", "exact (weights)"), ("probe", "s", "probe (ridge)")):
            ys = [100 * r[attack]["tokens"] for r in rows]
            right.scatter(xs, ys, marker=marker, label=f"{label}, s = {depth}")
            names: dict[tuple[int, int], list[str]] = {}
            for x, y, r in zip(xs, ys, rows):
                names.setdefault((round(x), round(y)), []).append(r["sink"])
            for (x, y), sinks in names.items():
                right.annotate(", ".join(sinks), (x, y), fontsize=7, xytext=(-4, -11 if attack == "probe" else 4),
                               textcoords="offset points", ha="right" if x > 50 else "left")
    right.set(xlabel="user's greedy tokens before the first difference (%)", ylabel="prompt tokens recovered (%)",
              title="Sinks: privacy vs the user's output", xlim=(-3, 103), ylim=(-3, 103))
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_json(path: str, sizes: Sizes, base_ppl: float, records: list[dict], costs: dict) -> None:
    Path(path).write_text(json.dumps({
        "sizes": asdict(sizes), "base_perplexity": base_ppl, "attacks": records,
        "costs": [{"depth": s, "sink": label, **c} for (s, label), c in costs.items()],
    }, indent=1))


def merge(path: str, records: list[dict]) -> tuple[list[dict], dict, Sizes]:
    """A full run's figures (`path`, written by --json) with this run's exact results on raw
    states as their whole-vocabulary series; written back to `path`."""
    full = json.loads(Path(path).read_text())
    searched = {r["depth"]: r for r in records if r["sink"] == "raw" and r.get("exact_full_search")}
    for r in full["attacks"]:
        if r["sink"] == "raw" and r["depth"] in searched:
            r["exact_full"] = searched[r["depth"]]["exact"]
            r["exact_full_candidates"] = searched[r["depth"]]["exact_candidates_per_position"]
    costs = {(c["depth"], c["sink"]): {k: v for k, v in c.items() if k not in ("depth", "sink")} for c in full["costs"]}
    sizes = Sizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in full["sizes"].items()})
    write_json(path, sizes, full["base_perplexity"], full["attacks"], costs)
    return full["attacks"], costs, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes: a few minutes")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--plot", help="write a PNG of recovery vs depth and vs the user's cost")
    parser.add_argument("--budget", type=int, help="the exact attack's candidates per position")
    parser.add_argument("--depths", help="comma-separated split depths to measure (default: all of " + str(DEPTHS) + ")")
    parser.add_argument("--exact-prompts", type=int, help="prompts of each kind the exact attack inverts")
    parser.add_argument("--raw-only", action="store_true", help="raw hidden states only: no codecs, no noise")
    parser.add_argument(
        "--merge", metavar="PATH",
        help="a full run's --json file: this run's exact results on raw states join it as the whole-vocabulary "
        "series (with --full-search), written back to it, and its tables and --plot include them",
    )
    parser.add_argument(
        "--full-search", action="store_true",
        help="the exact attack on raw states searches the whole vocabulary where its budget finds no match (slow on a CPU)",
    )
    args = parser.parse_args()
    print(machine_header(), flush=True)
    depths = DEPTHS if args.depths is None else tuple(int(d) for d in args.depths.split(","))
    sizes = QUICK if args.quick else FULL
    if args.budget:
        sizes = replace(sizes, budget=args.budget)
    if args.exact_prompts is not None:
        sizes = replace(sizes, exact_prompts=args.exact_prompts)
    if args.raw_only:
        sizes = replace(sizes, sink_depths=(), exact_sink_depths=())
    torch.manual_seed(0)

    source = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(source.folder)
    embeddings = model.get_input_embeddings().weight.detach()
    train_texts, held_out = corpus()
    prompts = make_prompts(tokenizer, held_out, sizes)
    train_ids = windows(tokenizer, train_texts, WINDOW, sizes.train_windows)
    ppl_rows = windows(tokenizer, held_out, WINDOW, sizes.ppl_windows, skip=8)
    tokenizer.padding_side = "left"
    rng = random.Random(2)
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": SUMMARIZE + personal_note(rng)[0]}],
                                           tokenize=False, add_generation_prompt=True) for _ in range(sizes.gen_prompts)]
    gen_batch = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)

    settings = [(s, sink) for s in depths for sink in SINKS if sink == attacks.RAW or s in sizes.sink_depths]
    progress = tqdm(total=len(settings) + 3, desc="privacy", file=sys.stderr)
    tables = attacks.first_position_table(model, list(depths))
    progress.update()
    train_states = states(model, train_ids, depths)
    observed = {s: [] for s in depths}
    for prompt in prompts:
        for s, h in states(model, torch.tensor([prompt.ids]), depths).items():
            observed[s].append(h[0])
    progress.update()
    reference, base_ppl = generate(model, gen_batch, sizes.gen_tokens), perplexity(model, ppl_rows)
    progress.update()

    records, costs = [], {}
    for s, sink in settings:
        progress.set_postfix_str(f"s={s} {sink.label}")
        first = tables[s] if sink == attacks.RAW or s in sizes.exact_sink_depths else None
        records.append(run_attacks(model, embeddings, s, sink, train_states[s], train_ids, prompts, observed[s],
                                   sizes, first, args.full_search and sink == attacks.RAW))
        if sink == attacks.RAW:
            costs[(s, sink.label)] = {"identical": sizes.gen_prompts, "agreement": 1.0, "ppl": base_ppl, "ppl_ratio": 1.0}
        else:
            with SinkAt(model, s, sink, seed=s):
                identical, share = agreement(generate(model, gen_batch, sizes.gen_tokens), reference)
                ppl = perplexity(model, ppl_rows)
            costs[(s, sink.label)] = {"identical": identical, "agreement": share, "ppl": ppl, "ppl_ratio": ppl / base_ppl}
        if args.json:  # after every setting, so that a run cut short keeps what it measured
            write_json(args.json, sizes, base_ppl, records, costs)
        progress.update()
    progress.close()
    if args.merge:
        print(f"whole-vocabulary exact attack at depths {', '.join(map(str, depths))}: {sizes.exact_prompts} prompt(s) "
              f"of each kind; merged into {args.merge}")
        records, costs, sizes = merge(args.merge, records)
    print(f"default model, float32; probe trained on {sizes.train_windows} x {WINDOW} tokens; "
          f"{sizes.text_prompts} held-out text prompts of {PROMPT_TOKENS} tokens and {sizes.note_prompts} notes with "
          f"{sum(len(p.items) for p in prompts)} personal items; exact attack on {sizes.exact_prompts} of each, "
          f"budget {sizes.budget} candidates/position")
    print_tables(records, costs, sizes)
    if args.plot:
        plot(records, costs, args.plot)


if __name__ == "__main__":
    main()
