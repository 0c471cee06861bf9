"""Greedy next tokens of the sessions that want one at the same moment, as one head computation.

A client running many sessions releases a cohort's members together (client/generate/lockstep.py); each
would then run the LM head on its own, a matrix-vector product over the whole vocabulary each.
Requests made in the same turn of the event loop are answered together instead: one final norm
and one float32 matrix product for all of them, which also sends their next steps to the first
peer together, to be batched there.
Fewer than BATCHED_ROWS requests go through the float16 screen one by one, which costs less then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from p2pfusion.client.generate.screen import ScreenedHead


BATCHED_ROWS = 4  # from this many rows, one float32 product costs less than screening each (docs/benchmarks.md)


class HeadBatcher:
    def __init__(
        self,
        screen: ScreenedHead,
        norm: Callable[[torch.Tensor], torch.Tensor],
        exact: Callable[[torch.Tensor], int],
    ):
        self.screen = screen
        self.norm = norm  # hidden states [rows, 1, hidden] -> the final norm's output
        self.exact = exact  # the full float32 head's greedy token for one [1, 1, hidden]
        self._waiting: list[tuple[torch.Tensor, asyncio.Future]] = []

    async def next_token(self, last: torch.Tensor) -> int:
        """The greedy token after `last` [1, 1, hidden], the last position's hidden states."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((last, future))
        if len(self._waiting) == 1:
            asyncio.get_running_loop().call_soon(self._answer)
        return await future

    @torch.inference_mode()
    def _answer(self) -> None:
        waiting, self._waiting = self._waiting, []
        live = [(last, future) for last, future in waiting if not future.cancelled()]
        if not live:
            return
        try:
            normed = self.norm(torch.cat([last for last, _ in live]))[:, -1]
            if len(live) < BATCHED_ROWS:
                tokens = [self.screen.next_token(row) for row in normed]
            else:
                tokens = self.screen.next_tokens(normed)
            answers = [self.exact(last) if token is None else token for (last, _), token in zip(live, tokens)]
        except Exception as exc:  # not ours to judge: each waiting session raises it as its own
            for _, future in live:
                future.set_exception(exc)
            return
        for (_, future), token in zip(live, answers):
            future.set_result(token)
