// The tinyformer playground: a chat that shows what the model reads and how sure it is of each token it
// writes (decoder runs), or the cosine similarities of sentence embeddings (encoder runs).
// Plain browser JavaScript, no build step, no network resource but this server's own API.
"use strict";
const $ = (id) => document.getElementById(id);

const state = {
  model: null,        // the served model's id
  props: null,        // GET /props
  messages: [],       // the conversation: {role, content, tokens?, tool_calls?, finish?}
  controller: null,   // AbortController of the running request
  lastRequest: null,  // the messages of the last request sent
};

// ------------------------------------------------------------------------------------------- HTTP
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function api(path, body, signal) {
  const init = body === undefined ? { headers: headers() } :
    { method: "POST", headers: headers(), body: JSON.stringify(body), signal };
  const r = await fetch(path, init);
  if (!r.ok) {
    const err = await r.json().catch(() => ({}));
    throw new Error(err.error ? err.error.message : r.status + " " + r.statusText);
  }
  return r;
}

// Server-sent events: each `data: {...}` chunk to onChunk, up to `data: [DONE]`.
async function readEvents(response, onChunk) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data || data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      onChunk(chunk);
    }
  }
}

function setStatus(id, text, isError) {
  $(id).textContent = text;
  $(id).classList.toggle("error", Boolean(isError));
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// ------------------------------------------------------------------------------------------- start
async function loadProps() {
  try {
    state.props = await (await api("/props")).json();
    state.model = state.props.model;
    const p = state.props;
    $("model").textContent = "model: " + p.model;
    const format = p.arch === "encoder" ? "embeds text, generates none" :
      p.chat_format === "jinja" ? "chat template: the tokenizer's" : "chat template: none (plain turns)";
    $("model_info").textContent = `${p.arch} · context ${p.context_length} tokens · ${format}`;
    $("template_details").hidden = !p.chat_template;
    $("template_source").textContent = p.chat_template || "";
    $("chat_view").hidden = p.arch === "encoder";
    $("encoder_view").hidden = p.arch !== "encoder";
    document.body.dataset.arch = p.arch;
    document.body.dataset.state = "ready";
  } catch (e) {
    setStatus("status", "could not read the server's properties: " + e.message, true);
    $("chat_view").hidden = false;
    document.body.dataset.state = "error";
  }
}

// ------------------------------------------------------------------------------------------- tokens
const prob = (logprob) => Math.exp(logprob);
// red (improbable) through yellow to green (certain), linear in the probability
const probColour = (p) => `hsl(${Math.round(120 * p)} 85% 82%)`;
const percent = (p) => (p >= 0.995 ? (100 * p).toFixed(1) : p >= 0.001 ? (100 * p).toFixed(2) : (100 * p).toExponential(1)) + "%";

// A token's text as the logprobs give it: part of a UTF-8 character comes as "bytes:\xNN".
function tokenText(token) {
  return token.startsWith("bytes:") ? { text: token.slice(6), bytes: true } : { text: token, bytes: false };
}

// What a piece looks like in a table cell: whitespace made visible.
function visible(text) {
  return text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥");
}

function tokenSpan(entry, index) {
  const span = el("span", "tok");
  const { text, bytes } = tokenText(entry.token);
  if (bytes) span.classList.add("bytes");
  // a newline token keeps its line break, with a mark so that it can be pointed at
  const parts = text.split("\n");
  parts.forEach((part, i) => {
    if (i > 0) { span.append(el("span", "nl", "↵")); span.append("\n"); }
    if (part) span.append(part);
  });
  if (!text) span.append(el("span", "nl", "∅"));
  const p = prob(entry.logprob);
  span.style.background = probColour(p);
  span.tabIndex = index === 0 ? 0 : -1;  // one tab stop per reply; the arrow keys move along it
  span.dataset.index = index;
  span.setAttribute("aria-label", `token ${index + 1}: ${JSON.stringify(text)}, probability ${percent(p)}`);
  span._entry = entry;
  return span;
}

let pinned = null;  // the token whose alternatives stay open after a click

function showAlternatives(span) {
  const entry = span._entry;
  const box = $("alts");
  box.replaceChildren();
  document.querySelectorAll(".tok.active").forEach((t) => t.classList.remove("active"));
  span.classList.add("active");
  const chosen = tokenText(entry.token).text;
  box.append(el("div", "head", `token ${Number(span.dataset.index) + 1}: “${visible(chosen)}”, p = ${percent(prob(entry.logprob))}`));
  const alts = entry.top_logprobs || [];
  if (!alts.length) box.append(el("div", "muted", "no alternatives (set “alternatives” above 0)"));
  const table = el("table");
  const best = alts.length ? prob(alts[0].logprob) : 1;  // bars are scaled to the most probable token
  let shownChosen = false;
  for (const alt of alts) {
    const isChosen = alt.token === entry.token;
    shownChosen ||= isChosen;
    table.append(altRow(alt, best, isChosen));
  }
  if (alts.length && !shownChosen) table.append(altRow(entry, best, true, " (drawn, outside the top)"));
  box.append(table);
  box.hidden = false;
  const r = span.getBoundingClientRect();
  const left = Math.min(window.scrollX + r.left, window.scrollX + document.documentElement.clientWidth - box.offsetWidth - 8);
  box.style.left = Math.max(4, left) + "px";
  box.style.top = window.scrollY + r.bottom + 6 + "px";
}

function altRow(alt, best, isChosen, suffix) {
  const tr = el("tr", isChosen ? "chosen" : "");
  const p = prob(alt.logprob);
  const t = el("td", "t", visible(tokenText(alt.token).text) + (suffix || ""));
  const b = el("td", "barcell");
  const bar = el("div", "bar");
  bar.style.width = Math.min(100, (100 * p) / best).toFixed(1) + "%";
  b.append(bar);
  tr.append(t, b, el("td", "p", percent(p)));
  return tr;
}

function hideAlternatives() {
  $("alts").hidden = true;
  pinned = null;
  document.querySelectorAll(".tok.active").forEach((t) => t.classList.remove("active"));
}

document.addEventListener("mouseover", (e) => {
  const span = e.target.closest && e.target.closest(".tok");
  if (span && !pinned) showAlternatives(span);
});
document.addEventListener("mouseout", (e) => {
  const span = e.target.closest && e.target.closest(".tok");
  if (span && !pinned && !span.contains(e.relatedTarget) && document.activeElement !== span) hideAlternatives();
});
document.addEventListener("click", (e) => {
  const span = e.target.closest && e.target.closest(".tok");
  if (span) { showAlternatives(span); pinned = span; return; }
  if (!e.target.closest("#alts")) hideAlternatives();
});
document.addEventListener("focusin", (e) => {
  if (e.target.classList && e.target.classList.contains("tok")) { showAlternatives(e.target); pinned = e.target; }
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape") { hideAlternatives(); return; }
  const span = document.activeElement;
  if (!(span && span.classList && span.classList.contains("tok"))) return;
  if (e.key === "Enter" || e.key === " ") { e.preventDefault(); showAlternatives(span); pinned = span; return; }
  const all = span.parentElement.querySelectorAll(".tok");
  const i = Number(span.dataset.index);
  const to = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: all.length - 1 }[e.key];
  if (to === undefined) return;
  const next = all[to];
  if (next) { e.preventDefault(); next.focus(); }
});

// ------------------------------------------------------------------------------------------- the chat
function renderMessage(m) {
  const box = el("div", "msg " + m.role);
  box.append(el("div", "role", m.role));
  const body = el("div", "body");
  if (m.tokens && m.tokens.length) m.tokens.forEach((entry, i) => body.append(tokenSpan(entry, i)));
  else body.textContent = m.content || "";
  box.append(body);
  if (m.tool_calls && m.tool_calls.length) box.append(renderToolCalls(m.tool_calls, m === state.messages[state.messages.length - 1] && !state.controller));
  if (m.role === "tool") box.querySelector(".role").textContent = "tool result" + (m.tool_call_id ? " · " + m.tool_call_id : "");
  if (m.role === "assistant" && m.finish) {
    const shown = (m.tokens || []).map((t) => tokenText(t.token).text).join("");
    let note = `finish: ${m.finish}` + (m.tokens ? ` · ${m.tokens.length} tokens` : "");
    if (m.tokens && m.tokens.length && shown !== (m.content || ""))
      note += " · shown: every token the model wrote; the reply's text leaves out special tokens and the stop sequence";
    if (m.json !== undefined) note += m.json ? " · the reply parses as JSON" : " · the reply does not parse as JSON";
    box.append(el("div", "note", note));
  }
  return box;
}

function renderToolCalls(calls, answerable) {
  const box = el("div", "tool-calls");
  box.append(el("div", "muted", "tool calls"));
  calls.forEach((c, i) => {
    const line = el("div", "call");
    const fn = c.function || {};
    line.append(el("span", "name", fn.name || "?"), "(" + (fn.arguments || "") + ")");
    if (c.id) line.append(el("span", "muted", "  id " + c.id));
    box.append(line);
    if (answerable) {  // the result goes back as a `tool` message when the next message is sent
      const input = el("input", "tool-result");
      input.id = "tool_result_" + i;
      input.placeholder = "the result of " + (fn.name || "this call") + ", sent with the next message";
      input.setAttribute("aria-label", "result of " + (fn.name || "tool call") + " " + (c.id || i));
      input.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); send(); } });
      box.append(input);
    }
  });
  return box;
}

// The tool calls of the last reply that no `tool` message answers yet.
function pendingToolCalls() {
  const last = state.messages[state.messages.length - 1];
  return last && last.role === "assistant" && last.tool_calls && last.tool_calls.length ? last.tool_calls : null;
}

function renderChat() {
  const chat = $("chat");
  chat.replaceChildren(...state.messages.map(renderMessage));
  const last = state.messages[state.messages.length - 1];
  // regenerate the last reply, or retry a request that failed (the conversation then ends with the user)
  $("regenerate").disabled = Boolean(state.controller) || !last;
}

// The messages sent to the server, as OpenAI's API reads them.
function wireMessages(messages) {
  const out = [];
  const system = $("system").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of messages) {
    const wire = { role: m.role, content: m.content };
    if (m.role === "tool") wire.tool_call_id = m.tool_call_id;
    if (m.tool_calls && m.tool_calls.length) {
      wire.tool_calls = m.tool_calls;
      if (!m.content) wire.content = null;
    }
    out.push(wire);
  }
  return out;
}

function numberOr(id, fallback) {
  const v = $(id).value.trim();
  return v === "" ? fallback : Number(v);
}

// response_format for a JSON schema typed in the box; null when empty; throws on invalid JSON.
function responseFormat() {
  const text = $("json_schema").value.trim();
  if (!text) return null;
  let schema;
  try { schema = JSON.parse(text); } catch (e) { throw new Error("the JSON schema is not valid JSON: " + e.message); }
  return { type: "json_schema", json_schema: { name: "user_schema", schema } };
}

// tools and tool_choice from the tools box; null when empty; throws on a box that is not a JSON list.
function toolsRequest() {
  const text = $("tools").value.trim();
  if (!text) return null;
  let tools;
  try { tools = JSON.parse(text); } catch (e) { throw new Error("the tools are not valid JSON: " + e.message); }
  if (!Array.isArray(tools)) throw new Error("the tools must be a JSON list of {\"type\": \"function\", \"function\": {...}}");
  return { tools, tool_choice: $("tool_choice").value };
}

// Both boxes checked before a message is sent; false (with the reason shown) when one is not valid.
function requestExtrasValid() {
  let ok = true;
  try { responseFormat(); setStatus("schema_status", ""); } catch (e) { setStatus("schema_status", e.message, true); ok = false; }
  try { toolsRequest(); setStatus("tools_status", ""); } catch (e) { setStatus("tools_status", e.message, true); ok = false; }
  return ok;
}

// Merge streamed `delta.tool_calls` pieces: each names its `index`; `function.arguments` arrive in parts.
function mergeToolCalls(calls, deltas) {
  for (const d of deltas) {
    const i = d.index ?? calls.length;
    const c = calls[i] || (calls[i] = { id: "", type: "function", function: { name: "", arguments: "" } });
    if (d.id) c.id = d.id;
    if (d.type) c.type = d.type;
    if (d.function) {
      if (d.function.name) c.function.name += d.function.name;
      if (d.function.arguments) c.function.arguments += d.function.arguments;
    }
  }
}

async function complete() {
  if (!state.model) await loadProps();
  if (!state.model) return;
  if (!requestExtrasValid()) return;
  const format = responseFormat(), tools = toolsRequest();
  const messages = wireMessages(state.messages);
  state.lastRequest = messages;
  if ($("show_prompt").checked) showPrompt(messages);
  const top = Math.max(0, Math.min(20, numberOr("top_logprobs", 5)));
  const body = {
    model: state.model, messages, stream: true, stream_options: { include_usage: true },
    logprobs: true, top_logprobs: top,
    temperature: numberOr("temperature", 1), top_k: numberOr("top_k", 0), top_p: numberOr("top_p", 1),
    min_p: numberOr("min_p", 0), max_tokens: numberOr("max_tokens", 128),
  };
  const seed = numberOr("seed", null);
  if (seed !== null) body.seed = seed;
  if (format) body.response_format = format;
  if (tools) Object.assign(body, tools);

  const reply = { role: "assistant", content: "", tokens: [], tool_calls: [], finish: null };
  state.messages.push(reply);
  state.controller = new AbortController();
  document.body.dataset.state = "running";
  $("send").disabled = true; $("stop").disabled = false; $("regenerate").disabled = true;
  renderChat();
  const view = $("chat").lastElementChild;
  setStatus("status", "generating…");
  const started = performance.now();
  let usage = null;
  try {
    const r = await api("/v1/chat/completions", body, state.controller.signal);
    const onChunk = (chunk) => {
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      const delta = choice.delta || choice.message || {};
      if (delta.content) reply.content += delta.content;
      if (delta.tool_calls) mergeToolCalls(reply.tool_calls, delta.tool_calls);
      const entries = (choice.logprobs && choice.logprobs.content) || [];
      const bodyEl = view.querySelector(".body");
      for (const entry of entries) bodyEl.append(tokenSpan(entry, reply.tokens.push(entry) - 1));
      if (!reply.tokens.length) bodyEl.textContent = reply.content;
      if (delta.tool_calls) {
        view.querySelector(".tool-calls")?.remove();
        view.append(renderToolCalls(reply.tool_calls));
      }
      if (choice.finish_reason) reply.finish = choice.finish_reason;
    };
    // a streamed answer (server-sent events) or, from a server that does not stream, one whole completion
    if ((r.headers.get("Content-Type") || "").includes("application/json")) onChunk(await r.json());
    else await readEvents(r, onChunk);
    const secs = (performance.now() - started) / 1000;
    const n = usage ? usage.completion_tokens : reply.tokens.length;
    setStatus("status", `${n} tokens in ${secs.toFixed(2)} s (${(n / secs).toFixed(1)} tok/s)` +
      (usage ? ` · prompt ${usage.prompt_tokens} tokens` : "") + ` · finish: ${reply.finish}`);
  } catch (e) {
    if (e.name === "AbortError") { reply.finish = "stopped"; setStatus("status", `stopped after ${reply.tokens.length} tokens`); }
    else {
      setStatus("status", "error: " + e.message, true);
      if (!reply.tokens.length && !reply.content) state.messages.pop();
    }
  } finally {
    if (format && reply.finish && reply.finish !== "stopped") {
      try { JSON.parse(reply.content); reply.json = true; } catch { reply.json = false; }
    }
    state.controller = null;
    $("send").disabled = false; $("stop").disabled = true;
    renderChat();
    document.body.dataset.state = "done";
  }
}

function send() {
  const text = $("user_input").value;
  const calls = pendingToolCalls();
  if ((!text.trim() && !calls) || state.controller) return;
  if (!requestExtrasValid()) return;  // the message stays typed
  if (calls) {  // OpenAI's order: the assistant's calls, one `tool` message per call, then the user's message
    calls.forEach((c, i) => {
      const input = document.getElementById("tool_result_" + i);
      state.messages.push({ role: "tool", tool_call_id: c.id, content: input ? input.value : "" });
    });
  }
  if (text.trim()) state.messages.push({ role: "user", content: text });
  $("user_input").value = "";
  complete();
}

function regenerate() {
  if (state.controller) return;
  if (state.messages.length && state.messages[state.messages.length - 1].role === "assistant") state.messages.pop();
  if (state.messages.length) complete();
}

// ------------------------------------------------------------------------------------------- the prompt view
async function showPrompt(messages) {
  const panel = $("prompt_view");
  panel.hidden = false;
  if (!messages) {  // nothing sent yet: the prompt the typed message would make
    const pending = $("user_input").value.trim() ? [{ role: "user", content: $("user_input").value }] : [];
    messages = state.lastRequest || wireMessages([...state.messages, ...pending]);
  }
  if (!messages.length) messages = [{ role: "user", content: "" }];
  $("prompt_format").textContent = state.props && state.props.chat_format === "plain" ?
    "(plain turns: the tokenizer has no chat template)" : "(the tokenizer's chat template)";
  try {
    // the tools too, as the chat completion sends them (a template may write them into the prompt)
    let tools = null;
    try { tools = toolsRequest(); } catch { tools = null; }
    const { prompt } = await (await api("/apply-template", { messages, ...(tools ? { tools: tools.tools } : {}) })).json();
    const { tokens, pieces } = await (await api("/tokenize", { content: prompt, add_special: false })).json();
    $("prompt_text").textContent = prompt;
    $("prompt_count").textContent = `(${tokens.length} tokens: id, then piece)`;
    $("prompt_tokens").replaceChildren(...tokens.map((id, i) => {
      const piece = pieces[i];
      const chip = el("span", "piece");
      if (/^<[|｜]?[^\s<>]*[|｜]?>$|^\[[A-Z]+\]$/.test(piece)) chip.classList.add("special");
      if (piece.includes("\\x")) chip.classList.add("bytes");
      chip.append(el("b", "", String(id)), visible(piece));
      chip.title = `id ${id}: ${JSON.stringify(piece)}`;
      return chip;
    }));
    panel.dataset.loaded = "true";
  } catch (e) {
    $("prompt_text").textContent = "could not render the prompt: " + e.message;
  }
}

// ------------------------------------------------------------------------------------------- encoder view
async function compareSentences() {
  const sentences = $("sentences").value.split("\n").map((s) => s.trim()).filter(Boolean);
  if (!sentences.length) { setStatus("encoder_status", "type at least one sentence", true); return; }
  document.body.dataset.state = "running";
  setStatus("encoder_status", "embedding…");
  try {
    const r = await api("/v1/embeddings", { model: state.model, input: sentences, encoding_format: "float" });
    const body = await r.json();
    const vectors = body.data.sort((a, b) => a.index - b.index).map((d) => d.embedding);
    const norm = (v) => Math.sqrt(v.reduce((s, x) => s + x * x, 0));
    const cos = (a, b) => a.reduce((s, x, i) => s + x * b[i], 0) / (norm(a) * norm(b));
    const table = $("similarity");
    const head = el("tr");
    head.append(el("th", "", ""), ...sentences.map((s, j) => { const th = el("th", "", `${j + 1}`); th.title = s; return th; }));
    const rows = sentences.map((s, i) => {
      const tr = el("tr");
      tr.append(el("th", "", `${i + 1}. ${s}`));
      for (let j = 0; j < sentences.length; j++) {
        const c = cos(vectors[i], vectors[j]);
        const td = el("td", "", c.toFixed(3));
        td.dataset.cosine = String(c);
        // white at 0 (or below), deep blue at 1
        const t = Math.max(0, c);
        td.style.background = `hsl(215 80% ${Math.round(100 - 45 * t)}%)`;
        if (t > 0.7) td.style.color = "#fff";
        td.title = `cos(${i + 1}, ${j + 1}) = ${c.toFixed(4)}`;
        tr.append(td);
      }
      return tr;
    });
    table.replaceChildren(head, ...rows);
    setStatus("encoder_status", `${sentences.length} sentences, ${vectors[0].length} dimensions, ${body.usage.prompt_tokens} tokens`);
  } catch (e) {
    setStatus("encoder_status", "error: " + e.message, true);
  } finally {
    document.body.dataset.state = "done";
  }
}

// ------------------------------------------------------------------------------------------- wiring
$("send").addEventListener("click", send);
$("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
$("regenerate").addEventListener("click", regenerate);
$("clear").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.messages = []; state.lastRequest = null; renderChat(); setStatus("status", "");
});
$("user_input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
$("show_prompt").addEventListener("change", () => {
  if ($("show_prompt").checked) showPrompt(); else $("prompt_view").hidden = true;
});
$("embed").addEventListener("click", compareSentences);
$("api_key").addEventListener("change", loadProps);
loadProps();
