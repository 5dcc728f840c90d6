// Drives the chat page of a running mlxd (a real model) in headless Chromium: picks the
// model, asks for a small Python function and lets the answer finish (rendered as markdown,
// with its token rate), saves a screenshot, then asks for a story, watches it stream in and
// stops it with the Stop button. Exits non-zero with the reason on any failure.
//
// usage: node scripts/chat_page_test.cjs <mlxd-url> <model> <screenshot.png>
"use strict";
const { open, check, run } = require("./chat_page_lib.cjs");

const [url, model, shot] = process.argv.slice(2);
if (!url || !model || !shot) {
  console.error("usage: chat_page_test.cjs <mlxd-url> <model> <screenshot.png>");
  process.exit(2);
}

run("chat page test", async () => {
  const { browser, page, problems } = await open({ width: 1100, height: 760 });
  try {
    await page.goto(url, { waitUntil: "domcontentloaded" });
    await page.waitForSelector(`#model option[value="${model}"]`, { state: "attached", timeout: 30000 });
    await page.selectOption("#model", model);
    await page.waitForSelector(".welcome .example");

    // A whole answer, with a token limit set in this conversation's settings.
    await page.click("#settings-toggle");
    await page.fill("#max_tokens", "160");
    await page.dispatchEvent("#max_tokens", "change");
    await page.click("#settings-toggle");
    await page.fill("#prompt", "Write a Python function that adds two numbers, in a code block.");
    await page.press("#prompt", "Enter");
    await page.waitForSelector(".msg.assistant[data-done='1']", { timeout: 240000 });
    const first = page.locator(".msg.assistant").last();
    const meta = await first.locator(".meta").textContent();
    check(new RegExp("^" + model + " · ~?\\d+ tokens · [\\d.]+ tok/s").test(meta), "meta line: " + meta);
    const text = (await first.locator(".body").innerText()).trim();
    check(text.length > 0, "empty answer; error: " + (await first.locator(".error").allTextContents()));
    const blocks = await first.locator(".code").count();
    await page.screenshot({ path: shot });

    // A long answer, streamed in several steps, then stopped.
    await page.evaluate(() => {
      window.__updates = [];
      new MutationObserver(() => {
        const b = document.querySelector(".msg.assistant.streaming .body");
        const n = b ? b.textContent.length : 0;
        if (n && window.__updates[window.__updates.length - 1] !== n) window.__updates.push(n);
      }).observe(document.getElementById("messages"), { subtree: true, childList: true, characterData: true });
    });
    await page.fill("#prompt", "Write a short story about a lighthouse keeper.");
    await page.press("#prompt", "Enter");
    await page.waitForFunction(() => window.__updates.length >= 5 ||
      document.querySelectorAll(".msg.assistant[data-done='1']").length >= 2, null, { timeout: 240000 });
    const lengths = await page.evaluate(() => window.__updates);
    check(lengths.length >= 2, "the answer arrived in one piece, not streamed: lengths " + lengths);
    const story = page.locator(".msg.assistant").last();
    if ((await story.getAttribute("data-done")) !== "1") await page.click("#stop");
    await page.waitForFunction(() => document.querySelectorAll(".msg.assistant[data-done='1']").length >= 2, null, { timeout: 60000 });
    const final = (await story.locator(".body").innerText()).trim();
    check(final.length > 0, "empty story");
    check(!(await page.isDisabled("#send")), "Send stays disabled after the answer");
    if (problems.length) throw new Error(problems.join("; "));
    console.log("chat page: a whole answer (" + meta.trim() + ", " + blocks + " code block(s)), then a streamed answer in " +
      lengths.length + "+ steps (" + (await story.locator(".meta").textContent()).trim() + "): " + JSON.stringify(final.slice(0, 120)));
    console.log("screenshot: " + shot);
  } finally {
    await browser.close();
  }
});
