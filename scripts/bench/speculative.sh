#!/usr/bin/env bash
# Speculative decoding against no drafting and against mlx-lm, same machine, same MLX, one run.
#
#   scripts/bench/speculative.sh <model dir> <prompt ids.json> <new tokens> <runs> <out.jsonl> [draft dir] [batches]
#
# For each batch size (default "1 8"): mlxd without drafts, mlxd with n-gram prompt lookup,
# mlxd with the draft model (when given), and mlx-lm without drafts (generate_step at batch 1,
# BatchGenerator above) and with `--draft-model` (batch 1 only: mlx-lm has no batched
# speculative decoding). The prompt comes from scripts/bench/grounded_prompt.py (an
# input-grounded copy-and-correct task); every row of a batch gets it. Greedy. Each line is
# bench_generate's or mlx_lm_bench.py's JSON, with `drafted`/`accepted` totals where drafting ran.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
model=$1 ids=$2 new=$3 runs=$4 out=$5 draft=${6:-} batches=${7:-1 8}
python=${PYTHON:-.venv/bin/python}
bench=${BENCH_BIN:-target/release/examples/bench_generate}
[[ -x $bench ]] || cargo build --release -q -p mlxd-engine --example bench_generate
row() { # row <label> <command...>: runs it, appends its JSON with the label
  local label=$1
  shift
  echo "== $label" >&2
  "$@" | "$python" -c 'import sys, json
for l in sys.stdin:
    if l.startswith("{"):
        print(json.dumps({"case": sys.argv[1], **json.loads(l)}))' "$label" | tee -a "$out"
}
for b in $batches; do
  row "mlxd b$b" "$bench" "$model" 0 "$new" "$runs" "$b" 0 --prompt-ids "$ids"
  row "mlxd ngram b$b" "$bench" "$model" 0 "$new" "$runs" "$b" 0 --prompt-ids "$ids" --draft ngram
  [[ -z $draft ]] || row "mlxd draft b$b" "$bench" "$model" 0 "$new" "$runs" "$b" 0 --prompt-ids "$ids" --draft "$draft"
  row "mlx-lm b$b" "$python" scripts/bench/mlx_lm_bench.py "$model" 0 "$new" "$runs" "$b" 0 --prompt-ids "$ids"
  if [[ -n $draft && $b == 1 ]]; then
    row "mlx-lm draft b1" "$python" scripts/bench/mlx_lm_bench.py "$model" 0 "$new" "$runs" 1 0 --prompt-ids "$ids" --draft-model "$draft"
  fi
done
