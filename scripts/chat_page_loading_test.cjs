// Opens the chat page of a running mlxd whose model is loading and checks that the page says
// so with the load's phase and progress, then that the notice clears once the model is loaded.
// The load waits for <gate-file>: this script creates it once the page has shown the load.
// Exits non-zero with the reason on any failure.
//
// usage: node scripts/chat_page_loading_test.cjs <mlxd-url> <model> <gate-file>
// Needs playwright-core (NODE_PATH=.deps/node/node_modules) and Chromium (CHROMIUM, default
// /usr/bin/chromium); scripts/setup.sh --test installs both.
"use strict";
const fs = require("fs");
const { chromium } = require("playwright-core");

const [url, model, gate] = process.argv.slice(2);
if (!url || !model || !gate) {
  console.error("usage: chat_page_loading_test.cjs <mlxd-url> <model> <gate-file>");
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
    await page.goto(url, { waitUntil: "domcontentloaded" });
    await page.waitForSelector(`#model option[value="${model}"]`, { state: "attached", timeout: 30000 });
    // The page polls /v1/models every 2 s; the load reports its weights in quarters and
    // holds at the first until the gate opens.
    await page.waitForFunction(
      () => /Loading .*\(reading weights \d+%\)/.test(document.getElementById("notice").textContent),
      null,
      { timeout: 60000 },
    );
    const loading = (await page.textContent("#notice")).trim();
    fs.writeFileSync(gate, "seen\n");
    await page.waitForFunction(
      () => document.getElementById("state").textContent === "loaded" &&
        document.getElementById("notice").textContent.trim() === "",
      null,
      { timeout: 60000 },
    );
    if (problems.length) throw new Error(problems.join("; "));
    console.log("chat page: saw " + JSON.stringify(loading) + ", then the model loaded");
  } finally {
    await browser.close();
  }
})().catch((e) => {
  console.error("chat page loading test failed: " + (e && e.stack || e));
  process.exit(1);
});
