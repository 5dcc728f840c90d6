// Drives the chat page of a running mlxd (fake engines) in headless Chromium through what a
// person does with it, and checks what they would see:
//  1. the welcome with example prompts on an empty conversation;
//  2. an answer with markdown, a highlighted code block (copied with its button), reasoning
//     shown collapsed, a tool call, and HTML and script in the model's output shown as text
//     (this answer is scripted with Playwright's request routing: the fake engine's answers
//     are plain words);
//  3. settings (system prompt, temperature, top_p, max tokens) refused when out of range,
//     then present in the request body the page sends to mlxd, which answers;
//  4. conversations, their settings and rendering kept across a reload; rename and delete;
//  5. regenerate and edit of the last question (each a new request with the right messages);
//  6. an example prompt asked of a slow model, then stopped mid-answer;
//  7. a failed model's reason as a sentence, in the banner and in an answer's error;
//  8. the page's wording of mlxd's failure reasons (engine JSON log lines, whole or cut);
//  9. stored conversations that cannot be read: set aside and said so.
// Screenshots go to <shot-dir>: chat-page-markdown.png, chat-page-settings.png,
// chat-page-failed.png.
//
// usage: node scripts/chat_page_features_test.cjs <mlxd-url> <shot-dir>
// The server serves fake-model (short answers), slow-model (long, slow answers) and
// broken-model (failed, its last log line a JSON line).
"use strict";
const path = require("path");
const { open, check, run } = require("./chat_page_lib.cjs");

const [url, shots] = process.argv.slice(2);
if (!url || !shots) {
  console.error("usage: chat_page_features_test.cjs <mlxd-url> <shot-dir>");
  process.exit(2);
}

const CODE = 'def add(a, b):\n    # sum two numbers\n    return a + b  # "done"\n\nprint(add(1, 2))';
const MARKDOWN = [
  "## Plan\n\nHere is **bold**, `inline code`, a [safe link](https://example.com/docs) and a ",
  "[bad link](javascript:window.__xss=1).\n\n- one\n- two\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n",
  "```python\n" + CODE + "\n```\n\n",
  "<script>window.__xss = 1</script>\n\n",
  'Inline <img src=x onerror="window.__xss=1"> and <a href="javascript:window.__xss=1" onclick="window.__xss=1">html link</a>.\n\n',
  '<iframe src="javascript:window.__xss=1"></iframe>\n',
];
const REASONING = "The user wants markdown. I will show a heading, a list, a table and some code.";

/// The scripted answer as the SSE body mlxd would stream.
function scriptedStream() {
  const ev = (v) => "data: " + JSON.stringify(v) + "\n\n";
  const chunk = (delta, finish = null) => ev({
    id: "chatcmpl-scripted", object: "chat.completion.chunk", model: "fake-model",
    choices: [{ index: 0, delta, finish_reason: finish }],
  });
  let out = chunk({ role: "assistant" });
  for (const w of REASONING.split(/(?<= )/)) out += chunk({ reasoning_content: w });
  for (const piece of MARKDOWN) out += chunk({ content: piece });
  out += chunk({ tool_calls: [{ index: 0, id: "call_1", type: "function", function: { name: "get_weather", arguments: '{"city":' } }] });
  out += chunk({ tool_calls: [{ index: 0, function: { arguments: '"Paris"}' } }] }, "tool_calls");
  out += ev({ id: "chatcmpl-scripted", object: "chat.completion.chunk", choices: [], usage: { prompt_tokens: 9, completion_tokens: 42, total_tokens: 51 } });
  return out + "data: [DONE]\n\n";
}

run("chat page features test", async () => {
  const { browser, page, problems } = await open(undefined, ["clipboard-read", "clipboard-write"]);
  try {
    // Every chat request body the page sends, in order.
    const sent = [];
    page.on("request", (r) => {
      if (r.url().endsWith("/v1/chat/completions") && r.method() === "POST") sent.push(r.postDataJSON());
    });
    const lastSent = () => sent[sent.length - 1];
    const done = (n) => page.waitForFunction((n) => document.querySelectorAll(".msg.assistant[data-done='1']").length >= n &&
      !document.querySelector(".msg.assistant.streaming"), n, { timeout: 60000 });
    const send = async (text) => {
      await page.fill("#prompt", text);
      await page.press("#prompt", "Enter");
    };

    await page.goto(url, { waitUntil: "domcontentloaded" });
    await page.waitForSelector('#model option[value="fake-model"]', { state: "attached", timeout: 30000 });
    await page.selectOption("#model", "fake-model");

    // 1. The welcome.
    await page.waitForSelector(".welcome .example", { timeout: 10000 });
    const welcome = await page.textContent(".welcome");
    check(/Ask fake-model anything/.test(welcome), "welcome does not name the model: " + welcome);
    check((await page.locator(".welcome .example").count()) >= 3, "fewer than 3 example prompts");

    // 2. Markdown, code, reasoning, a tool call, and no HTML from the model's output.
    await page.route("**/v1/chat/completions", (route) => route.fulfill({
      status: 200, headers: { "content-type": "text/event-stream" }, body: scriptedStream(),
    }));
    await send('Show me markdown <img src=x onerror="window.__xss=1">');
    await done(1);
    await page.unroute("**/v1/chat/completions");
    const a = page.locator(".msg.assistant").last();
    check((await a.locator(".body h2").textContent()) === "Plan", "no h2 heading");
    check((await a.locator(".body strong").textContent()) === "bold", "no bold");
    check((await a.locator(".body li").count()) === 2, "the list is not 2 items");
    check((await a.locator(".body table td").count()) === 2, "no table");
    check((await a.locator('.body a[href="https://example.com/docs"]').count()) === 1, "the safe link is gone");
    const code = a.locator(".code pre code.language-python");
    check((await code.textContent()) === CODE, "code block text differs: " + JSON.stringify(await code.textContent()));
    check((await a.locator(".code-lang").textContent()) === "python", "no language label");
    const kinds = await code.evaluate((c) => ["hl-k", "hl-s", "hl-c", "hl-n"].map((k) => [...c.querySelectorAll("." + k)].map((s) => s.textContent)));
    check(kinds[0].includes("def") && kinds[0].includes("return"), "keywords not highlighted: " + kinds[0]);
    check(kinds[1].includes('"done"') === false && kinds[2].includes('# "done"'), "comment with a string not one comment: " + kinds[2]);
    check(kinds[3].includes("1"), "numbers not highlighted");
    const font = await code.evaluate((c) => getComputedStyle(c).fontFamily);
    check(/mono|consolas|menlo/i.test(font), "code font is not monospace: " + font);
    await a.locator(".copy-code").click();
    const clip = await page.evaluate(() => navigator.clipboard.readText());
    check(clip === CODE, "copy button copied " + JSON.stringify(clip));
    const details = a.locator("details.reasoning");
    check((await details.count()) === 1 && !(await details.evaluate((d) => d.open)), "reasoning not collapsed");
    check(/Reasoning \(\d+ words\)/.test(await details.locator("summary").textContent()), "reasoning summary");
    check((await details.locator(".reasoning-body").textContent()).includes("a table and some code"), "reasoning text");
    check((await a.locator(".tool-name").textContent()) === "Tool call: get_weather", "tool call name");
    check((await a.locator(".tool-args").textContent()).includes('"city": "Paris"'), "tool call arguments");
    const meta = await a.locator(".meta").textContent();
    check(/^fake-model · 42 tokens · first token [\d.]+ s/.test(meta), "meta line: " + meta);
    // The model's HTML is text: no element, attribute or URL from it is live.
    const xss = await page.evaluate(() => {
      const m = document.getElementById("messages");
      const bad = [...m.querySelectorAll("*")].filter((e) =>
        ["SCRIPT", "IFRAME", "IMG", "OBJECT", "EMBED"].includes(e.tagName) ||
        [...e.attributes].some((at) => /^on/i.test(at.name) || /javascript:/i.test(at.value)));
      return { fired: window.__xss, bad: bad.map((e) => e.outerHTML.slice(0, 80)) };
    });
    check(xss.fired === undefined, "a script from the model's output ran");
    check(xss.bad.length === 0, "live HTML from the model's output: " + xss.bad.join(" | "));
    const shown = await a.locator(".body").innerText();
    check(shown.includes("<script>window.__xss = 1</script>") && shown.includes("<iframe"), "the model's HTML is not shown as text");
    check((await page.locator(".msg.user .body").first().innerText()).includes("<img src=x onerror="), "the question's HTML is not shown as text");
    // Tall enough to show the question and the whole answer.
    await page.setViewportSize({ width: 1100, height: 1080 });
    await page.locator(".msg.user").first().scrollIntoViewIfNeeded();
    await page.screenshot({ path: path.join(shots, "chat-page-markdown.png") });
    await page.setViewportSize({ width: 1100, height: 760 });

    // 3. Settings: refused out of range, then sent with the request.
    await page.click("#new");
    await page.waitForSelector(".welcome");
    await page.click("#settings-toggle");
    const set = async (id, v) => {
      await page.fill("#" + id, v);
      await page.dispatchEvent("#" + id, "change");
    };
    await set("temperature", "5");
    await send("Hello with settings");
    const refused = await page.textContent("#problem");
    check(/Temperature must be a number from 0 to 2 \(it is 5\)/.test(refused), "out-of-range temperature not refused: " + refused);
    check(sent.length === 1, "a request went out with a bad temperature");
    await set("system", "You answer in one line.");
    await set("temperature", "0.3");
    await set("top_p", "0.9");
    await set("max_tokens", "12");
    check((await page.textContent("#settings-problems")).trim() === "", "settings problems remain");
    await send("Hello with settings");
    await done(1);
    const body = lastSent();
    check(body.model === "fake-model" && body.stream === true, "model/stream: " + JSON.stringify(body));
    check(body.temperature === 0.3 && body.top_p === 0.9 && body.max_tokens === 12, "sampling settings not sent: " + JSON.stringify(body));
    check(body.messages.length === 2 && body.messages[0].role === "system" &&
      body.messages[0].content === "You answer in one line." && body.messages[1].content === "Hello with settings",
      "messages sent: " + JSON.stringify(body.messages));
    const rate = await page.locator(".msg.assistant .meta").last().textContent();
    check(/^fake-model · ~?8 tokens · [\d.]+ tok\/s · first token [\d.]+ s · [\d.]+ s$/.test(rate), "meta line: " + rate);
    const live = await page.locator(".msg.assistant .body").last().innerText();
    check(/tok0/.test(live), "mlxd's answer not shown: " + live);
    await page.screenshot({ path: path.join(shots, "chat-page-settings.png") });

    // 4. Kept across a reload: both conversations, the open one's settings, the rendering.
    await page.reload({ waitUntil: "domcontentloaded" });
    await page.waitForSelector('#model option[value="fake-model"]', { state: "attached", timeout: 30000 });
    const titles = await page.locator(".conv .conv-open").allTextContents();
    check(titles.length === 2 && titles[0] === "Hello with settings" && titles[1].startsWith("Show me markdown"),
      "conversations after reload: " + JSON.stringify(titles));
    check((await page.inputValue("#system")) === "You answer in one line." && (await page.inputValue("#max_tokens")) === "12",
      "settings not kept across the reload");
    check(/tok0/.test(await page.locator(".msg.assistant .body").last().innerText()), "answer not kept");
    await page.locator(".conv .conv-open").nth(1).click();
    check((await page.locator(".msg.assistant .body h2").count()) === 1 && (await page.locator(".msg.assistant .hl-k").count()) > 0,
      "the markdown answer is not rendered after the reload");
    await page.locator(".conv").nth(1).locator(".conv-rename").click();
    await page.fill(".conv .conv-title", "Markdown demo");
    await page.press(".conv .conv-title", "Enter");
    await page.reload({ waitUntil: "domcontentloaded" });
    await page.waitForSelector(".conv");
    const renamed = await page.locator(".conv.active .conv-open").textContent();
    check(renamed === "Markdown demo", "rename not kept (active: " + renamed + ")");
    const del = page.locator(".conv.active .conv-delete");
    await del.click();
    check((await del.textContent()) === "Delete?", "delete asks no confirmation");
    await del.click();
    await page.reload({ waitUntil: "domcontentloaded" });
    await page.waitForSelector(".conv");
    const left = await page.locator(".conv .conv-open").allTextContents();
    check(left.length === 1 && left[0] === "Hello with settings", "after delete: " + JSON.stringify(left));

    // 5. Regenerate, then edit the last question.
    await page.waitForSelector('#model option[value="fake-model"]', { state: "attached" });
    await page.waitForSelector(".msg.assistant .regenerate");
    let before = sent.length;
    await page.click(".msg.assistant .regenerate");
    await page.waitForFunction((n) => document.querySelectorAll(".msg").length === 2 &&
      document.querySelector(".msg.assistant[data-done='1']"), null, { timeout: 60000 });
    check(sent.length === before + 1, "regenerate sent no request");
    let msgs = lastSent().messages;
    check(msgs.length === 2 && msgs[1].role === "user" && msgs[1].content === "Hello with settings", "regenerate sent " + JSON.stringify(msgs));
    await page.click(".msg.user .edit");
    await page.fill(".edit-text", "Hello again, edited");
    before = sent.length;
    await page.click(".edit-send");
    await page.waitForFunction(() => document.querySelectorAll(".msg").length === 2 &&
      document.querySelector(".msg.assistant[data-done='1']"), null, { timeout: 60000 });
    msgs = lastSent().messages;
    check(sent.length === before + 1 && msgs[msgs.length - 1].content === "Hello again, edited" && msgs.length === 2,
      "edit sent " + JSON.stringify(msgs));
    check((await page.locator(".msg.user .body").innerText()) === "Hello again, edited", "edited question not shown");

    // 6. An example prompt to a slow model, stopped mid-answer.
    await page.click("#new");
    await page.selectOption("#model", "slow-model");
    await page.waitForSelector(".welcome .example");
    const example = await page.locator(".welcome .example").first().textContent();
    await page.locator(".welcome .example").first().click();
    await page.waitForFunction(() => {
      const b = document.querySelector(".msg.assistant.streaming .body");
      return b && (b.textContent.match(/tok\d+/g) || []).length >= 3;
    }, null, { timeout: 60000 });
    check(lastSent().messages[0].content === example && lastSent().model === "slow-model", "the example was not asked");
    check(await page.isDisabled("#send"), "Send is enabled while answering");
    await page.click("#stop");
    await done(1);
    const stopped = page.locator(".msg.assistant").last();
    check(/stopped/.test(await stopped.locator(".meta").textContent()), "the stopped answer is not marked");
    const partial = (await stopped.locator(".body").innerText()).match(/tok\d+/g) || [];
    check(partial.length >= 3, "the partial answer was not kept");
    check(!(await page.isDisabled("#send")) && (await page.isDisabled("#stop")), "buttons after stop");

    // 7. A failed model: its reason in words, in the banner and in the answer.
    await page.click("#new");
    await page.selectOption("#model", "broken-model");
    await page.waitForFunction(() => document.getElementById("notice").classList.contains("bad"), null, { timeout: 30000 });
    const banner = (await page.textContent("#notice")).trim();
    check(/^broken-model is not available: its engine crashed/.test(banner), "failed-model banner: " + banner);
    check(!/[{}]|"level"|; last log line:/.test(banner), "raw log line in the banner: " + banner);
    check((await page.textContent(".welcome h2")) === "broken-model is not available", "the welcome offers a failed model");
    await send("Are you there?");
    await done(1);
    const err = (await page.locator(".msg.assistant .error").last().textContent()).trim();
    check(/broken-model/.test(err) && !/[{}]/.test(err) && /\.$/.test(err), "error in the answer: " + err);
    await page.screenshot({ path: path.join(shots, "chat-page-failed.png") });

    // 8. The reasons mlxd gives, as the page words them: an engine's JSON log line (whole,
    // or cut at the stderr line limit) is reduced to its message.
    const reasons = await page.evaluate(async () => {
      const api = await import("/api.js");
      const json = '{"timestamp":"t","level":"ERROR","fields":{"message":"load failed","error":"no config.json in /m"},"target":"mlxd_engine::app"}';
      return [
        api.readableReason("load failed (exit code 1); last log line: " + json),
        api.readableReason("crashed (exit code 3); last log line: " + json.slice(0, 70)),
        api.readableReason("crashed (exit code 3); last log line: plain words"),
        api.readableReason("model m failed to load: exit code 1 " + json),
        api.failedModelNotice({ id: "m", failure: "load failed (exit code 1); last log line: " + json }),
      ];
    });
    const want = [
      "Load failed (exit code 1). Its last log line: “load failed: no config.json in /m”.",
      "Crashed (exit code 3). Its last log line: “load failed”.",
      "Crashed (exit code 3). Its last log line: “plain words”.",
      "Model m failed to load: exit code 1: load failed: no config.json in /m.",
      "m is not available: it failed to load (exit code 1). Its last log line: “load failed: no config.json in /m”. Pick another model, or fix it and restart mlxd.",
    ];
    for (let i = 0; i < want.length; i++) check(reasons[i] === want[i], "reason " + i + ": " + JSON.stringify(reasons[i]));

    // 9. Stored conversations that cannot be read are set aside with a sentence, not lost.
    await page.evaluate(() => localStorage.setItem("mlxd-chat-conversations-v1", "{not json"));
    await page.reload({ waitUntil: "domcontentloaded" });
    await page.waitForSelector("#problem.show");
    const unreadable = await page.textContent("#problem");
    check(/could not be read .*mlxd-chat-conversations-v1-unreadable/.test(unreadable), "unreadable storage: " + unreadable);
    check((await page.evaluate(() => localStorage.getItem("mlxd-chat-conversations-v1-unreadable"))) === "{not json",
      "the unreadable value was not kept");

    if (problems.length) throw new Error(problems.join("; "));
    console.log("chat page features: welcome, markdown+code+copy, reasoning, tool call, no script injection, " +
      "settings in the request, reload kept " + titles.length + " conversations, rename, delete, regenerate, edit, stop after " +
      partial.length + " tokens; failed model: " + JSON.stringify(banner) + "; answer error: " + JSON.stringify(err));
  } catch (e) {
    // What the page showed when it went wrong.
    const shot = path.join(shots, "chat-page-failure.png");
    await page.screenshot({ path: shot }).catch(() => {});
    const seen = await page.evaluate(() => ["notice", "problem", "messages"]
      .map((id) => id + ": " + document.getElementById(id).innerText.slice(0, 600)).join("\n")).catch((x) => String(x));
    e.message += "\n" + seen + "\nscreenshot: " + shot + (problems.length ? "\n" + problems.join("; ") : "");
    throw e;
  } finally {
    await browser.close();
  }
});
