#!/usr/bin/env bash
# Where a served decode step's extra time goes. Through mlxd, 32 greedy streams over the 1B
# shape step every 3.2-3.4 ms (inter-token p50), where the engine core without HTTP steps
# every 2.2 ms (an H100, BENCHMARKS.md session 44). A served engine differs from
# `bench_generate` in two settings it can reproduce: rows of different lengths (prompts
# differ, so the batch has a padding mask and per-row rotary offsets; `--ragged`) and MLX's
# buffer-cache limit (1 GiB without a KV budget, `app/memory.rs`; `--cache-limit`). This runs
# the engine core at 32 greedy rows with neither, each, and both, on the base and over four
# mixed adapters, in two alternated rounds: what is left between the last line and the served
# step is the serving process's (HTTP, the proxy, the client on the same host).
#
#   scripts/bench/served_conditions.sh <out dir>
#
# Run on the device machine like scripts/bench/h200.sh (after `source .gpu/b/on-device.sh`,
# BENCH_BIN pointing at bench_generate, $MODELS with llama-1b-bf16). ROWS changes the rows.
set -uo pipefail
out=$1
mkdir -p "$out"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
model=$MODELS/llama-1b-bf16
adapters=
for i in 1 2 3 4; do
  dir=$MODELS/lora-float32-$i
  [[ -f $dir/adapters.safetensors ]] ||
    "${PYTHON:-python3}" scripts/bench/random_lora.py --model "$model" --out "$dir" --seed "$i" --dtype float32 >/dev/null
  adapters="$adapters${adapters:+,}$dir"
done
limit=$((1 << 30))
core() {
  echo "== bench_generate ${ROWS:-32} rows $*" >&2
  timeout 90 "$BENCH_BIN" "$model" 128 256 3 "${ROWS:-32}" 0 "$@" | tee -a "$out/served-conditions.jsonl" | tail -1
}
for round in 1 2; do
  core
  core --ragged
  core --cache-limit "$limit"
  core --ragged --cache-limit "$limit"
  core --adapters "$adapters"
  core --adapters "$adapters" --ragged --cache-limit "$limit"
done
