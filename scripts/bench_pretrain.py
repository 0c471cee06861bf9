"""Training the default model's own weights across a swarm of replica processes on 127.0.0.1,
against local transformers training of the same layers with the same data, order and optimizer
(embeddings, final norm and head frozen on both sides, as the driver holds them).

    python scripts/bench_pretrain.py [--steps 60] [--sync-every 20] [--batch 4] [--tokens 32] [--averaging float16]

1. Exactness: 3 stages of one replica each, an outer step after every inner step with outer lr 1
   and momentum 0 (a plain average): the loss at every step and the final weights, relative to
   local training.
2. Convergence: 2 stages x 2 replicas, DiLoCo (outer lr 0.7, Nesterov 0.9) every `--sync-every`
   steps, against centralized training with the same total batch: held-out perplexity, and the
   bytes the replicas' averaging moved (counted at the receiving end of every all-reduce stream)
   against what an outer step at every inner step would move.
3. Churn: the same run with one replica of each stage killed (SIGKILL) at 1/3 of the steps and
   started again at 2/3; it must finish unattended.

The corpus is the docstrings of Python's standard library (every Python ships it): training text
from one set of modules, held-out text from another. Prints a table; `--plot PNG` draws the curves.
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import importlib
import inspect
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.run.trainer import SwarmTrainer
from p2pfusion.models.source import resolve_model

TRAIN_MODULES = ("argparse", "asyncio.tasks", "collections", "functools", "itertools", "json", "logging", "os", "pathlib",
                 "re", "shutil", "subprocess", "threading", "typing", "unittest.case", "urllib.parse", "zipfile")
HELD_OUT_MODULES = ("csv", "datetime", "email.message", "heapq", "statistics", "textwrap")
LR = 1e-4


def docstrings(names: tuple[str, ...]) -> str:
    texts = []
    for name in names:
        module = importlib.import_module(name)
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if (inspect.isclass(obj) or inspect.isfunction(obj)) else None
            if doc and getattr(obj, "__module__", None) == module.__name__:
                texts.append(doc)
    return "\n\n".join(texts)


def batches(tokenizer, names, count: int, batch: int, tokens: int, seed: int) -> list[torch.Tensor]:
    ids = torch.tensor(tokenizer(docstrings(names))["input_ids"])
    rows = ids[: len(ids) // tokens * tokens].view(-1, tokens)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    need = count * batch
    if need > len(rows):
        raise SystemExit(f"the corpus has {len(rows)} sequences of {tokens} tokens; {need} asked")
    return list(rows[order[:need]].split(batch))


def local_run(source, data, held_out, every: int = 0) -> dict:
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).train()
    for name, param in model.named_parameters():
        param.requires_grad_(".layers." in name)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, curve = [], []
    with progress(len(data), "centralized") as bar:
        for ids in data:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            bar.update(ids, losses[-1])
            if every and len(losses) % every == 0:
                with torch.no_grad():
                    curve.append((len(losses), model(input_ids=held_out, labels=held_out).loss.item()))
    with torch.no_grad():
        held = model(input_ids=held_out, labels=held_out).loss.item()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "held_out": held, "held_curve": curve, "state": state}


class progress:
    def __init__(self, total: int, what: str):
        self.bar = tqdm(total=total, desc=what, unit="step", file=sys.stderr)
        self.started = time.perf_counter()
        self.tokens = 0

    def update(self, ids: torch.Tensor, loss: float) -> None:
        self.tokens += ids.numel()
        rate = self.tokens / (time.perf_counter() - self.started)
        self.bar.set_postfix(loss=f"{loss:.3f}", tokens_s=f"{rate:.0f}")
        self.bar.update()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()


def swarm_run(source, data, held_out, layout, settings, run: str, churn=False, workdir=None) -> dict:
    fixed = ["--throughput", "100", "--train", run, "--session-limit", str(held_out.shape[1])]
    with LocalSwarm(model=None) as swarm:
        first = swarm.launch(layout[0], fixed)
        swarm.wait_ready(first)
        procs = [first, *[swarm.launch(r, fixed) for r in layout[1:]]]
        for proc in procs[1:]:
            swarm.wait_ready(proc)
        trainer = SwarmTrainer.connect(None, swarm.maddrs, run=run, lr=LR, **settings)
        victims = [procs[1], procs[3]] if churn else []  # one replica of each stage; the first peer is everyone's bootstrap
        losses, held, events, t0 = [], [], [], time.perf_counter()
        try:
            with progress(len(data), run) as bar:
                for step, ids in enumerate(data):
                    if churn and step == len(data) // 3:
                        for proc in victims:
                            proc.kill()
                            proc.wait()
                        events.append((step, "killed one replica of each stage"))
                    if churn and step == 2 * len(data) // 3:
                        for r in dict.fromkeys(layout):
                            swarm.wait_ready(swarm.launch(r, fixed))
                        events.append((step, "restarted them"))
                    losses.append(trainer.step(ids))
                    bar.update(ids, losses[-1])
                    if trainer.step_count % settings["sync_every"] == 0:
                        held.append((trainer.step_count, trainer.evaluate(held_out)))
            seconds = time.perf_counter() - t0
            final = trainer.evaluate(held_out)
            averaged = trainer.averaged_bytes
            rounds, redone = trainer.round, trainer.redone
            state = None
            if workdir is not None:
                saved = trainer.save_pretrained(workdir / run)
                state = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).state_dict()
        finally:
            trainer.close()
    return {"losses": losses, "held_curve": held, "held_out": final, "bytes": averaged, "rounds": rounds,
            "redone": redone, "seconds": seconds, "events": events, "state": state}


def relative(a: dict, b: dict) -> float:
    error = sum(float((a[k] - v).pow(2).sum()) for k, v in b.items()) ** 0.5
    return error / sum(float(v.pow(2).sum()) for v in b.values()) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--exact-steps", type=int, default=5)
    parser.add_argument("--skip", nargs="*", default=[], choices=["exact", "converge", "churn"])
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--averaging", default="none", choices=["none", "float16"], help="the pseudo-gradients' precision on the wire")
    parser.add_argument("--plot", help="draw the loss curves into this PNG")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    print(machine_header(), flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-pretrain-"))
    source = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(source.folder)
    data = batches(tokenizer, TRAIN_MODULES, args.steps, args.batch, args.tokens, seed=0)
    held_out = batches(tokenizer, HELD_OUT_MODULES, 1, 32, args.tokens, seed=1)[0]
    figures = {}
    if "exact" not in args.skip:
        exact_data = data[: args.exact_steps]
        local = local_run(source, exact_data, held_out)
        swarm = swarm_run(source, exact_data, held_out, [(0, 10), (10, 20), (20, 30)],
                          {"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0}, "exact", workdir=workdir)
        worst = max(abs(a - b) / b for a, b in zip(swarm["losses"], local["losses"]))
        figures["exact"] = {"steps": len(exact_data), "worst_loss_rel": worst, "weights_rel": relative(swarm["state"], local["state"]),
                            "losses": swarm["losses"], "local_losses": local["losses"]}
        print(f"exactness: {len(exact_data)} steps, worst loss difference {worst:.1e} relative, "
              f"final weights {figures['exact']['weights_rel']:.1e} relative", flush=True)
    runs = {}
    if "converge" not in args.skip or "churn" not in args.skip:
        runs["centralized"] = local_run(source, data, held_out, args.sync_every)
    layout = [(0, 15), (0, 15), (15, 30), (15, 30)]
    diloco = {"sync_every": args.sync_every, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum, "averaging": args.averaging}
    if "converge" not in args.skip:
        runs["diloco"] = swarm_run(source, data, held_out, layout, diloco, "diloco")
    if "churn" not in args.skip:
        runs["churn"] = swarm_run(source, data, held_out, layout, diloco, "churn", churn=True)
    if runs:
        base = math.exp(runs["centralized"]["held_out"])
        print("| run | held-out perplexity | vs centralized | averaging bytes | outer steps | steps redone | time |")
        print("|---|---|---|---|---|---|---|")
        for name, r in runs.items():
            ppl = math.exp(r["held_out"])
            moved = f"{r['bytes'] / 2**20:.0f} MiB" if "bytes" in r else "-"
            print(f"| {name} | {ppl:.2f} | {ppl / base:.3f}x | {moved} | {r.get('rounds', '-')} | {r.get('redone', '-')} | "
                  f"{r.get('seconds', 0):.0f} s |")
            figures[name] = {k: v for k, v in r.items() if k != "state"} | {"perplexity": ppl}
        if "diloco" in runs and runs["diloco"]["rounds"]:
            per_round = runs["diloco"]["bytes"] / runs["diloco"]["rounds"]
            every = per_round * args.steps
            print(f"averaging every step would move {every / 2**20:.0f} MiB: {every / runs['diloco']['bytes']:.1f}x what H={args.sync_every} moved")
        model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32)
        with torch.no_grad():
            figures["initial_perplexity"] = math.exp(model(input_ids=held_out, labels=held_out).loss.item())
        print(f"held-out perplexity before training: {figures['initial_perplexity']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    if args.plot and runs:
        plot(runs, args, args.plot)


def plot(runs: dict, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in runs.items():
        left.plot(range(1, len(r["losses"]) + 1), r["losses"], label=name, alpha=0.8)
        if r.get("held_curve"):
            steps, losses = zip(*r["held_curve"])
            right.plot(steps, [math.exp(x) for x in losses], marker="o", label=name)
    right.axhline(math.exp(runs["centralized"]["held_out"]), color="gray", linestyle="--", label="centralized, end")
    for step, what in runs.get("churn", {}).get("events", []):
        left.axvline(step, color="red", linestyle=":", alpha=0.6)
    left.set(xlabel="inner step", ylabel="training loss", title="Training loss (red: replicas killed, restarted)")
    right.set(xlabel="inner step", ylabel="held-out perplexity", title=f"Held-out perplexity at outer steps (H={args.sync_every})")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
