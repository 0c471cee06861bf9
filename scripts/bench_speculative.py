#!/usr/bin/env python
"""Speculative decoding against plain decoding, through one local swarm, in one run, with ratios.

The default model on 3 peer processes on 127.0.0.1 (a third of the layers each). For each prompt,
greedy generations with drafts (`speculate="auto"`) and without (`"off"`) alternate, so load from
other tenants of the machine hits both alike; both must give the same tokens. Two kinds of
prompt: answers that repeat their context (quote, summarise, edit code with and without an
explanation, list back), where drafts from the text stand, and free-form chat, where they rarely
do and drafting must cost next to nothing. Generations stop at the end of the answer (EOS), as
users' do, or after --tokens. Decode speed is (tokens - 1) / decode time (the prefill excluded,
as both sides share it). Beside
each, the most tokens per step prompt lookup could give on that answer (`lookup_bound`): drafts
stand only where the answer repeats its context, whatever the policy.
Usage: python scripts/bench_speculative.py [--tokens 96] [--runs 3] [--peers 3]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import statistics
import sys

import uvloop

from p2pfusion.cli.local_swarm import LocalSwarm, even_ranges
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.generate.conversation import Conversation
from p2pfusion.client.generate.draft import MAX_DRAFTS, lookup
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import load_config

CODE = '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(value)
'''
REPEATING = {
    "quote": "Repeat the following text exactly, word for word:\n\nThe lighthouse stood on the northern cliff for two "
             "hundred years. Every night its keeper climbed the hundred and twelve steps, lit the lamp, and watched "
             "the ships pass safely between the rocks.",
    "summarise": "Summarise this paragraph in one sentence: The lighthouse stood on the northern cliff for two "
                 "hundred years. Every night its keeper climbed the hundred and twelve steps, lit the lamp, and "
                 "watched the ships pass safely between the rocks.",
    "edit code": f"Fix the bug in this Python function and write out the whole corrected function:\n\n{CODE}",
    "edit, code only": "Fix the bug in this Python function. Reply with only the corrected code, no explanation:"
                       f"\n\n```python\n{CODE}```",
    "list back": "Here is a shopping list: apples, bread, milk, eggs, butter, cheese, rice, tomatoes, onions, "
                 "coffee. Write the same list again as a numbered list.",
}
FREE = {
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "question": "What is a distributed hash table, and why do peer-to-peer networks use one?",
}


def lookup_bound(ids: list[int], answer: list[int], k: int = MAX_DRAFTS) -> float:
    """Tokens per step if every step sent k prompt-lookup drafts, the answer known: each step
    yields the drafts that match it, and the model's own token."""
    done, steps = 0, 0
    while done < len(answer):
        drafts = lookup(ids + answer[:done], k)
        pairs = list(zip(drafts, answer[done:]))
        stood = next((i for i, (d, a) in enumerate(pairs) if d != a), len(pairs))
        done, steps = done + stood + 1, steps + 1
    return len(answer) / steps


async def generate(model: RemoteCausalLM, ids: list[int], tokens: int):
    conversation = Conversation(model, keep=False)
    try:
        result = await conversation.generate(ids, tokens)
    finally:
        await conversation.close()
    sent, stood = (0, 0) if conversation.speculation is None else (conversation.speculation.sent, conversation.speculation.stood)
    return result, sent, stood


async def runs(source, maddrs, prompts: dict[str, list[int]], args) -> dict[str, dict[str, list]]:
    swarm = await join_swarm(maddrs, client_mode=True)
    out = {name: {"spec": [], "plain": [], "per_step": [], "stood": [], "bound": []} for name in prompts}
    try:
        drafting = RemoteCausalLM.build(source, swarm, speculate="auto", verify=0.0)
        plain = RemoteCausalLM.build(source, swarm, speculate="off", verify=0.0)
        for model in (drafting, plain):  # connections, links, caches
            await generate(model, next(iter(prompts.values())), 4)
        for run in range(args.runs):
            for name, ids in prompts.items():
                fast, sent, stood = await generate(drafting, ids, args.tokens)
                slow, _, _ = await generate(plain, ids, args.tokens)
                if fast.token_ids != slow.token_ids:
                    raise SystemExit(f"{name}: speculative decoding changed the text")
                speed = lambda r: (len(r.token_ids) - 1) / r.decode_seconds  # noqa: E731
                out[name]["spec"].append(speed(fast))
                out[name]["plain"].append(speed(slow))
                out[name]["per_step"].append(len(fast.token_ids) / fast.steps)
                out[name]["stood"].append(stood / sent if sent else 0.0)
                out[name]["bound"].append(lookup_bound(ids, fast.token_ids))
                print(f"run {run} {name}: drafts {speed(fast):.1f} tok/s, plain {speed(slow):.1f} tok/s, "
                      f"{len(fast.token_ids) / fast.steps:.2f} tokens per step, {stood}/{sent} drafts stood",
                      file=sys.stderr)
        return out
    finally:
        await swarm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--peers", type=int, default=3)
    args = parser.parse_args()
    print(machine_header(), flush=True)
    source = resolve_model(None)
    encoder = RemoteCausalLM.build(source)
    prompts = {name: encoder.encode(text, chat=True) for name, text in {**REPEATING, **FREE}.items()}
    layers = load_config(source).num_hidden_layers
    with LocalSwarm(model=None) as local:
        local.start(even_ranges(layers, args.peers))
        r = uvloop.run(runs(source, local.maddrs, prompts, args))
    med = statistics.median
    print(f"model {source.name}, {args.peers} peers on 127.0.0.1, {args.tokens} new tokens, greedy, {args.runs} runs")
    for group, names in (("repeating", REPEATING), ("free-form", FREE)):
        ratios = []
        for name in names:
            ratio = [s / p for s, p in zip(r[name]["spec"], r[name]["plain"])]
            ratios += ratio
            print(f"  {group:<9} {name:<16} drafts {med(r[name]['spec']):5.1f} tok/s, plain {med(r[name]['plain']):5.1f} "
                  f"tok/s, ratio {med(ratio):.2f} (runs {', '.join(f'{x:.2f}' for x in ratio)}), "
                  f"{med(r[name]['per_step']):.2f} tokens per step (lookup's bound {med(r[name]['bound']):.2f}), "
                  f"{100 * med(r[name]['stood']):.0f}% of drafts stood")
        print(f"{group}: median ratio {med(ratios):.2f}")


if __name__ == "__main__":
    main()
