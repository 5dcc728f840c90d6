// Drives the chat page of a running mlxd in headless Chromium: picks the model, types a
// question, watches the answer stream in, saves a screenshot, then stops the answer with the
// Stop button. Exits non-zero with the reason on any failure.
//
// usage: node scripts/chat_page_test.cjs <mlxd-url> <model> <screenshot.png>
// Needs playwright-core (NODE_PATH=.deps/node/node_modules) and Chromium (CHROMIUM, default
// /usr/bin/chromium); scripts/setup.sh --test installs both.
"use strict";
const { chromium } = require("playwright-core");

const [url, model, shot] = process.argv.slice(2);
if (!url || !model || !shot) {
  console.error("usage: chat_page_test.cjs <mlxd-url> <model> <screenshot.png>");
  process.exit(2);
}

(async () => {
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
  });
  try {
    const page = await browser.newPage({ viewport: { width: 1000, height: 700 } });
    const problems = [];
    page.on("pageerror", (e) => problems.push("page error: " + e.message));
    page.on("console", (m) => m.type() === "error" && problems.push("console: " + m.text()));
    await page.goto(url, { waitUntil: "domcontentloaded" });
    await page.waitForSelector(`#model option[value="${model}"]`, { state: "attached", timeout: 30000 });
    await page.selectOption("#model", model);
    // Count the answer's text updates as the page makes them: one per streamed piece.
    await page.evaluate(() => {
      window.__updates = [];
      new MutationObserver(() => {
        const a = [...document.querySelectorAll(".msg.assistant")].pop();
        const t = a && a.firstChild ? a.firstChild.textContent || "" : "";
        if (t && window.__updates[window.__updates.length - 1] !== t.length) window.__updates.push(t.length);
      }).observe(document.getElementById("messages"), { subtree: true, childList: true, characterData: true });
    });
    await page.fill("#prompt", "Write a short story about a lighthouse keeper.");
    await page.press("#prompt", "Enter");
    const answer = page.locator(".msg.assistant").last();
    // Streamed: the text grows in several steps; after five, Stop ends it.
    await page.waitForFunction(() => window.__updates.length >= 5 ||
      document.querySelector(".msg.assistant[data-done='1']"), null, { timeout: 240000 });
    const lengths = await page.evaluate(() => window.__updates);
    if (lengths.length < 2) {
      throw new Error("the answer arrived in one piece, not streamed: lengths " + lengths +
        "; answer " + JSON.stringify(await answer.innerText()) + "; notice " +
        JSON.stringify(await page.textContent("#notice")));
    }
    await page.screenshot({ path: shot, fullPage: true });
    // Stop (if still streaming) ends the answer and keeps what arrived.
    if ((await answer.getAttribute("data-done")) !== "1") {
      await page.click("#stop");
    }
    await page.waitForSelector(".msg.assistant[data-done='1']", { timeout: 60000 });
    const final = (await answer.innerText()).trim();
    if (!final) throw new Error("empty answer");
    if (await page.isDisabled("#send")) throw new Error("Send stays disabled after the answer");
    if (problems.length) throw new Error(problems.join("; "));
    const stopped = await page.textContent("#notice");
    console.log("chat page: streamed answer in " + lengths.length + "+ steps (" + stopped.trim() + "): " + JSON.stringify(final.slice(0, 120)));
    console.log("screenshot: " + shot);
  } finally {
    await browser.close();
  }
})().catch((e) => {
  console.error("chat page test failed: " + (e && e.stack || e));
  process.exit(1);
});
