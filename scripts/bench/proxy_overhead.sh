#!/usr/bin/env bash
# Proxy overhead: per-chunk latency (p50/p99) and chunks/s through mlxd versus straight
# to the engine's unix socket, in the same run, with the fake engine streaming as fast as
# it can (and paced at 1 chunk/ms); plus mlxd's idle RSS.
#
# Usage: scripts/bench/proxy_overhead.sh [streams] [chunks]   (PROFILE=debug for a debug build)
set -euo pipefail
cd "$(dirname "$0")/../.."
profile="${PROFILE:-release}"
flag=()
[ "$profile" = release ] && flag=(--release)
cargo build "${flag[@]}" -p mlxd-proxy --bin mlxd -p mlxd-tests --bin fake-engine --bin proxy-bench
dir="target/$profile"
"$dir/proxy-bench" "$dir/mlxd" "$dir/fake-engine" "${1:-20}" "${2:-2000}"
