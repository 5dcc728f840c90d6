#!/usr/bin/env bash
# Engine core against mlx-lm, same machine, same MLX build, same prompt, warm, in one run.
#
#   scripts/bench/engine.sh [model dir] [prompt tokens] [new tokens] [runs] [batch] [temperature]
#
# The default model is the converted SmolLM2-135M-Instruct from the model store. Prints both
# JSON lines and the ratios mlxd / mlx-lm (above 1.0 is better for prefill and decode, below
# 1.0 is better for time to first token). PYTHON overrides the interpreter (the GPU machine
# has its own). A temperature above 0 samples on both sides (mlxd: a seed per row; mlx-lm:
# make_sampler(temp=...)). STEP_TRACE=FILE writes mlxd's per-step trace there
# (RUST_LOG=mlxd_engine::step=trace) and prints its medians per batch size
# (scripts/bench/step_trace.py); the trace costs a little, so take throughput from a run
# without it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
model=${1:-${MLXD_HOME:-$HOME/.cache/mlxd}/models/smollm2-135m}
prompt=${2:-512}
new=${3:-64}
runs=${4:-3}
batch=${5:-1}
temperature=${6:-0}
python=${PYTHON:-.venv/bin/python}
bench=${BENCH_BIN:-target/release/examples/bench_generate}
[[ -x $bench ]] || cargo build --release -q -p mlxd-engine --example bench_generate
# Alternate the two, so drifting machine load affects both alike.
if [[ -n ${STEP_TRACE:-} ]]; then
  ours=$(RUST_LOG=mlxd_engine::step=trace "$bench" "$model" "$prompt" "$new" "$runs" "$batch" "$temperature" 2>"$STEP_TRACE")
else
  ours=$("$bench" "$model" "$prompt" "$new" "$runs" "$batch" "$temperature")
fi
theirs=$("$python" scripts/bench/mlx_lm_bench.py "$model" "$prompt" "$new" "$runs" "$batch" "$temperature")
echo "$ours"
echo "$theirs"
"$python" - "$ours" "$theirs" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(json.dumps({
    "batch": a["batch"], "temperature": a["temperature"],
    "ratio_decode_tps": round(a["decode_tps"] / b["decode_tps"], 3),
    "ratio_prefill_tps": round(a["prefill_tps"] / b["prefill_tps"], 3),
    "ratio_ttft": round(a["ttft_s"] / b["ttft_s"], 3),
}))
PY
if [[ -n ${STEP_TRACE:-} ]]; then
  "$python" scripts/bench/step_trace.py "$STEP_TRACE"
fi
