"use strict";
// One viewer: everything below looks up elements inside its own root (id = uid), never by a
// document-wide id, so several viewers can share a page (a notebook with two outputs).
const root = document.getElementById(uid);
const $ = (role) => root.querySelector('[data-role="' + role + '"]');
const D = JSON.parse($("attnlab-data").textContent);
const T = D.T, S = D.S, ROW = 20, PAD = 12, LEFT_X = 150, RIGHT_X = 330, WIDTH = 480;
const SVGNS = "http://www.w3.org/2000/svg";
const keyTokens = D.key_tokens || D.tokens, keyMask = D.key_mask || D.mask;
const SB = D.sentence_b_start;  // null, or the index of the first token of sentence B
const state = { layer: D.selected[0], head: D.selected[1], pinned: null, hover: null,
                view: "head", filter: "all", heads: new Array(D.heads).fill(true) };
const visible = (t) => {
  const s = t.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
  return s.length ? s : "\u2205";
};
const shown = D.tokens.map(visible), shownKeys = keyTokens.map(visible);
const short = (s) => (s.length > 16 ? s.slice(0, 15) + "\u2026" : s);
const fmt = (w) => w.toFixed(Math.min(D.decimals, 3));
const headColor = (h) => "hsl(" + Math.round((h * 360) / Math.max(D.heads, 1) + 210) % 360 +
  ", 70%, 42%)";
const block = (i) => (SB === null ? "" : i < SB ? "A" : "B");
const inFilter = (i, j) => state.filter === "all" || block(i) + block(j) === state.filter;

// Sparse row of one head: [[key, weight], ...] (every weight in full mode, top-k otherwise).
function row(l, h, i) {
  if (D.mode === "full") {
    const r = D.weights[l][h][i], out = [];
    for (let j = 0; j < r.length; j++) if (r[j] > 0) out.push([j, r[j]]);
    return out;
  }
  const idx = D.top_idx[l][h][i], val = D.top_val[l][h][i];
  return idx.map((j, n) => [j, val[n]]);
}
function column(l, h, j) {
  const out = [];
  for (let i = 0; i < T; i++) {
    if (!D.mask[i]) continue;
    for (const [k, w] of row(l, h, i)) if (k === j) out.push([i, w]);
  }
  return out;
}
function matrix(l, h) {  // {rows, cols, values (rows*cols, in [0, 1])}
  if (D.mode === "full") return { rows: T, cols: S, values: D.weights[l][h].flat() };
  return { rows: D.thumb_shape[0], cols: D.thumb_shape[1],
           values: D.thumbs[l][h].map((v) => v / 255) };
}
function paint(canvas, l, h) {
  const m = matrix(l, h), n = m.rows * m.cols;
  canvas.width = m.cols; canvas.height = m.rows;
  const ctx = canvas.getContext("2d"), img = ctx.createImageData(m.cols, m.rows);
  let max = 0;
  for (const v of m.values) if (v > max) max = v;
  for (let p = 0; p < n; p++) {
    const t = max > 0 ? Math.sqrt(m.values[p] / max) : 0;  // sqrt: small weights stay visible
    img.data[4 * p] = Math.round(255 - t * (255 - 16));
    img.data[4 * p + 1] = Math.round(255 - t * (255 - 72));
    img.data[4 * p + 2] = Math.round(255 - t * (255 - 160));
    img.data[4 * p + 3] = 255;
  }
  ctx.putImageData(img, 0, 0);
}
function aspect(el, side) {  // a non-square matrix keeps its shape: the longer side is `side`
  const r = T / Math.max(T, S), c = S / Math.max(T, S);
  el.style.width = Math.max(4, Math.round(side * c)) + "px";
  el.style.height = Math.max(4, Math.round(side * r)) + "px";
}

// ---------------------------------------------------------------- static parts
$("no-script").remove();  // the note for pages whose scripts do not run
$("title").textContent = D.title;
$("subtitle").textContent = D.subtitle;
for (const note of D.notes) {
  const li = document.createElement("li");
  li.textContent = note;
  $("notes").appendChild(li);
}
for (const [role, n, name] of [["layer-select", D.layers, "layer"], ["head-select", D.heads,
                                                                      "head"]]) {
  const sel = $(role);
  for (let x = 0; x < n; x++) {
    const o = document.createElement("option");
    o.value = String(x); o.textContent = name + " " + x;
    sel.appendChild(o);
  }
  sel.addEventListener("change", () => {
    select(Number($("layer-select").value), Number($("head-select").value));
  });
}
$("view-select").addEventListener("change", () => {
  state.view = $("view-select").value;
  render();
});
if (SB !== null) {
  $("pair-control").hidden = false;
  $("pair-filter").addEventListener("change", () => {
    state.filter = $("pair-filter").value;
    render();
  });
}
const toggles = $("head-toggles");
for (let h = 0; h < D.heads; h++) {
  const label = document.createElement("label");
  const box = document.createElement("input");
  box.type = "checkbox"; box.checked = true;
  box.setAttribute("data-role", "head-toggle"); box.setAttribute("data-head", h);
  box.addEventListener("change", () => { state.heads[h] = box.checked; render(); });
  const sw = document.createElement("span");
  sw.className = "swatch"; sw.style.background = headColor(h);
  label.append(box, sw, "H" + h);
  toggles.appendChild(label);
}
const keyWord = D.cross ? "keys (" + S + " tokens)" : "keys";
$("head-legend").textContent = "Left: queries, right: " + keyWord + ". A line's opacity is " +
  "the weight (lines below " + D.min_line + " omitted)" +
  (D.mode === "topk" ? "; only each token's top " + D.topk + " weights are drawn." : ".") +
  (SB === null ? "" : " Sentence B starts at token #" + SB + ".");
$("model-legend").textContent = "Rows are layers, columns heads; click a thumbnail to select " +
  "it. Each thumbnail is scaled to its own maximum" + (D.mode === "topk" ?
  " and max-pooled to " + D.thumb_shape[0] + "\u00d7" + D.thumb_shape[1] + " pixels." : ".");
const realKeys = keyMask.filter(Boolean).length, maxEnt = Math.log(Math.max(2, realKeys));
$("entropy-legend").textContent = "Mean over query rows of \u2212\u03a3 p log p in nats (masked " +
  "rows skipped). 0 = every token attends to one key; log S = " + maxEnt.toFixed(2) +
  " = uniform over all " + realKeys + " keys. Shade: normalised entropy = entropy / log S " +
  "(dark = focused, light = diffuse). Click a cell to select.";

// Head view: two token columns (queries left, keys right) and a layer of lines between them.
const svg = $("head-view");
const height = 2 * PAD + ROW * Math.max(T, S) + 16;
svg.setAttribute("width", WIDTH); svg.setAttribute("height", height);
svg.setAttribute("viewBox", "0 0 " + WIDTH + " " + height);
const y = (i) => PAD + 16 + ROW * i + ROW / 2;
for (const [x, anchor, label] of [[LEFT_X, "end", "query"], [RIGHT_X, "start", "key"]]) {
  const t = document.createElementNS(SVGNS, "text");
  t.setAttribute("x", x); t.setAttribute("y", PAD); t.setAttribute("text-anchor", anchor);
  t.setAttribute("fill", "#5f6b7a"); t.style.cursor = "default";
  t.textContent = label;
  svg.appendChild(t);
}
if (SB !== null) {  // a rule between the two sentences, on both sides
  for (const x of [LEFT_X - 136, RIGHT_X - 4]) {
    const r = document.createElementNS(SVGNS, "line");
    r.setAttribute("x1", x); r.setAttribute("x2", x + 140);
    r.setAttribute("y1", y(SB) - ROW / 2); r.setAttribute("y2", y(SB) - ROW / 2);
    r.setAttribute("stroke", "#9aa3ae"); r.setAttribute("stroke-dasharray", "3 2");
    svg.appendChild(r);
  }
}
const lines = document.createElementNS(SVGNS, "g");
lines.setAttribute("data-role", "lines");
svg.appendChild(lines);
const qTok = [], kTok = [];
for (const side of ["q", "k"]) {
  const n = side === "q" ? T : S;
  for (let i = 0; i < n; i++) {
    const g = document.createElementNS(SVGNS, "g");
    g.setAttribute("class", "tok " + side);
    g.setAttribute("data-i", i);
    const rect = document.createElementNS(SVGNS, "rect");
    const w = 136;
    rect.setAttribute("x", side === "q" ? LEFT_X - w : RIGHT_X - 4);
    rect.setAttribute("y", y(i) - ROW / 2 + 1);
    rect.setAttribute("width", w + 4); rect.setAttribute("height", ROW - 2);
    rect.setAttribute("rx", 3);
    const t = document.createElementNS(SVGNS, "text");
    t.setAttribute("x", side === "q" ? LEFT_X - 2 : RIGHT_X);
    t.setAttribute("y", y(i));
    t.setAttribute("text-anchor", side === "q" ? "end" : "start");
    const text = side === "q" ? shown[i] : shownKeys[i];
    t.textContent = short(text);
    const tip = document.createElementNS(SVGNS, "title");
    tip.textContent = text + " (#" + i + ")";
    g.append(rect, t, tip);
    if (!(side === "q" ? D.mask : keyMask)[i]) g.classList.add("dim");
    g.addEventListener("mouseenter", () => { state.hover = { side: side, i: i }; render(); });
    g.addEventListener("mouseleave", () => { state.hover = null; render(); });
    g.addEventListener("click", () => {
      const same = state.pinned && state.pinned.side === side && state.pinned.i === i;
      state.pinned = same ? null : { side: side, i: i };
      root.focus({ preventScroll: true });  // Esc then reaches this viewer only
      render();
    });
    svg.appendChild(g);
    (side === "q" ? qTok : kTok).push(g);
  }
}
root.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && state.pinned) { state.pinned = null; render(); }
});

// Model view and entropy table.
const mv = $("model-view");
mv.style.gridTemplateColumns = "auto repeat(" + D.heads + ", auto)";
mv.appendChild(document.createElement("span"));
for (let h = 0; h < D.heads; h++) {
  const s = document.createElement("span");
  s.className = "lab"; s.textContent = "H" + h;
  mv.appendChild(s);
}
const thumbs = [];
for (let l = 0; l < D.layers; l++) {
  const s = document.createElement("span");
  s.className = "lab"; s.textContent = "L" + l;
  mv.appendChild(s);
  thumbs.push([]);
  for (let h = 0; h < D.heads; h++) {
    const b = document.createElement("button");
    b.className = "thumb"; b.type = "button";
    b.setAttribute("data-layer", l); b.setAttribute("data-head", h);
    const e = D.entropy[l][h];
    b.title = "layer " + l + ", head " + h + (e === null ? "" : " \u00b7 entropy " +
      e.toFixed(3) + " nats");
    const c = document.createElement("canvas");
    paint(c, l, h);
    aspect(c, 48);
    b.appendChild(c);
    b.addEventListener("click", () => select(l, h));
    mv.appendChild(b);
    thumbs[l].push(b);
  }
}
const table = $("entropy-table"), cells = [];
const headRow = table.insertRow();
headRow.appendChild(document.createElement("th"));
for (let h = 0; h < D.heads; h++) {
  const th = document.createElement("th");
  th.textContent = "H" + h;
  headRow.appendChild(th);
}
for (let l = 0; l < D.layers; l++) {
  const tr = table.insertRow();
  const th = document.createElement("th");
  th.textContent = "L" + l;
  tr.appendChild(th);
  cells.push([]);
  for (let h = 0; h < D.heads; h++) {
    const td = tr.insertCell(), e = D.entropy[l][h];
    td.setAttribute("data-layer", l); td.setAttribute("data-head", h);
    td.textContent = e === null ? "\u2013" : e.toFixed(2);
    const t = e === null ? 0 : Math.min(1, e / maxEnt);  // normalised entropy: light = diffuse
    td.title = e === null ? "no valid rows" : e.toFixed(D.decimals) + " nats \u00b7 normalised " +
      "entropy " + t.toFixed(2);
    td.style.background = "hsl(215, 70%, " + Math.round(40 + 55 * t) + "%)";
    td.style.color = t < 0.45 ? "#fff" : "#1d2330";
    td.addEventListener("click", () => select(l, h));
    cells[l].push(td);
  }
}

// ---------------------------------------------------------------- dynamic parts
function select(l, h) {
  state.layer = l; state.head = h;
  render();
}
function focus() { return state.hover || state.pinned; }

// The lines of head h: all real queries' rows, or the focused query's row / key's column,
// restricted to the sentence-pair filter and to weights >= min_line. [[q, k, w], ...]
function pairsOf(l, h, f) {
  let pairs = [];
  if (f && f.side === "q") pairs = row(l, h, f.i).map(([j, w]) => [f.i, j, w]);
  else if (f && f.side === "k") pairs = column(l, h, f.i).map(([i, w]) => [i, f.i, w]);
  else {
    for (let i = 0; i < T; i++) {
      if (D.mask[i]) for (const [j, w] of row(l, h, i)) pairs.push([i, j, w]);
    }
  }
  return pairs.filter((p) => p[2] >= D.min_line && D.mask[p[0]] && inFilter(p[0], p[1]));
}

function render() {
  const l = state.layer, h = state.head, f = focus();
  $("layer-select").value = String(l); $("head-select").value = String(h);
  $("view-select").value = state.view;
  $("pair-filter").value = state.filter;
  toggles.hidden = state.view !== "all";
  const attrs = {
    layer: l, head: h, view: state.view, filter: state.filter,
    token: state.pinned && state.pinned.side === "q" ? state.pinned.i : -1,
    key: state.pinned && state.pinned.side === "k" ? state.pinned.i : -1,
    focus: f ? f.side + f.i : "",
  };
  const e = D.entropy[l][h];
  $("selection-info").textContent = "Layer " + l + ", head " + h + " \u00b7 entropy " +
    (e === null ? "\u2013" : e.toFixed(3) + " nats");
  // One head's lines, or every enabled head of the layer in its own colour.
  const heads = state.view === "all" ? state.heads.map((on, x) => (on ? x : -1))
    .filter((x) => x >= 0) : [h];
  const frag = document.createDocumentFragment();
  const strong = f ? 1 : 0.85, shade = new Map();
  let count = 0;
  for (const hh of heads) {
    const color = headColor(hh);
    for (const [i, j, w] of pairsOf(l, hh, f)) {
      const ln = document.createElementNS(SVGNS, "line");
      ln.setAttribute("x1", LEFT_X + 4); ln.setAttribute("y1", y(i));
      ln.setAttribute("x2", RIGHT_X - 8); ln.setAttribute("y2", y(j));
      ln.setAttribute("stroke", color);
      ln.setAttribute("stroke-opacity", (strong * Math.min(1, w)).toFixed(4));
      ln.setAttribute("stroke-width", (1 + 3 * w).toFixed(2));
      ln.setAttribute("data-q", i); ln.setAttribute("data-k", j); ln.setAttribute("data-w", w);
      ln.setAttribute("data-h", hh);
      frag.appendChild(ln);
      const other = f && f.side === "k" ? i : j;
      shade.set(other, Math.max(shade.get(other) || 0, w));
      count++;
    }
  }
  lines.replaceChildren(frag);
  attrs.lines = count;
  for (const [name, value] of Object.entries(attrs)) {
    svg.setAttribute("data-" + name, value);
    root.setAttribute("data-" + name, value);
  }
  // Token shading: the focused token in yellow, the other side by weight.
  const color = state.view === "all" ? "" : headColor(h);
  for (const [side, toks] of [["q", qTok], ["k", kTok]]) {
    toks.forEach((g, i) => {
      const isFocus = f && f.side === side && f.i === i;
      g.classList.toggle("focus", !!isFocus);
      g.classList.toggle("pinned", !!(state.pinned && state.pinned.side === side &&
                                      state.pinned.i === i));
      const other = f && f.side !== side;
      const r = g.firstChild;
      r.style.fillOpacity = isFocus ? "0.9" : other ? (0.6 * (shade.get(i) || 0)).toFixed(3)
        : "0";
      r.style.fill = isFocus ? "" : color;
    });
  }
  for (let a = 0; a < D.layers; a++) {
    for (let b = 0; b < D.heads; b++) {
      const on = a === l && b === h;
      thumbs[a][b].classList.toggle("selected", on);
      cells[a][b].classList.toggle("selected", on);
    }
  }
  renderDetails(l, h, f);
}

const big = document.createElement("canvas");
big.setAttribute("data-role", "head-matrix");
const wrap = document.createElement("div");
wrap.className = "matrix-wrap";
aspect(wrap, 180);
const band = document.createElement("div");
band.className = "matrix-focus";
wrap.append(big, band);
const info = document.createElement("div");
info.className = "info";
$("details").append(wrap, info);
let painted = "";

function renderDetails(l, h, f) {
  if (painted !== l + "," + h) { paint(big, l, h); painted = l + "," + h; }
  // Outline the focused token's row (query) or column (key) on the matrix.
  band.style.display = f ? "block" : "none";
  if (f) {
    const n = f.side === "q" ? T : S, a = (100 * f.i) / n + "%", b = 100 / n + "%";
    Object.assign(band.style, f.side === "q" ? { top: a, height: b, left: "0", width: "100%" }
      : { left: a, width: b, top: "0", height: "100%" });
  }
  big.title = "layer " + l + ", head " + h + ": rows are queries, columns keys";
  info.replaceChildren();
  const head = document.createElement("h2");
  info.appendChild(head);
  const p = document.createElement("p");
  p.className = "muted";
  info.appendChild(p);
  if (!f) {
    head.textContent = "Layer " + l + ", head " + h;
    p.textContent = "Hover over a token (left: as a query, right: as a key) to see its " +
      "strongest weights here. The " + (T === S ? "square" : T + "\u00d7" + S + " rectangle") +
      " is this head's attention matrix (rows: queries).";
    return;
  }
  let items, names;
  if (f.side === "q") {
    head.textContent = "\u201c" + shown[f.i] + "\u201d (#" + f.i + ") attends to";
    const re = D.row_entropy[l][h][f.i];
    p.textContent = "layer " + l + ", head " + h + (re === null ? " \u00b7 masked row" :
      " \u00b7 row entropy " + re.toFixed(3) + " nats") +
      (D.mode === "topk" ? " \u00b7 top " + D.topk + " stored" : "");
    items = row(l, h, f.i);
    names = shownKeys;
  } else {
    head.textContent = "Attention to \u201c" + shownKeys[f.i] + "\u201d (#" + f.i + ") from";
    p.textContent = "layer " + l + ", head " + h;
    items = column(l, h, f.i);
    names = shown;
  }
  items.sort((a, b) => b[1] - a[1] || a[0] - b[0]);
  const ul = document.createElement("ul");
  ul.className = "bars"; ul.setAttribute("data-role", "top-weights");
  for (const [j, w] of items.slice(0, 8)) {
    const li = document.createElement("li");
    li.setAttribute("data-index", j); li.setAttribute("data-w", w);
    const k = document.createElement("span");
    k.className = "k"; k.textContent = names[j];
    const n = document.createElement("span");
    n.className = "n"; n.textContent = "#" + j;
    k.append(" ", n);
    const bar = document.createElement("span");
    bar.className = "bar"; bar.style.width = Math.max(1, Math.round(200 * w)) + "px";
    bar.style.background = headColor(h);
    const v = document.createElement("span");
    v.className = "v"; v.textContent = fmt(w);
    li.append(k, bar, v);
    ul.appendChild(li);
  }
  info.appendChild(ul);
}

// A per-viewer registry; window.attnlabViewer is the viewer created last (one per page before).
const api = { uid: uid, root: root, data: D, state: state, select: select, render: render };
window.attnlabViewers = window.attnlabViewers || {};
window.attnlabViewers[uid] = api;
window.attnlabViewer = api;
render();
root.setAttribute("data-ready", "1");
