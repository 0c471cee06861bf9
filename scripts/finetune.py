"""Fine-tune the default model through a swarm with LoRA, on the small question-answer set shipped in
scripts/data/zorvia.jsonl (facts about a made-up country, which the model cannot know beforehand).

    python scripts/finetune.py                                  # starts a local 3-peer swarm itself
    python scripts/finetune.py --initial-peers /ip4/.../p2p/... # or trains through an existing swarm

It shows the model's answer before and after training, a progress bar with the loss and tokens/s,
and saves the adapter (PEFT format), ready for `p2pfusion infer --adapter PATH`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from tqdm import tqdm

from p2pfusion import AutoDistributedModelForCausalLM
from p2pfusion.cli.local_swarm import LocalSwarm, even_ranges

DATA = Path(__file__).parent / "data" / "zorvia.jsonl"
QUESTION = "What is the capital of Zorvia?"


def examples(tokenizer, path: Path) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per pair: the loss covers only the answer (and its end-of-turn token)."""
    out = []
    for line in path.read_text().splitlines():
        pair = json.loads(line)
        user = [{"role": "user", "content": pair["question"]}]
        prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
        full = tokenizer.apply_chat_template(
            [*user, {"role": "assistant", "content": pair["answer"]}], tokenize=True, return_dict=False
        )
        if list(full[:len(prompt)]) != list(prompt):
            sys.exit(f"the chat template does not extend the question's tokens for: {pair['question']}")
        out.append((list(full), [-100] * len(prompt) + list(full[len(prompt):])))
    return out


def collate(batch: list[tuple[list[int], list[int]]], pad: int):
    """Right-padded ids, attention mask and labels."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
    mask = torch.tensor([[1] * len(ids_) + [0] * (width - len(ids_)) for ids_, _ in batch])
    return ids, mask, labels


def answer(model, tokenizer, question: str) -> str:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--initial-peers", nargs="+", help="a swarm to train through (default: start 3 local peers)")
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--output", type=Path, default=Path("zorvia-lora"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    with ExitStack() as stack:
        peers = args.initial_peers
        if not peers:
            print("starting 3 local peers...", file=sys.stderr)
            swarm = stack.enter_context(LocalSwarm(model=args.model))
            peers = swarm.start(even_ranges(30, 3)).maddrs
        model = AutoDistributedModelForCausalLM.from_pretrained(
            args.model, initial_peers=peers, tuning="lora", lora_rank=args.rank,
            lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
        )
        stack.callback(model.close)
        tokenizer = padded(model.tokenizer)
        data = examples(tokenizer, args.data)
        print(f"Q: {QUESTION}\nbefore: {answer(model, tokenizer, QUESTION)}", flush=True)

        optimizer = torch.optim.AdamW(model.adapter.parameters(), lr=args.lr)
        bar = tqdm(range(args.steps), desc="fine-tuning", unit="step", file=sys.stderr, disable=not sys.stderr.isatty())
        tokens, t0 = 0, time.perf_counter()
        for _ in bar:
            ids, mask, labels = collate(random.sample(data, args.batch_size), tokenizer.pad_token_id)
            optimizer.zero_grad()
            loss = model(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            tokens += int(mask.sum())
            bar.set_postfix(loss=f"{loss.item():.3f}", tokens_per_s=f"{tokens / (time.perf_counter() - t0):.0f}")

        print(f"after:  {answer(model, tokenizer, QUESTION)}", flush=True)
        model.save_adapter(args.output)
        print(f"adapter saved to {args.output}; try: p2pfusion infer --adapter {args.output} --chat "
              f"--initial-peers PEER \"{QUESTION}\"", file=sys.stderr)


def padded(tokenizer):
    """The model's tokenizer, padding with its end-of-sequence token where it names no pad token."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


if __name__ == "__main__":
    main()
