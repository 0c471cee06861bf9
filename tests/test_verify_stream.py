"""Checks beside the generation, on real peers: tokens stream while a check runs, a failed check
withdraws what was shown and the corrected tokens follow, and a check's bar comes from the two
routes compared, not from other records in the swarm."""

import io
import json
import logging
import time

import httpx2
import torch
import uvloop

from p2pfusion.client.checks.policy import WIRE_TOLERANCE
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.generate.swarm_lm import Correction, SwarmLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.formats import WeightFormat
from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import load_head
from p2pfusion.net.compression import Codec
from p2pfusion.cli.commands import StreamingDecoder
from tests.conftest import reference_model
from tests.test_api import _serve_in_process, _stop_server
from p2pfusion.client.loop import BackgroundLoop
from tests.swarm import peers_in_background, running_peers, start_peer, stop_peer
from tests.test_verify import lie, noise
from tests.tiny_chat import char_tokenizer, with_chat_tokenizer

IDS = [3, 17, 42, 99, 5, 250, 7, 1]
PROMPT = "Once upon a time"
NEW = 10
CHECK_SECONDS = 1.5  # how long the slow checking peer takes over a step of several positions


def expected_tokens(source) -> list[int]:
    with torch.no_grad():
        out = reference_model(source).generate(torch.tensor([IDS]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, len(IDS):].tolist()


def slow_on_prefills(peer, ended: list[float]) -> None:
    """The peer's stage takes CHECK_SECONDS over any step of several positions (a check's), and
    notes when each such step ended."""
    stage = peer.server.stage
    honest = stage.forward

    def forward(hidden, *args, **kwargs):
        out = honest(hidden, *args, **kwargs)
        if hidden.shape[1] > 1:
            time.sleep(CHECK_SECONDS)
            ended.append(time.monotonic())
        return out

    stage.forward = forward


async def generate(source, maddrs, hold: bool):
    """Tokens as `on_token` saw them (withdrawn ones dropped at each rewind), with when each came,
    the rewinds' kept counts, and the result."""
    swarm = await join_swarm(maddrs, client_mode=True)
    shown: list[int] = []
    times: list[float] = []
    rewinds: list[tuple[int, int]] = []  # (tokens shown before, tokens kept)

    def on_token(token: int) -> None:
        shown.append(token)
        times.append(time.monotonic())

    def on_rewind(kept: int) -> None:
        rewinds.append((len(shown), kept))
        del shown[kept:], times[kept:]

    try:
        model = RemoteCausalLM.build(source, swarm, compression="none", verify=0.05)
        result = await model.generate(
            IDS, NEW, stop_at_eos=False, decode=False, on_token=on_token, on_rewind=on_rewind, hold=hold
        )
        return shown, times, rewinds, result, model.core.access().distrusted
    finally:
        await swarm.shutdown()


async def stream(source, maddrs):
    """A SwarmLM stream's tokens and text, corrections applied, with the corrections and the result."""
    swarm = await join_swarm(maddrs, client_mode=True)
    try:
        lm = SwarmLM(RemoteCausalLM.build(source, swarm, compression="none", verify=0.05))
        tokens, text, corrections = [], "", []
        async with lm.stream(IDS, NEW, stop_at_eos=False) as pieces:
            async for item in pieces:
                if isinstance(item, Correction):
                    corrections.append(item)
                    del tokens[item.tokens:]
                    text = item.text
                else:
                    tokens.append(item.token_id)
                    text += item.text
        return tokens, text, corrections, pieces.result
    finally:
        await swarm.shutdown()


async def api_stream(source, maddrs, prompt: str, hold: bool) -> tuple[str, int]:
    """The text of a streamed completion from the HTTP API, its corrections applied as the web page
    applies them, and how many came."""
    swarm = await join_swarm(maddrs, client_mode=True)
    lm = SwarmLM(RemoteCausalLM.build(source, swarm, compression="none", verify=0.05))
    http, task, url = await _serve_in_process(lm, None)
    text, corrections = "", 0
    body = {"model": source.name, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "stream": True,
            "hold_until_checked": hold}
    try:
        async with httpx2.AsyncClient(timeout=60) as client:
            async with client.stream("POST", f"{url}/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "correction" in chunk:
                        corrections += 1
                        text = text[:chunk["correction"]["kept_characters"]]
                    else:
                        text += chunk["choices"][0]["text"]
    finally:
        await _stop_server(http, task)
        await swarm.shutdown()
    return text, corrections


def test_tokens_stream_while_checks_run_and_a_failed_check_is_corrected_in_view(tiny_models, tmp_path):
    source = with_chat_tokenizer(tiny_models["llama"], tmp_path / "llama")  # text for the stream

    async def scenario(checker, routed, maddrs):
        ended: list[float] = []
        slow_on_prefills(checker, ended)
        at_once = await generate(source, maddrs, hold=False), list(ended)
        ended.clear()
        held = await generate(source, maddrs, hold=True), list(ended)
        checker.server.stage.forward = checker.server.stage.__class__.forward.__get__(checker.server.stage)
        lie(routed, noise)
        corrected = await generate(source, maddrs, hold=False)
        streamed = await stream(source, maddrs)
        api = [await api_stream(source, maddrs, PROMPT, hold) for hold in (False, True)]
        return at_once, held, corrected, streamed, api

    # two peers serve every layer; the faster-claiming one takes the routes, the other checks them.
    # Each runs on a thread and loop of its own, as a peer process would: the checker's slow steps
    # block only its own loop, never the routed peer's or this client's.
    with peers_in_background(source, [(0, 4)]) as ([checker], maddrs, _):
        routed_loop = BackgroundLoop("routed-peer")
        routed = routed_loop.run(start_peer(source, maddrs, (0, 4), throughput="1000"))
        try:
            at_once, held, corrected, streamed, api = uvloop.run(scenario(checker, routed, maddrs))
        finally:
            routed_loop.run(stop_peer(routed))
            routed_loop.close()
    liar = routed.swarm.peer_id
    expected = expected_tokens(source)

    # by default tokens come as they are chosen: every one, the last included, came while the first
    # check still ran (the check of the rest follows the last token, as every check follows its tokens)
    (shown, times, rewinds, result, _), ended = at_once
    assert shown == result.token_ids == expected and not rewinds and result.rewinds == 0
    assert ended and all(t < ended[0] for t in times)
    # held until checked: none before the first check ended, and still exact
    (shown, times, rewinds, result, _), ended = held
    assert shown == result.token_ids == expected and not rewinds
    assert ended and all(t > ended[0] for t in times)

    # a lie caught after its tokens were shown: they are withdrawn, and the corrected ones follow
    shown, _, rewinds, result, distrusted = corrected
    assert result.rewinds >= 1 and rewinds and all(kept < before for before, kept in rewinds)
    assert shown == result.token_ids == expected and distrusted == {liar}
    tokens, text, corrections, result = streamed
    assert corrections and tokens == result.token_ids == expected
    assert result.text.startswith(text) and text
    # the HTTP API: a correction chunk, applied, gives the honest text; held, no correction comes
    ids = list(char_tokenizer(256)(PROMPT)["input_ids"])
    with torch.no_grad():
        out = reference_model(source).generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
    honest = char_tokenizer(256).decode(out[0, len(ids):], skip_special_tokens=True)
    (text, corrections), (held_text, held_corrections) = api
    assert text == honest and corrections >= 1
    assert held_text == honest and held_corrections == 0


def test_the_terminal_shows_a_correction_and_prints_the_text_that_stands_again(capsys):
    tokenizer = char_tokenizer(256)
    out = io.StringIO()
    decoder = StreamingDecoder(tokenizer, out)
    for token in tokenizer("hello wor")["input_ids"]:
        decoder.push(token)
    decoder.rewind(6)  # "hello " stands
    for token in tokenizer("there")["input_ids"]:
        decoder.push(token)
    decoder.finish()
    assert out.getvalue() == "hello wor\nhello there\n"
    assert "failed verification" in capsys.readouterr().err


def test_a_peer_that_computes_int4_and_claims_float32_is_caught_beside_an_honest_int4_record(tiny_models):
    """The bar of a check is the two compared routes' own: another peer's int4 record (honest, on
    layers no route here takes) would have widened it to int4's for every check."""
    source = tiny_models["llama"]

    async def scenario():
        async with running_peers(source, [(0, 2), (2, 4)]) as (_, maddrs):
            liar = await start_peer(source, maddrs, (0, 2), throughput="1000", quant=WeightFormat.INT4)
            # too slow for any route to take: an int4 hop on the route would change the tokens honestly
            elsewhere = await start_peer(source, maddrs, (3, 4), throughput="0.1", quant=WeightFormat.INT4)
            try:
                await liar.announce(weights="float32")
                result = await generate(source, maddrs, hold=False)
            finally:
                await stop_peer(elsewhere)
                await stop_peer(liar)
        return liar.swarm.peer_id, result

    liar, (shown, _, _, result, distrusted) = uvloop.run(scenario())
    assert distrusted == {liar} and result.rewinds >= 1
    assert shown == result.token_ids == expected_tokens(source)


def test_a_checked_forward_pass_is_computed_again_without_the_liar(tiny_models):
    source = tiny_models["llama"]
    batch = torch.tensor([IDS, IDS[::-1]])

    async def scenario():
        async with running_peers(source, [(0, 4)]) as (_, maddrs):
            liar = await start_peer(source, maddrs, (0, 4), throughput="1000")
            lie(liar, noise)
            swarm = await join_swarm(maddrs, client_mode=True)
            try:
                model = RemoteCausalLM.build(source, swarm, compression="none", verify=1.0)
                logits = await model.forward_logits(batch)
                return liar.swarm.peer_id, logits, model.core.access().distrusted
            finally:
                await swarm.shutdown()
                await stop_peer(liar)

    liar, logits, distrusted = uvloop.run(scenario())
    with torch.no_grad():
        expected = reference_model(source)(batch).logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert distrusted == {liar}


def nudge_to_flip(head, factor: float = 1.01):
    """The least change to a decode step's output that makes `head` choose another greedy token
    (times `factor`: under 1, the second token's odds come up to just under the first's)."""

    def corrupt(out: torch.Tensor) -> torch.Tensor:
        if out.shape[1] != 1:
            return out
        with torch.enable_grad():
            h = out[0, -1].detach().float().clone().requires_grad_(True)
            logits = head(inputs_embeds=h[None, None]).logits[0, -1]
            first, second = logits.topk(2).indices
            (logits[second] - logits[first]).backward()
        direction = h.grad / h.grad.norm()
        h = h.detach()
        low, high = 0.0, float(h.norm())
        with torch.no_grad():
            for _ in range(30):
                middle = (low + high) / 2
                flipped = int(head(inputs_embeds=(h + middle * direction)[None, None]).logits[0, -1].argmax()) != int(first)
                low, high = (low, middle) if flipped else (middle, high)
        nudged = out.clone()
        nudged[0, -1] = (h + factor * high * direction).to(out.dtype)
        return nudged

    return corrupt


async def a_nudging_liar(source, corrupt, compression: str = "none", **options):
    """Two peers of one stage (`options`: their format), the faster one a liar from the second
    generation on: (the liar's id, an honest generation, a checked one, and the peers the
    checking client avoids and distrusts after it)."""

    async def generate_with(maddrs, verify: float):
        swarm = await join_swarm(maddrs, client_mode=True)
        try:
            model = RemoteCausalLM.build(source, swarm, compression=compression, verify=verify)
            result = await model.generate(IDS, NEW, stop_at_eos=False, decode=False)
            avoided = model.core.health.banned(await model.core.access().records(0))
            return result, (avoided, set(model.core.access().distrusted))
        finally:
            await swarm.shutdown()

    async with running_peers(source, [(0, 4)], **options) as (_, maddrs):
        liar = await start_peer(source, maddrs, (0, 4), throughput="1000", **options)
        try:
            honest, _ = await generate_with(maddrs, 0.0)
            lie(liar, corrupt)
            result, avoided = await generate_with(maddrs, 1.0)
        finally:
            await stop_peer(liar)
    return liar.swarm.peer_id, honest, result, avoided


def test_a_change_under_the_bar_that_flips_a_token_is_replayed_and_caught(tiny_models, caplog):
    """Between bfloat16 peers the bar is 0.2; a liar nudging each decode step just enough to flip
    the greedy token stays under it, and only the tokens the client's head reads tell."""
    source = tiny_models["llama"]
    caplog.set_level(logging.INFO, logger="p2pfusion")
    liar, honest, result, (avoided, _) = uvloop.run(
        a_nudging_liar(source, nudge_to_flip(load_head(source)), dtype=torch.bfloat16))
    assert any("in the token chosen" in r.getMessage() for r in caplog.records)
    # it nudges decode steps only, so replaying the range as one prefill does not repeat it: its
    # tokens are undone and its route avoided for a while, but it is not named
    assert result.token_ids == honest.token_ids and result.rewinds >= 1 and liar in avoided


def sharpened(source, folder):
    """The tiny model with its final norm scaled up 100 times: next-token distributions as peaked
    as a trained model's, where moving the odds moves real probability."""
    model = reference_model(source)
    with torch.no_grad():
        model.model.norm.weight.mul_(100)
    model.save_pretrained(folder)
    return resolve_model(str(folder))


def test_odds_moved_under_the_bar_without_changing_the_greedy_token_are_caught(tiny_models, tmp_path, caplog):
    """Between int8 peers the states' bar is 0.3. A liar that brings the second token's odds up to
    just under the first's at each decode step stays far under it and changes no greedy token, but
    a sampled reply would follow its odds: the next-token distributions the client's head reads
    from both routes tell (total variation over the formats' bar). It replays honestly, so its
    tokens are undone and its route avoided for a while."""
    source = sharpened(tiny_models["llama"], tmp_path)
    caplog.set_level(logging.INFO, logger="p2pfusion")
    corrupt = nudge_to_flip(load_head(source), factor=0.97)
    liar, honest, result, (avoided, _) = uvloop.run(a_nudging_liar(source, corrupt, quant=WeightFormat.INT8))
    assert any("in the token chosen or its probability" in r.getMessage() for r in caplog.records)
    assert result.token_ids == honest.token_ids and result.rewinds >= 1 and liar in avoided


def test_under_auto_compression_the_bar_is_that_of_the_codecs_the_receipts_name(tiny_models):
    """`auto` may send float16 on a slow link, so without knowing better a check's bar is float16's
    (2e-2), and a replay that differs from the route's states by less passes for rounding. On
    loopback every hop's receipt says it sent float32: the bar is float32's, and nudges that flip
    a token while staying far under 2e-2 are caught and undone. The liar replays honestly, and its
    own receipts of the session, held to float32's bar, name it."""
    source = tiny_models["llama"]
    head = load_head(source)
    sizes: list[float] = []
    nudge = nudge_to_flip(head)

    def measured(out: torch.Tensor) -> torch.Tensor:
        """Nudges only the steps where a flip costs under half of float16's bar."""
        nudged = nudge(out)
        size = float((nudged - out).norm() / out.norm())
        if nudged is out or size >= WIRE_TOLERANCE[Codec.FLOAT16] / 2:
            return out
        sizes.append(size)
        return nudged

    liar, honest, result, (_, distrusted) = uvloop.run(a_nudging_liar(source, measured, compression="auto"))
    assert sizes
    assert result.token_ids == honest.token_ids and result.rewinds >= 1 and distrusted == {liar}
