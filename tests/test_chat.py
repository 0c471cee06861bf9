"""`p2pfusion chat` through real tiny-model peers: each turn's reply is transformers' greedy reply to
the whole conversation, and a turn sends the peers only the tokens after those they already hold."""

import asyncio
import io

import pytest
import torch
import uvloop
from transformers import AutoTokenizer

from p2pfusion.cli.chat import Chat, run_chat
from p2pfusion.cli.commands import client_model
from p2pfusion.cli.main import build_parser
from p2pfusion.client.loop import BackgroundLoop
from tests.conftest import reference_model
from tests.swarm import peers_in_background
from tests.forked_cli import forked_async
from tests.tiny_chat import with_chat_tokenizer

REPLY = 8  # tokens per reply at most


@pytest.fixture(scope="module")
def chat_swarm(tiny_models, tmp_path_factory):
    source = with_chat_tokenizer(tiny_models["llama"], tmp_path_factory.mktemp("chat") / "tiny-chat")
    with peers_in_background(source, [(0, 2), (2, 4)]) as (peers, maddrs, _):
        yield source, peers, maddrs


@pytest.fixture
def chat(chat_swarm):
    source, _, maddrs = chat_swarm
    # one token per step, so the peers' token counts below are the conversation's own (drafts that
    # fall would add theirs: tests/test_speculative.py checks a session's caches with drafts)
    args = build_parser().parse_args(
        ["chat", "--model", str(source.folder), "--initial-peers", maddrs[0], "--speculate", "off"]
    )
    loop = BackgroundLoop("test-chat")
    model = loop.run(client_model(args))  # joined, as `p2pfusion chat` builds it
    session = Chat(model, loop, REPLY)
    try:
        yield session
    finally:
        loop.run(session.conversation.close())
        loop.run(model.core.leave())
        loop.close()


def _counters(peers) -> list[tuple[int, int]]:
    return [(peer.server.sessions_opened, peer.server.tokens_done) for peer in peers]


def _greedy(source, tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The conversation's tokens and transformers' greedy reply to it."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = reference_model(source).generate(torch.tensor([ids]), max_new_tokens=REPLY, do_sample=False)
    return ids, out[0, len(ids):].tolist()


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_second_turn_sends_only_new_tokens_and_matches_transformers(chat_swarm, chat):
    source, peers, _ = chat_swarm
    tokenizer = chat.model.tokenizer
    before = _counters(peers)
    first = chat.say("hello", lambda token: None)
    second = chat.say("and then?", lambda token: None)

    ids1, ref1 = _greedy(source, tokenizer, [_user("hello")])
    reply1 = tokenizer.decode(ref1, skip_special_tokens=True)
    conversation = [_user("hello"), {"role": "assistant", "content": reply1}, _user("and then?")]
    ids2, ref2 = _greedy(source, tokenizer, conversation)
    assert first.token_ids == ref1
    assert second.token_ids == ref2
    # turn 2's tokens extend what turn 1 left in the session (its prompt and reply, less the reply's
    # last token, which was never sent), so turn 2 sent only the rest
    assert ids2[:len(ids1) + len(ref1) - 1] == ids1 + ref1[:-1]
    assert chat.conversation.tokens == ids2 + ref2[:-1]
    for (sessions, tokens), after in zip(before, _counters(peers)):
        assert after == (sessions + 1, tokens + len(ids2) + len(ref2) - 1)  # one session; each token once


def test_a_stopped_reply_keeps_the_session(chat_swarm, chat):
    """What Ctrl-C does during a reply: the stop comes while the next token is computed, and that
    token never shows (nothing appears after ^C); the reply is what was shown, and the chat goes on
    in the same session."""
    source, peers, _ = chat_swarm
    tokenizer = chat.model.tokenizer
    before = _counters(peers)
    seen = []

    def interrupt_after_three(token: int) -> None:
        seen.append(token)
        if len(seen) == 3:  # as Ctrl-C would: once this token is shown, while the next is on its way
            asyncio.get_running_loop().call_soon(chat.stopping.set)

    first = chat.say("tell me a story", interrupt_after_three)
    second = chat.say("go on", lambda token: None)
    _, ref1 = _greedy(source, tokenizer, [_user("tell me a story")])
    assert seen == first.token_ids == ref1[:3]
    stopped = {"role": "assistant", "content": tokenizer.decode(ref1[:3], skip_special_tokens=True)}
    _, ref2 = _greedy(source, tokenizer, [_user("tell me a story"), stopped, _user("go on")])
    assert second.token_ids == ref2
    assert [after[0] - sessions for (sessions, _), after in zip(before, _counters(peers))] == [1, 1]


def test_commands_and_the_length_limit(chat_swarm, chat, capsys):
    source, peers, _ = chat_swarm
    tokenizer = chat.model.tokenizer
    limit = reference_model(source).config.max_position_embeddings
    empty = tokenizer.apply_chat_template([_user("")], add_generation_prompt=True, tokenize=True, return_dict=False)
    overhead = len(empty)
    long_message = "a" * (limit - 1 - overhead)  # a prompt one token short of the limit: room for one reply token
    before = _counters(peers)
    out = io.StringIO()
    run_chat(chat, ["hi", "/reset", "", "/nope", long_message, "more", "/reset", "hi", "/exit", "never read"], out)

    _, reply = _greedy(source, tokenizer, [_user("hi")])
    text = tokenizer.decode(reply, skip_special_tokens=True)
    _, last = _greedy(source, tokenizer, [_user(long_message)])
    at_limit = tokenizer.decode(last[:1], skip_special_tokens=True)
    assert out.getvalue() == f"{text}\n{at_limit}\n{text}\n"
    err = capsys.readouterr().err
    assert "unknown command /nope" in err
    assert f"the conversation reached the {limit} tokens the swarm accepts; /reset starts a new one" in err
    assert f"the swarm accepts {limit}; /reset starts a new conversation" in err  # "more" did not fit
    assert [after[0] - sessions for (sessions, _), after in zip(before, _counters(peers))] == [3, 3]  # one per /reset


def test_chat_command_reads_stdin_until_eof(chat_swarm, forks):
    source, _, maddrs = chat_swarm
    argv = ["chat", "--initial-peers", maddrs[0], "--model", str(source.folder), "--max-new-tokens", str(REPLY)]
    done = uvloop.run(forked_async(forks, argv, "hello\n\n  \nhello\n"))
    code, out, err = done.returncode, done.stdout, done.stderr
    assert code == 0, err
    assert "Traceback" not in err
    assert "connecting to the swarm" in err.splitlines()[0]
    assert "\r" not in err and "%|" not in err  # no progress bars in a redirected log
    tokenizer = AutoTokenizer.from_pretrained(source.folder)
    _, reply = _greedy(source, tokenizer, [_user("hello")])
    text = tokenizer.decode(reply, skip_special_tokens=True)
    _, second = _greedy(source, tokenizer, [_user("hello"), {"role": "assistant", "content": text}, _user("hello")])
    assert out == f"{text}\n{tokenizer.decode(second, skip_special_tokens=True)}\n"
