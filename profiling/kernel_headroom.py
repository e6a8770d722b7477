"""Headroom probe: how fast could an expert's small product run with a kernel of our own?

    .venv/bin/python profiling/kernel_headroom.py            # the table below, ~2 minutes
    .venv/bin/python profiling/kernel_headroom.py --rounds 3 --rows 8,32

Why: on CPU, moe_ffn runs each expert's block through the fastest product torch offers for
its size (grouped.py's `_linear`: oneDNN's inner product, MKL's sgemm, or W·xᵀ). With 8–64
rows per expert (T = 256 in the fine-grained benchmark shape) those run at 40–65 GFLOP/s
against a square-matmul probe of 94–144, and the fast-path issue's T = 256 targets stay out
of reach. This script measures whether that gap is the hardware's or the kernels': it
compiles one hand-written AVX2/FMA kernel for the forward product y = x·Wᵀ (not part of the
library) and times it against `_linear` on the benchmark's expert shapes.

The kernel: dot products along the contiguous K dim of x and W, a register tile of 4 rows of
x by 3 rows of W (12 accumulators), W's rows split between the cores with at::parallel_for;
no packing, so each W row is streamed from memory once per block and reused from L1 by all
row tiles. Numerics: fp32 sums in a different order than the library's kernels (compared to
a float64 product with fp32 tolerance before timing).

Timing: for each (weight shape, rows), E blocks of distinct experts' weights in turn (more
bytes than the caches hold, as a layer's experts are), the two implementations alternate
round by round and the median of the rounds is reported in GFLOP/s of the product.

Needs a C++ compiler (torch.utils.cpp_extension builds the kernel; ~1 minute the first time,
cached in torch's extension directory afterwards) and a CPU with AVX2 and FMA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_ffn import grouped  # noqa: E402

KERNEL_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

static inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[i, j] = sum_k x[i, k] * w[j, k] for ROWS rows of x and COLS rows of w (K % 8 == 0).
template <int ROWS, int COLS>
static void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t K) {
  __m256 acc[ROWS][COLS];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 w_k[COLS];
    for (int j = 0; j < COLS; ++j) w_k[j] = _mm256_loadu_ps(w + j * ldw + k);
    for (int i = 0; i < ROWS; ++i) {
      __m256 x_k = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_fmadd_ps(x_k, w_k[j], acc[i][j]);
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) y[i * ldy + j] = horizontal_sum(acc[i][j]);
}

template <int COLS>
static void column_strip(const float* x, int64_t M, int64_t ldx, const float* w, int64_t ldw,
                         float* y, int64_t ldy, int64_t K) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) tile<4, COLS>(x + i * ldx, ldx, w, ldw, y + i * ldy, ldy, K);
  const float* xi = x + i * ldx;
  float* yi = y + i * ldy;
  switch (M - i) {
    case 3: tile<3, COLS>(xi, ldx, w, ldw, yi, ldy, K); break;
    case 2: tile<2, COLS>(xi, ldx, w, ldw, yi, ldy, K); break;
    case 1: tile<1, COLS>(xi, ldx, w, ldw, yi, ldy, K); break;
  }
}

// y_MN = x_MK . w_NKᵀ, all float32 with a contiguous last dim.
void linear_into(torch::Tensor y, torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1 && y.stride(1) == 1, "contiguous last dim expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 8 == 0 && w.size(1) == K && y.size(0) == M && y.size(1) == N, "shapes");
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldw = w.stride(0), ldy = y.stride(0);
  at::parallel_for(0, (N + 2) / 3, 8, [&](int64_t first, int64_t last) {
    for (int64_t strip = first; strip < last; ++strip) {
      const int64_t j = strip * 3, cols = std::min<int64_t>(3, N - j);
      if (cols == 3) column_strip<3>(xp, M, ldx, wp + j * ldw, ldw, yp + j, ldy, K);
      else if (cols == 2) column_strip<2>(xp, M, ldx, wp + j * ldw, ldw, yp + j, ldy, K);
      else column_strip<1>(xp, M, ldx, wp + j * ldw, ldw, yp + j, ldy, K);
    }
  });
}
"""

# (name, weight [O, I], experts cycled): the benchmark's expert weights (profiling/bench.py).
SHAPES = (
    ("fine gate_up", (1024, 1024), 64),
    ("fine down", (1024, 512), 64),
    ("mixtral gate_up", (7168, 1024), 8),
    ("mixtral down", (1024, 3584), 8),
)


def build():
    """The compiled kernel module; raises RuntimeError where it cannot be built or run here."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise RuntimeError(f"the kernel needs AVX2 and FMA; torch reports CPU capability {capability!r}")
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        "moe_ffn_kernel_headroom",
        cpp_sources=KERNEL_SOURCE,
        functions=["linear_into"],
        extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],  # -fopenmp: at::parallel_for's threads
        extra_ldflags=["-fopenmp"],
    )


def check(kernel, rows: int, out_features: int, in_features: int, seed: int = 0) -> float:
    """Largest |kernel − float64 product| over one block, relative to the product's scale."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    y = torch.empty(rows, out_features)
    kernel.linear_into(y, x, w)
    ref = x.double() @ w.double().t()
    return float((y.double() - ref).abs().max() / ref.abs().max())


def measure(kernel, rows_list, rounds: int) -> list[dict]:
    results = []
    for name, (out_features, in_features), experts in SHAPES:
        w_EOI = torch.randn(experts, out_features, in_features) / in_features**0.5
        for rows in rows_list:
            error = check(kernel, rows, out_features, in_features)
            if error > 1e-5:
                raise AssertionError(f"{name}, {rows} rows: kernel off the float64 product by {error:.2e}")
            x_ERI = torch.randn(experts, rows, in_features)
            y_RO = torch.empty(rows, out_features)

            def ours():
                for e in range(experts):
                    kernel.linear_into(y_RO, x_ERI[e], w_EOI[e])

            def library():
                for e in range(experts):
                    y_RO.copy_(grouped._linear(x_ERI[e], w_EOI[e]))

            times = {"library": [], "kernel": []}
            for r in range(rounds + 1):  # round 0 warms both up
                order = (("library", library), ("kernel", ours))
                for label, fn in order if r % 2 else order[::-1]:
                    start = time.perf_counter()
                    fn()
                    if r:
                        times[label].append(time.perf_counter() - start)
            gflop = 2 * experts * rows * out_features * in_features / 1e9
            rate = {label: gflop / statistics.median(t) for label, t in times.items()}
            results.append(dict(shape=name, weight=(out_features, in_features), rows=rows, **rate))
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| expert weight | rows | moe_ffn `_linear` GFLOP/s | hand-written kernel GFLOP/s | kernel / library |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        o, i = r["weight"]
        lines.append(
            f"| {r['shape']} {o}×{i} | {r['rows']} | {r['library']:.1f} | {r['kernel']:.1f} | {r['kernel'] / r['library']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128", help="rows per expert block, comma-separated")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per cell (median reported)")
    args = parser.parse_args(argv)
    kernel = build()
    rows_list = [int(r) for r in args.rows.split(",")]
    print(table(measure(kernel, rows_list, args.rounds)))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds")


if __name__ == "__main__":
    main()
