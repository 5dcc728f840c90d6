#!/usr/bin/env bash
# The H200 benchmark set behind BENCHMARKS.md, run on the device machine (see
# ../shared/gpu/README.md) after `source .gpu/b/on-device.sh`, with the release binaries in
# $MLXD_BIN_DIR (or, in two calls, after `source scripts/gpu_on_device.sh`: see
# scripts/gpu_bundle.sh). Every figure is mlxd against mlx-lm on the same MLX build, in one run.
#
#   scripts/bench/h200.sh models <tokenizer dir>   random-weight Llama shapes under $MODELS
#   scripts/bench/h200.sh engine <out dir>         engine core against mlx-lm (1B shapes)
#   scripts/bench/h200.sh engine8b <out dir>       the same for the 8B shape (models8b)
#   scripts/bench/h200.sh engine8b-q4 <out dir>    the 8B shape in 4 bits (models8b-q4)
#   scripts/bench/h200.sh serve <out dir>          mlxd against mlx_lm.server, prefix cache
#   scripts/bench/h200.sh prefix <out dir>         the prefix-cache part alone
#   scripts/bench/h200.sh served <out dir>         issue 21's served target: 64 and 128 streams of 128 tokens
#                                                  at 0.7 through one mlxd on the 1B (default batch size), a
#                                                  warm-up round first, ROUNDS (default 3) rounds of each
#   scripts/bench/h200.sh proxy <out dir>          streams straight to an engine against through mlxd
#   scripts/bench/h200.sh speculative <out dir> <gguf>  n-gram drafting on the default model (from
#                                                  its GGUF) and 1B drafting for 8B (models, models8b)
#   scripts/bench/h200.sh kvquant <out dir>        8B shape: decode at 4k/16k context (KV_CTX), bf16 KV against
#                                                  8- and 4-bit, and mlx-lm's quantized KV (models8b)
#   scripts/bench/h200.sh decode8b <out dir>       8B shape, one row at 16k (KV_CTX): mlxd and mlx-lm, each also
#                                                  with MLX's cuDNN attention off, mlxd also unstacked (models8b)
#   scripts/bench/h200.sh resume <out dir>         a resumed stream's pause after kill -9 against the restart time
#   scripts/bench/h200.sh standby <out dir>        the same under 32 streams with a standby engine taking over,
#                                                  against a cold restart (models)
#   scripts/bench/h200.sh constraint <out dir>     constrained decoding's cost per token (1B shape)
#   scripts/bench/h200.sh ssd <out dir>            SSD KV tier: TTFT of a 2 000/8 000-token shared prefix after
#                                                  an engine restart, restored against prefilled; the resume
#                                                  pause with generation checkpoints (1B bf16)
#   scripts/bench/h200.sh adapters <out dir>       32 streams over 4 random LoRA adapters of the 1B base against
#                                                  32 on the base alone, one mlxd per ADAPTER_SWITCHES value
#                                                  (MLXD_LORA_KERNEL: kernels or matmuls), ADAPTER_TRACE=1 for
#                                                  the engines' step traces (models)
#   scripts/bench/h200.sh longctx <out dir>        served decode over long prompts (LONG_WORDS numbered words,
#                                                  ~3.8 tokens each): 32 and 64 streams on the 1B, one mlxd per
#                                                  LONG_SWITCHES value of MLXD_PLAIN_DECODE_ATTENTION (models)
#   scripts/bench/h200.sh lora <out dir>           LoRA training tokens/s and peak memory: mlxd's lora job against
#                                                  mlx-lm's trainer, 1B bf16, rank 8, 16 layers, batch 4, 512 tokens
#   scripts/bench/h200.sh oom <out dir>            scripts/soak/gpu_oom.py: an engine driven out of GPU memory
#                                                  beside another model's engine (models)
#   scripts/bench/h200.sh quantize <out dir>       quantizing the 8B shape (bf16) to 4 and 8 bits:
#                                                  mlxd's quantize job against mlx_lm.convert -q (models8b)
#
# The tokenizer dir holds SmolLM2's tokenizer.json and tokenizer_config.json (vocabulary 49152,
# which the shapes use), so that served streams are real text.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
export MODELS=${MODELS:-/tmp/models}
export PYTHON=${PYTHON:-python3}
bins=${MLXD_BIN_DIR:-$root/target/release}
export BENCH_BIN=${BENCH_BIN:-$bins/bench_generate}
export BENCH_CONSTRAINT_BIN=${BENCH_CONSTRAINT_BIN:-$bins/bench_constraint}

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# start_mlxd <model dir> [serve args]: serves it on a free port; sets $port and $pid.
# MLXD_TRACE_LOG=<file>: its log, with its engine's step and prefix traces, goes there.
start_mlxd() {
  port=$(free_port)
  local model=$1
  shift
  local log=warn stderr=/dev/stderr
  if [[ -n ${MLXD_TRACE_LOG:-} ]]; then
    log=warn,mlxd_engine::step=trace,mlxd_engine::prefix=debug,mlxd::engine=trace
    stderr=$MLXD_TRACE_LOG
  fi
  XDG_RUNTIME_DIR=$(mktemp -d) RUST_LOG=$log "$bins/mlxd" serve --model "$model" --port "$port" "$@" 2>>"$stderr" &
  pid=$!
  for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && return 0; sleep 0.5; done
  echo "mlxd did not come up" >&2
  return 1
}

gen() { # gen <shape> <name> [extra args]
  local shape=$1 name=$2
  shift 2
  [[ -f $MODELS/$name/config.json ]] ||
    "$PYTHON" scripts/gen_random_model.py --shape "$shape" --dtype bfloat16 --vocab 49152 \
      --out "$MODELS/$name" "$@" >/dev/null
  cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json "$MODELS/$name/"
}

engine() { # engine <out> <model> <prompt> <new> <batch> <temperature>
  local out=$1 model=$2
  shift 2
  echo "== engine $model $*" >&2
  scripts/bench/engine.sh "$MODELS/$model" "$1" "$2" 3 "$3" "$4" |
    "$PYTHON" -c 'import sys, json
lines = [json.loads(l) for l in sys.stdin]
print(json.dumps({"model": sys.argv[1], "ours": lines[0], "mlx_lm": lines[1], **lines[2]}))' "$model" |
    tee -a "$out/engine.jsonl"
}

# case_line <case>: the last JSON line on stdin, with "case" first.
case_line() {
  "$PYTHON" -c 'import sys, json; last = [l for l in sys.stdin if l.startswith("{")][-1]; print(json.dumps({"case": sys.argv[1], **json.loads(last)}))' "$1"
}

case ${1:-} in
  models)
    tok=$2
    gen llama-1b llama-1b-bf16
    gen llama-1b llama-1b-q4 --quantize 4
    ;;
  models8b)
    tok=$2
    gen llama-8b llama-8b-bf16
    ;;
  models8b-q4)
    tok=$2
    gen llama-8b llama-8b-q4 --quantize 4
    ;;
  engine)
    out=$2
    mkdir -p "$out"
    engine "$out" llama-1b-bf16 512 256 1 0
    engine "$out" llama-1b-bf16 512 256 1 0.7
    engine "$out" llama-1b-bf16 128 128 8 0
    engine "$out" llama-1b-bf16 128 128 32 0
    engine "$out" llama-1b-bf16 128 128 32 0.7
    engine "$out" llama-1b-bf16 128 128 64 0
    engine "$out" llama-1b-bf16 4096 16 1 0
    engine "$out" llama-1b-q4 512 256 1 0
    engine "$out" llama-1b-q4 128 128 32 0
    ;;
  engine8b)
    out=$2
    mkdir -p "$out"
    engine "$out" llama-8b-bf16 512 128 1 0
    engine "$out" llama-8b-bf16 4096 8 1 0
    engine "$out" llama-8b-bf16 128 64 8 0
    ;;
  engine8b-q4)
    out=$2
    mkdir -p "$out"
    engine "$out" llama-8b-q4 512 128 1 0
    ;;
  serve | prefix)
    out=$2
    mkdir -p "$out"
    [[ $1 == prefix ]] || MLXD_BIN_DIR=$bins scripts/bench/serve_compare.sh "$MODELS/llama-1b-bf16" "$out/serve.jsonl" 1 8 32 64
    start_mlxd "$MODELS/llama-1b-bf16"
    for words in ${PREFIX_WORDS:-1500 6000}; do
      "$PYTHON" scripts/bench/prefix_cache.py --url "http://127.0.0.1:$port" --history-words "$words" --out "$out/prefix.jsonl"
    done
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    ;;
  served)
    out=$2
    mkdir -p "$out"
    start_mlxd "$MODELS/llama-1b-bf16"
    # The fresh engine compiles its kernels for each shape in the warm-up round.
    for streams in 64 128; do
      "$PYTHON" scripts/bench/serve.py --url "http://127.0.0.1:$port" --streams "$streams" --temperature 0.7 \
        --max-tokens 128 --label "$streams-warm" --out "$out/served.jsonl" >/dev/null
    done
    for round in $(seq 1 "${ROUNDS:-3}"); do
      for streams in 64 128; do
        "$PYTHON" scripts/bench/serve.py --url "http://127.0.0.1:$port" --streams "$streams" --temperature 0.7 \
          --max-tokens 128 --label "$streams-$round" --out "$out/served.jsonl" | tail -1
      done
    done
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    ;;
  resume)
    # Transparent resumption: kill -9 of the engine mid-stream; the stream's pause against
    # the engine's restart time (1 stream, then 8), 1B bf16, prefix cache off.
    out=$2
    mkdir -p "$out"
    for streams in 1 8; do
      MLXD_BIN_DIR=$bins "$PYTHON" scripts/bench/resume.py 5 128 32 "$MODELS/llama-1b-bf16" "$streams" |
        tee "$out/resume-$streams.jsonl"
    done
    ;;
  standby)
    # A standby engine per model: kill -9 of the serving engine under 32 streams; the pause
    # with the spare taking over against a cold restart (issue 23's target: <= 250 ms). 1B bf16.
    out=$2
    mkdir -p "$out"
    for standby in 1 0; do
      MLXD_BIN_DIR=$bins "$PYTHON" scripts/bench/resume.py 5 128 32 "$MODELS/llama-1b-bf16" 32 0 "$standby" |
        tee "$out/resume-32-standby-$standby.jsonl"
    done
    ;;
  adapters)
    # Adapters mixed in the batch: 32 streams spread over 4 LoRA adapters (rank 8, the last 16
    # layers, random factors) of one 1B base, against 32 streams on the base alone and 32 on
    # one adapter, all on one mlxd (issue 25's target: mixed >= 0.8x the base alone).
    out=$2
    mkdir -p "$out"
    list=
    # ADAPTER_DTYPE=bfloat16: factors in the base's dtype (mlx-lm writes float32).
    dtype=${ADAPTER_DTYPE:-float32}
    for i in 1 2 3 4; do
      dir=$MODELS/lora-$dtype-$i
      [[ -f $dir/adapters.safetensors ]] ||
        "$PYTHON" scripts/bench/random_lora.py --model "$MODELS/llama-1b-bf16" --out "$dir" --seed "$i" --dtype "$dtype" >/dev/null
      list="$list${list:+,}a$i=$dir"
    done
    base=llama-1b-bf16
    # ADAPTER_SWITCHES: the values of MLXD_LORA_KERNEL to run, one mlxd each, in this order
    # (default "1": the kernels; "1 0 1 0" alternates them with the matmuls on one machine).
    # ADAPTER_TRACE=1: each mlxd's log with its engine's step trace in adapters-trace-<n>.log
    # (`scripts/bench/step_trace.py --slow 100 <log>` lists the steps and gaps over 100 ms).
    n=0
    for switch in ${ADAPTER_SWITCHES:-1}; do
      n=$((n + 1))
      trace=; [[ ${ADAPTER_TRACE:-0} == 1 ]] && trace=$out/adapters-trace-$n.log
      MLXD_TRACE_LOG=$trace MLXD_LORA_KERNEL=$switch start_mlxd "$MODELS/llama-1b-bf16" --adapters "$list" --max-batch-size 64
      # ADAPTER_TEMPS: the temperatures run (default "0.7 0"); ADAPTER_TOKENS: each stream's
      # max_tokens (default 128; longer runs vary less from round to round); ADAPTER_ROUNDS:
      # timed rounds after the warm-up round (default 2).
      for t in ${ADAPTER_TEMPS:-0.7 0}; do
        for round in warm $(seq 1 "${ADAPTER_ROUNDS:-2}"); do
          for mix in base one four; do
            case $mix in
              base) models=$base ;;
              one) models=$base:a1 ;;
              four) models=$base:a1,$base:a2,$base:a3,$base:a4 ;;
            esac
            label=$mix; [[ $round == warm ]] && label=warm
            "$PYTHON" scripts/bench/serve.py --url "http://127.0.0.1:$port" --streams 32 --temperature "$t" \
              --max-tokens "${ADAPTER_TOKENS:-128}" --model "$models" --label "$label" \
              --out "$out/adapters-kernels-$switch.jsonl"
          done
        done
      done
      kill "$pid"
      wait "$pid" 2>/dev/null || true
    done
    ;;
  longctx)
    # Long contexts served: every stream's prompt is ~LONG_WORDS × 3.8 tokens, so each decode
    # step attends over thousands of positions. The first round of a process is its cold one
    # (a prefill of every prompt; a kernel compiled mid-request shows in its time to first
    # token); later rounds repeat the prompts, so they are prefix hits and mostly decode.
    out=$2
    mkdir -p "$out"
    for switch in ${LONG_SWITCHES:-default 0}; do
      if [[ $switch == default ]]; then
        start_mlxd "$MODELS/llama-1b-bf16" --max-batch-size 64
      else
        MLXD_PLAIN_DECODE_ATTENTION=$switch start_mlxd "$MODELS/llama-1b-bf16" --max-batch-size 64
      fi
      for streams in ${LONG_STREAMS:-32 64}; do
        for round in cold $(seq 1 "${LONG_ROUNDS:-2}"); do
          "$PYTHON" scripts/bench/serve.py --url "http://127.0.0.1:$port" --streams "$streams" \
            --temperature "${LONG_TEMP:-0}" --max-tokens "${LONG_TOKENS:-128}" \
            --context-words "${LONG_WORDS:-700}" --label "plain-$switch-$round" \
            --out "$out/longctx.jsonl"
        done
      done
      kill "$pid"
      wait "$pid" 2>/dev/null || true
    done
    ;;
  lora)
    out=$2
    mkdir -p "$out"
    "$PYTHON" scripts/bench/lora_train.py --model "$MODELS/llama-1b-bf16" --mlxd-bin "$bins" \
      --iters "${LORA_ITERS:-30}" --out "$out/lora.jsonl"
    ;;
  oom)
    out=$2
    mkdir -p "$out"
    "$PYTHON" scripts/soak/gpu_oom.py --mlxd-bin "$bins" --model "$MODELS/llama-1b-bf16" --out "$out/gpu_oom.json" \
      ${OOM_ARGS:-}
    ;;
  ssd)
    # The SSD KV tier: TTFT after an engine restart of a request whose long prefix is on disk,
    # restored against prefilled; then the resume pause with generation checkpoints every 16
    # tokens (against the `resume` mode's pause without them). 1B bf16.
    out=$2
    mkdir -p "$out"
    for tokens in 2000 8000; do
      MLXD_BIN_DIR=$bins "$PYTHON" scripts/bench/ssd_ttft.py 5 "$tokens" "$MODELS/llama-1b-bf16" |
        tee "$out/ssd-ttft-$tokens.jsonl"
    done
    MLXD_BIN_DIR=$bins "$PYTHON" scripts/bench/resume.py 5 128 96 "$MODELS/llama-1b-bf16" 1 16 |
      tee "$out/resume-checkpoint.jsonl"
    MLXD_BIN_DIR=$bins "$PYTHON" scripts/bench/resume.py 5 128 96 "$MODELS/llama-1b-bf16" 1 |
      tee "$out/resume-no-checkpoint.jsonl"
    ;;
  proxy)
    # The proxy's share: the same streams straight to one engine's socket and through mlxd.
    out=$2
    mkdir -p "$out"
    sock=$(mktemp -u /tmp/mlxd-engine.XXXX.sock)
    RUST_LOG=warn "$bins/mlxd-engine" --model "$MODELS/llama-1b-bf16" --unix "$sock" &
    epid=$!
    start_mlxd "$MODELS/llama-1b-bf16"
    for _ in $(seq 1 240); do [[ -S $sock ]] && break; sleep 0.5; done
    for t in 0 0.7; do
      for n in 32 64; do
        for round in warm 1 2; do
          label=direct; [[ $round == warm ]] && label=warm
          "$PYTHON" scripts/bench/serve.py --url "unix:$sock" --streams "$n" --temperature "$t" --label "$label" --out "$out/proxy.jsonl"
          label=mlxd; [[ $round == warm ]] && label=warm
          "$PYTHON" scripts/bench/serve.py --url "http://127.0.0.1:$port" --streams "$n" --temperature "$t" --label "$label" --out "$out/proxy.jsonl"
        done
      done
    done
    kill "$pid" "$epid"
    wait 2>/dev/null || true
    ;;
  speculative)
    out=$2 gguf=$3
    mkdir -p "$out"
    tok=${TOK:-$root/.bench/tok}
    # The default model, converted from its GGUF by the engine's own store.
    export MLXD_HOME=${MLXD_HOME:-/tmp/mlxd-home} MLXD_SMOLLM2_GGUF=$gguf
    sock=$(mktemp -u /tmp/mlxd-convert.XXXX.sock)
    RUST_LOG=warn "$bins/mlxd-engine" --model smollm2-135m --unix "$sock" &
    cpid=$!
    for _ in $(seq 1 600); do [[ -S $sock ]] && break; sleep 0.5; done
    kill "$cpid"; wait "$cpid" 2>/dev/null || true
    smol=$MLXD_HOME/models/smollm2-135m
    "$PYTHON" scripts/bench/grounded_prompt.py "$smol" "$out/grounded-smollm2.json"
    "$PYTHON" scripts/bench/chat_prompts.py "$smol" "$out/chat-smollm2.json"
    # SPEC_AGREEMENT=0 skips the quantized-KV agreement; SPEC_RUNS sets the runs per case.
    [[ ${SPEC_AGREEMENT:-1} == 0 ]] ||
      "$bins/kv_agreement" "$smol" "$out/chat-smollm2.json" 256 | tee -a "$out/kv_agreement.jsonl"
    runs=${SPEC_RUNS:-3}
    PYTHON=$PYTHON scripts/bench/speculative.sh "$smol" "$out/grounded-smollm2.json" 256 "$runs" "$out/speculative.jsonl" "" "1 8"
    "$PYTHON" scripts/bench/grounded_prompt.py "$tok" "$out/grounded-llama.json"
    PYTHON=$PYTHON scripts/bench/speculative.sh "$MODELS/llama-8b-bf16" "$out/grounded-llama.json" 128 "$runs" "$out/speculative.jsonl" "$MODELS/llama-1b-bf16" "1 8"
    ;;
  kvquant)
    out=$2
    mkdir -p "$out"
    for ctx in ${KV_CTX:-4096 16384}; do
      for bits in none 8 4; do
        kv=(); [[ $bits == none ]] || kv=(--kv-bits "$bits")
        echo "== kv $bits ctx $ctx" >&2
        "$BENCH_BIN" "$MODELS/llama-8b-bf16" "$ctx" 64 3 1 0 "${kv[@]}" |
          case_line "mlxd kv $bits" | tee -a "$out/kvquant.jsonl"
        # mlx-lm's quantized cache has no CUDA kernel for long prefill chunks: record the failure.
        { "$PYTHON" scripts/bench/mlx_lm_bench.py "$MODELS/llama-8b-bf16" "$ctx" 64 3 1 0 "${kv[@]}" ||
          echo '{"failed": true}'; } |
          case_line "mlx-lm kv $bits" | tee -a "$out/kvquant.jsonl"
      done
    done
    ;;
  decode8b)
    # Where mlx-lm's lead at one long row comes from: MLX sends a one-query step over mlx-lm's
    # cache (a buffer of whole 256-position steps) to cuDNN; MLX_CUDA_USE_CUDNN_SDPA=0 sends it
    # to MLX's vector kernel, as mlxd's buffers do (cache::stored::capacity_for).
    out=$2
    mkdir -p "$out"
    for ctx in ${KV_CTX:-16384}; do
      for run in "mlxd" "mlxd unstacked" "mlxd cudnn-off" "mlx-lm" "mlx-lm cudnn-off"; do
        echo "== $run ctx $ctx" >&2
        cudnn=1; stacked=1
        [[ $run == *cudnn-off ]] && cudnn=0
        [[ $run == *unstacked ]] && stacked=0
        if [[ $run == mlxd* ]]; then
          MLX_CUDA_USE_CUDNN_SDPA=$cudnn MLXD_STACKED_PROJECTIONS=$stacked \
            "$BENCH_BIN" "$MODELS/llama-8b-bf16" "$ctx" 64 3 1 0
        else
          MLX_CUDA_USE_CUDNN_SDPA=$cudnn "$PYTHON" scripts/bench/mlx_lm_bench.py "$MODELS/llama-8b-bf16" "$ctx" 64 3 1 0
        fi | case_line "$run" | tee -a "$out/decode8b.jsonl"
      done
    done
    ;;
  constraint)
    out=$2
    mkdir -p "$out"
    for b in 1 8 32; do
      scripts/bench/constraint.sh "$MODELS/llama-1b-bf16" "$b" 128 3 | tee -a "$out/constraint.jsonl"
    done
    ;;
  quantize)
    out=$2
    mkdir -p "$out"
    for bits in 4 8; do
      echo "== quantize llama-8b-bf16 to $bits bits" >&2
      PYTHON=$PYTHON ENGINE_BIN=$bins/mlxd-engine scripts/bench/quantize.sh "$MODELS/llama-8b-bf16" "$bits" 64 3 "$out/quantize.jsonl"
    done
    ;;
  *)
    sed -n '2,/^set -euo pipefail/p' "$0" | sed '$d'
    exit 64
    ;;
esac
