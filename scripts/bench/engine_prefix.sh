#!/usr/bin/env bash
# Issue 21's prefix-hit target against mlx-lm, in one run: time to first token of a prompt whose
# first N tokens are cached (a hit) against the same prompt with nothing cached (a miss), in the
# engine core (engine/examples/bench_prefix.rs) and in mlx-lm (scripts/bench/mlx_lm_prefix.py:
# generate_step over a trimmed prompt cache, as mlx_lm.server does). Target: hit_over_miss
# <= 0.10 at 5k and 30k tokens.
#
#   scripts/bench/engine_prefix.sh [model dir] [runs] [prefix tokens...]   (default: 5000 30000)
#
# The model's context must hold the longest prefix + 24 tokens. PREFIX_TRACE=FILE writes the
# engine's prefix spans there (RUST_LOG=mlxd_engine::prefix=debug): lookup, copy-in, the
# prefill of the rest and the first step of each request; and the step trace
# (mlxd_engine::step=trace): each prefill step's build and wait, each decode step's graph,
# async_eval and wait. PYTHON and BENCH_BIN as for engine.sh. PREFIX_TOGETHER=N: a burst of N
# prompts with distinct prefixes at once, misses then hits, in the engine core only
# (scripts/bench/mlx_lm_prefix.py times one prompt at a time: no reference for a burst).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
model=${1:-${MLXD_HOME:-$HOME/.cache/mlxd}/models/smollm2-135m}
runs=${2:-3}
shift $(( $# > 2 ? 2 : $# ))
lengths=("$@")
[[ ${#lengths[@]} -gt 0 ]] || lengths=(5000 30000)
python=${PYTHON:-.venv/bin/python}
bench=${BENCH_BIN:-target/release/examples/bench_prefix}
[[ -x $bench ]] || cargo build --release -q -p mlxd-engine --example bench_prefix
if [[ -n ${PREFIX_TOGETHER:-} ]]; then
  "$bench" "$model" "$runs" "${lengths[@]}" --together "$PREFIX_TOGETHER"
  exit
fi
if [[ -n ${PREFIX_TRACE:-} ]]; then
  RUST_LOG=mlxd_engine::prefix=debug,mlxd_engine::step=trace "$bench" "$model" "$runs" "${lengths[@]}" 2>"$PREFIX_TRACE"
else
  "$bench" "$model" "$runs" "${lengths[@]}"
fi
"$python" scripts/bench/mlx_lm_prefix.py "$model" "$runs" "${lengths[@]}"
