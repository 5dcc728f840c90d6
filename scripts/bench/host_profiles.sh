#!/usr/bin/env bash
# Where the host's time goes in a decode step and in a prefix hit, on the device that runs it.
#
#   scripts/bench/host_profiles.sh <model dir> <adapter dir>[,<adapter dir>...] <out dir>
#
# Engine core at 32 greedy rows, 128-token prompts, 256 new tokens: the base, then every row
# taking one of the adapters in turn, each sampled on the host (MLXD_HOST_PROFILE, with the step
# trace on stderr); then 60 prefix hits at 5 000 tokens (bench_prefix, the hits alone sampled: a
# hit is ~12 ms on an H100, ~3 samples at the kernel's 4 ms tick); then MLX's CUDA graph size
# (MLX_MAX_OPS_PER_BUFFER=400, MLX_MAX_MB_PER_BUFFER=20000 against MLX's defaults), base and
# adapters, unprofiled; then the CUDA graphs of one miss and one hit as dot files
# (MLX_SAVE_CUDA_GRAPHS_DOT_FILE, in graphs.tgz). Read the profiles here with
# scripts/bench/host_profile.py and the same build's unstripped binaries. BENCH_BIN and
# PREFIX_BIN override the benchmark binaries (default target/release/examples/).
set -uo pipefail
model=$1 adapters=$2 out=$3
bins=${BINS:-target/release/examples}
bench=${BENCH_BIN:-$bins/bench_generate}
prefix=${PREFIX_BIN:-$bins/bench_prefix}
mkdir -p "$out"
t0=$SECONDS
profile() {
  local tag=$1
  shift
  MLXD_HOST_PROFILE=$out/profile-$tag.txt RUST_LOG=mlxd_engine::step=trace timeout 120 \
    "$bench" "$model" 128 256 3 32 0 "$@" >"$out/line.tmp" 2>"$out/trace-$tag.log"
  echo "$tag: rc $? at $((SECONDS - t0)) s: $(tail -1 "$out/line.tmp")"
  cat "$out/line.tmp" >>"$out/core-profiled.jsonl"
}
profile base
profile adapters --adapters "$adapters"
MLXD_HOST_PROFILE=$out/profile-hit.txt RUST_LOG=mlxd_engine::step=trace,mlxd_engine::prefix=debug \
  timeout 120 "$prefix" "$model" 60 5000 >"$out/prefix.jsonl" 2>"$out/trace-hit.log"
echo "prefix hits: rc $? at $((SECONDS - t0)) s: $(cat "$out/prefix.jsonl")"
core() {
  local ops=$1
  shift
  timeout 60 "$bench" "$model" 128 256 3 32 0 "$@" >"$out/line.tmp" 2>/dev/null
  echo "graph ops $ops $*: rc $? at $((SECONDS - t0)) s: $(tail -1 "$out/line.tmp")"
  sed "s/^{/{\"max_ops_per_buffer\":\"$ops\",/" "$out/line.tmp" >>"$out/core-graph-size.jsonl"
}
for round in 1 2; do
  core default
  core default --adapters "$adapters"
  MLX_MAX_OPS_PER_BUFFER=400 MLX_MAX_MB_PER_BUFFER=20000 core 400
  MLX_MAX_OPS_PER_BUFFER=400 MLX_MAX_MB_PER_BUFFER=20000 core 400 --adapters "$adapters"
done
dots=$(mktemp -d)
MLX_SAVE_CUDA_GRAPHS_DOT_FILE=$dots/graph timeout 60 "$prefix" "$model" 1 5000 >/dev/null 2>&1
echo "graphs: rc $? $(ls "$dots" | wc -l) files"
tar czf "$out/graphs.tgz" -C "$dots" .
rm -f "$out/line.tmp"
echo "done at $((SECONDS - t0)) s"
