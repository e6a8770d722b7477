"""moe_ffn's CPU kernel for small blocks against torch's kernels, product by product.

    .venv/bin/python profiling/kernel_headroom.py            # the table below, ~2 minutes
    .venv/bin/python profiling/kernel_headroom.py --rounds 3 --rows 8,32

What it measures: the products moe_ffn/_small_gemm.cpp computes — an expert's forward
x·Wᵀ, input gradient g·W and weight gradient gᵀ·x (written over an old one) in float32, and
with `--dtype bf16` the forward of bf16 weights — on the benchmark's expert weights
(profiling/bench.py's shapes), for blocks of 1–128 rows, by the kernel and by the torch kernel
grouped.py would pick without it (`grouped._linear` or `grouped._matmul_into` with the kernel
switched off). Each cell runs the product for E experts' weights in turn (64 fine-grained, 8
Mixtral: more bytes than the EPYC's caches held, as in the layer; a CPU with a 480 MiB L3, as
the Xeon this project moved to, keeps them all, so there the table reads cache, not memory);
the two sides alternate round by round, after a warm-up round, and the median of the rounds
is reported in GFLOP/s. Inside the layer the kernel is used only where this table (and the
A/B runs quoted in moe_ffn/_small_gemm.py) showed it ahead on a CPU like this one:
`_small_gemm.ranges()`, which differs between AVX2 and AVX-512 CPUs.
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


def _torch_side(fn, *args, **kwargs):
    """grouped.py's choice among torch's kernels: the same call with the kernel switched off."""
    library = _small_gemm.library
    _small_gemm.library = lambda: None
    try:
        return fn(*args, **kwargs)
    finally:
        _small_gemm.library = library


def _ran(result):
    if result is None or result is False:
        raise RuntimeError("the kernel declined a product it was asked to time")
    return result


def _sides(dtype, experts, w_EOI, x_ERI, g_ERO, y_RO, wgrad_EOI):
    """{(product, side): one call over every expert}. float32: forward, input gradient and the
    weight gradient written over an old one (grouped._matmul_into with overwrite); bf16: the
    forward, torch's side the native bf16 GEMM (what runs on CPUs with bf16 units)."""
    if dtype == torch.bfloat16:
        return {
            ("forward", "torch"): lambda: [torch.mm(x_ERI[e], w_EOI[e].t(), out=y_RO) for e in range(experts)],
            ("forward", "kernel"): lambda: [_ran(_small_gemm.linear_into(y_RO, x_ERI[e], w_EOI[e], None)) for e in range(experts)],
        }
    return {
        ("forward", "torch"): lambda: [y_RO.copy_(_torch_side(grouped._linear, x_ERI[e], w_EOI[e])) for e in range(experts)],
        ("forward", "kernel"): lambda: [_ran(_small_gemm.linear_into(y_RO, x_ERI[e], w_EOI[e], None)) for e in range(experts)],
        ("input grad", "torch"): lambda: [_torch_side(grouped._linear, g_ERO[e], w_EOI[e].t()) for e in range(experts)],
        ("input grad", "kernel"): lambda: [_ran(_small_gemm.input_grad(g_ERO[e], w_EOI[e].t())) for e in range(experts)],
        ("weight grad", "torch"): lambda: [
            _torch_side(grouped._matmul_into, wgrad_EOI[e], g_ERO[e].t(), x_ERI[e], overwrite=True) for e in range(experts)
        ],
        ("weight grad", "kernel"): lambda: [
            _ran(_small_gemm.weight_grad_into(wgrad_EOI[e], g_ERO[e].t(), x_ERI[e])) for e in range(experts)
        ],
    }


def measure(rows_list, rounds: int, dtype: torch.dtype = torch.float32) -> list[dict]:
    if _small_gemm.library() is None or _small_gemm.torch_openmp() is None:
        raise SystemExit("moe_ffn's kernel is not built or cannot run here (see moe_ffn/_small_gemm.py)")
    # The kernel side runs every row count asked for, past the ranges the layer uses it for.
    most = max(rows_list)
    _small_gemm.MAX_ROWS, _small_gemm.INPUT_GRAD_ROWS = most, (1, most)
    _small_gemm.PACKED_MAX_ROWS = _small_gemm.WEIGHT_GRAD_MAX_ROWS = max(most, _small_gemm.PACKED_MAX_ROWS)
    everything = _small_gemm.Ranges(forward=most, input_grad=most, weight_grad=most, bf16=most)
    _small_gemm.ranges = lambda: everything
    results = []
    for name, (O, I), experts in SHAPES:
        w_EOI = (torch.randn(experts, O, I) / I**0.5).to(dtype)
        wgrad_EOI = torch.randn(experts, O, I) if dtype == torch.float32 else None
        for rows in rows_list:
            x_ERI, g_ERO = torch.randn(experts, rows, I, dtype=dtype), torch.randn(experts, rows, O, dtype=dtype)
            sides = _sides(dtype, experts, w_EOI, x_ERI, g_ERO, torch.empty(rows, O, dtype=dtype), wgrad_EOI)
            times = {key: [] for key in sides}
            keys = list(sides)
            for r in range(rounds + 1):  # round 0 warms every side up
                for key in keys[r % len(keys):] + keys[: r % len(keys)]:
                    start = time.perf_counter()
                    sides[key]()
                    if r:
                        times[key].append(time.perf_counter() - start)
            gflop = 2 * experts * rows * O * I / 1e9
            for product in dict.fromkeys(p for p, _ in sides):
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
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: the forward only, against torch's native bf16 GEMM")
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print(table(measure([int(r) for r in args.rows.split(",")], args.rounds, dtype)))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__} "
          f"(CPU capability {torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads, "
          f"{args.dtype}, {args.rounds} rounds")


if __name__ == "__main__":
    main()
