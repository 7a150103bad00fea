// Line charts drawn as plain SVG by the page itself. A charting library would have to be vendored into the
// repository or fetched at setup, and the page must work offline; what the time view needs (lines over a time
// axis, a legend, a dragged selection) is this one small module.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#3a87c8", "#d9534f", "#4aa96c", "#e0a030", "#8e6bd1", "#2bb3b1", "#c2549d", "#6b7280"];
const SIZE = { width: 460, height: 150, left: 46, right: 8, top: 8, bottom: 20 };

function svg(name, attrs, parent) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (parent) parent.appendChild(node);
  return node;
}

function clock(seconds, withSeconds) {
  const t = new Date(seconds * 1000);
  const parts = { hour: "2-digit", minute: "2-digit", hour12: false };
  return t.toLocaleTimeString([], withSeconds ? { ...parts, second: "2-digit" } : parts);
}

function roundTicks(max) {
  // Three gridlines at round values: 1, 2 or 5 times a power of ten.
  const raw = max / 3;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
  return [step, 2 * step, 3 * step];
}

function compact(value) {
  if (value >= 1000) return `${+(value / 1000).toFixed(1)}k`;
  return value >= 10 ? String(Math.round(value)) : String(+value.toFixed(2));
}

class LineChart {
  // One chart: a title, an SVG plot and a legend. `onSelect(fromS, toS)` is called when a span of time is dragged.
  constructor(parent, id, title, onSelect) {
    this.figure = document.createElement("figure");
    this.figure.className = "chart";
    this.figure.dataset.chart = id;
    const caption = document.createElement("figcaption");
    caption.textContent = title;
    this.svg = svg("svg", { viewBox: `0 0 ${SIZE.width} ${SIZE.height}`, role: "img", "aria-label": title });
    this.legend = document.createElement("div");
    this.legend.className = "chart-legend";
    this.figure.append(caption, this.svg, this.legend);
    parent.appendChild(this.figure);
    this.onSelect = onSelect;
    this.range = null;
    this.selection = null;
    this.brush();
  }

  x(t) {
    const [from, to] = this.range;
    return SIZE.left + ((t - from) / Math.max(1e-9, to - from)) * (SIZE.width - SIZE.left - SIZE.right);
  }

  timeAt(clientX) {
    const box = this.svg.getBoundingClientRect();
    const x = ((clientX - box.left) / box.width) * SIZE.width;
    const [from, to] = this.range;
    const share = (x - SIZE.left) / (SIZE.width - SIZE.left - SIZE.right);
    return from + Math.min(1, Math.max(0, share)) * (to - from);
  }

  // lines: [{key, label, values}], values aligned with times (null where nothing was sampled).
  draw(times, step, lines) {
    this.range = [times[0], times[times.length - 1] + step];
    this.svg.replaceChildren();
    this.legend.replaceChildren();
    const plotBottom = SIZE.height - SIZE.bottom;
    const max = Math.max(0, ...lines.flatMap((line) => line.values.filter((v) => v !== null)));
    const ticks = roundTicks(max > 0 ? max : 1);
    const top = ticks[2];
    const y = (v) => plotBottom - (v / top) * (plotBottom - SIZE.top);
    for (const tick of [0, ...ticks]) {
      svg("line", { x1: SIZE.left, x2: SIZE.width - SIZE.right, y1: y(tick), y2: y(tick), class: "grid" }, this.svg);
      svg("text", { x: SIZE.left - 4, y: y(tick) + 3, class: "tick y" }, this.svg).textContent = compact(tick);
    }
    const span = this.range[1] - this.range[0];
    for (let i = 0; i <= 3; i++) {
      const t = this.range[0] + (i * span) / 3;
      const anchor = ["start", "middle", "middle", "end"][i];
      const label = svg("text", { x: this.x(t), y: SIZE.height - 5, class: "tick x", "text-anchor": anchor }, this.svg);
      label.textContent = clock(t, span < 600);
    }
    lines.forEach((line, i) => {
      const colour = PALETTE[i % PALETTE.length];
      // Points at the middle of their step; a gap where nothing was sampled.
      // A point with no neighbour is drawn as a dot (a zero-length segment with round caps).
      let d = "";
      line.values.forEach((v, j) => {
        if (v === null) return;
        const joined = j > 0 && line.values[j - 1] !== null;
        const alone = !joined && (j + 1 >= line.values.length || line.values[j + 1] === null);
        d += `${joined ? "L" : "M"}${this.x(times[j] + step / 2).toFixed(1)},${y(v).toFixed(1)}${alone ? "h0" : ""}`;
      });
      const path = svg("path", { d: d || "M0,0", class: "line", stroke: colour }, this.svg);
      path.dataset.key = line.key;
      path.dataset.values = JSON.stringify(line.values);
      const item = document.createElement("span");
      item.className = "legend-item";
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = colour;
      item.append(swatch, line.label);
      this.legend.appendChild(item);
    });
    if (lines.length === 0) {
      svg("text", { x: SIZE.width / 2, y: SIZE.height / 2, class: "empty" }, this.svg).textContent = "no data";
    }
    this.band = svg("rect", { y: SIZE.top, height: plotBottom - SIZE.top, class: "selection" }, this.svg);
    this.showSelection(this.selection);
  }

  showSelection(selection) {
    this.selection = selection;
    if (!this.band) return;
    if (!selection || !this.range) {
      this.band.setAttribute("width", 0);
      return;
    }
    const [a, b] = [this.x(Math.max(selection[0], this.range[0])), this.x(Math.min(selection[1], this.range[1]))];
    this.band.setAttribute("x", Math.min(a, b));
    this.band.setAttribute("width", Math.max(0, Math.abs(b - a)));
  }

  brush() {
    let start = null;
    this.svg.addEventListener("pointerdown", (event) => {
      if (!this.range) return;
      start = this.timeAt(event.clientX);
      this.svg.setPointerCapture(event.pointerId);
    });
    this.svg.addEventListener("pointermove", (event) => {
      if (start !== null) this.showSelection([start, this.timeAt(event.clientX)].sort((a, b) => a - b));
    });
    this.svg.addEventListener("pointerup", (event) => {
      if (start === null) return;
      const [from, to] = [start, this.timeAt(event.clientX)].sort((a, b) => a - b);
      start = null;
      if (to - from > 0) this.onSelect(from, to);
    });
  }
}
