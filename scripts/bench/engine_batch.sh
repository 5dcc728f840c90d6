#!/usr/bin/env bash
# Issue 21's engine-core targets against mlx-lm, in one run (each line is scripts/bench/engine.sh:
# mlxd's bench_generate, then mlx-lm's generate_step / BatchGenerator on the same prompts).
#
#   scripts/bench/engine_batch.sh [model dir] [out dir]
#
# 1. Decode at batch 1, 8, 32, 64 and 128, greedy and temperature 0.7 (128-token prompts,
#    128 new tokens): ratio_decode_tps is the target (>= 1.2), and 128 must beat 64.
# 2. Batched prefill: 32, 64 and 128 simultaneous 128-token prompts, 8 new tokens:
#    ratio_prefill_tps (>= 1.0) and ratio_ttft (<= 1.0).
# Every mlxd run writes its step trace (RUST_LOG=mlxd_engine::step=trace) to the out dir; the
# 'decode step' medians are printed per run, and the 'prefill step' events show how each
# step's prefill was split into passes (padded_passes counts those that needed a mask array).
# Runs: RUNS (default 3). PYTHON, BENCH_BIN as for engine.sh.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
model=${1:-${MLXD_HOME:-$HOME/.cache/mlxd}/models/smollm2-135m}
out=${2:-$(mktemp -d /tmp/engine-batch.XXXXXX)}
runs=${RUNS:-3}
python=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
bench=${BENCH_BIN:-target/release/examples/bench_generate}
[[ -x $bench ]] || cargo build --release -q -p mlxd-engine --example bench_generate
summary=$out/summary.jsonl
: >"$summary"
run() { # name prompt new batch temperature
  local name=$1
  shift
  echo "== $name: prompt $1, new $2, batch $3, temperature $4" >&2
  STEP_TRACE=$out/$name.trace scripts/bench/engine.sh "$model" "$1" "$2" "$runs" "$3" "$4" \
    | tee "$out/$name.out" >&2
  # The ratios line (third) goes to the summary with the run's name.
  sed -n 3p "$out/$name.out" | "$python" -c 'import json,sys; d=json.loads(sys.stdin.read()); d["run"]=sys.argv[1]; print(json.dumps(d))' "$name" >>"$summary"
}
for temperature in 0 0.7; do
  for batch in 1 8 32 64 128; do
    run "decode-b$batch-t$temperature" 128 128 "$batch" "$temperature"
  done
done
for batch in 32 64 128; do
  run "prefill-b$batch" 128 8 "$batch" 0
done
echo "== summary ($summary)" >&2
cat "$summary"
