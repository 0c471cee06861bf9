"""What an idle gap costs on this machine: the two effects behind the 3-peer loopback swarm's
decode gap to local transformers (docs/benchmarks.md).

In a pipeline of peers on one machine, each peer waits about two thirds of every token for the
others. This measures, in one run, each of two things done back to back and after such a gap:
1. one decode step through 10 layers of the default model (fp32, KV cache), on one thread, on all
   of them, and on all kept warm: the machine header of every bench script (bench_machine.py);
2. a loopback TCP round trip of one token's hidden state (2304 bytes) between two processes.

    python scripts/bench_idle_gaps.py [--gap-ms 25] [--steps 40]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import asyncio
import multiprocessing
import statistics
import time

import uvloop


PAYLOAD = 576 * 4


def _echo_server(port: int) -> None:
    async def serve():
        async def handle(reader, writer):
            try:
                while True:
                    writer.write(await reader.readexactly(PAYLOAD))
            except asyncio.IncompleteReadError:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    uvloop.run(serve())


async def round_trips(port: int, gap: float, count: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    message, times = b"x" * PAYLOAD, []
    for _ in range(count):
        if gap:
            time.sleep(gap)  # the whole process idles, as a waiting peer does
        t0 = time.perf_counter()
        writer.write(message)
        await reader.readexactly(PAYLOAD)
        times.append(time.perf_counter() - t0)
    writer.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gap-ms", type=float, default=25.0, help="idle time before each step")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--port", type=int, default=39123)
    args = parser.parse_args()
    gap = args.gap_ms / 1000
    print(machine_header(gap), flush=True)
    server = multiprocessing.Process(target=_echo_server, args=(args.port,), daemon=True)
    server.start()
    time.sleep(1.0)
    try:
        busy = uvloop.run(round_trips(args.port, 0, 5 * args.steps))
        idle = uvloop.run(round_trips(args.port, gap, args.steps))
    finally:
        server.terminate()
    print(f"loopback round trip, {PAYLOAD} bytes: back to back {busy * 1e6:.0f} us, after {args.gap_ms:.0f} ms idle "
          f"{idle * 1e6:.0f} us ({idle / busy:.1f}x)")


if __name__ == "__main__":
    main()
