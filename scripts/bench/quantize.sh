#!/usr/bin/env bash
# Quantizing a model with mlxd's quantize job against `mlx_lm.convert -q`, same MLX, one run.
#
#   scripts/bench/quantize.sh <model dir> [bits] [group size] [runs] [out.jsonl]
#
# Defaults: 4 bits, group 64, 3 runs. The engine binary is $ENGINE_BIN, else
# target/release/mlxd-engine, else target/debug/mlxd-engine (the job's work is MLX's either way;
# the binary's own code only moves tensors). PYTHON overrides the interpreter (default .venv's).
# Prints the JSON line of scripts/bench/quantize.py (medians, peak RSS, whether the tensors are
# bit-identical) and appends it to out.jsonl when given.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
model=${1:?usage: quantize.sh <model dir> [bits] [group size] [runs] [out.jsonl]}
bits=${2:-4}
group=${3:-64}
runs=${4:-3}
out=${5:-}
python=${PYTHON:-.venv/bin/python}
engine=${ENGINE_BIN:-}
if [[ -z $engine ]]; then
  for b in target/release/mlxd-engine target/debug/mlxd-engine; do
    [[ -x $b ]] && engine=$b && break
  done
fi
[[ -n $engine ]] || { echo "no mlxd-engine binary: cargo build -p mlxd-engine, or set ENGINE_BIN" >&2; exit 1; }
line=$("$python" scripts/bench/quantize.py "$engine" "$model" "$bits" "$group" "$runs" --compare)
echo "$line"
[[ -z $out ]] || echo "$line" >>"$out"
