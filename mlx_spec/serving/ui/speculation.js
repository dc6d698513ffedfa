// What speculation did for one reply, from the stream's trace: each token's kind and drafter
// (for colouring), the live counts, and the chart of acceptance by draft position.

const SVG = "http://www.w3.org/2000/svg";
const KIND_TITLES = {
  draft: "accepted draft token",
  recovered: "recovered: the target's token after a rejected draft",
  bonus: "bonus: the target's token after every draft was accepted",
  plain: "plain step: nothing was drafted",
};
const drafterSlots = new Map(); // drafter name -> colour slot, stable for the page's life

export function drafterSlot(name) {
  if (!drafterSlots.has(name)) drafterSlots.set(name, drafterSlots.size % 6);
  return drafterSlots.get(name);
}

export function knownDrafters() {
  return [...drafterSlots.keys()];
}

export class Trace {
  constructor() {
    this.marks = []; // {start, end, kind, drafter, drafted}
    this.length = 0; // characters covered so far
    this.tokens = 0;
    this.drafts = 0; // accepted drafts
    this.rounds = 0; // rounds closed by the target's own token
    this.drafted = 0;
    this.run = 0; // accepted drafts since the last closing token
    this.draftedAt = []; // per draft position: rounds that drafted it
    this.acceptedAt = [];
    this.summary = null;
    this.started = null; // time of the first token
    this.last = null; // time of the latest token
  }

  // The tokens of one chunk, whose texts follow what is covered so far.
  add(tokens, now) {
    for (const t of tokens) {
      const end = this.length + t.text.length;
      this.marks.push({ start: this.length, end, kind: t.kind, drafter: t.drafter });
      this.length = end;
      this.tokens++;
      if (t.kind === "draft") {
        this.drafts++;
        this.run++;
        if (t.drafter) drafterSlot(t.drafter);
      } else {
        this.close(t.drafted || 0);
      }
    }
    if (tokens.length) {
      if (this.started === null) this.started = now;
      this.last = now;
    }
  }

  close(drafted) {
    this.rounds++;
    this.drafted += drafted;
    for (let i = 0; i < drafted; i++) {
      this.draftedAt[i] = (this.draftedAt[i] || 0) + 1;
      this.acceptedAt[i] = (this.acceptedAt[i] || 0) + (i < this.run ? 1 : 0);
    }
    this.run = 0;
  }

  finish(summary) {
    this.summary = summary;
  }

  // The numbers of the live line (the final summary's, once it came).
  numbers(plainRate) {
    const s = this.summary;
    const seconds = this.started === null ? 0 : (this.last - this.started) / 1000;
    const rate = s ? s.decode_tokens_per_sec : (seconds > 0 ? (this.tokens - 1) / seconds : 0);
    let speedup = s ? s.speedup_estimate : null;
    if (speedup === null && plainRate) speedup = rate / plainRate;
    return {
      tokens: s ? s.generated_tokens : this.tokens,
      rate,
      acceptance: s ? s.acceptance_rate : (this.drafted ? this.drafts / this.drafted : 0),
      meanLength: s ? s.mean_accepted_length : (this.rounds ? this.tokens / this.rounds : 0),
      speedup,
      drafted: s ? s.drafted_tokens : this.drafted,
    };
  }

  // Per draft position: acceptance (rounds that kept it / rounds that drafted it).
  byPosition() {
    const s = this.summary;
    const drafted = s ? s.drafted_per_position : this.draftedAt;
    const accepted = s ? s.accepted_per_position : this.acceptedAt;
    return drafted.map((d, i) => ({ rate: d ? (accepted[i] || 0) / d : 0, rounds: d || 0 }));
  }

  // A `put` for markdown.js: the text of `src[start:end]` in spans, one per token piece.
  painter(src, coloured) {
    const marks = this.marks;
    return (parent, start, end) => {
      if (!coloured) {
        parent.append(document.createTextNode(src.slice(start, end)));
        return;
      }
      let i = firstMark(marks, start);
      let at = start;
      while (at < end) {
        const mark = i < marks.length && marks[i].start < end ? marks[i] : null;
        if (!mark) {
          parent.append(document.createTextNode(src.slice(at, end)));
          return;
        }
        if (mark.start > at) parent.append(document.createTextNode(src.slice(at, mark.start)));
        const from = Math.max(at, mark.start);
        const to = Math.min(end, mark.end);
        if (to > from) parent.append(tokenSpan(src.slice(from, to), mark));
        at = Math.max(to, at);
        i++;
      }
    };
  }
}

// The index of the first mark that ends after `offset` (marks are sorted, contiguous).
function firstMark(marks, offset) {
  let lo = 0;
  let hi = marks.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (marks[mid].end <= offset) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

function tokenSpan(text, mark) {
  const span = document.createElement("span");
  span.className = "tok " + mark.kind;
  if (mark.kind === "draft" && mark.drafter) span.classList.add("d" + drafterSlot(mark.drafter));
  span.title = KIND_TITLES[mark.kind] + (mark.drafter ? " (" + mark.drafter + ")" : "");
  span.textContent = text;
  return span;
}

// A small bar chart: acceptance at each draft position.
export function positionChart(positions) {
  const width = 16;
  const height = 40;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("width", String(Math.max(positions.length, 1) * (width + 4)));
  svg.setAttribute("height", String(height + 14));
  svg.setAttribute("role", "img");
  positions.forEach((p, i) => {
    const bar = document.createElementNS(SVG, "rect");
    const h = Math.max(1, Math.round(p.rate * height));
    bar.setAttribute("x", String(i * (width + 4)));
    bar.setAttribute("y", String(height - h));
    bar.setAttribute("width", String(width));
    bar.setAttribute("height", String(h));
    const title = document.createElementNS(SVG, "title");
    title.textContent = `position ${i + 1}: ${(p.rate * 100).toFixed(0)}% of ${p.rounds} rounds`;
    bar.append(title);
    const label = document.createElementNS(SVG, "text");
    label.setAttribute("x", String(i * (width + 4) + width / 2));
    label.setAttribute("y", String(height + 12));
    label.textContent = String(i + 1);
    svg.append(bar, label);
  });
  return svg;
}

export function formatLine(n, withTokens) {
  const parts = [];
  if (withTokens) parts.push(`${n.tokens} tokens`);
  parts.push(`${n.rate.toFixed(1)} tok/s`);
  if (n.drafted) {
    parts.push(`acceptance ${(n.acceptance * 100).toFixed(0)}%`);
    parts.push(`${n.meanLength.toFixed(2)} tokens/pass`);
  } else {
    parts.push("no drafts");
  }
  parts.push(n.speedup ? `speedup ≈ ×${n.speedup.toFixed(2)}` : "speedup —");
  return parts.join(" · ");
}
