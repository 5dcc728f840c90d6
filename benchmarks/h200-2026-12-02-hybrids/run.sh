#!/usr/bin/env bash
# Lead's H200 run: delta-kernel parity, then Qwen3-Next (8 of 48 layers, 4-bit) against mlx-lm.
set -u
MLX_SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! python3 -c 'import mlx.core as mx; assert mx.__version__ == "0.32.4"; import mlx_lm' 2>/dev/null; then
  [[ -f /root/stash/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl.part.aa && -d .gpu/b ]] || { echo NEED_INSTALL; exit 3; }
  source .gpu/b/on-device.sh
fi
export LD_LIBRARY_PATH=$MLX_SITE/mlx/lib:$(ls -d $MLX_SITE/nvidia/*/lib | tr '\n' ':')
mkdir -p /root/stash/bin /root/stash/models
[[ -f .gpu/bins.tgz ]] && tar xzf .gpu/bins.tgz -C /root/stash/bin
export MODELS=/root/stash/models MLXD_BIN_DIR=/root/stash/bin PYTHON=python3 BENCH_BIN=/root/stash/bin/bench_generate
out=$OUT/r; mkdir -p "$out"
log() { echo "== $(date +%T) $*" | tee -a "$out/steps.log"; }
log deltakernel
timeout 120 scripts/bench/families_h200.sh "$out" /root/stash/tok deltakernel 2>&1 | tail -5
m=$MODELS/qwen3-next-q4
if [[ ! -f $m/config.json ]]; then
  log gen
  timeout 240 python3 scripts/bench/gen_family_shape.py --shape qwen3-next-80b-a3b --vocab 49152 \
    --tokenizer /root/stash/tok --layers 8 --quantize 4 --out "$m" 2>&1 | tail -3
  du -sh "$m"
fi
for spec in "4096 64 1" "32768 32 1"; do
  set -- $spec
  log "engine prompt $1 new $2 batch $3"
  timeout 200 scripts/bench/engine.sh "$m" "$1" "$2" 1 "$3" 0 2>&1 | tee -a "$out/qwen3next.jsonl" | tail -3
done
log "ours, ops path, 32768"
MLXD_DELTA_KERNEL=0 timeout 120 /root/stash/bin/bench_generate "$m" 32768 32 1 1 0 2>&1 | tee -a "$out/qwen3next-opspath.jsonl" | tail -2
log done
