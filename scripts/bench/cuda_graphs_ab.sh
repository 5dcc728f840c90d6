#!/usr/bin/env bash
# Whether MLX's CUDA graphs help or cost mlxd's decode: the engine core against mlx-lm at 1, 8,
# 32 and 64 greedy rows, and 32 streams over LoRA adapters, each with MLX_USE_CUDA_GRAPHS=1
# (MLX's default: each command buffer becomes a CUDA graph, updated in place when its shape of
# nodes repeats, instantiated anew when not) and =0 (kernels launched one by one); then one
# decode run's graphs written out (MLX_SAVE_CUDA_GRAPHS_DOT_FILE) and their node kinds counted.
# A graph with a copy node, or a kernel launched in a cluster of more than one block in y or z
# (some cuBLAS kernels on Hopper), cannot be updated and is instantiated on every commit.
#
#   scripts/bench/cuda_graphs_ab.sh <out dir>
#
# Run on the device machine like scripts/bench/h200.sh (after `source .gpu/b/on-device.sh`, the
# release binaries in $MLXD_BIN_DIR, BENCH_BIN pointing at bench_generate, $MODELS with
# llama-1b-bf16).
set -uo pipefail
out=$1
mkdir -p "$out/graphs"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
scripts/bench/switch_ab.sh "$out" MLX_USE_CUDA_GRAPHS 1 0
MLX_SAVE_CUDA_GRAPHS_DOT_FILE="$out/graphs/decode8" timeout 120 "$BENCH_BIN" \
  "$MODELS/llama-1b-bf16" 128 8 1 8 0 > /dev/null
python3 - "$out/graphs" <<'PY'
import collections, pathlib, re, sys
kinds = collections.Counter()
files = sorted(pathlib.Path(sys.argv[1]).glob("*.dot"))
for f in files:
    text = f.read_text(errors="replace")
    for kind in ("MEMCPY", "MEMSET", "KERNEL", "GRAPH", "EVENT", "HOST"):
        kinds[kind] += len(re.findall(kind, text, flags=re.IGNORECASE))
    kinds["cluster"] += len(re.findall(r"clusterDim|cluster", text))
print({"graphs": len(files), **kinds})
PY
