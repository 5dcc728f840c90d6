// Shared by the chat page's browser tests: headless Chromium through playwright-core, a
// page that records its script errors, and a check that fails with the reason.
// Needs playwright-core (NODE_PATH=.deps/node/node_modules) and Chromium (CHROMIUM, default
// /usr/bin/chromium); scripts/setup.sh --test installs both.
"use strict";
const { chromium } = require("playwright-core");

/// Launches Chromium and opens a page of `viewport` size whose script errors and console
/// errors (other than failed HTTP statuses, which tests provoke on purpose) are collected
/// in `problems`.
async function open(viewport = { width: 1100, height: 760 }, permissions = []) {
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
  });
  const context = await browser.newContext({ viewport });
  if (permissions.length) await context.grantPermissions(permissions);
  const page = await context.newPage();
  const problems = [];
  page.on("pageerror", (e) => problems.push("page error: " + e.message));
  page.on("console", (m) => {
    if (m.type() === "error" && !/Failed to load resource/.test(m.text())) {
      problems.push("console: " + m.text());
    }
  });
  return { browser, context, page, problems };
}

function check(ok, what) {
  if (!ok) throw new Error(what);
}

/// Runs `main` and exits non-zero with the reason if it throws.
function run(name, main) {
  main().catch((e) => {
    console.error(name + " failed: " + ((e && e.message) || e) + "\n" + ((e && e.stack) || ""));
    process.exit(1);
  });
}

module.exports = { open, check, run };
