#!/usr/bin/env bash
# Dependency audit, offline: `cargo deny check bans licenses sources` with deny.toml
# (permissive licences only, crates.io as the only source, no wildcard versions; duplicate
# versions are reported, not refused). Installs cargo-deny (pinned) when it is missing.
#
# Not checked: security advisories. `cargo deny check advisories` and `cargo audit` read the
# RustSec advisory database, a git repository on GitHub, which the project's machines and
# CI cannot reach. Where GitHub is reachable, run `cargo deny check advisories` by hand.
#
# Not part of scripts/test.sh: building cargo-deny took 1 029 s (release) and 737 s
# (--debug) on the shared 2-core machine, too much for CI's budget.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
version=0.20.2
if ! cargo deny --version 2>/dev/null | grep -qx "cargo-deny $version"; then
  echo "audit.sh: installing cargo-deny $version (a long build)" >&2
  cargo install --locked cargo-deny --version "$version"
fi
cargo deny --offline check bans licenses sources
