#!/usr/bin/env bash
# Packs what a benchmark on the device machine needs (MLX's CUDA build, mlx-lm, the stripped
# release binaries and SmolLM2's tokenizer) into two pieces, each small enough to travel in one
# `run` call beside the tracked tree (a call carries at most 64 MiB; the tree is ~19 MB). Two
# calls then set a fresh machine up, where ../shared/gpu/README.md's way takes three.
#
#   ../shared/gpu/stage.sh <mlx version> <mlx-lm version>   # once: fills .gpu/a and .gpu/b
#   cargo build --release -p mlxd-engine --bin mlxd-engine --example bench_generate -p mlxd-proxy --bin mlxd
#   scripts/gpu_bundle.sh [binaries dir] [tokenizer dir]
#
# Binaries: `mlxd`, `mlxd-engine` and `examples/bench_generate` from the binaries dir
# (default target/release), and EXTRA_EXAMPLES (names under examples/, e.g. "bench_prefix").
# Tokenizer: tokenizer.json and tokenizer_config.json from the converted default model
# (default $MLXD_HOME/models/smollm2-135m; `mlxd pull smollm2-135m` makes it). Writes
# .gpu/g1/bundle.part.aa and .gpu/g2/bundle.part.ab (git-ignored). The CUDA wheel's files,
# recompressed with xz (75 MB against the wheel's 90), are kept in .gpu/w-<wheel>.txz for the
# next bundle. On the device:
#
#   call 1, carry [".gpu/g1"]:  mkdir -p /root/stash && cp .gpu/g1/* /root/stash/
#   call 2 (within 30 s), carry [".gpu/g2"]:  source scripts/gpu_on_device.sh && <benchmark>
#
# Later calls on the same warm machine need only the `source` (no carry).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
bins=${1:-target/release}
tok=${2:-${MLXD_HOME:-$HOME/.cache/mlxd}/models/smollm2-135m}
shopt -s nullglob
first=(.gpu/a/mlx_cuda_13-*.part.aa)
second=(.gpu/b/mlx_cuda_13-*.part.ab)
wheels=(.gpu/b/mlx-*.whl .gpu/b/mlx_lm-*.whl)
if [[ ${#first[@]} -ne 1 || ${#second[@]} -ne 1 || ${#wheels[@]} -ne 2 ]]; then
  echo "gpu_bundle.sh: .gpu/a and .gpu/b do not hold one staged MLX build; run ../shared/gpu/stage.sh first" >&2
  exit 2
fi
binaries=("$bins/mlxd" "$bins/mlxd-engine" "$bins/examples/bench_generate")
for e in ${EXTRA_EXAMPLES:-}; do binaries+=("$bins/examples/$e"); done
for f in "${binaries[@]}" "$tok/tokenizer.json" "$tok/tokenizer_config.json"; do
  [[ -f $f ]] || { echo "gpu_bundle.sh: $f is missing" >&2; exit 2; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bundle" "$work/pack/bin" "$work/pack/tok"
wheel=$(basename "${first[0]}" .part.aa)
cached=.gpu/w-$wheel.txz
if [[ ! -f $cached ]]; then
  cat "${first[0]}" "${second[0]}" > "$work/cuda.whl"
  mkdir -p "$work/wheel"
  python3 -m zipfile -e "$work/cuda.whl" "$work/wheel"
  tar cf - -C "$work/wheel" . | xz -9 -T2 > "$cached.partial"
  mv "$cached.partial" "$cached"
fi
cp "$cached" "$work/bundle/w.txz"
cp "${wheels[@]}" "$work/bundle/"
cp "${binaries[@]}" "$work/pack/bin/"
strip "$work/pack/bin/"*
cp "$tok/tokenizer.json" "$tok/tokenizer_config.json" "$work/pack/tok/"
tar cf - -C "$work/pack" bin tok | xz -6 -T2 > "$work/bundle/both.txz"
tar cf "$work/bundle.tar" -C "$work/bundle" .
rm -rf .gpu/g1 .gpu/g2
mkdir -p .gpu/g1 .gpu/g2
split -n 2 "$work/bundle.tar" "$work/bundle.part."
mv "$work/bundle.part.aa" .gpu/g1/
mv "$work/bundle.part.ab" .gpu/g2/
tree_mb=$(($(git ls-files -z | xargs -0 cat 2>/dev/null | wc -c) / 1000000))
for part in .gpu/g1/bundle.part.aa .gpu/g2/bundle.part.ab; do
  mb=$(($(stat -c %s "$part") / 1000000))
  echo "$part: $mb MB (+ the tracked tree, $tree_mb MB)"
  if ((mb + tree_mb > 66)); then
    echo "gpu_bundle.sh: $part and the tree exceed the 64 MiB a call carries" >&2
    exit 1
  fi
done
