"use strict";
// The site of `harvest sae features`. Routes: #/ the SAE's tensors, #/<tensor> the index of its latents,
// #/<tensor>/<latent> one latent's page. Data come as scripts calling harvestRegister(path, data) (browsers refuse
// fetch on file://): data/site.js, data/<tensor>/index.js, data/<tensor>/block_NNNN.js (64 latents each, loaded
// when one of them is opened). Strings from the data go into the page as text, never as HTML.

const PAGE = 100; // index rows a page
const DEAD = 1, DENSE = 2; // index.js's flags
const registered = new Map();
const pending = new Map();
const states = new Map(); // per tensor: the index's sort, search and page, kept across pages
let ticket = 0; // the route being drawn: a slower load of an older route draws nothing

window.harvestRegister = (path, data) => { registered.set(path, data); };

function load(path) {
  if (registered.has(path)) return Promise.resolve(registered.get(path));
  if (!pending.has(path)) {
    pending.set(path, new Promise((resolve, reject) => {
      const s = document.createElement("script");
      s.src = path;
      s.charset = "utf-8";
      s.dataset.harvest = path;
      s.onload = () => registered.has(path) ? resolve(registered.get(path))
        : reject(new Error(`${path} registered no data`));
      s.onerror = () => {
        pending.delete(path);
        s.remove();
        reject(new Error(`could not load ${path}: is the site complete (harvest sae features finished)?`));
      };
      document.head.append(s);
    }));
  }
  return pending.get(path);
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  e.append(...children.filter((c) => c !== null && c !== undefined).map((c) => typeof c === "number" ? String(c) : c));
  return e;
}

function svg(tag, attrs = {}, ...children) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  e.append(...children);
  return e;
}

function fmt(x) {
  if (x === 0 || !Number.isFinite(x)) return String(x);
  const a = Math.abs(x);
  return a >= 1e-3 && a < 1e5 ? String(Number(x.toPrecision(4))) : x.toExponential(2);
}

const CONTROL = { "\n": "↵", "\t": "⇥", "\x7f": "␡" };
function int(n) { return Number(n).toLocaleString("en-US"); }

function shown(token) { // control characters as visible symbols (newline ↵), the rest as is
  return token.replace(/[\x00-\x1f\x7f]/g, (c) => CONTROL[c] || String.fromCharCode(0x2400 + c.charCodeAt(0)));
}

function tok(token, cls = "tok") { return el("span", { class: cls }, shown(token)); }

function flags(flag) {
  if (flag === DEAD) return el("span", { class: "flag dead", title: "never fired on the tokens read" }, "dead");
  if (flag === DENSE) return el("span", { class: "flag dense", title: "fires on more tokens than dense_above" }, "dense");
  return null;
}

function blockPath(tensor, block) { return `data/${tensor}/block_${String(block).padStart(4, "0")}.js`; }

async function tensorData(tensor) {
  const site = await load("data/site.js");
  const summary = site.tensors.find((t) => t.tensor === tensor);
  if (!summary) throw new Error(`no tensor ${tensor} in this site (it has ${site.tensors.map((t) => t.tensor).join(", ")})`);
  return [site, summary, await load(`data/${tensor}/index.js`)];
}

function draw(mine, title, crumbs, ...content) {
  if (mine !== ticket) return false;
  document.title = `${title} · SAE latents`;
  const nav = document.getElementById("crumbs");
  nav.replaceChildren(...crumbs.flatMap(([text, href]) => [" › ", href ? el("a", { href }, text) : el("span", {}, text)]));
  const main = document.getElementById("main");
  const following = document.activeElement !== document.body; // a link or key took us here: focus goes on with us
  main.replaceChildren(...content);
  if (following) main.focus({ preventScroll: true });
  return true;
}

function dl(pairs) {
  return el("dl", { class: "stats" }, ...pairs.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}

async function home(mine) {
  const site = await load("data/site.js");
  const head = ["tensor", "latents", "tokens read", "dead", "dense", "architecture", "width"];
  const rows = site.tensors.map((t) => el("tr", {},
    el("td", {}, el("a", { href: `#/${t.tensor}` }, t.tensor)), el("td", {}, int(t.latents)), el("td", {}, int(t.tokens)),
    el("td", {}, int(t.dead)), el("td", {}, `${int(t.dense)} (density > ${fmt(t.dense_above)})`),
    el("td", {}, t.architecture), el("td", {}, int(t.width))));
  draw(mine, "tensors", [], el("h1", {}, "SAE latents"),
    dl([["SAE run", site.sae_run], ["step", site.step], ["model", site.model_name || site.model || "none given"],
      ["runs read", site.runs.join(", ")], ["streams", site.streams.map((s) => s.join(",")).join(" | ")],
      ["settings", Object.entries(site.settings).map(([k, v]) => `${k} ${JSON.stringify(v)}`).join(" · ")]]),
    el("table", { id: "tensors" }, el("thead", {}, el("tr", {}, ...head.map((h) => el("th", { scope: "col" }, h)))),
      el("tbody", {}, ...rows)));
}

function order(index, st) {
  let ids = Array.from({ length: index.latents }, (_, i) => i);
  if (st.query) {
    const q = st.query.toLowerCase();
    ids = ids.filter((i) => index.top[i].some((t) => t.toLowerCase().includes(q)));
  }
  const sign = st.desc ? -1 : 1;
  const col = index[st.key];
  return ids.sort(st.key === "id" ? (a, b) => sign * (a - b) : (a, b) => sign * (col[a] - col[b]) || a - b);
}

function densityCell(index, i) {
  const d = index.density[i];
  const lo = Math.log10(1 / Math.max(index.tokens, 2));
  const frac = d > 0 ? Math.min(1, Math.max(0.02, (Math.log10(d) - lo) / -lo)) : 0;
  const bar = el("span", { class: "bar", "aria-hidden": "true" });
  bar.style.width = `${(frac * 100).toFixed(1)}%`;
  return el("td", { class: "density" }, el("span", { class: "track" }, bar), el("span", { class: "num" }, fmt(d)));
}

function row(tensor, index, i) {
  const flag = index.flag[i];
  const tokens = index.top[i];
  return el("tr", { class: ["latent", flag === DEAD ? "dead" : flag === DENSE ? "dense" : ""].join(" ").trim(),
    "data-latent": i },
    el("td", { class: "id" }, el("a", { href: `#/${tensor}/${i}` }, i)), densityCell(index, i),
    el("td", { class: "max num" }, fmt(index.max[i])), el("td", { class: "mean num" }, fmt(index.mean[i])),
    el("td", { class: "tokens" }, ...tokens.slice(0, 1).map((t) => tok(t, "tok top")),
      ...tokens.slice(1).map((t) => tok(t, "tok more"))),
    el("td", { class: "flags" }, flags(flag)));
}

async function tensorIndex(mine, tensor) {
  const [, summary, index] = await tensorData(tensor);
  if (!states.has(tensor)) states.set(tensor, { key: "id", desc: false, query: "", page: 0 });
  const st = states.get(tensor);
  let ids = order(index, st);
  const tbody = el("tbody");
  const status = el("span", { class: "status", "aria-live": "polite" });
  const prev = el("button", { type: "button", class: "prev" }, "‹ previous");
  const next = el("button", { type: "button", class: "next" }, "next ›");
  const columns = [["id", "latent"], ["density", "density"], ["max", "max"], ["mean", "mean"]];
  const heads = columns.map(([key, label]) => {
    const button = el("button", { type: "button", class: "sort", "data-key": key }, label, el("span", { class: "arrow", "aria-hidden": "true" }));
    button.addEventListener("click", () => {
      st.desc = st.key === key ? !st.desc : key !== "id";
      st.key = key;
      st.page = 0;
      ids = order(index, st);
      fill();
    });
    return el("th", { scope: "col", class: key }, button);
  });
  function fill() {
    const pages = Math.max(1, Math.ceil(ids.length / PAGE));
    st.page = Math.min(st.page, pages - 1);
    const start = st.page * PAGE;
    tbody.replaceChildren(...ids.slice(start, start + PAGE).map((i) => row(tensor, index, i)));
    status.textContent = ids.length ? `${int(start + 1)}–${int(Math.min(start + PAGE, ids.length))} of ${int(ids.length)} (page ${int(st.page + 1)} of ${int(pages)})`
      : `no latent has a top token containing “${st.query}”`;
    prev.disabled = st.page === 0;
    next.disabled = st.page >= pages - 1;
    for (const th of heads) {
      const key = th.querySelector("button").dataset.key;
      th.setAttribute("aria-sort", key === st.key ? (st.desc ? "descending" : "ascending") : "none");
      th.querySelector(".arrow").textContent = key === st.key ? (st.desc ? " ▼" : " ▲") : "";
    }
  }
  prev.addEventListener("click", () => { st.page -= 1; fill(); });
  next.addEventListener("click", () => { st.page += 1; fill(); });
  const search = el("input", { type: "search", id: "search", value: st.query, placeholder: "e.g. the", autocomplete: "off" });
  search.addEventListener("input", () => { st.query = search.value; st.page = 0; ids = order(index, st); fill(); });
  fill();
  draw(mine, tensor, [[tensor]], el("h1", {}, tensor),
    el("p", { class: "summary" }, `${int(summary.latents)} latents · ${int(summary.tokens)} tokens read · ${int(summary.dead)} dead · `
      + `${int(summary.dense)} dense (density > ${fmt(summary.dense_above)}) · ${summary.architecture}, width ${int(summary.width)}`),
    el("p", { class: "search" }, el("label", { for: "search" }, "Top token contains "), search),
    el("table", { id: "latents" }, el("caption", {}, "Latents: click a column's name to sort by it"),
      el("thead", {}, el("tr", {}, ...heads, el("th", { scope: "col" }, "top tokens"), el("th", { scope: "col" }, "flags"))),
      tbody),
    el("p", { class: "pager" }, prev, " ", status, " ", next));
}

function context(c, max) {
  const line = el("span", { class: "context" }, ...c.tokens.map((t, j) => {
    const span = tok(t, j === c.at ? "tok at" : "tok");
    span.title = `activation ${fmt(c.acts[j])}`;
    if (c.acts[j] > 0 && max > 0) span.style.backgroundColor = `rgba(255, 128, 0, ${Math.min(1, c.acts[j] / max).toFixed(3)})`;
    return span;
  }));
  return el("li", {}, el("span", { class: "value num" }, fmt(c.value)), line,
    el("span", { class: "where" }, `stream ${c.where[0]} · shard ${c.where[1]} · offset ${c.where[2]}`));
}

function contexts(list, max, cls) { return el("ol", { class: `contexts ${cls}` }, ...list.map((c) => context(c, max))); }

function histogram(edges, counts) { // bars of the counts, the largest labelled; each bar's range and count on hover
  const W = 640, H = 160, T = 18, base = H + 20;
  const top = Math.max(1, ...counts);
  const w = W / counts.length;
  const lo = fmt(edges[0]), hi = fmt(edges[edges.length - 1]);
  const height = (c) => (H - T) * c / top;
  return svg("svg", { class: "histogram", viewBox: `0 0 ${W} ${base}`, role: "img",
    "aria-label": `Histogram of the activations where it fired, ${lo} to ${hi}` },
    ...counts.map((c, k) => svg("rect", { class: "hbar", x: (k * w).toFixed(2), y: (H - height(c)).toFixed(2),
      width: Math.max(0.5, w - 1).toFixed(2), height: height(c).toFixed(2) },
      svg("title", {}, `${fmt(edges[k])} to ${fmt(edges[k + 1])}: ${int(c)}`))),
    svg("line", { x1: 0, y1: H, x2: W, y2: H, class: "axis" }),
    svg("text", { x: 0, y: 12 }, `${int(top)} tokens`), svg("text", { x: 0, y: base - 4 }, lo),
    svg("text", { x: W, y: base - 4, "text-anchor": "end" }, hi));
}

function logits(caption, cls, pairs) {
  return el("table", { class: `logits ${cls}` }, el("caption", {}, caption),
    el("thead", {}, el("tr", {}, el("th", { scope: "col" }, "token"), el("th", { scope: "col" }, "logit"))),
    el("tbody", {}, ...pairs.map(([t, v]) => el("tr", {}, el("td", {}, tok(t)), el("td", { class: "num" }, fmt(v))))));
}

async function latentPage(mine, tensor, part) {
  const [, summary, index] = await tensorData(tensor);
  const i = /^\d+$/.test(part) ? Number(part) : -1;
  if (i < 0 || i >= index.latents) throw new Error(`no latent ${part} in ${tensor}: it has latents 0 to ${index.latents - 1}`);
  const lat = (await load(blockPath(tensor, Math.floor(i / index.block))))[i % index.block];
  const nav = el("p", { class: "latent-nav" }, el("a", { class: "back", href: `#/${tensor}` }, "↑ all latents"),
    i > 0 ? el("a", { class: "prev", href: `#/${tensor}/${i - 1}`, rel: "prev" }, `‹ latent ${i - 1}`) : null,
    i + 1 < index.latents ? el("a", { class: "next", href: `#/${tensor}/${i + 1}`, rel: "next" }, `latent ${i + 1} ›`) : null);
  const fired = lat.top.length > 0;
  const bins = lat.bins.slice().reverse().map((b) => el("section", { class: "bin" },
    el("h3", {}, `Activations ${fmt(b.lo)} to ${fmt(b.hi)}`), contexts(b.examples, lat.max, "bin-examples")));
  const hasLogits = lat.top_logits.length + lat.bottom_logits.length > 0;
  if (draw(mine, `latent ${i} · ${tensor}`, [[tensor, `#/${tensor}`], [`latent ${i}`]], nav,
    el("h1", {}, `Latent ${i} `, flags(index.flag[i])),
    dl([["fired on", `${int(lat.count)} of ${int(summary.tokens)} tokens`], ["density", fmt(lat.density)],
      ["max activation", fmt(lat.max)], ["mean activation (where it fired)", fmt(lat.mean)]]),
    el("section", { id: "top" }, el("h2", {}, "Top activations"), fired
      ? contexts(lat.top, lat.max, "top-examples") : el("p", { class: "note" }, "It never fired on the tokens read.")),
    el("section", { id: "distribution" }, el("h2", {}, "Activation histogram"), lat.counts.length
      ? histogram(lat.edges, lat.counts) : el("p", { class: "note" }, "No activations.")),
    el("section", { id: "logits" }, el("h2", {}, "Logits its decoder direction moves"), hasLogits
      ? el("div", { class: "pair" }, logits("Promoted", "top-logits", lat.top_logits),
        logits("Suppressed", "bottom-logits", lat.bottom_logits))
      : el("p", { class: "note" }, "No logits: the pass had no model unembedding.")),
    el("section", { id: "bins" }, el("h2", {}, "Examples by activation quantile"),
      ...(bins.length ? bins : [el("p", { class: "note" }, "No quantile bins.")])))) window.scrollTo(0, 0);
}

function route() {
  const mine = ++ticket;
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  const view = parts.length === 0 ? home(mine) : parts.length === 1 ? tensorIndex(mine, parts[0])
    : latentPage(mine, parts[0], parts[1]);
  view.catch((err) => draw(mine, "error", [], el("p", { class: "error", role: "alert" }, String(err.message || err))));
}

document.addEventListener("keydown", (e) => { // ← and → step through latents
  if (e.target.closest("input, textarea") || e.altKey || e.ctrlKey || e.metaKey) return;
  const link = document.querySelector(e.key === "ArrowLeft" ? "a.prev" : e.key === "ArrowRight" ? "a.next" : "none");
  if (link) location.hash = link.getAttribute("href");
});
window.addEventListener("hashchange", route);
route();
