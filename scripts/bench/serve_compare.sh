#!/usr/bin/env bash
# Serving through mlxd against mlx_lm.server on the same model, same machine, same MLX, in one
# run: for each temperature and stream count, the two are measured back to back.
#
#   scripts/bench/serve_compare.sh <model dir> [out.jsonl] [streams...]
#
# Environment: MLXD_BIN_DIR (default target/release), PYTHON (default .venv/bin/python),
# MAX_TOKENS (default 128), TEMPS (default "0 0.7").
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model=$1
out=${2:-/dev/null}
shift $(( $# >= 2 ? 2 : $# ))
streams=("$@")
((${#streams[@]})) || streams=(1 8 32 64)
bins=${MLXD_BIN_DIR:-$root/target/release}
python=${PYTHON:-$root/.venv/bin/python}
max_tokens=${MAX_TOKENS:-128}
read -r -a temps <<<"${TEMPS:-0 0.7}"
free_port() { "$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() {
  for _ in $(seq 1 600); do
    curl -sf "$1/v1/models" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "server at $1 did not come up" >&2
  return 1
}
p1=$(free_port)
p2=$(free_port)
runtime=$(mktemp -d)
XDG_RUNTIME_DIR=$runtime RUST_LOG=warn "$bins/mlxd" serve --model "$model" --port "$p1" &
mlxd_pid=$!
"$python" -m mlx_lm server --model "$model" --port "$p2" --log-level WARNING &
ref_pid=$!
trap 'kill $mlxd_pid $ref_pid 2>/dev/null; wait 2>/dev/null; rm -rf "$runtime"' EXIT
wait_ready "http://127.0.0.1:$p1"
wait_ready "http://127.0.0.1:$p2"
bench() { "$python" "$root/scripts/bench/serve.py" "$@"; }
# Warm-up: first use of each batch shape (and of the sampling kernels) compiles kernels on CUDA.
for t in "${temps[@]}"; do
  for n in "${streams[@]}"; do
    bench --url "http://127.0.0.1:$p1" --streams "$n" --max-tokens 8 --temperature "$t" --label warm >/dev/null
    bench --url "http://127.0.0.1:$p2" --streams "$n" --max-tokens 8 --temperature "$t" --label warm >/dev/null
  done
done
for t in "${temps[@]}"; do
  for n in "${streams[@]}"; do
    bench --url "http://127.0.0.1:$p1" --streams "$n" --max-tokens "$max_tokens" --temperature "$t" --label mlxd --out "$out"
    bench --url "http://127.0.0.1:$p2" --streams "$n" --max-tokens "$max_tokens" --temperature "$t" --label mlx_lm.server --out "$out"
  done
done
