// colibri dashboard: polls /v1/colibri/stats and draws with canvas (no libraries).
"use strict";
const TIER_COLORS = { gpu: "#7b3294", ram: "#008837", disk: "#999999" };

function human(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n.toFixed(0)) + " " + u[i];
}

function drawTiers(t) {
  const bar = document.getElementById("tiers"), legend = document.getElementById("tierlegend");
  const total = t.gpu + t.ram + t.disk || 1;
  bar.replaceChildren(); legend.replaceChildren();
  for (const k of ["gpu", "ram", "disk"]) {
    const d = document.createElement("div");
    d.style.width = (100 * t[k] / total) + "%";
    d.style.background = TIER_COLORS[k];
    d.title = k + ": " + human(t[k]);
    bar.appendChild(d);
    const s = document.createElement("span");
    const i = document.createElement("i");
    i.style.background = TIER_COLORS[k];
    s.append(i, k.toUpperCase() + " " + human(t[k]));
    legend.appendChild(s);
  }
}

function drawLine(id, xs, ys, fmt) {
  const c = document.getElementById(id), g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  g.fillStyle = "#666"; g.font = "11px sans-serif";
  if (ys.length < 2) { g.fillText("waiting for requests…", 10, 20); return; }
  const x0 = xs[0], x1 = xs[xs.length - 1] || x0 + 1;
  const ymax = Math.max(...ys, 1e-9);
  g.strokeStyle = "#1f77b4"; g.lineWidth = 2; g.beginPath();
  xs.forEach((x, i) => {
    const px = 30 + (c.width - 40) * (x - x0) / (x1 - x0 || 1);
    const py = c.height - 15 - (c.height - 30) * ys[i] / ymax;
    i ? g.lineTo(px, py) : g.moveTo(px, py);
  });
  g.stroke();
  g.fillText(fmt(ymax), 2, 12);
  g.fillText(fmt(ys[ys.length - 1]) + " now", c.width - 110, 12);
}

function drawHeat(h) {
  const c = document.getElementById("heat"), g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const L = h.layers.length, E = h.experts;
  if (!L) { g.fillText("no MoE layers", 10, 20); return; }
  const left = 40, top = 4, w = (c.width - left - 4) / E, hh = (c.height - top - 16) / L;
  g.font = "10px sans-serif";
  h.counts.forEach((row, i) => {
    const mx = Math.max(...row, 1);
    g.fillStyle = "#444"; g.fillText("L" + h.layers[i], 4, top + hh * i + hh / 2 + 3);
    row.forEach((v, e) => {
      const a = v / mx;  // per-layer scale: the layer's hottest expert is brightest
      g.fillStyle = `rgb(${Math.round(255 - 200 * a)}, ${Math.round(255 - 120 * a)}, ${Math.round(255 - 30 * a)})`;
      g.fillRect(left + e * w, top + i * hh, Math.max(w - 1, 1), Math.max(hh - 1, 1));
    });
  });
  g.fillStyle = "#444";
  for (let e = 0; e < E; e += Math.max(1, Math.ceil(E / 32))) g.fillText(String(e), left + e * w + 2, c.height - 3);
  c.dataset.total = String(h.counts.flat().reduce((a, b) => a + b, 0));
}

function drawRequests(reqs) {
  const body = document.querySelector("#reqs tbody");
  body.replaceChildren();
  for (const r of reqs.slice().reverse().slice(0, 15)) {
    const tr = document.createElement("tr");
    const cells = [r.id, r.prompt_tokens, r.generated, (1000 * r.ttft_s).toFixed(0),
                   r.tok_s == null ? "–" : r.tok_s.toFixed(1), r.last_s_ago.toFixed(0)];
    for (const v of cells) { const td = document.createElement("td"); td.textContent = v; tr.appendChild(td); }
    body.appendChild(tr);
  }
}

async function tick() {
  try {
    const r = await fetch("/v1/colibri/stats", { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    const s = await r.json();
    document.getElementById("status").textContent =
      `${s.placement || ""} · policy ${s.policy || "-"} · ${s.steps} steps · slots busy ${s.health.busy}/${s.health.slots}`;
    drawTiers(s.tiers);
    const xs = s.series.map(p => p.t);
    drawLine("hit", xs, s.series.map(p => p.hit_rate), v => (100 * v).toFixed(1) + "%");
    drawLine("bytes", xs, s.series.map(p => p.bytes_read), human);
    drawHeat(s.heat);
    drawRequests(s.requests);
  } catch (e) {
    document.getElementById("status").textContent = "disconnected (" + e.message + ")";
  }
}

tick();
setInterval(tick, 1000);
