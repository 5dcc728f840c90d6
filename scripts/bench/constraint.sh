#!/usr/bin/env bash
# What constrained decoding (structured output, forced tool calls) costs per token.
#
#   scripts/bench/constraint.sh [model dir] [batch] [new tokens] [runs]
#
# Prints the JSON line of engine/examples/bench_constraint.rs: llguidance's mask and commit
# per token, the mask row's upload, and decode tokens/s of `batch` rows unconstrained, all
# under an allow-everything constraint (the synchronous step and the mask alone), and with one
# constrained row among them. BENCH_CONSTRAINT_BIN overrides the binary (default: the release
# example, built when missing).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
model=${1:-${MLXD_HOME:-$HOME/.cache/mlxd}/models/smollm2-135m}
batch=${2:-8}
new=${3:-64}
runs=${4:-3}
bench=${BENCH_CONSTRAINT_BIN:-target/release/examples/bench_constraint}
[[ -x $bench ]] || cargo build --release -q -p mlxd-engine --example bench_constraint
"$bench" "$model" "$batch" "$new" "$runs"
