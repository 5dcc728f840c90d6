#!/usr/bin/env bash
# Model switch: time to first token when the requested model must be loaded — with its
# weights dropped from the page cache (cold) or still cached (warm) — versus already
# loaded, with max_engines = 1 so that every switch evicts the other model.
# Runs with the fake engine (pure supervisor cost: spawn, control handshake, eviction),
# then with the real mlxd-engine on the tiny test models and, when it is in the model
# store, SmolLM2-135M.
#
# Usage: scripts/bench/model_switch.sh [iterations]   (PROFILE=debug for a debug build;
#        MLXD_ENGINE_BIN=path to use an engine built elsewhere)
set -euo pipefail
cd "$(dirname "$0")/../.."
n="${1:-5}"
profile="${PROFILE:-release}"
flag=()
[ "$profile" = release ] && flag=(--release)
cargo build "${flag[@]}" -p mlxd-proxy --bin mlxd -p mlxd-tests --bin fake-engine --bin switch-bench
dir="target/$profile"
models="${MLXD_TEST_MODELS:-target/test-models}"
home="${MLXD_TEST_HOME:-target/mlxd-test-home}"
export MLXD_HOME="$home"

echo "== fake engine"
"$dir/switch-bench" "$dir/mlxd" "$dir/fake-engine" "$n" "$models/tiny-llama" "$models/tiny-qwen3"

engine="${MLXD_ENGINE_BIN:-$dir/mlxd-engine}"
if [ ! -x "$engine" ]; then
  echo "== real engine skipped: $engine is absent (cargo build ${flag[*]} -p mlxd-engine)"
  exit 0
fi
if [ ! -f "$models/tiny-llama/config.json" ]; then
  echo "== real engine skipped: no tiny models in $models (scripts/test.sh generates them)"
  exit 0
fi
echo "== mlxd-engine: tiny-llama and tiny-qwen3"
"$dir/switch-bench" "$dir/mlxd" "$engine" "$n" "$models/tiny-llama" "$models/tiny-qwen3"
if [ -f "$home/models/smollm2-135m/config.json" ]; then
  echo "== mlxd-engine: smollm2-135m and tiny-llama"
  "$dir/switch-bench" "$dir/mlxd" "$engine" "$n" "$home/models/smollm2-135m" "$models/tiny-llama"
fi
