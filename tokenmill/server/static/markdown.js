// A small Markdown renderer for model replies that builds DOM nodes and never parses HTML:
// whatever the model writes (<script>, <img onerror>, ...) ends up as text. Covers what chat
// replies use: fenced code, headings, lists, quotes, paragraphs, `code`, **bold**, *italic*, links.

// (__bold__ is left out: it would mangle identifiers like __init__ in prose)
const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g;

function inline(parent, text) {
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > last) parent.append(document.createTextNode(text.slice(last, match.index)));
    const [, ticks, code, bold, italic, linkText, href] = match;
    if (ticks) {
      const node = document.createElement("code");
      node.textContent = code;
      parent.append(node);
    } else if (bold) {
      const node = document.createElement("strong");
      inline(node, bold);
      parent.append(node);
    } else if (italic) {
      const node = document.createElement("em");
      inline(node, italic);
      parent.append(node);
    } else {
      const node = document.createElement("a");
      node.href = href;  // http(s) only, by the pattern
      node.rel = "noopener noreferrer nofollow";
      node.target = "_blank";
      node.textContent = linkText;
      parent.append(node);
    }
    last = match.index + match[0].length;
  }
  if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
}

function paragraph(parent, lines) {
  const p = document.createElement("p");
  lines.forEach((line, i) => {
    if (i) p.append(document.createElement("br"));
    inline(p, line);
  });
  parent.append(p);
}

// Render `text` (possibly a reply still streaming: an open fence is code up to the end) into `root`.
export function renderMarkdown(root, text) {
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  const blocks = document.createDocumentFragment();
  let i = 0;
  let para = [];
  const flush = () => {
    if (para.length) paragraph(blocks, para);
    para = [];
  };
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(```+|~~~+)\s*([\w+-]*)/);
    if (fence) {
      flush();
      const code = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) code.push(lines[i++]);
      i += 1;
      const pre = document.createElement("pre");
      const node = document.createElement("code");
      if (fence[2]) node.dataset.lang = fence[2];
      node.textContent = code.join("\n");
      pre.append(node);
      blocks.append(pre);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
    if (heading) {
      flush();
      const node = document.createElement(`h${Math.min(6, heading[1].length + 2)}`);
      inline(node, heading[2]);
      blocks.append(node);
    } else if (item) {
      flush();
      const ordered = /\d/.test(item[1]);
      const list = document.createElement(ordered ? "ol" : "ul");
      while (i < lines.length) {
        const m = lines[i].match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
        if (!m || /\d/.test(m[1]) !== ordered) break;
        const li = document.createElement("li");
        inline(li, m[2]);
        list.append(li);
        i += 1;
      }
      blocks.append(list);
      continue;
    } else if (line.startsWith(">")) {
      flush();
      const quote = document.createElement("blockquote");
      const quoted = [];
      while (i < lines.length && lines[i].startsWith(">")) quoted.push(lines[i++].replace(/^>\s?/, ""));
      paragraph(quote, quoted);
      blocks.append(quote);
      continue;
    } else if (!line.trim()) {
      flush();
    } else {
      para.push(line);
    }
    i += 1;
  }
  flush();
  root.replaceChildren(blocks);
}
