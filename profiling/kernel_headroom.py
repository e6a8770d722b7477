"""moe_ffn's CPU kernel for small blocks against torch's kernels, product by product.

    .venv/bin/python profiling/kernel_headroom.py            # the table below, ~2 minutes
    .venv/bin/python profiling/kernel_headroom.py --rounds 3 --rows 8,32

What it measures: the two products moe_ffn/_small_gemm.cpp computes — an expert's forward
x·Wᵀ and input gradient g·W — on the benchmark's expert weights (profiling/bench.py's
shapes), for blocks of 1–128 rows, by the kernel and by the torch kernel grouped.py would
pick without it (`grouped._linear` with the kernel switched off). Each cell runs the product
for E experts' weights in turn (64 fine-grained, 8 Mixtral: more bytes than the caches hold,
as in the layer); the two sides alternate round by round, after a warm-up round, and the
median of the rounds is reported in GFLOP/s. Inside the layer the kernel is used only where
this table (and the A/B runs quoted in moe_ffn/_small_gemm.py) showed it ahead: forward up to
`_small_gemm.MAX_ROWS` rows, input gradients for `_small_gemm.INPUT_GRAD_ROWS`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_ffn import _small_gemm, grouped  # noqa: E402

# (name, weight [O, I], experts cycled): the benchmark's expert weights.
SHAPES = (
    ("fine gate_up", (1024, 1024), 64),
    ("fine down", (1024, 512), 64),
    ("mixtral gate_up", (7168, 1024), 8),
    ("mixtral down", (1024, 3584), 8),
)


def _torch_linear(x, w):
    library = _small_gemm.library
    _small_gemm.library = lambda: None  # grouped._linear's choice among torch's kernels
    try:
        return grouped._linear(x, w)
    finally:
        _small_gemm.library = library


def _ran(result):
    if result is None or result is False:
        raise RuntimeError("the kernel declined a product it was asked to time")
    return result


def measure(rows_list, rounds: int) -> list[dict]:
    if _small_gemm.library() is None or _small_gemm.torch_openmp() is None:
        raise SystemExit("moe_ffn's kernel is not built or cannot run here (see moe_ffn/_small_gemm.py)")
    # The kernel side runs every row count asked for, past the ranges the layer uses it for.
    _small_gemm.MAX_ROWS, _small_gemm.INPUT_GRAD_ROWS = max(rows_list), (1, max(rows_list))
    results = []
    for name, (O, I), experts in SHAPES:
        w_EOI = torch.randn(experts, O, I) / I**0.5
        for rows in rows_list:
            x_ERI, g_ERO, y_RO = torch.randn(experts, rows, I), torch.randn(experts, rows, O), torch.empty(rows, O)
            sides = {
                ("forward", "torch"): lambda: [y_RO.copy_(_torch_linear(x_ERI[e], w_EOI[e])) for e in range(experts)],
                ("forward", "kernel"): lambda: [_ran(_small_gemm.linear_into(y_RO, x_ERI[e], w_EOI[e], None)) for e in range(experts)],
                ("input grad", "torch"): lambda: [_torch_linear(g_ERO[e], w_EOI[e].t()) for e in range(experts)],
                ("input grad", "kernel"): lambda: [_ran(_small_gemm.input_grad(g_ERO[e], w_EOI[e].t())) for e in range(experts)],
            }
            times = {key: [] for key in sides}
            keys = list(sides)
            for r in range(rounds + 1):  # round 0 warms every side up
                for key in keys[r % len(keys):] + keys[: r % len(keys)]:
                    start = time.perf_counter()
                    sides[key]()
                    if r:
                        times[key].append(time.perf_counter() - start)
            gflop = 2 * experts * rows * O * I / 1e9
            for product in ("forward", "input grad"):
                rate = {side: gflop / statistics.median(times[(product, side)]) for side in ("torch", "kernel")}
                results.append(dict(shape=name, weight=(O, I), rows=rows, product=product, **rate))
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| expert weight | product | rows | torch's kernel GFLOP/s | moe_ffn kernel GFLOP/s | kernel / torch |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        o, i = r["weight"]
        lines.append(
            f"| {r['shape']} {o}×{i} | {r['product']} | {r['rows']} | {r['torch']:.1f} | {r['kernel']:.1f} | "
            f"{r['kernel'] / r['torch']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128", help="rows per expert block, comma-separated")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per cell (median reported)")
    args = parser.parse_args(argv)
    print(table(measure([int(r) for r in args.rows.split(",")], args.rounds)))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds")


if __name__ == "__main__":
    main()
