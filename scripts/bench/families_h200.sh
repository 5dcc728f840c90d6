#!/usr/bin/env bash
# The model-family rows of BENCHMARKS.md, run on the device machine (../shared/gpu/README.md)
# after `source .gpu/b/on-device.sh`, release binaries in $MLXD_BIN_DIR. Every figure is mlxd
# against mlx-lm on the same MLX build, in one run, on random weights at real shapes
# (scripts/bench/gen_family_shape.py; vocabulary 49152 so SmolLM2's tokenizer reads the
# served text).
#
#   scripts/bench/families_h200.sh <out dir> <tokenizer dir> qwen3moe   Qwen3-30B-A3B 4-bit, batch 1/8/32
#   scripts/bench/families_h200.sh <out dir> <tokenizer dir> gptoss     gpt-oss-20b mxfp4, batch 1/8/32
#   scripts/bench/families_h200.sh <out dir> <tokenizer dir> gemma3     Gemma-3-12B bf16, batch 1, 8k prompt
#   scripts/bench/families_h200.sh <out dir> <tokenizer dir> serve      Qwen3-30B-A3B through mlxd against
#                                                                       mlx_lm.server, 32 streams
#   scripts/bench/families_h200.sh <out dir> <tokenizer dir> qwen3next  Qwen3-Next-80B-A3B shape (LAYERS of
#                                                                       its 48, default 12) 4-bit, and its
#                                                                       attention-only twin: decode at 4k and
#                                                                       32k context, batch 1 and 8
#   scripts/bench/families_h200.sh <out dir> <tokenizer dir> qwen3nexthit  a prefix hit at ~32k tokens
#                                                                       against a miss, through mlxd
#   scripts/bench/families_h200.sh <out dir> <tokenizer dir> deltakernel  greedy tokens of a tiny Qwen3-Next
#                                                                       (mlx-lm's fixture, made here) with the
#                                                                       CUDA delta kernel and with the ops path
#                                                                       against mlx-lm's on this GPU
# RUNS (default 2) timed runs after one warm-up; BATCHES (default "1 8 32").
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
out=$1
tok=$2
shift 2
export MODELS=${MODELS:-/tmp/models}
export PYTHON=${PYTHON:-python3}
bins=${MLXD_BIN_DIR:-$root/target/release}
export BENCH_BIN=${BENCH_BIN:-$bins/bench_generate}
[[ -x $BENCH_BIN ]] || { echo "no bench_generate at $BENCH_BIN" >&2; exit 1; }
runs=${RUNS:-2}
read -r -a batches <<<"${BATCHES:-1 8 32}"
mkdir -p "$out" "$MODELS"

gen() { # gen <shape> <name> [args]
  local shape=$1 name=$2
  shift 2
  [[ -f $MODELS/$name/config.json ]] ||
    "$PYTHON" scripts/bench/gen_family_shape.py --shape "$shape" --vocab 49152 --tokenizer "$tok" \
      --out "$MODELS/$name" "$@" >&2
}

engine() { # engine <model> <prompt> <new> <batch>
  local model=$1
  echo "== engine $model prompt $2 new $3 batch $4" >&2
  scripts/bench/engine.sh "$MODELS/$model" "$2" "$3" "$runs" "$4" 0 |
    "$PYTHON" -c 'import sys, json
lines = [json.loads(l) for l in sys.stdin]
print(json.dumps({"model": sys.argv[1], "ours": lines[0], "mlx_lm": lines[1], **lines[2]}))' "$model" |
    tee -a "$out/families.jsonl"
}

for what in "$@"; do
  case $what in
    qwen3moe)
      gen qwen3-30b-a3b qwen3-30b-a3b-q4 --quantize 4
      for b in "${batches[@]}"; do engine qwen3-30b-a3b-q4 512 64 "$b"; done
      ;;
    gptoss)
      gen gpt-oss-20b gpt-oss-20b-mxfp4 --mode mxfp4
      for b in "${batches[@]}"; do engine gpt-oss-20b-mxfp4 512 64 "$b"; done
      ;;
    qwen3next)
      layers=${LAYERS:-12}
      gen qwen3-next-80b-a3b qwen3-next-q4 --quantize 4 --layers "$layers"
      gen qwen3-next-80b-a3b qwen3-next-attn-q4 --quantize 4 --layers "$layers" --attention-only
      for model in qwen3-next-q4 qwen3-next-attn-q4; do
        for b in "${batches[@]}"; do engine "$model" 4096 64 "$b"; done
        RUNS=1 runs=1 engine "$model" 32768 64 1
      done
      ;;
    deltakernel)
      tiny=$MODELS/family-qwen3_next
      [[ -f $tiny/reference.json ]] ||
        "$PYTHON" scripts/gen_family_models.py --family qwen3_next --out "$tiny" >&2
      greedy=$bins/greedy
      [[ -x $greedy ]] || { echo "no greedy example at $greedy" >&2; exit 1; }
      "$PYTHON" - "$tiny" "$greedy" <<'PY' | tee -a "$out/deltakernel.jsonl"
import json, os, subprocess, sys
tiny, greedy = sys.argv[1], sys.argv[2]
ref = json.load(open(os.path.join(tiny, "reference.json")))
def run(kernel, case):
    env = dict(os.environ, MLXD_DELTA_KERNEL=kernel)
    args = [greedy, tiny, str(ref["max_tokens"])] + [str(t) for t in case["prompt"]]
    return [int(t) for t in subprocess.run(args, env=env, check=True, capture_output=True,
                                           text=True).stdout.split()]
rows = {"kernel": 0, "ops": 0, "cases": len(ref["cases"])}
for case in ref["cases"]:
    rows["kernel"] += run("1", case) == case["greedy"]
    rows["ops"] += run("0", case) == case["greedy"]
print(json.dumps({"deltakernel_equal_to_mlx_lm": rows}))
PY
      ;;
    qwen3nexthit)
      gen qwen3-next-80b-a3b qwen3-next-q4 --quantize 4 --layers "${LAYERS:-12}"
      port=18431
      XDG_RUNTIME_DIR=$(mktemp -d) RUST_LOG=info "$bins/mlxd" serve --model "$MODELS/qwen3-next-q4" \
        --host 127.0.0.1 --port $port >"$out/qwen3next-serve.log" 2>&1 &
      pid=$!
      trap 'kill $pid 2>/dev/null || true' EXIT
      for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break
        kill -0 $pid || { tail -20 "$out/qwen3next-serve.log" >&2; exit 1; }
        sleep 0.5
      done
      "$PYTHON" scripts/bench/prefix_cache.py --url "http://127.0.0.1:$port" \
        --history-words "${HISTORY_WORDS:-24000}" --runs 3 | tee -a "$out/qwen3next-hit.jsonl"
      kill $pid
      ;;
    gemma3)
      gen gemma-3-12b gemma-3-12b-bf16
      engine gemma-3-12b-bf16 8192 64 1
      ;;
    serve)
      gen qwen3-30b-a3b qwen3-30b-a3b-q4 --quantize 4
      MAX_TOKENS=${MAX_TOKENS:-128} TEMPS=0 MLXD_BIN_DIR=$bins \
        scripts/bench/serve_compare.sh "$MODELS/qwen3-30b-a3b-q4" "$out/serve.jsonl" 32
      ;;
    *)
      echo "unknown part $what" >&2
      exit 2
      ;;
  esac
done
