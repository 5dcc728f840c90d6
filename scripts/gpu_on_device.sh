# Sourced on the device machine from the repo root, in the second call after
# scripts/gpu_bundle.sh's first piece was stashed (see there): installs MLX's CUDA build and
# mlx-lm into the machine's Python, unpacks the binaries and the tokenizer into /root/stash,
# makes the random-weight 1B bf16 model the benchmarks use, and exports what
# scripts/bench/h200.sh and its siblings read (LD_LIBRARY_PATH, MODELS, MLXD_BIN_DIR,
# BENCH_BIN, PYTHON). On a machine where it already ran it only exports (a few seconds).
S=/root/stash
export S
MLX_SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [[ ! -x $S/bin/mlxd ]]; then
  if [[ ! -f $S/bundle.part.aa || ! -f .gpu/g2/bundle.part.ab ]]; then
    echo "gpu_on_device.sh: needs $S/bundle.part.aa (the first call) and .gpu/g2 carried" >&2
    return 2 2>/dev/null || exit 2
  fi
  _t=$SECONDS
  rm -rf /tmp/mlxd-bundle && mkdir -p /tmp/mlxd-bundle
  cat "$S/bundle.part.aa" .gpu/g2/bundle.part.ab | tar xf - -C /tmp/mlxd-bundle
  xz -dc /tmp/mlxd-bundle/w.txz | tar xf - -C "$MLX_SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile /tmp/mlxd-bundle/mlx-*.whl /tmp/mlxd-bundle/mlx_lm-*.whl
  xz -dc /tmp/mlxd-bundle/both.txz | tar xf - -C "$S"
  rm -rf /tmp/mlxd-bundle
  echo "installed in $((SECONDS - _t)) s"
fi
export LD_LIBRARY_PATH=$MLX_SITE/mlx/lib:$(ls -d "$MLX_SITE"/nvidia/*/lib | tr '\n' ':')${LD_LIBRARY_PATH:-}
export MODELS=$S/models MLXD_BIN_DIR=$S/bin BENCH_BIN=$S/bin/bench_generate PYTHON=python3
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
mkdir -p "$MODELS"
if [[ ! -f $MODELS/llama-1b-bf16/config.json ]]; then
  _t=$SECONDS
  python3 scripts/gen_random_model.py --shape llama-1b --dtype bfloat16 --vocab 49152 \
    --out "$MODELS/llama-1b-bf16" >/dev/null
  cp "$S/tok/tokenizer.json" "$S/tok/tokenizer_config.json" "$MODELS/llama-1b-bf16/"
  echo "model made in $((SECONDS - _t)) s"
fi
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
