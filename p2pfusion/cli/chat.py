"""`p2pfusion chat`: a multi-turn chat in the terminal through one warm swarm session.

Each turn renders the whole conversation with the model's chat template; a `Conversation`
(client/generate/causal_lm.py) keeps the session open between turns, so the peers keep the earlier turns'
KV caches and a turn sends only its new tokens. Replies stream to stdout; notices go to stderr.

The chat runs on the main thread and the swarm on a loop thread of its own, so `input()` keeps its
line editing and Ctrl-C reaches the main thread: during a reply it asks the generation to stop
before the next token shows, which leaves the session consistent for the next turn.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TextIO

import torch

from p2pfusion.cli.commands import StreamingDecoder, client_model, holds
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.generate.conversation import Conversation, Generated
from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.errors import RequestError

log = logging.getLogger("p2pfusion")

HELP = "type a message; /reset starts over, /exit or Ctrl-D ends the chat, Ctrl-C stops a reply"


class Chat:
    """The messages so far and the session that holds them."""

    def __init__(
        self,
        model: RemoteCausalLM,
        loop: BackgroundLoop,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        system: str | None = None,
        hold: bool = False,
    ):
        self.model = model
        self.loop = loop
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.system = system
        self.hold = hold  # print only text whose results are checked
        self.conversation = Conversation(model)
        self.messages: list[dict[str, str]] = self._first_messages()
        self.length = 0  # tokens of the conversation so far, the last reply's included
        self.stopping = threading.Event()

    def _first_messages(self) -> list[dict[str, str]]:
        return [] if self.system is None else [{"role": "system", "content": self.system}]

    def reset(self) -> None:
        """Start over; the peers free the old conversation's caches now."""
        self.messages, self.length = self._first_messages(), 0
        self.loop.run(self.conversation.close())

    def say(self, text: str, on_token, on_rewind=None) -> Generated:
        """The assistant's reply to `text`, streamed through `on_token` and corrected through
        `on_rewind` (Conversation.generate; both called on the loop's thread)."""
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = self.model.chat_ids(messages)
        self.stopping.clear()
        reply = self.conversation.generate(
            ids, self.max_new_tokens, self.temperature, self.generator, on_token, stop=self.stopping.is_set,
            on_rewind=on_rewind, hold=self.hold,
        )
        future = asyncio.run_coroutine_threadsafe(reply, self.loop.loop)
        while True:
            try:
                result = future.result()
                break
            except KeyboardInterrupt:
                self.stopping.set()  # the reply ends with the tokens shown so far
        self.messages = [*messages, {"role": "assistant", "content": result.text}]
        self.length = len(ids) + len(result.token_ids)
        return result

    @property
    def at_limit(self) -> bool:
        return self.length >= self.conversation.limit


def run_chat(chat: Chat, lines: Iterable[str], out: TextIO) -> None:
    """The chat's loop: one turn per line of `lines`, until /exit or their end."""
    for line in lines:
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return
        if text == "/reset":
            chat.reset()
            print("(a new conversation)", file=sys.stderr)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]}: {HELP}", file=sys.stderr)
            continue
        decoder = StreamingDecoder(chat.model.tokenizer, out)
        try:
            chat.say(text, decoder.push, decoder.rewind)
        except RequestError as exc:
            print(f"p2pfusion: {exc}; /reset starts a new conversation", file=sys.stderr)
            continue
        decoder.finish()
        if chat.at_limit:
            print(
                f"p2pfusion: the conversation reached the {chat.conversation.limit} tokens the swarm accepts; "
                "/reset starts a new one",
                file=sys.stderr,
            )


def _terminal_lines() -> Iterator[str]:
    if not sys.stdin.isatty():
        yield from sys.stdin
        return
    import readline  # noqa: F401  (line editing and history for input(); only on a terminal)

    prompt = "> " if sys.stdout.isatty() else ""
    while True:
        try:
            yield input(prompt)
        except EOFError:
            print(file=sys.stderr)
            return


def chat(args, started: float) -> None:
    """`started`: when the command started (perf_counter), for the progress lines."""
    loop = BackgroundLoop("p2pfusion-chat")
    try:
        model = loop.run(client_model(args))
        try:
            model.require_chat_template()
        except BaseException:
            loop.run(model.core.leave())
            raise
        log.info("loaded %s in %.1f s", model.source.name, time.perf_counter() - started)
        session = Chat(
            model, loop, args.max_new_tokens, args.temperature, args.seed, args.system, holds(args, sys.stdout)
        )
        try:
            if sys.stdin.isatty():
                print(HELP, file=sys.stderr)
            run_chat(session, _terminal_lines(), sys.stdout)
        finally:
            loop.run(session.conversation.close())
            loop.run(model.core.leave())
    finally:
        loop.close()
