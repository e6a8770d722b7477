"""moe_ffn's bf16 kernel for AMX tile units (moe_ffn/_amx.{cpp,py}) against float64 products,
and a bf16 layer on it against the float64 per-token loop. The kernel runs only on CPUs with
AMX (and AVX-512); elsewhere its tests skip, and test_amx_runs_where_the_cpu_has_it says
whether it must run here."""

from __future__ import annotations

import os

import pytest
import torch

from moe_ffn import MoE, _amx, _small_gemm
from reference import BF16_TIE_ROWS, BF16_TIE_T, moe_forward, routed_rows

# The layers here run on their ops, whose calls these tests pin (the one-call decode step of
# moe_ffn/_decode.py, which float32 layers take on AMX CPUs too, is switched off).
pytestmark = pytest.mark.usefixtures("layer_ops")

U32 = 2.0**-24  # float32 unit roundoff (the kernel's sums)
U16 = 2.0**-8  # bf16's (each result rounded once)
bf16 = torch.bfloat16


def _needs_amx():
    if not _amx.available():
        pytest.skip("no AMX kernel here: the CPU lacks AMX/AVX-512, or the kernel is not built or switched off")


def _needs_swiglu():
    if not _amx.swiglu_available():
        pytest.skip("no bf16 SwiGLU passes here: the CPU lacks AVX-512, or the kernel is not built or switched off")


def test_bf16_swiglu_runs_where_the_cpu_has_avx512():
    """The bf16 SwiGLU passes need AVX-512 only: where torch reports AVX512 and the library is
    built they must run, with or without AMX."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("torch does not run AVX-512 kernels on this CPU")
    if _small_gemm.library() is None or _small_gemm.torch_openmp() is None:
        pytest.skip("the kernel library is not built or cannot run here (test_small_gemm says why)")
    assert _amx.swiglu_available()


def test_amx_runs_where_the_cpu_has_it():
    """Where torch reports AMX tiles and AVX-512 and the library is built, the kernel must run:
    a refusal of the tile state or a build without the AMX part must not pass unnoticed."""
    if not (torch.cpu._is_amx_tile_supported() and torch.backends.cpu.get_cpu_capability() == "AVX512"):
        pytest.skip("this CPU has no AMX (as torch reports it)")
    if _small_gemm.library() is None or _small_gemm.torch_openmp() is None:
        pytest.skip("the kernel library is not built or cannot run here (test_small_gemm says why)")
    assert _amx.available()


def _strided(rows: int, cols: int) -> torch.Tensor:
    """A bf16 [rows, cols] view whose rows are further apart than cols (a slice of a wider tensor)."""
    return torch.randn(rows + 2, cols + 40, dtype=bf16)[1 : rows + 1, 8 : cols + 8]


def _within_bf16_of(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, n: int, init=None) -> bool:
    """|got − a·b (+ init)| within one bf16 rounding of the result plus the float32 sum's worst
    case γ_n·Σ|a||b| (any order of n float32 additions)."""
    exact = a.double() @ b.double() + (0 if init is None else init.double())
    sum_error = (n + 2) * U32 * (a.double().abs() @ b.double().abs())
    if init is not None:
        sum_error = sum_error + (n + 2) * U32 * init.double().abs()
    return bool(((got.double() - exact).abs() <= U16 * (exact.abs() + sum_error) + sum_error).all())


def _margins(rows: int, cols: int):
    """(out, wide): out a [rows, cols] bf16 slice of `wide`, whose other columns hold NaN."""
    wide = torch.full((rows, cols + 48), float("nan"), dtype=bf16)
    return wide[:, 16 : cols + 16], wide


def _untouched(wide: torch.Tensor, cols: int) -> bool:
    return bool(wide[:, :16].isnan().all() and wide[:, cols + 16 :].isnan().all())


# rows: one tile's, partial tiles, pairs of tiles and a lone one past them, the limits
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64, 100, _amx.FORWARD_MAX_ROWS, _amx.FORWARD_SMALL_WEIGHT[0]])
@pytest.mark.parametrize("shape", [(16, 32), (48, 64), (80, 96), (272, 512), (1024, 160), (1040, 1024)])
def test_forward_matches_float64(rows, shape):
    """(1040, 1024): past FORWARD_SMALL_WEIGHT's elements, so at most FORWARD_MAX_ROWS rows."""
    _needs_amx()
    O, I = shape
    if rows > _amx.FORWARD_MAX_ROWS and O * I > _amx.FORWARD_SMALL_WEIGHT[1]:
        rows = _amx.FORWARD_MAX_ROWS
    x, w = _strided(rows, I), _strided(O, I)
    out, wide = _margins(rows, O)
    assert _amx.linear_into(out, x, w)
    assert _within_bf16_of(out, x, w.t(), I)
    assert _untouched(wide, O)


@pytest.mark.parametrize("rows", [1, 17, 100])
@pytest.mark.parametrize("shape", [(48, 64), (1024, 160), (272, 512)])
def test_results_written_past_the_caches_are_the_ones_written_through_them(rows, shape):
    """Forward and input gradient, bf16 results in whole 64-byte lines (_amx.cpp,
    store_bf16_pair): into a fresh, 64-byte aligned tensor those of kStreamResult (2^12)
    elements or more go past the caches (here rows·O from 17 rows of 48 × 64, from one row of
    1024 × 160), into a slice 16 columns in (not aligned) through them; the same bits either
    way, and within a bf16 rounding of float64 (forward O = 48 and 272: a lone 16-column tile
    past the pairs; the input gradient's O rounded up to a multiple of 32, which it needs)."""
    _needs_amx()
    O, I = shape
    x, w = _strided(rows, I), _strided(O, I)
    out, wide = _margins(rows, O)
    assert _amx.linear_into(out, x, w)
    fresh = torch.empty(rows, O, dtype=bf16)
    assert fresh.data_ptr() % 64 == 0 and _amx.linear_into(fresh, x, w)
    assert torch.equal(fresh.view(torch.int16), out.view(torch.int16)) and _untouched(wide, O)
    assert _within_bf16_of(fresh, x, w.t(), I)
    O = O // 32 * 32 + 32 * (O % 32 > 0)  # the input gradient's depth: whole steps of 32
    g, w = _strided(rows, O), _strided(O, I)
    grad, wide = _margins(rows, I)
    assert _amx.input_grad(g, w.t(), out=grad) is not None
    fresh = _amx.input_grad(g, w.t())
    assert fresh is not None and fresh.data_ptr() % 64 == 0
    assert torch.equal(fresh.view(torch.int16), grad.view(torch.int16)) and _untouched(wide, I)
    assert _within_bf16_of(fresh, g, w, O)


def test_forward_blocks_in_one_call_are_the_blocks_one_by_one():
    """linear_blocks: every block through its expert's weight, bit for bit what linear_into
    makes of it alone, rows between the blocks and the other columns untouched; it declines
    (nothing written) a block past `forward_max_rows` or a float32 operand, and raises on an
    expert or rows outside the tensors."""
    _needs_amx()
    torch.manual_seed(4)
    E, O, I = 5, 48, 64
    most = _amx.forward_max_rows((O, I))
    N = most + 100
    w = torch.randn(E, O, I + 32, dtype=bf16)[:, :, 16 : I + 16]  # strided rows, experts apart
    x = _strided(N, I)
    blocks = [(3, 0, 7), (0, 7, 40), (4, 52, 53), (3, 53, 53 + most - 1)]
    out, wide = _margins(N, O)
    assert _amx.linear_blocks(out, x, w, blocks)
    for e, start, stop in blocks:
        one = torch.empty(stop - start, O, dtype=bf16)
        assert _amx.linear_into(one, x[start:stop], w[e])
        assert torch.equal(out[start:stop], one)
        assert _within_bf16_of(out[start:stop], x[start:stop], w[e].t(), I)
    assert out[40:52].isnan().all() and out[53 + most - 1 :].isnan().all()
    assert _untouched(wide, O)
    fresh, _ = _margins(N, O)
    too_many = [(0, 0, 4), (1, 4, 4 + most + 1)]
    assert not _amx.linear_blocks(fresh, x, w, too_many)
    assert not _amx.linear_blocks(fresh, x.float(), w, blocks[:1])
    assert fresh.isnan().all()
    with pytest.raises(ValueError, match="linear_blocks"):
        _amx.linear_blocks(fresh, x, w, [(E, 0, 4)])
    with pytest.raises(ValueError, match="linear_blocks"):
        _amx.linear_blocks(fresh, x, w, [(0, N - 2, N + 2)])


def test_backward_blocks_in_one_call_are_the_blocks_one_by_one():
    """input_grad_blocks and weight_grad_blocks: each block bit for bit what input_grad and
    weight_grad_into make of it alone, within the float64 bound; a weight gradient's second
    block of an expert added to its first where its flag says so (a dropped flag is caught:
    the first piece would be overwritten); other rows and experts untouched; blocks past the
    limits declined with nothing written."""
    _needs_amx()
    torch.manual_seed(8)
    E, O, I, N = 4, 64, 96, 300
    w = torch.randn(E, O, I + 32, dtype=bf16)[:, :, 8 : I + 8]
    g = _strided(N, O)
    blocks = [(2, 0, 9), (0, 9, 100), (2, 130, 131), (3, 131, 131 + _amx.INPUT_GRAD_MAX_ROWS)]
    out, wide = _margins(N, I)
    assert _amx.input_grad_blocks(out, g, w, blocks)
    for e, start, stop in blocks:
        one = _amx.input_grad(g[start:stop], w[e].t())
        assert one is not None and torch.equal(out[start:stop], one)
        assert _within_bf16_of(out[start:stop], g[start:stop], w[e], O)
    assert out[100:130].isnan().all() and _untouched(wide, I)
    fresh, _ = _margins(N, I)
    assert not _amx.input_grad_blocks(fresh, g, w, [(0, 0, _amx.input_grad_max_rows((O, I)) + 1)])
    assert fresh.isnan().all()

    x = _strided(N, I)  # weight gradients: gᵀ·x per block, expert 2 twice (added the second time)
    again = [False, False, True, False]
    grad = torch.full((E + 1, O, I), float("nan"), dtype=bf16)[:E]
    assert _amx.weight_grad_blocks(grad, g, x, blocks, again)
    want = torch.full((E, O, I), float("nan"), dtype=bf16)
    for (e, start, stop), add in zip(blocks, again):
        assert _amx.weight_grad_into(want[e], g[start:stop].t(), x[start:stop], accumulate=add)
    assert torch.equal(grad[[0, 2, 3]], want[[0, 2, 3]]) and grad[1].isnan().all()
    # expert 2: its first piece rounded to bf16, then the sum with the second rounded again
    first = g[0:9].double().t() @ x[0:9].double()
    exact = first + g[130:131].double().t() @ x[130:131].double()
    bound = U16 * (first.abs() + exact.abs()) * (1 + 1e-3) + 12 * U32 * (g[0:9].double().abs().t() @ x[0:9].double().abs())
    assert ((grad[2].double() - exact).abs() <= bound + U16 * bound).all()
    dropped = torch.zeros(E, O, I, dtype=bf16)
    assert _amx.weight_grad_blocks(dropped, g, x, blocks, [False] * 4)
    assert not torch.equal(dropped[2], grad[2])
    assert not _amx.weight_grad_blocks(dropped, g, x, [(0, 0, _amx.WEIGHT_GRAD_MAX_ROWS + 1)], [False])


@pytest.mark.parametrize("even", [True, False])
def test_blocks_shared_among_threads_are_the_blocks_one_by_one(even):
    """Many blocks of about even rows are shared among the threads, each block whole on one
    thread (_team.h's each_block_shared; uneven ones go on the whole team in turn): every
    product bit for bit what the single-block calls make on the whole team, an expert's second
    block added to its first (the two on one thread), with a routed index too."""
    _needs_amx()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(13)
        E, O, I = 6, 48, 64
        rows = [23, 19, 31, 17, 9, 12, 25, 21] if even else [200, 3, 5, 2, 4, 3, 2, 6]
        experts = [0, 1, 1, 2, 3, 3, 4, 5]  # experts 1 and 3 in two blocks each
        starts = [sum(rows[:i]) for i in range(len(rows))]
        blocks = [(e, s, s + r) for e, s, r in zip(experts, starts, rows)]
        again = [False, False, True, False, False, True, False, False]
        N = sum(rows)
        w = torch.randn(E, O, I, dtype=bf16)
        x, g = _strided(N, I), _strided(N, O)
        index = torch.randint(0, N, (N,))
        out, want = torch.empty(N, O, dtype=bf16), torch.empty(N, O, dtype=bf16)
        assert _amx.linear_blocks(out, x, w, blocks, index=index)
        for e, start, stop in blocks:
            assert _amx.linear_into(want[start:stop], x[index[start:stop]], w[e])
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
        w_ig = torch.randn(E, 64, I, dtype=bf16)
        g_ig = _strided(N, 64)
        grad_in, want = torch.empty(N, I, dtype=bf16), torch.empty(N, I, dtype=bf16)
        assert _amx.input_grad_blocks(grad_in, g_ig, w_ig, blocks)
        for e, start, stop in blocks:
            assert _amx.input_grad(g_ig[start:stop], w_ig[e].t(), out=want[start:stop]) is not None
        assert torch.equal(grad_in.view(torch.int16), want.view(torch.int16))
        grad, want = torch.zeros(E, O, I, dtype=bf16), torch.zeros(E, O, I, dtype=bf16)
        assert _amx.weight_grad_blocks(grad, g, x, blocks, again)
        for (e, start, stop), add in zip(blocks, again):
            assert _amx.weight_grad_into(want[e], g[start:stop].t(), x[start:stop], accumulate=add)
        assert torch.equal(grad.view(torch.int16), want.view(torch.int16))
    finally:
        torch.set_num_threads(threads)


def test_blocks_gather_token_rows_as_they_pack_them():
    """linear_blocks with an index and weight_grad_blocks with b_index (a routed layer's token
    rows, picked as the kernel packs them): bit for bit the same calls on the rows gathered
    first by torch (tokens repeated, out of order, blocks with part tiles and an odd row count,
    one expert twice with its flag); an index outside the source's rows (either end) declines
    with nothing written; the input gradients take no index."""
    _needs_amx()
    torch.manual_seed(12)
    E, O, I, T = 4, 48, 64, 37
    w = torch.randn(E, O, I + 32, dtype=bf16)[:, :, 16 : I + 16]
    x = _strided(T, I)
    index = torch.cat([torch.randperm(T), torch.randint(0, T, (60,))])  # every token, then repeats
    N = index.shape[0]
    blocks = [(1, 0, 17), (3, 17, 18), (0, 30, 61), (1, 61, N)]
    gathered = x[index]
    out, wide = _margins(N, O)
    want = torch.full((N, O), float("nan"), dtype=bf16)
    assert _amx.linear_blocks(out, x, w, blocks, index=index)
    assert _amx.linear_blocks(want, gathered, w, blocks)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16)) and out[18:30].isnan().all() and _untouched(wide, O)
    assert _within_bf16_of(out[30:61], gathered[30:61], w[0].t(), I)

    g = _strided(N, O)
    again = [False, False, False, True]
    grad = torch.full((E, O, I), float("nan"), dtype=bf16)
    want = grad.clone()
    assert _amx.weight_grad_blocks(grad, g, x, blocks, again, b_index=index)
    assert _amx.weight_grad_blocks(want, g, gathered, blocks, again)
    assert torch.equal(grad.view(torch.int16), want.view(torch.int16)) and grad[2].isnan().all()

    for bad in (T, -1):
        wrong = index.clone()
        wrong[45] = bad  # a row of block (0, 30, 61)
        fresh, _ = _margins(N, O)
        assert not _amx.linear_blocks(fresh, x, w, blocks, index=wrong) and fresh.isnan().all()
        untouched = torch.full((E, O, I), float("nan"), dtype=bf16)
        assert not _amx.weight_grad_blocks(untouched, g, x, blocks, again, b_index=wrong) and untouched.isnan().all()
    wrong = index.clone()
    wrong[20] = T  # between the blocks: not read, not checked
    assert _amx.linear_blocks(fresh, x, w, blocks, index=wrong)
    assert torch.equal(fresh.view(torch.int16), out.view(torch.int16))
    with pytest.raises(ValueError, match="linear_blocks"):
        _amx.linear_blocks(torch.empty(N, O, dtype=bf16), x, w, [(0, N - 2, N + 2)], index=index)
    with pytest.raises(ValueError, match="takes no index"):
        _amx._product_blocks("input_grad", torch.empty(N, I, dtype=bf16), g, w, blocks, 64, True, (O, I), index)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64, _amx.INPUT_GRAD_MAX_ROWS, 1100, _amx.INPUT_GRAD_SMALL_WEIGHT[0]])
@pytest.mark.parametrize("shape", [(32, 32), (64, 96), (96, 160), (512, 288), (1024, 1024), (2048, 2048)])
def test_input_grad_matches_float64(rows, shape):
    """(2048, 2048): w's depth in chunks (partial sums carried from chunk to chunk); past 512 rows
    (through weights of at most 2^20 elements) the rows in even chunks (1100: 368, 368, 364)."""
    _needs_amx()
    O, I = shape
    if rows > _amx.INPUT_GRAD_MAX_ROWS and O * I > _amx.INPUT_GRAD_SMALL_WEIGHT[1]:
        rows = _amx.INPUT_GRAD_MAX_ROWS
    g, w = _strided(rows, O), _strided(O, I)
    out, wide = _margins(rows, I)
    y = _amx.input_grad(g, w.t(), out=out)
    assert y is not None and y.data_ptr() == out.data_ptr()
    assert _within_bf16_of(out, g, w, O)
    assert _untouched(wide, I)
    fresh = _amx.input_grad(g, w.t())  # into a new tensor: the same bits
    assert fresh is not None and torch.equal(fresh.view(torch.int16), out.view(torch.int16))


@pytest.mark.parametrize("rows", [1, 2, 31, 32, 33, 100, 500, 800, _amx.WEIGHT_GRAD_MAX_ROWS])
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (272, 160), (2048, 1024)])
def test_weight_grad_matches_float64(rows, shape):
    """aᵀ·b over `rows` steps; from 500 rows b's columns in chunks, past 640 the sums in even depth
    chunks (the row tiles in groups, a last group of one tile for 272 rows). Into a slice 16 columns in
    (not 64-byte aligned: stored through the caches) and into a fresh tensor (aligned: from
    kStreamElements, 2^19, past them, as the (2048, 1024) gradient is): the same bits."""
    _needs_amx()
    _weight_grad_checked(rows, *shape)


def _weight_grad_checked(rows: int, m: int, n: int):
    """aᵀ·b of strided a [rows, m] and b [rows, n] into a slice 16 columns in (not 64-byte
    aligned: stored through the caches, its margins untouched) within float64's bound, and into
    a fresh tensor (aligned: streamed from kStreamElements) with the same bits; (a, b, out)."""
    a, b = _strided(rows, m), _strided(rows, n)
    out, wide = _margins(m, n)
    assert _amx.weight_grad_into(out, a.t(), b)
    assert _within_bf16_of(out, a.t(), b, rows)
    assert _untouched(wide, n)
    fresh = torch.empty(m, n, dtype=bf16)
    assert fresh.data_ptr() % 64 == 0 and _amx.weight_grad_into(fresh, a.t(), b)
    assert torch.equal(fresh.view(torch.int16), out.view(torch.int16))
    return a, b, out


@pytest.mark.parametrize("rows", [40, 1000])
@pytest.mark.parametrize("shape", [(48, 96), (2048, 1024)])
def test_weight_grad_accumulates_onto_what_out_holds(shape, rows):
    """out += aᵀ·b: the float32 sum added to out's bf16 values, rounded once more (never streamed)."""
    _needs_amx()
    m, n = shape
    a, b = _strided(rows, m), _strided(rows, n)
    init = torch.randn(m, n, dtype=bf16)
    out = init.clone()
    assert _amx.weight_grad_into(out, a.t(), b, accumulate=True)
    assert _within_bf16_of(out, a.t(), b, rows, init=init)


def test_results_round_to_nearest_even_as_torch_does():
    """Each float32 sum rounded to bf16 as torch rounds: sums exact in float32 that land on ties
    (to even, up and down), just off them, on infinity and NaN (its bits too), for the forward
    and (the same sums over the rows) the weight gradient."""
    _needs_amx()
    t = BF16_TIE_T
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([1.0, t, t * t])
    rows_of_w = BF16_TIE_ROWS
    w = torch.zeros(16, 32)
    w[: len(rows_of_w), :3] = torch.tensor(rows_of_w)
    assert torch.equal(w.bfloat16().float(), w), "the rows must be exact in bf16"
    expected = (x.double() @ w.double().t()).float().bfloat16()  # exact sums, rounded by torch
    out = torch.empty(1, 16, dtype=bf16)
    assert _amx.linear_into(out, x.bfloat16(), w.bfloat16())
    # the same sums as aᵀ·b over 32 steps: a [32, 16] = wᵀ, b [32, 32] with x's row as column 0
    a, b = w.t().contiguous().bfloat16(), torch.zeros(32, 32, dtype=bf16)
    b[:, 0] = x[0].bfloat16()
    grad = torch.empty(16, 32, dtype=bf16)
    assert _amx.weight_grad_into(grad, a.t(), b)
    for got in (out[0], grad[:, 0]):
        same = (got.view(torch.int16) == expected[0].view(torch.int16)) | (got.isnan() & expected[0].isnan())
        assert same.all(), f"kernel {got.tolist()} against torch {expected[0].tolist()}"
        # every NaN as c10's rounding writes it, 0x7FC0 (the rounding instruction the kernel uses
        # for whole lines would keep the sign of the tiles' NaN)
        nan_bits = got.view(torch.int16)[got.isnan()]
        assert len(nan_bits) > 0 and (nan_bits == 0x7FC0).all(), [hex(v) for v in nan_bits.tolist()]
    assert out[0, :3].tolist() == [1.0, 1.0 + 4 * t, 1.0 + 2 * t]  # the ties, by hand


def test_entry_points_decline_what_they_do_not_take():
    """False / None, `out` untouched: float32 tensors, dims off the tiles' multiples, more rows
    than the limits, no rows, rows that are not contiguous; a ValueError for shapes that do not
    fit each other."""
    _needs_amx()
    x, w = torch.randn(4, 64, dtype=bf16), torch.randn(32, 64, dtype=bf16)
    out = torch.full((4, 32), 7.0, dtype=bf16)
    assert not _amx.linear_into(out.float(), x.float(), w.float())
    assert not _amx.linear_into(out[:, :24], x, w[:24])  # O = 24: not a multiple of 16
    assert not _amx.linear_into(torch.empty(4, 32, dtype=bf16), x[:, :48], w[:, :48])  # I = 48
    many = _amx.FORWARD_SMALL_WEIGHT[0] + 1
    assert not _amx.linear_into(torch.empty(many, 32, dtype=bf16), torch.randn(many, 64, dtype=bf16), w)
    big_w = torch.randn(1040, 1024, dtype=bf16)  # past FORWARD_SMALL_WEIGHT's elements: the smaller limit
    many = _amx.FORWARD_MAX_ROWS + 1
    assert not _amx.linear_into(torch.empty(many, 1040, dtype=bf16), torch.randn(many, 1024, dtype=bf16), big_w)
    assert not _amx.linear_into(out[:0], x[:0], w)
    assert not _amx.linear_into(out, x.t().contiguous().t(), w)  # x's rows not contiguous
    assert bool((out == 7).all())
    g = torch.randn(4, 32, dtype=bf16)
    assert _amx.input_grad(g.float(), w.float().t()) is None
    assert _amx.input_grad(g[:, :16], w[:16].t()) is None  # O = 16: not a multiple of 32
    assert _amx.input_grad(torch.randn(_amx.INPUT_GRAD_SMALL_WEIGHT[0] + 1, 32, dtype=bf16), w.t()) is None
    big_w = torch.randn(1024, 1056, dtype=bf16)  # past INPUT_GRAD_SMALL_WEIGHT's elements: the smaller limit
    assert _amx.input_grad(torch.randn(_amx.INPUT_GRAD_MAX_ROWS + 1, 1024, dtype=bf16), big_w.t()) is None
    grad = torch.full((32, 64), 7.0, dtype=bf16)
    assert not _amx.weight_grad_into(grad[:, :48], g.t(), x[:, :48])  # n = 48: not a multiple of 32
    assert not _amx.weight_grad_into(grad, torch.randn(_amx.WEIGHT_GRAD_MAX_ROWS + 1, 32, dtype=bf16).t(),
                                     torch.randn(_amx.WEIGHT_GRAD_MAX_ROWS + 1, 64, dtype=bf16))
    assert bool((grad == 7).all())
    with pytest.raises(ValueError, match="do not fit"):
        _amx.linear_into(torch.empty(4, 48, dtype=bf16), x, w)
    with pytest.raises(ValueError, match="do not fit"):
        _amx.input_grad(torch.randn(4, 64, dtype=bf16), w.t())
    with pytest.raises(ValueError, match="do not fit"):
        _amx.weight_grad_into(grad, g.t(), torch.randn(5, 64, dtype=bf16))


def _bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got − want| in units of bf16's spacing at want (2^-7 of its binade), elementwise."""
    want64 = want.double()
    spacing = torch.exp2(torch.floor(torch.log2(want64.abs().clamp(min=2.0**-126))) - 7)
    return (got.double() - want64).abs() / spacing


@pytest.mark.parametrize("rows, F", [(1, 8), (3, 13), (37, 300)])
@pytest.mark.parametrize("scaled", [False, True])
def test_bf16_swiglu_kernels_are_torchs_bf16_ops(rows, F, scaled):
    """bf16 h and da: the one-pass AVX-512 kernels give what grouped's bf16 ops give, written out here
    with torch's own bf16 ops (silu, products, the sum, silu_backward, the weight cast to bf16),
    each rounding to bf16: bit for bit but for elements where our e^x and torch's land on two
    sides of a rounding boundary (at most one bf16 unit apart there, and rare)."""
    _needs_swiglu()
    torch.manual_seed(rows + F)
    h, da = (torch.randn(rows + 1, 2 * F + 3)[1:, 2 : 2 * F + 2] * 4).bfloat16(), torch.randn(rows, F + 5)[:, 3 : F + 3].bfloat16()
    weight = torch.rand(rows) + 0.5 if scaled else None
    gate, up = h.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate)
    a_ops = act * up
    dweight_ops = (a_ops * da).sum(-1)
    dav = da if weight is None else da * weight[:, None].bfloat16()
    dh_ops = torch.cat([torch.ops.aten.silu_backward(dav * up, gate), dav * act], dim=-1)
    a2, dh, dweight = _amx.swiglu_backward(h, da, weight, True, True)
    a = _amx.swiglu(h)  # the forward pass: AMX or AVX512-BF16 CPUs (_amx.swiglu_forward_available)
    assert (a is None) == (not _amx.swiglu_forward_available())
    assert a2.dtype == dh.dtype == torch.bfloat16 and dweight.dtype == torch.float32
    if a is not None:
        assert torch.equal(a.view(torch.int16), a2.view(torch.int16))
    for got, want in ((a2, a_ops), (dh, dh_ops)):
        ulps = _bf16_ulps(got, want)
        assert ulps.max() <= 2 and (ulps > 0).float().mean() <= 0.02
    # the sum runs in another order than torch's: within its float32 bound, then one rounding
    assert torch.equal(dweight.bfloat16().float(), dweight)  # rounded to bf16 as the op's result is
    bound = (F + 4) * 2.0**-24 * (a_ops.double() * da.double()).abs().sum(-1)
    assert ((dweight.double() - dweight_ops.double()).abs() <= 2.0**-8 * dweight_ops.double().abs() * 2 + bound + 1e-30).all()


def test_bf16_swiglu_kernels_pass_nan_through_and_decline_what_they_do_not_take():
    _needs_swiglu()
    h, da = torch.ones(2, 32, dtype=bf16), torch.ones(2, 16, dtype=bf16)
    h[0, 3] = float("nan")  # a gate
    h[1, 16 + 5] = float("nan")  # an up
    a, dh, dweight = _amx.swiglu_backward(h, da, None, True, True)
    assert a.isnan().nonzero().tolist() == [[0, 3], [1, 5]]
    if _amx.swiglu_forward_available():
        assert _amx.swiglu(h).isnan().nonzero().tolist() == [[0, 3], [1, 5]]
    assert dh[0, [3, 16 + 3]].isnan().all() and dh[1, 5].isnan() and dweight.isnan().all() and dh.isnan().sum() == 3
    assert _amx.swiglu(h.float()) is None and _amx.swiglu(h[:, :31]) is None
    assert _amx.swiglu_backward(h, da.float(), None, True, True) is None  # mixed dtypes
    assert _amx.swiglu_backward(h, da[:, :15], None, True, True) is None  # da not [rows, F]
    assert _amx.swiglu(torch.ones(32, 2, dtype=bf16).t()) is None  # rows not contiguous


def test_bf16_swiglu_rows_at_the_edges_of_the_native_rounding_screen():
    """AVX512-BF16's rounding instruction (NaN and subnormal results wrong) runs only on rows whose
    inputs keep every rounded value normal (_amx.cpp's ordinary_row: gates within 2^-24 … 16, ups,
    gradients and the weight within 2^-24 … 2^24). Rows at those bounds, and rows just past them
    whose results are subnormal (a gate of -44 with the rest at 2^-24), come out as torch's bf16
    ops make them: zeros where torch has zeros only, subnormals kept, within the exp's unit."""
    _needs_swiglu()
    F = 48
    tiny, huge = 2.0**-24, 2.0**24
    gate = torch.full((5, F), -16.0)
    up, da = torch.full((5, F), tiny), torch.full((5, F), tiny)
    gate[1], up[1], da[1] = tiny, huge, -huge  # the other corner of the screen
    gate[2, ::2], gate[2, 1::2] = -1.28125, 16.0  # (near silu's minimum: the slope near 0)
    gate[3] = -44.0  # past the screen: s ≈ 2^-63.5, so dh's gate half is subnormal (≈ 2^-130)
    gate[4] = torch.linspace(-3, 3, F)
    up[4, 7] = 2.0**-25  # one up past the screen
    weight = torch.tensor([tiny, huge, 1.0, tiny, 0.5])
    h, da = torch.cat([gate, up], dim=-1).bfloat16(), da.bfloat16()
    g, u = h.chunk(2, dim=-1)
    act = torch.nn.functional.silu(g)
    a_ops = act * u
    dav = da * weight[:, None].bfloat16()
    dh_ops = torch.cat([torch.ops.aten.silu_backward(dav * u, g), dav * act], dim=-1)
    assert ((dh_ops[3, :F] != 0) & (dh_ops[3, :F].float().abs() < 2.0**-126)).all()  # subnormal: the case holds
    a, dh, _ = _amx.swiglu_backward(h, da, weight, True, True)
    outputs = [(a, a_ops), (dh, dh_ops)]
    if _amx.swiglu_forward_available():
        outputs.append((_amx.swiglu(h), a_ops))
    for got, want in outputs:
        assert torch.equal(got == 0, want == 0)
        assert _bf16_ulps(got, want).max() <= 1


def test_bf16_swiglu_at_gates_where_the_exponential_overflows():
    """The bf16 passes for gates whose e^-g overflows float32 or nearly does (test_small_gemm's
    EXTREME_GATES): bit for bit torch's bf16 ops, -0 where e^-g is inf (it was a tiny nonzero
    number while the passes clamped e^x at 88.3)."""
    _needs_swiglu()
    from test_small_gemm import EXTREME_GATES

    F = len(EXTREME_GATES)
    gate = torch.tensor(EXTREME_GATES).repeat(3, 1)
    up = torch.tensor([[2.0**-5], [1.0], [3.0]]).expand(3, F)
    h, da = torch.cat([gate, up], dim=-1).bfloat16(), torch.full((3, F), 0.75).bfloat16()
    g, u = h.chunk(2, dim=-1)
    act = torch.nn.functional.silu(g)
    dh_ops = torch.cat([torch.ops.aten.silu_backward(da * u, g), da * act], dim=-1)
    a2, dh, _ = _amx.swiglu_backward(h, da, None, True, False)
    outputs = [(a2, act * u), (dh, dh_ops)]
    if _amx.swiglu_forward_available():
        outputs.append((_amx.swiglu(h), act * u))
    for got, want in outputs:
        assert torch.equal(got == 0, want == 0)
        assert _bf16_ulps(got, want).max() <= 1


def test_bf16_swiglu_kernels_round_nan_and_subnormals_as_torch_does():
    """Lanes the AVX512-BF16 rounding instruction would get wrong, among ordinary ones: subnormal
    values (torch keeps them; the instruction flushes them to zero), bit for bit torch's bf16 ops,
    and NaNs with a sign and a payload (the instruction keeps both), as the kernels' one quiet
    NaN 0x7FC0 (c10's scalar rounding; torch's vector code writes 0xFFFF, so NaN bits are not
    compared with torch's); the other lanes of the same 16-lane steps (done again when a step
    meets such a lane) as the other SwiGLU tests hold them. With such a gate e^-g is 1 or NaN,
    so our e^x and torch's agree exactly there."""
    _needs_swiglu()
    torch.manual_seed(5)
    rows, F = 4, 40  # two whole 16-lane steps and a part one per row
    h = (torch.randn(rows, 2 * F) * 0.5).bfloat16()
    da = torch.randn(rows, F).bfloat16()
    bits = h.view(torch.int16)
    special = [(0, 3), (1, 17), (2, 33), (3, 8)]  # one lane in each kind of step
    def bf16_bits(value):  # (as int16)
        return value - 0x10000 if value >= 0x8000 else value

    bits[0, 3] = bf16_bits(0xFFC1)  # a negative quiet NaN with a payload
    bits[1, 17] = bf16_bits(0x0023)  # a positive subnormal gate: act = g/2, a = act·up subnormal
    bits[2, 33] = bf16_bits(0x8051)  # a negative one
    bits[3, 8] = bf16_bits(0xFF81)  # a negative signalling NaN
    da[1, 17], da[2, 33] = 0.75, -3.0
    weight = torch.tensor([0.5, 1.25, 0.375, 2.0])
    gate, up = h.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate)
    a_ops = act * up
    dav = da * weight[:, None].bfloat16()
    dh_ops = torch.cat([torch.ops.aten.silu_backward(dav * up, gate), dav * act], dim=-1)
    a2, dh, _ = _amx.swiglu_backward(h, da, weight, True, True)
    outputs = [(a2, a_ops, F), (dh, dh_ops, 2 * F)]
    a = _amx.swiglu(h)
    if a is not None:
        outputs.append((a, a_ops, F))
    for value in (a_ops[1, 17], a_ops[2, 33], dh_ops[1, F + 17], dh_ops[2, F + 33]):  # (the inputs are special)
        assert 0 < value.abs().item() < 2.0**-126
    assert a_ops[0, 3].isnan() and a_ops[3, 8].isnan()
    for got, want, width in outputs:
        for r, f in special:
            lanes = [c for c in (f, F + f) if c < width]
            got_bits, want_bits = got[r, lanes].view(torch.int16), want[r, lanes].view(torch.int16)
            nan = want[r, lanes].isnan()
            assert torch.equal(got_bits[~nan], want_bits[~nan]), (r, f)
            assert (got_bits[nan] == 0x7FC0).all() and got[r, lanes].isnan().sum() == nan.sum(), (r, f)
        ordinary = ~want.isnan()
        for r, f in special:
            ordinary[r, [c for c in (f, F + f) if c < width]] = False
        assert not got[ordinary].isnan().any()
        assert _bf16_ulps(got[ordinary], want[ordinary]).max() <= 2


def test_bf16_swiglu_backward_at_every_gate_value():
    """The backward pass takes silu's parts of a bf16 gate from a table of all 65536 gate values
    (_amx.cpp's GateTable; on AMD's CPUs, whose gathers are slow, it computes them): every one of them, NaNs and infinities included, against torch's bf16
    ops: NaN where they give NaN, the same infinities and zeros, finite values within one bf16
    unit (the exponentials differ; on this data they agree bit for bit on an AVX-512 Xeon)."""
    _needs_swiglu()
    torch.manual_seed(0)
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(bf16).reshape(512, 128)
    up, da = (torch.rand(2, 512, 128) + 0.5).bfloat16()
    weight = torch.rand(512) + 0.5
    act = torch.nn.functional.silu(gate)
    dav = da * weight[:, None].bfloat16()
    a_ops = act * up
    dh_ops = torch.cat([torch.ops.aten.silu_backward(dav * up, gate), dav * act], dim=-1)
    a, dh, _ = _amx.swiglu_backward(torch.cat([gate, up], dim=-1), da, weight, True, False)
    for got, want in ((a, a_ops), (dh, dh_ops)):
        assert want.isnan().any() and want.isinf().any() and (want == 0).any()  # (the cases are there)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got == 0, want == 0)
        assert torch.equal(got[want.isinf()], want[want.isinf()])
        finite = want.isfinite()
        assert _bf16_ulps(got[finite], want[finite]).max() <= 1


def test_bf16_swiglu_backward_with_subnormals_flushed():
    """With torch's flush-denormal mode on (DAZ and FTZ), subnormal gates and the subnormal
    sigmoids of gates near -88 count as zero, in torch's ops and in the pass alike. (The pass
    computes silu's parts itself wherever the float environment is not the default one the
    table was made in; with both flags set, as here, the table's values would come out the same.)"""
    _needs_swiglu()
    subnormal = torch.arange(1, 128, dtype=torch.int32).to(torch.int16).view(bf16)
    gate = torch.cat([subnormal, -subnormal, torch.tensor([-88.0, -87.5, -88.5, 0.0, 1.0, -1.0, 3.0, -0.0, 2.0, -2.0])]).bfloat16()
    gate = gate.reshape(4, 66)
    up, da = torch.full((4, 66), 1.5, dtype=bf16), torch.full((4, 66), 0.75, dtype=bf16)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        act = torch.nn.functional.silu(gate)
        want_a = act * up
        want_dh = torch.cat([torch.ops.aten.silu_backward(da * up, gate), da * act], dim=-1)
        a, dh, _ = _amx.swiglu_backward(torch.cat([gate, up], dim=-1), da, None, True, False)
    finally:
        torch.set_flush_denormal(False)
    assert (want_a == 0).sum() >= 254  # (the subnormal gates' a is zero)
    for got, want in ((a, want_a), (dh, want_dh)):
        assert torch.equal(got == 0, want == 0)
        assert _bf16_ulps(got, want).max() <= 1


def test_switched_off_with_the_library():
    """MOE_FFN_SMALL_GEMM=0 switches off the whole library, the AMX kernel with it."""
    import subprocess
    import sys

    code = "from moe_ffn import _amx; print(_amx.available())"
    env = dict(os.environ, MOE_FFN_SMALL_GEMM="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- SwiGLU's first projection with its activation in one pass --------------------------------

@pytest.mark.parametrize(
    "F, I, sizes, gathered, keep_h",
    [(32, 64, [5, 17, 40, 1], False, True), (64, 128, [100, 33, 16], True, True), (96, 64, [64, 130, 3], True, False),
     (512, 1024, [70], False, True)],
)
def test_swiglu_forward_blocks_are_the_product_then_the_activation(F, I, sizes, gathered, keep_h):
    """h and a of `swiglu_forward_blocks` bit for bit `linear_blocks`' h and `swiglu`'s a of that
    h (blocks of partial tiles, odd row tiles, token rows gathered by an index, h not written);
    rows between the blocks and the columns beside them untouched."""
    _needs_amx()
    torch.manual_seed(F + I)
    E = 3
    w = (torch.randn(E, 2 * F, I + 32) * 0.1).bfloat16()[:, :, 16 : I + 16]
    blocks, start = [], 0
    for i, n in enumerate(sizes):
        blocks.append(((2 * i) % E, start, start + n))
        start += n + 2  # (two rows between blocks)
    N = start
    x = _strided(N if not gathered else 37, I)
    index = torch.randint(0, x.shape[0], (N,)) if gathered else None
    rows = x[index] if gathered else x
    h_want = torch.full((N, 2 * F), float("nan"), dtype=bf16)
    assert _amx.linear_blocks(h_want, rows.contiguous(), w, blocks)
    a_want = torch.full((N, F), float("nan"), dtype=bf16)
    for _, lo, hi in blocks:
        a_want[lo:hi] = _amx.swiglu(h_want[lo:hi])
    h, h_wide = _margins(N, 2 * F)
    a, a_wide = _margins(N, F)
    assert _amx.swiglu_forward_blocks(h if keep_h else None, a, x, w, blocks, index=index)
    assert torch.equal(a.view(torch.int16), a_want.view(torch.int16)) and _untouched(a_wide, F)
    if keep_h:
        assert torch.equal(h.view(torch.int16), h_want.view(torch.int16)) and _untouched(h_wide, 2 * F)
    else:
        assert h_wide.isnan().all()


def test_swiglu_forward_blocks_round_the_screens_edges_and_nan_as_swiglu():
    """Gates and ups at and just past the native rounding screen's bounds (2^-24 … 16 and 2^-24 …
    2^24: _amx.cpp's swiglu16 takes the integer rounding for a 16-lane step with one lane past
    them), zeros, huge values, products act·up that are subnormal, and a NaN row (x's NaN reaches
    every sum of its row): h and a bit for bit `linear_blocks`' and `swiglu`'s. h = x exactly (w the
    identity: each sum one product by 1, the rest by 0)."""
    _needs_amx()
    F = 32
    w = torch.eye(2 * F, dtype=bf16).unsqueeze(0)
    x = torch.randn(20, 2 * F).bfloat16()
    edges = [2.0**-24, 2.0**-25, 16.0, 16.125, -16.0, -90.0, 0.0, -0.0, 3.0e38, -3.0e38, 2.0**24, 2.0**25, 1.0, -2.5]
    for r in range(14):
        x[r, r % F] = edges[r]  # a gate
        x[r, F + (r * 7) % F] = edges[(r + 5) % len(edges)]  # an up, another step of the row
    x[14, 5] = float("nan")
    x[15, 3], x[15, F + 3] = 2.0**-110, 2.0**-20  # a = act·up subnormal (2^-131): kept by torch, flushed by the instruction
    x[16, 9], x[16, F + 9] = -88.0, 2.0**-7  # the same from a gate past the screen's other bound
    h_want = torch.empty(20, 2 * F, dtype=bf16)
    assert _amx.linear_blocks(h_want, x, w, [(0, 0, 20)])
    assert torch.equal(h_want[:14], x[:14])  # (the identity: h holds the edges as they are)
    a_want = _amx.swiglu(h_want)
    h, a = torch.empty(20, 2 * F, dtype=bf16), torch.empty(20, F, dtype=bf16)
    assert _amx.swiglu_forward_blocks(h, a, x, w, [(0, 0, 20)])
    assert torch.equal(h.view(torch.int16), h_want.view(torch.int16))
    assert torch.equal(a.view(torch.int16), a_want.view(torch.int16))
    assert a[14].isnan().all()
    assert 0 < a[15, 3].float().abs() < 2.0**-126 and 0 < a[16, 9].float().abs() < 2.0**-126  # (the cases hold)


def test_swiglu_forward_blocks_take_rows_past_the_plain_products_limit():
    """Through a weight past FORWARD_SMALL_WEIGHT's elements, `swiglu_forward_blocks` takes a
    block of more rows than `linear_blocks` does (SWIGLU_FORWARD_MAX_ROWS): h bit for bit the
    plain product's in two parts of rows (each output element the same sum either way), a
    `swiglu`'s of that h."""
    _needs_amx()
    F, I = 576, 1024  # 2F·I = 1.18·2^20 elements
    rows = _amx.FORWARD_MAX_ROWS + 17
    assert _amx.forward_max_rows((2 * F, I)) < rows <= _amx.swiglu_forward_max_rows((2 * F, I))
    torch.manual_seed(12)
    w = (torch.randn(1, 2 * F, I) * 0.05).bfloat16()
    x = torch.randn(rows, I).bfloat16()
    assert not _amx.linear_blocks(torch.empty(rows, 2 * F, dtype=bf16), x, w, [(0, 0, rows)])
    h_want = torch.empty(rows, 2 * F, dtype=bf16)
    half = rows // 2
    assert _amx.linear_blocks(h_want, x, w, [(0, 0, half), (0, half, rows)])
    h, a = torch.empty(rows, 2 * F, dtype=bf16), torch.empty(rows, F, dtype=bf16)
    assert _amx.swiglu_forward_blocks(h, a, x, w, [(0, 0, rows)])
    assert torch.equal(h.view(torch.int16), h_want.view(torch.int16))
    assert torch.equal(a.view(torch.int16), _amx.swiglu(h_want).view(torch.int16))


def test_swiglu_forward_blocks_decline_what_they_do_not_take():
    """F not a multiple of 32, a block past `swiglu_forward_max_rows`, a float32 operand: False
    with nothing written; an expert or rows outside the tensors: ValueError."""
    _needs_amx()
    x = torch.randn(40, 64, dtype=bf16)
    for w, blocks in [
        (torch.randn(2, 96, 64, dtype=bf16), [(0, 0, 8)]),  # F = 48
        (torch.randn(2, 64, 64, dtype=bf16), [(0, 0, _amx.swiglu_forward_max_rows((64, 64)) + 1)]),
    ]:
        rows = max(stop for _, _, stop in blocks)
        h = torch.full((rows, w.shape[1]), float("nan"), dtype=bf16)
        a = torch.full((rows, w.shape[1] // 2), float("nan"), dtype=bf16)
        xs = torch.randn(rows, 64, dtype=bf16)
        assert not _amx.swiglu_forward_blocks(h, a, xs, w, blocks)
        assert h.isnan().all() and a.isnan().all()
    w = torch.randn(2, 64, 64, dtype=bf16)
    a = torch.full((40, 32), float("nan"), dtype=bf16)
    assert not _amx.swiglu_forward_blocks(None, a, x.float(), w, [(0, 0, 8)])
    assert a.isnan().all()
    with pytest.raises(ValueError, match="swiglu_forward_blocks"):
        _amx.swiglu_forward_blocks(None, a, x, w, [(2, 0, 8)])
    with pytest.raises(ValueError, match="swiglu_forward_blocks"):
        _amx.swiglu_forward_blocks(None, a, x, w, [(0, 36, 44)])


def test_bf16_layer_forward_with_the_activation_in_the_product_is_the_two_passes(monkeypatch):
    """A bf16 SwiGLU layer's forward (training: h kept; inference: h not written) bit for bit the
    same with the activation in the first projection's product as with the product and
    `swiglu`'s pass after it; the one-pass product ran in both. (The group's calls as the loop
    makes them, not in one: routed_swiglu_blocks is tested below.)"""
    _needs_amx()
    monkeypatch.setattr(_amx, "routed_swiglu_blocks", lambda *a, **k: None)
    calls = []
    real = _amx.swiglu_forward_blocks
    monkeypatch.setattr(_amx, "swiglu_forward_blocks", lambda h, *a, **k: calls.append(h is None) or real(h, *a, **k))
    torch.manual_seed(3)
    moe = MoE(dim=64, hidden_dim=96, num_experts=4, top_k=2).bfloat16()
    x = torch.randn(90, 64, dtype=bf16)
    with torch.no_grad():
        inference = moe(x)
    training = moe(x.requires_grad_())
    assert True in calls and False in calls
    monkeypatch.setattr(_amx, "swiglu_forward_blocks", lambda *a, **k: False)
    with torch.no_grad():
        two_passes = moe(x)
    assert torch.equal(inference, two_passes) and torch.equal(training.detach(), two_passes)


def test_bf16_forward_groups_are_counted_in_the_activation_width(monkeypatch):
    """Where the AMX product forms SwiGLU's activation, a forward group's one temporary of its
    width is [rows, F] (h is kept whole, or not written), so groups count rows by F: a step
    whose rows × 2F pass the group budget and rows × F do not is one group, which goes to the
    one-call path; the output bit for bit the loop's, with the activation after the product."""
    _needs_amx()
    from moe_ffn import grouped

    T, D, F = 48, 64, 96  # 96 rows: 9216 elements by F, 18432 by 2F
    monkeypatch.setattr(grouped, "_ONE_GROUP_FACTOR", 1)
    monkeypatch.setattr(grouped, "_GROUP_ELEMENTS", T * 2 * F)  # 96 rows by F
    calls = []
    real = _amx.routed_swiglu_blocks
    monkeypatch.setattr(_amx, "routed_swiglu_blocks", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(8)
    moe = MoE(dim=D, hidden_dim=F, num_experts=4, top_k=2).bfloat16()
    x = torch.randn(T, D, dtype=bf16)
    with torch.no_grad():
        one_group = moe(x)
    assert calls == [1]
    monkeypatch.setattr(_amx, "routed_swiglu_blocks", lambda *a, **k: None)
    monkeypatch.setattr(_amx, "swiglu_forward_blocks", lambda *a, **k: False)
    with torch.no_grad():
        apart = moe(x)
    assert torch.equal(one_group.view(torch.int16), apart.view(torch.int16))


@pytest.mark.parametrize("T, K", [(1, 2), (4, 2), (6, 5), (40, 2)])
@pytest.mark.parametrize("keep_h", [True, False])
def test_routed_swiglu_blocks_are_the_forwards_calls_one_by_one(T, K, keep_h):
    """A routed bf16 SwiGLU forward in one call: out and h bit for bit what
    swiglu_forward_blocks (gathering the token rows), linear_blocks and slot_sum_rows make one by
    one, experts without rows included; h not written without keep_h; zeros for a token without
    rows; out within one bf16 rounding of the rows' weighted sum in float64 (the layer against
    the float64 loop: test_bf16_layer_runs_on_the_kernel_and_matches_float64, whose T = 3 and
    40 run this call)."""
    _needs_amx()
    torch.manual_seed(10 * T + K)
    E, D, F = 7, 64, 96
    x, w1, w2, token, _, weight, blocks = routed_rows(T, K, E, D, F, bf16, pad=16)
    got = _amx.routed_swiglu_blocks(x, token, weight, w1, w2, blocks, keep_h)
    assert got is not None
    out, h = got
    N = T * K
    h_apart, a = torch.empty(N, 2 * F, dtype=bf16), torch.empty(N, F, dtype=bf16)
    assert _amx.swiglu_forward_blocks(h_apart, a, x, w1, blocks, index=token)
    y = torch.empty(N, D, dtype=bf16)
    assert _amx.linear_blocks(y, a, w2, blocks)
    out_apart = torch.empty(T + 1, D, dtype=bf16)
    assert _small_gemm.slot_sum_rows(out_apart, token, y, weight)
    assert torch.equal(out.view(torch.int16), out_apart.view(torch.int16))
    assert torch.equal(h.view(torch.int16), h_apart.view(torch.int16)) if keep_h else h.numel() == 0
    assert (out[T] == 0).all()
    sums = torch.zeros(T + 1, D, dtype=torch.float64)
    sums.index_add_(0, token, weight.double()[:, None] * y.double())
    assert ((out.double() - sums).abs() <= U16 * sums.abs() + 1e-6 * sums.abs().max()).all()


def test_routed_swiglu_blocks_declines_what_the_calls_would_not_take():
    """None, nothing written, where one of the calls would not run or the blocks do not cover the
    rows in order: float32 tensors, float64 combine weights, a block past the forward's rows, a
    gap between blocks, F not a multiple of 32; a ValueError for an expert out of range."""
    _needs_amx()
    torch.manual_seed(5)
    x, w1, w2, token, _, weight, blocks = routed_rows(3, 2, 5, 64, 96, bf16, pad=16)
    call = _amx.routed_swiglu_blocks
    assert call(x, token, weight, w1, w2, blocks, True) is not None
    assert call(x.float(), token, weight, w1.float(), w2.float(), blocks, True) is None
    assert call(x, token, weight.double(), w1, w2, blocks, True) is None
    assert call(x, token, weight, w1, w2, blocks[:-1], True) is None
    assert call(x, token, weight, w1, w2, [(e, s + 1, t + 1) for e, s, t in blocks], True) is None
    most = _amx.forward_max_rows((192, 64))
    many = torch.zeros(most + 1, dtype=torch.int64)
    assert call(x, many, torch.rand(most + 1), w1, w2, [(0, 0, most + 1)], True) is None
    # 2F = 96: not a multiple of 64
    x48, w1_48, w2_48, token48, _, weight48, blocks48 = routed_rows(3, 2, 5, 64, 48, bf16, pad=16)
    assert call(x48, token48, weight48, w1_48, w2_48, blocks48, True) is None
    with pytest.raises(ValueError, match="do not fit"):
        call(x, token, weight, w1, w2, [(5, s, t) for _, s, t in blocks], True)


@pytest.mark.parametrize("T", [1, 5, 40])
def test_bf16_layer_backward_in_one_call_is_the_loops(monkeypatch, T):
    """A routed bf16 layer's backward whose rows make one group, in one call
    (routed_swiglu_backward_blocks): the gradients of x, the router, both expert weights and the
    output bit for bit what grouped._ffn_backward's loop makes with that call switched off; the
    call ran. (Against the float64 loop: test_bf16_layer_runs_on_the_kernel_and_matches_float64.)"""
    _needs_amx()
    torch.manual_seed(T)
    moe = MoE(dim=64, hidden_dim=96, num_experts=6, top_k=2).bfloat16()
    x, g = torch.randn(T, 64, dtype=bf16), torch.randn(T, 64, dtype=bf16)
    real, ran = _amx.routed_swiglu_backward_blocks, []

    def recorded(*args):
        ran.append(real(*args))
        return ran[-1]

    def step(one_call: bool):
        monkeypatch.setattr(_amx, "routed_swiglu_backward_blocks", recorded if one_call else (lambda *a: False))
        leaf = x.clone().requires_grad_()
        y = moe(leaf)
        return [y, *torch.autograd.grad((y * g).sum(), [leaf, *moe.parameters()])]

    together, apart = step(True), step(False)
    assert ran == [True]
    for a, b in zip(together, apart):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_routed_swiglu_backward_blocks_declines_what_the_calls_would_not_take():
    """False where one of the calls would not run on its kernel or a block would add to another
    expert's piece: float32 tensors, float64 combine weights, an expert in two blocks, a block
    past the input gradients' rows, blocks not covering the rows."""
    _needs_amx()
    torch.manual_seed(6)
    E, D, F, T, K = 5, 64, 96, 3, 2
    x, w1, w2, token, _, weight, blocks = routed_rows(T, K, E, D, F, bf16, pad=16)
    h = torch.randn(token.shape[0], 2 * F, dtype=bf16)

    def call(g, x, h, w1, w2, token, weight, blocks):
        grads = torch.empty_like(x), torch.zeros_like(w1), torch.zeros_like(w2), torch.empty(token.shape[0])
        return _amx.routed_swiglu_backward_blocks(*grads, g, x, h, w1, w2, token, weight, blocks)

    g = torch.randn(T + 1, D, dtype=bf16)
    assert call(g, x, h, w1, w2, token, weight, blocks)
    assert not call(g.float(), x.float(), h.float(), w1.float(), w2.float(), token, weight, blocks)
    assert not call(g, x, h, w1, w2, token, weight.double(), blocks)
    if len(blocks) > 1:
        assert not call(g, x, h, w1, w2, token, weight, [(blocks[0][0], s, t) for _, s, t in blocks])
    assert not call(g, x, h, w1, w2, token, weight, blocks[:-1])
    many = min(_amx.input_grad_max_rows((D, F)), _amx.input_grad_max_rows((2 * F, D))) + 1
    assert not call(g, x, torch.randn(many, 2 * F, dtype=bf16), w1, w2, torch.zeros(many, dtype=torch.int64),
                    torch.rand(many), [(0, 0, many)])
    fewer = many - 1  # (the same call at the limit runs)
    assert call(g, x, torch.randn(fewer, 2 * F, dtype=bf16), w1, w2, torch.zeros(fewer, dtype=torch.int64),
                torch.rand(fewer), [(0, 0, fewer)])


# --- a bf16 layer on the kernel against the float64 loop ------------------------------------

@pytest.mark.parametrize("T", [3, 40, 220])
def test_bf16_layer_runs_on_the_kernel_and_matches_float64(monkeypatch, T):
    """Forward products, input gradients and weight gradients of a bf16 layer's experts on the
    kernel, block by block (T = 3: decode-sized blocks, which on AMX CPUs take no decode path;
    T = 220: ~110 rows, some experts past the input gradient's limit); output and the
    gradients of x, the router and both expert weights within bf16 rounding of the float64
    per-token loop."""
    _needs_amx()
    ran = {"linear": 0, "input_grad": 0, "weight_grad": 0}
    real = {name: getattr(_amx, fn) for name, fn in
            (("linear", "linear_into"), ("input_grad", "input_grad"), ("weight_grad", "weight_grad_into"))}

    def counted(name):
        def run(*args, **kwargs):
            result = real[name](*args, **kwargs)
            ran[name] += result is not None and result is not False
            return result
        return run

    monkeypatch.setattr(_amx, "linear_into", counted("linear"))
    def blocks_counted(name, fn):  # (a group's blocks in one call)
        real_blocks = getattr(_amx, fn)

        def run(out, a, b, blocks, *rest, **kwargs):
            done = real_blocks(out, a, b, blocks, *rest, **kwargs)
            ran[name] += len(blocks) if done else 0
            return done
        monkeypatch.setattr(_amx, fn, run)

    blocks_counted("linear", "linear_blocks")
    real_swiglu = _amx.swiglu_forward_blocks

    def swiglu_counted(h, a, x, w, blocks, **kwargs):  # (the first projection, with SwiGLU in it)
        done = real_swiglu(h, a, x, w, blocks, **kwargs)
        ran["linear"] += len(blocks) if done else 0
        return done

    monkeypatch.setattr(_amx, "swiglu_forward_blocks", swiglu_counted)
    real_routed = _amx.routed_swiglu_blocks

    def routed_counted(x, token, weight, w1, w2, blocks, keep_h):  # (both projections, one call)
        done = real_routed(x, token, weight, w1, w2, blocks, keep_h)
        ran["linear"] += 2 * len(blocks) if done is not None else 0
        return done

    monkeypatch.setattr(_amx, "routed_swiglu_blocks", routed_counted)
    real_routed_backward = _amx.routed_swiglu_backward_blocks

    def routed_backward_counted(*args):  # (both input gradients and both weight gradients, one call)
        done = real_routed_backward(*args)
        blocks = args[-1]
        ran["input_grad"] += 2 * len(blocks) if done else 0
        ran["weight_grad"] += 2 * len(blocks) if done else 0
        return done

    monkeypatch.setattr(_amx, "routed_swiglu_backward_blocks", routed_backward_counted)
    blocks_counted("input_grad", "input_grad_blocks")
    blocks_counted("weight_grad", "weight_grad_blocks")
    monkeypatch.setattr(_amx, "input_grad", counted("input_grad"))
    monkeypatch.setattr(_amx, "weight_grad_into", counted("weight_grad"))
    torch.manual_seed(T)
    D, F, E, K = 64, 96, 4, 2
    moe = MoE(dim=D, hidden_dim=F, num_experts=E, top_k=K).bfloat16()
    x = torch.randn(T, D, dtype=bf16, requires_grad=True)
    g = torch.randn(T, D, dtype=bf16)
    params = [x, moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj]
    y = moe(x)
    grads = torch.autograd.grad((y * g).sum(), params)
    active = int((moe.stats.tokens_per_expert_E > 0).sum())
    assert ran["linear"] == 2 * active and ran["weight_grad"] == 2 * active
    assert ran["input_grad"] >= 1
    leaves = [t.detach().double().requires_grad_() for t in params]
    ref = moe_forward(*leaves, K)
    ref_grads = torch.autograd.grad((ref * g.double()).sum(), leaves)
    assert (y.double() - ref).abs().max() <= 3e-2 * ref.abs().max()
    for name, a, b in zip(("x", "router", "gate_up_proj", "down_proj"), grads, ref_grads):
        assert (a.double() - b).abs().max() <= 3e-2 * b.abs().max(), name


@pytest.mark.parametrize("rows, O, I", [(1, 8, 64), (300, 8, 96), (33, 20, 64), (2048, 64, 1024), (5, 16, 32)])
def test_linear_float32_is_the_float32_sum_of_exact_products(rows, O, I):
    """`linear_float32` (the router's logits of bf16 tokens): each x·w within the worst case of
    any order of float32 additions of the exact products from float64's product, as a new
    contiguous float32 [rows, O] tensor, for O not a multiple of the tiles' 16 too (a weight
    padded with zero rows) and x with rows further apart; None for what it does not take."""
    _needs_amx()
    torch.manual_seed(rows + O + I)
    x, w = _strided(rows, I), torch.randn(O, I, dtype=bf16)
    y = _amx.linear_float32(x, w)
    assert y is not None and y.dtype == torch.float32 and y.shape == (rows, O) and y.is_contiguous()
    exact = x.double() @ w.double().T
    assert ((y.double() - exact).abs() <= (I + 2) * U32 * (x.double().abs() @ w.double().abs().T)).all()
    assert _amx.linear_float32(x.float(), w) is None and _amx.linear_float32(x, w.float()) is None
    assert _amx.linear_float32(x[:, : I - 16], w[:, : I - 16]) is None  # depth not a multiple of 32
    assert _amx.linear_float32(x[:0], w) is None and _amx.linear_float32(x, w[:, :-32]) is None


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("shape", [(48, 96), (1024, 1024), (256, 3584)])
def test_weight_grad_from_few_rows(rows, shape):
    """A weight gradient from up to 8 rows goes on outer products (AVX-512 FMAs: to 4 rows, and
    to 8 where b's rows stay in L1), past that on the tiles: within float64's bound either way;
    from one row, bit for bit the tiles' result (the same data with 9 zero rows appended goes
    on the tiles) and torch's rounding of the exact products; inputs and results below
    float32's normal range count as zero on both paths, as the tiles count them."""
    _needs_amx()
    torch.manual_seed(rows * 7 + shape[1])
    m, n = shape
    a, b, out = _weight_grad_checked(rows, m, n)
    if rows == 1:
        exact = (a.double().t() @ b.double()).float().bfloat16()
        assert torch.equal(out.view(torch.int16), exact.view(torch.int16))
        tiny = torch.tensor([1e-39, -3e-40, 1e-20], dtype=bf16)  # subnormal, subnormal, normal
        a[0, :3], b[0, :3] = tiny, torch.tensor([1.0, 1.0, 1e-20], dtype=bf16)  # products 1e-39, -3e-40, 1e-40
        zeros = torch.zeros(9, m, dtype=bf16), torch.zeros(9, n, dtype=bf16)
        tiles = torch.empty(m, n, dtype=bf16)
        assert _amx.weight_grad_into(out, a.t(), b)
        assert _amx.weight_grad_into(tiles, torch.cat((a, zeros[0])).t(), torch.cat((b, zeros[1])))
        assert torch.equal(out.view(torch.int16), tiles.view(torch.int16))
        assert (out[:2] == 0).all() and out[2, 2] == 0  # subnormal a; a product below the normal range
        assert out[2, 0] == tiny[2] and out[2, 3:].abs().sum() > 0
