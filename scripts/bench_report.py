#!/usr/bin/env python
"""The headline ratios on this machine, in one command and one table (about 10 minutes on 2 cores).

Runs the bench scripts one after another with short settings, reads their result lines, and
prints the machine header (bench_machine.py) and one markdown table on stdout; each script's full
output goes to --logs. The rows, each against its reference in the same run:
- greedy decode and batch forward 4x128 through a 3-peer swarm ÷ local transformers (bench_inference.py);
- 8 concurrent sessions through the client core ÷ transformers' batched generate of 8, and their
  p99 token gap ÷ one session's (bench_load.py);
- 8 concurrent streams through `p2pfusion api` ÷ the same reference (bench_api.py);
- the stall of a generation when a peer with a warm backup gets kill -9 (bench_churn.py);
- resident memory of a peer per weight format ÷ float32 (bench_memory.py).
Usage: python scripts/bench_report.py [--logs DIR] [--runs 3]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
NUMBER = r"([0-9.]+)"


@dataclass
class Row:
    measure: str
    value: str
    target: str
    script: str


def run(script: str, args: list[str], logs: Path) -> str:
    """The script's stdout; stdout and stderr go to logs/<script>.log as well."""
    started = time.perf_counter()
    print(f"running {script} {' '.join(args)} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True)
    (logs / f"{Path(script).stem}.log").write_text(f"$ {script} {' '.join(args)}\n{done.stdout}\n--- stderr\n{done.stderr}")
    print(f"  {time.perf_counter() - started:.0f} s, exit {done.returncode}", file=sys.stderr, flush=True)
    return done.stdout


def find(pattern: str, text: str, default: str = "-") -> str:
    match = re.search(pattern, text)
    return match.group(1) if match else default


def verdict(value: str, ok) -> str:
    try:
        return f"{value} {'PASS' if ok(float(value.rstrip('x s'))) else 'FAIL'}"
    except ValueError:
        return f"{value} (not measured)"


def inference_rows(runs: int, logs: Path) -> list[Row]:
    out = run("bench_inference.py", ["--runs", str(runs)], logs)
    decode = find(r"greedy decode.*ratio " + NUMBER, out)
    batch = find(r"batch forward.*ratio " + NUMBER, out)
    return [
        Row("greedy decode, 3-peer swarm ÷ local", verdict(decode, lambda x: x >= 0.9), ">= 0.90", "bench_inference.py"),
        Row("batch forward 4x128 ÷ local", verdict(batch, lambda x: x >= 0.85), ">= 0.85", "bench_inference.py"),
    ]


def load_rows(logs: Path) -> list[Row]:
    out = run("bench_load.py", ["--sessions", "1,8", "--abusers", "", "--pairs", "3"], logs)
    ratio = find(r"aggregate at N=8, all decoding.*?: " + NUMBER, out)
    p99 = find(r"p99 at N=8 <= 3x p99 at N=1: " + NUMBER, out)
    return [
        Row("8 sessions through the core ÷ local batched generate of 8", verdict(ratio, lambda x: x >= 0.8), ">= 0.80",
            "bench_load.py"),
        Row("p99 token gap, 8 sessions ÷ 1", verdict(p99 + "x" if p99 != "-" else p99, lambda x: x <= 3), "<= 3x",
            "bench_load.py"),
    ]


def api_rows(logs: Path) -> list[Row]:
    out = run("bench_api.py", ["--runs", "2", "--concurrent", "8", "--rounds", "3"], logs)
    api = find(r"local batched generate of 8.*?all decoding, API " + NUMBER, out)
    overhead = find(r"the API costs at most 5% of decode tokens/s: ([-+0-9.]+)%", out)
    return [
        Row("8 streams through the HTTP API ÷ local batched generate of 8", verdict(api, lambda x: x >= 0.8), ">= 0.80",
            "bench_api.py"),
        Row("one stream: the API's cost in decode tokens/s, % of the core's", verdict(overhead, lambda x: x <= 5), "<= 5%",
            "bench_api.py"),
    ]


def churn_rows(logs: Path) -> list[Row]:
    out = run("bench_churn.py", ["--setups", "backup", "--stall-runs", "3", "--runs", "0"], logs)
    stall = find(r"stall with a warm backup: .*?p50 " + NUMBER + " s", out)
    done = find(r"stall with a warm backup: (\d+ of \d+)", out)
    return [Row(f"stall when a peer with a warm backup is killed (p50; {done} runs token-identical)",
                stall + " s" if stall != "-" else stall, "-", "bench_churn.py")]


def memory_rows(logs: Path) -> list[Row]:
    out = run("bench_memory.py", [], logs)
    targets = {("400m", "int8"): 1024, ("400m", "int4"): 922, ("400m", "bfloat16"): 1331}
    rows = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 9 or cells[0] in ("model", "---"):
            continue
        model, layers, fmt, rss, ratio, loading = cells[0], cells[1], cells[2], cells[4], cells[5], cells[7]
        limit = targets.get((model, fmt))
        if model == "default" and fmt != "float32":
            target, ok = "<= float32", ratio != "-" and float(ratio) <= 1.0
        elif limit is not None:
            target, ok = f"<= {limit} MiB", float(rss.split()[0]) <= limit
        else:
            target, ok = "-", None
        value = f"{rss} (x{ratio} of float32; peak loading {loading})"
        rows.append(Row(f"peer RSS serving {model} {layers} in {fmt}",
                        value if ok is None else f"{value} {'PASS' if ok else 'FAIL'}", target, "bench_memory.py"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs", type=Path, help="where each script's output goes (default: a new temporary folder)")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs of bench_inference.py")
    args = parser.parse_args()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="p2pfusion-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    header = run("bench_machine.py", [], logs).strip()
    rows = inference_rows(args.runs, logs) + load_rows(logs) + api_rows(logs) + churn_rows(logs) + memory_rows(logs)
    print(header)
    print(f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; {time.perf_counter() - started:.0f} s; logs in {logs}\n")
    print("| measure | this machine | target | script |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row.measure} | {row.value} | {row.target} | {row.script} |")


if __name__ == "__main__":
    main()
