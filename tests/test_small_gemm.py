"""moe_ffn's CPU kernel for small float32 blocks (moe_ffn/_small_gemm.{cpp,py}) against
float64 products, and the layer with and without it against the float64 per-token loop."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_ffn import MoE, _amx, _small_gemm, grouped
from reference import BF16_TIE_ROWS, BF16_TIE_T, moe_forward, routed_rows

# The layers here run on their ops, whose calls these tests pin: a decode step's one call
# (moe_ffn/_decode.py, tested in test_decode.py) is switched off.
pytestmark = pytest.mark.usefixtures("layer_ops")

U = 2.0**-24  # float32 unit roundoff

on_x86_linux_with_avx2 = (
    sys.platform.startswith("linux")
    and platform.machine() in ("x86_64", "AMD64")
    and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
)


# Everything the kernel computes, on any CPU: the layer hands it less where torch's kernels are
# faster (_small_gemm.ranges(): AVX-512 CPUs, bf16 units), but what it computes is tested whole.
EVERY_RANGE = _small_gemm.Ranges(
    forward=_small_gemm.PACKED_MAX_ROWS, input_grad=_small_gemm.PACKED_MAX_ROWS,
    weight_grad=_small_gemm.WEIGHT_GRAD_MAX_ROWS, bf16=_small_gemm.BF16_MAX_ROWS,
)


@pytest.fixture(autouse=True)
def _every_range(request, monkeypatch):
    if "machine_ranges" not in request.keywords:
        monkeypatch.setattr(_small_gemm, "ranges", lambda: EVERY_RANGE)


@pytest.mark.machine_ranges
@pytest.mark.parametrize(
    "capability, bf16_units, expected",
    [
        ("AVX2", False, _small_gemm.Ranges(forward=1024, input_grad=1024, weight_grad=1024, bf16=512)),
        ("AVX512", False, _small_gemm.Ranges(forward=8, input_grad=8, weight_grad=0, bf16=512)),
        ("AVX512", True, _small_gemm.Ranges(forward=8, input_grad=8, weight_grad=0, bf16=2)),
        ("AVX2", True, _small_gemm.Ranges(forward=1024, input_grad=1024, weight_grad=1024, bf16=2)),
    ],
)
def test_ranges_follow_the_cpu(monkeypatch, capability, bf16_units, expected):
    """The rows the layer hands the kernel: all it was measured ahead in where torch's kernels
    are AVX2 too; up to 8 forward and input-gradient rows and no weight gradients where they
    use AVX-512; bf16 operands in blocks of 1–2 rows only where the CPU multiplies bf16 itself."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(_small_gemm, "cpu_has_bf16_units", lambda: bf16_units)
    _small_gemm.ranges.cache_clear()
    try:
        assert _small_gemm.ranges() == expected
    finally:
        _small_gemm.ranges.cache_clear()


@pytest.mark.machine_ranges
def test_the_entry_points_keep_to_this_machines_ranges():
    """Past ranges() the entry points decline and leave `out` alone (torch's kernels run)."""
    _needs_kernel()
    limits = _small_gemm.ranges()
    w = torch.randn(40, 24)
    rows = limits.forward + 1
    out = torch.full((rows, 40), 7.0)
    assert not _small_gemm.linear_into(out, torch.randn(rows, 24), w, None)
    assert bool((out == 7.0).all())
    assert _small_gemm.input_grad(torch.randn(limits.input_grad + 1, 40), w) is None
    grad = torch.full((40, 24), 7.0)
    assert not _small_gemm.weight_grad_into(grad, torch.randn(limits.weight_grad + 1, 40).t(), torch.randn(limits.weight_grad + 1, 24))
    assert bool((grad == 7.0).all())
    if limits.bf16 < min(limits.forward, limits.input_grad):
        rows, w16 = limits.bf16 + 1, w.bfloat16()
        out16 = torch.zeros(rows, 40, dtype=torch.bfloat16)
        assert not _small_gemm.linear_into(out16, torch.randn(rows, 24, dtype=torch.bfloat16), w16, None)
        assert _small_gemm.input_grad(torch.randn(rows, 40), w16) is None
        assert bool((out16 == 0).all())


def _needs_kernel():
    if _small_gemm.library() is None or _small_gemm.torch_openmp() is None:
        pytest.skip("the kernel is not built or cannot run here (test_kernel_is_built_here says why where it must)")


@pytest.mark.skipif(not on_x86_linux_with_avx2, reason="the kernel is built for x86-64 Linux with AVX2 only")
@pytest.mark.skipif(os.environ.get("MOE_FFN_SMALL_GEMM") == "0", reason="switched off by MOE_FFN_SMALL_GEMM=0")
def test_kernel_is_built_here():
    """Where the kernel is meant to run, it is built and finds torch's OpenMP team: a failed
    optional build must not pass unnoticed as "torch's kernels everywhere"."""
    assert _small_gemm.library() is not None, "moe_ffn/_small_gemm_lib*.so missing: the optional extension did not build"
    assert _small_gemm.torch_openmp() is not None, "torch's libgomp not found"


def _bound(a_abs: torch.Tensor, b_abs: torch.Tensor, n: int) -> torch.Tensor:
    # |fl(Σ a·b) − Σ a·b| ≤ γ_n Σ|a||b| with γ_n ≈ n·u: the worst case of any summation order.
    return (n + 2) * U * (a_abs @ b_abs) + 1e-30


def _strided(rows: int, cols: int) -> torch.Tensor:
    """A [rows, cols] view with a row stride larger than cols (a slice of a wider tensor)."""
    return torch.randn(rows + 2, cols + 5)[1 : rows + 1, 2 : cols + 2]


@pytest.mark.parametrize("rows", [65, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_column_split_matches_float64(rows, bias):
    """Products whose B packs into more than 2^20 floats (Mixtral's shapes) run in the packed
    product's column split: sums in passes of 256 steps, blocks of rows past 192. The layer
    sends it bf16 weights' products, input gradients of up to COLUMN_SPLIT_INPUT_GRAD_ROWS
    rows and wide ones (packed_max_rows); here both layouts of B, within the float64 bound,
    out's margins untouched."""
    _needs_kernel()
    kernel = _small_gemm._kernel()
    O, I = 1100, 1000  # B: 1000·1104 floats forward, 1100·1008 for the input gradient
    x, w, g = _strided(rows, I), _strided(O, I), _strided(rows, O)
    b = torch.randn(O) if bias else None
    wide = torch.full((rows, O + 4), float("nan"))
    assert _small_gemm._product(kernel, wide[:, 2 : O + 2], x, False, w, False, b)  # x·wᵀ
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    bound = _bound(x.double().abs(), w.double().abs().T, I + 1)
    assert ((wide[:, 2 : O + 2].double() - ref).abs() <= bound).all()
    assert wide[:, :2].isnan().all() and wide[:, O + 2 :].isnan().all()
    y = torch.full((rows, I), float("nan"))
    assert _small_gemm._product(kernel, y, g, False, w, True)  # g·w
    assert ((y.double() - g.double() @ w.double()).abs() <= _bound(g.double().abs(), w.double().abs(), O)).all()


def test_packed_product_takes_only_the_products_it_was_measured_ahead_in(monkeypatch):
    """Past the unpacked kernels' rows (the in-place forward's IN_PLACE_MAX_ROWS for float32
    forward products), float32 products go to the packed product only where B packs whole
    into ROW_SPLIT_PACK_FLOATS floats, or for input gradients of up to
    COLUMN_SPLIT_INPUT_GRAD_ROWS rows or whose result is WIDE_RATIO times wider than their
    depth; elsewhere every entry point declines (out untouched) and torch's kernels run. bf16
    weights keep it (torch would copy the whole weight to float32 first)."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    M, R = _small_gemm.IN_PLACE_MAX_ROWS, _small_gemm.COLUMN_SPLIT_INPUT_GRAD_ROWS
    # hand-worked: 1024·1024 = 2^20 packs whole; 1024·1040 (1025 columns padded to 65 panels)
    # does not; 1024 deep by 2560 wide is 2.5× wider, 2559 is not
    assert _small_gemm.packed_max_rows(1024, 1024, False) == _small_gemm.PACKED_MAX_ROWS
    assert _small_gemm.packed_max_rows(1024, 1025, False) == M
    assert _small_gemm.packed_max_rows(1024, 1025, True) == R
    assert _small_gemm.packed_max_rows(1024, 2560, True) == _small_gemm.PACKED_MAX_ROWS
    assert _small_gemm.packed_max_rows(1024, 2559, True) == R
    assert _small_gemm.packed_max_rows(1024, 2560, False) == M  # (a forward product is never "wide")

    O, I = 1100, 1000  # neither layout packs whole; the input gradient is not wide
    w = torch.randn(O, I)
    out = torch.full((M + 1, O), 7.0)
    assert not _small_gemm.linear_into(out, torch.randn(M + 1, I), w, None)
    assert (out == 7).all()
    assert _small_gemm.linear_into(out[:M], torch.randn(M, I), w, None)  # (w read in place)
    assert _small_gemm.linear_blocks(torch.randn(M + 1, I), w[None], [(0, 0, M + 1)]) is None
    dx = torch.full((R + 1, I), 7.0)
    assert _small_gemm.input_grad(torch.randn(R + 1, O), w.t(), out=dx) is None
    assert not _small_gemm.input_grad_blocks(dx, torch.randn(R + 1, O), w[None], [(0, 0, R + 1)])
    assert (dx == 7).all()
    g = torch.randn(R, O)
    y = _small_gemm.input_grad(g, w.t(), out=dx[:R])
    assert y is not None and ((y.double() - g.double() @ w.double()).abs() <= _bound(g.double().abs(), w.double().abs(), O)).all()
    assert _small_gemm.input_grad(torch.randn(R + 1, O), w.bfloat16().t()) is not None  # bf16 weight: kept

    w_wide = torch.randn(400, 1000)  # g·w: 400 deep, 1000 wide (2.5×)
    g = torch.randn(R + 1, 400)
    y = _small_gemm.input_grad(g, w_wide.t())
    assert y is not None and ((y.double() - g.double() @ w_wide.double()).abs() <= _bound(g.double().abs(), w_wide.double().abs(), 400)).all()
    w_small = torch.randn(300, 200)  # packs whole: the packed product up to PACKED_MAX_ROWS
    x = torch.randn(_small_gemm.PACKED_MAX_ROWS, 200)
    out = torch.empty(_small_gemm.PACKED_MAX_ROWS, 300)
    assert _small_gemm.linear_into(out, x, w_small, None)
    assert ((out.double() - x.double() @ w_small.double().T).abs() <= _bound(x.double().abs(), w_small.double().abs().T, 200)).all()


# 1–15 rows: strips of 3 rows of w (the next strip prefetched from 8 rows where w's rows are
# short, I ≤ 1024); w read in place from 16 rows, and from 12 rows where the rows are long
# (I = 1025, 4100): tiles of 6 rows of w by a 16-row panel of xᵀ, a last panel of up to 8
# rows through the strips over each block of w (20, 65, 72, 97 and 200 take those, 90 a part
# full 16-row panel, 16 and 64 whole panels only; O = 97, 1100 leave a tile part full, I =
# 4100 makes several blocks of w a thread); from 257 rows: the packed product (tiles of 6
# rows, w's rows transposed into 16-column panels 8 by 8; here always in the row split, B
# packed whole: see the next test for the other)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 13, 16, 20, 64, 65, 72, 90, 97, 128, 129, 200, 256, 257, 700])
@pytest.mark.parametrize(
    "shape",
    [(1, 1), (2, 7), (5, 9), (24, 8), (50, 17), (97, 3), (130, 200), (256, 512), (40, 300), (1100, 261), (50, 4100),
     (13, 1025)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64(rows, shape, bias):
    _needs_kernel()
    O, I = shape
    x, w = _strided(rows, I), _strided(O, I)
    b = torch.randn(O) if bias else None
    out_wide = torch.full((rows, O + 4), float("nan"))
    out = out_wide[:, 2 : O + 2]
    assert _small_gemm.linear_into(out, x, w, b)
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    bound = _bound(x.double().abs(), w.double().abs().t(), I + 1)
    if b is not None:  # the bias is one more term of the sum
        bound = bound + (I + 3) * U * b.double().abs()
    assert ((out.double() - ref).abs() <= bound).all()
    assert out_wide[:, :2].isnan().all() and out_wide[:, O + 2 :].isnan().all()  # nothing written outside


# (1–7 rows: w read row after row, 32 weights a step for 1–2 rows of x, 16 for 3–4, 8 for 5–7,
# then 8, then the masked tail: I = 300 and 45 take all three; x of 7 rows by I = 1024 is the
# most read that way (28 KiB), 7 by 1025 and 8 rows go to the strips of 3 rows of w)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 64])
@pytest.mark.parametrize(
    "shape", [(1, 1), (5, 9), (50, 17), (97, 3), (256, 512), (40, 300), (7, 45), (3, 64), (4, 1024), (4, 1025)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_on_bf16_weights_is_the_float32_product_rounded_once(rows, shape, bias):
    """bf16 x, w, b: the weights are read as bf16 and widened exactly, the products summed in
    float32 and rounded to bf16 once: within bf16's unit roundoff of the float64 result, plus the
    float32 sum's own error bound."""
    _needs_kernel()
    O, I = shape
    x, w = _strided(rows, I).bfloat16(), _strided(O, I).bfloat16()
    b = torch.randn(O).bfloat16() if bias else None
    out = torch.full((rows, O), float("nan"), dtype=torch.bfloat16)
    assert _small_gemm.linear_into(out, x, w, b)
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    sum_error = _bound(x.double().abs(), w.double().abs().t(), I + 1) + (0 if b is None else (I + 3) * U * b.double().abs())
    assert ((out.double() - ref).abs() <= 2.0**-8 * (ref.abs() + sum_error) + sum_error).all()  # bf16: u = 2^-8



@pytest.mark.parametrize("rows", [65, 97, 200])
@pytest.mark.parametrize("shape", [(5, 9), (50, 17), (256, 512), (40, 300)])
def test_bf16_linear_past_the_unpacked_rows_is_the_float32_product_rounded_once(rows, shape):
    """bf16 x, w, out past MAX_ROWS: the packed product on x widened and w read as it is, its
    float32 sums rounded once into out: bit for bit the float32 packed product on widened
    copies, rounded by torch; with a bias it declines (torch's path)."""
    _needs_kernel()
    O, I = shape
    x, w = _strided(rows, I).bfloat16(), _strided(O, I).bfloat16()
    wide = torch.full((rows, O + 2), 7.0).bfloat16()
    out = wide[:, 1 : O + 1]
    assert _small_gemm.linear_into(out, x, w, None)
    out32 = torch.empty(rows, O)  # (float32 linear_into runs these rows unpacked: the product itself)
    assert _small_gemm._product(_small_gemm._kernel(), out32, x.float(), False, w.float(), False)
    assert torch.equal(out.view(torch.int16), out32.bfloat16().view(torch.int16))
    assert (wide[:, 0] == 7).all() and (wide[:, O + 1] == 7).all()
    assert not _small_gemm.linear_into(out, x, w, torch.zeros(O).bfloat16())


def test_bf16_results_round_to_nearest_even_as_torch_does():
    """The kernel rounds each float32 sum to bf16 as it writes it: the same bits as torch's
    float32 → bf16 conversion, on sums that are exact in float32 and land on ties (to even, up
    and down), just off them, on infinities and on NaN (x = [1, 2^-8, …] against chosen rows)."""
    _needs_kernel()
    t = BF16_TIE_T
    x = torch.tensor([[1.0, t, t * t]])
    rows_of_w = BF16_TIE_ROWS
    w = torch.tensor(rows_of_w).bfloat16()
    assert (w.float() == torch.tensor(rows_of_w)).all(), "the rows must be exact in bf16"
    out = torch.empty(1, len(rows_of_w), dtype=torch.bfloat16)
    assert _small_gemm.linear_into(out, x.bfloat16(), w, None)
    sums = (x.double() @ w.double().t()).float()  # exact: a few powers of two apart
    expected = sums.bfloat16()
    same = (out.view(torch.int16) == expected.view(torch.int16)) | (out.isnan() & expected.isnan())
    assert same.all(), f"kernel {out.tolist()} against torch {expected.tolist()}"
    assert out[0, :3].tolist() == [1.0, 1.0 + 4 * t, 1.0 + 2 * t]  # the ties, by hand


@pytest.mark.parametrize("rows", [8, 13, 64])
def test_bf16_results_are_the_float32_kernel_on_widened_copies_rounded_by_torch(rows):
    """Bitwise: the bf16 entry forms the same float32 sums as the float32 one on x, w, b widened
    (exactly), and its rounding is torch's. (1–7 rows of x against bf16 weights sum in another
    order, w read row after row: see test_linear_on_bf16_weights_is_the_float32_product_rounded_once.)"""
    _needs_kernel()
    x, w, b = torch.randn(rows, 300).bfloat16(), torch.randn(77, 300).bfloat16(), torch.randn(77).bfloat16()
    out, out32 = torch.empty(rows, 77, dtype=torch.bfloat16), torch.empty(rows, 77)
    assert _small_gemm.linear_into(out, x, w, b)
    assert _small_gemm.linear_into(out32, x.float(), w.float(), b.float())
    assert torch.equal(out.view(torch.int16), out32.bfloat16().view(torch.int16))

def _swamping(rows: int, O: int, I: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 x [rows, I] of ones and w [O, I] whose rows hold four pairs of ±2^25 at random
    places, ones and twos at some others, zeros elsewhere: every exact sum is a small integer,
    and which of the small terms survive in float32 (an addend below half of 2^25's spacing is
    lost) depends on the order each sum is formed in, so the bf16 results show the order
    (randn data hides it: a float32 sum's last bits rarely reach bf16's)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.zeros(O, I)
    for o in range(O):
        places = torch.randperm(I, generator=gen)
        w[o, places[:4]], w[o, places[4:8]] = 2.0**25, -(2.0**25)
        n = min(I - 8, max(8, 60 * I // 1024))
        w[o, places[8 : 8 + n]] = torch.randint(1, 3, (n,), generator=gen).float()
    return torch.ones(rows, I).bfloat16(), w.bfloat16()


def _order_test_operands(data: str, rows: int, O: int, I: int):
    """x [rows, I] (a strided view) and w [O, I], bf16: random normal, or `_swamping`'s."""
    torch.manual_seed(rows * I)
    if data == "randn":
        return _strided(rows, I).bfloat16(), _strided(O, I).bfloat16()
    x, w = _swamping(rows, O, I, rows * I)
    x_wide = torch.zeros(rows, I + 3).bfloat16()
    x_wide[:, 1 : I + 1] = x
    return x_wide[:, 1 : I + 1], w


def _forward_sums_in_order(data: str, rows: int, O: int, I: int, bias: bool, order_sums) -> None:
    """linear_into on bf16 x, w (and b) from `_order_test_operands`: bit for bit order_sums's
    float32 sums rounded to bf16 once by torch."""
    x, w = _order_test_operands(data, rows, O, I)
    b = torch.randn(O).bfloat16() if bias else None
    out = torch.full((rows, O), float("nan"), dtype=torch.bfloat16)
    assert _small_gemm.linear_into(out, x, w, b)
    assert torch.equal(out.view(torch.int16), order_sums(x, w, b).bfloat16().view(torch.int16))


def _strip_order_sums(x: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    """float32 sums of x·wᵀ (+ b) in the order the forward's strips of 3 rows of w form them
    (_small_gemm.cpp, linear_tile): each sum in 8 lanes, lane j adding x[k]·w[k] for k = j mod 8
    in k's order (the last, partial vector's lanes past I add 0·0), then the lanes summed as
    ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the bias. For bf16 x and w every
    product is exact in float32, so each step below is the FMA's single rounding."""
    rows, I = x.shape
    pad = -I % 8
    xs = torch.nn.functional.pad(x.float(), (0, pad)).view(rows, -1, 8)
    ws = torch.nn.functional.pad(w.float(), (0, pad)).view(w.shape[0], -1, 8)
    acc = torch.zeros(rows, w.shape[0], 8)
    for k in range(xs.shape[1]):
        acc = acc + xs[:, None, k, :] * ws[None, :, k, :]
    s4 = acc[..., :4] + acc[..., 4:]
    s2 = s4[..., :2] + s4[..., 2:]
    sums = s2[..., 0] + s2[..., 1]
    return sums if b is None else sums + b.float()


def _rows_order_sums(x: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    """float32 sums of x·wᵀ (+ b) in the order the forward forms them against bf16 weights for
    1–7 rows of x (_small_gemm.cpp, linear_rows): S sets of 8 lanes (S = 4 for 1–2 rows, 2 for
    3–4, 1 for 5–7), steps of 8·S weights, set s lane j adding the weight at 8·s + j of each
    step; the whole vectors past the last such step into set 0, the partial last vector (zeros
    past I) into set 1 (set 0 where S = 1); then (set 0 + set 1) + (set 2 + set 3) (as many as
    there are), its lanes summed as the strips' are (_strip_order_sums), then the bias."""
    rows, I = x.shape
    O, S = w.shape[0], 4 if rows <= 2 else 2 if rows <= 4 else 1
    body, whole = I // (8 * S) * (8 * S), I // 8 * 8
    xf, wf = x.float(), w.float()
    acc = torch.zeros(rows, O, S, 8)
    for k in range(0, body, 8 * S):
        acc = acc + xf[:, None, k : k + 8 * S].reshape(rows, 1, S, 8) * wf[None, :, k : k + 8 * S].reshape(1, O, S, 8)
    for k in range(body, whole, 8):
        acc[:, :, 0] = acc[:, :, 0] + xf[:, None, k : k + 8] * wf[None, :, k : k + 8]
    if whole < I:
        pad = whole + 8 - I
        xt = torch.nn.functional.pad(xf[:, whole:], (0, pad))
        wt = torch.nn.functional.pad(wf[:, whole:], (0, pad))
        t = 1 if S > 1 else 0
        acc[:, :, t] = acc[:, :, t] + xt[:, None, :] * wt[None, :, :]
    v = acc[:, :, 0]
    if S == 2:
        v = acc[:, :, 0] + acc[:, :, 1]
    if S == 4:
        v = (acc[:, :, 0] + acc[:, :, 1]) + (acc[:, :, 2] + acc[:, :, 3])
    s4 = v[..., :4] + v[..., 4:]
    s2 = s4[..., :2] + s4[..., 2:]
    sums = s2[..., 0] + s2[..., 1]
    return sums if b is None else sums + b.float()


# 1–2 rows of x whose I is whole steps of 32 (and fits kRowsBytes): weights widened by unpacks,
# x read from a reordered copy (linear_rows_unpacked); other widths and 3–7 rows: linear_rows.
# One row of I = 8192 is past the copy's 28 KiB: linear_rows.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("I", [45, 96, 300, 512, 1024])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("data", ["randn", "swamping"])
def test_bf16_rows_of_w_one_after_another_sum_in_their_order_and_round_once(rows, I, bias, data):
    """Bitwise: bf16 x, w (and b) against 1–7 rows of x, every sum the float32 sum in
    linear_rows's documented order (emulated in torch), rounded to bf16 once by torch."""
    _needs_kernel()
    _forward_sums_in_order(data, rows, 77, I, bias, _rows_order_sums)


@pytest.mark.parametrize("I", [3584, 8192])
@pytest.mark.parametrize("data", ["randn", "swamping"])
def test_bf16_long_rows_against_one_row_sum_in_their_order(I, data):
    """The same for one row of x against Mixtral's long rows of w (3584: the unpacked path)
    and rows past the reordered copy (8192)."""
    _needs_kernel()
    _forward_sums_in_order(data, 1, 40, I, False, _rows_order_sums)


# 8–15 rows: the strips widen bf16 weights for every tile of 4 rows; from 16 rows (from 28
# where I is past one widened chunk of 1024, up to 64) each strip is widened once into a
# float32 buffer, long rows a chunk at a time with the tiles' sums kept between the chunks
# (linear_strip_widened): the same order either way
@pytest.mark.parametrize("rows", [8, 13, 16, 27, 28, 31, 64])
@pytest.mark.parametrize("I", [300, 1024, 1025, 2048, 2100])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("data", ["randn", "swamping"])
def test_bf16_strips_sum_in_the_tiles_order_and_round_once(rows, I, bias, data):
    """Bitwise: bf16 x, w (and b) against 8–64 rows, every sum the float32 sum in the strips'
    documented order (emulated in torch), rounded to bf16 once by torch; O = 77 leaves a strip
    of 2 rows of w at the end of a thread's share."""
    _needs_kernel()
    _forward_sums_in_order(data, rows, 77, I, bias, _strip_order_sums)


# from 24: w packed first; from 65: the packed product (see test_linear_matches_float64)
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 6, 7, 16, 24, 37, 64, 65, 97, 200, 700])
@pytest.mark.parametrize(
    "shape", [(1, 1), (2, 7), (5, 9), (24, 8), (50, 17), (97, 3), (130, 200), (200, 1000), (300, 40), (261, 1100)]
)
@pytest.mark.parametrize("into", [False, True])
def test_input_grad_matches_float64(rows, shape, into):
    """Into a new tensor, or into `out`, a slice of a wider tensor whose other columns stay
    untouched."""
    _needs_kernel()
    O, I = shape
    g, w = _strided(rows, O), _strided(O, I)
    wide = torch.full((rows, I + 4), float("nan"))
    y = _small_gemm.input_grad(g, w.t(), out=wide[:, 1 : I + 1] if into else None)
    assert y is not None and y.shape == (rows, I)
    ref = g.double() @ w.double()
    assert ((y.double() - ref).abs() <= _bound(g.double().abs(), w.double().abs(), O)).all()
    if into:
        assert y.data_ptr() == wide[:, 1:].data_ptr()
        assert wide[:, :1].isnan().all() and wide[:, I + 1 :].isnan().all()


# 3–6 rows: w's rows in blocks of 256 read a column strip at a time (`split_long`: through bf16
# weights from 3 rows, float32 from 5, rows a multiple of 4 KiB apart only bf16 at 6) or in
# blocks of 8; each thread's part of w's rows (O = 520: 264 + 256, a block of 256 and one of
# 8) in whole blocks and a short last one; 1001 columns: strips of 16, a vector, a masked tail
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 4, 5, 6])
@pytest.mark.parametrize("shape", [(520, 1001), (1030, 1024), (600, 2048), (17, 40)])
@pytest.mark.parametrize("strided", [False, True])
def test_input_grad_of_a_few_rows_takes_every_product_once(dtype, rows, shape, strided):
    """Small integers: every product and partial sum is exact in float32, so the result equals
    the float64 product whatever the order: each product counted once, none left out."""
    _needs_kernel()
    O, I = shape
    torch.manual_seed(rows)
    g = torch.randint(-8, 9, (rows, O)).float()
    w = torch.randint(-8, 9, (O, I + 3 if strided else I)).to(dtype)[:, :I]
    y = _small_gemm.input_grad(g, w.t())
    assert y is not None and torch.equal(y.double(), g.double() @ w.double())


# 1–2 rows: w read a line at a time where y's rows fit in 8 KiB (I = 1001: lines, a vector, a
# masked tail; 2048 the widest one row takes, 2049 past it); 24: w packed first; 65: packed product
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 23, 24, 37, 64, 65, 97, 200])
@pytest.mark.parametrize("shape", [(1, 1), (5, 9), (24, 8), (97, 3), (130, 200), (200, 1000), (50, 1001), (7, 2048), (7, 2049)])
def test_input_grad_reads_bf16_weights_as_the_float32_product_of_their_values(rows, shape):
    """bf16 w with float32 g and out: each bf16 widens exactly, so the result is the float32
    kernel's on w's float32 values, bit for bit, and within the float64 bound of them."""
    _needs_kernel()
    O, I = shape
    g, w = _strided(rows, O), _strided(O, I).bfloat16()
    wide = torch.full((rows, I + 2), float("nan"))
    y = _small_gemm.input_grad(g, w.t(), out=wide[:, 1 : I + 1])
    assert y is not None
    w32 = w.float()
    ref = g.double() @ w32.double()
    assert ((y.double() - ref).abs() <= _bound(g.double().abs(), w32.double().abs(), O)).all()
    if rows >= _small_gemm.INPUT_GRAD_ROWS[0]:
        assert torch.equal(y, _small_gemm.input_grad(g, w32.t()))
    assert wide[:, 0].isnan().all() and wide[:, I + 1].isnan().all()


def test_input_grad_on_bf16_weights_declines_past_the_packed_rows():
    rows = _small_gemm.BF16_MAX_ROWS + 1  # (float32 weights go on to PACKED_MAX_ROWS)
    w = torch.randn(16, 8).bfloat16()
    assert _small_gemm.input_grad(torch.randn(rows, 16), w.t()) is None
    if _small_gemm.available():
        assert _small_gemm.input_grad(torch.randn(rows, 16), w.float().t()) is not None
    assert _small_gemm.input_grad(torch.randn(4, 16).bfloat16(), w.t()) is None  # g must be float32


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 31, 64, 128, 300, 600, _small_gemm.WEIGHT_GRAD_MAX_ROWS])
@pytest.mark.parametrize("shape", [(1, 1), (5, 9), (6, 16), (7, 17), (50, 33), (97, 40), (130, 200), (193, 7), (300, 1000)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_weight_grad_matches_float64(rows, shape, accumulate):
    """c = aᵀ·b (+ c) over tiles of 6 rows by 16 columns, the last ones partial, the threads
    splitting c's columns (up to 192 rows of c) or its rows (more); c a slice of a wider
    tensor whose other columns stay untouched; without `accumulate` c's old contents (NaN
    here) are never read."""
    _needs_kernel()
    M, N = shape
    a, b = _strided(rows, M), _strided(rows, N)
    wide = torch.full((M, N + 6), float("nan"))
    out = wide[:, 3 : N + 3]
    old = torch.randn(M, N)
    if accumulate:
        out.copy_(old)
    assert _small_gemm.weight_grad_into(out, a.t(), b, accumulate)
    ref = a.double().t() @ b.double() + (old.double() if accumulate else 0)
    bound = _bound(a.double().abs().t(), b.double().abs(), rows + 1) + (4 * U * old.double().abs() if accumulate else 0)
    assert ((out.double() - ref).abs() <= bound).all()
    assert wide[:, :3].isnan().all() and wide[:, N + 3 :].isnan().all()


@pytest.mark.parametrize("rows", [1, 5, 6, 64, 128, _small_gemm.BF16_MAX_ROWS])
@pytest.mark.parametrize("shape", [(1, 1), (5, 9), (6, 16), (7, 17), (50, 33), (130, 200), (193, 7), (300, 1000)])
def test_weight_grad_into_bf16_is_the_float32_result_rounded_once(rows, shape):
    """A bf16 `out` gets each float32 sum rounded to nearest even as it is stored: bit for bit
    the float32 kernel's result rounded by torch, the last partial vectors included, NaN kept
    NaN; out's neighbours in a wider tensor untouched."""
    _needs_kernel()
    M, N = shape
    a, b = _strided(rows, M), _strided(rows, N)
    a[0, 0] = float("nan")  # row 0 of out all NaN where b's row 0 is not zero
    wide = torch.full((M, N + 6), 7.0).bfloat16()
    out = wide[:, 3 : N + 3]
    assert _small_gemm.weight_grad_into(out, a.t(), b)
    _assert_float32_sums_rounded(out, a, b)
    assert out[0].isnan().all()
    assert (wide[:, :3] == 7).all() and (wide[:, N + 3 :] == 7).all()


def _assert_float32_sums_rounded(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out (bf16) is bit for bit the float32 kernel's aᵀ·b rounded by torch, NaN where it is NaN."""
    out32 = torch.empty(out.shape)
    assert _small_gemm.weight_grad_into(out32, a.t(), b)
    assert torch.equal(out.isnan(), out32.isnan())
    finite = ~out32.isnan()
    assert torch.equal(out[finite].view(torch.int16), out32[finite].bfloat16().view(torch.int16))


# bf16 outputs of 2^19 elements and more whose rows start on 64-byte lines are streamed a line
# at a time: 32 columns (two panels) by 3 rows, then the rest of a 6-row tile (525 / 526 / 527
# / 530 rows end on tiles of 3 / 4 / 5 / 2 rows); 1000 columns leave a partial panel, 1008 an
# odd last panel, both stored the ordinary way
@pytest.mark.parametrize("rows", [1, 3, 8, 64, _small_gemm.BF16_MAX_ROWS])
@pytest.mark.parametrize("shape", [(525, 1024), (526, 1000), (527, 1008), (530, 1024)])
def test_weight_grad_into_bf16_streamed_in_whole_lines_is_the_float32_result_rounded_once(rows, shape):
    """Bit for bit the float32 kernel's sums rounded by torch (NaN kept NaN), and the same bits
    as a slice that is not line-aligned (stored the ordinary way); the columns past the slice
    in its wider tensor untouched."""
    _needs_kernel()
    M, N = shape
    assert M * N >= 1 << 19
    a, b = _strided(rows, M), _strided(rows, N)
    a[0, 1] = float("nan")  # row 1 of out all NaN where b's row 0 is not zero
    wide = torch.full((M, 1024), 7.0).bfloat16()
    out = wide[:, :N]
    assert out.data_ptr() % 64 == 0 and out.stride(0) * 2 % 64 == 0
    assert _small_gemm.weight_grad_into(out, a.t(), b)
    _assert_float32_sums_rounded(out, a, b)
    assert out[1].isnan().all()
    assert (wide[:, N:] == 7).all()
    shifted = torch.full((M * 1024 + 8,), 7.0).bfloat16()[8:].view(M, 1024)[:, :N]  # 16 bytes off a line
    assert shifted.data_ptr() % 64 != 0
    assert _small_gemm.weight_grad_into(shifted, a.t(), b)
    assert torch.equal(shifted.view(torch.int16), out.view(torch.int16))


def _bf16_bits_by_hand(sums: torch.Tensor) -> list[int]:
    """float32 values' bf16 bits, rounded to nearest even on the integer bits (NaN as 0x7FC0)."""
    out = []
    for bits in sums.view(torch.int32).tolist():
        bits &= 0xFFFFFFFF
        if bits & 0x7FFFFFFF > 0x7F800000:
            out.append(0x7FC0)
        else:
            out.append(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF)
    return out


# float32 bits around each way a bf16 rounding can go (sum bits → bf16 bits by hand in
# _bf16_bits_by_hand): ties to even down and up, just off them, at the top of the finite range
# (a tie there rounds up to infinity), positive subnormals and their ties; negative values whose
# top half is 0x8000 and infinities; NaNs: quiet, signalling, negative
BF16_ROUNDING_CASES = [
    0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF808000, 0xBF818000, 0x7F7E8000, 0x7F7F8000,
    0x7F7F7FFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00008000, 0x00018000, 0x00007FFF, 0x00000001, 0x00800000,
    0x4B7FFF80, 0x3D5C8000, 0xBEF88000,
]
BF16_EDGE_CASES = [0x80000001, 0x80008000, 0x80018000, 0x8000FFFF, 0x807F8000, 0x7F800000, 0xFF800000]
BF16_NAN_CASES = [0x7FC00000, 0x7F800001, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC08000]


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32)


def _bf16_weight_grad_line_bits(monkeypatch, entry: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """aᵀ·b [M, N] into a bf16 gradient whose lines are 64-byte aligned (streamed whole lines)
    through `weight_grad_into` or `weight_grad_blocks` (expert 1 of 2, expert 0 untouched), as
    its bf16 bits (int32, 0–0xFFFF). The AVX2 kernel's entry points on any CPU (on AVX-512
    CPUs the layer hands these gradients to other kernels, and `weight_grad_blocks` declines)."""
    _avx2_kernels(monkeypatch)
    (rows, M), N = a.shape, b.shape[1]
    if entry == "weight_grad_into":
        out = torch.full((M, N), 7.0).bfloat16()
        assert out.data_ptr() % 64 == 0
        assert _small_gemm.weight_grad_into(out, a.t(), b)
    else:
        grads = torch.full((2, M, N), 7.0).bfloat16()
        assert grads[1].data_ptr() % 64 == 0
        assert _small_gemm.weight_grad_blocks(grads, a, b, [(1, 0, rows)], [False])
        assert bool((grads[0] == 7).all())
        out = grads[1]
    return out.view(torch.int16).int() & 0xFFFF


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("M", [526, 527])
@pytest.mark.parametrize("entry", ["weight_grad_into", "weight_grad_blocks"])
def test_bf16_weight_grad_lines_round_every_kind_of_float32_as_by_hand(monkeypatch, rows, M, entry):
    """The streamed lines of a bf16 weight gradient (rounded half up where no sum of a line's
    32 is a tie or a NaN, else exactly: round_line in _small_gemm.cpp) give each float32 sum's
    nearest-even bf16, NaN as 0x7FC0, bit for bit: a's rows are ones and b's first row holds
    chosen and random float32 bit patterns (b's other rows -0.0), so each sum is that pattern
    (a NaN quieted, -0.0 as +0.0: the sums start from +0.0). Each kind of case has lines of
    its own, so that a line's check sees it alone (a tie to even alone among ordinary sums).
    M = 526 / 527: 3-row line tiles and a last one of 1 / 2 rows; both entry points (the
    decode-sized blocks' one region)."""
    _needs_kernel()
    N = 1024
    assert M * N >= 1 << 19
    torch.manual_seed(rows * M)
    patterns = torch.randint(-(2**31), 2**31, (N,), dtype=torch.int32)  # (about 1 in 8 lines with a NaN)
    patterns[:160] = torch.randn(160).view(torch.int32)  # lines of 32 sums, the cases among ordinary sums:
    patterns[: len(BF16_ROUNDING_CASES)] = _int32(BF16_ROUNDING_CASES)  # ties etc. alone (no NaN, no top half
    patterns[32 : 32 + len(BF16_EDGE_CASES)] = _int32(BF16_EDGE_CASES)  # 0x8000 in the line); the edges;
    patterns[64 : 64 + len(BF16_NAN_CASES)] = _int32(BF16_NAN_CASES)  # the NaNs; a single tie to even (down)
    patterns[96 + 7] = _int32([0x3F808000])[0]  # in a line of ordinary sums; a line of ordinary sums only
    patterns[N - 32 :] = _int32(BF16_ROUNDING_CASES[:16] + BF16_EDGE_CASES[:4] + BF16_NAN_CASES[:4] + [0x40000000] * 8).flip(0)
    b = torch.full((rows, N), -0.0)
    b[0] = patterns.view(torch.float32)
    a = torch.ones(rows, M)
    expected = torch.tensor(_bf16_bits_by_hand(b[0] + 0.0), dtype=torch.int32)
    got = _bf16_weight_grad_line_bits(monkeypatch, entry, a, b)
    wrong = (got != expected).nonzero().tolist()
    assert not wrong, [(r, c, hex(patterns[c].item() & 0xFFFFFFFF), hex(got[r, c]), hex(expected[c])) for r, c in wrong[:8]]


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("M", [526, 527])
@pytest.mark.parametrize("entry", ["weight_grad_into", "weight_grad_blocks"])
@pytest.mark.parametrize("nan_in_a", [False, True], ids=["finite", "nan-in-a"])
def test_bf16_weight_grad_lines_of_finite_operands_round_as_by_hand(monkeypatch, rows, M, entry, nan_in_a):
    """Where a line tile's operands are all finite, its lines skip the NaN screen (the kernel's
    finite_operands): then every finite sum and every sum that overflows still rounds to its
    nearest-even bf16, bit for bit. b's first row holds the finite rounding and edge cases and
    random finite bit patterns (its other rows -0.0); a's rows are ones but for the last row
    of G, scaled by 2^100 (sums past the largest float32 there: ±infinity from finite
    operands), so G[m] is a[0, m]·b[0] rounded to float32, then to bf16. With `nan_in_a`, one
    row of G (5) has a NaN in a: its tile takes the screen and that row is all 0x7FC0, the
    other tiles not (a build that screens b alone fails here)."""
    _needs_kernel()
    N = 1024
    torch.manual_seed(rows * M + nan_in_a)
    patterns = torch.randint(-(2**31), 2**31, (N,), dtype=torch.int32)
    patterns[(patterns & 0x7F800000) == 0x7F800000] ^= 0x00800000  # (no infinities, no NaNs)
    finite_edges = [v for v in BF16_EDGE_CASES if v & 0x7F800000 != 0x7F800000]
    patterns[:160] = torch.randn(160).view(torch.int32)
    patterns[: len(BF16_ROUNDING_CASES)] = _int32(BF16_ROUNDING_CASES)
    patterns[32 : 32 + len(finite_edges)] = _int32(finite_edges)
    patterns[N - 32 :] = _int32(BF16_ROUNDING_CASES[:16] + finite_edges[:4] + [0x40000000] * 12).flip(0)
    b = torch.full((rows, N), -0.0)
    b[0] = patterns.view(torch.float32)
    assert b.isfinite().all()
    a = torch.ones(rows, M)
    a[:, M - 1] = 2.0**100
    if nan_in_a:  # (a negative NaN of the widest payload: its bits + 0x8000 would carry into the sign)
        a[0, 5] = _int32([0xFFFFFFFF]).view(torch.float32)[0]
    sums = a[0].unsqueeze(1) * b[0] + 0.0  # [M, N]: a[0, m]·b[0, n] rounded to float32 (-0.0 as +0.0)
    assert sums[M - 1].isinf().sum() > 100 and sums[M - 1].isfinite().sum() > 100
    expected = torch.tensor(_bf16_bits_by_hand(sums[0]), dtype=torch.int32).repeat(M, 1)  # (rows of ones alike)
    for m in (5, M - 1):
        expected[m] = torch.tensor(_bf16_bits_by_hand(sums[m]), dtype=torch.int32)
    got = _bf16_weight_grad_line_bits(monkeypatch, entry, a, b)
    if nan_in_a:
        assert (expected[5] == 0x7FC0).all()
    wrong = (got != expected).nonzero().tolist()
    assert not wrong, [(r, c, hex(patterns[c].item() & 0xFFFFFFFF), hex(got[r, c]), hex(expected[r, c])) for r, c in wrong[:8]]


@pytest.mark.parametrize("rows", [1, 3, 40, _small_gemm.WEIGHT_GRAD_MAX_ROWS])
@pytest.mark.parametrize("shape", [(512, 1024), (600, 904)])
def test_weight_grad_streamed_past_the_caches_matches_float64(rows, shape):
    """Outputs of 2^19 elements and more, 32-byte aligned with rows a multiple of 8 floats
    apart, are stored with streaming stores (the row split, _small_gemm.cpp): within the
    float64 bound, and bit for bit the sums stored the ordinary way into a misaligned slice of
    the same shape (904 columns: a partial last panel of 8, stored unstreamed)."""
    _needs_kernel()
    M, N = shape
    assert M * N >= 1 << 19
    a, b = _strided(rows, M), _strided(rows, N)
    out = torch.full((M, N), float("nan"))
    assert out.data_ptr() % 32 == 0
    assert _small_gemm.weight_grad_into(out, a.t(), b)
    ref = a.double().t() @ b.double()
    assert ((out.double() - ref).abs() <= _bound(a.double().abs().t(), b.double().abs(), rows + 1)).all()
    shifted = torch.full((M * N + 1,), float("nan"))[1:].view(M, N)  # 4 bytes past alignment
    assert _small_gemm.weight_grad_into(shifted, a.t(), b)
    assert torch.equal(shifted, out)


def test_weight_grad_declines_what_it_does_not_take_and_leaves_out_untouched():
    a, b, out = torch.randn(4, 16), torch.randn(4, 8), torch.full((16, 8), 7.0)
    too_many = _small_gemm.WEIGHT_GRAD_MAX_ROWS + 1
    cases = [
        (a.double().t(), b.double(), out.double()),
        (a.t(), b.bfloat16(), out),
        (torch.randn(too_many, 16).t(), torch.randn(too_many, 8), out),
        (torch.randn(16, 4), b, out),  # aᵀ a plain [16, 4]: a's rows not contiguous
        (a.t()[:, :0], b[:0], out),
        (a.t().bfloat16(), b.bfloat16(), out.bfloat16()),  # bf16 operands: the caller's fp32 products only
    ]
    for a_t, b_, out_ in cases:
        assert not _small_gemm.weight_grad_into(out_, a_t, b_)
        assert (out_ == 7).all()
    out16 = out.bfloat16()  # a bf16 result is rounded once: never accumulated into
    assert not _small_gemm.weight_grad_into(out16, a.t(), b, accumulate=True) and (out16 == 7).all()
    _needs_kernel()
    with pytest.raises(ValueError, match=r"a_t \(16, 4\), b \(4, 8\) and out \(16, 9\)"):
        _small_gemm.weight_grad_into(torch.empty(16, 9), a.t(), b)


def test_results_do_not_depend_on_the_number_of_threads():
    """Each output element is one thread's sum in one fixed order: bitwise the same on 1 and
    2 threads (the threads split the outputs, not the sums; input gradients of 1–6 rows split
    the sums into two parts whatever the threads)."""
    _needs_kernel()
    x, w, g = torch.randn(100, 300), torch.randn(500, 300), torch.randn(100, 500)
    h, da, weight = torch.randn(100, 600), torch.randn(100, 300), torch.rand(100)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y, y_packed = torch.empty(13, 500), torch.empty(100, 500)
            assert _small_gemm.linear_into(y, x[:13], w, None) and _small_gemm.linear_into(y_packed, x, w, None)
            c = torch.empty(300, 500)
            assert _small_gemm.weight_grad_into(c, x[:9].t(), g[:9])
            grads = _small_gemm.input_grad(g[:9], w.t()), _small_gemm.input_grad(g, w.t()), _small_gemm.input_grad(g[:3], w.t())
            results.append((y, y_packed, c, *grads, _small_gemm.swiglu(h), *_small_gemm.swiglu_backward(h, da, weight, True, True)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(one, two) for one, two in zip(*results))


@pytest.mark.parametrize(
    "case",
    ["float16", "float64", "mixed dtypes", "rows past the limit", "weight not row-contiguous", "no rows",
     "output rows overlap"],
)
def test_declines_what_it_does_not_take_and_leaves_out_untouched(case):
    x, w, out = torch.randn(4, 16), torch.randn(8, 16), torch.full((4, 8), 7.0)
    if case == "float16":
        x, w, out = x.half(), w.half(), out.half()
    elif case == "mixed dtypes":
        w = w.bfloat16()
    elif case == "float64":
        x, w, out = x.double(), w.double(), out.double()
    elif case == "rows past the limit":  # (past MAX_ROWS: the packed product, up to PACKED_MAX_ROWS)
        rows = _small_gemm.PACKED_MAX_ROWS + 1
        x, out = torch.randn(rows, 16), torch.full((rows, 8), 7.0)
    elif case == "weight not row-contiguous":
        w = torch.randn(16, 8).t()
    elif case == "no rows":
        x, out = x[:0], out[:0]
    elif case == "output rows overlap":
        out = torch.full((1, 8), 7.0).expand(4, 8)
    assert not _small_gemm.linear_into(out, x, w, None)
    assert (out == 7).all()
    assert _small_gemm.input_grad(torch.randn(1, 8), torch.randn(8, 16).t()) is None  # one row: torch's split


def test_misfit_shapes_are_an_error_naming_them():
    _needs_kernel()
    with pytest.raises(ValueError, match=r"x \(4, 16\), w \(8, 12\)"):
        _small_gemm.linear_into(torch.empty(4, 8), torch.randn(4, 16), torch.randn(8, 12), None)
    with pytest.raises(ValueError, match=r"g \(4, 8\), w \(8, 12\) and out \(4, 11\)"):
        _small_gemm.input_grad(torch.randn(4, 8), torch.randn(8, 12).t(), out=torch.empty(4, 11))


# --- SwiGLU's elementwise kernels ------------------------------------------------------------


def _swiglu_float64(h, da, weight):
    gate, up = h.double().chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    act = gate * s
    a = act * up
    dav = da.double() * (1.0 if weight is None else weight.double()[:, None])
    dh = torch.cat([dav * up * s * (1 + gate * (1 - s)), dav * act], dim=-1)
    return a, dh, (a * da.double()).sum(-1)


@pytest.mark.parametrize("rows", [1, 3, 50])
@pytest.mark.parametrize("F", [1, 7, 8, 13, 300])
@pytest.mark.parametrize("scaled", [False, True])
def test_swiglu_kernels_match_float64(rows, F, scaled):
    """a = silu(gate)·up, dh and dweight in one pass, against float64: a and dh within a few
    float32 roundings of each factor (e^x to under an ulp, one division), dweight within the
    sum's bound. Inputs span e^x's clamped range; h and da are strided slices; F not a multiple
    of 8 takes the masked tail."""
    _needs_kernel()
    torch.manual_seed(rows * 1000 + F)
    h, da = _strided(rows, 2 * F) * 6, _strided(rows, F)
    h[0, 0] = 95.0  # past the clamp at 88.3: e^-g ≈ 0, s = 1
    if F > 1:
        h[0, 1] = -95.0  # e^-g clamped: s ≈ 0
    weight = torch.rand(rows) + 0.5 if scaled else None
    a_ref, dh_ref, dweight_ref = _swiglu_float64(h, da, weight)
    gate, up = h.double().chunk(2, dim=-1)
    tol = 16 * U
    a = _small_gemm.swiglu(h)
    assert ((a.double() - a_ref).abs() <= tol * a_ref.abs() + 1e-30).all()
    a2, dh, dweight = _small_gemm.swiglu_backward(h, da, weight, True, True)
    assert torch.equal(a2, a)
    # each part of dh is a product of factors, one of which (1 + g·(1 − s)) can cancel: bound
    # it by the sizes of its terms, 1 + |g|·(1 − s) ≤ 1 + |g|
    s = torch.sigmoid(gate)
    dav = da.double().abs() * (1.0 if weight is None else weight.double()[:, None])
    scale = torch.cat([dav * up.abs() * s * (1 + gate.abs()), dav * (gate * s).abs()], dim=-1)
    assert ((dh.double() - dh_ref).abs() <= tol * scale + 1e-30).all()
    bound = (F + 4) * U * (a_ref.abs() * da.double().abs()).sum(-1) + tol * (a_ref.abs() * da.double().abs()).sum(-1)
    assert ((dweight.double() - dweight_ref).abs() <= bound + 1e-30).all()
    none_a, dh_only, none_w = _small_gemm.swiglu_backward(h, da, weight, False, False)
    assert none_a is None and none_w is None and torch.equal(dh_only, dh)


@pytest.mark.parametrize("rows, F", [(3, 13), (50, 300)])
@pytest.mark.parametrize("scaled", [False, True])
def test_swiglu_kernels_round_to_bf16_where_a_bf16_layer_does(rows, F, scaled):
    """round_bf16 (a bf16 layer computing in float32: h holds bf16 values): a, da·weight and dh
    rounded to bf16 values where grouped's bf16 ops round them, dweight from the rounded a and
    the unscaled da. Against float64 with the same roundings: every value a bf16 value, within
    one bf16 rounding of the reference, and nearly all equal to it (the float32 steps before a
    rounding flip it only near a tie); dweight within the sum's bound."""
    _needs_kernel()
    torch.manual_seed(rows + F)
    h = (_strided(rows, 2 * F) * 3).bfloat16().float()
    da = _strided(rows, F)
    weight = torch.rand(rows) + 0.5 if scaled else None
    a, dh, dweight = _small_gemm.swiglu_backward(h, da, weight, True, True, round_bf16=True)
    assert torch.equal(_small_gemm.swiglu(h, round_bf16=True), a)

    def bf16(t):
        return t.to(torch.bfloat16).double()

    gate, up = h.double().chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    a_ref = bf16(gate * s * up)
    dav = bf16(da.double() * (1.0 if weight is None else weight.double()[:, None]))
    dh_ref = bf16(torch.cat([dav * up * s * (1 + gate * (1 - s)), dav * gate * s], dim=-1))
    for got, want in ((a, a_ref), (dh, dh_ref)):
        assert torch.equal(bf16(got), got.double())
        assert ((got.double() - want).abs() <= 2.0**-7 * want.abs()).all()
        assert (got.double() == want).float().mean() >= 0.98
    bound = ((a.double() - a_ref).abs() * da.double().abs()).sum(-1) + (F + 4) * U * (a_ref.abs() * da.double().abs()).sum(-1)
    assert ((dweight.double() - (a_ref * da.double()).sum(-1)).abs() <= bound + 1e-30).all()


def test_swiglu_kernels_pass_nan_through():
    _needs_kernel()
    h, da = torch.ones(2, 16), torch.ones(2, 8)
    h[0, 3] = float("nan")  # a gate
    h[1, 8 + 5] = float("nan")  # an up
    a = _small_gemm.swiglu(h)
    _, dh, dweight = _small_gemm.swiglu_backward(h, da, None, False, True)
    assert a.isnan().nonzero().tolist() == [[0, 3], [1, 5]]
    assert dh[0, [3, 8 + 3]].isnan().all() and dh[1, 5].isnan() and dweight.isnan().all()
    assert dh.isnan().sum() == 3


# gates where e^-g leaves float32's range (past ln(FLT_MAX) ≈ 88.7228: torch's silu is -0 there),
# close to it on both sides, and large positive ones (e^-g tiny: silu(g) = g)
EXTREME_GATES = [-3.0e38, -200.0, -90.0, -88.8, -88.73, -88.72, -88.7, -88.5, -88.3, -88.0, -87.0, 88.9, 150.0, 0.5]


def test_swiglu_kernels_at_gates_where_the_exponential_overflows():
    """silu(g)·u and its gradient for gates whose e^-g overflows float32 (torch: e^-g = inf, so
    silu and the gradient are ±0, not a tiny number) or nearly does, against torch's float32 ops:
    zeros where torch has zeros, the rest within float32 rounding (the kernels clamped e^x at
    88.3 until 2026-12-05: silu(-90) came out as -4e-37)."""
    _needs_kernel()
    F = len(EXTREME_GATES)
    gate = torch.tensor(EXTREME_GATES).repeat(3, 1)
    up = torch.tensor([[2.0**-5], [1.0], [3.0]]).expand(3, F)
    h, da = torch.cat([gate, up], dim=-1).contiguous(), torch.full((3, F), 0.75)
    a = _small_gemm.swiglu(h)
    _, dh, _ = _small_gemm.swiglu_backward(h, da, None, False, False)
    act = torch.nn.functional.silu(gate)
    dh_ops = torch.cat([torch.ops.aten.silu_backward(da * up, gate), da * act], dim=-1)
    for got, want in [(a, act * up), (dh, dh_ops)]:
        assert torch.equal(got == 0, want == 0)
        assert ((got.double() - want.double()).abs() <= 1e-5 * want.double().abs()).all()


def test_swiglu_kernels_decline_what_they_do_not_take():
    h, da = torch.randn(4, 16), torch.randn(4, 8)
    assert _small_gemm.swiglu(h.double()) is None and _small_gemm.swiglu(h[:, :15]) is None
    assert _small_gemm.swiglu(torch.randn(16, 4).t()) is None  # rows not contiguous
    assert _small_gemm.swiglu_backward(h, da.double(), None, True, True) is None
    assert _small_gemm.swiglu_backward(h, torch.randn(4, 9), None, True, True) is None  # da not [rows, F]
    assert _small_gemm.swiglu_backward(h, da, torch.rand(3), True, True) is None  # weight not [rows]


@pytest.mark.skipif(not on_x86_linux_with_avx2, reason="the kernel is built for x86-64 Linux with AVX2 only")
@pytest.mark.skipif(os.environ.get("MOE_FFN_SMALL_GEMM") == "0", reason="switched off by MOE_FFN_SMALL_GEMM=0")
def test_avx512_kernels_run_where_torch_uses_avx512():
    """Where torch runs its kernels at AVX-512 and the library is built, the AVX-512 kernels
    must run: a build without them must not pass unnoticed as their tests skipping."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("torch does not run AVX-512 kernels on this CPU")
    assert _small_gemm.library() is not None, "the kernel library did not build (test_kernel_is_built_here)"
    assert _small_gemm._avx512_entry_points() is not None


def _needs_avx512_kernel():
    if _small_gemm._avx512_entry_points() is None or torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("no AVX-512 weight-gradient kernel here (CPU without AVX-512, or the library not built)")


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 33, 64, 96, 128, 129, 300, 1500])
@pytest.mark.parametrize("shape", [(1, 1), (5, 17), (6, 64), (13, 100), (97, 300), (1024, 512)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_avx512_weight_grad_matches_float64(rows, shape, accumulate):
    """aᵀ·b over `rows` rows into a slice of a wider tensor (margins untouched), or added to
    what it holds; (1024, 512) not accumulating: stored with streaming stores (a slice with a
    row stride of 16 floats' multiple), and again into a tensor of its own (aligned). Past 128
    rows (the limits AMD's CPUs run it to, SGEMM_AVX2_WEIGHT_GRAD_ROWS): panels deeper than
    L1 holds, and at 1500 rows c's rows in chunks of 174 (`at` kept to 2^18 floats)."""
    _needs_avx512_kernel()
    m, n = shape
    a, b = _strided(rows, m), _strided(rows, n)
    wide = torch.full((m, n + 20), float("nan"))
    out = wide[:, 4 : n + 4]
    init = torch.randn(m, n) if accumulate else None
    if accumulate:
        out.copy_(init)
    assert _small_gemm.avx512_weight_grad_into(
        out, a.t(), b, accumulate=accumulate, limits=_small_gemm.SGEMM_AVX2_WEIGHT_GRAD_ROWS
    )
    exact = a.double().t() @ b.double() + (0 if init is None else init.double())
    bound = _bound(a.double().abs().t(), b.double().abs(), rows + 1) + (0 if init is None else (rows + 3) * U * init.double().abs())
    assert ((out.double() - exact).abs() <= bound).all()
    assert wide[:, :4].isnan().all() and wide[:, n + 4 :].isnan().all()
    if not accumulate:
        own = torch.empty(m, n)
        assert _small_gemm.avx512_weight_grad_into(own, a.t(), b, limits=_small_gemm.SGEMM_AVX2_WEIGHT_GRAD_ROWS)
        assert torch.equal(own, out)


@pytest.mark.parametrize("depth", [_small_gemm.AVX512_FORWARD_DEPTH, _small_gemm.AVX512_FORWARD_DEPTH_AMD])
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 12, 17, 33, 64, 96])
@pytest.mark.parametrize("shape", [(1, 1), (5, 17), (6, 64), (13, 100), (97, 300), (64, 1040), (40, 3584), (7, 4200)])
def test_avx512_linear_matches_float64(monkeypatch, rows, shape, depth):
    """x·wᵀ into a slice of a wider tensor (margins untouched): tiles of 4 rows by 6, their
    tails, I not a multiple of 16 and I past one chunk of either depth (partial sums carried).
    The kernel's whole range on any CPU (each CPU sends it its own: widened here)."""
    _needs_avx512_kernel()
    most = max(_small_gemm.AVX512_FORWARD_ROWS[1], _small_gemm.AVX512_FORWARD_ROWS_ZEN4[1])
    monkeypatch.setattr(_small_gemm, "_avx512_forward_rows", lambda: (1, most))
    monkeypatch.setattr(_small_gemm, "avx512_forward_depth", lambda: depth)
    O, I = shape
    x, w = _strided(rows, I), _strided(O, I)
    wide = torch.full((rows, O + 6), float("nan"))
    out = wide[:, 3 : O + 3]
    assert _small_gemm.avx512_linear_into(out, x, w)
    bound = _bound(x.double().abs(), w.double().abs().t(), I)
    assert ((out.double() - x.double() @ w.double().t()).abs() <= bound).all()
    assert wide[:, :3].isnan().all() and wide[:, O + 3 :].isnan().all()


@pytest.mark.parametrize("blocks", [False, True])
def test_avx512_forward_depth_is_the_chunk_of_the_sums(monkeypatch, blocks):
    """Where I's elements are summed in chunks, by hand, all in lane 0 of the sums: a row of
    8192 with 2^24 at element 0 and 1s at 512, 528, 4096 and 4112. A sum rounds a 1 added to
    2^24 away (2^24 + 1 ties to even: 2^24), while two 1s summed apart make 2 exactly: chunks
    of 512 give 2^24 + 4, of 4096 2^24 + 2 (the first pair in 2^24's chunk), one sum over all
    of I 2^24. The single product for all three; the blocks' call has entry points for the two
    depths `avx512_forward_depth` chooses between."""
    _needs_avx512_kernel()
    monkeypatch.setattr(_small_gemm, "_avx512_forward_rows", lambda: _small_gemm.AVX512_FORWARD_ROWS)
    x, w = torch.zeros(3, 8192), torch.ones(8, 8192)
    x[:, 0] = 2.0**24
    x[:, [512, 528, 4096, 4112]] = 1.0
    cases = {_small_gemm.AVX512_FORWARD_DEPTH: 2.0**24 + 4, _small_gemm.AVX512_FORWARD_DEPTH_AMD: 2.0**24 + 2}
    assert set(cases) == {512, 4096}  # (the cases' expected sums are for these depths)
    if not blocks:
        cases[8192] = 2.0**24
    for depth, expected in cases.items():
        monkeypatch.setattr(_small_gemm, "avx512_forward_depth", lambda: depth)
        if blocks:
            out = _small_gemm.linear_blocks(x, w[None], [(0, 0, 3)])
        else:
            out = torch.empty(3, 8)
            assert _small_gemm.avx512_linear_into(out, x, w)
        assert out is not None and bool((out == expected).all()), (depth, out)


def test_avx512_linear_declines_what_it_does_not_take():
    _needs_avx512_kernel()
    lo, hi = _small_gemm._avx512_forward_rows()
    w, out = torch.randn(24, 40), torch.full((hi + 1, 24), 7.0)
    for rows in (lo - 1, hi + 1):
        assert not _small_gemm.avx512_linear_into(out[:rows], torch.randn(rows, 40), w)
    assert not _small_gemm.avx512_linear_into(out[:lo].double(), torch.randn(lo, 40).double(), w.double())
    assert not _small_gemm.avx512_linear_into(out[: lo + 1], torch.randn(40, lo + 1).t(), w)  # x's rows not contiguous
    assert bool((out == 7).all())
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.avx512_linear_into(out[:lo, :20], torch.randn(lo, 40), w)


@pytest.mark.parametrize("amd, family", [(True, 25), (True, 26), (False, 6)])
def test_avx512_linear_row_range_by_vendor(monkeypatch, amd, family):
    """On AMD's AVX-512 CPUs (forced here) the forward kernel takes up to AVX512_FORWARD_ROWS_AMD
    rows, on Zen 4 (family 25) AVX512_FORWARD_ROWS_ZEN4, and leaves larger blocks to oneDNN;
    elsewhere up to AVX512_FORWARD_ROWS."""
    _needs_avx512_kernel()
    monkeypatch.setattr(_small_gemm, "_vendor_is_amd", lambda: amd)
    monkeypatch.setattr(_small_gemm, "_cpu_family", lambda: family)
    expected = {(True, 25): 512, (True, 26): 40, (False, 6): 64}[amd, family]
    hi = _small_gemm._avx512_forward_rows()[1]
    assert hi == expected
    w = torch.randn(24, 40)
    for rows, taken in ((hi, True), (hi + 1, False)):
        out = torch.full((rows, 24), 7.0)
        assert _small_gemm.avx512_linear_into(out, torch.randn(rows, 40), w) == taken
        assert bool((out == 7).all()) != taken


def test_cpu_family_is_this_cpus():
    """_cpu_family reads /proc/cpuinfo's "cpu family" (by hand here: its first such line)."""
    lines = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("cpu family")]
    if not lines:
        pytest.skip("no cpu family in /proc/cpuinfo here")
    _small_gemm._cpu_family.cache_clear()
    assert _small_gemm._cpu_family() == int(lines[0].split(":")[1])


def test_avx512_weight_grad_declines_what_it_does_not_take():
    _needs_avx512_kernel()
    lo, hi = _small_gemm.AVX512_WEIGHT_GRAD_ROWS
    out = torch.full((8, 32), 7.0)
    for rows in (hi + 1,):
        assert not _small_gemm.avx512_weight_grad_into(out, torch.randn(rows, 8).t(), torch.randn(rows, 32))
    assert not _small_gemm.avx512_weight_grad_into(out.double(), torch.randn(lo, 8).double().t(), torch.randn(lo, 32).double())
    assert not _small_gemm.avx512_weight_grad_into(out, torch.randn(8, lo + 1), torch.randn(lo + 1, 32))  # a's rows not contiguous
    assert bool((out == 7).all())
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.avx512_weight_grad_into(out, torch.randn(lo, 8).t(), torch.randn(lo, 31))


# --- bf16 decode blocks on AVX512-BF16 CPUs without AMX (_small_gemm.bf16_*_blocks) ------------

def _bf16_blocks_here() -> bool:
    return (
        torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_avx512_bf16_supported()
        and not torch.cpu._is_amx_tile_supported()
    )


@pytest.mark.skipif(not on_x86_linux_with_avx2, reason="the kernel is built for x86-64 Linux with AVX2 only")
@pytest.mark.skipif(os.environ.get("MOE_FFN_SMALL_GEMM") == "0", reason="switched off by MOE_FFN_SMALL_GEMM=0")
def test_bf16_blocks_kernels_run_where_the_cpu_has_avx512_bf16_and_no_amx():
    """A build or a check that loses them must not pass as their tests skipping."""
    if not _bf16_blocks_here():
        assert _small_gemm._bf16_blocks_entry_points() is None
        pytest.skip("not an AVX512-BF16 CPU without AMX (as torch reports it)")
    assert _small_gemm._bf16_blocks_entry_points() is not None


def _needs_bf16_blocks():
    if _small_gemm._bf16_blocks_entry_points() is None:
        pytest.skip("no bf16 blocks kernels here (not an AVX512-BF16 CPU without AMX, or the library not built)")


def _with_threads(n, run):
    """run() with torch (and so the kernels' team) on n threads."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return run()
    finally:
        torch.set_num_threads(threads)


def _on_one_thread(run):
    """run() with torch (and so the kernels' team) on one thread: the work is split otherwise."""
    return _with_threads(1, run)


def _bf16_input_grads_checked(g: torch.Tensor, w: torch.Tensor, blocks, unused_row: int) -> torch.Tensor:
    """bf16_input_grad_blocks into a slice of a wider NaN tensor: each block's rows within one
    rounding of float64's product, the row between blocks and the margins untouched."""
    I = w.shape[2]
    wide = torch.full((g.shape[0], I + 7), float("nan"), dtype=torch.bfloat16)
    out = wide[:, 3 : I + 3]
    assert _small_gemm.bf16_input_grad_blocks(out, g, w, blocks)
    for e, start, stop in blocks:
        exact = g[start:stop].double() @ w[e].double()
        bound = _bound(g[start:stop].double().abs(), w[e].double().abs(), w.shape[1])
        _bf16_within_one_rounding(out[start:stop], exact, bound)
    assert wide[unused_row].isnan().all() and wide[:, :3].isnan().all() and wide[:, I + 3 :].isnan().all()
    return out


# blocks of 1 to BF16_BLOCKS_MAX_ROWS rows, experts in any order, rows between blocks unused
_BF16_BLOCKS = [(2, 0, 1), (0, 1, 9), (3, 10, 13), (1, 13, 19)]


def _bf16_within_one_rounding(got: torch.Tensor, exact: torch.Tensor, fp32_bound: torch.Tensor) -> None:
    """got is exact rounded to bf16 once from a float32 sum: within half a bf16 ulp of a value
    within fp32_bound of exact (2^-9 relative), and equal to exact's own rounding nearly always
    (a float32 sum landing on the other side of a rounding boundary is rare)."""
    assert ((got.double() - exact).abs() <= 2.0**-8 * exact.abs() + 2 * fp32_bound).all()
    assert (got == exact.bfloat16()).double().mean() >= 0.98


@pytest.mark.parametrize("shape", [(1, 1), (5, 17), (40, 64), (100, 77), (64, 1040), (1024, 512)])
def test_bf16_input_grad_blocks_are_each_blocks_product_rounded_once(shape):
    """out[start:stop] = g[start:stop]·w_e, bf16 in and out, into a slice of a wider tensor:
    rows outside the blocks and the margins untouched; one call for all blocks is the same
    as one call per block and as one thread."""
    _needs_bf16_blocks()
    O, I = shape
    torch.manual_seed(0)
    w = torch.randn(4, O, I).bfloat16()
    g = torch.randn(19, O).bfloat16()
    out = _bf16_input_grads_checked(g, w, _BF16_BLOCKS, unused_row=9)
    one_by_one = torch.empty_like(out)
    for block in _BF16_BLOCKS:
        assert _small_gemm.bf16_input_grad_blocks(one_by_one, g, w, [block])
    single = torch.empty_like(out)
    assert _on_one_thread(lambda: _small_gemm.bf16_input_grad_blocks(single, g, w, _BF16_BLOCKS))
    rows = torch.ones(19, dtype=torch.bool)
    rows[9] = False
    assert torch.equal(one_by_one[rows], out[rows]) and torch.equal(single[rows], out[rows])


@pytest.mark.parametrize("shape", [(2, 1), (6, 33), (258, 64), (300, 130), (1024, 77), (512, 1040)])
def test_bf16_input_grads_of_2_to_6_rows_read_w_in_place_with_the_packed_sums(shape):
    """Blocks of 2 to 6 rows take w's pairs straight from its rows (no packed panels): the same
    pair products in the same order, so each row's bits are the ones it gets within a block of
    13 rows on the packed panels. Strips of 64 columns and a part-full last one (I = 1, 33, 77,
    130, 1040), chunks of 256 of w's rows carried in float32 (O = 258, 300, 512, 1024), several
    blocks in one call (each prefetching into the next's rows)."""
    _needs_bf16_blocks()
    O, I = shape
    torch.manual_seed(O + I)
    w, g = torch.randn(3, O, I).bfloat16(), torch.randn(33, O).bfloat16()
    blocks = [(1, 0, 2), (0, 2, 5), (2, 5, 9), (1, 9, 14), (0, 15, 21)]
    out = _bf16_input_grads_checked(g, w, blocks, unused_row=14)
    for e, start, stop in blocks:
        packed = torch.empty(13, I, dtype=torch.bfloat16)
        rows = torch.cat([g[start:stop], g[21 : 21 + 13 - (stop - start)]])
        assert _small_gemm.bf16_input_grad_blocks(packed, rows, w, [(e, 0, 13)])
        assert torch.equal(out[start:stop].view(torch.int16), packed[: stop - start].view(torch.int16))


def test_bf16_input_grads_of_few_rows_sum_w_s_pairs_in_order():
    """Hand-made sums: g's rows all 1s but for row i's value i + 1 at O-index 302; w's column c
    holds 2^25 at its row 0, 1s at rows 2-9, -2^25 at row 300 (the second chunk of 256 rows)
    and c mod 8 at row 302. Summed pair after pair from row 0 (as the packed panels do), each
    1 is lost to 2^25 (2^25 + 1 rounds back to it), the two cancel and row i gets (i + 1)·(c
    mod 8); the exact sum is 8 more."""
    _needs_bf16_blocks()
    O, I = 512, 130
    w = torch.zeros(1, O, I)
    w[0, 0], w[0, 2:10], w[0, 300] = 2.0**25, 1.0, -(2.0**25)
    w[0, 302] = torch.arange(I) % 8
    for rows in range(2, 7):
        g = torch.ones(rows, O)
        g[:, 302] = torch.arange(1, rows + 1)
        out = torch.empty(rows, I, dtype=torch.bfloat16)
        assert _small_gemm.bf16_input_grad_blocks(out, g.bfloat16(), w.bfloat16(), [(0, 0, rows)])
        assert torch.equal(out.float(), g[:, 302:303] * w[0, 302])


@pytest.mark.parametrize("shape", [(1, 1), (5, 17), (7, 64), (13, 100), (29, 64), (97, 300), (1024, 512), (520, 1024)])
@pytest.mark.parametrize("own", [False, True])
def test_bf16_weight_grad_blocks_are_each_blocks_product_rounded_once(shape, own):
    """out[e] = a[start:stop]ᵀ·b[start:stop] written over old contents (NaN here), bf16 in and
    out; experts without a block untouched. own: a tensor of its own, whose (1024, 512) and
    (520, 1024) gradients are stored streaming; else a slice with odd strides (plain stores)."""
    _needs_bf16_blocks()
    M, N = shape
    torch.manual_seed(1)
    a, b = torch.randn(19, M).bfloat16(), torch.randn(19, N).bfloat16()
    whole = torch.full((5, M, N + (0 if own else 3)), float("nan"), dtype=torch.bfloat16)
    out = whole if own else whole[:, :, 1 : N + 1]
    assert _small_gemm.bf16_weight_grad_blocks(out, a, b, _BF16_BLOCKS, [False] * 4)
    for e, start, stop in _BF16_BLOCKS:
        exact = a[start:stop].double().t() @ b[start:stop].double()
        bound = _bound(a[start:stop].double().abs().t(), b[start:stop].double().abs(), stop - start)
        _bf16_within_one_rounding(out[e], exact, bound)
    assert whole[4].isnan().all()
    if not own:
        assert whole[:, :, 0].isnan().all() and whole[:, :, N + 1 :].isnan().all()


@pytest.mark.parametrize("shape", [(1, 1), (5, 31), (6, 32), (13, 100), (64, 1040), (40, 3584)])
def test_bf16_forward_blocks_are_each_blocks_product_rounded_once(shape):
    """linear_blocks on AVX512-BF16's dot products: y[start:stop] = x[start:stop]·w_eᵀ for blocks
    of 1 to BF16_FORWARD_MAX_ROWS rows (tiles of 4 rows by 6 and their tails; I not a multiple
    of 32: the masked last step), into a slice of a wider tensor, rows outside the blocks and
    the margins untouched; the same on one thread."""
    _needs_bf16_blocks()
    O, I = shape
    most = _small_gemm.BF16_FORWARD_MAX_ROWS
    blocks = [(1, 0, 3), (0, 3, 3 + most), (2, 4 + most, 5 + most), (1, 5 + most, 10 + most)]
    rows = 10 + most
    torch.manual_seed(2)
    w, x = torch.randn(3, O, I).bfloat16(), torch.randn(rows, I).bfloat16()
    wide = torch.full((rows, O + 7), float("nan"), dtype=torch.bfloat16)
    out = wide[:, 2 : O + 2]
    past = _small_gemm.bf16_forward_max_rows(3) + 1  # (most, or on the Zen 4 EPYC the pieces' limit)
    assert _small_gemm.bf16_forward_blocks_fit(blocks, 3) and not _small_gemm.bf16_forward_blocks_fit([(0, 0, past)], 3)
    assert _small_gemm.linear_blocks(x, w, blocks, out=out) is out
    for e, start, stop in blocks:
        exact = x[start:stop].double() @ w[e].double().t()
        bound = _bound(x[start:stop].double().abs(), w[e].double().abs().t(), I)
        _bf16_within_one_rounding(out[start:stop], exact, bound)
    assert wide[3 + most].isnan().all() and wide[:, :2].isnan().all() and wide[:, O + 2 :].isnan().all()
    single = _on_one_thread(lambda: _small_gemm.linear_blocks(x, w, blocks))
    used = torch.ones(rows, dtype=torch.bool)
    used[3 + most] = False
    assert torch.equal(single[used], out[used])


@pytest.mark.parametrize("shape", [(1, 1), (5, 31), (17, 64), (40, 100), (100, 1024), (1024, 3584)])
def test_bf16_forward_of_one_row_is_the_tiles_sum_bit_for_bit(shape):
    """A block of one row takes w's rows one after another (dot_one_row: 16 rows' sums reduced
    together, the last group short where O is not a multiple of 16): each row bit for bit what
    the tiles give it inside a block of two rows (the same sums, the same reduction), NaN and
    infinity included, and within one bf16 rounding of the float64 product."""
    _needs_bf16_blocks()
    O, I = shape
    torch.manual_seed(O * I)
    w, x = torch.randn(2, O, I).bfloat16(), torch.randn(2, I).bfloat16()
    if O > 3 and I > 3:
        w[1, 3, 1] = float("nan")
        w[1, O - 1, 0] = float("inf")
    alone = torch.cat([_small_gemm.linear_blocks(x[r : r + 1], w, [(1, 0, 1)]) for r in range(2)])
    paired = _small_gemm.linear_blocks(x, w, [(1, 0, 2)])
    assert torch.equal(alone.view(torch.int16), paired.view(torch.int16))
    if O > 3 and I > 3:
        assert alone[:, 3].isnan().all() and not alone[:, :3].isnan().any()
    exact = x.double() @ w[1].double().t()
    finite = exact.isfinite()
    bound = _bound(x.double().abs(), w[1].double().abs().t().nan_to_num(0.0, posinf=0.0), I)
    _bf16_within_one_rounding(alone[finite], exact[finite], bound[finite])


@pytest.mark.parametrize("shape", [(1, 2), (7, 50), (13, 100), (31, 40), (100, 78), (1040, 64), (40, 3584), (7, 33)])
def test_bf16_forward_of_larger_blocks_is_each_blocks_product_rounded_once(shape):
    """Blocks past 29 rows (an even I): outer products over packed groups of 16 rows, in
    register tiles of 3 groups and of 2 by 8 or 12 of w's rows and their tails, w's rows 48 at
    a time; blocks of 17 (the dot-product tiles, in tiles of 4 rows and a tail of 1), 33, 70,
    64, 100, 44, 43, 60 and 79 rows: 2 groups + a tail of 1 on the dot-product tiles, 3 + 22
    on them and 3 + 16 (4 groups and up to 8 go as 3 and the rest), 3 + 3 + 4 on them, 3
    (after 2 groups a tail of 12 is a group of its own), 2 + 11 on them, 3 + 12 on them (after
    3 groups any tail), 3 + 2 (after 4, a tail of 15);
    an odd I (7, 33): the dot-product tiles. Into a slice of a wider tensor, rows between
    blocks untouched."""
    _needs_bf16_blocks()
    O, I = shape
    blocks = [
        (1, 0, 17), (0, 17, 50), (2, 51, 121), (1, 121, 185), (0, 185, 285), (2, 285, 329), (1, 329, 372),
        (0, 372, 432), (2, 432, 511),
    ]
    torch.manual_seed(3)
    w, x = torch.randn(3, O, I).bfloat16(), torch.randn(511, I).bfloat16()
    wide = torch.full((511, O + 5), float("nan"), dtype=torch.bfloat16)
    out = wide[:, 1 : O + 1]
    assert _small_gemm.linear_blocks(x, w, blocks, out=out) is out
    for e, start, stop in blocks:
        exact = x[start:stop].double() @ w[e].double().t()
        bound = _bound(x[start:stop].double().abs(), w[e].double().abs().t(), I)
        _bf16_within_one_rounding(out[start:stop], exact, bound)
    assert wide[50].isnan().all() and wide[:, 0].isnan().all() and wide[:, O + 1 :].isnan().all()


@pytest.mark.parametrize("shape", [(7, 50), (100, 1024), (40, 3584), (24, 33)])
def test_bf16_forward_by_index_reads_the_tokens_rows(shape):
    """With `index` the blocks' rows are x[index[n]], read by the kernel as it packs them (the
    dot-product tiles' rows gathered first): blocks of 1 to BF16_FORWARD_MAX_ROWS rows (the dot
    tiles to 29, groups of 16 with a tail on the dot tiles at 33 and 41, 48 with none, 1024;
    an odd I: the dot tiles at every size), tokens repeated and out of order, into a slice of a
    wider tensor: each block within one rounding of float64's product of the tokens' rows, bit
    for bit what the blocks make from a gathered copy, rows outside the blocks untouched."""
    _needs_bf16_blocks()
    O, I = shape
    T, most = 50, _small_gemm.BF16_FORWARD_MAX_ROWS
    sizes = [1, 24, 33, 41, 48, most, 5]
    blocks, start = [], 0
    for e, n in enumerate(sizes):
        blocks.append((e % 3, start, start + n))
        start += n + (1 if e == 2 else 0)  # (a row after the third block no block has)
    torch.manual_seed(13)
    x, w = torch.randn(T, I).bfloat16(), torch.randn(3, O, I).bfloat16()
    index = torch.randint(0, T, (start,))
    wide = torch.full((start, O + 5), float("nan"), dtype=torch.bfloat16)
    out = wide[:, 2 : O + 2]
    assert _small_gemm.linear_blocks(x, w, blocks, out=out, index=index) is out
    gathered = _small_gemm.linear_blocks(x[index].contiguous(), w, blocks)
    for e, first, stop in blocks:
        rows = x[index[first:stop]].double()
        exact = rows @ w[e].double().t()
        _bf16_within_one_rounding(out[first:stop], exact, _bound(rows.abs(), w[e].double().abs().t(), I))
        assert torch.equal(out[first:stop].view(torch.int16), gathered[first:stop].view(torch.int16))
    unused = blocks[2][2]
    assert wide[unused].isnan().all() and wide[:, :2].isnan().all() and wide[:, O + 2 :].isnan().all()


@pytest.mark.parametrize("shape", [(64, 96), (100, 130), (512, 1024), (40, 1100)])
def test_bf16_many_small_blocks_taken_whole_by_the_threads_are_the_same_bits(shape):
    """With many blocks of few rows (_avx512.cpp's whole_blocks: at least 8 a thread, at most
    128 rows on average) the two threads take whole blocks each instead of a share of every
    block. Forward (gathered rows and rows by index) and input gradients, blocks of 1 to 60
    rows (the dot tiles, groups of 16 with and without a tail on the dot tiles, the direct and
    the packed input gradients; past 1024 columns the input gradients keep the shares), uneven
    and out of expert order: every block bit for bit what a call of its own makes (a share of
    it to each thread), and within one rounding of float64."""
    _needs_bf16_blocks()
    O, I = shape
    sizes = [1, 60, 7, 33, 2, 41, 24, 48, 5, 17, 3, 32, 6, 25, 9, 47, 1, 40]
    E = 5
    blocks, start = [], 0
    for i, n in enumerate(sizes):
        blocks.append(((7 * i) % E, start, start + n))
        start += n
    torch.manual_seed(21)
    x, w = torch.randn(start, I).bfloat16(), torch.randn(E, O, I).bfloat16()
    g, w_t = torch.randn(start, O).bfloat16(), torch.randn(E, O, I).bfloat16()
    index = torch.randperm(start)
    forward = _with_threads(2, lambda: _small_gemm.linear_blocks(x, w, blocks))
    by_index = _with_threads(2, lambda: _small_gemm.linear_blocks(x, w, blocks, index=index))
    grads = torch.empty(start, I, dtype=torch.bfloat16)
    assert _with_threads(2, lambda: _small_gemm.bf16_input_grad_blocks(grads, g, w_t, blocks))
    for e, first, stop in blocks:
        alone = _with_threads(2, lambda: _small_gemm.linear_blocks(x[first:stop], w, [(e, 0, stop - first)]))
        assert torch.equal(forward[first:stop].view(torch.int16), alone.view(torch.int16))
        rows = x[index[first:stop]].contiguous()
        alone = _with_threads(2, lambda: _small_gemm.linear_blocks(rows, w, [(e, 0, stop - first)]))
        assert torch.equal(by_index[first:stop].view(torch.int16), alone.view(torch.int16))
        alone = torch.empty(stop - first, I, dtype=torch.bfloat16)
        assert _with_threads(2, lambda: _small_gemm.bf16_input_grad_blocks(alone, g[first:stop], w_t, [(e, 0, stop - first)]))
        assert torch.equal(grads[first:stop].view(torch.int16), alone.view(torch.int16))
        exact = x[first:stop].double() @ w[e].double().t()
        _bf16_within_one_rounding(forward[first:stop], exact, _bound(x[first:stop].double().abs(), w[e].double().abs().t(), I))
        exact = g[first:stop].double() @ w_t[e].double()
        _bf16_within_one_rounding(grads[first:stop], exact, _bound(g[first:stop].double().abs(), w_t[e].double().abs(), O))


def test_bf16_forward_by_index_checks_the_indices():
    """An index of a block's rows outside x's rows is a ValueError naming the range, nothing
    written; an index past the blocks' rows is not read; an int32 index is declined (None) for
    the caller to gather."""
    _needs_bf16_blocks()
    x, w = torch.randn(10, 64).bfloat16(), torch.randn(2, 8, 64).bfloat16()
    out = torch.full((4, 8), 7.0, dtype=torch.bfloat16)
    for bad in (10, -1):
        with pytest.raises(ValueError, match=r"must lie in \[0, 10\), got"):
            _small_gemm.linear_blocks(x, w, [(1, 0, 4)], out=out, index=torch.tensor([0, 3, bad, 9]))
        assert bool((out == 7).all())
    y = _small_gemm.linear_blocks(x, w, [(1, 0, 3)], out=out, index=torch.tensor([9, 0, 4, 1000]))
    assert y is out and bool((out[3] == 7).all())
    exact = x[[9, 0, 4]].double() @ w[1].double().t()
    _bf16_within_one_rounding(out[:3], exact, _bound(x[[9, 0, 4]].double().abs(), w[1].double().abs().t(), 64))
    assert _small_gemm.linear_blocks(x, w, [(1, 0, 3)], index=torch.tensor([0, 1, 2], dtype=torch.int32)) is None


@pytest.mark.parametrize("depth", [_small_gemm.AVX512_FORWARD_DEPTH, _small_gemm.AVX512_FORWARD_DEPTH_AMD])
@pytest.mark.parametrize("shape", [(64, 96), (100, 1030), (24, 4200)])
def test_float32_forward_by_index_reads_the_tokens_rows(monkeypatch, shape, depth):
    """The AVX-512 float32 forward with `index` (linear_blocks, moe_ffn_avx512_linear_rows_f32):
    row n of the blocks is x[index[n]], each register tile's rows read where they lie. Blocks
    of 1, 3, 4, 7 and the most rows it takes here (FLOAT32_FORWARD_INDEX_MAX_ROWS), tokens
    repeated and out of order, I past a multiple of 16 and past a chunk: bit for bit what the
    gathered rows give, within float32's bound of float64's, rows no block has unwritten. A
    block past those rows is declined (None, nothing written); an index outside x's rows is a
    ValueError, nothing written."""
    most = min(_small_gemm.float32_blocks_max_rows(torch.ones(1, 1)), _small_gemm.FLOAT32_FORWARD_INDEX_MAX_ROWS)
    if most == 0:
        pytest.skip("the AVX-512 float32 forward kernel does not run here")
    monkeypatch.setattr(_small_gemm, "avx512_forward_depth", lambda: depth)
    O, I = shape
    T = 40
    blocks, start = [], 0
    for e, n in [(2, 1), (0, 3), (1, 4), (2, 7), (0, most)]:
        blocks.append((e, start, start + n))
        start += n + (1 if e == 1 else 0)  # (a row no block has)
    torch.manual_seed(29)
    x, w = torch.randn(T, I), torch.randn(3, O, I)
    index = torch.randint(0, T, (start,))
    out = torch.full((start, O), float("nan"))
    assert _small_gemm.linear_blocks(x, w, blocks, out=out, index=index) is out
    gathered = _small_gemm.linear_blocks(x[index].contiguous(), w, blocks)
    for e, first, stop in blocks:
        assert torch.equal(out[first:stop], gathered[first:stop])
        rows = x[index[first:stop]].double()
        bound = _bound(rows.abs(), w[e].double().abs().t(), I)
        assert ((out[first:stop].double() - rows @ w[e].double().t()).abs() <= bound).all()
    assert out[blocks[2][2]].isnan().all()
    fresh = torch.full((start + 1, O), 7.0)
    longer = blocks[:-1] + [(0, blocks[-1][1], blocks[-1][2] + 1)]
    assert _small_gemm.linear_blocks(x, w, longer, out=fresh, index=torch.zeros(start + 1, dtype=torch.int64)) is None
    bad = index.clone()
    bad[4] = T
    with pytest.raises(ValueError, match=rf"must lie in \[0, {T}\), got \d+ to {T}"):
        _small_gemm.linear_blocks(x, w, blocks, out=fresh[:start], index=bad)
    with pytest.raises(ValueError, match=r"linear_blocks: x \(40, \d+\) by index .* do not fit"):
        _small_gemm.linear_blocks(x[:, 1:], w, blocks, out=fresh[:start], index=index)
    assert bool((fresh == 7).all())


@pytest.mark.parametrize("rows", [5, 8, 13, 17, 24, 29, 30])
def test_bf16_forward_blocks_to_29_rows_sum_on_the_dot_product_tiles(rows):
    """Blocks of up to 29 rows take the dot-product tiles: each of the 16 lanes sums every 16th
    pair of I, then the lanes are added. Hand-made sums tell them from the outer products'
    single running sum (blocks past 29 rows): w's row holds 2^25 and -2^25 in lane 0's pairs 0
    and 16, eight 1s in lanes 1-4's first pairs and a 1 in lane 4's pair 20, where x holds the
    row's index r. The lanes get 0, 2, 2, 2, 2 + r: 8 + r. A running sum loses each 1 to 2^25
    (2^25 + 1 rounds back to it) and gets r: a block of 30 rows. Over strips of 6 of w's rows
    and a tail (O = 100), in tiles of 4 rows and a tail, the next strip's prefetches shared out
    among them; each row's bits as alone."""
    _needs_bf16_blocks()
    O, I = 100, 1024
    x, w = torch.zeros(rows, I), torch.zeros(2, O, I)
    x[:, :34] = 1.0
    x[:, 40] = torch.arange(rows, dtype=torch.float32)
    w[1, :, 0], w[1, :, 32], w[1, :, 2:10], w[1, :, 40] = 2.0**25, -(2.0**25), 1.0, 1.0
    x, w = x.bfloat16(), w.bfloat16()
    block = _small_gemm.linear_blocks(x, w, [(1, 0, rows)])
    expected = ((8.0 if rows <= 29 else 0.0) + torch.arange(rows, dtype=torch.float32))[:, None].expand(rows, O)
    assert torch.equal(block.float(), expected)
    if rows > 29:
        return
    torch.manual_seed(rows)
    w, x = torch.randn(2, O, I).bfloat16(), torch.randn(rows, I).bfloat16()
    block = _small_gemm.linear_blocks(x, w, [(1, 0, rows)])
    alone = _small_gemm.linear_blocks(x, w, [(1, r, r + 1) for r in range(rows)])
    assert torch.equal(block.view(torch.int16), alone.view(torch.int16))
    exact = x.double() @ w[1].double().t()
    _bf16_within_one_rounding(block, exact, _bound(x.double().abs(), w[1].double().abs().t(), I))


@pytest.mark.parametrize(
    "shape", [(2, 1), (14, 70), (100, 64), (256, 90), (258, 33), (1024, 512), (600, 1000), (600, 2200)]
)
def test_bf16_input_grad_of_larger_blocks_is_each_blocks_product_rounded_once(shape):
    """Blocks of 2 to BF16_INPUT_GRAD_MAX_ROWS rows on the packed-panel kernel (with a one-row
    block on the widening one in the same call): tiles of 6 rows and their tails, panels of 64
    columns and the last part-full one, the sum over O in chunks of 256 rows carried in float32
    (O = 258, 600, 1024) or in one (O ≤ 256), or of 128 rows (I = 2200: a thread's columns
    past 512 KiB a chunk, the 9-row block; its 37- and 87-row blocks 256); into a slice of a
    wider tensor, rows between blocks and the margins untouched; one thread gives the same."""
    _needs_bf16_blocks()
    O, I = shape
    blocks = [(1, 0, 9), (0, 9, 10), (2, 13, 50), (1, 50, 137)]
    torch.manual_seed(4)
    w, g = torch.randn(3, O, I).bfloat16(), torch.randn(137, O).bfloat16()
    out = _bf16_input_grads_checked(g, w, blocks, unused_row=12)
    single = torch.empty_like(out)
    assert _on_one_thread(lambda: _small_gemm.bf16_input_grad_blocks(single, g, w, blocks))
    used = torch.ones(137, dtype=torch.bool)
    used[10:13] = False
    assert torch.equal(single[used], out[used])


def test_pieces_cut_blocks_past_the_most_rows_evenly_in_order():
    """_pieces: each block of more than `most` rows becomes the fewest pieces of at most `most`
    rows of the same expert, sizes one apart at most, covering its rows in order; smaller
    blocks as they were."""
    blocks = [(3, 0, 5), (0, 5, 9), (1, 9, 20), (2, 30, 30 + 3 * 4 + 1)]
    assert _small_gemm._pieces(blocks, 4) == [
        (3, 0, 3), (3, 3, 5), (0, 5, 9), (1, 9, 13), (1, 13, 17), (1, 17, 20),
        (2, 30, 34), (2, 34, 37), (2, 37, 40), (2, 40, 43),
    ]
    assert _small_gemm._pieces(blocks, 13) == blocks
    for most in (1, 2, 7, 512):
        pieces = _small_gemm._pieces([(0, 0, 1537)], most)
        sizes = [stop - start for _, start, stop in pieces]
        assert len(pieces) == -(-1537 // most) and max(sizes) <= most and max(sizes) - min(sizes) <= 1
        assert pieces[0][1] == 0 and pieces[-1][2] == 1537 and all(a[2] == b[1] for a, b in zip(pieces, pieces[1:]))


def test_bf16_blocks_past_the_kernels_most_rows_run_in_pieces_on_zen4(monkeypatch):
    """On the Zen 4 EPYC (here made to say so) the forward (blocks up to
    BF16_FORWARD_SPLIT_MAX_ROWS_ZEN4 rows) and the input gradients through weights of at most
    1024 columns (up to BF16_SPLIT_MAX_ROWS_ZEN4) take blocks past their kernels' rows, cut into
    pieces of at most their kernels' rows: each block within one rounding of float64's product
    (all its rows written), bit for bit what the pieces make called one by one, by index as
    gathered; past that limit, and for the input gradients past 1024 columns, they decline."""
    _needs_bf16_blocks()
    monkeypatch.setattr(_small_gemm, "_zen4", lambda: True)
    big, fwd_big = _small_gemm.BF16_SPLIT_MAX_ROWS_ZEN4, _small_gemm.BF16_FORWARD_SPLIT_MAX_ROWS_ZEN4
    assert _small_gemm.bf16_forward_max_rows(3) == fwd_big
    fwd_most, grad_most = _small_gemm.BF16_FORWARD_MAX_ROWS, _small_gemm.BF16_INPUT_GRAD_MAX_ROWS
    O, I = 48, 96
    torch.manual_seed(21)
    w = torch.randn(3, O, I).bfloat16()
    sizes = [fwd_most + 37, 3, fwd_big]
    blocks, start = [], 0
    for e, n in zip((2, 0, 1), sizes):
        blocks.append((e, start, start + n))
        start += n
    x = torch.randn(start, I).bfloat16()
    out = torch.full((start, O), float("nan"), dtype=torch.bfloat16)
    assert _small_gemm.linear_blocks(x, w, blocks, out=out) is out
    index = torch.randperm(start)
    by_index = _small_gemm.linear_blocks(x, w, blocks, index=index)
    gathered = _small_gemm.linear_blocks(x[index].contiguous(), w, blocks)
    assert torch.equal(by_index.view(torch.int16), gathered.view(torch.int16))
    for e, first, stop in blocks:
        exact = x[first:stop].double() @ w[e].double().t()
        bound = _bound(x[first:stop].double().abs(), w[e].double().abs().t(), I)
        _bf16_within_one_rounding(out[first:stop], exact, bound)
        for _, a, b in _small_gemm._pieces([(e, first, stop)], fwd_most):
            alone = _small_gemm.linear_blocks(x[a:b], w[e : e + 1], [(0, 0, b - a)])
            assert torch.equal(out[a:b].view(torch.int16), alone.view(torch.int16))
    assert not _small_gemm.bf16_forward_blocks_fit([(0, 0, fwd_big + 1)], 3)
    # one expert (a dense block): the kernels' own rows, past them torch's GEMM as nn.Linear's
    assert _small_gemm.bf16_forward_max_rows(1) == fwd_most
    assert _small_gemm.linear_blocks(x[: fwd_most + 1], w[:1], [(0, 0, fwd_most + 1)]) is None
    assert _small_gemm.bf16_input_grad_max_rows(torch.empty(1, 64, 96, dtype=torch.bfloat16)) == grad_most
    # input gradients g·w_e through w [3, 64, 96] (96 columns)
    wg = torch.randn(3, 64, 96).bfloat16()
    grad_blocks = [(0, 0, grad_most + 1), (2, grad_most + 1, grad_most + 1 + big)]
    rows = grad_blocks[-1][2]
    g = torch.randn(rows, 64).bfloat16()
    got = _bf16_input_grads_checked(torch.cat((g, g[:1])), wg, grad_blocks, unused_row=rows)
    for e, first, stop in grad_blocks:
        for _, a, b in _small_gemm._pieces([(e, first, stop)], grad_most):
            alone = torch.empty(b - a, 96, dtype=torch.bfloat16)
            assert _small_gemm.bf16_input_grad_blocks(alone, g[a:b], wg[e : e + 1], [(0, 0, b - a)])
            assert torch.equal(got[a:b].view(torch.int16), alone.view(torch.int16))
    wide = torch.randn(1, 64, 1040).bfloat16()  # past 1024 columns: the kernel's most rows only
    past = grad_most + 1
    assert not _small_gemm.bf16_input_grad_blocks(torch.empty(past, 1040, dtype=torch.bfloat16), g[:past], wide, [(0, 0, past)])
    past = big + 1
    assert not _small_gemm.bf16_input_grad_blocks(torch.empty(past, 96, dtype=torch.bfloat16), g[:past], wg, [(0, 0, past)])


def test_bf16_blocks_kernels_round_ties_to_even_and_pass_nan():
    """Sums exactly halfway between two bf16 values: 1 + 2^-8 rounds down to 1 (even), (1 +
    2^-7) + 2^-8 up to 1 + 2^-6 (even), as torch rounds; inf - inf (x86's NaN, 0xFFC00000)
    gives torch's bf16 NaN, 0x7FC0."""
    _needs_bf16_blocks()
    h = 2.0**-8
    want = torch.tensor([[1.0, 1 + 4 * h, float("nan")]], dtype=torch.bfloat16)
    ones = torch.ones(1, 2, dtype=torch.bfloat16)
    w = torch.tensor([[[1.0, h], [1 + 2 * h, h], [float("inf"), -float("inf")]]], dtype=torch.bfloat16)  # [1, 3, 2]
    same_bits = lambda got: torch.equal(got.view(torch.int16), want.view(torch.int16))  # noqa: E731 (NaN: 0x7FC0)
    assert same_bits(_small_gemm.linear_blocks(ones, w, [(0, 0, 1)]))
    w_t = w.transpose(1, 2).contiguous()  # [1, 2, 3]: g·W sums over its 2 rows
    out = torch.empty(1, 3, dtype=torch.bfloat16)
    assert _small_gemm.bf16_input_grad_blocks(out, ones, w_t, [(0, 0, 1)])  # (the widening kernel)
    assert same_bits(out)
    out2 = torch.empty(2, 3, dtype=torch.bfloat16)
    assert _small_gemm.bf16_input_grad_blocks(out2, ones.expand(2, 2).contiguous(), w_t, [(0, 0, 2)])  # (packed panels)
    assert same_bits(out2[:1]) and same_bits(out2[1:])
    grads = torch.empty(1, 1, 3, dtype=torch.bfloat16)
    assert _small_gemm.bf16_weight_grad_blocks(grads, torch.ones(2, 1, dtype=torch.bfloat16), w_t[0], [(0, 0, 2)], [False])
    assert same_bits(grads[0])


@pytest.mark.parametrize("shape", [(1, 1), (5, 17), (7, 64), (13, 100), (29, 64), (97, 300), (1024, 512), (520, 1024)])
@pytest.mark.parametrize("own", [False, True])
def test_bf16_weight_grad_of_larger_blocks_is_each_blocks_product_rounded_once(monkeypatch, shape, own):
    """Blocks of BF16_WEIGHT_GRAD_PACKED_FROM_ROWS to BF16_WEIGHT_GRAD_MAX_ROWS_ZEN4 rows (the
    most it takes on any CPU; Zen 4 forced) on the packed-pairs kernel (odd row counts: the last
    row paired with zeros; both ends of its rows), with one- and three-row blocks on the
    widening kernel in the same call: tiles of 6 rows of the result and their tails, panels of
    64 columns and the last part-full one; written over old contents (NaN), streaming (own, the
    two largest) or into a slice with odd strides; experts without a block untouched; one
    thread gives the same."""
    _needs_bf16_blocks()
    monkeypatch.setattr(_small_gemm, "_vendor_is_amd", lambda: True)
    monkeypatch.setattr(_small_gemm, "_cpu_family", lambda: 25)
    M, N = shape
    most, least = _small_gemm.BF16_WEIGHT_GRAD_MAX_ROWS_ZEN4, _small_gemm.BF16_WEIGHT_GRAD_PACKED_FROM_ROWS
    assert _small_gemm.bf16_weight_grad_max_rows() == most
    end = 50 + most  # (block 3 the most rows, block 5 the fewest of the packed kernel)
    blocks = [(1, 0, 9), (0, 9, 10), (2, 13, 50), (3, 50, end), (5, end, end + least)]
    blocks.append((6, end + least, end + least + 3))
    torch.manual_seed(5)
    a, b = torch.randn(end + least + 3, M).bfloat16(), torch.randn(end + least + 3, N).bfloat16()
    whole = torch.full((8, M, N + (0 if own else 3)), float("nan"), dtype=torch.bfloat16)
    out = whole if own else whole[:, :, 1 : N + 1]
    assert _small_gemm.bf16_weight_grad_blocks(out, a, b, blocks, [False] * len(blocks))
    for e, start, stop in blocks:
        exact = a[start:stop].double().t() @ b[start:stop].double()
        bound = _bound(a[start:stop].double().abs().t(), b[start:stop].double().abs(), stop - start)
        _bf16_within_one_rounding(out[e], exact, bound)
    assert whole[4].isnan().all() and whole[7].isnan().all()
    if not own:
        assert whole[:, :, 0].isnan().all() and whole[:, :, N + 1 :].isnan().all()
    single = torch.full_like(out, float("nan"))
    assert _on_one_thread(lambda: _small_gemm.bf16_weight_grad_blocks(single, a, b, blocks, [False] * len(blocks)))
    experts = [e for e, _, _ in blocks]
    assert torch.equal(single[experts], out[experts])


@pytest.mark.parametrize("shape", [(96, 1024), (1024, 512), (40, 33)])
def test_bf16_weight_grad_by_index_reads_the_tokens_rows(monkeypatch, shape):
    """With `b_index` the blocks' b rows are b[b_index[n]], gathered as the packed kernel packs
    them: blocks of 4 (the fewest it takes), 5, 32, 257 and BF16_WEIGHT_GRAD_MAX_ROWS_ZEN4 rows
    (Zen 4 forced), tokens repeated and out of order: each within one rounding of float64's
    product, bit for bit what the gathered rows give, experts without a block untouched.
    Declined (False, nothing written) where a block has fewer rows or adds to its expert's
    gradient; an index outside b's rows is a ValueError, nothing written."""
    _needs_bf16_blocks()
    monkeypatch.setattr(_small_gemm, "_vendor_is_amd", lambda: True)
    monkeypatch.setattr(_small_gemm, "_cpu_family", lambda: 25)
    M, N = shape
    T, most = 60, _small_gemm.BF16_WEIGHT_GRAD_MAX_ROWS_ZEN4
    blocks, start = [], 0
    for e, n in [(1, 4), (0, 5), (3, 32), (5, 257), (2, most)]:
        blocks.append((e, start, start + n))
        start += n
    torch.manual_seed(17)
    a, b = torch.randn(start, M).bfloat16(), torch.randn(T, N).bfloat16()
    index = torch.randint(0, T, (start,))
    out = torch.full((6, M, N), float("nan"), dtype=torch.bfloat16)
    assert _small_gemm.bf16_weight_grad_blocks(out, a, b, blocks, [False] * len(blocks), b_index=index)
    gathered = torch.full_like(out, float("nan"))
    assert _small_gemm.bf16_weight_grad_blocks(gathered, a, b[index].contiguous(), blocks, [False] * len(blocks))
    for e, first, stop in blocks:
        rows = b[index[first:stop]].double()
        exact = a[first:stop].double().t() @ rows
        _bf16_within_one_rounding(out[e], exact, _bound(a[first:stop].double().abs().t(), rows.abs(), stop - first))
        assert torch.equal(out[e].view(torch.int16), gathered[e].view(torch.int16))
    assert out[4].isnan().all()
    fresh = torch.full_like(out, 7.0)
    for few, adds in (([(0, 0, 3)], [False]), (blocks[:2], [False, True])):
        assert not _small_gemm.bf16_weight_grad_blocks(fresh, a, b, few, adds, b_index=index)
    bad = index.clone()
    bad[5] = T
    with pytest.raises(ValueError, match=rf"must lie in \[0, {T}\), got \d+ to {T}"):
        _small_gemm.bf16_weight_grad_blocks(fresh, a, b, blocks[:2], [False, False], b_index=bad)
    assert bool((fresh == 7).all())


def _blocks_in_turn(experts_rows: list[tuple[int, int]]) -> tuple[list[tuple[int, int, int]], int]:
    """(blocks, rows): blocks (e, start, stop) of the (expert, rows) pairs one after another."""
    blocks, start = [], 0
    for e, n in experts_rows:
        blocks.append((e, start, start + n))
        start += n
    return blocks, start


def _blocks_one_adding() -> tuple[list[tuple[int, int, int]], int, list[bool]]:
    """(blocks, rows, adds): blocks of 3 (under the panels' 16 steps), 16, 129 and 300 rows, the
    last adding to its expert's (1) first block."""
    blocks, start = _blocks_in_turn([(1, 3), (0, 16), (3, 129), (1, 300)])
    return blocks, start, [False, False, False, True]


@pytest.mark.parametrize("shape", [(96, 1024), (1024, 512), (40, 200), (30, 33)])
def test_float32_weight_grad_by_index_reads_the_tokens_rows(monkeypatch, shape):
    """float32 weight gradients with `b_index` (AMD's AVX-512 CPUs, forced here): the blocks' b
    rows are b[b_index[n]], gathered as the panels are packed. Blocks of 3 (under the panels'
    16 steps), 16, 129 and 300 rows, one adding to its expert's first piece, tokens repeated and
    out of order; n = 200 has columns past the last panel of 64, n = 33 no whole panel: bit for
    bit what the gathered rows give, within float32's bound of float64's sums, experts without
    a block untouched. Declined (all False, nothing written) where a block has more than
    SGEMM_AVX2_WEIGHT_GRAD_ROWS rows; an index outside b's rows is a ValueError, nothing
    written."""
    _needs_avx512_kernel()
    monkeypatch.setattr(_small_gemm, "sgemm_at_avx2_width", lambda: True)
    M, N = shape
    T = 50
    blocks, start, again = _blocks_one_adding()
    torch.manual_seed(19)
    a, b = torch.randn(start, M), torch.randn(T, N)
    index = torch.randint(0, T, (start,))
    out = torch.full((5, M, N), float("nan"))
    out[1] = 0.0  # (expert 1's second block adds to its first)
    gathered = out.clone()
    assert _small_gemm.float32_weight_grad_blocks(out, a, b, blocks, again, b_index=index) == [True] * 4
    assert _small_gemm.float32_weight_grad_blocks(gathered, a, b[index].contiguous(), blocks, again) == [True] * 4
    assert torch.equal(out[[0, 1, 3]], gathered[[0, 1, 3]])
    for e in (0, 1, 3):
        pieces = [(first, stop) for x, first, stop in blocks if x == e]
        exact = sum(a[f:t].double().t() @ b[index[f:t]].double() for f, t in pieces)
        bound = sum(_bound(a[f:t].double().abs().t(), b[index[f:t]].double().abs(), t - f) for f, t in pieces)
        assert ((out[e].double() - exact).abs() <= 2 * bound).all(), e
    assert out[2].isnan().all() and out[4].isnan().all()
    fresh = torch.full_like(out, 7.0)
    monkeypatch.setattr(_small_gemm, "SGEMM_AVX2_WEIGHT_GRAD_ROWS", (1, 128))
    assert _small_gemm.float32_weight_grad_blocks(fresh, a, b, blocks, again, b_index=index) == [False] * 4
    monkeypatch.undo()
    monkeypatch.setattr(_small_gemm, "sgemm_at_avx2_width", lambda: True)
    bad = index.clone()
    bad[5] = T
    with pytest.raises(ValueError, match=rf"must lie in \[0, {T}\), got \d+ to {T}"):
        _small_gemm.float32_weight_grad_blocks(fresh, a, b, blocks[:2], [False, False], b_index=bad)
    assert bool((fresh == 7).all())


@pytest.mark.parametrize("shape", [(48, 256), (1024, 512), (40, 200), (30, 33)])
@pytest.mark.parametrize("scaled", [True, False])
def test_float32_weight_grad_reads_a_by_index_weighted(monkeypatch, shape, scaled):
    """float32 weight gradients with `a_index` (and `a_scale`): the blocks' a rows are
    a[a_index[n]] (times a_scale[n]), read as a's columns are transposed (the panels) or by the
    per-row loop (3 rows; n = 33; the columns past the last panel of 64): bit for bit the
    gathered rows multiplied by torch (a[a_index] * a_scale[:, None]) give, an adding block
    included, within float32's bound of float64's; an index outside a's rows is a ValueError,
    nothing written."""
    _needs_avx512_kernel()
    monkeypatch.setattr(_small_gemm, "sgemm_at_avx2_width", lambda: True)
    M, N = shape
    T = 50
    blocks, start, again = _blocks_one_adding()
    torch.manual_seed(31 + scaled)
    a, b = torch.randn(T, M), torch.randn(start, N)
    index = torch.randint(0, T, (start,))
    scale = torch.rand(start) if scaled else None
    out = torch.full((5, M, N), float("nan"))
    out[1] = 0.0  # (expert 1's second block adds to its first)
    gathered = out.clone()
    rows = a[index] * scale[:, None] if scaled else a[index]
    assert _small_gemm.float32_weight_grad_blocks(out, a, b, blocks, again, a_index=index, a_scale=scale) == [True] * 4
    assert _small_gemm.float32_weight_grad_blocks(gathered, rows.contiguous(), b, blocks, again) == [True] * 4
    assert torch.equal(out[[0, 1, 3]], gathered[[0, 1, 3]])
    for e in (0, 1, 3):
        pieces = [(first, stop) for x, first, stop in blocks if x == e]
        exact = sum(rows[f:t].double().t() @ b[f:t].double() for f, t in pieces)
        bound = sum(_bound(rows[f:t].double().abs().t(), b[f:t].double().abs(), t - f) for f, t in pieces)
        assert ((out[e].double() - exact).abs() <= 2 * bound).all(), e
    assert out[2].isnan().all() and out[4].isnan().all()
    fresh = torch.full_like(out, 7.0)
    bad = index.clone()
    bad[20] = -1
    with pytest.raises(ValueError, match=rf"must lie in \[0, {T}\), got -1 to \d+"):
        _small_gemm.float32_weight_grad_blocks(fresh, a, b, blocks, again, a_index=bad, a_scale=scale)
    assert bool((fresh == 7).all())


@pytest.mark.parametrize("shape", [(64, 128), (1024, 512), (72, 200)])
def test_float32_input_grad_reads_g_by_index(monkeypatch, shape):
    """float32 input gradients with `a_index` (AMD's AVX-512 CPUs, forced here): the blocks' g
    rows are g[a_index[n]], copied by index into the chunks' contiguous rows (blocks of 1, 3,
    6, 7, 100 and 300 rows: one row in place, the few-row tiles on a copy too), bit for bit
    what the gathered rows give, within float32's bound of float64's; an index outside g's rows
    is a ValueError, nothing written."""
    _needs_avx512_kernel()
    monkeypatch.setattr(_small_gemm, "sgemm_at_avx2_width", lambda: True)
    O, I = shape
    T, E = 60, 4
    blocks, start = [], 0
    for e, n in [(2, 1), (0, 3), (1, 6), (3, 7), (0, 100), (2, 300)]:
        blocks.append((e, start, start + n))
        start += n
    torch.manual_seed(37)
    g, w = torch.randn(T, O), torch.randn(E, O, I)
    index = torch.randint(0, T, (start,))
    out = torch.full((start, I), float("nan"))
    assert _small_gemm.float32_input_grad_blocks(out, g, w, blocks, a_index=index)
    gathered = torch.full_like(out, float("nan"))
    assert _small_gemm.float32_input_grad_blocks(gathered, g[index].contiguous(), w, blocks)
    assert torch.equal(out, gathered)
    for e, first, stop in blocks:
        rows = g[index[first:stop]].double()
        bound = _bound(rows.abs(), w[e].double().abs(), O)
        assert ((out[first:stop].double() - rows @ w[e].double()).abs() <= bound).all()
    fresh = torch.full_like(out, 7.0)
    bad = index.clone()
    bad[-1] = T
    with pytest.raises(ValueError, match=rf"must lie in \[0, {T}\), got \d+ to {T}"):
        _small_gemm.float32_input_grad_blocks(fresh, g, w, blocks, a_index=bad)
    with pytest.raises(ValueError, match=r"float32_input_grad_blocks: g \(60, \d+\) by index .* do not fit"):
        _small_gemm.float32_input_grad_blocks(fresh, g[:, 1:], w, blocks, a_index=index)
    assert bool((fresh == 7).all())


@pytest.mark.parametrize("amd, family", [(True, 25), (True, 26), (False, 6)])
def test_bf16_weight_grad_row_range_by_cpu(monkeypatch, amd, family):
    """On Zen 4 (AMD's family 25, forced here) the bf16 weight-gradient kernel takes blocks of up
    to BF16_WEIGHT_GRAD_MAX_ROWS_ZEN4 rows, elsewhere up to BF16_WEIGHT_GRAD_MAX_ROWS; a block
    one row past declines the call (the output untouched), and the layer's backward leaves
    just that block to torch."""
    _needs_bf16_blocks()
    monkeypatch.setattr(_small_gemm, "_vendor_is_amd", lambda: amd)
    monkeypatch.setattr(_small_gemm, "_cpu_family", lambda: family)
    most = {(True, 25): 1536, (True, 26): 320, (False, 6): 320}[amd, family]
    assert _small_gemm.bf16_weight_grad_max_rows() == most
    torch.manual_seed(2)
    a, b = torch.randn(most + 1, 12).bfloat16(), torch.randn(most + 1, 70).bfloat16()
    for rows, taken in ((most, True), (most + 1, False)):
        out = torch.full((2, 12, 70), 7.0, dtype=torch.bfloat16)
        assert _small_gemm.bf16_weight_grad_blocks(out, a[:rows], b[:rows], [(1, 0, rows)], [False]) == taken
        assert bool((out == 7).all()) != taken
        if taken:
            exact = a[:rows].double().t() @ b[:rows].double()
            _bf16_within_one_rounding(out[1], exact, _bound(a[:rows].double().abs().t(), b[:rows].double().abs(), rows))
    out = torch.full((2, 12, 70), 7.0, dtype=torch.bfloat16)
    assert grouped._weight_grad_blocks(out, a, b, [(0, 0, 5), (1, 5, most + 1)], [False, False]) == [True, True]
    out = torch.full((2, 12, 70), 7.0, dtype=torch.bfloat16)
    c = torch.cat([a, a[:5]]), torch.cat([b, b[:5]])
    assert grouped._weight_grad_blocks(out, *c, [(0, 0, 5), (1, 5, most + 6)], [False, False]) == [True, False]
    assert bool((out[1] == 7).all())  # (the block past the most rows: left to the caller)


@pytest.mark.parametrize("N", [128, 1 << 16])
@pytest.mark.parametrize("K", [2, 4])
def test_bf16_weight_grad_rounds_whole_panels_as_torch_does(N, K):
    """The weight gradients' whole panels (64 columns: one rounding instruction for 32 sums;
    K = 2 rows: the few-rows kernel on float32 products, K = 4: the packed one) round as
    torch's bf16 does, bit for bit: ties to even both ways, inf − inf to 0x7FC0 (the
    instruction alone would keep x86's NaN 0xFFC0), a NaN among ordinary sums not spilling onto
    them, and (float32 products only: vdpbf16ps flushes them) a subnormal sum kept as torch
    keeps it, where the instruction would flush it; the rest within one rounding of float64.
    N = 2^16: 8 × N elements, streamed."""
    _needs_bf16_blocks()
    M, h = 8, 2.0**-8
    torch.manual_seed(11)
    a = torch.ones(K, M, dtype=torch.bfloat16)
    b = torch.randn(K, N).bfloat16()
    special = {  # column: b's first rows (the others zero; a's rows are ones: c[:, col] is their sum)
        0: [float("inf"), -float("inf")], 1: [1, h], 2: [1 + 2 * h, h], 40: [-1, -h], 63: [-(1 + 2 * h), -h],
        64 + 17: [float("inf"), 0, -float("inf")] if K > 2 else [-float("inf"), float("inf")],
    }
    tiny = 2.0**-130  # a bf16 (and float32) subnormal
    if K == 2:
        special[64 + 40] = [tiny, 0]  # (its 32 columns hold no NaN: the instruction would take them)
    for col, rows in special.items():
        b[:, col] = torch.tensor(rows + [0] * (K - len(rows)), dtype=torch.bfloat16)
    want = {0: 0x7FC0, 1: 0x3F80, 2: 0x3F82, 40: 0xBF80 - 0x10000, 63: 0xBF82 - 0x10000, 64 + 17: 0x7FC0}
    if K == 2:
        want[64 + 40] = int(torch.tensor([tiny]).bfloat16().view(torch.int16))
        assert want[64 + 40] != 0
    out = torch.full((2, M, N), 7.0, dtype=torch.bfloat16)
    assert _small_gemm.bf16_weight_grad_blocks(out, a, b, [(1, 0, K)], [False])
    bits = out[1].view(torch.int16)
    for col, value in want.items():
        assert (bits[:, col] == value).all(), (col, bits[:, col])
    ordinary = [c for c in range(N) if c not in special]
    exact = (a.double().t() @ b.double())[:, ordinary]
    bound = _bound(a.double().t().abs(), b.double().abs(), K)[:, ordinary]
    _bf16_within_one_rounding(out[1][:, ordinary], exact, bound)
    assert bool((out[0] == 7).all())


def _needs_one_row_gradients(dtype: torch.dtype):
    if dtype == torch.bfloat16:
        _needs_bf16_blocks()
    elif _small_gemm._float32_blocks_entry_points() is None or not _small_gemm.sgemm_at_avx2_width() or (
        _small_gemm._one_row_gradients_f32_entry_point() is None
    ):
        pytest.skip("the float32 one-row pass runs where the float32 blocks kernels take every block (AMD's AVX-512 CPUs) with AVX512-BF16")


def _by_the_two_calls(outs, g, a, b, w, blocks):
    """y = g·w_e and grad_e = aᵀ·b by the input and the weight gradients' blocks calls of w's
    dtype, into outs = (y, grad)."""
    y, grad = outs
    if w.dtype == torch.bfloat16:
        assert _small_gemm.bf16_input_grad_blocks(y, g, w, blocks)
        assert _small_gemm.bf16_weight_grad_blocks(grad, a, b, blocks, [False] * len(blocks))
    else:
        assert _small_gemm.float32_input_grad_blocks(y, g, w, blocks)
        assert all(_small_gemm.float32_weight_grad_blocks(grad, a, b, blocks, [False] * len(blocks)))
    return y, grad


@pytest.mark.parametrize("shape", [(2, 1), (6, 33), (258, 64), (300, 130), (64, 1040), (512, 3584), (130, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_few_row_gradients_are_the_two_calls_bit_for_bit(shape, dtype):
    """few_row_gradients (blocks of 2 to 6 rows in bf16, 2 to 4 in float32, each of w's rows
    read once for both gradients): y[start:stop] = g·w_e within the float64 bound (bf16: and one
    bf16 rounding), grad_e = gᵀ·b likewise, and both bit for bit what the input and weight
    gradients' blocks calls of that dtype write for these blocks (bf16: the weight gradient's
    widening kernel below 4 rows, its packed pairs from 4), NaNs included (one in g, one in w),
    on one thread too. Strips of 64 columns and a part-full last one, chunks of 256 (bf16) or
    128 (float32) of w's rows, a streamed gradient ((512, 3584)) and not; rows of y outside the
    blocks and the expert without a block untouched. float32 with fewer than 64 columns a
    thread: declined, nothing written."""
    _needs_one_row_gradients(dtype)
    O, I = shape
    torch.manual_seed(O + I)
    E, rows = 6, 24
    w = torch.randn(E, O, I).to(dtype)
    g, b = torch.randn(rows, O).to(dtype), torch.randn(rows, I).to(dtype)
    if dtype == torch.bfloat16:
        blocks = [(3, 0, 2), (0, 2, 5), (1, 6, 10), (4, 10, 15), (2, 15, 21)]
    else:
        blocks = [(3, 0, 2), (0, 2, 5), (1, 6, 10), (4, 10, 12), (2, 17, 21)]
    if O > 3 and I > 3:
        g[3, 3] = float("nan")  # (row 3 of expert 0's gradient, and y's row 3, all NaN)
        w[1, O - 1, 2] = float("nan")  # (column 2 of y's rows 6-9 NaN)
    fresh = lambda: (torch.full((rows, I), 7.0).to(dtype), torch.full((E, O, I), 7.0).to(dtype))  # noqa: E731
    got_y, got_w = fresh()
    if dtype == torch.float32 and I < 64 * torch.get_num_threads():
        assert not _small_gemm.few_row_gradients(got_y, got_w, g, b, w, blocks)
        assert bool((got_y == 7).all()) and bool((got_w == 7).all())
        return
    assert _small_gemm.few_row_gradients(got_y, got_w, g, b, w, blocks)
    for e, start, stop in blocks:
        gs, bs = g[start:stop].double(), b[start:stop].double()
        for got, exact, bound in (
            (got_y[start:stop], gs.nan_to_num(0.0) @ w[e].double().nan_to_num(0.0),
             _bound(gs.abs().nan_to_num(0.0), w[e].double().abs().nan_to_num(0.0), O)),
            (got_w[e], gs.t().nan_to_num(0.0) @ bs, _bound(gs.t().abs().nan_to_num(0.0), bs.abs(), stop - start)),
        ):
            ok = ~got.isnan()
            if dtype == torch.bfloat16:
                _bf16_within_one_rounding(got[ok], exact[ok], bound[ok])
            else:
                assert ((got[ok].double() - exact[ok]).abs() <= bound[ok]).all()
    if O > 3 and I > 3:
        assert bool(got_w[0][3].isnan().all()) and bool(got_y[3].isnan().all()) and bool(got_y[6:10, 2].isnan().all())
    assert bool((got_y[[5, 21, 22, 23]] == 7).all()) and bool((got_w[5] == 7).all())
    two_y, two_w = _by_the_two_calls(fresh(), g, g, b, w, blocks)
    bits = (lambda t: t.view(torch.int16)) if dtype == torch.bfloat16 else (lambda t: t.view(torch.int32))  # noqa: E731
    assert torch.equal(bits(got_y), bits(two_y)) and torch.equal(bits(got_w), bits(two_w))
    one_y, one_w = fresh()
    assert _on_one_thread(lambda: _small_gemm.few_row_gradients(one_y, one_w, g, b, w, blocks))
    assert torch.equal(bits(one_y), bits(got_y)) and torch.equal(bits(one_w), bits(got_w))


def test_few_row_gradients_decline_what_they_do_not_take():
    """Blocks of 1 or 7 rows (float32: 5), an odd O (bf16), float64 tensors: False, nothing
    written; shapes that do not fit: a clear error."""
    _needs_bf16_blocks()
    w, g, b = torch.randn(2, 16, 128).bfloat16(), torch.randn(8, 16).bfloat16(), torch.randn(8, 128).bfloat16()
    y, grad = torch.full((8, 128), 7.0).bfloat16(), torch.full((2, 16, 128), 7.0).bfloat16()
    assert not _small_gemm.few_row_gradients(y, grad, g, b, w, [(0, 0, 1)])
    assert not _small_gemm.few_row_gradients(y, grad, g, b, w, [(0, 0, 2), (1, 1, 8)])
    assert not _small_gemm.few_row_gradients(y, grad[:, :15], g[:, :15], b, w[:, :15], [(0, 0, 2)])
    assert not _small_gemm.few_row_gradients(y.float(), grad.float(), g.float(), b.float(), w.float(), [(0, 0, 5)])
    assert not _small_gemm.few_row_gradients(y.double(), grad.double(), g.double(), b.double(), w.double(), [(0, 0, 2)])
    assert bool((y == 7).all()) and bool((grad == 7).all())
    with pytest.raises(ValueError, match="few_row_gradients: .* do not fit"):
        _small_gemm.few_row_gradients(y, grad, g[:, :14], b, w, [(0, 0, 2)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_layer_backward_takes_few_row_gradients_with_the_same_bits(monkeypatch, dtype):
    """A MoE layer's backward on a few tokens (blocks of 2 to 6 rows) writes w1's two gradients
    in one pass, and w2's (da, and the weighted rows' gradient through a made first):
    few_row_gradients called and taking blocks, every gradient bit for bit what the two calls
    give with it switched off."""
    _needs_one_row_gradients(dtype)
    # (the loop's calls: the bf16 one-call backward, which makes them in one, is tested below)
    monkeypatch.setattr(_small_gemm, "avx512_routed_swiglu_backward_blocks", lambda *a: False)
    torch.manual_seed(5)
    layer = MoE(dim=128, hidden_dim=128, num_experts=4, top_k=2).to(dtype)
    x, g = torch.randn(9, 128).to(dtype), torch.randn(9, 128).to(dtype)

    def grads():
        layer.zero_grad(set_to_none=True)
        x_ = x.clone().requires_grad_(True)
        layer(x_).backward(g)
        return [x_.grad] + [p.grad for p in layer.parameters()]

    taken = []
    real = _small_gemm.few_row_gradients
    monkeypatch.setattr(_small_gemm, "few_row_gradients", lambda *a, **k: taken.append(real(*a, **k)) or taken[-1])
    fused = grads()
    assert taken.count(True) == 2  # (both projections' pairs)
    monkeypatch.setattr(_small_gemm, "few_row_gradients", lambda *a, **k: False)
    apart = grads()
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert all(torch.equal(a.view(bits), b.view(bits)) for a, b in zip(fused, apart))


@pytest.mark.parametrize("shape", [(1, 1), (5, 70), (300, 200), (64, 1000), (40, 1024), (512, 3584)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_one_row_gradients_are_the_two_calls_bit_for_bit(shape, dtype):
    """one_row_gradients (each of w's rows read once for both gradients of one-row blocks):
    y[r] = g[r]·w_e within the float64 bound (bf16: and one bf16 rounding), and grad_e[o, i] the
    float32 product a[r, o]·b[r, i] (bf16: rounded to bf16 by torch); both bit for bit what the
    input and weight gradients' blocks calls of that dtype write for these blocks, NaNs
    included (one in a and one in w), on one thread too. Shapes: whole panels of 256 columns,
    the columns past them (a 64-column tile, fewer than 64), streamed gradients ((40, 1024),
    (512, 3584); float32 also (300, 200)) and not; rows of y outside the blocks and experts
    without one untouched. float32 with fewer than 64 columns a thread: declined, as the
    input gradients' call declines them, nothing written."""
    _needs_one_row_gradients(dtype)
    O, I = shape
    torch.manual_seed(O + I)
    E, rows = 4, 6
    w = torch.randn(E, O, I).to(dtype)
    g, a, b = torch.randn(rows, O).to(dtype), torch.randn(rows, O).to(dtype), torch.randn(rows, I).to(dtype)
    blocks = [(3, 0, 1), (0, 2, 3), (1, 5, 6)]
    if O > 3 and I > 3:
        a[2, 3] = float("nan")  # (row 3 of expert 0's gradient all NaN)
        w[1, O - 1, 2] = float("nan")  # (column 2 of y's row 5 NaN)
    fresh = lambda: (torch.full((rows, I), 7.0).to(dtype), torch.full((E, O, I), 7.0).to(dtype))  # noqa: E731
    got_y, got_w = fresh()
    if dtype == torch.float32 and I < 64 * torch.get_num_threads():
        assert not _small_gemm.one_row_gradients(got_y, got_w, g, a, b, w, blocks)
        assert not _small_gemm.float32_input_grad_blocks(got_y, g, w, blocks)
        assert bool((got_y == 7).all()) and bool((got_w == 7).all())
        return
    assert _small_gemm.one_row_gradients(got_y, got_w, g, a, b, w, blocks)
    for e, r, _ in blocks:
        exact = (g[r].double() @ w[e].double()).nan_to_num(0.0)
        bound = _bound(g[r].double().abs(), w[e].double().abs().nan_to_num(0.0), O)
        if dtype == torch.bfloat16:
            _bf16_within_one_rounding(got_y[r].nan_to_num(0.0), exact, bound)
        else:
            assert ((got_y[r].nan_to_num(0.0).double() - exact).abs() <= bound).all()
        by_hand = (a[r].float()[:, None] * b[r].float()[None, :]).to(dtype)
        assert torch.equal(got_w[e].isnan(), by_hand.isnan()) and torch.equal(got_w[e].nan_to_num(0.0), by_hand.nan_to_num(0.0))
    assert bool((got_y[[1, 3, 4]] == 7).all()) and bool((got_w[2] == 7).all())
    two_y, two_w = _by_the_two_calls(fresh(), g, a, b, w, blocks)
    one_y, one_w = fresh()
    assert _on_one_thread(lambda: _small_gemm.one_row_gradients(one_y, one_w, g, a, b, w, blocks))
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for t in (two_y, one_y):
        assert torch.equal(got_y.view(bits), t.view(bits))
    for t in (two_w, one_w):
        assert torch.equal(got_w.view(bits), t.view(bits))


def test_one_row_gradients_decline_what_they_do_not_take():
    """A block of two rows, mixed dtypes, float64: False, nothing written; shapes that do not
    fit: an error naming them."""
    _needs_bf16_blocks()
    w = torch.randn(2, 24, 40).bfloat16()
    g, b = torch.randn(3, 24).bfloat16(), torch.randn(3, 40).bfloat16()
    y, grads = torch.full((3, 40), 7.0).bfloat16(), torch.full((2, 24, 40), 7.0).bfloat16()
    assert not _small_gemm.one_row_gradients(y, grads, g, g, b, w, [(0, 0, 1), (1, 1, 3)])
    assert not _small_gemm.one_row_gradients(y, grads, g.float(), g.float(), b, w, [(0, 0, 1)])
    assert not _small_gemm.one_row_gradients(y.double(), grads.double(), g.double(), g.double(), b.double(), w.double(), [(0, 0, 1)])
    assert bool((y == 7).all()) and bool((grads == 7).all())
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.one_row_gradients(y[:, :20], grads, g, g, b, w, [(0, 0, 1)])
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.one_row_gradients(y, grads, g, g, b, w, [(2, 0, 1)])  # no expert 2


def test_bf16_blocks_kernels_decline_what_they_do_not_take():
    """Blocks past the kernels' most rows, a block accumulating, float32 tensors: False, nothing
    written; shapes that do not fit: an error naming them."""
    _needs_bf16_blocks()
    most = _small_gemm.BF16_BLOCKS_MAX_ROWS
    w = torch.randn(2, 24, 40).bfloat16()
    g = torch.randn(most + 1, 24).bfloat16()
    out = torch.full((most + 1, 40), 7.0, dtype=torch.bfloat16)
    assert not _small_gemm.bf16_input_grad_blocks(out, g[:, :23], w[:, :23], [(0, 0, most + 1)])  # odd O past `most` rows
    big = _small_gemm.bf16_input_grad_max_rows(w) + 1  # (rows 1 to big + 1: one row past the most)
    assert not _small_gemm.bf16_input_grad_blocks(
        torch.empty(big + 1, 40, dtype=torch.bfloat16), torch.randn(big + 1, 24).bfloat16(), w, [(0, 0, 1), (1, 1, big + 1)]
    )
    assert not _small_gemm.bf16_input_grad_blocks(out.float(), g.float(), w.float(), [(0, 0, 1)])
    grads = torch.full((2, 24, 40), 7.0, dtype=torch.bfloat16)
    x = torch.randn(most + 1, 40).bfloat16()
    most_w = _small_gemm.bf16_weight_grad_max_rows()
    g_w, x_w = torch.randn(most_w + 2, 24).bfloat16(), torch.randn(most_w + 2, 40).bfloat16()  # (a block one row past)
    assert not _small_gemm.bf16_weight_grad_blocks(grads, g_w, x_w, [(0, 0, 1), (1, 1, most_w + 2)], [False, False])
    assert not _small_gemm.bf16_weight_grad_blocks(grads, g, x, [(0, 0, 2), (0, 2, 4)], [False, True])
    assert bool((out == 7).all()) and bool((grads == 7).all())
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.bf16_input_grad_blocks(out[:, :20], g, w, [(0, 0, 2)])
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.bf16_weight_grad_blocks(grads, g[:, :20], x, [(0, 0, 2)], [False])
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.bf16_input_grad_blocks(out, g, w, [(2, 0, 2)])  # no expert 2


def test_environment_switch_turns_the_kernel_off():
    code = "from moe_ffn import _small_gemm; print(_small_gemm.library() is None)"
    env = dict(os.environ, MOE_FFN_SMALL_GEMM="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


# --- the layer, float32, with and without the kernel, against the float64 loop ---------------

def _layer_against_float64(T: int, moe: MoE | None = None, seed: int = 3):
    torch.manual_seed(seed)
    D, F, E, K = 40, 24, 4, 2
    if moe is None:
        moe = MoE(dim=D, hidden_dim=F, num_experts=E, top_k=K)  # float32
    D = moe.router.weight.shape[1]  # (a given layer's own width; top-2 throughout)
    x = torch.randn(T, D, requires_grad=True)
    g = torch.randn(T, D)
    y = moe(x)
    grads = torch.autograd.grad((y * g).sum(), [x, moe.experts.gate_up_proj, moe.experts.down_proj])
    leaves = [t.detach().double().requires_grad_() for t in (x, moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj)]
    ref = moe_forward(leaves[0], leaves[1], leaves[2], leaves[3], K)
    ref_grads = torch.autograd.grad((ref * g.double()).sum(), [leaves[0], leaves[2], leaves[3]])
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-5)
    for name, a, b in zip(("x", "gate_up_proj", "down_proj"), grads, ref_grads):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-5 * max(1.0, float(b.abs().max())), msg=lambda m: f"{name}: {m}")


def _avx2_kernels(monkeypatch):
    """The AVX2 kernel's paths whatever this CPU is (on AVX-512 CPUs the AVX-512 kernels and
    torch's choices would take some of these products first; they are tested on their own)."""
    monkeypatch.setattr(_small_gemm, "_avx512_forward_rows", lambda: (1, 0))
    monkeypatch.setattr(_small_gemm, "_torch_on_avx512", lambda: False)
    monkeypatch.setattr(_small_gemm, "_bf16_blocks_entry_points", lambda: None)  # (AVX512-BF16's)


def _per_block(monkeypatch):
    """The layer's loop over the blocks in Python (each product through its single-block entry
    point), as where the *_blocks entry points decline; the decode path's linear_blocks stays."""
    linear_blocks = _small_gemm.linear_blocks
    monkeypatch.setattr(
        _small_gemm, "linear_blocks",
        lambda x, w, blocks, out=None, index=None: None if out is not None else linear_blocks(x, w, blocks, index=index),
    )
    monkeypatch.setattr(_small_gemm, "input_grad_blocks", lambda *args: False)
    monkeypatch.setattr(_small_gemm, "weight_grad_blocks", lambda *args: False)


def _count_calls(monkeypatch, ran: dict, names: tuple[str, ...]) -> None:
    """ran[name] += 1 for each call of _small_gemm.name that ran (linear_blocks: ran[name +
    " decode"] without `out`, the decode path's call)."""
    for name in names:
        real = getattr(_small_gemm, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            result = _real(*args, **kwargs)
            key = _name + (" decode" if _name == "linear_blocks" and kwargs.get("out") is None else "")
            ran[key] = ran.get(key, 0) + (result is not None and result is not False)
            return result

        monkeypatch.setattr(_small_gemm, name, counted)


@pytest.mark.parametrize("T, path", [(4, "decode"), (4, "decode apart"), (24, "blocks"), (24, "per-block")])
def test_layer_runs_its_blocks_on_the_kernel_and_matches_float64(monkeypatch, T, path):
    """decode (T=4: 8 assignments over 4 experts, every block decode-sized): the whole forward
    in one call (routed_swiglu_blocks); decode apart (that call declining): each forward
    projection in one call for all blocks (linear_blocks without `out`); blocks (T=24: ~12 rows
    each): every product of a group of experts in one call (linear_blocks into the group's rows,
    input_grad_blocks, weight_grad_blocks), none block by block; per-block (the *_blocks entry
    points declining): each block through linear_into, input_grad and weight_grad_into. The
    float64 per-token loop comes out each way."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    if path == "per-block":
        _per_block(monkeypatch)
    if path == "decode apart":
        monkeypatch.setattr(_small_gemm, "routed_swiglu_blocks", lambda *args: None)
        monkeypatch.setattr(_small_gemm, "routed_swiglu_backward_blocks", lambda *args: False)
    ran = {}
    _count_calls(monkeypatch, ran, (
        "linear_blocks", "input_grad_blocks", "weight_grad_blocks", "linear_into", "input_grad", "weight_grad_into",
        "routed_swiglu_blocks", "routed_swiglu_backward_blocks",
    ))
    _layer_against_float64(T=T)
    single = ran.get("linear_into", 0), ran.get("input_grad", 0), ran.get("weight_grad_into", 0)
    if path == "decode":
        assert ran.get("routed_swiglu_blocks", 0) == 1 and ran.get("routed_swiglu_backward_blocks", 0) == 1
        assert ran.get("linear_blocks decode", 0) == 0 and ran.get("linear_blocks", 0) == 0
        assert ran.get("input_grad_blocks", 0) == ran.get("weight_grad_blocks", 0) == 0  # (all in the one call)
    elif path == "decode apart":
        assert ran.get("linear_blocks decode", 0) == 2 and ran.get("linear_blocks", 0) == 0
        assert ran.get("input_grad_blocks", 0) == ran.get("weight_grad_blocks", 0) == 2
    elif path == "blocks":
        assert ran.get("routed_swiglu_blocks", 0) == 0 and ran.get("routed_swiglu_backward_blocks", 0) == 0
        assert ran.get("linear_blocks decode", 0) == 0 and ran.get("linear_blocks", 0) >= 2
        assert ran.get("input_grad_blocks", 0) >= 2 and ran.get("weight_grad_blocks", 0) >= 2 and single == (0, 0, 0)
    else:
        assert all(n >= 2 * 2 for n in single)  # both projections of (almost) every expert
        assert ran.get("input_grad_blocks", 0) == ran.get("weight_grad_blocks", 0) == ran.get("linear_blocks", 0) == 0


def test_layer_with_weights_past_the_row_split_matches_float64(monkeypatch):
    """An expert bank whose first projection does not pack whole (D = 128, 2F = 8200: B of
    128 · 8208 floats > ROW_SPLIT_PACK_FLOATS) and blocks on both sides of IN_PLACE_MAX_ROWS:
    the forward's large blocks of that projection go to torch's kernels block by block (the
    forward's linear_blocks declines the group), its small ones to the in-place kernel, the
    down projection (B packs whole) to the packed product; output and every gradient match
    the float64 per-token loop."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    ran = {"forward product": 0}
    product = _small_gemm._product

    def counted(kernel, out, a, a_steps_are_rows, b, b_steps_are_rows, *rest, **kwargs):
        ran["forward product"] += not a_steps_are_rows and not b_steps_are_rows and b.shape[1] == 128
        return product(kernel, out, a, a_steps_are_rows, b, b_steps_are_rows, *rest, **kwargs)

    monkeypatch.setattr(_small_gemm, "_product", counted)
    torch.manual_seed(5)
    D, F, E, K, T = 128, 4100, 3, 1, 800
    assert _small_gemm.packed_max_rows(D, 2 * F, False) == _small_gemm.IN_PLACE_MAX_ROWS
    moe = MoE(dim=D, hidden_dim=F, num_experts=E, top_k=K)
    with torch.no_grad():  # one expert with few tokens, two with many
        moe.router.weight[0] -= 0.25 * moe.router.weight[0]
    x = torch.randn(T, D, requires_grad=True)
    g = torch.randn(T, D)
    params = [x, moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj]
    grads = torch.autograd.grad((moe(x) * g).sum(), params)
    counts = moe.stats.tokens_per_expert_E.tolist()
    assert min(counts) <= _small_gemm.IN_PLACE_MAX_ROWS < max(counts), counts
    assert ran["forward product"] == 0  # the first projection's forward never went to the packed product
    leaves = [t.detach().double().requires_grad_() for t in params]
    ref = moe_forward(*leaves, K)
    ref_grads = torch.autograd.grad((ref * g.double()).sum(), leaves)
    for name, a, b in zip(("x", "router", "gate_up_proj", "down_proj"), grads, ref_grads):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-5 * max(1.0, float(b.abs().max())), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("path", ["per-block", "blocks"])
@pytest.mark.parametrize("T", [150, 1200])
def test_layer_runs_packed_products_and_one_pass_swiglu_and_matches_float64(monkeypatch, path, T):
    """Blocks past MAX_ROWS (150 tokens, top-2 of 4 experts: ~75 rows each; 1200: ~600, past
    grouped.py's oneDNN rows, where the per-block path must still ask the kernel) go to the packed
    product, forward products only past IN_PLACE_MAX_ROWS (w read in place up to it)
    (per-block: through its Python entry, counted; blocks: from the *_blocks entry
    points' loop in C++), and the SwiGLU work to its one-pass kernels; the output and the
    gradients of the input, the experts' weights and the router (through the routing weights'
    gradient the backward kernel forms) match the float64 per-token loop."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    if path == "per-block":
        _per_block(monkeypatch)
    else:
        _count_calls(monkeypatch, ran_blocks := {}, ("linear_blocks", "input_grad_blocks", "weight_grad_blocks"))
    ran = {"product": 0, "swiglu": 0, "swiglu_backward": 0}
    product, swiglu, swiglu_backward = _small_gemm._product, _small_gemm.swiglu, _small_gemm.swiglu_backward

    def counted(name, fn):
        def run(*args, **kwargs):
            result = fn(*args, **kwargs)
            ran[name] += result is not None and result is not False
            return result
        return run

    def forward_or_input_grad(kernel, out, a, a_steps_are_rows, *rest, **kwargs):  # (not a weight gradient)
        run = counted("product", product) if not a_steps_are_rows else product
        return run(kernel, out, a, a_steps_are_rows, *rest, **kwargs)

    monkeypatch.setattr(_small_gemm, "_product", forward_or_input_grad)
    monkeypatch.setattr(_small_gemm, "swiglu", counted("swiglu", swiglu))
    monkeypatch.setattr(_small_gemm, "swiglu_backward", counted("swiglu_backward", swiglu_backward))
    torch.manual_seed(11)
    D, F, E, K = 40, 24, 4, 2
    moe = MoE(dim=D, hidden_dim=F, num_experts=E, top_k=K)
    x = torch.randn(T, D, requires_grad=True)
    g = torch.randn(T, D)
    params = [x, moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj]
    grads = torch.autograd.grad((moe(x) * g).sum(), params)
    counts = moe.stats.tokens_per_expert_E.tolist()
    big = sum(_small_gemm.MAX_ROWS < c <= _small_gemm.PACKED_MAX_ROWS for c in counts)
    big_forward = sum(_small_gemm.IN_PLACE_MAX_ROWS < c <= _small_gemm.PACKED_MAX_ROWS for c in counts)
    assert T < 1000 or min(counts) > 512
    if path == "per-block":  # each: two input gradients, and past IN_PLACE_MAX_ROWS two forward products
        assert big >= 1 and ran["product"] == 2 * big + 2 * big_forward
    else:
        assert big >= 1 and ran["product"] == 0 and all(ran_blocks.get(name, 0) >= 2 for name in ran_blocks)
    assert ran["swiglu"] >= 1 and ran["swiglu_backward"] >= 1
    leaves = [t.detach().double().requires_grad_() for t in params]
    ref = moe_forward(*leaves, K)
    ref_grads = torch.autograd.grad((ref * g.double()).sum(), leaves)
    for name, a, b in zip(("x", "router", "gate_up_proj", "down_proj"), grads, ref_grads):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-5 * max(1.0, float(b.abs().max())), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("experts", [1, 3, 6])
@pytest.mark.parametrize("kernel", ["avx2", "avx2-decode", "avx512"])
def test_linear_blocks_is_linear_into_block_by_block(monkeypatch, experts, kernel):
    """One call for every block (repeated experts, gaps between blocks, one-row blocks): each
    block's rows bit for bit what the per-block entry point of the same kernel computes for it
    alone (linear_into, or on AVX-512 CPUs avx512_linear_into), and within the float64 bound.
    avx2: blocks of up to 100 rows (strips and w read in place, a parallel region each); avx2-decode:
    up to 8 rows (all in one parallel region)."""
    _needs_kernel()
    if kernel.startswith("avx2"):
        _avx2_kernels(monkeypatch)  # (the AVX2 kernel's, whatever this CPU is)
        per_block = lambda out, x, w: _small_gemm.linear_into(out, x, w, None)
    else:
        _needs_avx512_kernel()
        per_block = _small_gemm.avx512_linear_into
    torch.manual_seed(experts)
    most = 100 if kernel == "avx2" else _small_gemm.BLOCKS_MAX_ROWS
    E, O, I, N = 4, 37, 29, 3 * most + 16
    w = torch.randn(E, O + 3, I)[:, 1 : O + 1]  # rows of a wider tensor: a row stride of its own
    x = _strided(N, I)
    blocks = _some_blocks(N, experts, E, most)
    y = _small_gemm.linear_blocks(x, w, blocks)
    assert y is not None and y.shape == (N, O)
    for e, start, stop in blocks:
        one = torch.empty(stop - start, O)
        assert per_block(one, x[start:stop], w[e])
        assert torch.equal(y[start:stop], one)
        exact = x[start:stop].double() @ w[e].double().T
        bound = _bound(x[start:stop].double().abs(), w[e].double().abs().T, I)
        assert bool(((y[start:stop].double() - exact).abs() <= bound).all())


def _some_blocks(N: int, experts: int, E: int, most: int) -> list[tuple[int, int, int]]:
    """Blocks of 1 to `most` rows over N rows: gaps between them, experts repeated, one-row
    blocks and a block at the end."""
    starts = sorted(torch.randperm(N - 1)[: 2 * experts].tolist())
    blocks = [(i % E, starts[2 * i], starts[2 * i + 1] + 1) for i in range(experts)]
    return [b for b in blocks if 0 < b[2] - b[1] <= most] + [(E - 1, N - 1, N)]


@pytest.mark.parametrize("kernel", ["avx2", "avx512"])
@pytest.mark.parametrize("T, K", [(1, 2), (3, 2), (5, 8)])
def test_routed_swiglu_blocks_are_the_decode_calls_one_by_one(monkeypatch, kernel, T, K):
    """The decode forward in one call: out and h bit for bit what the gather, linear_blocks for
    each projection, swiglu and scatter_add_rows make one by one (grouped.py's decode path
    without it), on the AVX2 kernel or this CPU's AVX-512 one, with experts without rows and
    blocks of one to five rows; out within the float64 bound of the per-row loop, zeros for the
    token without rows."""
    _needs_kernel()
    if kernel == "avx2":
        _avx2_kernels(monkeypatch)
    else:
        _needs_avx512_kernel()
    torch.manual_seed(10 * T + K)
    E, D, F = 9, 40, 24
    x, w1, w2, token, expert, weight, blocks = routed_rows(T, K, E, D, F)
    got = _small_gemm.routed_swiglu_blocks(x, token, weight, w1, w2, blocks)
    assert got is not None
    out, h = got
    xg = x.index_select(0, token)
    h_apart = _small_gemm.linear_blocks(xg, w1, blocks)
    a = _small_gemm.swiglu(h_apart)
    y = _small_gemm.linear_blocks(a, w2, blocks)
    out_apart = torch.zeros(T + 1, D)
    assert _small_gemm.scatter_add_rows(out_apart, token, y, weight)
    assert torch.equal(h, h_apart) and torch.equal(out, out_apart)
    assert (out[T] == 0).all()
    ref = torch.zeros(T + 1, D, dtype=torch.float64)
    for n in range(T * K):
        h_n = w1[expert[n]].double() @ x[token[n]].double()
        ref[token[n]] += weight[n].double() * (w2[expert[n]].double() @ (torch.nn.functional.silu(h_n[:F]) * h_n[F:]))
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("T, K", [(1, 2), (3, 2), (5, 8)])
def test_bf16_routed_swiglu_blocks_are_the_decode_calls_one_by_one(monkeypatch, T, K):
    """The same for bf16 x and weights (a bf16 layer computing in float32): out (float32) and
    h (bf16) bit for bit the gather, linear_blocks (x widened), swiglu on h widened, a rounded
    to bf16 by torch, linear_blocks, scatter_add_rows from the bf16 rows; out within bf16's
    rounding of the float64 loop on the same bf16 values."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    torch.manual_seed(10 * T + K)
    E, D, F = 9, 40, 24
    x, w1, w2, token, expert, weight, blocks = routed_rows(T, K, E, D, F)
    x, w1, w2 = x.bfloat16(), w1.bfloat16(), w2.bfloat16()
    got = _small_gemm.routed_swiglu_blocks(x, token, weight, w1, w2, blocks)
    assert got is not None
    out, h = got
    assert out.dtype == torch.float32 and h.dtype == torch.bfloat16
    h_apart = _small_gemm.linear_blocks(x.index_select(0, token), w1, blocks)
    a = _small_gemm.swiglu(h_apart.float()).bfloat16()
    y = _small_gemm.linear_blocks(a, w2, blocks)
    out_apart = torch.zeros(T + 1, D)
    assert _small_gemm.scatter_add_rows(out_apart, token, y, weight)
    assert torch.equal(h.view(torch.int16), h_apart.view(torch.int16)) and torch.equal(out, out_apart)
    assert (out[T] == 0).all()
    ref = torch.zeros(T + 1, D, dtype=torch.float64)
    for n in range(T * K):
        h_n = w1[expert[n]].double() @ x[token[n]].double()
        ref[token[n]] += weight[n].double() * (w2[expert[n]].double() @ (torch.nn.functional.silu(h_n[:F]) * h_n[F:]))
    # h, a and y each rounded to bf16 once (u = 2^-8), relative to the sizes of the terms
    scale = ref.abs().max()
    assert ((out.double() - ref).abs() <= 4 * 2.0**-8 * scale).all()


@pytest.mark.parametrize("T, K", [(1, 2), (3, 2), (5, 8), (12, 4)])
@pytest.mark.parametrize("keep_h", [True, False])
def test_native_bf16_routed_swiglu_blocks_are_the_decode_calls_one_by_one(T, K, keep_h):
    """A bf16 layer computing in bf16 on the AVX512-BF16 kernels (no AMX): the decode forward
    in one call (bf16_routed_swiglu_blocks), out (bf16) and h (bf16, kept or not) bit for bit
    the gather, linear_blocks on the bf16 dot products, the bf16 SwiGLU pass, linear_blocks and
    scatter_add_rows into float32 zeros rounded to bf16 once; out within bf16's rounding of the
    float64 loop on the same bf16 values, zeros for the token without rows."""
    _needs_kernel()
    _needs_bf16_blocks()
    if not _amx.swiglu_forward_available():
        pytest.skip("the bf16 SwiGLU pass does not run here")
    torch.manual_seed(10 * T + K)
    E, D, F = 9, 40, 24
    x, w1, w2, token, expert, weight, blocks = routed_rows(T, K, E, D, F, dtype=torch.bfloat16)
    got = _small_gemm.bf16_routed_swiglu_blocks(x, token, weight, w1, w2, blocks, keep_h)
    assert got is not None
    out, h = got
    assert out.dtype == h.dtype == torch.bfloat16 and out.shape == (T + 1, D)
    h_apart = _small_gemm.linear_blocks(x.index_select(0, token), w1, blocks)
    y = _small_gemm.linear_blocks(_amx.swiglu(h_apart), w2, blocks)
    out_apart = torch.zeros(T + 1, D)
    assert _small_gemm.scatter_add_rows(out_apart, token, y, weight)
    assert torch.equal(out.view(torch.int16), out_apart.bfloat16().view(torch.int16))
    if keep_h:
        assert torch.equal(h.view(torch.int16), h_apart.view(torch.int16))
    else:
        assert h.shape == (0, 2 * F)
    assert (out[T] == 0).all()
    ref = torch.zeros(T + 1, D, dtype=torch.float64)
    for n in range(T * K):
        h_n = w1[expert[n]].double() @ x[token[n]].double()
        ref[token[n]] += weight[n].double() * (w2[expert[n]].double() @ (torch.nn.functional.silu(h_n[:F]) * h_n[F:]))
    # h, silu(gate), a, y and out each rounded to bf16 once (u = 2^-8), relative to the terms' sizes
    assert ((out.double() - ref).abs() <= 8 * 2.0**-8 * ref.abs().max()).all()


def test_native_bf16_routed_swiglu_blocks_in_the_layer(monkeypatch):
    """A bf16 MoE layer's decode forward (eval and training, with its backward) takes the one
    call on the AVX512-BF16 kernels, with the same output and gradients, bit for bit, as with the
    call declining (grouped.py's calls one by one); a token index out of range is an error."""
    _needs_kernel()
    _needs_bf16_blocks()
    if not _amx.swiglu_forward_available():
        pytest.skip("the bf16 SwiGLU pass does not run here")
    torch.manual_seed(3)
    moe = MoE(dim=64, hidden_dim=48, num_experts=8, top_k=2).to(torch.bfloat16)
    x, g = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    real, ran = _small_gemm.bf16_routed_swiglu_blocks, []

    def step(one_call: bool):
        monkeypatch.setattr(
            _small_gemm, "bf16_routed_swiglu_blocks",
            (lambda *a: ran.append(real(*a)) or ran[-1]) if one_call else (lambda *a: None),
        )
        with torch.no_grad():
            y_eval = moe(x)
        leaf = x.clone().requires_grad_()
        y = moe(leaf)
        return [y_eval, y, *torch.autograd.grad((y.float() * g.float()).sum(), [leaf, *moe.parameters()])]

    together, apart = step(True), step(False)
    assert len(ran) == 2 and all(r is not None for r in ran)
    for a, b in zip(together, apart):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a, b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
    x1, w1, w2, token, _, weight, blocks = routed_rows(1, 2, 9, 40, 24, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="out of range"):
        real(x1, token + 5, weight, w1, w2, blocks, False)


def _same_bits_and_within_float64(names, together, apart, moe, x, g, K, dtype):
    """together and apart ([name]: tensor) bit for bit; x's, the router's and both expert
    weights' gradients in `together` within the float64 loop's bound (bf16: a few roundings to
    bf16 of the largest terms)."""
    for name, a, b in zip(names, together, apart):
        bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
        assert a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits)), name
    leaves = [t.detach().double().requires_grad_() for t in (x, moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj)]
    ref_grads = torch.autograd.grad((moe_forward(*leaves, K) * g.double()).sum(), leaves)
    got = dict(zip(names, together))
    for name, b in zip(("x", "router.weight", "experts.gate_up_proj", "experts.down_proj"), ref_grads):
        scale = max(1.0, float(b.abs().max()))
        bound = 6 * 2.0**-8 * scale if dtype == torch.bfloat16 else 2e-5 * scale
        assert float((got[name].double() - b).abs().max()) <= bound, name


def _needs_avx512_one_call_backward(dtype):
    _needs_kernel()
    _needs_one_row_gradients(dtype)
    if dtype == torch.bfloat16 and not _amx.swiglu_forward_available():
        pytest.skip("the bf16 SwiGLU passes do not run here")


def _avx512_backward_both_ways(monkeypatch, moe, x, g):
    """(together, apart, ran): [y, x's gradient, each parameter's] of a layer's
    forward+backward with avx512_routed_swiglu_backward_blocks as it is, and with it declining
    (grouped._ffn_backward's loop), and what the call returned each time the first made it."""
    real, ran = _small_gemm.avx512_routed_swiglu_backward_blocks, []

    def step(one_call: bool):
        monkeypatch.setattr(
            _small_gemm, "avx512_routed_swiglu_backward_blocks",
            (lambda *a: ran.append(real(*a)) or ran[-1]) if one_call else (lambda *a: False),
        )
        leaf = x.clone().requires_grad_()
        y = moe(leaf)
        return [y, *torch.autograd.grad((y.float() * g.float()).sum(), [leaf, *moe.parameters()])]

    return step(True), step(False), ran


@pytest.mark.parametrize("dtype, D, F, E, K, T, blocks_of", [
    (torch.bfloat16, 64, 48, 8, 2, 1, "1"), (torch.bfloat16, 64, 64, 16, 4, 5, "1-6"),
    (torch.bfloat16, 40, 24, 6, 2, 7, "1-6"), (torch.bfloat16, 64, 64, 8, 2, 16, "1-6, 7+"),
    (torch.bfloat16, 48, 32, 3, 2, 14, "7+"), (torch.bfloat16, 1024, 512, 4, 2, 1, "1"),
    (torch.bfloat16, 1024, 512, 3, 2, 2, "1-6"), (torch.bfloat16, 1024, 512, 3, 2, 12, "1-6, 7+"),
    (torch.float32, 128, 128, 8, 2, 1, "1"), (torch.float32, 256, 128, 12, 4, 5, "1-6"),
    (torch.float32, 256, 128, 4, 2, 12, "1-6, 7+"), (torch.float32, 128, 128, 2, 2, 8, "7+"),
    (torch.float32, 1024, 512, 4, 2, 1, "1"), (torch.float32, 1024, 512, 5, 2, 4, "1-6"),
], ids=[
    "bf16-one-row", "bf16-1-3-rows", "bf16-up-to-6-rows-tails", "bf16-mixed", "bf16-7+-rows", "bf16-streamed",
    "bf16-streamed-2-rows", "bf16-streamed-mixed", "fp32-one-row", "fp32-1-4-rows", "fp32-mixed", "fp32-8-rows",
    "fp32-streamed", "fp32-streamed-1-4-rows",
])
def test_avx512_layer_backward_in_one_call_is_the_loops_and_matches_float64(monkeypatch, dtype, D, F, E, K, T, blocks_of):
    """A layer computing in its own dtype on the AVX512-BF16 CPUs' kernels (no AMX): its
    decode-sized backward in one call (avx512_routed_swiglu_backward_blocks) gives the output
    and the gradients of x, the router and both expert weights bit for bit as
    grouped._ffn_backward's loop with that call switched off (blocks of 1 to 6 rows, float32 1
    to 4: the one-pass gradients through each weight; larger ones: the input and weight
    gradients' blocks calls, and a made by the SwiGLU backward pass where no block takes one
    pass; the SwiGLU passes, the slot sum); the call ran; the gradients within the float64 per-token loop's bound
    (bf16: a few roundings to bf16 of the largest terms). D = 40 / 48: rows past whole vectors
    of 16 / 32 (the scaling's and the gathers' tails); 1024 × 512: streamed gradients."""
    _needs_avx512_one_call_backward(dtype)
    torch.manual_seed(10 * T + K)
    moe = MoE(dim=D, hidden_dim=F, num_experts=E, top_k=K).to(dtype)
    x, g = torch.randn(T, D).to(dtype), torch.randn(T, D).to(dtype)
    picked = (x.double() @ moe.router.weight.double().t()).topk(K, dim=-1).indices.flatten().bincount(minlength=E)
    sizes = set(picked[picked > 0].tolist())
    kinds = ", ".join(k for k, there in (
        ("1", sizes == {1}), ("1-6", max(sizes) > 1 and min(sizes) <= 6), ("7+", max(sizes) > 6)) if there)
    assert kinds == blocks_of  # (the blocks this case means to have)
    together, apart, ran = _avx512_backward_both_ways(monkeypatch, moe, x, g)
    assert ran == [True]
    names = ["y", "x", *(name for name, _ in moe.named_parameters())]
    _same_bits_and_within_float64(names, together, apart, moe, x, g, K, dtype)


@pytest.mark.parametrize("T", [1, 4], ids=["one-row", "more-rows"])
@pytest.mark.parametrize("where", ["grad", "input"])
def test_avx512_bf16_backward_in_one_call_rounds_nan_as_the_loop(monkeypatch, T, where):
    """A NaN in the output gradient or in the input (a negative one of the widest payload)
    through the one-call bf16 backward on the AVX512-BF16 kernels: every gradient bit for bit
    the loop's with the call switched off, NaN where the float64 loop has one (output gradient),
    the expert weights' NaNs 0x7FC0 and some entries finite."""
    _needs_avx512_one_call_backward(torch.bfloat16)
    D, F, E, K = 128, 64, 4, 2
    torch.manual_seed(T)
    moe = MoE(dim=D, hidden_dim=F, num_experts=E, top_k=K).bfloat16()
    x, g = torch.randn(T, D).bfloat16(), torch.randn(T, D).bfloat16()
    special = g if where == "grad" else x
    special.view(torch.int16)[0, 3] = -1  # 0xFFFF
    assert special[0, 3].isnan()
    (_, *together), (_, *apart), ran = _avx512_backward_both_ways(monkeypatch, moe, x, g)
    assert ran == [True]
    leaves = [t.detach().double().requires_grad_() for t in (x, moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj)]
    ref = torch.autograd.grad((moe_forward(*leaves, K) * g.double()).sum(), leaves)
    for name, a, b, r in zip(("x", "router.weight", "experts.gate_up_proj", "experts.down_proj"), together, apart, ref):
        bits = a.view(torch.int16)
        assert torch.equal(bits, b.view(torch.int16)) and a.isnan().any(), name
        if where == "grad":
            assert torch.equal(a.isnan(), r.isnan()), name
        if name.startswith("experts"):
            assert a.isfinite().any() and (bits[a.isnan()] == 0x7FC0).all(), name


def test_avx512_backward_blocks_writes_whole_gradients_and_declines_what_it_does_not_take():
    """avx512_routed_swiglu_backward_blocks called directly (bf16): x's gradient zeros for the token
    without rows, the experts without rows' weight gradients untouched; False for a block past
    ONE_CALL_BACKWARD_MAX_ROWS rows, a step past ONE_CALL_BACKWARD_MAX_STEP_ROWS, an
    expert in two blocks, mixed dtypes, float32 the loop's float32 blocks calls would not take
    (too few columns a thread) or past the limit, an odd D, a token out of range; a ValueError
    for an expert out of range."""
    _needs_avx512_one_call_backward(torch.bfloat16)
    torch.manual_seed(8)
    E, D, F, T, K = 6, 48, 32, 3, 2
    x, w1, w2, token, expert, weight, blocks = routed_rows(T, K, E, D, F, dtype=torch.bfloat16)
    h = torch.randn(token.shape[0], 2 * F).bfloat16()
    g = torch.randn(T + 1, D).bfloat16()

    def call(g, x, h, w1, w2, token, weight, blocks):
        grads = torch.empty_like(x), torch.full_like(w1, 7), torch.full_like(w2, 7), torch.empty(token.shape[0])
        return _small_gemm.avx512_routed_swiglu_backward_blocks(*grads, g, x, h, w1, w2, token, weight, blocks), grads

    ok, (grad_x, grad_w1, grad_w2, _) = call(g, x, h, w1, w2, token, weight, blocks)
    assert ok
    assert (grad_x[T] == 0).all() and grad_x[:T].abs().sum() > 0
    idle = sorted(set(range(E)) - set(expert.tolist()))
    assert idle and (grad_w1[idle] == 7).all() and (grad_w2[idle] == 7).all()
    busy = sorted(set(expert.tolist()))
    assert (grad_w1[busy] != 7).any() and (grad_w2[busy] != 7).any()

    def one_block(rows):  # h, token, weight and the table of one block of `rows` rows (all token 0's)
        return torch.randn(rows, 2 * F).bfloat16(), torch.zeros(rows, dtype=torch.int64), torch.rand(rows), [(0, 0, rows)]

    most = _small_gemm.ONE_CALL_BACKWARD_MAX_ROWS
    h1, t1, w1_, b1 = one_block(most)
    assert call(g, x, h1, w1, w2, t1, w1_, b1)[0]
    h1, t1, w1_, b1 = one_block(most + 1)
    assert not call(g, x, h1, w1, w2, t1, w1_, b1)[0]
    step = _small_gemm.ONE_CALL_BACKWARD_MAX_STEP_ROWS + 1
    h1, t1, w1_, _ = one_block(step)
    spread = [(e, e * step // E, (e + 1) * step // E) for e in range(E)]  # (blocks of ~43 rows)
    assert not call(g, x, h1, w1, w2, t1, w1_, spread)[0]
    if len(blocks) > 1:
        assert not call(g, x, h, w1, w2, token, weight, [(blocks[0][0], s, t) for _, s, t in blocks])[0]
    assert not call(g, x, h, w1, w2.float(), token, weight, blocks)[0]  # mixed dtypes
    # float32: not through w2 of F = 32 columns (fewer than 64 a thread: the loop's two calls)
    assert not call(g.float(), x.float(), h.float(), w1.float(), w2.float(), token, weight, blocks)[0]
    if torch.get_num_threads() <= 2 and _small_gemm._few_row_gradients_entry_point(torch.float32) is not None:
        # float32 with D = F = 128: blocks of up to ONE_CALL_BACKWARD_MAX_ROWS rows, as bf16
        xf, w1f, w2f, _, _, _, _ = routed_rows(T, K, E, 128, 128)
        gf = torch.randn(T + 1, 128)
        for rows, runs in ((4, True), (5, True), (most, True), (most + 1, False)):
            block = (torch.randn(rows, 256), w1f, w2f, torch.zeros(rows, dtype=torch.int64), torch.rand(rows), [(0, 0, rows)])
            assert call(gf, xf, *block)[0] == runs, rows
    odd = routed_rows(T, K, E, D + 1, F, dtype=torch.bfloat16)
    assert not call(torch.randn(T + 1, D + 1).bfloat16(), odd[0], h, odd[1], odd[2], odd[3], odd[5], odd[6])[0]
    assert not call(g, x, h, w1, w2, torch.full_like(token, T + 1), weight, blocks)[0]
    with pytest.raises(ValueError, match="do not fit"):
        call(g, x, h, w1, w2, token, weight, [(E + i, s, t) for i, (_, s, t) in enumerate(blocks)])


@pytest.mark.parametrize("T, E, D", [(1, 64, 1024), (3, 7, 37), (16, 8, 1000), (2, 1, 64), (300, 64, 1000), (2048, 8, 520)])
def test_router_kernel_sums_exact_products_in_float32(T, E, D):
    """The router's products of bf16 tokens (router_logits: a few tokens, on one thread;
    router_backward: any number, on torch's team past 2^22 multiply-adds a product): the logits
    within float32's rounding of the float64 products, the gradients g·W and gᵀ·x within it
    before one bf16 rounding and the same bits on one thread as on the team (the threads split
    the columns, no sum); tails of D past whole vectors and of the tiles' rows, rows of a wider
    tensor (a row stride of their own), a NaN in g reaching exactly its token's row and its
    expert's."""
    _needs_avx512_kernel()
    torch.manual_seed(T * E + D)
    x = torch.randn(T, D + 5).bfloat16()[:, 2 : D + 2]
    w = (torch.randn(E, D) / D**0.5).bfloat16()
    x64, w64 = x.double(), w.double()
    logits = _small_gemm.router_logits(x, w)
    assert logits is not None and logits.dtype == torch.float32 and logits.shape == (T, E)
    assert ((logits.double() - x64 @ w64.T).abs() <= D * 2.0**-24 * (x64.abs() @ w64.abs().T)).all()
    g = torch.randn(T, E)
    grad_x, grad_w = _small_gemm.router_backward(g, x, w, True, True)
    g64 = g.double()
    want_x, want_w = g64 @ w64, g64.T @ x64
    assert ((grad_x.double() - want_x).abs() <= E * 2.0**-24 * (g64.abs() @ w64.abs()) + 2.0**-8 * want_x.abs()).all()
    assert ((grad_w.double() - want_w).abs() <= T * 2.0**-24 * (g64.abs().T @ x64.abs()) + 2.0**-8 * want_w.abs()).all()
    assert _small_gemm.router_backward(g, x, w, False, True)[0] is None
    assert torch.equal(_small_gemm.router_backward(g, x, w, False, True)[1].view(torch.int16), grad_w.view(torch.int16))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _small_gemm.router_backward(g, x, w, True, True)
    finally:
        torch.set_num_threads(threads)
    for one, team in zip(alone, (grad_x, grad_w)):
        assert torch.equal(one.view(torch.int16), team.view(torch.int16))
    g[0, E - 1] = float("nan")
    grad_x, grad_w = _small_gemm.router_backward(g, x, w, True, True)
    assert grad_x[0].isnan().all() and not grad_x[1:].isnan().any()
    assert grad_w[E - 1].isnan().all() and not grad_w[: E - 1].isnan().any()
    assert _small_gemm.router_logits(x.float(), w.float()) is None  # (float32: F.linear's own)


@pytest.mark.parametrize("T, E, D", [(17, 64, 1024), (300, 8, 96), (33, 20, 64), (5, 130, 32), (2048, 64, 1024), (40, 1, 2)])
def test_router_logits_on_pairs_sum_exact_products_in_float32(T, E, D):
    """The router's logits of bf16 tokens past a few, on the pair products (router_logits_on_pairs):
    within float32's rounding of the float64 products, as a new contiguous float32 [T, E]; tiles
    of tokens past whole ones, experts not a multiple of 16 and past 64 (a second column chunk),
    rows of a wider tensor; the same bits on one thread as on the team (each logit's sum the same
    steps), and as the few tokens' `router_logits` gives them; a NaN in x reaching exactly its
    token's row; subnormal inputs and products flushed to
    zero (the instruction's, as on AMX's tiles); None for float32 operands, an odd D and columns
    not contiguous."""
    if _small_gemm._router_pairs_entry_point() is None:
        pytest.skip("no AVX512-BF16 router kernel here (CPU without AVX512-BF16, or the library not built)")
    torch.manual_seed(T * E + D)
    x = torch.randn(T, D + 6).bfloat16()[:, 2 : D + 2]
    w = (torch.randn(E, D) / D**0.5).bfloat16()
    x64, w64 = x.double(), w.double()
    logits = _small_gemm.router_logits_on_pairs(x, w)
    assert logits is not None and logits.dtype == torch.float32 and logits.shape == (T, E) and logits.is_contiguous()
    assert ((logits.double() - x64 @ w64.T).abs() <= (D + 2) * 2.0**-24 * (x64.abs() @ w64.abs().T)).all()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _small_gemm.router_logits_on_pairs(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone.view(torch.int32), logits.view(torch.int32))
    few = _small_gemm.router_logits(x[:5], w)  # (the few tokens' entry point, one thread: the same sums)
    assert torch.equal(few.view(torch.int32), logits[:5].view(torch.int32))
    x[T // 2, D - 1] = float("nan")
    nan = _small_gemm.router_logits_on_pairs(x, w)
    assert nan[T // 2].isnan().all() and not nan[: T // 2].isnan().any() and not nan[T // 2 + 1 :].isnan().any()
    tiny = torch.zeros(T, D, dtype=torch.bfloat16)
    tiny[:, 0] = 1e-39  # subnormal in bf16
    tiny[0, 1], w_tiny = 1e-20, torch.zeros(E, D, dtype=torch.bfloat16)
    w_tiny[:, :2] = torch.tensor([1.0, 1e-20])  # 1e-20 · 1e-20: a subnormal product
    assert not _small_gemm.router_logits_on_pairs(tiny, w_tiny).any()
    assert _small_gemm.router_logits_on_pairs(x.float(), w.float()) is None
    assert _small_gemm.router_logits_on_pairs(x[:, 1:], w[:, 1:]) is None  # D - 1: odd
    assert _small_gemm.router_logits_on_pairs(x[:, ::2], w[:, ::2]) is None  # columns 2 apart


def _backward_with_and_without_one_call(monkeypatch, moe, x, g):
    """(together, apart, ran): [y, x's gradient, each parameter's] of one forward+backward with
    routed_swiglu_backward_blocks as it is and one with it declining (grouped._ffn_backward's
    loop), and what the kernel's call returned each time the first step made it."""
    real, ran = _small_gemm.routed_swiglu_backward_blocks, []

    def recorded(*args):
        ran.append(real(*args))
        return ran[-1]

    def step(one_call: bool):
        monkeypatch.setattr(_small_gemm, "routed_swiglu_backward_blocks", recorded if one_call else (lambda *a: False))
        leaf = x.clone().requires_grad_()
        y = moe(leaf)
        return [y, *torch.autograd.grad((y * g).sum(), [leaf, *moe.parameters()])]

    return step(True), step(False), ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D, F, E, K, T", [
    (64, 48, 8, 2, 1), (64, 64, 8, 2, 3), (64, 64, 16, 4, 5), (64, 48, 6, 2, 9), (1024, 512, 4, 2, 1), (1024, 512, 3, 2, 2),
], ids=["one-row", "some-rows", "1-3-rows", "more-rows", "streamed", "streamed-2-rows"])
def test_layer_backward_in_one_call_is_the_loops_and_matches_float64(monkeypatch, dtype, D, F, E, K, T):
    """A routed layer's decode-sized backward in one call of the kernel
    (routed_swiglu_backward_blocks; bf16: a bf16 layer computing in float32): the output and
    the gradients of x, the router and both expert weights bit for bit what
    grouped._ffn_backward's loop makes with that call switched off; the call ran; the
    gradients within the float64 per-token loop's bound (bf16: a few roundings to bf16 of the
    largest terms). Blocks of 1–2 rows through a weight of a multiple of 32 columns take the
    one pass over its rows (gradient_pass: F = 48 leaves the down projection to the calls; 3+
    rows, the calls), streamed where the gradient is large (1024 × 512)."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    from moe_ffn import _amx, grouped

    monkeypatch.setattr(_amx, "available", lambda: False)
    monkeypatch.setattr(grouped, "_cpu_has_matrix_units", lambda dtype: False)
    torch.manual_seed(10 * T + K)
    moe = MoE(dim=D, hidden_dim=F, num_experts=E, top_k=K).to(dtype)
    x, g = torch.randn(T, D).to(dtype), torch.randn(T, D).to(dtype)
    together, apart, ran = _backward_with_and_without_one_call(monkeypatch, moe, x, g)
    assert ran == [True]
    names = ["y", "x", *(name for name, _ in moe.named_parameters())]
    for name, a, b in zip(names, together, apart):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b), name
    leaves = [t.detach().double().requires_grad_() for t in (x, moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj)]
    ref = moe_forward(*leaves, K)
    ref_grads = torch.autograd.grad((ref * g.double()).sum(), leaves)
    got = dict(zip(names, together))
    for name, b in zip(("x", "router.weight", "experts.gate_up_proj", "experts.down_proj"), ref_grads):
        scale = max(1.0, float(b.abs().max()))
        bound = 2e-5 * scale if dtype == torch.float32 else 6 * 2.0**-8 * scale
        assert float((got[name].double() - b).abs().max()) <= bound, name


@pytest.mark.parametrize("T, E, K", [(1, 8, 2), (5, 16, 4)], ids=["one-row", "mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_layer_one_row_gradients_are_the_two_calls_bit_for_bit(monkeypatch, T, E, K, dtype):
    """Where one_row_gradients runs (AVX512-BF16 CPUs without AMX; float32: AMD's), a layer's
    blocks of one row take both gradients through the first weight (and the down projection's,
    bf16) in one pass (grouped._one_pass_gradients): every gradient bit for bit what the layer makes with that
    call switched off (the input and the weight gradients' calls), and within rounding of the
    float64 loop. "mixed": blocks of one row and of more, the others through the two calls."""
    _needs_one_row_gradients(dtype)
    from moe_ffn import _amx

    monkeypatch.setattr(_amx, "available", lambda: False)
    monkeypatch.setattr(_small_gemm, "avx512_routed_swiglu_backward_blocks", lambda *a: False)  # (the loop's calls)
    D, F = 512, 64  # (w1 [128, 512]: whole panels of 256 columns a thread)
    torch.manual_seed(T + E)
    moe = MoE(dim=D, hidden_dim=F, num_experts=E, top_k=K).to(dtype)
    x, g = torch.randn(T, D).to(dtype), torch.randn(T, D).to(dtype)
    picked = (x.double() @ moe.router.weight.double().t()).topk(K, dim=-1).indices.flatten().bincount(minlength=E)
    assert (picked == 1).any() and (T == 1 or (picked > 1).any())

    def step():
        leaf = x.clone().requires_grad_()
        for p in moe.parameters():
            p.grad = None
        moe(leaf).backward(g)
        return [leaf.grad, *(p.grad.clone() for p in moe.parameters())]

    ran = {}
    _count_calls(monkeypatch, ran, ("one_row_gradients",))
    together = step()
    # the first projection's pair, and the down projection's (w2 [E, D, F]: I = F = 64) where
    # the kernel takes it: bf16, not float32 (fewer than 64 columns a thread)
    assert ran == {"one_row_gradients": 2 if dtype == torch.bfloat16 else 1}
    monkeypatch.setattr(_small_gemm, "one_row_gradients", lambda *args: False)
    apart = step()
    names = ["x", *(name for name, _ in moe.named_parameters())]
    _same_bits_and_within_float64(names, together, apart, moe, x, g, K, dtype)


@pytest.mark.parametrize("T", [1, 8], ids=["one-row", "more-rows"])
@pytest.mark.parametrize("where", ["grad", "input"])
def test_bf16_layer_backward_in_one_call_rounds_nan_gradients_as_the_loops(monkeypatch, T, where):
    """A NaN in the output gradient or in the input (a negative one of the widest payload,
    whose bits + 0x8000 would carry into the sign) through a bf16 layer's decode-sized
    backward in one call: the gradients bit for bit what grouped._ffn_backward's loop makes
    with that call switched off; in the expert weights' gradients every NaN 0x7FC0 (as
    c10::BFloat16 rounds a float32 NaN) and some entries finite; with the NaN in the output
    gradient, NaN exactly where the float64 per-token loop has one (a NaN input's router
    scores rank the experts apart from float64's). T = 1: blocks of one row (the one pass over
    each weight's rows); T = 8: blocks of 3+ rows (the calls' line tiles). (The weight
    gradients' lines skip their NaN screen where their operands are finite; the kernel-level
    tests below and above pin that screen down.)"""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    from moe_ffn import _amx, grouped

    monkeypatch.setattr(_amx, "available", lambda: False)
    monkeypatch.setattr(grouped, "_cpu_has_matrix_units", lambda dtype: False)
    D, F, E, K = 1024, 512, 4, 2
    torch.manual_seed(T)
    moe = MoE(dim=D, hidden_dim=F, num_experts=E, top_k=K).bfloat16()
    x, g = torch.randn(T, D).bfloat16(), torch.randn(T, D).bfloat16()
    special = g if where == "grad" else x
    special.view(torch.int16)[0, 3] = -1  # 0xFFFF: a negative NaN, all payload bits set
    assert special[0, 3].isnan()
    (_, *together), (_, *apart), ran = _backward_with_and_without_one_call(monkeypatch, moe, x, g)
    assert ran == [True]
    leaves = [t.detach().double().requires_grad_() for t in (x, moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj)]
    ref = torch.autograd.grad((moe_forward(*leaves, K) * g.double()).sum(), leaves)
    for name, a, b, r in zip(("x", "router.weight", "experts.gate_up_proj", "experts.down_proj"), together, apart, ref):
        bits = a.view(torch.int16)
        assert torch.equal(bits, b.view(torch.int16)), name
        assert a.isnan().any(), name
        if where == "grad":
            assert torch.equal(a.isnan(), r.isnan()), name
        if name.startswith("experts"):  # (the kernel's lines; torch's vector ops round a NaN to 0xFFFF)
            assert a.isfinite().any() and (bits[a.isnan()] == 0x7FC0).all(), name


@pytest.mark.parametrize("T", [2, 8], ids=["1-2-rows", "3+-rows"])
def test_bf16_backward_in_one_call_quiets_a_nan_input_in_the_first_weights_gradient(monkeypatch, T):
    """routed_swiglu_backward_blocks on bf16 tensors, with a NaN in x at column 3 of token 0 (a
    negative one of the widest payload, whose bits + 0x8000 would carry into the sign) and the
    forward's h finite: exactly column 3 of the first weight's gradient of token 0's experts
    turns NaN, each 0x7FC0 (as c10::BFloat16 rounds a float32 NaN), and every other bit of
    every gradient is that of the same call with a finite x there. That column's sums are
    finite h-side terms times the NaN as it came, which the lines whose operands are all
    finite would round to 0xFFFF: their screen (finite_operands in the kernel) must see it — in
    the one pass over the weight's rows (T = 2: blocks of 1–2 rows) and in the weight
    gradient's line tiles (T = 8: blocks of 3+ rows), both streamed (1024 × 1024)."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    torch.manual_seed(T)
    E, D, F, K = 4, 1024, 512, 2
    x, w1, w2, token, expert, weight, blocks = routed_rows(T, K, E, D, F, dtype=torch.bfloat16, pad=0)
    h = torch.randn(token.shape[0], 2 * F).bfloat16()
    g = torch.randn(T + 1, D).bfloat16()

    def call(x):
        grads = (torch.empty_like(x), torch.full_like(w1, 7), torch.full_like(w2, 7), torch.empty(token.shape[0]))
        assert _small_gemm.routed_swiglu_backward_blocks(*grads, g, x, h, w1, w2, token, weight, blocks)
        return [t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32) for t in grads]

    finite = call(x)
    x.view(torch.int16)[0, 3] = -1  # 0xFFFF
    assert x[0, 3].isnan()
    got = call(x)
    hit = sorted(set(expert[token == 0].tolist()))
    assert len(hit) == K and any(stop - start > (2 if T > 2 else 0) for e, start, stop in blocks if e in hit)
    assert (got[1][hit, :, 3] == 0x7FC0).all()
    got[1][hit, :, 3] = finite[1][hit, :, 3]
    for name, a, b in zip(("x", "w1", "w2", "weight"), got, finite):
        assert torch.equal(a, b), name


def test_routed_swiglu_backward_blocks_declines_what_the_calls_would_not_take(monkeypatch):
    """False, where one of the calls would not run on its kernel or a block would add to
    another expert's piece: mixed dtypes, float16, float64 combine weights, an expert in two
    blocks, blocks not covering the rows, a block past the weight gradients' rows, the
    AVX-512 CPUs' kernels (whose input gradients the loop takes first), a token out of range;
    a ValueError for an expert out of range."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    torch.manual_seed(6)
    E, D, F, T, K = 5, 40, 24, 3, 2
    x, w1, w2, token, _, weight, blocks = routed_rows(T, K, E, D, F)
    h = torch.randn(token.shape[0], 2 * F)
    g = torch.randn(T + 1, D)

    def call(g, x, h, w1, w2, token, weight, blocks):
        grads = torch.empty_like(x), torch.zeros_like(w1), torch.zeros_like(w2), torch.empty(token.shape[0])
        return _small_gemm.routed_swiglu_backward_blocks(*grads, g, x, h, w1, w2, token, weight, blocks)

    assert call(g, x, h, w1, w2, token, weight, blocks)
    assert call(g.bfloat16(), x.bfloat16(), h.bfloat16(), w1.bfloat16(), w2.bfloat16(), token, weight, blocks)
    assert not call(g, x, h, w1, w2.bfloat16(), token, weight, blocks)  # mixed dtypes
    assert not call(g.half(), x.half(), h.half(), w1.half(), w2.half(), token, weight, blocks)
    assert not call(g, x, h, w1, w2, token, weight.double(), blocks)
    if len(blocks) > 1:
        assert not call(g, x, h, w1, w2, token, weight, [(blocks[0][0], s, t) for _, s, t in blocks])
    assert not call(g, x, h, w1, w2, token, weight, blocks[:-1])
    many = _small_gemm.WEIGHT_GRAD_MAX_ROWS + 1
    assert not call(g, x, torch.randn(many, 2 * F), w1, w2, torch.zeros(many, dtype=torch.int64), torch.rand(many),
                    [(0, 0, many)])
    assert not call(g, x, h, w1, w2, torch.full_like(token, T + 1), weight, blocks)
    with monkeypatch.context() as m:
        m.setattr(_small_gemm, "_torch_on_avx512", lambda: True)
        assert not call(g, x, h, w1, w2, token, weight, blocks)
    with pytest.raises(ValueError, match="do not fit"):
        call(g, x, h, w1, w2, token, weight, [(E + i, s, t) for i, (_, s, t) in enumerate(blocks)])


def test_routed_swiglu_blocks_declines_what_the_calls_would_not_take(monkeypatch):
    """None, nothing computed, where a step would not run on its kernel or the blocks do not
    cover the rows in order: float64 combine weights (a router in float64), mixed dtypes,
    float16, bf16 where linear_blocks reads x as bf16 (AVX512-BF16 CPUs), a block past
    the kernel's rows, a gap between blocks or none at row 0, a weight whose rows are not
    contiguous; a ValueError for an expert out of range; a RuntimeError for a token out of range."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    torch.manual_seed(4)
    x, w1, w2, token, _, weight, blocks = routed_rows(3, 2, 5, 32, 16)
    call = _small_gemm.routed_swiglu_blocks
    assert call(x, token, weight, w1, w2, blocks) is not None
    assert call(x, token, weight.double(), w1, w2, blocks) is None
    assert call(x.bfloat16(), token, weight, w1, w2.bfloat16(), blocks) is None  # mixed dtypes
    assert call(x.half(), token, weight, w1.half(), w2.half(), blocks) is None
    with monkeypatch.context() as m:  # bf16 where linear_blocks would read x as bf16 (AVX512-BF16 CPUs)
        m.setattr(_small_gemm, "bf16_forward_blocks_fit", lambda *args, **kwargs: True)
        assert call(x.bfloat16(), token, weight, w1.bfloat16(), w2.bfloat16(), blocks) is None
    assert call(x.bfloat16(), token, weight, w1.bfloat16(), w2.bfloat16(), blocks) is not None
    assert call(x, token, weight, w1, w2, blocks[:-1]) is None  # rows past the blocks
    assert call(x, token, weight, w1, w2, [(e, s + 1, t + 1) for e, s, t in blocks]) is None
    assert call(x, token, weight, w1, w2.transpose(1, 2).contiguous().transpose(1, 2), blocks) is None
    many = _small_gemm.PACKED_MAX_ROWS + 1  # one block of more rows than the forward kernels take
    assert call(x, torch.zeros(many, dtype=torch.int64), torch.rand(many), w1, w2, [(0, 0, many)]) is None
    with pytest.raises(ValueError, match="do not fit"):
        call(x, token, weight, w1, w2, [(5, b[1], b[2]) for b in blocks])
    with pytest.raises(RuntimeError, match="out of range"):
        call(x, torch.full_like(token, x.shape[0]), weight, w1, w2, blocks)


@pytest.mark.parametrize("rows", [3, 80])
def test_input_grad_blocks_is_input_grad_block_by_block(monkeypatch, rows):
    """One call for every block: each block's rows bit for bit what input_grad computes for it
    alone (blocks of up to 3 rows: the row split; to 64, the column split; past it the packed
    product), one-row blocks (which input_grad leaves to torch) within the float64 bound, rows
    outside the blocks untouched."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    torch.manual_seed(rows)
    E, O, I, N = 4, 37, 29, 3 * rows + 10
    w = torch.randn(E, O + 3, I)[:, 1 : O + 1]
    g = _strided(N, O)
    blocks = _some_blocks(N, 5, E, rows)  # (its last block: one row)
    out = torch.full((N, I + 2), float("nan"))[:, 1 : I + 1]
    assert _small_gemm.input_grad_blocks(out, g, w, blocks)
    covered = torch.zeros(N, dtype=torch.bool)
    for e, start, stop in blocks:
        covered[start:stop] = True
        if stop - start > 1:
            assert torch.equal(out[start:stop], _small_gemm.input_grad(g[start:stop], w[e].t()))
        exact = g[start:stop].double() @ w[e].double()
        assert bool(((out[start:stop].double() - exact).abs() <= _bound(g[start:stop].double().abs(), w[e].double().abs(), O)).all())
    assert out[~covered].isnan().all()


@pytest.mark.parametrize("rows", [3, 80])
def test_input_grad_blocks_through_bf16_weights_is_input_grad_block_by_block(monkeypatch, rows):
    """bf16 weights read as they are: each block's rows bit for bit what input_grad computes
    through the same bf16 weight for the block alone (one-row blocks included), rows outside
    the blocks untouched."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    torch.manual_seed(rows)
    E, O, I, N = 4, 37, 29, 3 * rows + 10
    w = torch.randn(E, O + 3, I)[:, 1 : O + 1].bfloat16()
    g = _strided(N, O)
    blocks = _some_blocks(N, 5, E, rows)
    out = torch.full((N, I + 2), float("nan"))[:, 1 : I + 1]
    assert _small_gemm.input_grad_blocks(out, g, w, blocks)
    covered = torch.zeros(N, dtype=torch.bool)
    for e, start, stop in blocks:
        covered[start:stop] = True
        assert torch.equal(out[start:stop], _small_gemm.input_grad(g[start:stop], w[e].t()))
    assert out[~covered].isnan().all()


# (512 × 1024: gradients large enough to be streamed a line at a time)
@pytest.mark.parametrize("rows", [4, 200])
@pytest.mark.parametrize("shape", [(200, 33), (512, 1024)])
def test_weight_grad_blocks_into_bf16_is_weight_grad_into_block_by_block(monkeypatch, rows, shape):
    """bf16 gradients, one block an expert (nothing added to): each bit for bit what
    weight_grad_into writes for its block alone; experts without blocks untouched."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    torch.manual_seed(rows)
    E, (M, Nc), N = 6, shape, 3 * rows + 10
    a, b = _strided(N, M), _strided(N, Nc)
    blocks = [(i, start, stop) for i, (_, start, stop) in enumerate(_some_blocks(N, 6, E - 1, rows))][: E - 1]
    out = torch.full((E, M, Nc), 7.0).bfloat16()
    assert _small_gemm.weight_grad_blocks(out, a, b, blocks, [False] * len(blocks))
    for e, start, stop in blocks:
        want = torch.empty(M, Nc, dtype=torch.bfloat16)
        assert _small_gemm.weight_grad_into(want, a[start:stop].t(), b[start:stop])
        assert torch.equal(out[e].view(torch.int16), want.view(torch.int16))
    assert (out[len(blocks) :] == 7).all()


def test_bf16_weight_grad_blocks_are_the_same_on_one_and_two_threads(monkeypatch):
    """Decode-sized blocks into bf16 gradients run in one parallel region, each thread its
    share of every block's rows: bitwise the same on 1 and 2 threads, and each block bit for
    bit what weight_grad_into writes for it alone."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    torch.manual_seed(3)
    E, M, Nc, N = 12, 256, 64, 60
    a, b = _strided(N, M), _strided(N, Nc)
    cuts = [0, 1, 3, 8, 9, 15, 20, 28, 30, 37, 45, 52, 60]  # blocks of 1 to 8 rows
    blocks = [(e, start, stop) for e, (start, stop) in enumerate(zip(cuts, cuts[1:]))]
    outs, threads = [], torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(torch.full((E, M, Nc), 7.0).bfloat16())
            assert _small_gemm.weight_grad_blocks(outs[-1], a, b, blocks, [False] * len(blocks))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    for e, start, stop in blocks:
        want = torch.empty(M, Nc, dtype=torch.bfloat16)
        assert _small_gemm.weight_grad_into(want, a[start:stop].t(), b[start:stop])
        assert torch.equal(outs[1][e].view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("rows", [4, 200])
def test_weight_grad_blocks_is_weight_grad_into_block_by_block(monkeypatch, rows):
    """One call for every block, experts repeated: each expert's gradient bit for bit what
    weight_grad_into writes for its blocks in turn (the second and later added to the first
    where the block's accumulate flag says so, as grouped.py marks an expert's later pieces);
    experts without blocks untouched."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    torch.manual_seed(rows)
    E, M, Nc, N = 5, 200, 33, 3 * rows + 10
    a, b = _strided(N, M), _strided(N, Nc)
    blocks = _some_blocks(N, 6, E - 1, rows)
    seen, accumulate = set(), []
    for e, _, _ in blocks:
        accumulate.append(e in seen)
        seen.add(e)
    out = torch.full((E, M, Nc), float("nan"))
    assert _small_gemm.weight_grad_blocks(out, a, b, blocks, accumulate)
    want = torch.full((E, M, Nc), float("nan"))
    for (e, start, stop), acc in zip(blocks, accumulate):
        assert _small_gemm.weight_grad_into(want[e], a[start:stop].t(), b[start:stop], acc)
    assert torch.equal(out[sorted(seen)], want[sorted(seen)]) and out[E - 1].isnan().all()


@pytest.mark.parametrize("layout", ["even", "uneven", "small", "pair"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_blocks_of_more_than_six_rows_are_shared_and_the_blocks_one_by_one(monkeypatch, layout, dtype):
    """Where every block has more than six rows, the backward's *_blocks calls share the blocks
    among the threads, each block whole on one thread (an expert's blocks together; two blocks
    on two threads, one each, too), and put the whole team on each block in turn where the
    shares are uneven or a block is smaller:
    on two threads, every input gradient (through float32 or bf16 weights) and weight gradient
    (into float32, an expert's later block added; into bf16, one block an expert) bit for bit
    what the single-block calls make on the whole team, and within the float64 bound."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    torch.manual_seed(len(layout))
    rows = {
        "even": [23, 19, 31, 17, 9, 12, 25, 21, 40, 7],
        "uneven": [150, 9, 12, 8, 7, 10, 11, 9, 13, 8],  # (float32: uneven shares, the whole team on each block)
        "small": [23, 19, 31, 17, 9, 12, 25, 21, 40, 3],  # (a decode-sized block among them: the same)
        "pair": [23, 19],  # (one block a thread: shared)
    }[layout]
    if dtype == torch.bfloat16:
        rows = [min(r, _small_gemm.ranges().bf16) for r in rows]
    experts = [0, 1, 1, 2, 3, 3, 4, 5, 6, 7][: len(rows)]  # (ascending; experts 1 and 3 in two blocks each)
    starts = [sum(rows[:i]) for i in range(len(rows))]
    blocks = [(e, s, s + r) for e, s, r in zip(experts, starts, rows)]
    E, O, I, N = 8, 96, 72, sum(rows)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        w = torch.randn(E, O, I).to(dtype)
        g = _strided(N, O)
        out = torch.full((N, I), float("nan"))
        assert _small_gemm.input_grad_blocks(out, g, w, blocks)
        for e, start, stop in blocks:
            assert torch.equal(out[start:stop], _small_gemm.input_grad(g[start:stop], w[e].t()))
            exact = g[start:stop].double() @ w[e].double()
            bound = _bound(g[start:stop].double().abs(), w[e].double().abs(), O)
            assert bool(((out[start:stop].double() - exact).abs() <= bound).all())
        a, b = _strided(N, O), _strided(N, I)
        if dtype == torch.float32:
            again = [i > 0 and experts[i - 1] == e for i, e in enumerate(experts)]
            grad, want = torch.full((E, O, I), float("nan")), torch.full((E, O, I), float("nan"))
        else:  # (bf16 gradients are never added to: one block an expert)
            blocks = [blk for i, blk in enumerate(blocks) if i == 0 or experts[i - 1] != blk[0]]
            again = [False] * len(blocks)
            grad, want = torch.full((E, O, I), 7.0).bfloat16(), torch.full((E, O, I), 7.0).bfloat16()
        assert _small_gemm.weight_grad_blocks(grad, a, b, blocks, again)
        exact = torch.zeros(E, O, I, dtype=torch.float64)
        for (e, start, stop), add in zip(blocks, again):
            assert _small_gemm.weight_grad_into(want[e], a[start:stop].t(), b[start:stop], add)
            exact[e] += a[start:stop].double().t() @ b[start:stop].double()
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(grad.view(bits), want.view(bits))
        bound = _bound(a.double().abs().t(), b.double().abs(), N) + (exact.abs() * 2.0**-8 if dtype == torch.bfloat16 else 0)
        seen = sorted({e for e, _, _ in blocks})
        assert bool(((grad.double() - exact).abs() <= bound)[seen].all())
        untouched = [e for e in range(E) if e not in seen]  # (experts without blocks)
        assert (grad[untouched].isnan() if dtype == torch.float32 else grad[untouched] == 7).all()
    finally:
        torch.set_num_threads(threads)


def test_blocks_entry_points_decline_what_they_do_not_take(monkeypatch):
    """False (nothing written) for: no blocks, a block past the rows the kernel takes (through
    bf16 weights or into bf16 gradients: past its bf16 rows), an empty block, float64 tensors,
    bf16 input rows, a bf16 gradient added to, a weight whose rows are not contiguous, and where
    torch's kernels are AVX-512 (the per-block choices there); a ValueError for blocks or
    tensors that do not fit."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    E, O, I, N = 3, 24, 16, _small_gemm.PACKED_MAX_ROWS + 1
    g, w, out = torch.randn(N, O), torch.randn(E, O, I), torch.full((N, I), 7.0)
    a, b, grad = torch.randn(N, O), torch.randn(N, I), torch.full((E, O, I), 7.0)
    for blocks in ([], [(0, 0, N)], [(0, 4, 4)]):
        assert not _small_gemm.input_grad_blocks(out, g, w, blocks)
        assert not _small_gemm.weight_grad_blocks(grad, a, b, blocks, [False] * len(blocks))
    one = [(0, 0, 4)]
    assert not _small_gemm.input_grad_blocks(out.double(), g.double(), w.double(), one)
    past_bf16 = [(0, 0, _small_gemm.ranges().bf16 + 1)]
    assert not _small_gemm.input_grad_blocks(out, g, w.bfloat16(), past_bf16)
    assert not _small_gemm.input_grad_blocks(out, g.bfloat16(), w.bfloat16(), one)
    assert not _small_gemm.input_grad_blocks(out, g, w.transpose(1, 2).contiguous().transpose(1, 2), one)
    grad16 = torch.full((E, O, I), 7.0).bfloat16()
    assert not _small_gemm.weight_grad_blocks(grad16, a, b, past_bf16, [False])
    assert not _small_gemm.weight_grad_blocks(grad16, a, b, [(0, 0, 4), (0, 4, 8)], [False, True])
    assert not _small_gemm.weight_grad_blocks(grad16, a.bfloat16(), b.bfloat16(), one, [False])
    assert (grad16 == 7).all()
    assert not _small_gemm.weight_grad_blocks(grad, a.double(), b.double(), one, [False])
    monkeypatch.setattr(_small_gemm, "_torch_on_avx512", lambda: True)
    assert not _small_gemm.input_grad_blocks(out, g, w, one)
    assert not _small_gemm.weight_grad_blocks(grad, a, b, one, [False])
    assert (out == 7).all() and (grad == 7).all()
    monkeypatch.setattr(_small_gemm, "_torch_on_avx512", lambda: False)
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.input_grad_blocks(out, g, w, [(3, 0, 4)])
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.input_grad_blocks(out[:, :8], g, w, one)
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.weight_grad_blocks(grad, a, b, [(0, N - 2, N + 1)], [False])
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.weight_grad_blocks(grad, a, b, one, [False, True])


@pytest.mark.parametrize("experts", [1, 3, 6])
def test_linear_blocks_bf16_is_linear_into_block_by_block(monkeypatch, experts):
    """bf16 x, w and y (x widened to float32 once, w read as it is, each sum rounded once):
    each block's rows bit for bit what linear_into computes for the block alone, rows outside
    the blocks untouched."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    torch.manual_seed(experts)
    E, O, I, N = 4, 37, 29, 40
    w = torch.randn(E, O + 3, I)[:, 1 : O + 1].bfloat16()
    x = _strided(N, I).bfloat16()
    blocks = _some_blocks(N, experts, E, _small_gemm.BLOCKS_MAX_ROWS)
    out = torch.full((N, O), 7.0).bfloat16()
    assert _small_gemm.linear_blocks(x, w, blocks, out=out) is out
    covered = torch.zeros(N, dtype=torch.bool)
    for e, start, stop in blocks:
        covered[start:stop] = True
        one = torch.empty(stop - start, O).bfloat16()
        assert _small_gemm.linear_into(one, x[start:stop], w[e], None)
        assert torch.equal(out[start:stop].view(torch.int16), one.view(torch.int16))
    assert (out[~covered] == 7).all()


def test_linear_blocks_declines_what_it_does_not_take(monkeypatch):
    """None (nothing computed) for: no blocks, a block past the forward rows (PACKED_MAX_ROWS
    on AVX2 CPUs; MAX_ROWS for bf16), an empty block, mixed dtypes or float64, a weight whose
    rows are not contiguous; a ValueError
    for blocks that do not fit x, w or out. The decode path takes blocks of up to
    BLOCKS_MAX_ROWS only (blocks_fit)."""
    _needs_kernel()
    _avx2_kernels(monkeypatch)
    x, w = torch.randn(_small_gemm.PACKED_MAX_ROWS + 1, 16), torch.randn(3, 24, 16)
    assert _small_gemm.linear_blocks(x, w, []) is None
    assert _small_gemm.linear_blocks(x, w, [(0, 0, _small_gemm.PACKED_MAX_ROWS + 1)]) is None
    assert _small_gemm.blocks_fit([(0, 0, _small_gemm.BLOCKS_MAX_ROWS)])
    assert not _small_gemm.blocks_fit([(0, 0, _small_gemm.BLOCKS_MAX_ROWS + 1)])
    x = x[:80]
    assert _small_gemm.linear_blocks(x, w, [(0, 4, 4)]) is None
    assert _small_gemm.linear_blocks(x.bfloat16(), w.bfloat16(), [(0, 0, _small_gemm.MAX_ROWS + 1)]) is None
    assert _small_gemm.linear_blocks(x.bfloat16(), w, [(0, 0, 4)]) is None  # mixed dtypes
    assert _small_gemm.linear_blocks(x.double(), w.double(), [(0, 0, 4)]) is None
    assert _small_gemm.linear_blocks(x, w.transpose(1, 2).contiguous().transpose(1, 2), [(0, 0, 4)]) is None
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.linear_blocks(x, w, [(3, 0, 4)])
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.linear_blocks(x, w, [(0, 78, 81)])
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.linear_blocks(x[:, :8], w, [(0, 0, 4)])
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.linear_blocks(x, w, [(0, 0, 4)], out=torch.empty(79, 24))


@pytest.mark.machine_ranges
def test_layer_runs_the_avx512_kernels_and_matches_float64(monkeypatch):
    """On AVX-512 CPUs, blocks of 9–64 rows go to the AVX-512 forward kernel (one by one, or a
    group's blocks in one call of linear_blocks) and weight gradients of 16–96 rows to the
    AVX-512 weight-gradient kernel (one by one, or on AMD's a group's blocks in one call of
    float32_weight_grad_blocks) (T = 40, top-2 of 4 experts: ~20 rows each); output and
    gradients against the float64 loop."""
    _needs_avx512_kernel()
    ran = {"linear": 0, "weight_grad": 0}
    linear, weight_grad = _small_gemm.avx512_linear_into, _small_gemm.avx512_weight_grad_into
    blocks_call = _small_gemm.linear_blocks

    def counted_blocks(x, w, blocks, out=None, index=None):
        y = blocks_call(x, w, blocks, out=out, index=index)
        if y is not None and x.dtype == torch.float32:
            ran["linear"] += len(blocks)
        return y

    def counted_weight_grad(*args, **kwargs):
        done = weight_grad(*args, **kwargs)
        ran["weight_grad"] += done
        return done

    weight_grad_blocks = _small_gemm.float32_weight_grad_blocks

    def counted_weight_grad_blocks(*args, **kwargs):
        done = weight_grad_blocks(*args, **kwargs)
        ran["weight_grad"] += sum(done)
        return done

    def counted_linear(*args):
        done = linear(*args)
        ran["linear"] += done
        return done
    monkeypatch.setattr(_small_gemm, "avx512_linear_into", counted_linear)
    monkeypatch.setattr(_small_gemm, "avx512_weight_grad_into", counted_weight_grad)
    monkeypatch.setattr(_small_gemm, "linear_blocks", counted_blocks)
    monkeypatch.setattr(_small_gemm, "float32_weight_grad_blocks", counted_weight_grad_blocks)
    _layer_against_float64(T=40)
    assert ran["linear"] >= 2 * 3 and ran["weight_grad"] >= 2 * 3  # both projections, (almost) every expert


@pytest.mark.parametrize("T", [40, 200])
def test_float32_layer_on_amd_avx512_gathers_no_rows(monkeypatch, T):
    """Where the float32 kernels read the tokens' rows by index (AMD's AVX-512 CPUs, forced
    here; blocks of ~20 / ~100 rows, top-2 of 4 experts, D = F = 128), the layer gathers no rows into
    copies in its backward (x for w1's gradient, the output gradient for da = g·w2 and, weighted,
    for w2's gradient), and none in its forward where its blocks are within
    FLOAT32_FORWARD_INDEX_MAX_ROWS; output and gradients against the float64 loop."""
    from moe_ffn import grouped

    _needs_avx512_kernel()
    monkeypatch.setattr(_small_gemm, "sgemm_at_avx2_width", lambda: True)
    gathered = []
    rows = grouped._rows
    monkeypatch.setattr(grouped, "_rows", lambda src, token_N, *a: gathered.append(token_N is not None) or rows(src, token_N, *a))
    torch.manual_seed(5)
    # (D, F = 128: the input gradients' kernel takes 64 columns a thread)
    _layer_against_float64(T=T, moe=MoE(dim=128, hidden_dim=128, num_experts=4, top_k=2))
    assert sum(gathered) == (0 if T == 40 else 1)  # (T = 200: the forward's one gather of x, ~100-row blocks)


def test_float32_forward_sends_its_small_blocks_in_one_call_and_the_rest_one_by_one(monkeypatch):
    """float32 blocks on the AVX-512 forward kernel: where some of a group's blocks are past the
    rows linear_blocks takes, the others still go in one call of it (the large ones one by one);
    the result is the float64 forward's, and bit for bit the every-block-by-itself path's."""
    from moe_ffn import grouped

    most = _small_gemm.float32_blocks_max_rows(torch.ones(1, 1))
    if most == 0:
        pytest.skip("the AVX-512 float32 forward kernel does not run here")
    torch.manual_seed(11)
    D, F = 64, 48
    counts = torch.tensor([most + 12, 9, most, 0, most + 1, 17, 1])
    x = torch.randn(int(counts.sum()), D)
    w1, w2 = torch.randn(len(counts), 2 * F, D) / 8, torch.randn(len(counts), D, F) / 8
    calls = []
    blocks_call = _small_gemm.linear_blocks

    def spy(x_, w_, blocks, out=None, index=None):
        y = blocks_call(x_, w_, blocks, out=out, index=index)
        calls.append((w_.shape[1], [stop - start for _, start, stop in blocks], y is not None))
        return y

    monkeypatch.setattr(_small_gemm, "linear_blocks", spy)
    y = grouped.grouped_ffn(x, w1, w2, counts, activation="silu", gated=True)
    small = [c for c in counts.tolist() if 0 < c <= most]
    assert (2 * F, small, True) in calls and (D, small, True) in calls  # both projections' small blocks, one call each
    ref, start = torch.empty(x.shape, dtype=torch.float64), 0
    for e, c in enumerate(counts.tolist()):
        h = x[start : start + c].double() @ w1[e].double().t()
        ref[start : start + c] = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ w2[e].double().t()
        start += c
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-5 * float(ref.abs().max()))
    _per_block(monkeypatch)
    assert torch.equal(y, grouped.grouped_ffn(x, w1, w2, counts, activation="silu", gated=True))


def test_float32_backward_blocks_on_intel_take_small_groups_only(monkeypatch):
    """Where MKL's sgemm runs its AVX-512 code (Intel's CPUs; that state forced here), the
    float32 blocks entry points take a group only where every block has at most
    INTEL_FLOAT32_BLOCKS[0] rows through an expert weight of at most INTEL_FLOAT32_BLOCKS[1]
    elements, within float32's bound of the float64 products; otherwise they decline, nothing
    written."""
    _needs_avx512_kernel()
    monkeypatch.setattr(_small_gemm, "sgemm_at_avx2_width", lambda: False)
    monkeypatch.setattr(_small_gemm, "_vendor_is_amd", lambda: False)
    most_rows, most_elements = _small_gemm.INTEL_FLOAT32_BLOCKS
    torch.manual_seed(23)
    E, O, I = 3, 64, 128
    small = [(2, 0, 5), (0, 5, 5 + most_rows)]
    rows = small[-1][2] + 1
    g, w = torch.randn(rows, O), torch.randn(E, O, I)
    out = torch.full((rows, I), float("nan"))
    assert _small_gemm.float32_input_grad_blocks(out, g, w, small)
    for e, start, stop in small:
        ref = g[start:stop].double() @ w[e].double()
        bound = O * 2.0**-24 * (g[start:stop].double().abs() @ w[e].double().abs())
        assert ((out[start:stop].double() - ref).abs() <= bound + 1e-30).all()
    a, b = torch.randn(rows, 32), torch.randn(rows, 48)
    grads = torch.full((E, 32, 48), float("nan"))
    assert _small_gemm.float32_weight_grad_blocks(grads, a, b, small, [False, False]) == [True, True]
    for e, start, stop in small:
        ref = a[start:stop].double().t() @ b[start:stop].double()
        bound = (stop - start) * 2.0**-24 * (a[start:stop].double().abs().t() @ b[start:stop].double().abs())
        assert ((grads[e].double() - ref).abs() <= bound + 1e-30).all()
    too_long = [(2, 0, 5), (0, 5, 6 + most_rows)]
    fresh = torch.full((rows, I), float("nan"))
    fresh_grads = torch.full((E, 32, 48), float("nan"))
    assert not _small_gemm.float32_input_grad_blocks(fresh, g, w, too_long)
    assert _small_gemm.float32_weight_grad_blocks(fresh_grads, a, b, too_long, [False, False]) == [False, False]
    monkeypatch.setattr(_small_gemm, "INTEL_FLOAT32_BLOCKS", (most_rows, O * I - 1))  # the weight too large
    assert not _small_gemm.float32_input_grad_blocks(fresh, g, w, small)
    monkeypatch.setattr(_small_gemm, "INTEL_FLOAT32_BLOCKS", (most_rows, 32 * 48 - 1))
    assert _small_gemm.float32_weight_grad_blocks(fresh_grads, a, b, small, [False, False]) == [False, False]
    assert fresh.isnan().all() and fresh_grads.isnan().all()


@pytest.mark.parametrize("outer_rows", [128, None])
@pytest.mark.parametrize("streamed", [False, True])
def test_float32_backward_blocks_in_one_call_are_the_per_block_products(monkeypatch, streamed, outer_rows):
    """The float32 blocks entry points of the backward (AMD's AVX-512 CPUs; here on any AVX-512
    CPU): input gradients g·w_e and weight gradients aᵀ·b of blocks of 1 to 300 rows, some
    adding to their expert's earlier piece, each bit for bit what the single-block kernel the
    layer would call gives (`avx512_matmul_into`, `avx512_weight_grad_into` to
    SGEMM_AVX2_WEIGHT_GRAD_ROWS), and within float32's bound of the float64 products. With
    those rows at 128, an accumulating block past them is left to the caller, untouched; at
    their own 8192, the weight-gradient kernel takes every block, adding ones too."""
    _needs_avx512_kernel()
    monkeypatch.setattr(_small_gemm, "sgemm_at_avx2_width", lambda: True)
    if outer_rows is not None:
        monkeypatch.setattr(_small_gemm, "SGEMM_AVX2_WEIGHT_GRAD_ROWS", (1, outer_rows))
    outer = _small_gemm.SGEMM_AVX2_WEIGHT_GRAD_ROWS[1]
    torch.manual_seed(21 + streamed)
    E, O, I = 4, 72, 160
    m, n = (512, 1024) if streamed else (40, 136)  # (2^19 elements: streaming stores)
    spans = [(2, 0, 5), (0, 5, 40), (3, 40, 41), (1, 41, 300), (0, 300, 428), (2, 428, 560)]
    rows = spans[-1][2]
    g, w = torch.randn(rows, O), torch.randn(E, O, I)
    out = torch.full((rows, I), float("nan"))
    assert _small_gemm.float32_input_grad_blocks(out, g, w, spans)
    for e, start, stop in spans:
        want = torch.empty(stop - start, I)
        assert _small_gemm.avx512_matmul_into(want, g[start:stop], w[e])
        assert torch.equal(out[start:stop], want)
        ref = g[start:stop].double() @ w[e].double()
        bound = O * 2.0**-24 * (g[start:stop].double().abs() @ w[e].double().abs())
        assert ((out[start:stop].double() - ref).abs() <= bound + 1e-30).all()
    assert not _small_gemm.float32_input_grad_blocks(out, g, w[:, :, :100], spans)  # 50 columns a thread: declined

    a, b = torch.randn(rows, m), torch.randn(rows, n)
    again = [False, False, False, False, True, True]  # expert 0's second piece (128 rows) adds; expert 2's (132) cannot
    grads = torch.randn(E, m, n)  # old contents, written over where a block does not add
    before = grads.clone()
    done = _small_gemm.float32_weight_grad_blocks(grads, a, b, spans, again)
    assert done == [True, True, True, True, True, outer > 128]
    want = before.clone()
    for (e, start, stop), add, d in zip(spans, again, done):
        if not d:
            continue
        a_t = a[start:stop].t()
        if stop - start <= outer:
            assert _small_gemm.avx512_weight_grad_into(want[e], a_t, b[start:stop], accumulate=add, limits=(1, outer))
        else:
            assert not add and _small_gemm.avx512_matmul_into(want[e], a_t, b[start:stop])
    assert torch.equal(grads, want)  # (with 128 rows: expert 2 its first piece only; the caller adds the second)
    for e in range(E):
        pieces = [(start, stop) for (x, start, stop), d in zip(spans, done) if x == e and d]
        ref = sum(a[s:t].double().t() @ b[s:t].double() for s, t in pieces)
        bound = sum((t - s) * 2.0**-24 * (a[s:t].double().abs().t() @ b[s:t].double().abs()) for s, t in pieces)
        assert ((grads[e].double() - ref).abs() <= bound * 2 + 1e-30).all(), e


@pytest.mark.parametrize("T", [12, 80])
def test_layer_matches_float64_on_torch_kernels(torch_kernels_only, torch_choices, T):
    """Without the kernel, with grouped.py's AVX2 and its AVX-512 choices among torch's kernels."""
    _layer_against_float64(T=T)


def test_bf16_layer_forward_runs_on_the_kernel_and_matches_float64(monkeypatch):
    """A bf16 layer's forward at decode sizes (blocks of a few rows): the whole forward in one
    call of the kernel (routed_swiglu_blocks, bf16 weights read as they are); with that call
    declining, all blocks in one call per projection (linear_blocks): the same bits; the output
    within bf16 rounding of the float64 loop. (On CPUs with AMX the AMX kernel would take most
    of these blocks first: switched off here, see test_amx.py; on CPUs with bf16 units the
    kernel takes only 1–2-row blocks: widened here; on CPUs with AVX512-BF16 their bf16
    forward kernel takes the blocks first: switched off, see _needs_bf16_blocks' tests.)"""
    _needs_kernel()
    from moe_ffn import _amx, grouped

    _avx2_kernels(monkeypatch)
    monkeypatch.setattr(_amx, "available", lambda: False)
    monkeypatch.setattr(grouped, "_cpu_has_matrix_units", lambda dtype: False)
    ran = {}
    _count_calls(monkeypatch, ran, ("linear_blocks", "routed_swiglu_blocks"))
    torch.manual_seed(5)
    D, F, E, K, T = 64, 48, 4, 2, 10
    moe = MoE(dim=D, hidden_dim=F, num_experts=E, top_k=K).bfloat16()
    x = torch.randn(T, D).bfloat16()
    with torch.no_grad():
        y = moe(x)
    assert ran == {"routed_swiglu_blocks": 1}  # the whole forward in one call
    routed = _small_gemm.routed_swiglu_blocks
    monkeypatch.setattr(_small_gemm, "routed_swiglu_blocks", lambda *args: None)
    ran.clear()
    with torch.no_grad():
        y_apart = moe(x)
    assert ran == {"linear_blocks decode": 2}  # one call per projection
    assert torch.equal(y.view(torch.int16), y_apart.view(torch.int16))
    params = [p.detach().double() for p in (moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj)]
    ref = moe_forward(x.double(), *params, K)
    assert ((y.double() - ref).abs() <= 3e-2 * ref.abs().max()).all()
    monkeypatch.setattr(_small_gemm, "routed_swiglu_blocks", routed)


@pytest.mark.parametrize("dims", [(40, 24), (200, 104), (1024, 256)], ids=["small", "row-split", "streamed"])
@pytest.mark.parametrize("kernel", ["avx2", "avx512"])
def test_layer_overwrites_kept_gradient_memory_on_the_kernel_and_matches_float64(monkeypatch, kernel, dims):
    """Second and third steps on the first step's weight-gradient memory (moe_ffn._memory),
    which grouped.py overwrites with the kernel: here every buffer is kept and every output
    counts as large, so the layer's small experts take that path; each step against the
    float64 loop. kernel "avx2": the AVX2 kernel's path (on AVX-512 CPUs the AVX-512 kernel
    takes these weight gradients first: switched off), its column split (gradients of at most
    192 rows, "small"), its row split (more rows, "row-split") and that with streaming stores
    (2^19 elements and more on the kept mapping, "streamed"); "avx512": that kernel (never
    reading the old gradient), on AVX-512 CPUs only."""
    _needs_kernel()
    from moe_ffn import _memory, grouped

    ran = []
    if kernel == "avx2":
        monkeypatch.setattr(_small_gemm, "avx512_weight_grad_into", lambda *args, **kwargs: False)
        name = "weight_grad_into"
    else:
        _needs_avx512_kernel()
        name = "avx512_weight_grad_into"
        blocks_f32 = _small_gemm.float32_weight_grad_blocks  # (AMD's: a group's blocks in one call)

        def counted_blocks(*args, **kwargs):
            done = blocks_f32(*args, **kwargs)
            ran.extend(d for d in done if d)
            return done
        monkeypatch.setattr(_small_gemm, "float32_weight_grad_blocks", counted_blocks)
        one_call = _small_gemm.avx512_routed_swiglu_backward_blocks  # (small steps: both projections' blocks)
        monkeypatch.setattr(_small_gemm, "avx512_routed_swiglu_backward_blocks", lambda *a: ran.extend([one_call(*a)] * 2 * len(a[-1])) or ran[-1])
    monkeypatch.setattr(_memory, "_keep_gradient_memory", lambda: True)
    monkeypatch.setattr(_memory, "_MIN_BYTES", 0)
    monkeypatch.setattr(grouped, "_ACCUMULATE_ELEMENTS", 0)
    real = getattr(_small_gemm, name)
    monkeypatch.setattr(_small_gemm, name, lambda *a, **k: ran.append(real(*a, **k)) or ran[-1])
    if kernel == "avx2":  # (the blocks of a group in one call: each block's product counted)
        _avx2_kernels(monkeypatch)
        blocks = _small_gemm.weight_grad_blocks
        monkeypatch.setattr(_small_gemm, "weight_grad_blocks", lambda out, a, b, bl, acc: ran.extend([blocks(out, a, b, bl, acc)] * len(bl)) or ran[-1])
        one_call = _small_gemm.routed_swiglu_backward_blocks  # (decode-sized steps: both projections' blocks)
        monkeypatch.setattr(_small_gemm, "routed_swiglu_backward_blocks", lambda *a: ran.extend([one_call(*a)] * 2 * len(a[-1])) or ran[-1])
    moe = MoE(dim=dims[0], hidden_dim=dims[1], num_experts=4, top_k=2)
    try:
        for step in range(3):  # other tokens each step: stale gradients would not pass
            _layer_against_float64(12, moe, seed=step)
    finally:
        _memory.release_gradient_memory()
    assert ran.count(True) >= 2 * 2 * 3  # both projections of (almost) every expert, steps 2 and 3


@pytest.mark.skipif(os.environ.get("MOE_FFN_SMALL_GEMM") == "0", reason="switched off by MOE_FFN_SMALL_GEMM=0")
def test_avx512_gradients_run_where_sgemm_runs_at_avx2_width():
    """On an AMD CPU that torch runs at AVX-512 (MKL's sgemm there runs its AVX2 code), with
    the library built, float32 gradients must go to the AVX-512 kernels: the choice must not
    fall back to torch's kernels unnoticed. Read here from /proc/cpuinfo on its own."""
    try:
        amd = "AuthenticAMD" in Path("/proc/cpuinfo").read_text()
    except OSError:
        amd = False
    if not amd or torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("not an AMD CPU that torch runs at AVX-512")
    assert _small_gemm.library() is not None, "the kernel library did not build (test_kernel_is_built_here)"
    assert _small_gemm.sgemm_at_avx2_width()
    assert _small_gemm._matmul_entry_point() is not None


@pytest.mark.parametrize(
    "m, k, n",
    [(1, 1, 1), (5, 17, 3), (7, 129, 70), (97, 300, 130), (200, 257, 1040), (13, 1024, 100), (6, 128, 64),
     (1, 300, 1040), (1, 1024, 600)],
)
@pytest.mark.parametrize("a_transposed", [False, True])
def test_avx512_matmul_matches_float64(m, k, n, a_transposed):
    """a·b on the blocked product into a slice of a wider tensor holding NaNs (old contents
    never read, margins untouched): row tiles of 6 and their tails, more than one 96-row block,
    sums past one 128-step pass (added onto the first), 64-column panels and masked tails, the
    threads splitting columns (n ≥ 128) or rows; a as it lies or as the transpose of [k, m];
    one row in 256-column panels, then 64-column ones and a tail, in each thread's columns."""
    _needs_avx512_kernel()
    a = _strided(k, m).t() if a_transposed else _strided(m, k)
    b = _strided(k, n)
    wide = torch.full((m, n + 20), float("nan"))
    out = wide[:, 4 : n + 4]
    assert _small_gemm.avx512_matmul_into(out, a, b)
    exact = a.double() @ b.double()
    assert ((out.double() - exact).abs() <= _bound(a.double().abs(), b.double().abs(), k)).all()
    assert wide[:, :4].isnan().all() and wide[:, n + 4 :].isnan().all()


def test_avx512_matmul_declines_what_it_does_not_take():
    _needs_avx512_kernel()
    a, b, out = torch.randn(8, 16), torch.randn(16, 24), torch.full((8, 24), 7.0)
    assert not _small_gemm.avx512_matmul_into(out.double(), a.double(), b.double())
    assert not _small_gemm.avx512_matmul_into(out, a, torch.randn(24, 16).t())  # b's rows not contiguous
    assert not _small_gemm.avx512_matmul_into(out, torch.randn(32, 16)[::2, ::2].t(), b)  # neither layout of a
    assert not _small_gemm.avx512_matmul_into(torch.full((8, 0), 7.0), torch.randn(8, 0), torch.randn(0, 0))
    assert bool((out == 7).all())
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.avx512_matmul_into(out, a, torch.randn(15, 24))
    with pytest.raises(ValueError, match="2-d tensors expected"):
        _small_gemm.avx512_matmul_into(out, a.unsqueeze(0), b)


def _scatter_add_reference(out, token, src, weight):
    """out[token[i]] += src[i]·weight[i] row after row in float32, the product rounded on its
    own before the sum (torch's float32 ops on whole rows: no fused multiply-add)."""
    want = out.clone()
    for i, t in enumerate(token.tolist()):
        row = src[i].float() if weight is None else src[i].float() * weight[i]
        want[t] = want[t] + row
    return want


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("cols", [5, 64, 1030])
def test_scatter_add_rows_adds_each_row_in_order(src_dtype, weighted, cols):
    """out[token[i]] += src[i]·weight[i], bit for bit the row-by-row float32 reference: tokens
    repeated (their rows added in order), columns in whole 8s and a tail, src rows strided, out
    a slice of a wider tensor whose margins stay untouched; one thread gives the same."""
    _needs_kernel()
    torch.manual_seed(3)
    T, n = 37, 300
    token = torch.randint(0, T, (n,))
    token[:4] = torch.tensor([5, 5, 5, 36])
    src = torch.randn(n, cols + 3).to(src_dtype)[:, 1 : cols + 1]
    src[0] *= 1e8  # sums where the order of the additions shows
    weight = torch.rand(n) if weighted else None
    wide = torch.full((T, cols + 4), float("nan"))
    out = wide[:, 2 : cols + 2]
    out.copy_(torch.randn(T, cols))
    want = _scatter_add_reference(out, token, src, weight)
    start = out.clone()
    assert _small_gemm.scatter_add_rows(out, token, src, weight)
    assert torch.equal(out, want)
    assert wide[:, :2].isnan().all() and wide[:, cols + 2 :].isnan().all()
    single = start.clone()
    assert _on_one_thread(lambda: _small_gemm.scatter_add_rows(single, token, src, weight))
    assert torch.equal(single, want)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("cols", [5, 64, 1030])
def test_slot_sum_rows_writes_each_tokens_sum_in_row_order(src_dtype, weighted, cols):
    """out[t] = the sum of token t's rows src[i]·weight[i] in ascending i, written over whatever
    out held: bit for bit the row-by-row float32 reference on a zeroed out (the order of the
    additions shows: a row of 1e8 first), tokens without rows zeros (-0 products included:
    +0, as 0 + -0 is), columns in whole 8s and a tail, src rows strided, out a slice of a wider
    tensor whose margins stay untouched; one thread gives the same; a bf16 out gets the sums
    rounded as .bfloat16() rounds them (a NaN row's sums NaN)."""
    _needs_kernel()
    torch.manual_seed(4)
    T, n = 37, 300
    token = torch.randint(0, T - 3, (n,))  # tokens 34–36 get no rows
    token[:4] = torch.tensor([5, 5, 5, 33])
    src = torch.randn(n, cols + 3).to(src_dtype)[:, 1 : cols + 1]
    src[0] *= 1e8
    src[3] = -0.0  # token 33's first row: its sum starts at +0 (0 + -0), as the zeroed reference's
    weight = torch.rand(n) if weighted else None
    wide = torch.full((T, cols + 4), float("nan"))
    out = wide[:, 2 : cols + 2]
    out.copy_(torch.randn(T, cols))  # overwritten, not added to
    want = _scatter_add_reference(torch.zeros(T, cols), token, src, weight)
    assert _small_gemm.slot_sum_rows(out, token, src, weight)
    assert torch.equal(out, want) and torch.equal(out[34:], torch.zeros(3, cols))
    assert torch.equal(torch.signbit(out), torch.signbit(want))  # (torch.equal takes -0 for +0)
    assert wide[:, :2].isnan().all() and wide[:, cols + 2 :].isnan().all()
    single = torch.randn(T, cols)
    assert _on_one_thread(lambda: _small_gemm.slot_sum_rows(single, token, src, weight))
    assert torch.equal(single, want)
    scattered = torch.zeros(T, cols)
    assert _small_gemm.scatter_add_rows(scattered, token, src, weight)
    assert torch.equal(torch.signbit(out), torch.signbit(scattered)) and torch.equal(out, scattered)
    wide16 = torch.full((T, cols + 4), float("nan"), dtype=torch.bfloat16)
    out16 = wide16[:, 2 : cols + 2]  # a bf16 out: each float32 sum rounded once, as torch rounds it
    src[5] = float("nan")
    want = _scatter_add_reference(torch.zeros(T, cols), token, src, weight).bfloat16()
    assert _small_gemm.slot_sum_rows(out16, token, src, weight)
    nan = want.isnan()  # (NaN bits differ between torch's own roundings: 0xFFFF vectorised)
    assert torch.equal(out16.isnan(), nan) and nan.any()
    assert torch.equal(out16.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert wide16[:, :2].isnan().all() and wide16[:, cols + 2 :].isnan().all()


@pytest.mark.parametrize("name", ["scatter_add_rows", "slot_sum_rows"])
def test_slot_sums_decline_and_name_misfits(name):
    """A token out of range: False and out untouched (the caller's index_add_ then raises); other
    dtypes (a float16 out; scatter_add_rows a bf16 one too) or a strided token: False; shapes
    that do not fit: an error naming the entry point and them."""
    _needs_kernel()
    run = getattr(_small_gemm, name)
    out = torch.full((4, 16), 7.0)
    src = torch.ones(3, 16)
    for bad in ([0, 1, 4], [0, -1, 2]):
        assert not run(out, torch.tensor(bad), src)
        assert bool((out == 7).all())
    token = torch.tensor([0, 1, 2])
    assert not run(out.half(), token, src)
    assert name == "slot_sum_rows" or not run(out.bfloat16(), token, src)
    assert not run(out, token.int(), src)
    assert not run(out, torch.tensor([0, 9, 1, 9, 2, 9])[::2], src)
    assert not run(out, token, src, torch.ones(3, dtype=torch.float64))
    assert bool((out == 7).all())
    with pytest.raises(ValueError, match=rf"{name}: .*do not fit.*out \[T, D\]"):
        run(out, token, torch.ones(3, 15))
    with pytest.raises(ValueError, match="do not fit"):
        run(out, token, src, torch.ones(2))


@pytest.mark.parametrize(
    "T, E, k", [(1, 8, 2), (37, 8, 8), (300, 64, 8), (5000, 64, 8), (200, 128, 6), (64, 256, 8), (100, 40, 12), (50, 13, 13), (9, 3, 1)]
)
@pytest.mark.parametrize("scores", ["softmax", "ties", "strided"])
def test_topk_ids_are_a_stable_descending_sort(T, E, k, scores):
    """The top-k kernel's columns (`topk_ids`: k ≤ 8 in a vector register, past 8 by
    insertion): the first k of a stable descending sort, so torch.topk's indices wherever the
    scores differ and, of equal ones (±0, ±inf among them), the lower column first; rows of a
    wider tensor too. A NaN anywhere, k outside [1, E], or scores not float32 on the CPU: None."""
    if _small_gemm.library() is None:
        pytest.skip("the kernel library is not built here")
    torch.manual_seed(T * E + k)
    if scores == "ties":
        s = torch.tensor([0.0, -0.0, 1.0, float("inf"), float("-inf"), 0.5])[torch.randint(0, 6, (T, E))]
    else:
        s = torch.randn(T, E + 7)[:, 3 : E + 3] if scores == "strided" else torch.randn(T, E)
        s = s.softmax(-1)
    ids = _small_gemm.topk_ids(s, k)
    assert ids is not None and ids.dtype == torch.int64 and ids.shape == (T, k)
    assert torch.equal(ids, torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k])
    if scores == "softmax":
        assert torch.equal(ids, s.topk(k, -1).indices)
    s = s.clone()
    s[T // 2, E - 1] = float("nan")
    assert _small_gemm.topk_ids(s, k) is None
    assert _small_gemm.topk_ids(s[:0], k) is not None and _small_gemm.topk_ids(s, E + 1) is None and _small_gemm.topk_ids(s, 0) is None
    assert _small_gemm.topk_ids(s.double(), k) is None


def _nan_margins(rows: int, cols: int):
    """(out, wide): out a bf16 [rows, cols] slice of `wide`, whose other columns hold NaN."""
    wide = torch.full((rows, cols + 48), float("nan"), dtype=torch.bfloat16)
    return wide[:, 16 : cols + 16], wide


def _margins_untouched(wide: torch.Tensor, cols: int) -> bool:
    return bool(wide[:, :16].isnan().all() and wide[:, cols + 16 :].isnan().all())


# sizes: the dot tiles' blocks (1, 5, 24, 25 rows), the outer products' (30, 31, 32, 33 and 40 —
# a tail of 1 and 8 rows on the dot tiles —, 48, 64, 100), a block past BF16_FORWARD_MAX_ROWS (in pieces);
# F: whole chunks of kSwigluChunk (48, 96), a part chunk (64, 100: a part vector too); I odd: all
# on the dot tiles
@pytest.mark.parametrize(
    "F, I, sizes, gathered, keep_h",
    [(48, 64, [1, 5, 24, 25], False, True), (64, 96, [33, 40, 100, 2], True, True), (100, 128, [32, 48, 7], True, False),
     (96, 33, [3, 30, 64], False, True), (512, 1024, [31, 9, 40, 30], True, True),
     (32, 64, [_small_gemm.BF16_FORWARD_MAX_ROWS + 37], False, False)],
)
def test_bf16_swiglu_forward_blocks_are_the_product_then_the_activation(monkeypatch, F, I, sizes, gathered, keep_h):
    """h and a of `bf16_swiglu_forward_blocks` (AVX512-BF16, no AMX) bit for bit `linear_blocks`'
    h and `_amx.swiglu`'s a of that h, and a within torch's own bf16 silu(gate)·up of it (which
    rounds silu's result too, where its exp may differ from ours in the last bit); on one thread
    and on two; rows between the blocks and the columns beside them untouched."""
    _needs_bf16_blocks()
    monkeypatch.setattr(_small_gemm, "_vendor_is_amd", lambda: True)  # (Zen 4: blocks past the most rows in pieces)
    monkeypatch.setattr(_small_gemm, "_cpu_family", lambda: 25)
    torch.manual_seed(F + I)
    E = 3
    w = (torch.randn(E, 2 * F, I + 32) * 0.1).bfloat16()[:, :, 16 : I + 16]
    blocks, start = [], 0
    for i, n in enumerate(sizes):
        blocks.append(((2 * i) % E, start, start + n))
        start += n + 2  # (two rows between blocks)
    N = start
    x = torch.randn(N + 3 if not gathered else 40, I + 8).bfloat16()[1 : N + 1 if not gathered else 38, 4 : I + 4]  # (rows strided)
    index = torch.randint(0, x.shape[0], (N,)) if gathered else None
    rows = x[index] if gathered else x
    h_want = torch.full((N, 2 * F), float("nan"), dtype=torch.bfloat16)
    assert _small_gemm.linear_blocks(rows.contiguous(), w, blocks, out=h_want) is h_want
    a_want = torch.full((N, F), float("nan"), dtype=torch.bfloat16)
    for _, lo, hi in blocks:
        a_want[lo:hi] = _amx.swiglu(h_want[lo:hi])
        gate, up = h_want[lo:hi].chunk(2, dim=1)
        torch_a = torch.nn.functional.silu(gate) * up
        assert torch.allclose(a_want[lo:hi].float(), torch_a.float(), rtol=2**-7, atol=1e-30)
    for threads in (1, 2):
        h, h_wide = _nan_margins(N, 2 * F)
        a, a_wide = _nan_margins(N, F)
        assert _with_threads(
            threads, lambda: _small_gemm.bf16_swiglu_forward_blocks(h if keep_h else None, a, x, w, blocks, index=index)
        )
        assert torch.equal(a.view(torch.int16), a_want.view(torch.int16)) and _margins_untouched(a_wide, F)
        if keep_h:
            assert torch.equal(h.view(torch.int16), h_want.view(torch.int16)) and _margins_untouched(h_wide, 2 * F)
        else:
            assert h_wide.isnan().all()


def test_bf16_swiglu_forward_blocks_many_small_blocks_taken_whole():
    """Blocks many and small enough for the threads to take whole ones each (the kernel's
    whole_blocks: 16 and more blocks of at most 128 rows on average on two threads): the same h
    and a as the product then `_amx.swiglu`, every expert's block on either thread."""
    _needs_bf16_blocks()
    torch.manual_seed(5)
    E, F, I, T = 20, 64, 128, 90
    w = (torch.randn(E, 2 * F, I) * 0.1).bfloat16()
    sizes = [(7 * e) % 45 + 1 for e in range(E)]
    blocks, rows = _blocks_in_turn([(e, n) for e, n in enumerate(sizes)])
    x = torch.randn(T, I).bfloat16()
    index = torch.randint(0, T, (rows,))
    h_want = _small_gemm.linear_blocks(x, w, blocks, index=index)
    h, a = torch.empty(rows, 2 * F, dtype=torch.bfloat16), torch.empty(rows, F, dtype=torch.bfloat16)
    assert _with_threads(2, lambda: _small_gemm.bf16_swiglu_forward_blocks(h, a, x, w, blocks, index=index))
    assert torch.equal(h.view(torch.int16), h_want.view(torch.int16))
    assert torch.equal(a.view(torch.int16), _amx.swiglu(h_want).view(torch.int16))


def test_bf16_swiglu_forward_blocks_round_the_screens_edges_and_nan_as_swiglu():
    """Gates and ups at and just past swiglu16's native rounding screen (2^-24 … 16 and 2^-24 …
    2^24), zeros, huge values, products act·up that are subnormal, a NaN row, through the dot
    tiles (20 rows) and the outer products (40): h and a bit for bit `linear_blocks`' and
    `_amx.swiglu`'s. h = x exactly (w the identity)."""
    _needs_bf16_blocks()
    F = 32
    w = torch.eye(2 * F, dtype=torch.bfloat16).unsqueeze(0)
    x = torch.randn(40, 2 * F).bfloat16()
    edges = [2.0**-24, 2.0**-25, 16.0, 16.125, -16.0, -90.0, 0.0, -0.0, 3.0e38, -3.0e38, 2.0**24, 2.0**25, 1.0, -2.5]
    for r in range(14):
        x[r, r % F] = edges[r]  # a gate
        x[r, F + (r * 7) % F] = edges[(r + 5) % len(edges)]  # an up
    x[14, 5] = float("nan")
    x[15, 3], x[15, F + 3] = 2.0**-110, 2.0**-20  # a = act·up subnormal (2^-131): kept by torch, flushed by the instruction
    x[16, 9], x[16, F + 9] = -88.0, 2.0**-7
    x[20:] = x[:20]
    for blocks in ([(0, 0, 20)], [(0, 0, 40)]):
        rows = blocks[0][2]
        h_want = _small_gemm.linear_blocks(x[:rows], w, blocks)
        assert torch.equal(h_want[:14], x[:14])  # (the identity: h holds the edges as they are)
        h, a = torch.empty(rows, 2 * F, dtype=torch.bfloat16), torch.empty(rows, F, dtype=torch.bfloat16)
        assert _small_gemm.bf16_swiglu_forward_blocks(h, a, x[:rows], w, blocks)
        assert torch.equal(h.view(torch.int16), h_want.view(torch.int16))
        assert torch.equal(a.view(torch.int16), _amx.swiglu(h_want).view(torch.int16))
        assert a[14].isnan().all()
        assert 0 < a[15, 3].float().abs() < 2.0**-126 and 0 < a[16, 9].float().abs() < 2.0**-126  # (the cases hold)


def test_bf16_swiglu_forward_blocks_decline_or_refuse_what_they_do_not_take():
    """A float32 operand, a block of no rows or past the forward's most rows, an odd 2F: False
    with nothing written; x, h or a too narrow or short for the blocks, an expert outside w, an
    index outside x's rows: ValueError naming them, nothing written."""
    _needs_bf16_blocks()
    bf16 = torch.bfloat16
    E, F, I = 2, 32, 64
    w = torch.randn(E, 2 * F, I).bfloat16()
    x = torch.randn(40, I).bfloat16()
    h, a = torch.full((40, 2 * F), 7.0, dtype=bf16), torch.full((40, F), 7.0, dtype=bf16)
    most = _small_gemm.bf16_forward_max_rows(E)
    declined = [
        (h, a, x.float(), w, [(0, 0, 8)]),
        (h, a.float(), x, w, [(0, 0, 8)]),
        (h, a, x, w, [(0, 4, 4)]),
        (h, a, x, w, [(0, 0, most + 1)]),
        (h, a, x, torch.randn(E, 2 * F + 1, I).bfloat16(), [(0, 0, 8)]),
    ]
    for args in declined:
        assert not _small_gemm.bf16_swiglu_forward_blocks(*args)
    refused = [
        ((h, a, x[:, :I - 2], w, [(0, 0, 8)]), r"x \(40, 62\)"),
        ((h[:, :F], a, x, w, [(0, 0, 8)]), r"h \(40, 32\)"),
        ((h, a[:, :8], x, w, [(0, 0, 8)]), r"a \(40, 8\)"),
        ((h, a, x[:20], w, [(0, 10, 30)]), "blocks of 30 rows"),
        ((h, a, x, w, [(2, 0, 8)]), "do not fit"),
    ]
    for args, message in refused:
        with pytest.raises(ValueError, match=message):
            _small_gemm.bf16_swiglu_forward_blocks(*args)
    index = torch.tensor([0, 3, 40, 9])
    with pytest.raises(ValueError, match=r"must lie in \[0, 40\), got 0 to 40"):
        _small_gemm.bf16_swiglu_forward_blocks(h, a, x, w, [(1, 0, 4)], index=index)
    assert bool((h == 7).all() and (a == 7).all())


@pytest.mark.parametrize("rows", [8, 33])
def test_bf16_packed_weight_grad_checks_nan_unless_every_sum_is_finite(rows):
    """The packed-pairs weight gradient skips its NaN check only where its operands keep every
    sum finite (the kernel's finite_sums): a negative NaN in a (unchecked, the rounding
    instruction keeps its sign: 0xFFC0) and an infinity against the other sign's (x86's NaN,
    0xFFC00000) come out as torch's bf16 NaN, 0x7FC0; finite operands whose products overflow
    give ±inf or that NaN, never 0xFFC0 (how the products' instruction carries an overflow is
    the CPU's); the other sums within one rounding of float64's. Operands just inside the
    bound (m² · rows ≤ 2^120, m = 2^56) skip the check: every sum within one rounding of
    float64's. Whole panels of 64 columns, tiles of 6 rows."""
    _needs_bf16_blocks()
    M, N = 12, 128
    torch.manual_seed(rows)
    base_a, base_b = torch.randn(rows, M).bfloat16(), torch.randn(rows, N).bfloat16()
    for case in ("nan", "inf", "overflow"):
        a, b = base_a.clone(), base_b.clone()
        a[:4, :4], b[:4, :64] = 0.0, 0.0  # c's rows 0-3 by columns 0-63: the case alone
        if case == "nan":
            a[1, :4] = torch.tensor([0xFFC0 - 0x10000], dtype=torch.int16).view(torch.bfloat16)
        elif case == "inf":
            a[0, :4], a[2, :4] = float("inf"), float("inf")
            b[0, :64], b[2, :64] = 1.0, -1.0
        else:  # products 2^200 and −2^200 in turn (rows 0 and 2: two pair steps)
            a[0, :4], a[2, :4] = 2.0**100, 2.0**100
            b[0, :64], b[2, :64] = 2.0**100, -(2.0**100)
        grads = torch.full((1, M, N), 7.0, dtype=torch.bfloat16)
        assert _small_gemm.bf16_weight_grad_blocks(grads, a, b, [(0, 0, rows)], [False])
        bits = grads[0].view(torch.int16).int() & 0xFFFF
        case_bits = bits[:4, :64]
        if case == "overflow":
            assert bool(((case_bits == 0x7FC0) | (case_bits == 0x7F80) | (case_bits == 0xFF80)).all()), case_bits.unique()
        else:
            assert (case_bits == 0x7FC0).all(), case_bits.unique()
        rest_a = a[:, 4:].double()  # (c's rows past the case's)
        _bf16_within_one_rounding(grads[0][4:], rest_a.t() @ b.double(), _bound(rest_a.abs().t(), b.double().abs(), rows))
    big, other = base_a.clone(), base_b.clone()
    big[0, 0], other[0, 0] = -(2.0**56), 2.0**56
    assert float(big.double().abs().max()) ** 2 * rows <= 2.0**120
    grads = torch.full((1, M, N), 7.0, dtype=torch.bfloat16)
    assert _small_gemm.bf16_weight_grad_blocks(grads, big, other, [(0, 0, rows)], [False])
    _bf16_within_one_rounding(grads[0], big.double().t() @ other.double(), _bound(big.double().abs().t(), other.double().abs(), rows))


@pytest.mark.parametrize(
    "shape, dtype, runs",
    [
        ((9, 120, 1001), torch.float32, [(0, 2), (3, 4), (6, 9)]),  # slices not 32-byte aligned
        ((7, 333), torch.bfloat16, [(1, 2), (4, 7)]),
        ((64, 1024, 512), torch.bfloat16, [(0, 5), (9, 40), (63, 64)]),  # past 1 MiB: on the team
        ((3, 5), torch.float32, []),
    ],
)
def test_zero_streaming_zeroes_exactly_the_runs(shape, dtype, runs):
    """The idle experts' slices of a kept weight gradient (_memory.gradient_memory): zeros over
    every run of the first dim, every other byte as it was, at any alignment."""
    _needs_kernel()
    t = torch.randn(shape).to(dtype)
    expected = t.clone()
    for e0, e1 in runs:
        expected[e0:e1] = 0
    assert _small_gemm.zero_streaming(t, runs)
    assert torch.equal(t, expected)
    # a part of a larger buffer (offset storage)
    whole = torch.randn(2 * shape[0], *shape[1:]).to(dtype)
    part, kept = whole[shape[0] :], whole[: shape[0]].clone()
    expected = part.clone()
    for e0, e1 in runs:
        expected[e0:e1] = 0
    assert _small_gemm.zero_streaming(part, runs)
    assert torch.equal(part, expected) and torch.equal(whole[: shape[0]], kept)


def test_zero_streaming_rejects_runs_outside_the_tensor():
    with pytest.raises(ValueError, match=r"runs \[\(2, 5\)\] do not fit the first dim of \(4, 3\)"):
        _small_gemm.zero_streaming(torch.ones(4, 3), [(2, 5)])
    with pytest.raises(ValueError, match="do not fit"):
        _small_gemm.zero_streaming(torch.ones(4, 3), [(3, 2)])
