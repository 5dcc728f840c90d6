#!/usr/bin/env bash
# MLX's cache limit and the decode step: is the served step slower than the engine core's
# because the serving engine bounds MLX's cache of freed buffers (1 GiB without a KV budget,
# `engine/src/app/memory.rs`)? Session 48 on an H100: no (BENCHMARKS.md).
#
#   MLXD_BIN_DIR=<dir> scripts/bench/cache_limit.sh <model dir> <out dir>
#
# 1. The engine core (`bench_generate`, 32 greedy rows, 128-token prompts, 256 new tokens,
#    three runs), rows of one length and `--ragged`, each with the limits of CORE_LIMITS
#    (GiB, or `mlx` for MLX's own; default "mlx 1 16"), in rounds (CORE_ROUNDS, default 1) so
#    that each arm meets the machine's drift in turn: core.jsonl, one line per run with its arm.
# 2. The served engine (`mlxd serve`, 32 streams of SERVED_TOKENS (default 512) greedy tokens
#    through scripts/bench/serve.py, SERVED_ROUNDS (default 3) timed rounds after a warm-up
#    round), one mlxd per arm of SERVED_ARMS (default "1g 16g 4g 1g 16g"): `1g` without a
#    configured KV budget (the engine's 1 GiB limit), `4g` and `16g` with configured budgets of
#    16 and 64 GiB (limits of 4 and 16 GiB: a quarter of the budget): served.jsonl, each
#    engine's figures (`/engines`, its cache limit and cached bytes among them) in
#    served-<arm>-<n>.engines.json and each mlxd's log with the engine's step trace in
#    served-<arm>-<n>.log (`scripts/bench/step_trace.py --rounds 500 <log>`).
# DEADLINE (seconds, default 600) stops before a step that would not fit.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
model=$1 out=$2
mkdir -p "$out"
bins=${MLXD_BIN_DIR:-$root/target/release}
PYTHON=${PYTHON:-python3}
[[ -x $bins/bench_generate && -x $bins/mlxd && -x $bins/mlxd-engine ]] || {
  echo "cache_limit.sh: $bins lacks bench_generate, mlxd or mlxd-engine" >&2
  exit 2
}
t0=$SECONDS
left() { echo $((${DEADLINE:-600} - (SECONDS - t0))); }
# A run's time limit: `limit` seconds, or what is left before DEADLINE if less.
cap() { local l; l=$(left); echo $(($1 < l ? $1 : (l > 1 ? l : 1))); }
gib=$((1 << 30))

core() { # core <arm> [bench_generate args]
  local arm=$1
  shift
  timeout "$(cap 150)" "$bins/bench_generate" "$model" 128 256 3 32 0 "$@" >"$out/line.tmp" 2>>"$out/core.err"
  echo "core $arm rc $? at $((SECONDS - t0)) s: $(grep -o '"decode_tps":[0-9.]*' "$out/line.tmp")"
  sed "s/}\$/,\"arm\":\"$arm\"}/" "$out/line.tmp" >>"$out/core.jsonl"
}
for _ in $(seq 1 "${CORE_ROUNDS:-1}"); do
  for layout in even ragged; do
    flag=(); [[ $layout == ragged ]] && flag=(--ragged)
    for limit in ${CORE_LIMITS:-mlx 1 16}; do
      [[ $(left) -gt 60 ]] || break 3
      if [[ $limit == mlx ]]; then
        core "$layout-mlx" "${flag[@]}"
      else
        core "$layout-${limit}g" "${flag[@]}" --cache-limit $((limit * gib))
      fi
    done
  done
done

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
served() { # served <arm> <run number> <KV budget or "none">
  local arm=$1 n=$2 budget=$3 config port pid name
  name=$arm-$n
  config=$out/served-$name.toml
  : >"$config"
  [[ $budget == none ]] || printf '[server.limits]\nkv_budget_bytes = "%s"\n' "$budget" >"$config"
  port=$(free_port)
  XDG_RUNTIME_DIR=$(mktemp -d) RUST_LOG=warn,mlxd_engine::step=trace,mlxd::engine=trace \
    "$bins/mlxd" serve --config "$config" --model "$model" --port "$port" --max-batch-size 64 \
    2>>"$out/served-$name.log" &
  pid=$!
  local up=0
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && { up=1; break; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  if ((up)); then
    for round in warm $(seq 1 "${SERVED_ROUNDS:-3}"); do
      [[ $(left) -gt 40 ]] || break
      timeout "$(cap 200)" "$PYTHON" scripts/bench/serve.py --url "http://127.0.0.1:$port" --streams 32 \
        --temperature 0 --max-tokens "${SERVED_TOKENS:-512}" --label "$name-$round" \
        --out "$out/served.jsonl" >/dev/null
      echo "served $name $round rc $? at $((SECONDS - t0)) s"
    done
    # The engine's own figures: its memory, the cache limit in force among them.
    curl -sf "http://127.0.0.1:$port/engines" >"$out/served-$name.engines.json"
  else
    echo "served $name: mlxd did not come up (see served-$name.log)"
  fi
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
}
n=0
for arm in ${SERVED_ARMS:-1g 16g 4g 1g 16g}; do
  [[ $(left) -gt 90 ]] || break
  n=$((n + 1))
  case $arm in
    1g) served 1g $n none ;;
    4g) served 4g $n 16GiB ;;
    16g) served 16g $n 64GiB ;;
    *) echo "cache_limit.sh: unknown arm $arm" >&2 ;;
  esac
done
rm -f "$out/line.tmp"
