// colibri's chat page: a conversation over POST /v1/chat/completions (streamed, SSE). An answer is shown
// as markdown (marked), its HTML sanitized (DOMPurify) before it reaches the page; everything else, and an
// answer when those two did not load, is set with textContent only.
"use strict";
const $ = (id) => document.getElementById(id);
const conv = [];  // {role, content} of the conversation so far
let busy = null;  // the AbortController of the answer being streamed

for (const id of ["system", "temperature", "max_tokens", "key"]) {  // settings survive a reload
  const saved = localStorage.getItem("colibri." + id);
  if (saved !== null) $(id).value = saved;
  $(id).addEventListener("change", () => localStorage.setItem("colibri." + id, $(id).value));
}

function headers() {
  const h = {"Content-Type": "application/json"};
  if ($("key").value) h.Authorization = "Bearer " + $("key").value;
  return h;
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text || "";
  div.appendChild(body);
  $("log").appendChild(div);
  div.scrollIntoView({block: "end"});
  return div;
}

// An answer's text into `el`: markdown made HTML and sanitized, or plain text. `data-raw` keeps the text.
function render(el, text) {
  el.dataset.raw = text;
  if (window.marked && window.DOMPurify) {
    el.innerHTML = DOMPurify.sanitize(marked.parse(text, {gfm: true, breaks: true}));
    el.classList.add("md");
  } else {
    el.textContent = text;
  }
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", {headers: headers()});
    const j = await r.json();
    $("model").textContent = r.ok ? j.data[0].id : (j.error && j.error.message) || r.statusText;
  } catch (e) {
    $("model").textContent = "server unreachable";
  }
}

// The SSE events of a streamed response body, as parsed JSON objects.
async function* events(response) {
  const reader = response.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += dec.decode(value, {stream: true});
    let at;
    while ((at = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, at).replace(/\r$/, "");
      buf = buf.slice(at + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function ask(text) {
  conv.push({role: "user", content: text});
  bubble("user", text);
  const out = bubble("assistant", "");
  const body = out.querySelector(".text");
  let thinking = null, answer = "", failed = false;
  const messages = ($("system").value ? [{role: "system", content: $("system").value}] : []).concat(conv);
  busy = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  $("status").textContent = "generating…";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: busy.signal,
      body: JSON.stringify({messages, stream: true, stream_options: {include_usage: true},
                            temperature: Number($("temperature").value), max_tokens: Number($("max_tokens").value)}),
    });
    if (!r.ok) {
      const j = await r.json().catch(() => ({}));
      throw new Error((j.error && j.error.message) || r.statusText);
    }
    for await (const ev of events(r)) {
      if (ev.error) throw new Error(ev.error.message);
      const delta = ev.choices && ev.choices[0] && ev.choices[0].delta;
      if (delta && delta.reasoning_content) {
        if (!thinking) {
          const d = document.createElement("details");
          d.innerHTML = "<summary>reasoning</summary>";
          thinking = document.createElement("div");
          d.appendChild(thinking);
          out.insertBefore(d, body);
        }
        thinking.textContent += delta.reasoning_content;
      }
      if (delta && delta.content) {
        answer += delta.content;
        render(body, answer);
        out.scrollIntoView({block: "end"});
      }
      if (ev.usage) {
        const meta = document.createElement("div");
        meta.className = "meta";
        const t = ev.timings;
        meta.textContent = `${ev.usage.completion_tokens} tokens` +
          (t ? `, ${t.predicted_per_second.toFixed(1)} tok/s, prompt ${t.prompt_n} tok in ${t.prompt_ms.toFixed(0)} ms` : "");
        out.appendChild(meta);
      }
    }
    $("status").textContent = "";
  } catch (e) {
    if (e.name === "AbortError") {
      $("status").textContent = "stopped";
    } else {
      failed = true;
      out.classList.add("error");
      body.classList.remove("md");
      body.textContent = body.dataset.raw = answer + (answer ? "\n" : "") + "error: " + e.message;
      $("status").textContent = "";
    }
  } finally {
    if (failed) conv.pop();  // the turn did not happen: the next message goes without it
    else conv.push({role: "assistant", content: answer});
    busy = null;
    $("send").disabled = false; $("stop").disabled = true;
    out.dataset.done = "1";
  }
}

$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || busy) return;
  $("input").value = "";
  ask(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("ask").requestSubmit(); }
});
$("stop").addEventListener("click", () => busy && busy.abort());
$("new").addEventListener("click", () => { if (!busy) { conv.length = 0; $("log").textContent = ""; } });
$("key").addEventListener("change", loadModel);
loadModel();
