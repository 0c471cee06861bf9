"""The web page of `p2pfusion api`, driven in Debian's chromium against real peer processes of a tiny
chat model: the chat streams transformers' greedy reply into the page turn after turn, the dashboard
lists the live peers, and a peer killed with SIGKILL (its DHT record still unexpired) is gone from
the dashboard within its refresh period."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.survey import SNAPSHOT_TTL
from p2pfusion.models.source import ModelSource
from tests.api_process import api_url, launch_api
from tests.conftest import reference_model
from tests.tiny_chat import with_chat_tokenizer

CHROMIUM = "/usr/bin/chromium"
KEY = "web-test-key"
REPLY = 8  # tokens per reply at most
PEER_OPTIONS = ["--throughput", "100"]  # no benchmark: the peers start sooner
SWARM_PERIOD = 2.0  # the dashboard's refresh period (SWARM_PERIOD_MS in static/app.js)
MARGIN = 2.0  # a refresh's own time on a busy 2-core machine, and the test's polling


@dataclass
class Site:
    source: ModelSource
    url: str
    browser: object
    swarm: LocalSwarm
    peers: list[subprocess.Popen]
    peer_ids: list[str]
    shots: Path


def _get(url: str, key: str | None = KEY) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


@pytest.fixture(scope="module")
def site(tiny_models, tmp_path_factory, forks):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: the web page's tests drive Debian's chromium (`make setup` installs it)")
    from playwright.sync_api import sync_playwright

    work = tmp_path_factory.mktemp("web")
    source = with_chat_tokenizer(tiny_models["llama"], work / "tiny-chat")
    with LocalSwarm(model=str(source.folder), forks=forks) as swarm:
        first = swarm.launch((0, 2), PEER_OPTIONS)
        swarm.wait_ready(first)
        second = swarm.launch((2, 4), PEER_OPTIONS)
        log = work / "api.log"  # the API loads its model while the second peer loads its layers
        api = launch_api(["--model", str(source.folder), "--initial-peers", swarm.maddrs[0], "--api-key", KEY], log, forks)
        try:
            second_maddrs = swarm.wait_ready(second)
            url = api_url(api, log)
            peer_ids = [m.rsplit("/p2p/", 1)[1] for m in (swarm.maddrs[0], second_maddrs[0])]
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(
                    executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
                )
                try:
                    yield Site(source, url, browser, swarm, [first, second], peer_ids, work)
                finally:
                    browser.close()
        finally:
            api.terminate()
            api.wait(30)


def _greedy(source: ModelSource, messages: list[dict]) -> str:
    """transformers' greedy reply to the conversation, as text."""
    tokenizer = AutoTokenizer.from_pretrained(source.folder)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = reference_model(source).generate(torch.tensor([ids]), max_new_tokens=REPLY, do_sample=False)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


# every length the newest reply's text had in the page, to tell a streamed reply from one set at once
WATCH_REPLIES = """() => {
  window.replyLengths = [];
  new MutationObserver(() => {
    const replies = document.querySelectorAll('.msg.assistant .text');
    if (replies.length) window.replyLengths.push(replies[replies.length - 1].textContent.length);
  }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
}"""


def _say(page, text: str, turn: int) -> str:
    page.evaluate(WATCH_REPLIES)
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_selector(f".msg.assistant:nth-child({2 * turn + 1})[data-done]", timeout=60_000)
    grew = [n for n in page.evaluate("window.replyLengths") if n > 0]
    assert len(set(grew)) > 1, f"the reply did not come piece by piece: lengths {grew}"
    reply = page.locator(".msg.assistant").nth(turn - 1)
    assert reply.locator(".error").count() == 0, reply.text_content()
    return reply.locator(".text").text_content()


def test_chat_asks_for_the_key_and_streams_the_greedy_reply_turn_after_turn(site):
    context = site.browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    try:
        page.goto(site.url + "/")
        # the API has a key: the page says so, and works once it is given
        page.wait_for_selector("#key-form.needed")
        page.fill("#api-key", KEY)
        page.click("#key-form button")
        page.wait_for_selector("#model option", state="attached")
        assert page.eval_on_selector_all("#model option", "options => options.map(o => o.value)") == ["tiny-chat"]
        assert page.evaluate("localStorage.getItem('p2pfusion.apiKey')") == KEY
        page.fill("#max-tokens", str(REPLY))

        first = _say(page, "hello", 1)
        assert first == _greedy(site.source, [{"role": "user", "content": "hello"}])
        second = _say(page, "and then?", 2)
        conversation = [
            {"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
            {"role": "user", "content": "and then?"},
        ]
        assert second == _greedy(site.source, conversation)
        stats = page.locator(".msg.assistant .meta").nth(1).text_content()
        assert re.fullmatch(r"\d+ tokens? in [\d.]+ s( · [\d.]+ tokens/s)?", stats), stats
        page.screenshot(path=site.shots / "chat.png")
        assert (site.shots / "chat.png").stat().st_size > 0
    finally:
        context.close()


def _rows(page) -> list[dict]:
    return page.eval_on_selector_all("tr[data-peer-id]", """rows => rows.map(r => ({
        id: r.dataset.peerId, state: r.querySelector('.state').textContent, layers: r.children[1].textContent}))""")


def test_dashboard_lists_the_live_peers_and_marks_a_killed_one_within_a_refresh(site):
    assert _get(f"{site.url}/v1/swarm", key=None)[0] == 401  # it names the peers: the key guards it
    status, body = _get(f"{site.url}/v1/swarm")
    (model,) = body["models"]
    assert status == 200 and (model["model"], model["num_layers"], model["gaps"]) == ("tiny-chat", 4, [])
    assert [(p["peer_id"], p["layers"], p["state"]) for p in model["peers"]] == [
        (site.peer_ids[0], [0, 2], "online"), (site.peer_ids[1], [2, 4], "online"),
    ]
    assert all(p["advertised_tokens_per_s"] > 0 and p["backed_up_by"] == [] for p in model["peers"])
    loads = ("sessions", "queued", "cache_used", "cache_total")
    assert all(type(p[load]) is int for p in model["peers"] for load in loads)

    context = site.browser.new_context(viewport={"width": 1280, "height": 800})
    context.add_init_script(f"localStorage.setItem('p2pfusion.apiKey', {json.dumps(KEY)})")
    page = context.new_page()
    try:
        page.goto(site.url + "/swarm")
        page.wait_for_function("document.querySelectorAll('tr[data-peer-id]').length === 2")
        assert _rows(page) == [
            {"id": site.peer_ids[0], "state": "online", "layers": "0:2"},
            {"id": site.peer_ids[1], "state": "online", "layers": "2:4"},
        ]
        assert page.locator(".gaps").text_content() == "none"
        assert page.locator(".coverage .layer").count() == 4 and page.locator(".coverage .layer.gap").count() == 0

        site.peers[1].kill()  # SIGKILL: no goodbye, and its record stays in the DHT for up to 30 s
        killed = time.monotonic()
        bound = SWARM_PERIOD + SNAPSHOT_TTL + MARGIN
        page.wait_for_function(
            "document.querySelector('.gaps').textContent === '2:4'", timeout=1000 * (bound + 10)
        )
        seconds = time.monotonic() - killed
        assert seconds < bound, f"the killed peer's layers stayed served on the dashboard {seconds:.1f} s"
        rows = _rows(page)  # while its record lasts, it is listed as what it is: unreachable
        assert rows[0] == {"id": site.peer_ids[0], "state": "online", "layers": "0:2"}
        assert rows[1:] in ([], [{"id": site.peer_ids[1], "state": "unreachable", "layers": "2:4"}]), rows
        if rows[1:]:
            assert "2:4 are claimed by listed peers that do not answer" in page.locator(".unreachable-claims").text_content()
        assert page.locator(".coverage .layer.gap").count() == 2  # layers 2 and 3, in red
        page.screenshot(path=site.shots / "swarm.png", full_page=True)
        assert (site.shots / "swarm.png").stat().st_size > 0
    finally:
        context.close()


NO_SIDEWAYS = "() => document.documentElement.scrollWidth <= window.innerWidth"
TABLE_FITS = "() => [...document.querySelectorAll('.table')].every(t => t.scrollWidth <= t.clientWidth + 1)"


def test_the_page_fits_a_phone_and_wide_screens_and_a_gap_says_what_to_do(site):
    """After the dashboard test, layers 2:4 have no peer. At 360 px nothing scrolls sideways (the
    peers' rows stack, each value named) and a chat's error says what is missing and to send again;
    at 1280 and 1920 px the peers' table fits without scrolling."""
    for width in (1280, 1920, 360):
        context = site.browser.new_context(viewport={"width": width, "height": 780})
        context.add_init_script(f"localStorage.setItem('p2pfusion.apiKey', {json.dumps(KEY)})")
        page = context.new_page()
        try:
            page.goto(site.url + "/swarm")
            page.wait_for_function("document.querySelector('.gaps') && document.querySelector('.gaps').textContent === '2:4'")
            assert page.evaluate(NO_SIDEWAYS), width
            if width == 360:
                labels = page.eval_on_selector_all("tr[data-peer-id] td", "cells => cells.map(c => c.dataset.label)")
                assert labels[:2] == ["state", "layers"] and labels[-1] == "peer"
                peer = page.locator("tr[data-peer-id] td.peer").first.bounding_box()
                assert peer["x"] + peer["width"] <= width  # the peer's column is on screen, not cut off
                page.screenshot(path=site.shots / "swarm-phone.png", full_page=True)
                # once the killed peer's record has expired (a client still routing to it would
                # wait for the swarm to recover first), a request is refused at once
                deadline = time.monotonic() + 60
                while _get(f"{site.url}/v1/models")[1]["data"][0]["coverage"]["gaps"] != [[2, 4]]:
                    assert time.monotonic() < deadline, "the killed peer's record did not expire"
                    time.sleep(1)
                page.click("#tab-chat")
                page.wait_for_selector("#model option", state="attached")
                page.fill("#prompt", "hello")
                page.press("#prompt", "Enter")
                page.wait_for_selector(".msg.assistant[data-done]", timeout=60_000)
                error = page.locator(".msg.assistant .error").text_content()
                assert "2:4" in error and "send the message again" in error and "Swarm tab" in error, error
                assert page.locator(".msg.assistant .text").count() == 0  # no empty bubble above it
                assert page.evaluate(NO_SIDEWAYS)
                page.screenshot(path=site.shots / "chat-phone.png", full_page=True)
            else:
                assert page.evaluate(TABLE_FITS), width
        finally:
            context.close()
