"""How a peer runs its one-token steps on a CPU: how many threads, and whether to keep them warm.

A stage in a pipeline idles while the other stages compute, for most of every token. On some
machines a thread that has slept costs more to wake than its step costs: on one Intel VM a step
through 10 layers took 10.0 ms on two threads back to back but 41.6 ms after 50 ms idle, against
16.5 and 19.2 ms on one thread. So what counts is a step's time after such a gap, measured for
each option where the peer runs; a step back to back only breaks ties under many users, when steps
do follow each other. Keeping threads warm (spinning through the gap) costs cores that other
stages or the volunteer's own work may need, so it is chosen only where it clearly wins.
"""

from __future__ import annotations

from dataclasses import dataclass

MARGIN = 0.1  # a costlier option must be this much faster to be chosen: timings on a shared machine wobble
WARM_MARGIN = 0.25  # spinning through every gap costs cores, so it must win by more


@dataclass(frozen=True)
class StepCost:
    """Measured seconds of one one-token step with one setting."""

    threads: int
    warm: bool  # the threads were kept spinning through the idle gap before the step
    back_to_back: float
    after_idle: float

    def describe(self) -> str:
        setting = f"{self.threads} thread{'s' if self.threads > 1 else ''}{' warm' if self.warm else ''}"
        return f"{setting} {self.back_to_back * 1000:.2f} / {self.after_idle * 1000:.2f} ms"


@dataclass(frozen=True)
class DecodeSettings:
    threads: int
    warm: bool

    def describe(self) -> str:
        return f"{self.threads} thread{'s' if self.threads > 1 else ''}" + (", kept warm between steps" if self.warm else "")


def _price(cost: StepCost) -> tuple[bool, int]:
    """What an option costs the machine besides its time: spinning first, then threads."""
    return cost.warm, cost.threads


def choose_decode_settings(costs: list[StepCost]) -> DecodeSettings:
    """The cheapest option whose step after an idle gap is within its margin of the fastest one's.

    Options are compared after idle because that is how a pipeline's steps arrive; an option that
    costs more (more threads, or warm) must beat the cheaper choice by MARGIN (WARM_MARGIN for
    warm), or match it after idle and beat it by MARGIN back to back.
    """
    if not costs:
        raise ValueError("no step costs to choose from")
    chosen = min(costs, key=_price)
    for cost in sorted(costs, key=_price):
        margin = WARM_MARGIN if cost.warm and not chosen.warm else MARGIN
        if cost.after_idle < (1 - margin) * chosen.after_idle:
            chosen = cost
        elif not cost.warm and cost.after_idle <= chosen.after_idle and cost.back_to_back < (1 - margin) * chosen.back_to_back:
            # as fast after idle, and clearly faster when steps follow each other (spinning
            # changes nothing then, so it is never chosen for that)
            chosen = cost
    return DecodeSettings(chosen.threads, chosen.warm)


def thread_options(all_threads: int) -> list[int]:
    """1, 2, 4, ... up to all of this process's threads, and all of them."""
    options, threads = [], 1
    while threads < all_threads:
        options.append(threads)
        threads *= 2
    return options + [all_threads]



def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def shares_host(mine: list[str], others: list[list[str]]) -> bool:
    """Whether another peer announces a direct address (host:port) on one of this peer's hosts.
    Such peers compute on the same cores, where a spinning peer takes them from the others (decode
    0.47x of local with three warm peers on 2 cores, docs/benchmarks.md). Peers behind one NAT look
    alike too; they merely lose the spin."""
    hosts = {_host(address) for address in mine}
    return any(_host(address) in hosts for addresses in others for address in addresses)
