#!/usr/bin/env bash
# An engine setting's A/B on the GPU, in one run: the engine core against mlx-lm at 1, 8, 32
# and 64 greedy rows (`engine.sh <1B> 128 128 3 <rows> 0`), then 32 served streams on the
# base, one adapter and four mixed (`h200.sh adapters`, 512-token greedy streams), once per
# value of the environment variable, the values alternated row count by row count so that a
# drifting machine affects each alike. mlx-lm runs beside every line: compare ratios.
#
#   scripts/bench/switch_ab.sh <out dir> <VARIABLE> <value> <value>...
#   e.g. scripts/bench/switch_ab.sh $OUT/s MLXD_STACKED_PROJECTIONS 1 0
#
# Run on the device machine like scripts/bench/h200.sh (after `source .gpu/b/on-device.sh`, the
# release binaries in $MLXD_BIN_DIR, BENCH_BIN pointing at bench_generate, $MODELS with
# llama-1b-bf16). ROWS and SKIP_ADAPTERS=1 narrow the run. CORE_ONLY=1 runs the engine core
# alone instead (no mlx-lm, no served streams: a host-side change's A/B, where mlx-lm's figure
# does not move): `bench_generate <1B> 128 256 3 <rows> 0` ROUNDS times (default 2) per row
# count and value, alternated, each line tagged with the value, in core.jsonl.
set -uo pipefail
out=$1 var=$2
shift 2
values=("$@")
[[ ${#values[@]} -ge 2 ]] || { echo "usage: $0 <out dir> <VARIABLE> <value> <value>..." >&2; exit 2; }
mkdir -p "$out"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
if [[ ${CORE_ONLY:-0} == 1 ]]; then
  for rows in ${ROWS:-8 32 64 128}; do
    for _ in $(seq 1 "${ROUNDS:-2}"); do
      for value in "${values[@]}"; do
        line=$(env "$var=$value" timeout 150 "$BENCH_BIN" "$MODELS/llama-1b-bf16" 128 256 3 "$rows" 0)
        echo "${line%\}},\"$var\":\"$value\"}" | tee -a "$out/core.jsonl"
      done
    done
  done
  exit 0
fi
for rows in ${ROWS:-1 8 32 64}; do
  for value in "${values[@]}"; do
    echo "{\"$var\": \"$value\", \"rows\": $rows}" >> "$out/engine.jsonl"
    env "$var=$value" timeout 150 scripts/bench/engine.sh "$MODELS/llama-1b-bf16" 128 128 3 "$rows" 0 |
      tee -a "$out/engine.jsonl" | tail -1
  done
done
[[ ${SKIP_ADAPTERS:-0} == 1 ]] && exit 0
for value in "${values[@]}"; do
  env "$var=$value" ADAPTER_TOKENS=512 ADAPTER_TEMPS=0 timeout 200 \
    scripts/bench/h200.sh adapters "$out/adapters-$var-$value" | grep -v '^{' | tail -1
done
