"""The client's greedy head for several sessions at once: screened row by row, or one product.

`client/generate/greedy.py` chooses the greedy tokens of the sessions that ask in the same turn of the
loop together; this measures what each way costs on the default model's head (49,152 x 576), one
thread, for 1 to 16 rows: the float16 screen one row at a time (`ScreenedHead.next_token`),
`torch.nn.functional.linear` over all rows, the float32 product with the vocabulary as the left
operand (`ScreenedHead.next_tokens`) and the bfloat16 screen of all rows (`next_tokens(x,
bfloat16=True)`, where this machine's bfloat16 kernel passes its check). The four take turns within
each repetition, so a busy moment of a shared machine hits them alike; the medians are printed,
with ratios to `linear`.

    .venv/bin/python scripts/bench_head.py [--reps 7]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import statistics
import sys
import time

import torch
from tqdm import tqdm

from p2pfusion.client.generate.screen import screened_head
from p2pfusion.models.source import resolve_model
from transformers import AutoModelForCausalLM

ROWS = (1, 2, 4, 8, 16)


def timed(fn, repeat: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    print(machine_header(), flush=True)
    source = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32)
    screen = screened_head(model)
    if screen is None:
        sys.exit("the default model's head cannot be screened")
    torch.set_num_threads(1)
    weight = screen.weight
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for _ in tqdm(range(args.reps), desc="repetitions", file=sys.stderr):
            for rows in ROWS:
                x = torch.randn(rows, weight.shape[1]) * 2  # the final norm's scale: |x| about 46
                ways = {
                    "screen per row": lambda: [screen.next_token(row) for row in x],
                    "linear": lambda: torch.nn.functional.linear(x, weight),
                    "vocabulary on the left": lambda: screen.next_tokens(x),
                    "bfloat16 screen": lambda: screen.next_tokens(x, bfloat16=True),
                }
                for name, fn in ways.items():
                    times.setdefault((name, rows), []).append(timed(fn))
    print(f"{'rows':>4} | {'screen per row':>15} | {'linear':>8} | {'vocabulary on the left':>22} | "
          f"{'bfloat16 screen':>15} | left vs linear | bfloat16 vs left")
    for rows in ROWS:
        medians = {name: statistics.median(values) for (name, r), values in times.items() if r == rows}
        left, low = medians["vocabulary on the left"], medians["bfloat16 screen"]
        print(f"{rows:>4} | {medians['screen per row']:>12.1f} ms | {medians['linear']:>5.1f} ms | {left:>19.1f} ms | "
              f"{low:>12.1f} ms | {left / medians['linear']:>14.2f} | {low / left:.2f}")
    print(f"bfloat16 kernel summing in float32 here, by row count: {screen.sound}")


if __name__ == "__main__":
    main()
