// The chat page of `mlx-spec serve`: a conversation over the server's own streaming API
// (/v1/chat/completions with the speculation trace), showing how each token came.

import { render } from "./markdown.js";
import { Trace, drafterSlot, formatLine, knownDrafters, positionChart } from "./speculation.js";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "mlx-spec-api-key"; // this tab's session only, never the address
const state = {
  messages: [], // {role, content} sent as the history
  controller: null, // the running reply's AbortController
  plainRate: null, // plain decoding's tokens/s, from the last summary that measured it
  key: sessionStorage.getItem(KEY_STORE) || "",
};

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function option(value, label) {
  const o = el("option", "", label);
  o.value = value;
  return o;
}

// ---------------------------------------------------------------------------- the server

async function loadModels() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers() });
  } catch (err) {
    return notice("cannot reach the server: " + err.message);
  }
  if (response.status === 401) return askKey(state.key ? "the API key was refused" : "");
  if (!response.ok) return notice("the server answered " + response.status);
  const models = (await response.json()).data || [];
  $("model").replaceChildren(...models.map((m) => option(m.id, m.id)));
  const drafters = models.length ? models[0].drafters || [] : [];
  $("drafter").replaceChildren(
    option("", "server default"), option("off", "off"),
    ...drafters.map((d) => option(d, d)),
  );
  $("model-name").textContent = models.length ? models[0].id : "";
  $("key-row").hidden = !state.key;
  notice("");
}

function askKey(message) {
  $("settings").open = true;
  $("key-row").hidden = false;
  notice(message || "this server needs its API key (Settings)");
  $("api-key").focus();
}

function settings() {
  const spec = { trace: true };
  const drafter = $("drafter").value;
  const length = $("num-draft").value;
  if (drafter === "off") spec.enabled = false;
  else if (drafter) spec.drafter = drafter;
  if (drafter !== "off" && length) spec.num_draft = length === "auto" ? "auto" : Number(length);
  const body = {
    model: $("model").value,
    stream: true,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
    top_k: Number($("top-k").value),
    min_p: Number($("min-p").value),
    speculative: spec,
  };
  return body;
}

function history() {
  const system = $("system").value.trim();
  return (system ? [{ role: "system", content: system }] : []).concat(state.messages);
}

// Streams the server-sent events of `response`, handing each JSON payload to `onEvent`.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (line.startsWith("data: ") && line !== "data: [DONE]") onEvent(JSON.parse(line.slice(6)));
    }
  }
}

async function errorText(response) {
  try {
    return (await response.json()).error.message;
  } catch {
    return "the server answered " + response.status;
  }
}

// ---------------------------------------------------------------------------- a reply

class Reply {
  constructor() {
    this.text = "";
    this.trace = new Trace();
    this.node = el("div", "message assistant");
    this.content = el("div", "content");
    this.line = el("div", "stats");
    this.chart = el("div", "chart-box");
    this.node.append(this.content, this.line, this.chart);
    $("messages").append(this.node);
    this.pending = false;
  }

  onEvent(event) {
    if (event.error) throw new Error(event.error.message);
    const choice = (event.choices || [])[0];
    const delta = choice && choice.delta ? choice.delta.content : null;
    const spec = event.speculative;
    if (spec) this.trace.add(spec.tokens || [], performance.now());
    if (delta) this.text += delta;
    if (spec && spec.summary) this.finishWith(spec.summary);
    this.schedule();
  }

  finishWith(summary) {
    this.trace.finish(summary);
    if (summary.plain_tokens_per_sec) state.plainRate = summary.plain_tokens_per_sec;
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.draw();
    });
  }

  draw() {
    const coloured = $("colours").checked;
    render(this.text, this.content, this.trace.painter(this.text, coloured));
    const numbers = this.trace.numbers(state.plainRate);
    const line = formatLine(numbers, true);
    this.line.textContent = line;
    $("live").textContent = line;
    const positions = this.trace.byPosition();
    this.chart.replaceChildren();
    if (positions.length) {
      this.chart.append(el("span", "chart-label", "acceptance by draft position"));
      this.chart.append(positionChart(positions));
    }
    updateLegend();
    scrollDown();
  }
}

function updateLegend() {
  const legend = $("legend");
  const names = knownDrafters();
  if (legend.dataset.drafters === names.join(",")) return;
  legend.dataset.drafters = names.join(",");
  const chips = names.map((n) => el("span", "tok draft d" + drafterSlot(n), "draft: " + n));
  chips.push(el("span", "tok recovered", "recovered"), el("span", "tok bonus", "bonus"));
  chips.push(el("span", "tok plain", "plain step"));
  legend.replaceChildren(...chips);
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function addUser(text) {
  const node = el("div", "message user");
  node.append(el("div", "content", text));
  $("messages").append(node);
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  state.messages.push({ role: "user", content: text });
  addUser(text);
  const reply = new Reply();
  const controller = new AbortController();
  state.controller = controller;
  busy(true);
  try {
    const body = { ...settings(), messages: history() };
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (response.status === 401) throw Object.assign(new Error("key"), { auth: true });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (event) => reply.onEvent(event));
  } catch (err) {
    if (err.auth) askKey(state.key ? "the API key was refused" : "");
    else if (err.name !== "AbortError") reply.node.append(el("div", "error", err.message));
  } finally {
    finishReply(reply, controller.signal.aborted);
  }
}

function finishReply(reply, stopped) {
  state.controller = null;
  busy(false);
  reply.draw();
  if (stopped) reply.node.append(el("div", "note", "stopped"));
  if (reply.text) state.messages.push({ role: "assistant", content: reply.text });
  else if (!stopped) state.messages.pop(); // nothing came back: the question is not kept
  $("prompt").focus();
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("prompt").disabled = on;
}

function stop() {
  if (state.controller) state.controller.abort();
}

function newChat() {
  stop();
  state.messages = [];
  $("messages").replaceChildren();
  $("live").textContent = "";
  $("prompt").focus();
}

function notice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

// ---------------------------------------------------------------------------- wiring

function wire() {
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("api-key").addEventListener("change", () => {
    state.key = $("api-key").value.trim();
    if (state.key) sessionStorage.setItem(KEY_STORE, state.key);
    else sessionStorage.removeItem(KEY_STORE);
    loadModels();
  });
  $("colours").addEventListener("change", () => {
    document.body.classList.toggle("plain-colours", !$("colours").checked);
  });
  const lengths = [option("", "server default"), option("auto", "auto")];
  for (let k = 1; k <= 8; k++) lengths.push(option(String(k), String(k)));
  $("num-draft").replaceChildren(...lengths);
  $("api-key").value = state.key;
}

wire();
updateLegend();
loadModels();
