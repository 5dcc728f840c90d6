"""Runs the served LoRA update's CUDA kernel body (engine/src/adapters/lora_kernel.rs) on the CPU
under a small SIMT emulation, and compares it with numpy's `y + ((x @ A) * mask) @ B`.

No GPU is needed: the body is compiled with g++ inside a function that one std::thread per CUDA
thread runs, one block at a time, with `__syncthreads` a block-wide barrier, `__shfl_xor_sync` an
exchange through a per-warp slot array between two warp-wide barriers, and `__shared__` arrays
shared by the block's threads. Every type is float (the dtype conversions are not emulated), so
this checks the kernel's indexing, masking and reductions, not its speed or its roundings.

    .venv/bin/python scripts/emulate_lora_kernel.py

Prints one line per case and exits non-zero if any case differs from numpy by more than float
rounding.
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "engine/src/adapters/lora_kernel.rs"

HEADER = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#include <algorithm>
using std::min;
using std::max;
struct Dim { int x = 1, y = 1, z = 1; };
static thread_local Dim threadIdx, blockIdx;
static Dim blockDim, gridDim;
static std::barrier<>* block_barrier;
static std::vector<std::barrier<>*> warp_barriers;
static float warp_slots[32][32];
static void __syncthreads() { block_barrier->arrive_and_wait(); }
static float __shfl_xor_sync(unsigned, float v, int offset) {
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  warp_slots[warp][lane] = v;
  warp_barriers[warp]->arrive_and_wait();
  float other = warp_slots[warp][lane ^ offset];
  warp_barriers[warp]->arrive_and_wait();
  return other;
}
#define __shared__ static
"""


def kernel_body() -> str:
    text = SOURCE.read_text()
    match = re.search(r'const SOURCE: &str = r#"(.*?)"#;', text, re.S)
    if not match:
        sys.exit(f"no kernel SOURCE in {SOURCE}")
    return match.group(1)


def program(has_mask: int, max_c: int) -> str:
    inputs = ["x", "a", "b", "y", "mask"]
    params = ", ".join(
        f"const float* {n}, const int32_t* {n}_shape" for n in inputs
    ) + ", float* out"
    body = kernel_body()
    return HEADER + f"""
using XT = float; using FT = float; using YT = float; using MT = float;
constexpr int HAS_MASK = {has_mask};
constexpr int MAX_C = {max_c};
static void kernel({params}) {{
{body}
}}
static std::vector<float> read(const char* path, size_t n) {{
  std::vector<float> v(n);
  FILE* f = fopen(path, "rb");
  if (!f || fread(v.data(), sizeof(float), n, f) != n) {{ fprintf(stderr, "cannot read %s\\n", path); exit(2); }}
  fclose(f);
  return v;
}}
int main(int argc, char** argv) {{
  // argv: dir B L K C N Bm W grid_x grid_y
  const char* dir = argv[1];
  int B = atoi(argv[2]), L = atoi(argv[3]), K = atoi(argv[4]), C = atoi(argv[5]), N = atoi(argv[6]);
  int Bm = atoi(argv[7]), W = atoi(argv[8]);
  gridDim.x = atoi(argv[9]); gridDim.y = atoi(argv[10]);
  blockDim.x = 128;
  std::string d(dir);
  auto x = read((d + "/x").c_str(), (size_t)B * L * K);
  auto a = read((d + "/a").c_str(), (size_t)K * C);
  auto b = read((d + "/b").c_str(), (size_t)C * N);
  auto y = read((d + "/y").c_str(), (size_t)B * L * N);
  auto mask = read((d + "/mask").c_str(), (size_t)Bm * W);
  std::vector<float> out((size_t)B * L * N, NAN);
  int32_t xs[3] = {{B, L, K}}, as[2] = {{K, C}}, bs[2] = {{C, N}}, ys[3] = {{B, L, N}}, ms[3] = {{Bm, 1, W}};
  for (int by = 0; by < gridDim.y; ++by) {{
    for (int bx = 0; bx < gridDim.x; ++bx) {{
      std::barrier<> block(blockDim.x);
      block_barrier = &block;
      std::vector<std::barrier<>*> warps;
      for (int w = 0; w < blockDim.x / 32; ++w) warps.push_back(new std::barrier<>(32));
      warp_barriers = warps;
      std::vector<std::thread> threads;
      for (int t = 0; t < blockDim.x; ++t) {{
        threads.emplace_back([&, t, bx, by] {{
          threadIdx.x = t; blockIdx.x = bx; blockIdx.y = by;
          kernel(x.data(), xs, a.data(), as, b.data(), bs, y.data(), ys, mask.data(), ms, out.data());
        }});
      }}
      for (auto& th : threads) th.join();
      for (auto* w : warps) delete w;
    }}
  }}
  FILE* f = fopen((d + "/out").c_str(), "wb");
  fwrite(out.data(), sizeof(float), out.size(), f);
  fclose(f);
  return 0;
}}
"""


def rust_const(name: str) -> int:
    match = re.search(rf"const {name}: i32 = (\d+);", SOURCE.read_text())
    if not match:
        sys.exit(f"no constant {name} in {SOURCE}")
    return int(match.group(1))


def column_blocks(rows: int, columns: int) -> int:
    """The launch's column blocks, as `lora_kernel::column_blocks` computes them."""
    block, row_block, target = rust_const("BLOCK"), rust_const("ROWS"), rust_const("TARGET_BLOCKS")
    ceil = lambda a, b: (a + b - 1) // b
    return max(1, min(ceil(target, max(1, ceil(rows, row_block))), max(1, ceil(columns, block))))


def run_case(binaries: dict, work: Path, b: int, l: int, k: int, c: int, n: int, adapters: int, layers: int) -> bool:
    rng = np.random.default_rng(b * 1000 + c)
    x = rng.standard_normal((b, l, k), dtype=np.float32)
    a = (rng.standard_normal((k, c), dtype=np.float32) * 0.05).astype(np.float32)
    bb = (rng.standard_normal((c, n), dtype=np.float32) * 0.05).astype(np.float32)
    y = rng.standard_normal((b, l, n), dtype=np.float32)
    has_mask = int(adapters > 1)
    if has_mask:
        w = c // layers
        rank = w // adapters
        mask = np.zeros((b, 1, w), dtype=np.float32)
        for row in range(b):
            slot = row % (adapters + 1)  # the last slot: a base row, no columns
            if slot < adapters:
                mask[row, 0, slot * rank:(slot + 1) * rank] = 1.0
        h = (x @ a).reshape(b, l, layers, w) * mask.reshape(b, 1, 1, w)
        want = y + h.reshape(b, l, c) @ bb
        bm = b
    else:
        w, bm = 1, 1
        mask = np.ones((1, 1, 1), dtype=np.float32)
        want = y + (x @ a) @ bb
    for name, value in [("x", x), ("a", a), ("b", bb), ("y", y), ("mask", mask)]:
        value.astype(np.float32).tofile(work / name)
    rows = b * l
    grid = (column_blocks(rows, n), (rows + rust_const("ROWS") - 1) // rust_const("ROWS"))
    subprocess.run(
        [str(binaries[has_mask]), str(work), str(b), str(l), str(k), str(c), str(n), str(bm), str(w), str(grid[0]), str(grid[1])],
        check=True,
    )
    got = np.fromfile(work / "out", dtype=np.float32).reshape(b, l, n)
    diff = float(np.abs(got - want).max())
    update = float(np.abs(want - y).mean())
    ok = diff <= 1e-4 * max(1.0, float(np.abs(want).max()))
    print(f"rows {b}x{l} in {k} R {c} out {n} adapters {adapters} layers {layers} grid {grid}: max diff {diff:.2e} (mean update {update:.3f}) {'ok' if ok else 'DIFFERS'}")
    return ok


def main() -> int:
    max_c = rust_const("MAX_RANK_COLUMNS")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        binaries = {}
        for has_mask in (0, 1):
            src = work / f"k{has_mask}.cpp"
            src.write_text(program(has_mask, max_c))
            exe = work / f"k{has_mask}"
            subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-w", str(src), "-o", str(exe)], check=True)
            binaries[has_mask] = exe
        cases = [
            # rows, positions, in, R, out, adapters, layers: q/k/v of one adapter, rank 8.
            (1, 1, 256, 24, 384, 1, 3),
            (5, 1, 256, 24, 384, 1, 3),
            (32, 1, 512, 24, 640, 1, 3),
            # Four adapters mixed (and base rows) over three stacked layers; rows not a multiple of 8.
            (13, 1, 256, 96, 384, 4, 3),
            (32, 1, 512, 96, 640, 4, 3),
            # One layer, a prefill-sized pass of a few rows, a rank that is not a multiple of 8.
            (3, 7, 300, 12, 200, 1, 1),
            (4, 2, 128, 20, 130, 2, 1),
        ]
        results = [run_case(binaries, work, *case) for case in cases]
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
