// Markdown to safe HTML for answers: `marked` (vendored) parses, raw HTML in the text is
// shown as text rather than interpreted, code blocks get a language label, highlighting and a
// copy button, and DOMPurify (vendored) cleans the result before it reaches the page. The
// page's CSP (no inline scripts or styles) is the last line of defence.

import { escapeHtml, highlight, language } from "./highlight.js";

let md = null;

function parser() {
  if (md) return md;
  if (!globalThis.marked || !globalThis.DOMPurify) {
    throw new Error("the page's markdown libraries did not load");
  }
  md = new globalThis.marked.Marked({ gfm: true, breaks: false });
  md.use({
    renderer: {
      // Model output is text: HTML in it is displayed, never interpreted.
      html({ text }) {
        return escapeHtml(text);
      },
      code({ text, lang }) {
        const tag = (lang || "").trim().split(/\s+/)[0];
        const known = language(tag);
        const label = tag ? escapeHtml(tag) : "text";
        return '<div class="code"><div class="code-head"><span class="code-lang">' + label +
          '</span><button type="button" class="copy-code" title="Copy the code">Copy</button></div>' +
          '<pre><code' + (known ? ' class="language-' + known + '"' : "") + ">" +
          highlight(text.replace(/\n$/, ""), tag) + "</code></pre></div>";
      },
    },
  });
  globalThis.DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
  return md;
}

/// `markdown` as sanitized HTML.
export function markdownToHtml(markdown) {
  const html = parser().parse(markdown, { async: false });
  return globalThis.DOMPurify.sanitize(html, {
    FORBID_TAGS: ["style", "form", "input", "textarea", "select", "iframe", "object", "embed"],
    FORBID_ATTR: ["style", "id", "name"],
    ADD_ATTR: ["target"],
  });
}

/// Renders `markdown` into `el`.
export function renderMarkdown(el, markdown) {
  el.innerHTML = markdownToHtml(markdown);
}

/// Splits `<think>…</think>` at the start of a reply into reasoning and answer, for servers
/// (or chat templates) that leave the model's thinking in the content.
export function splitThinking(content) {
  const m = /^\s*<think>([\s\S]*?)(<\/think>|$)([\s\S]*)$/.exec(content);
  if (!m) return { reasoning: "", content };
  return { reasoning: m[1].trim(), content: m[3].replace(/^\s+/, ""), open: m[2] === "" };
}
