// A small, safe Markdown renderer: builds DOM nodes, never parses HTML. Every piece of text goes
// through `put(parent, start, end)` with its offsets in the source, so the caller can split it
// into the spans of the tokens that wrote it.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+/;
const QUOTE = /^ {0,3}>\s?/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const LINK = /\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/y;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

// The source's lines, each with its offsets.
function splitLines(src) {
  const out = [];
  let i = 0;
  for (;;) {
    let j = src.indexOf("\n", i);
    if (j < 0) j = src.length;
    out.push({ start: i, end: j, text: src.slice(i, j) });
    if (j >= src.length) return out;
    i = j + 1;
  }
}

// Renders `src` into `root` (which it empties first).
export function render(src, root, put) {
  root.replaceChildren();
  const lines = splitLines(src);
  let i = 0;
  while (i < lines.length) {
    i = block(src, lines, i, root, put);
  }
}

// Renders the block that starts at line `i`; returns the index of the line after it.
function block(src, lines, i, root, put) {
  const line = lines[i];
  if (!line.text.trim()) return i + 1;
  const fence = FENCE.exec(line.text);
  if (fence) return codeBlock(lines, i, fence, root, put);
  const heading = HEADING.exec(line.text);
  if (heading) {
    const h = el("h" + Math.min(heading[1].length + 2, 6));
    inline(src, line.start + heading[0].length, line.end, h, put);
    root.append(h);
    return i + 1;
  }
  if (RULE.test(line.text)) {
    root.append(el("hr"));
    return i + 1;
  }
  if (ITEM.test(line.text)) return list(src, lines, i, root, put);
  if (QUOTE.test(line.text)) {
    const quote = el("blockquote");
    while (i < lines.length && QUOTE.test(lines[i].text)) {
      const start = lines[i].start + QUOTE.exec(lines[i].text)[0].length;
      lineInto(src, start, lines[i].end, quote, put, i + 1 < lines.length);
      i++;
    }
    root.append(quote);
    return i;
  }
  return paragraph(src, lines, i, root, put);
}

function startsBlock(text) {
  return !text.trim() || FENCE.test(text) || HEADING.test(text) || ITEM.test(text) ||
    QUOTE.test(text) || RULE.test(text);
}

// A line's inline content, then its line break (kept: the paragraphs preserve white space).
function lineInto(src, start, end, parent, put, more) {
  inline(src, start, end, parent, put);
  if (more) put(parent, end, end + 1);
}

function paragraph(src, lines, i, root, put) {
  const p = el("p");
  let first = true;
  while (i < lines.length && (first || !startsBlock(lines[i].text))) {
    const last = i + 1 >= lines.length || startsBlock(lines[i + 1].text);
    lineInto(src, lines[i].start, lines[i].end, p, put, !last);
    first = false;
    i++;
  }
  root.append(p);
  return i;
}

// A fenced code block; unclosed (still streaming), it runs to the end.
function codeBlock(lines, i, fence, root, put) {
  const pre = el("pre");
  const code = el("code");
  if (fence[2]) {
    code.dataset.lang = fence[2];
    const label = el("span", "lang");
    label.textContent = fence[2];
    pre.append(label);
  }
  const marker = fence[1];
  let j = i + 1;
  while (j < lines.length && !lines[j].text.trimStart().startsWith(marker)) j++;
  if (j > i + 1) put(code, lines[i + 1].start, lines[j - 1].end);
  pre.append(code);
  root.append(pre);
  return j + 1;
}

function list(src, lines, i, root, put) {
  const ordered = /\d/.test(ITEM.exec(lines[i].text)[2]);
  const node = el(ordered ? "ol" : "ul");
  let item = null;
  while (i < lines.length) {
    const line = lines[i];
    const match = ITEM.exec(line.text);
    if (match && /\d/.test(match[2]) === ordered) {
      item = el("li");
      node.append(item);
      inline(src, line.start + match[0].length, line.end, item, put);
    } else if (item && line.text.trim() && !startsBlock(line.text)) {
      put(item, line.start - 1, line.start); // a continuation line: its line break
      inline(src, line.start, line.end, item, put);
    } else {
      break;
    }
    i++;
  }
  root.append(node);
  return i;
}

function isWord(c) {
  return c !== undefined && /[\p{L}\p{N}]/u.test(c);
}

// The closing `mark` of an emphasis opened before `from`, within `end` (-1: none).
function closing(src, mark, from, end) {
  for (let j = src.indexOf(mark, from); j >= 0 && j + mark.length <= end;
    j = src.indexOf(mark, j + 1)) {
    if (src[j - 1] === " ") continue;
    if (mark.length === 1 && src[j + 1] === mark) { j++; continue; }
    if (mark[0] === "_" && isWord(src[j + mark.length])) continue;
    return j;
  }
  return -1;
}

// Inline Markdown of `src[start:end]`: code spans, strong, emphasis and http(s) links.
function inline(src, start, end, parent, put) {
  let text = start;
  let i = start;
  const flush = (to) => {
    if (to > text) put(parent, text, to);
  };
  while (i < end) {
    const c = src[i];
    let next = -1;
    if (c === "`") {
      const j = src.indexOf("`", i + 1);
      if (j > i + 1 && j < end) {
        flush(i);
        const code = el("code");
        put(code, i + 1, j);
        parent.append(code);
        next = j + 1;
      }
    } else if ((c === "*" || c === "_") && !(c === "_" && isWord(src[i - 1]))) {
      const mark = src[i + 1] === c ? c + c : c;
      const from = i + mark.length;
      const j = src[from] === " " ? -1 : closing(src, mark, from + 1, end);
      if (j > from) {
        flush(i);
        const node = el(mark.length === 2 ? "strong" : "em");
        inline(src, from, j, node, put);
        parent.append(node);
        next = j + mark.length;
      }
    } else if (c === "[") {
      LINK.lastIndex = i;
      const match = LINK.exec(src);
      if (match && i + match[0].length <= end) {
        flush(i);
        const a = el("a");
        a.href = match[2]; // an http(s) address only: the pattern allows no other scheme
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        put(a, i + 1, i + 1 + match[1].length);
        parent.append(a);
        next = i + match[0].length;
      }
    }
    if (next < 0) {
      i++;
    } else {
      i = text = next;
    }
  }
  flush(end);
}
