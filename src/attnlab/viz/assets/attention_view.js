"use strict";
(function () {
  const D = JSON.parse(document.getElementById("attn-data").textContent);
  const T = D.T, ROW = 20, PAD = 12, LEFT_X = 150, RIGHT_X = 330, WIDTH = 480;
  const SVGNS = "http://www.w3.org/2000/svg";
  const state = { layer: D.selected[0], head: D.selected[1], pinned: null, hover: null };
  const $ = (id) => document.getElementById(id);
  const shown = D.tokens.map((t) => {
    const s = t.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
    return s.length ? s : "\u2205";
  });
  const short = (s) => (s.length > 16 ? s.slice(0, 15) + "\u2026" : s);
  const fmt = (w) => w.toFixed(Math.min(D.decimals, 3));
  const headColor = (h) => "hsl(" + Math.round((h * 360) / Math.max(D.heads, 1) + 210) % 360 +
    ", 70%, 42%)";

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
  function matrix(l, h) {  // {n, values (n*n, in [0, 1])}
    if (D.mode === "full") return { n: T, values: D.weights[l][h].flat() };
    return { n: D.thumb_size, values: D.thumbs[l][h].map((v) => v / 255) };
  }
  function paint(canvas, l, h) {
    const m = matrix(l, h), n = m.n;
    canvas.width = n; canvas.height = n;
    const ctx = canvas.getContext("2d"), img = ctx.createImageData(n, n);
    let max = 0;
    for (const v of m.values) if (v > max) max = v;
    for (let p = 0; p < n * n; p++) {
      const t = max > 0 ? Math.sqrt(m.values[p] / max) : 0;  // sqrt: small weights stay visible
      img.data[4 * p] = Math.round(255 - t * (255 - 16));
      img.data[4 * p + 1] = Math.round(255 - t * (255 - 72));
      img.data[4 * p + 2] = Math.round(255 - t * (255 - 160));
      img.data[4 * p + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
  }

  // ---------------------------------------------------------------- static parts
  $("title").textContent = D.title;
  $("subtitle").textContent = D.subtitle;
  document.title = D.title;
  for (const note of D.notes) {
    const li = document.createElement("li");
    li.textContent = note;
    $("notes").appendChild(li);
  }
  for (const [id, n, name] of [["layer-select", D.layers, "layer"], ["head-select", D.heads,
                                                                       "head"]]) {
    const sel = $(id);
    for (let x = 0; x < n; x++) {
      const o = document.createElement("option");
      o.value = String(x); o.textContent = name + " " + x;
      sel.appendChild(o);
    }
    sel.addEventListener("change", () => {
      select(Number($("layer-select").value), Number($("head-select").value));
    });
  }
  $("head-legend").textContent = "Left: queries, right: keys. A line's opacity is the weight " +
    "(lines below " + D.min_line + " omitted)" +
    (D.mode === "topk" ? "; only each token's top " + D.topk + " weights are drawn." : ".");
  $("model-legend").textContent = "Rows are layers, columns heads; click a thumbnail to select " +
    "it. Each thumbnail is scaled to its own maximum" + (D.mode === "topk" ?
    " and max-pooled to " + D.thumb_size + "\u00d7" + D.thumb_size + " pixels." : ".");
  const maxEnt = Math.log(Math.max(2, D.mask.filter(Boolean).length));
  $("entropy-legend").textContent = "Mean over query rows of \u2212\u03a3 p log p (masked rows " +
    "skipped). 0 = every token attends to one key; log T = " + maxEnt.toFixed(2) +
    " = uniform over all " + D.mask.filter(Boolean).length + " tokens. Click a cell to select.";

  // Head view: two token columns and a layer of lines between them.
  const svg = $("head-view");
  const height = 2 * PAD + ROW * T + 16;
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
  const lines = document.createElementNS(SVGNS, "g");
  lines.setAttribute("id", "lines");
  svg.appendChild(lines);
  const qTok = [], kTok = [];
  for (const side of ["q", "k"]) {
    for (let i = 0; i < T; i++) {
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
      t.textContent = short(shown[i]);
      const tip = document.createElementNS(SVGNS, "title");
      tip.textContent = shown[i] + " (#" + i + ")";
      g.append(rect, t, tip);
      if (!D.mask[i]) g.classList.add("dim");
      g.addEventListener("mouseenter", () => { state.hover = { side: side, i: i }; render(); });
      g.addEventListener("mouseleave", () => { state.hover = null; render(); });
      g.addEventListener("click", () => {
        const same = state.pinned && state.pinned.side === side && state.pinned.i === i;
        state.pinned = same ? null : { side: side, i: i };
        render();
      });
      svg.appendChild(g);
      (side === "q" ? qTok : kTok).push(g);
    }
  }
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape") { state.pinned = null; render(); }
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
      td.title = e === null ? "no valid rows" : e.toFixed(D.decimals) + " nats";
      const t = e === null ? 0 : Math.min(1, e / maxEnt);  // light = diffuse, dark = focused
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

  function render() {
    const l = state.layer, h = state.head, f = focus(), color = headColor(h);
    $("layer-select").value = String(l); $("head-select").value = String(h);
    svg.setAttribute("data-layer", l); svg.setAttribute("data-head", h);
    svg.setAttribute("data-token", state.pinned && state.pinned.side === "q" ? state.pinned.i : -1);
    svg.setAttribute("data-key", state.pinned && state.pinned.side === "k" ? state.pinned.i : -1);
    svg.setAttribute("data-focus", f ? f.side + f.i : "");
    const e = D.entropy[l][h];
    $("selection-info").textContent = "Layer " + l + ", head " + h + " \u00b7 entropy " +
      (e === null ? "\u2013" : e.toFixed(3) + " nats");
    // Lines: all queries, or only the focused query (its row) / key (its column).
    const frag = document.createDocumentFragment();
    let pairs = [];
    if (f && f.side === "q") pairs = row(l, h, f.i).map(([j, w]) => [f.i, j, w]);
    else if (f && f.side === "k") pairs = column(l, h, f.i).map(([i, w]) => [i, f.i, w]);
    else {
      for (let i = 0; i < T; i++) {
        if (D.mask[i]) for (const [j, w] of row(l, h, i)) pairs.push([i, j, w]);
      }
    }
    pairs = pairs.filter((p) => p[2] >= D.min_line && D.mask[p[0]]);
    const strong = f ? 1 : 0.85;
    for (const [i, j, w] of pairs) {
      const ln = document.createElementNS(SVGNS, "line");
      ln.setAttribute("x1", LEFT_X + 4); ln.setAttribute("y1", y(i));
      ln.setAttribute("x2", RIGHT_X - 8); ln.setAttribute("y2", y(j));
      ln.setAttribute("stroke", color);
      ln.setAttribute("stroke-opacity", (strong * Math.min(1, w)).toFixed(4));
      ln.setAttribute("stroke-width", (1 + 3 * w).toFixed(2));
      ln.setAttribute("data-q", i); ln.setAttribute("data-k", j); ln.setAttribute("data-w", w);
      frag.appendChild(ln);
    }
    lines.replaceChildren(frag);
    svg.setAttribute("data-lines", pairs.length);
    // Token shading: the focused token in yellow, the other side by weight.
    const shade = new Map();
    for (const [i, j, w] of pairs) shade.set(f && f.side === "k" ? i : j, w);
    for (let i = 0; i < T; i++) {
      for (const [side, g] of [["q", qTok[i]], ["k", kTok[i]]]) {
        const isFocus = f && f.side === side && f.i === i;
        g.classList.toggle("focus", !!isFocus);
        g.classList.toggle("pinned", !!(state.pinned && state.pinned.side === side &&
                                        state.pinned.i === i));
        const other = f && f.side !== side;
        const r = g.firstChild;
        r.style.fillOpacity = isFocus ? "0.9" : other ? (0.6 * (shade.get(i) || 0)).toFixed(3)
          : "0";
        r.style.fill = isFocus ? "" : color;
      }
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
  big.id = "head-matrix";
  const wrap = document.createElement("div");
  wrap.className = "matrix-wrap";
  const band = document.createElement("div");
  band.id = "matrix-focus";
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
      const a = (100 * f.i) / T + "%", b = 100 / T + "%";
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
        "strongest weights here. The square is this head's attention matrix (rows: queries).";
      return;
    }
    let items;
    if (f.side === "q") {
      head.textContent = "\u201c" + shown[f.i] + "\u201d (#" + f.i + ") attends to";
      const re = D.row_entropy[l][h][f.i];
      p.textContent = "layer " + l + ", head " + h + (re === null ? " \u00b7 masked row" :
        " \u00b7 row entropy " + re.toFixed(3) + " nats") +
        (D.mode === "topk" ? " \u00b7 top " + D.topk + " stored" : "");
      items = row(l, h, f.i);
    } else {
      head.textContent = "Attention to \u201c" + shown[f.i] + "\u201d (#" + f.i + ") from";
      p.textContent = "layer " + l + ", head " + h;
      items = column(l, h, f.i);
    }
    items.sort((a, b) => b[1] - a[1] || a[0] - b[0]);
    const ul = document.createElement("ul");
    ul.className = "bars"; ul.id = "top-weights";
    for (const [j, w] of items.slice(0, 8)) {
      const li = document.createElement("li");
      li.setAttribute("data-index", j); li.setAttribute("data-w", w);
      const k = document.createElement("span");
      k.className = "k"; k.textContent = shown[j];
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

  window.attnlabViewer = { data: D, state: state, select: select, render: render };
  render();
  document.body.setAttribute("data-ready", "1");
})();
