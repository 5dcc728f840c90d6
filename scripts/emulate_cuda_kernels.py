"""Runs the engine's custom CUDA kernel bodies on the CPU under a small SIMT emulation and compares
them with numpy: the served LoRA update (engine/src/adapters/lora_kernel.rs), decode attention
over a quantized or plain KV cache (engine/src/models/decode_attention.rs, its split and merge kernels) and
the gated delta recurrence (engine/src/models/delta_kernel.rs).

No GPU is needed: a body is compiled with a C++20 compiler (clang++, as `scripts/setup.sh`
installs it, or `$CXX`) inside a function that one std::thread per CUDA
thread runs, one block at a time, with `__syncthreads` a block-wide barrier, `__shfl_xor_sync` an
exchange through a per-warp slot array between two warp-wide barriers, and `__shared__` arrays
shared by the block's threads. Inputs are passed as MLX passes them (a pointer, `<name>_shape`,
`<name>_strides`). Floating types are float (bf16 conversions are not emulated), so this checks
the kernels' indexing, masking and reductions, not their speed or their roundings.

    .venv/bin/python scripts/emulate_cuda_kernels.py

Prints one line per case and exits non-zero if any case differs from numpy by more than float
rounding.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LORA = ROOT / "engine/src/adapters/lora_kernel.rs"
ATTENTION = ROOT / "engine/src/models/decode_attention.rs"
DELTA = ROOT / "engine/src/models/delta_kernel.rs"

HEADER = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
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
static float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
#define __shared__ static
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
"""

C_TYPES = {np.float32: "float", np.uint32: "uint32_t", np.bool_: "bool"}


def kernel_body(path: Path, const: str) -> str:
    match = re.search(rf'const {const}: &str = r#"(.*?)"#;', path.read_text(), re.S)
    if not match:
        sys.exit(f"no kernel {const} in {path}")
    return match.group(1)


def rust_const(path: Path, name: str) -> int:
    match = re.search(rf"const {name}: i32 = (\d+);", path.read_text())
    if not match:
        sys.exit(f"no constant {name} in {path}")
    return int(match.group(1))


def compiler() -> str:
    """`$CXX`, else clang++ (which `scripts/setup.sh` installs), else g++."""
    for candidate in [os.environ.get("CXX"), "clang++", "g++"]:
        if candidate and shutil.which(candidate):
            return candidate
    sys.exit("no C++ compiler: set CXX, or install clang (scripts/setup.sh does)")


class View:
    """An input as MLX hands it to a kernel: a buffer and the shape and strides of a view of it."""

    def __init__(self, buffer: np.ndarray, shape=None, strides=None):
        self.buffer = np.ascontiguousarray(buffer)
        self.shape = list(shape if shape is not None else buffer.shape)
        natural = [int(s // buffer.itemsize) for s in self.buffer.strides]
        self.strides = list(strides if strides is not None else natural)


def emulate(work: Path, body: str, inputs: dict, outputs: dict, consts: dict, grid, block: int) -> dict:
    """Runs `body` over `grid` blocks (x, y, z) of `block` threads; returns the outputs (float32
    arrays of the shapes in `outputs`)."""
    params, reads, args = [], [], []
    for i, (name, view) in enumerate(inputs.items()):
        ctype = C_TYPES[view.buffer.dtype.type]
        params += [f"const {ctype}* {name}", f"const int32_t* {name}_shape", f"const int64_t* {name}_strides"]
        view.buffer.tofile(work / f"in{i}")
        shape = ", ".join(map(str, view.shape))
        strides = ", ".join(map(str, view.strides))
        # A bool array is read as bytes (std::vector<bool> holds no `bool*`).
        storage = "unsigned char" if ctype == "bool" else ctype
        reads.append(
            f'  auto v{i} = read<{storage}>("{work}/in{i}", {view.buffer.size});\n'
            f"  int32_t s{i}[] = {{{shape}}}; int64_t t{i}[] = {{{strides}}};"
        )
        args += [f"(const {ctype}*)v{i}.data()", f"s{i}", f"t{i}"]
    for j, (name, shape) in enumerate(outputs.items()):
        params.append(f"float* {name}")
        reads.append(f"  std::vector<float> o{j}({int(np.prod(shape))}, NAN);")
        args.append(f"o{j}.data()")
    defs = "".join(
        f"using {k} = {v};\n" if isinstance(v, str) else f"constexpr int {k} = {v};\n"
        for k, v in consts.items()
    )
    writes = "".join(
        f'  {{ FILE* f = fopen("{work}/out{j}", "wb"); fwrite(o{j}.data(), 4, o{j}.size(), f); fclose(f); }}\n'
        for j in range(len(outputs))
    )
    source = HEADER + defs + f"""
static void kernel({", ".join(params)}) {{
{body}
}}
template <typename T> static std::vector<T> read(const char* path, size_t n) {{
  std::vector<T> v(n);
  FILE* f = fopen(path, "rb");
  if (!f || fread(v.data(), sizeof(T), n, f) != n) {{ fprintf(stderr, "cannot read %s\\n", path); exit(2); }}
  fclose(f);
  return v;
}}
int main() {{
{chr(10).join(reads)}
  gridDim.x = {grid[0]}; gridDim.y = {grid[1]}; gridDim.z = {grid[2]};
  blockDim.x = {block};
  for (int bz = 0; bz < gridDim.z; ++bz)
  for (int by = 0; by < gridDim.y; ++by)
  for (int bx = 0; bx < gridDim.x; ++bx) {{
    std::barrier<> whole(blockDim.x);
    block_barrier = &whole;
    std::vector<std::barrier<>*> warps;
    for (int w = 0; w < (blockDim.x + 31) / 32; ++w) warps.push_back(new std::barrier<>(min(32, blockDim.x - 32 * w)));
    warp_barriers = warps;
    std::vector<std::thread> threads;
    for (int t = 0; t < blockDim.x; ++t)
      threads.emplace_back([&, t, bx, by, bz] {{
        threadIdx.x = t; blockIdx.x = bx; blockIdx.y = by; blockIdx.z = bz;
        kernel({", ".join(args)});
      }});
    for (auto& th : threads) th.join();
    for (auto* w : warps) delete w;
  }}
{writes}  return 0;
}}
"""
    src, exe = work / "k.cpp", work / "k"
    src.write_text(source)
    subprocess.run([compiler(), "-std=c++20", "-O1", "-pthread", "-w", str(src), "-o", str(exe)], check=True)
    subprocess.run([str(exe)], check=True)
    return {
        name: np.fromfile(work / f"out{j}", dtype=np.float32).reshape(shape)
        for j, (name, shape) in enumerate(outputs.items())
    }


def report(label: str, got: np.ndarray, want: np.ndarray, scale: float) -> bool:
    diff = float(np.abs(got - want).max())
    ok = bool(np.isfinite(got).all()) and diff <= 1e-4 * max(1.0, scale)
    print(f"{label}: max diff {diff:.2e} {'ok' if ok else 'DIFFERS'}")
    return ok


def lora_case(work: Path, b: int, l: int, k: int, c: int, n: int, adapters: int, layers: int) -> bool:
    """The LoRA update `y + ((x @ A) * mask) @ B` for `adapters` of rank `c / layers / adapters`."""
    rng = np.random.default_rng(b * 1000 + c)
    x = rng.standard_normal((b, l, k), dtype=np.float32)
    a = rng.standard_normal((k, c), dtype=np.float32) * np.float32(0.05)
    bb = rng.standard_normal((c, n), dtype=np.float32) * np.float32(0.05)
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
    else:
        mask = np.ones((1, 1, 1), dtype=np.float32)
        want = y + (x @ a) @ bb
    rows = b * l
    block, span, columns, row_tile, expand_rows = (
        rust_const(LORA, n_) for n_ in ("BLOCK", "SHRINK_SPAN", "SHRINK_COLUMNS", "SHRINK_ROWS", "EXPAND_ROWS")
    )
    ceil = lambda p_, q: (p_ + q - 1) // q
    spans = ceil(k, span)
    shrink_grid = (spans, ceil(c, columns), ceil(rows, row_tile))
    partials = emulate(
        work,
        kernel_body(LORA, "SHRINK_SOURCE"),
        {"x": View(x), "a": View(a)},
        {"p": (spans, rows, c)},
        {"XT": "float", "FT": "float", "SPAN": span, "NT": block, "CT": columns, "MR": row_tile},
        shrink_grid,
        block,
    )["p"]
    expand_grid = (ceil(n, block), ceil(rows, expand_rows), 1)
    got = emulate(
        work,
        kernel_body(LORA, "EXPAND_SOURCE"),
        {"p": View(partials), "b": View(bb), "y": View(y), "mask": View(mask),
         "res": View(np.ones((1, 1, 1), dtype=np.float32))},
        {"out": (b, l, n)},
        {"FT": "float", "YT": "float", "MT": "float", "HAS_MASK": has_mask, "WIDE": 0, "EPILOGUE": 0,
         "MAX_C": rust_const(LORA, "MAX_RANK_COLUMNS"), "RB": expand_rows},
        expand_grid,
        block,
    )["out"]
    grid = (shrink_grid, expand_grid[:2])
    label = f"lora: rows {b}x{l} in {k} R {c} out {n} adapters {adapters} layers {layers} grids {grid}"
    return report(label, got, want, float(np.abs(want).max()))


def lora_wide_case(
    work: Path, b: int, l: int, c: int, n: int, adapters: int, layers: int, mask_rows: int, epilogue: int = 0
) -> bool:
    """The expand widened (`WIDE`): `yw` carries `x @ A` as its last `c` columns; the output is its first
    `n` columns plus `(masked x @ A) @ B` (`mask_rows` 1: every row takes the same adapter), then the
    `epilogue`: 0 none, 1 added to a residual, 2 `silu(g) * u` of its halves."""
    rng = np.random.default_rng(b * 7 + c + n)
    z = rng.standard_normal((b, l, c), dtype=np.float32)
    y = rng.standard_normal((b, l, n), dtype=np.float32)
    yw = np.concatenate([y, z], axis=-1)
    bb = rng.standard_normal((c, n), dtype=np.float32) * np.float32(0.05)
    w = c // layers
    rank = w // adapters
    mask = np.zeros((mask_rows, 1, w), dtype=np.float32)
    for row in range(mask_rows):
        slot = (row + 1) % (adapters + 1)  # the last slot: a base row, no columns
        if slot < adapters:
            mask[row, 0, slot * rank:(slot + 1) * rank] = 1.0
    per = (b * l) // mask_rows
    row_mask = np.repeat(mask.reshape(mask_rows, w), per, axis=0).reshape(b, l, 1, w)
    want = y + (z.reshape(b, l, layers, w) * row_mask).reshape(b, l, c) @ bb
    res = rng.standard_normal((b, l, n), dtype=np.float32)
    out_n = n
    if epilogue == 1:
        want = res + want
    elif epilogue == 2:
        out_n = n // 2
        g, u = want[..., :out_n], want[..., out_n:]
        want = g / (1.0 + np.exp(-g)) * u
    rows = b * l
    block, expand_rows = (rust_const(LORA, n_) for n_ in ("BLOCK", "EXPAND_ROWS"))
    ceil = lambda p_, q: (p_ + q - 1) // q
    grid = (ceil(out_n, block), ceil(rows, expand_rows), 1)
    got = emulate(
        work,
        kernel_body(LORA, "EXPAND_SOURCE"),
        {"p": View(np.ones((1, 1, 1), dtype=np.float32)), "b": View(bb), "y": View(yw), "mask": View(mask),
         "res": View(res if epilogue == 1 else np.ones((1, 1, 1), dtype=np.float32))},
        {"out": (b, l, out_n)},
        {"FT": "float", "YT": "float", "MT": "float", "HAS_MASK": 1, "WIDE": 1, "EPILOGUE": epilogue,
         "MAX_C": rust_const(LORA, "MAX_RANK_COLUMNS"), "RB": expand_rows},
        grid,
        block,
    )["out"]
    label = (
        f"lora widened: rows {b}x{l} R {c} out {n} adapters {adapters} layers {layers} mask rows {mask_rows}"
        f" epilogue {['none', 'residual', 'swiglu'][epilogue]}"
    )
    return report(label, got, want, float(np.abs(want).max()))


def attention_case(work: Path, rows: int, heads: int, kv_heads: int, d: int, t: int, bits: int, group: int, spans: int, masked: bool) -> bool:
    """Decode attention of one query per row over `t` positions of a cache (a view of a longer
    buffer, as a cache's), quantized with `bits` (0: plain), split over `spans` spans, then
    merged."""
    rng = np.random.default_rng(rows * 100 + d + bits)
    cap = t + 5
    q = rng.standard_normal((rows, heads, 1, d), dtype=np.float32)
    scale = np.float32(1.0 / np.sqrt(d))
    starts = np.array([(7 * r) % max(1, t // 2) for r in range(rows)])
    mask = (np.arange(t)[None, :] >= starts[:, None]).reshape(rows, 1, 1, t) if masked else np.ones((1, 1, 1, 1), bool)

    def view(buf):
        return View(buf, shape=[rows, kv_heads, t, buf.shape[-1]])

    if bits:
        per_word = 32 // bits
        kw = rng.integers(0, 2**32, size=(rows, kv_heads, cap, d // per_word), dtype=np.uint64).astype(np.uint32)
        vw = rng.integers(0, 2**32, size=(rows, kv_heads, cap, d // per_word), dtype=np.uint64).astype(np.uint32)
        groups = d // group
        ks, kb, vs, vb = (
            (rng.standard_normal((rows, kv_heads, cap, groups), dtype=np.float32) * np.float32(s)).astype(np.float32)
            for s in (0.02, 0.5, 0.02, 0.5)
        )

        def dequantize(words, s, b_):
            w = words[:, :, :t]
            shifts = (np.arange(per_word, dtype=np.uint32) * bits)
            vals = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
            vals = vals.reshape(rows, kv_heads, t, d).astype(np.float32)
            s = np.repeat(s[:, :, :t], group, axis=-1)
            b_ = np.repeat(b_[:, :, :t], group, axis=-1)
            return vals * s + b_

        keys, values = dequantize(kw, ks, kb), dequantize(vw, vs, vb)
        cache = {"kw": view(kw), "ks": view(ks), "kb": view(kb), "vw": view(vw), "vs": view(vs), "vb": view(vb)}
        kind, consts = "PACKED", {"EPL": max(8, 32 // bits), "BITS": bits, "GS": group}
    else:
        kbuf = rng.standard_normal((rows, kv_heads, cap, d), dtype=np.float32)
        vbuf = rng.standard_normal((rows, kv_heads, cap, d), dtype=np.float32)
        keys, values = kbuf[:, :, :t], vbuf[:, :, :t]
        cache = {"k": view(kbuf), "v": view(vbuf)}
        kind, consts = "PLAIN", {"EPL": 8}

    r = heads // kv_heads
    keys, values = np.repeat(keys, r, axis=1), np.repeat(values, r, axis=1)
    scores = (q * scale) @ keys.transpose(0, 1, 3, 2)
    if masked:
        scores = np.where(mask, scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    p = np.exp(scores)
    want = (p / p.sum(-1, keepdims=True)) @ values

    split_block = rust_const(ATTENTION, "SPLIT_BLOCK")
    pieces = ("SPLIT_PROLOGUE", f"{kind}_ROWS", "SPLIT_WALK", f"{kind}_LOAD", "SPLIT_EPILOGUE")
    body = "".join(kernel_body(ATTENTION, piece) for piece in pieces)
    parts = emulate(
        work,
        body,
        {"q": View(q), **cache, "mask": View(mask)},
        {"part_acc": (rows, heads, spans, d), "part_m": (rows, heads, spans), "part_l": (rows, heads, spans)},
        {"D": d, "R": r, **consts, "HAS_MASK": int(masked),
         "SCALE_BITS": int(np.array([scale], dtype=np.float32).view(np.int32)[0])},
        (spans, kv_heads, rows),
        split_block,
    )
    merge_block = rust_const(ATTENTION, "MERGE_BLOCK")
    total = rows * heads * d
    got = emulate(
        work,
        kernel_body(ATTENTION, "MERGE_SOURCE"),
        {"part_acc": View(parts["part_acc"]), "part_m": View(parts["part_m"]), "part_l": View(parts["part_l"])},
        {"out": (rows, heads, 1, d)},
        {"OutT": "float", "D": d},
        ((total + merge_block - 1) // merge_block, 1, 1),
        merge_block,
    )["out"]
    cache_label = f"{bits} bits" if bits else "plain"
    label = f"decode attention: {rows} rows, {heads}/{kv_heads} heads of {d}, {t} positions, {cache_label}, {spans} spans{', masked' if masked else ''}"
    return report(label, got, want.astype(np.float32), float(np.abs(want).max()))


def delta_case(work: Path, b: int, t: int, hk: int, hv: int, dk: int, dv: int) -> bool:
    """The gated delta recurrence over `t` positions from a random state, the second row's
    last positions masked out (the state held, zeros written)."""
    rng = np.random.default_rng(b * 10 + t)
    q = rng.standard_normal((b, t, hk, dk), dtype=np.float32) * np.float32(0.3)
    k = rng.standard_normal((b, t, hk, dk), dtype=np.float32) * np.float32(0.3)
    v = rng.standard_normal((b, t, hv, dv), dtype=np.float32)
    g = rng.uniform(0.5, 1.0, size=(b, t, hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(b, t, hv)).astype(np.float32)
    state = rng.standard_normal((b, hv, dv, dk), dtype=np.float32) * np.float32(0.1)
    mask = np.ones((b, t), dtype=bool)
    if b > 1:
        mask[1, t - 2:] = False
    want_y = np.zeros((b, t, hv, dv), dtype=np.float32)
    want_s = state.copy()
    for bi in range(b):
        for hi in range(hv):
            kh = hi // (hv // hk)
            s_ = want_s[bi, hi]
            for ti in range(t):
                if not mask[bi, ti]:
                    continue
                s_ = s_ * g[bi, ti, hi]
                kv = s_ @ k[bi, ti, kh]
                delta = (v[bi, ti, hi] - kv) * beta[bi, ti, hi]
                s_ = s_ + np.outer(delta, k[bi, ti, kh])
                want_y[bi, ti, hi] = s_ @ q[bi, ti, kh]
            want_s[bi, hi] = s_
    block = rust_const(DELTA, "BLOCK")
    got = emulate(
        work,
        kernel_body(DELTA, "SOURCE"),
        {"q": View(q), "k": View(k), "v": View(v), "g": View(g), "beta": View(beta),
         "state_in": View(state), "mask": View(mask)},
        {"y": (b, t, hv, dv), "state_out": (b, hv, dv, dk)},
        {"InT": "float", "StT": "float", "Dk": dk, "Dv": dv, "Hk": hk, "Hv": hv},
        ((b * hv * dv + block - 1) // block, 1, 1),
        block,
    )
    label = f"gated delta: {b} rows, {t} positions, {hv} value heads over {hk}, Dk {dk}, Dv {dv}"
    scale = float(max(np.abs(want_y).max(), np.abs(want_s).max()))
    return report(label + " (output)", got["y"], want_y, scale) & report(
        label + " (state)", got["state_out"], want_s, scale
    )


def main() -> int:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for case in [
            # rows, positions, in, R, out, adapters, layers: q/k/v of one adapter, rank 8.
            (1, 1, 256, 24, 384, 1, 3),
            (32, 1, 512, 24, 640, 1, 3),
            # Four adapters mixed (and base rows) over three stacked layers; rows not a multiple of 8.
            (13, 1, 256, 96, 384, 4, 3),
            (32, 1, 512, 96, 640, 4, 3),
            # More rows than a shrink tile, an `in` off the span.
            (40, 1, 300, 16, 96, 2, 1),
            # One layer, a prefill-sized pass of a few rows, a rank that is not a multiple of 8.
            (3, 7, 300, 12, 200, 1, 1),
            (4, 2, 128, 20, 130, 2, 1),
        ]:
            results.append(lora_case(work, *case))
        for case in [
            # rows, positions, R, out, adapters, layers, mask rows
            (32, 1, 96, 640, 4, 3, 32),
            (13, 1, 24, 300, 2, 2, 13),
            # Every row one adapter (a mask of one row), a prefill-sized pass.
            (3, 7, 16, 130, 2, 1, 1),
            # The residual add in the kernel (an o or down projection), rows off the row tile.
            (13, 1, 32, 300, 4, 1, 13, 1),
            # SwiGLU of a gate/up pair: 2 x 260 columns, 260 outputs (off the block's 256).
            (13, 1, 64, 520, 4, 2, 13, 2),
            (3, 2, 16, 96, 2, 2, 1, 2),
        ]:
            results.append(lora_wide_case(work, *case))
        for case in [
            # rows, heads, kv heads, head width, positions, bits, group, spans, masked
            (1, 8, 2, 64, 100, 8, 64, 3, False),
            (3, 8, 2, 64, 77, 8, 32, 2, True),
            (2, 4, 2, 128, 50, 4, 64, 4, True),
            (2, 8, 2, 64, 40, 2, 32, 1, True),
            # More spans than a span's positions fill: empty spans merge as nothing.
            (1, 4, 1, 32, 9, 8, 32, 4, False),
            # Plain caches (bits 0): 8 lanes a position at width 64, 16 at 128, 4 at 32.
            (3, 8, 2, 64, 130, 0, 0, 3, True),
            (1, 8, 2, 64, 100, 0, 0, 2, False),
            (2, 4, 2, 128, 50, 0, 0, 4, True),
            (1, 4, 1, 32, 9, 0, 0, 4, False),
        ]:
            results.append(attention_case(work, *case))
        for case in [
            # rows, positions, key heads, value heads, key width, value width
            (1, 5, 1, 2, 16, 8),
            (2, 7, 2, 4, 32, 24),
        ]:
            results.append(delta_case(work, *case))
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
