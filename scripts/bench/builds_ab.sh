#!/usr/bin/env bash
# Two builds of the engine on one machine, for a change to the decode step's host cost: the
# engine core at 32 greedy rows (128-token prompts, 256 new tokens, three runs each) on the
# base and with every row taking one of four adapters in turn, builds alternating, then 32
# served streams over the four adapters against the base alone (`h200.sh adapters`, 256
# tokens, greedy) on each build's mlxd.
#
#   OLD=<dir> NEW=<dir> scripts/bench/builds_ab.sh <model dir> <adapter dir>,<...>x4 <out dir>
#
# Each dir holds a build's mlxd, mlxd-engine and bench_generate. The served part is h200.sh's:
# the model dir must be named llama-1b-bf16 and its adapters are h200.sh's lora-float32-<i>
# beside it (made if missing; the engine rounds take the four given). ROUNDS (default 2)
# engine rounds; DEADLINE (seconds, default 600) stops before a step that would not fit.
# Lines go to core.jsonl and served.jsonl, each with the build's name ("old" or "new").
set -uo pipefail
model=$1 adapters=$2 out=$3
mkdir -p "$out"
t0=$SECONDS
left() { echo $((${DEADLINE:-600} - (SECONDS - t0))); }
# A run's time limit: `limit` seconds, or what is left before DEADLINE if less. The first runs
# of a fresh machine wait for MLX to compile its kernels (on an H100 in session 47 the first
# core run took over 60 s and the first served warm-up round 110 s), so the limits leave room.
cap() { local l; l=$(left); echo $(($1 < l ? $1 : (l > 1 ? l : 1))); }
dir_of() { [[ $1 == old ]] && echo "$OLD" || echo "$NEW"; }
core() { # core <old|new> [bench_generate args]
  local which=$1
  shift
  timeout "$(cap 150)" "$(dir_of "$which")/bench_generate" "$model" 128 256 3 32 0 "$@" >"$out/line.tmp" 2>/dev/null
  echo "core $which ${1:+adapters }rc $? at $((SECONDS - t0)) s: $(grep -o '"decode_tps":[0-9.]*' "$out/line.tmp")"
  sed "s/}\$/,\"build\":\"$which\"}/" "$out/line.tmp" >>"$out/core.jsonl"
}
for _ in $(seq 1 "${ROUNDS:-2}"); do
  [[ $(left) -gt 150 ]] || break
  core old
  core new
  core old --adapters "$adapters"
  core new --adapters "$adapters"
done
models_dir=$(dirname "$model")
for which in new old; do
  [[ $(left) -gt 70 ]] || break
  # h200.sh finds the base and its adapters by name under MODELS.
  MODELS=$models_dir MLXD_BIN_DIR=$(dir_of "$which") ADAPTER_TOKENS=256 ADAPTER_ROUNDS=2 ADAPTER_TEMPS=0 \
    timeout "$(cap 240)" bash scripts/bench/h200.sh adapters "$out/served-$which" >/dev/null 2>&1
  echo "served $which rc $? at $((SECONDS - t0)) s"
  sed "s/}\$/,\"build\":\"$which\"}/" "$out/served-$which/adapters-kernels-1.jsonl" >>"$out/served.jsonl"
done
rm -f "$out/line.tmp"
