// The page served by `p2pfusion api`: a chat streamed from /v1/chat/completions and a live view of
// the swarm from /v1/swarm. No framework and nothing fetched from elsewhere: it runs offline.
"use strict";

const KEY_STORE = "p2pfusion.apiKey";
const SWARM_PERIOD_MS = 2000;

const $ = (id) => document.getElementById(id);
const chat = { history: [], controller: null };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
}

// --- the API key: kept in this browser only, sent as a bearer token --------------------------------

function authHeaders(extra = {}) {
  const key = localStorage.getItem(KEY_STORE);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

function needKey(message) {
  $("key-form").classList.add("needed");
  showNotice(message || "This API needs a key: enter it at the top right.");
}

function showNotice(message) {
  $("notice").textContent = message;
  $("notice").hidden = !message;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || body.detail || JSON.stringify(body);
  } catch (_) {
    return `${response.status} ${response.statusText}`;
  }
}

// What went wrong with a request, and what the user can do about it.
async function failure(response) {
  const message = await errorText(response);
  if (response.status === 503) {
    const wait = response.headers.get("Retry-After");
    return `${message}. The swarm cannot answer now: send the message again${wait ? ` in ${wait} s` : " in a moment"}, ` +
      "or see the Swarm tab for the layers no peer serves.";
  }
  if (response.status === 429) return `${message}.`;
  return message;
}

// --- views -----------------------------------------------------------------------------------------

function show(view, push) {
  for (const name of ["chat", "swarm"]) {
    $(`view-${name}`).hidden = name !== view;
    $(`tab-${name}`).classList.toggle("active", name === view);
  }
  if (push) history.pushState({ view }, "", view === "swarm" ? "/swarm" : "/");
  if (view === "swarm") pollSwarm();
  else $("prompt").focus();
}

// --- chat ------------------------------------------------------------------------------------------

async function loadModels() {
  const response = await fetch("/v1/models", { headers: authHeaders() });
  if (response.status === 401) return needKey(await errorText(response));
  if (!response.ok) return showNotice(`cannot list the models: ${await errorText(response)}`);
  const select = $("model");
  const chosen = select.value;
  select.replaceChildren(...(await response.json()).data.map((m) => el("option", { value: m.id, text: m.id })));
  if (chosen) select.value = chosen;
  showNotice("");
}

function addMessage(role, text) {
  $("empty").hidden = true;
  const box = el("div", { class: `msg ${role}` }, el("div", { class: "who", text: role }), el("div", { class: "text", text }));
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("prompt").disabled = on;
}

// Server-sent events from a fetch body: lines end with \r\n, \n or \r; an empty line ends an event.
async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
    // a last \r may be the first half of a \r\n: it waits for the next chunk
    const cut = !done && buffer.endsWith("\r") ? buffer.length - 1 : buffer.length;
    const lines = buffer.slice(0, cut).split(/\r\n|\n|\r/);
    buffer = done ? "" : lines.pop() + buffer.slice(cut); // the line still coming
    for (const line of lines) {
      if (line === "") {
        if (data.length) yield data.join("\n");
        data = [];
      } else if (line.startsWith("data:")) {
        data.push(line.slice(line[5] === " " ? 6 : 5));
      }
    }
    if (done) {
      if (data.length) yield data.join("\n");
      return;
    }
  }
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value;
  if (!prompt.trim() || chat.controller) return;
  $("prompt").value = "";
  const history = chat.history; // "New chat" meanwhile starts another, which this reply stays out of
  history.push({ role: "user", content: prompt });
  const asked = addMessage("user", prompt);
  const box = addMessage("assistant", "");
  const text = box.querySelector(".text");
  box.dataset.streaming = "true";
  busy(true);
  chat.controller = new AbortController();
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...history] : [...history];
  const started = performance.now();
  let first = null; // when the first piece of text came
  let usage = null;
  let note = "";
  let corrections = 0;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: authHeaders({ "Content-Type": "application/json", Accept: "text/event-stream" }),
      body: JSON.stringify({
        model: $("model").value, messages, stream: true, stream_options: { include_usage: true },
        temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
      }),
      signal: chat.controller.signal,
    });
    if (response.status === 401) needKey(await errorText(response));
    if (!response.ok) throw new Error(await failure(response));
    for await (const data of sseEvents(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      if (chunk.correction) {
        // verification found the results behind the end of this reply wrong: it goes, corrected text follows
        text.textContent = text.textContent.slice(0, chunk.correction.kept_characters);
        corrections += 1;
        continue;
      }
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        text.textContent += delta.content;
        if (first === null) first = performance.now();
        box.scrollIntoView({ block: "end" });
      }
    }
    note = replyStats(started, first, performance.now(), usage);
    if (corrections) {
      const times = corrections === 1 ? "once" : `${corrections} times`;
      box.append(el("div", { class: "meta warning", text: `corrected ${times}: a peer's results failed verification, and the text after that point was computed again` }));
    }
  } catch (error) {
    if (error.name === "AbortError") note = "stopped";
    else {
      if (!text.textContent) text.remove(); // no empty bubble above the error
      box.append(el("div", { class: "meta error", text: String(error.message || error) }));
    }
  } finally {
    chat.controller = null;
    delete box.dataset.streaming;
    box.dataset.done = "true";
    if (note) box.append(el("div", { class: "meta", text: note }));
    // a stopped reply stays in the conversation as far as it went, as in a terminal chat
    if (text.textContent) history.push({ role: "assistant", content: text.textContent });
    else {
      history.pop(); // no answer: the question leaves the conversation too, and shows it
      asked.classList.add("unsent");
      asked.title = "not part of the conversation: it got no answer";
    }
    busy(false);
    $("prompt").focus();
  }
}

function replyStats(started, first, ended, usage) {
  const seconds = (ended - started) / 1000;
  if (!usage) return `${seconds.toFixed(1)} s`;
  const n = usage.completion_tokens;
  // tokens after the first, over the time after it: the rate of generation, the prompt's prefill aside
  const rate = first !== null && n > 1 && ended > first ? ` · ${((n - 1) / ((ended - first) / 1000)).toFixed(1)} tokens/s` : "";
  return `${n} token${n === 1 ? "" : "s"} in ${seconds.toFixed(1)} s${rate}`;
}

function newChat() {
  if (chat.controller) chat.controller.abort();
  chat.history = [];
  $("messages").replaceChildren($("empty"));
  $("empty").hidden = false;
}

// --- swarm dashboard ----------------------------------------------------------------------------------

let swarmTimer = null;

async function pollSwarm() {
  clearTimeout(swarmTimer);
  if ($("view-swarm").hidden) return;
  try {
    const response = await fetch("/v1/swarm", { headers: authHeaders(), cache: "no-store" });
    if (response.status === 401) needKey(await errorText(response));
    else if (!response.ok) $("swarm-updated").textContent = `could not refresh: ${await errorText(response)}`;
    else {
      renderSwarm((await response.json()).models);
      $("swarm-updated").textContent = `updated ${new Date().toLocaleTimeString()}, every ${SWARM_PERIOD_MS / 1000} s`;
    }
  } catch (error) {
    $("swarm-updated").textContent = `could not refresh: ${error.message}`;
  }
  swarmTimer = setTimeout(pollSwarm, SWARM_PERIOD_MS);
}

const rate = (x) => (x === null || x === undefined ? "–" : x.toFixed(1));
const span = ([a, b]) => `${a}:${b}`;
const mib = (bytes) => (bytes / (1 << 20)).toFixed(0);
const short = (peerId) => `…${peerId.slice(-8)}`;

// The stage to point at: none while a gap is the bottleneck (it shows in red) or every layer is as slow.
function neckOf(model) {
  const layers = model.bottleneck_layers.reduce((n, [a, b]) => n + b - a, 0);
  return model.gaps.length || layers >= model.num_layers ? [] : model.bottleneck_layers;
}

function coverageBar(model) {
  const neck = new Set();
  for (const [a, b] of neckOf(model)) for (let i = a; i < b; i++) neck.add(i);
  const top = Math.max(...model.layer_tokens_per_s, 1e-9);
  const bar = el("div", { class: "coverage", "data-testid": "coverage" });
  model.layer_tokens_per_s.forEach((t, i) => {
    const cls = ["layer", t <= 0 ? "gap" : "", neck.has(i) && t > 0 ? "neck" : ""].join(" ").trim();
    const cell = el("div", { class: cls, title: `layer ${i}: ${t <= 0 ? "not served" : `${t.toFixed(1)} tokens/s`}` });
    if (t > 0) cell.style.opacity = String(0.45 + 0.55 * (t / top));
    bar.append(cell);
  });
  return bar;
}

function role(peer) {
  if (peer.unreachable) return `unreachable: ${peer.unreachable}`;
  if (peer.backup_for) return `backup of ${peer.backup_for.length ? peer.backup_for.map(short).join(", ") : "a lost stage"}`;
  if (peer.backed_up_by && peer.backed_up_by.length) return `${peer.backed_up_by.length} warm backup${peer.backed_up_by.length > 1 ? "s" : ""}`;
  return "–";
}

function cache(peer) {
  if (!peer.cache_total) return el("td", { class: "num", text: "–" });
  const share = Math.round((100 * peer.cache_used) / peer.cache_total);
  const meter = el("span", { class: "meter", title: `${share}% of its KV cache reserved` }, el("span"));
  meter.firstChild.style.width = `${share}%`;
  return el("td", { class: "num" }, meter, `${mib(peer.cache_used)}/${mib(peer.cache_total)} MiB`);
}

function peerRow(peer, neck) {
  const inNeck = peer.state !== "backup" && neck.some(([a, b]) => peer.layers[0] < b && a < peer.layers[1]);
  const moving = peer.moving_to ? ` → ${span(peer.moving_to)}` : "";
  return el("tr", { class: inNeck ? "neck" : "", "data-peer-id": peer.peer_id },
    el("td", {}, el("span", {
      class: `state ${peer.state}`, text: peer.state,
      title: peer.unreachable ? `listed as ${peer.claimed_state}, but does not answer: ${peer.unreachable}` : "",
    })),
    el("td", { class: "num", text: span(peer.layers) + moving }),
    el("td", { class: "device", text: `${peer.device}, ${peer.weights}` }),
    el("td", { class: "num", text: rate(peer.advertised_tokens_per_s) }),
    el("td", { class: "num", text: rate(peer.observed_tokens_per_s) }),
    el("td", { class: "num", text: rate(peer.load_tokens_per_s) }),
    el("td", { class: "num", text: `${peer.sessions} / ${peer.queued}` }),
    cache(peer),
    el("td", { class: "role", text: role(peer) }),
    el("td", { class: "peer", title: peer.peer_id, text: short(peer.peer_id) }));
}

function unreachableCount(model) {
  const n = model.peers.filter((p) => p.unreachable).length;
  return n ? ` (${n} unreachable)` : "";
}

function modelCard(model) {
  const gaps = model.gaps.length ? model.gaps.map(span).join(", ") : "none";
  const claimed = model.unreachable_claims.length
    ? el("div", { class: "meta warning unreachable-claims",
      text: `Layers ${model.unreachable_claims.map(span).join(", ")} are claimed by listed peers that do not answer: ` +
        "stopped, frozen, or listed at an address nobody reaches (see their rows)." })
    : "";
  const head = [
    "state", "layers", "device, weights", "advertised tok/s", "observed tok/s", "load tok/s", "sessions / queued", "KV cache",
    "backup role", "peer",
  ];
  const numeric = new Set(head.slice(1, 8).filter((h) => h !== "device, weights"));
  const table = el("table", {},
    el("thead", {}, el("tr", {}, ...head.map((h) => el("th", { class: numeric.has(h) ? "num" : "", text: h })))),
    el("tbody", {}, ...model.peers.map((p) => peerRow(p, neckOf(model)))));
  // each cell names its column, for narrow screens where rows stack (style.css)
  for (const row of table.tBodies[0].rows) [...row.cells].forEach((cell, i) => { cell.dataset.label = head[i]; });
  return el("section", { class: "card", "data-model-key": model.key },
    el("h2", { text: model.model }),
    el("div", { class: "key-line", text: `${model.key} · ${model.num_layers} layers` }),
    el("div", { class: "summary" },
      el("span", {}, "peers ", el("b", { text: String(model.peers.length) }), unreachableCount(model)),
      el("span", { class: model.gaps.length ? "bad" : "" }, "not served ", el("b", { class: "gaps", text: gaps })),
      el("span", {}, "bottleneck ", el("b", { text: `${rate(model.bottleneck_tokens_per_s)} tokens/s` }),
        ` at layers ${model.bottleneck_layers.map(span).join(", ") || "–"}`)),
    coverageBar(model),
    claimed,
    el("div", { class: "axis" }, el("span", { text: "layer 0" }), el("span", { text: `layer ${model.num_layers - 1}` })),
    el("div", { class: "legend" },
      el("span", {}, el("i", { style: "background: var(--bar)" }), "served (darker: faster)"),
      el("span", {}, el("i", { style: "background: var(--gap)" }), "not served"),
      el("span", {}, el("i", { style: "background: var(--neck)" }), "bottleneck")),
    model.peers.length ? el("div", { class: "table" }, table) : el("div", { class: "none", text: "No live peer serves this model." }));
}

function renderSwarm(models) {
  const root = $("swarm-models");
  if (!models.length) root.replaceChildren(el("div", { class: "card none", text: "The swarm serves no model right now." }));
  else root.replaceChildren(...models.map(modelCard));
}

// --- wiring ----------------------------------------------------------------------------------------

function init() {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (key) localStorage.setItem(KEY_STORE, key);
    else localStorage.removeItem(KEY_STORE);
    $("key-form").classList.remove("needed");
    showNotice("");
    loadModels();
    pollSwarm();
  });
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", (event) => {
      event.preventDefault();
      show(tab.dataset.view, true);
    });
  }
  window.addEventListener("popstate", () => show(location.pathname === "/swarm" ? "swarm" : "chat", false));
  $("temperature").addEventListener("input", () => { $("temperature-value").textContent = $("temperature").value; });
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) send(event);
  });
  $("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  show(location.pathname === "/swarm" ? "swarm" : "chat", false);
  loadModels();
}

init();
