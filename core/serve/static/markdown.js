// bestiary's Markdown renderer for the web chat (written by hand: no dependency, nothing fetched).
//
// renderMarkdown(source) -> DocumentFragment. Safe by construction: it never parses HTML (no
// innerHTML anywhere); every character of the source ends in a text node or inside an element of a
// fixed set of tags, so `<script>` or `<img onerror=...>` in model output show as text. A link gets
// an href only when its URL parses as an absolute http: or https: URL; any other link (javascript:,
// data:, relative) is shown as its Markdown source text.
//
// Made for streaming: every prefix of an answer renders. An unclosed ``` fence is an open code
// block holding the lines so far; an unclosed ** or ` is literal text until its closer arrives.
//
// Blocks: paragraphs (a single newline is a line break, as in GitHub comments), ATX and setext
// headings, fenced code blocks (``` or ~~~, with the language and a Copy button), bullet and
// ordered lists (nested by indentation), blockquotes, horizontal rules, GFM tables.
// Inline: emphasis, strong, ~~strikethrough~~, `code`, [links](url "title"), <autolinks>, bare
// http(s) URLs, backslash escapes. Nesting deeper than MAX_DEPTH and bracket searches longer than
// MAX_SCAN characters are shown as text, so a hostile answer costs linear time and a bounded stack.
"use strict";

const renderMarkdown = (() => {
  const MAX_DEPTH = 12;    // nested blocks (quotes, lists) or inline spans (emphasis, links)
  const MAX_SCAN = 2000;   // characters searched for a link's closing bracket and its URL
  const FENCE = /^( {0,3})(`{3,}|~{3,})[ \t]*([^\s`]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
  const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:[ \t]+(.*))?$/;
  const SETEXT = /^ {0,3}(=+|-+)[ \t]*$/;
  const TABLE_RULE = /^ {0,3}\|?[ \t]*:?-+:?[ \t]*(\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*$/;
  const PUNCT = /[!-/:-@[-`{-~]/;
  const WORD = /[\p{L}\p{N}]/u;

  function el(tag, children, className) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (children) node.append(...children);
    return node;
  }

  function text(value) {
    return document.createTextNode(value);
  }

  function indentOf(line) {
    return line.length - line.trimStart().length;
  }

  // --- blocks: each parser takes (lines, i[, depth]) and returns {node, next} or null ---------

  function parseBlocks(lines, depth) {
    const nodes = [];
    let i = 0;
    while (i < lines.length) {
      if (!lines[i].trim()) { i += 1; continue; }
      const block = fence(lines, i) || heading(lines, i) || rule(lines, i) || table(lines, i)
        || (depth < MAX_DEPTH && (quote(lines, i, depth) || list(lines, i, depth))) || paragraph(lines, i);
      nodes.push(block.node);
      i = block.next;
    }
    return nodes;
  }

  // Whether line i ends a paragraph before it (a block that may interrupt one, as in CommonMark).
  function interrupts(lines, i) {
    const line = lines[i];
    if (FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || tableStart(lines, i)) return true;
    const item = ITEM.exec(line);
    return Boolean(item && item[3] && item[3].trim() && (!/\d/.test(item[2][0]) || parseInt(item[2], 10) === 1));
  }

  function paragraph(lines, i) {
    let j = i + 1;
    while (j < lines.length && lines[j].trim() && !SETEXT.test(lines[j]) && !interrupts(lines, j)) j += 1;
    const body = lines.slice(i, j).map((line) => line.trim()).join("\n");
    if (j < lines.length && SETEXT.test(lines[j]) && j > i) {  // Title\n=== or Title\n---
      return { node: el(lines[j].trim()[0] === "=" ? "h1" : "h2", inline(body, 0)), next: j + 1 };
    }
    return { node: el("p", inline(body, 0)), next: j };
  }

  function heading(lines, i) {
    const m = HEADING.exec(lines[i]);
    return m && { node: el(`h${m[1].length}`, inline(m[2] || "", 0)), next: i + 1 };
  }

  function rule(lines, i) {
    return RULE.test(lines[i]) ? { node: el("hr"), next: i + 1 } : null;
  }

  // ```lang ... ``` (or ~~~): the lines verbatim; without its closing fence the block runs to the end.
  function fence(lines, i) {
    const m = FENCE.exec(lines[i]);
    if (!m) return null;
    const [, indent, marks, lang] = m;
    const closer = new RegExp(`^ {0,3}${marks[0]}{${marks.length},}[ \\t]*$`);
    let j = i + 1;
    while (j < lines.length && !closer.test(lines[j])) j += 1;
    const code = lines.slice(i + 1, j).map((line) => line.slice(Math.min(indent.length, indentOf(line)))).join("\n");
    return { node: codeBlock(code, lang), next: j + 1 };
  }

  function codeBlock(code, lang) {
    const codeNode = el("code", [text(code)]);
    if (lang) codeNode.dataset.lang = lang;
    const copy = el("button", [text("Copy")], "copy");
    copy.type = "button";
    copy.addEventListener("click", () => copyCode(codeNode, copy));
    const head = el("div", [el("span", [text(lang || "code")], "lang"), copy], "code-head");
    return el("div", [head, el("pre", [codeNode])], "code-block");
  }

  function copyCode(codeNode, button) {
    const done = (label) => {
      button.textContent = label;
      setTimeout(() => { button.textContent = "Copy"; }, 1500);
    };
    const selectIt = () => {  // no clipboard API outside a secure context (http:// to another host)
      const range = document.createRange();
      range.selectNodeContents(codeNode);
      window.getSelection().removeAllRanges();
      window.getSelection().addRange(range);
      done(document.execCommand("copy") ? "Copied" : "Press Ctrl+C");
    };
    if (!navigator.clipboard) { selectIt(); return; }
    navigator.clipboard.writeText(codeNode.textContent).then(() => done("Copied"), selectIt);
  }

  function quote(lines, i, depth) {
    let j = i;
    while (j < lines.length && QUOTE.test(lines[j])) j += 1;
    if (j === i) return null;
    const inner = lines.slice(i, j).map((line) => QUOTE.exec(line)[1]);
    return { node: el("blockquote", parseBlocks(inner, depth + 1)), next: j };
  }

  // One list: items whose markers sit less than 2 columns right of the first's; deeper lines (and
  // blank lines followed by deeper ones) belong to the item above, parsed as blocks (nested lists).
  function list(lines, i, depth) {
    const first = ITEM.exec(lines[i]);
    if (!first) return null;
    const indent = first[1].length;
    const ordered = /\d/.test(first[2][0]);
    const node = el(ordered ? "ol" : "ul");
    const start = parseInt(first[2], 10);
    if (ordered && start !== 1) node.start = start;
    let j = i;
    for (;;) {
      const m = j < lines.length && ITEM.exec(lines[j]);
      if (!m || m[1].length >= indent + 2 || /\d/.test(m[2][0]) !== ordered) break;
      const item = itemLines(lines, j + 1, indent, indent + m[2].length + 1);
      const blocks = parseBlocks([m[3] || "", ...item.lines], depth + 1);
      if (blocks[0] && blocks[0].tagName === "P") blocks.splice(0, 1, ...blocks[0].childNodes);  // "- a": <li>a</li>
      node.append(el("li", blocks));
      j = item.next;
      while (j < lines.length && !lines[j].trim()) j += 1;  // a blank line between items
    }
    return { node, next: j };
  }

  // The lines of an item from line j on (dedented by up to `offset`) and the index after them.
  function itemLines(lines, j, indent, offset) {
    const body = [];
    let k = j;
    while (k < lines.length) {
      const line = lines[k];
      if (!line.trim()) {
        let next = k + 1;
        while (next < lines.length && !lines[next].trim()) next += 1;
        if (next >= lines.length || indentOf(lines[next]) < indent + 2) break;
      } else if (indentOf(line) < indent + 2) {
        const sibling = ITEM.test(line);
        const lazy = body.length > 0 && body[body.length - 1].trim() && !interrupts(lines, k);
        if (sibling || !(lazy || (k === j && !interrupts(lines, k)))) break;
      }
      body.push(line.slice(Math.min(offset, indentOf(line))));
      k += 1;
    }
    return { lines: body, next: k };
  }

  // | a | b |\n|---|:-:|\n| 1 | 2 |: a header row, a delimiter row of as many cells, body rows.
  function tableStart(lines, i) {
    const rule = lines[i + 1];
    return i + 1 < lines.length && lines[i].includes("|") && rule.includes("|") && TABLE_RULE.test(rule)
      && cells(lines[i]).length === cells(rule).length;
  }

  function cells(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    return s.split(/(?<!\\)\|/).map((cell) => cell.trim());
  }

  function table(lines, i) {
    if (!tableStart(lines, i)) return null;
    const align = cells(lines[i + 1]).map((c) => {
      if (c.startsWith(":") && c.endsWith(":")) return "align-center";
      return c.endsWith(":") ? "align-right" : c.startsWith(":") ? "align-left" : "";
    });
    const row = (line, tag) => {
      const values = cells(line);
      return el("tr", align.map((a, k) => el(tag, inline(values[k] || "", 0), a)));
    };
    let j = i + 2;
    const body = [];
    while (j < lines.length && lines[j].includes("|") && lines[j].trim() && !interrupts(lines, j)) {
      body.push(row(lines[j], "td"));
      j += 1;
    }
    const node = el("table", [el("thead", [row(lines[i], "th")]), el("tbody", body)]);
    return { node: el("div", [node], "table-wrap"), next: j };
  }

  // --- inline spans ---------------------------------------------------------------------------

  // The nodes of one paragraph's (or heading's, or cell's) text; a newline becomes a <br>.
  function inline(s, depth, inLink = false) {
    const nodes = [];
    const failed = new Set();  // delimiter runs ("**", "`") known to have no closer in s
    let buffer = "";
    const flush = () => { if (buffer) nodes.push(text(buffer)); buffer = ""; };
    let i = 0;
    while (i < s.length) {
      const c = s[i];
      if (c === "\\" && i + 1 < s.length && PUNCT.test(s[i + 1])) { buffer += s[i + 1]; i += 2; continue; }
      if (c === "\n") { flush(); nodes.push(el("br")); i += 1; continue; }
      const span = depth >= MAX_DEPTH ? null : c === "`" ? codeSpan(s, i, failed)
        : "*_~".includes(c) ? emphasis(s, i, depth, failed, inLink)
          : inLink ? null : c === "[" || (c === "!" && s[i + 1] === "[") ? link(s, i, depth)
            : c === "<" ? autolink(s, i) : c === "h" ? bareUrl(s, i) : null;
      if (span) {
        flush();
        nodes.push(span.node);
        i = span.next;
      } else {  // a delimiter run that opens nothing is text as a whole
        const run = "`*_~".includes(c) ? runLength(s, i) : 1;
        buffer += s.slice(i, i + run);
        i += run;
      }
    }
    flush();
    return nodes;
  }

  function runLength(s, i) {
    let j = i;
    while (j < s.length && s[j] === s[i]) j += 1;
    return j - i;
  }

  // `code`: a run of n backticks up to the next run of exactly n.
  function codeSpan(s, i, failed) {
    const n = runLength(s, i);
    const key = "`".repeat(n);
    if (failed.has(key)) return null;
    for (let j = s.indexOf(key, i + n); j >= 0; j = s.indexOf(key, j + runLength(s, j))) {
      if (runLength(s, j) !== n) continue;
      let code = s.slice(i + n, j).replace(/\n/g, " ");
      if (code.length > 2 && code.startsWith(" ") && code.endsWith(" ") && code.trim()) code = code.slice(1, -1);
      return { node: el("code", [text(code)]), next: j + n };
    }
    failed.add(key);
    return null;
  }

  // *em*, **strong**, ***both***, _em_, __strong__, ~~del~~: an opener followed by non-space, up to
  // the first run of the same character at least as long, after non-space (its last n characters
  // close). An underscore run does not open or close inside a word (snake_case stays as it is).
  function emphasis(s, i, depth, failed, inLink) {
    const c = s[i];
    const n = runLength(s, i);
    if (n > 3 || (c === "~" && n !== 2) || i + n >= s.length || /\s/.test(s[i + n])) return null;
    if (c === "_" && i > 0 && WORD.test(s[i - 1])) return null;
    const key = c.repeat(n);
    if (failed.has(key)) return null;
    for (let j = i + n; j < s.length;) {
      if (s[j] === "\\") { j += 2; continue; }
      if (s[j] === "`") { const code = codeSpan(s, j, failed); j = code ? code.next : j + runLength(s, j); continue; }
      const run = s[j] === c ? runLength(s, j) : 0;
      if (run >= n && !/\s/.test(s[j - 1]) && !(c === "_" && WORD.test(s[j + run] || ""))) {
        const end = j + run - n;
        const inner = inline(s.slice(i + n, end), depth + 1, inLink);
        const node = c === "~" ? el("del", inner) : n === 1 ? el("em", inner) : n === 2 ? el("strong", inner)
          : el("strong", [el("em", inner)]);
        return { node, next: j + run };
      }
      j += Math.max(run, 1);
    }
    failed.add(key);
    return null;
  }

  // The index of the bracket closing the one at i (nested pairs skipped), or -1.
  function closingBracket(s, i) {
    let level = 0;
    for (let j = i; j < s.length && j < i + MAX_SCAN; j += 1) {
      if (s[j] === "\\") j += 1;
      else if (s[j] === "[") level += 1;
      else if (s[j] === "]" && --level === 0) return j;
    }
    return -1;
  }

  // (url "title") at i: {url, title, next} or null; the URL may hold balanced parentheses.
  function destination(s, i) {
    const m = /^\(\s*(<[^<>\n]*>|(?:[^\s()\\]|\\.|\((?:[^\s()\\]|\\.)*\))*)(?:\s+("[^"]*"|'[^']*'))?\s*\)/
      .exec(s.slice(i, i + MAX_SCAN));
    if (!m) return null;
    const url = m[1].startsWith("<") ? m[1].slice(1, -1) : m[1].replace(/\\([!-/:-@[-`{-~])/g, "$1");
    return { url, title: m[2] ? m[2].slice(1, -1) : "", next: i + m[0].length };
  }

  // The URL to link to: an absolute http(s) URL, else null (javascript:, data:, relative, ...).
  function safeUrl(raw) {
    try {
      const url = new URL(raw);
      return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
    } catch (_) {
      return null;
    }
  }

  function anchor(href, children, title) {
    const a = el("a", children);
    a.href = href;
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    if (title) a.title = title;
    return a;
  }

  // [text](url "title"); ![alt](url) becomes a link to the image (no image is loaded).
  function link(s, i, depth) {
    const image = s[i] === "!";
    const open = image ? i + 1 : i;
    const close = closingBracket(s, open);
    if (close < 0 || s[close + 1] !== "(") return null;
    const dest = destination(s, close + 1);
    if (!dest) return null;
    const href = safeUrl(dest.url);
    if (!href) return { node: text(s.slice(i, dest.next)), next: dest.next };  // shown as its source
    const label = s.slice(open + 1, close);
    const children = image ? [text(label || "image")] : inline(label, depth + 1, true);
    return { node: anchor(href, children, dest.title), next: dest.next };
  }

  function autolink(s, i) {
    const m = /^<(https?:\/\/[^\s<>]+)>/.exec(s.slice(i, i + MAX_SCAN));
    const href = m && safeUrl(m[1]);
    return href ? { node: anchor(href, [text(m[1])]), next: i + m[0].length } : null;
  }

  // https://... in running text, without trailing punctuation or an unbalanced ")".
  function bareUrl(s, i) {
    if (i > 0 && WORD.test(s[i - 1])) return null;
    const m = /^https?:\/\/[^\s<>"]+/.exec(s.slice(i, i + MAX_SCAN));
    if (!m) return null;
    let url = m[0].replace(/[.,:;!?'*_~]+$/, "");
    while (url.endsWith(")") && url.split("(").length < url.split(")").length) url = url.slice(0, -1);
    const href = safeUrl(url);
    return href && url.length > m[0].indexOf("//") + 2 ? { node: anchor(href, [text(url)]), next: i + url.length } : null;
  }

  return (source) => {
    const fragment = document.createDocumentFragment();
    fragment.append(...parseBlocks(source.replace(/\r\n?/g, "\n").split("\n"), 0));
    return fragment;
  };
})();
