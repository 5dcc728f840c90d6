// A small syntax highlighter for the code blocks of answers: comments, strings, numbers and
// keywords of the languages small models write most, as <span class="hl-…"> around escaped
// text. It never guesses a language: a block without a known tag stays plain (escaped).

const KEYWORDS = {
  c: "auto break case char const continue default do double else enum extern float for goto if " +
    "inline int long register return short signed sizeof static struct switch typedef union " +
    "unsigned void volatile while bool true false NULL nullptr class public private protected " +
    "virtual template typename namespace using new delete this throw try catch include define",
  go: "break case chan const continue default defer else fallthrough for func go goto if import " +
    "interface map package range return select struct switch type var nil true false",
  java: "abstract boolean break byte case catch char class const continue default do double else " +
    "enum extends final finally float for if implements import instanceof int interface long " +
    "new package private protected public return short static super switch this throw throws " +
    "try void while true false null var record",
  js: "async await break case catch class const continue debugger default delete do else export " +
    "extends finally for from function if import in instanceof let new of return static super " +
    "switch this throw try typeof var void while yield true false null undefined interface type " +
    "enum implements readonly",
  python: "and as assert async await break class continue def del elif else except finally for " +
    "from global if import in is lambda nonlocal not or pass raise return try while with yield " +
    "True False None self print",
  rust: "as async await break const continue crate dyn else enum extern false fn for if impl in " +
    "let loop match mod move mut pub ref return self Self static struct super trait true type " +
    "unsafe use where while Some None Ok Err",
  shell: "if then else elif fi for while until do done case esac in function return export local " +
    "echo cd sudo set unset",
  sql: "select from where insert into values update set delete create table drop alter join left " +
    "right inner outer on group by order having limit as and or not null is in like distinct " +
    "primary key",
};

/// Per language: its keyword list and which comment and string forms it has.
const LANGS = {
  c: { kw: "c", line: "//", block: true, quotes: "\"'" },
  go: { kw: "go", line: "//", block: true, quotes: "\"'`" },
  java: { kw: "java", line: "//", block: true, quotes: "\"'" },
  js: { kw: "js", line: "//", block: true, quotes: "\"'`" },
  python: { kw: "python", line: "#", block: false, quotes: "\"'", triple: true },
  rust: { kw: "rust", line: "//", block: true, quotes: "\"" },
  shell: { kw: "shell", line: "#", block: false, quotes: "\"'" },
  sql: { kw: "sql", line: "--", block: true, quotes: "'\"", nocase: true },
  json: { kw: null, line: null, block: false, quotes: "\"", words: "true false null" },
  toml: { kw: null, line: "#", block: false, quotes: "\"'", words: "true false" },
  yaml: { kw: null, line: "#", block: false, quotes: "\"'", words: "true false null yes no" },
};

const ALIASES = {
  c: "c", h: "c", cpp: "c", "c++": "c", cc: "c", hpp: "c", cs: "c", csharp: "c",
  go: "go", golang: "go", java: "java", kotlin: "java", kt: "java", swift: "java",
  js: "js", javascript: "js", jsx: "js", ts: "js", typescript: "js", tsx: "js", mjs: "js",
  py: "python", python: "python", python3: "python", rs: "rust", rust: "rust",
  sh: "shell", bash: "shell", shell: "shell", zsh: "shell", console: "shell",
  sql: "sql", json: "json", jsonc: "json", toml: "toml", ini: "toml", yaml: "yaml", yml: "yaml",
};

const escapeRe = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");

export function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

const compiled = new Map();

/// One sticky-free global regex per language whose groups are, in order: comment, string,
/// number, word. Everything between matches is plain text.
function grammar(name) {
  if (compiled.has(name)) return compiled.get(name);
  const l = LANGS[name];
  const comments = [];
  if (l.line) comments.push(escapeRe(l.line) + "[^\\n]*");
  if (l.block) comments.push("/\\*[\\s\\S]*?(?:\\*/|$)");
  const strings = [];
  if (l.triple) strings.push('"""[\\s\\S]*?(?:"""|$)', "'''[\\s\\S]*?(?:'''|$)");
  for (const q of l.quotes) {
    const e = escapeRe(q);
    const body = q === "`" ? "[^`\\\\]|\\\\[\\s\\S]" : "[^" + e + "\\\\\\n]|\\\\.";
    strings.push(e + "(?:" + body + ")*(?:" + e + "|$)");
  }
  const parts = [
    comments.length ? "(" + comments.join("|") + ")" : "(?!)",
    "(" + strings.join("|") + ")",
    "(\\b(?:0x[0-9a-fA-F_]+|\\d[\\d_]*(?:\\.\\d+)?(?:[eE][+-]?\\d+)?)\\b)",
    "([A-Za-z_][A-Za-z0-9_]*)",
  ];
  const words = new Set(((l.kw ? KEYWORDS[l.kw] : l.words) || "").split(" ")
    .map((w) => (l.nocase ? w.toLowerCase() : w)));
  const g = { re: new RegExp(parts.join("|"), "g"), words, nocase: !!l.nocase };
  compiled.set(name, g);
  return g;
}

/// The language `tag` names, if this highlighter knows it.
export function language(tag) {
  return ALIASES[(tag || "").trim().toLowerCase()] || null;
}

/// `code` as HTML: escaped, and highlighted when `tag` names a known language.
export function highlight(code, tag) {
  const name = language(tag);
  if (!name) return escapeHtml(code);
  const { re, words, nocase } = grammar(name);
  let out = "";
  let at = 0;
  re.lastIndex = 0;
  for (let m; (m = re.exec(code)) !== null;) {
    if (m[0] === "") {
      re.lastIndex++;
      continue;
    }
    out += escapeHtml(code.slice(at, m.index));
    const text = escapeHtml(m[0]);
    if (m[1] !== undefined) out += '<span class="hl-c">' + text + "</span>";
    else if (m[2] !== undefined) out += '<span class="hl-s">' + text + "</span>";
    else if (m[3] !== undefined) out += '<span class="hl-n">' + text + "</span>";
    else if (words.has(nocase ? m[4].toLowerCase() : m[4])) out += '<span class="hl-k">' + text + "</span>";
    else out += text;
    at = m.index + m[0].length;
  }
  return out + escapeHtml(code.slice(at));
}
