"""grouped_linear and grouped_ffn against a per-expert loop (float64): outputs and gradients."""

import pytest
import torch

import moe_ffn.grouped as grouped
from moe_ffn import MoE, _small_gemm
from moe_ffn.grouped import grouped_ffn, grouped_linear, routed_ffn
from reference import act

f64 = dict(dtype=torch.float64)


def _blocks(counts):
    start = 0
    for e, c in enumerate(counts):
        yield e, start, start + c
        start += c


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_matches_loop_with_empty_experts_and_dropped_tail(bias):
    counts = torch.tensor([3, 0, 5, 1])
    N, I, O, E = 11, 6, 7, 4  # rows 9 and 10 belong to no expert (dropped)
    x = torch.randn(N, I, **f64, requires_grad=True)
    w = torch.randn(E, O, I, **f64, requires_grad=True)
    b = torch.randn(E, O, **f64, requires_grad=True) if bias else None
    y = grouped_linear(x, w, counts, b)
    rows = []
    for e, s, t in _blocks(counts.tolist()):
        if t > s:
            rows.append(x[s:t] @ w[e].T + (b[e] if bias else 0))
    ref = torch.cat(rows + [x.new_zeros(N - int(counts.sum()), O)])
    torch.testing.assert_close(y, ref, atol=1e-12, rtol=0)
    g = torch.randn_like(y)
    inputs = [x, w] + ([b] if bias else [])
    got = torch.autograd.grad((y * g).sum(), inputs)
    want = torch.autograd.grad((ref * g).sum(), inputs)
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, atol=1e-12, rtol=0)
    assert (got[1][1] == 0).all()  # the expert without rows


@pytest.mark.parametrize("activation, gated", [("silu", True), ("gelu_tanh", True), ("gelu", False), ("relu", False)])
def test_grouped_ffn_matches_loop(activation, gated):
    counts = torch.tensor([2, 4, 0])
    N, D, F, E = 7, 5, 6, 3
    H = 2 * F if gated else F
    x = torch.randn(N, D, **f64, requires_grad=True)
    w1 = torch.randn(E, H, D, **f64, requires_grad=True)
    w2 = torch.randn(E, D, F, **f64, requires_grad=True)
    y = grouped_ffn(x, w1, w2, counts, None, None, activation=activation, gated=gated)
    rows = []
    for e, s, t in _blocks(counts.tolist()):
        h = x[s:t] @ w1[e].T
        h = act(activation, h[:, :F]) * h[:, F:] if gated else act(activation, h)
        rows.append(h @ w2[e].T)
    ref = torch.cat(rows + [x.new_zeros(N - int(counts.sum()), D)])
    torch.testing.assert_close(y, ref, atol=1e-12, rtol=0)
    g = torch.randn_like(y)
    for a, r in zip(torch.autograd.grad((y * g).sum(), [x, w1, w2]), torch.autograd.grad((ref * g).sum(), [x, w1, w2])):
        torch.testing.assert_close(a, r, atol=1e-12, rtol=0)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation, gated", [("silu", True), ("gelu", False)])
def test_routed_ffn_matches_per_token_loop(activation, gated, bias):
    """routed_ffn (gather → experts → weighted sum, fused) against a loop over tokens and slots:
    the output and the gradients of x, every weight and bias, and the combine weights."""
    torch.manual_seed(3)
    T, D, F, E = 6, 5, 4, 4
    H = 2 * F if gated else F
    # rows in expert order: expert 0 ← tokens 1, 4; expert 1 none; expert 2 ← 0, 1, 5;
    # expert 3 ← 2; the last two rows (tokens 3 and 0) were dropped by a capacity limit.
    counts = torch.tensor([2, 0, 3, 1])
    token = torch.tensor([1, 4, 0, 1, 5, 2, 3, 0])
    x = torch.randn(T, D, **f64, requires_grad=True)
    w1 = torch.randn(E, H, D, **f64, requires_grad=True)
    w2 = torch.randn(E, D, F, **f64, requires_grad=True)
    b1 = torch.randn(E, H, **f64, requires_grad=True) if bias else None
    b2 = torch.randn(E, D, **f64, requires_grad=True) if bias else None
    weight = torch.rand(token.numel(), **f64, requires_grad=True)
    out = routed_ffn(x, w1, w2, counts, token, weight, b1, b2, activation=activation, gated=gated)

    expert_of_row = [e for e, c in enumerate(counts.tolist()) for _ in range(c)]
    ref_rows = [x.new_zeros(D) for _ in range(T)]
    for n, e in enumerate(expert_of_row):  # kept rows only; dropped rows add nothing
        t = int(token[n])
        h = w1[e] @ x[t] + (b1[e] if bias else 0)
        a = act(activation, h[:F]) * h[F:] if gated else act(activation, h)
        ref_rows[t] = ref_rows[t] + weight[n] * (w2[e] @ a + (b2[e] if bias else 0))
    ref = torch.stack(ref_rows)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)

    g = torch.randn_like(out)
    inputs = [x, w1, w2, weight] + ([b1, b2] if bias else [])
    got = torch.autograd.grad((out * g).sum(), inputs)
    want = torch.autograd.grad((ref * g).sum(), inputs, allow_unused=True)
    for name, a, r in zip(["x", "w1", "w2", "weight", "b1", "b2"], got, want):
        r = torch.zeros_like(a) if r is None else r
        torch.testing.assert_close(a, r, atol=1e-12, rtol=0, msg=name)
    assert (got[1][1] == 0).all() and (got[2][1] == 0).all()  # expert 1 has no rows
    assert (got[3][-2:] == 0).all()  # dropped rows: no output, no weight gradient


@pytest.mark.parametrize(
    "dtype, upcast", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)], ids=["fp32", "bf16", "bf16-upcast"]
)
def test_routed_sums_token_by_token_are_the_group_by_group_sums(monkeypatch, dtype, upcast):
    """The routed forward's weighted sum over each token's slots and the backward's sum of x's
    gradient over them, token by token once all slot rows are made (`_small_gemm.slot_sum_rows`):
    bit for bit the sums added group by group (the rows' kept size capped to nothing), which are
    within rounding of the float64 loop over tokens and slots; dropped rows add nothing, a
    token without rows gets 0 and a zero gradient. A bf16 layer multiplied in float32 (CPUs
    without bf16 units, `grouped._lowp_is_slow`; forced either way here) sums its forward token
    by token too, but its backward group by group: the gradient's slot rows come out in
    float32 there, not in x's dtype."""
    if not _small_gemm.slot_sums_fit(torch.ones(1), dtype, torch.ones(1)):
        pytest.skip("moe_ffn's CPU kernel is not built here")
    monkeypatch.setattr(grouped, "_lowp_is_slow", lambda t: upcast and t.dtype == torch.bfloat16)
    calls = []
    for name in ("slot_sum_rows", "scatter_add_rows"):
        real = getattr(_small_gemm, name)
        monkeypatch.setattr(_small_gemm, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    torch.manual_seed(6)
    T, D, F, E = 81, 40, 24, 4
    expert_TK = torch.randint(0, E, (T - 1, 3)) // 2 * 2  # experts 0 and 2; token 80 has no rows
    order = torch.argsort(expert_TK.reshape(-1), stable=True)
    token = order // 3
    counts = torch.bincount(expert_TK.reshape(-1), minlength=E)
    counts[2] -= 5  # its last 5 rows dropped
    x = torch.randn(T, D).to(dtype)
    w1, w2 = (torch.randn(E, 2 * F, D) / 6).to(dtype), (torch.randn(E, D, F) / 4).to(dtype)
    weight = torch.rand(token.numel())
    g = torch.randn(T, D).to(dtype)

    def run():
        x_ = x.clone().requires_grad_()
        out = routed_ffn(x_, w1, w2, counts, token, weight, activation="silu", gated=True)
        out.backward(g)
        return out.detach(), x_.grad

    out, grad = run()
    assert calls == ["slot_sum_rows", "scatter_add_rows" if upcast else "slot_sum_rows"]
    monkeypatch.setattr(grouped, "_SLOT_ROWS_MAX_BYTES", 0)
    calls.clear()
    grouped_out, grouped_grad = run()
    assert set(calls) == {"scatter_add_rows"}
    assert torch.equal(out, grouped_out) and torch.equal(grad, grouped_grad)
    assert torch.equal(out[80], torch.zeros(D, dtype=dtype)) and torch.equal(grad[80], torch.zeros(D, dtype=dtype))
    x64 = x.double().requires_grad_()
    w1_64, w2_64 = w1.double(), w2.double()
    rows = [x64.new_zeros(D) for _ in range(T)]
    expert_of_row = [e for e, c in enumerate(counts.tolist()) for _ in range(c)]
    for n, e in enumerate(expert_of_row):
        t = int(token[n])
        h = w1_64[e] @ x64[t]
        rows[t] = rows[t] + float(weight[n]) * (w2_64[e] @ (act("silu", h[:F]) * h[F:]))
    ref = torch.stack(rows)
    (ref_grad,) = torch.autograd.grad(ref, x64, g.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    ref = ref.detach()
    torch.testing.assert_close(out.double(), ref, atol=tol * float(ref.abs().max()), rtol=0)
    torch.testing.assert_close(grad.double(), ref_grad, atol=tol * float(ref_grad.abs().max()), rtol=0)


def test_routed_ffn_only_some_gradients():
    """A frozen router (weights without grad) and frozen experts still give the others."""
    T, D, F, E = 4, 3, 2, 2
    counts, token = torch.tensor([3, 2]), torch.tensor([0, 1, 3, 2, 3])
    x = torch.randn(T, D, **f64, requires_grad=True)
    w1, w2 = torch.randn(E, 2 * F, D, **f64), torch.randn(E, D, F, **f64)
    weight = torch.rand(5, **f64)
    out = routed_ffn(x, w1, w2, counts, token, weight, activation="silu", gated=True)
    (gx,) = torch.autograd.grad(out.sum(), [x])
    x2 = x.detach()
    w1.requires_grad_()
    out2 = routed_ffn(x2, w1, w2, counts, token, weight, activation="silu", gated=True)
    (gw1,) = torch.autograd.grad(out2.sum(), [w1])
    ref = sum(
        weight[n] * (w2[e] @ (torch.nn.functional.silu(w1[e, :F] @ x[t]) * (w1[e, F:] @ x[t])))
        for n, (e, t) in enumerate(zip([0, 0, 0, 1, 1], token.tolist()))
    )
    want_x, want_w1 = torch.autograd.grad(ref.sum(), [x, w1])
    torch.testing.assert_close(gx, want_x, atol=1e-12, rtol=0)
    torch.testing.assert_close(gw1, want_w1, atol=1e-12, rtol=0)


def test_routed_ffn_rejects_mismatched_rows():
    x, w1, w2 = torch.randn(2, 3), torch.randn(1, 4, 3), torch.randn(1, 3, 2)
    with pytest.raises(ValueError, match=r"token_N and weight_N .* got \(2,\) and \(3,\)"):
        routed_ffn(x, w1, w2, torch.tensor([2]), torch.tensor([0, 1]), torch.rand(3), activation="silu", gated=True)


@pytest.mark.parametrize("bias", [False, True])
def test_experts_cut_into_pieces_give_the_same_outputs_and_gradients(monkeypatch, bias):
    """With a tiny group budget every expert's block is cut into one-row pieces (forward) and
    its weight gradient is accumulated over them (backward): the loop references above still
    hold to 1e-12."""
    from moe_ffn import grouped

    monkeypatch.setattr(grouped, "_GROUP_ELEMENTS", 8)
    monkeypatch.setattr(grouped, "_ONE_GROUP_FACTOR", 1)  # (several groups, as the budget says)
    monkeypatch.setattr(grouped, "_PIECE_ELEMENTS", 8)
    pieces = grouped._groups([(0, 0, 3), (2, 3, 4)], 8, split=True)
    assert pieces == [[(0, 0, 1)], [(0, 1, 2)], [(0, 2, 3)], [(2, 3, 4)]]
    assert grouped._groups([(0, 0, 3)], 8, split=False) == [[(0, 0, 3)]]
    test_routed_ffn_matches_per_token_loop("silu", True, bias)
    test_routed_ffn_matches_per_token_loop("gelu", False, bias)
    test_grouped_ffn_matches_loop("silu", True)


def test_a_small_step_goes_in_one_group(monkeypatch):
    """Blocks of at most _ONE_GROUP_FACTOR budgets' worth in all form one group; past that,
    groups of the budget (the same number of elements for every compute dtype)."""
    monkeypatch.setattr(grouped, "_GROUP_ELEMENTS", 4 * 8)  # H = 8: 4 rows a group
    monkeypatch.setattr(grouped, "_ONE_GROUP_FACTOR", 2)
    blocks = [(0, 0, 3), (1, 3, 5), (2, 5, 8)]  # 8 rows: two budgets' worth
    assert grouped._groups(blocks, 8, split=False) == [blocks]
    more = blocks + [(3, 8, 9)]  # 9 rows
    assert grouped._groups(more, 8, split=False) == [[(0, 0, 3)], [(1, 3, 5)], [(2, 5, 8), (3, 8, 9)]]
    # by a width of 2: 16 rows a group, all 9 rows in one; 36 rows past two budgets
    assert grouped._groups(more, 2, split=False) == [more]
    most = more + [(4, 9, 14), (5, 14, 20), (6, 20, 30), (7, 30, 36)]
    assert grouped._groups(most, 2, split=False) == [more + [(4, 9, 14)], [(5, 14, 20), (6, 20, 30)], [(7, 30, 36)]]


def test_many_large_blocks_go_several_to_a_group(monkeypatch):
    """Where a step has more blocks than _GROUP_BLOCKS_A_THREAD a thread, the budget grows to
    that many blocks' worth on average (at most a piece's elements); with fewer blocks it stays."""
    monkeypatch.setattr(grouped, "_GROUP_ELEMENTS", 8)  # H = 8: 1 row a group
    monkeypatch.setattr(grouped, "_ONE_GROUP_FACTOR", 1)
    monkeypatch.setattr(grouped, "_GROUP_BLOCKS_A_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # 2 blocks a group
    blocks = [(e, e, e + 1) for e in range(8)]
    assert grouped._groups(blocks, 8, split=False) == [blocks[i : i + 2] for i in range(0, 8, 2)]
    assert grouped._groups(blocks[:2], 8, split=False) == [[b] for b in blocks[:2]]  # (not more than 2)
    monkeypatch.setattr(grouped, "_PIECE_ELEMENTS", 8)  # the growth stops at a piece
    assert grouped._groups(blocks, 8, split=False) == [[b] for b in blocks]
    monkeypatch.setattr(grouped, "_PIECE_ELEMENTS", 1 << 24)
    monkeypatch.setattr(grouped, "_GROUP_BLOCKS_A_THREAD", 0)  # off: the budget alone
    assert grouped._groups(blocks, 8, split=False) == [[b] for b in blocks]


@pytest.mark.parametrize("routed", [False, True])
def test_first_projection_runs_over_whole_blocks_when_the_rest_is_cut(monkeypatch, routed):
    """Cut into 2-row pieces, the forward still multiplies each expert's whole block by its
    first weight in one product (cutting that GEMM cost ~7 %); the down projection goes piece
    by piece. Outputs: the float64 loop, as in the test above."""
    monkeypatch.setattr(grouped, "_GROUP_ELEMENTS", 2 * 8)  # H = 8: pieces of 2 rows
    monkeypatch.setattr(grouped, "_ONE_GROUP_FACTOR", 1)  # (several groups, as the budget says)
    monkeypatch.setattr(grouped, "_PIECE_ELEMENTS", 2 * 8)
    seen = []
    real = grouped._linear_into
    monkeypatch.setattr(
        grouped, "_linear_into", lambda out, x, w, b, cdt: seen.append((w.shape[0], x.shape[0])) or real(out, x, w, b, cdt)
    )
    torch.manual_seed(4)
    counts, D, F = torch.tensor([5, 0, 3]), 6, 4
    x = torch.randn(8, D, **f64)
    w1, w2 = torch.randn(3, 2 * F, D, **f64), torch.randn(3, D, F, **f64)
    if routed:
        token_N, weight_N = torch.arange(8), torch.rand(8, **f64)
        y = routed_ffn(x, w1, w2, counts, token_N, weight_N, activation="silu", gated=True)
    else:
        y = grouped_ffn(x, w1, w2, counts, activation="silu", gated=True)
    assert [rows for out, rows in seen if out == 2 * F] == [5, 3]
    assert [rows for out, rows in seen if out == D] == [2, 2, 1, 2, 1]
    rows = []
    for e, s, t in _blocks(counts.tolist()):
        h = x[s:t] @ w1[e].T
        rows.append((act("silu", h[:, :F]) * h[:, F:]) @ w2[e].T)
    ref = torch.cat(rows) * (weight_N[:, None] if routed else 1)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sliced", [False, True])
def test_weight_gradients_written_by_accumulating_onto_zeros(monkeypatch, sliced):
    """Large weight gradients are written as zeros + a·b (grouped._ACCUMULATE_ELEMENTS), whole
    or in row slices (thin products): forced at these small sizes, the loop references still
    hold to 1e-12."""
    from moe_ffn import grouped

    monkeypatch.setattr(grouped, "_ACCUMULATE_ELEMENTS", 0)
    if sliced:
        monkeypatch.setattr(grouped, "_SLICED_MM_ELEMENTS", 4)
    test_routed_ffn_matches_per_token_loop("silu", True, True)
    test_grouped_ffn_matches_loop("gelu", False)
    test_grouped_linear_matches_loop_with_empty_experts_and_dropped_tail(True)


# The bf16 decode path exists where bf16 is multiplied in fp32 (no bf16 matrix units) and
# torch has a CPU grouped GEMM; elsewhere these tests have nothing to check.
_bf16_decode_path = pytest.mark.skipif(
    grouped._compute_dtype(torch.empty(0, dtype=torch.bfloat16)) == torch.bfloat16
    or not grouped._cpu_grouped_mm_available(),
    reason="this CPU multiplies bf16 natively (or torch lacks CPU _grouped_mm): no decode path",
)


def _bf16_decode_case(seed=5):
    """Decode-sized bf16 blocks (all ≤ 32 rows): expert 1 idle (NaN weights: never read),
    the last two rows dropped; dims multiples of 8 (torch._grouped_mm's alignment)."""
    torch.manual_seed(seed)
    T, D, F, E = 6, 16, 8, 4
    counts = torch.tensor([2, 0, 3, 1])
    token = torch.tensor([1, 4, 0, 1, 5, 2, 3, 0])
    x = torch.randn(T, D, dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * F, D, dtype=torch.bfloat16)
    w2 = torch.randn(E, D, F, dtype=torch.bfloat16)
    w1[1], w2[1] = float("nan"), float("nan")
    weight = torch.rand(token.numel())
    return x, w1, w2, counts, token, weight


def _bf16_decode_reference(x, w1, w2, counts, token, weight):
    """The float64 per-row loop of `_bf16_decode_case` (rows past the counted ones dropped)."""
    ref = torch.zeros(x.shape, dtype=torch.float64)
    expert = [e for e, c in enumerate(counts.tolist()) for _ in range(c)]
    for n, e in enumerate(expert[: int(counts.sum())]):
        t = int(token[n])
        h = w1[e].double() @ x[t].double()
        ref[t] += weight[n].double() * (w2[e].double() @ (torch.nn.functional.silu(h[:8]) * h[8:]))
    return ref


def _count_grouped_mm(monkeypatch):
    calls = []
    real = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    return calls


@_bf16_decode_path
def test_bf16_decode_runs_on_grouped_mm_as_the_per_block_loop_does(monkeypatch, torch_kernels_only):
    """On CPUs without bf16 matrix units (and without moe_ffn's own kernel, which takes these
    blocks where it is built), decode-sized bf16 blocks go through one
    torch._grouped_mm per projection; the result is the per-block loop's (the same native
    GEMMs), both within bf16 rounding of float64, and the gradients match too."""
    x, w1, w2, counts, token, weight = _bf16_decode_case()
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, weight)]
    calls = _count_grouped_mm(monkeypatch)
    out = routed_ffn(*leaves[:3], counts, token, leaves[3], activation="silu", gated=True)
    assert len(calls) == 2
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out.float() * g.float()).sum(), leaves)

    monkeypatch.setattr(grouped, "_cpu_grouped_mm_available", lambda: False)
    loop_leaves = [t.clone().requires_grad_() for t in (x, w1, w2, weight)]
    out_loop = routed_ffn(*loop_leaves[:3], counts, token, loop_leaves[3], activation="silu", gated=True)
    assert len(calls) == 2  # the loop did not call it
    loop_grads = torch.autograd.grad((out_loop.float() * g.float()).sum(), loop_leaves)

    kept = counts.sum()
    ref = _bf16_decode_reference(x, w1, w2, counts, token, weight)
    scale = ref.abs().max()
    assert (out.double() - ref).abs().max() <= 3e-2 * scale
    torch.testing.assert_close(out, out_loop, atol=2e-2 * float(scale), rtol=0)
    for name, a, b in zip(["x", "w1", "w2", "weight"], grads, loop_grads):
        a, b = torch.nan_to_num(a.double()), torch.nan_to_num(b.double())
        torch.testing.assert_close(a, b, atol=2e-2 * float(b.abs().max()), rtol=0, msg=name)
    assert (grads[1][1] == 0).all() and (grads[2][1] == 0).all()  # the idle expert
    assert (grads[3][kept:] == 0).all()  # dropped rows


@_bf16_decode_path
def test_bf16_decode_grouped_ffn_zeroes_rows_past_the_counted_ones(monkeypatch, torch_kernels_only):
    x, w1, w2, counts, token, _ = _bf16_decode_case()
    x_ND = x.index_select(0, token)
    calls = _count_grouped_mm(monkeypatch)
    y = grouped_ffn(x_ND, w1, w2, counts, activation="silu", gated=True)
    assert len(calls) == 2
    kept = int(counts.sum())
    assert torch.isfinite(y).all() and (y[kept:] == 0).all()
    monkeypatch.setattr(grouped, "_cpu_grouped_mm_available", lambda: False)
    y_loop = grouped_ffn(x_ND, w1, w2, counts, activation="silu", gated=True)
    torch.testing.assert_close(y, y_loop, atol=2e-2 * float(y_loop.abs().max()), rtol=0)


@pytest.mark.skipif(not grouped._cpu_grouped_mm_available(), reason="torch lacks CPU _grouped_mm")
def test_bf16_units_decode_runs_on_grouped_mm_when_a_block_outgrows_the_kernel(monkeypatch):
    """On CPUs with bf16 units (forced here, as is the kernel's 2-row bf16 limit there):
    decode-sized blocks with one of 3 rows go through one torch._grouped_mm per projection,
    within bf16 rounding of the float64 loop and of the per-block loop; blocks of at most 2
    rows each stay off it (the kernel, or the loop, takes them). (AVX512-BF16 CPUs without AMX
    take such blocks on bf16 dot products instead: switched off here, tested below.)"""
    monkeypatch.setattr(grouped, "_cpu_has_matrix_units", lambda dtype: True)
    monkeypatch.setattr(grouped._small_gemm, "_bf16_blocks_entry_points", lambda: None)
    limits = grouped._small_gemm.Ranges(forward=8, input_grad=8, weight_grad=0, bf16=2)
    monkeypatch.setattr(grouped._small_gemm, "ranges", lambda: limits)
    x, w1, w2, counts, token, weight = _bf16_decode_case()  # blocks of 2, 0, 3, 1 rows
    calls = _count_grouped_mm(monkeypatch)
    with torch.no_grad():
        out = routed_ffn(x, w1, w2, counts, token, weight, activation="silu", gated=True)
        assert len(calls) == 2
        ref = _bf16_decode_reference(x, w1, w2, counts, token, weight)
        assert (out.double() - ref).abs().max() <= 3e-2 * ref.abs().max()
        monkeypatch.setattr(grouped, "_cpu_grouped_mm_available", lambda: False)
        out_loop = routed_ffn(x, w1, w2, counts, token, weight, activation="silu", gated=True)
        torch.testing.assert_close(out, out_loop, atol=2e-2 * float(ref.abs().max()), rtol=0)
        monkeypatch.setattr(grouped, "_cpu_grouped_mm_available", lambda: True)
        small = torch.tensor([2, 0, 2, 1])
        routed_ffn(x, w1, w2, small, token[:5], weight[:5], activation="silu", gated=True)
        assert len(calls) == 2  # no more calls


def test_bf16_decode_on_avx512_bf16_runs_in_one_kernel_call_per_projection(monkeypatch):
    """On AVX512-BF16 CPUs without AMX, decode-sized bf16 blocks (2, 0, 3 and 1 rows) run in one
    call of the bf16 dot-product kernel per projection, no torch._grouped_mm, within bf16
    rounding of the float64 loop; the idle expert (NaN weights) is never read; its gradients
    (through the backward's bf16 blocks kernels) within bf16 rounding of float64's."""
    if _small_gemm._bf16_blocks_entry_points() is None:
        pytest.skip("no bf16 blocks kernels here (not an AVX512-BF16 CPU without AMX, or the library not built)")
    x, w1, w2, counts, token, weight = _bf16_decode_case()
    grouped_mm_calls = _count_grouped_mm(monkeypatch) if grouped._cpu_grouped_mm_available() else []
    calls, real = [], _small_gemm.linear_blocks
    monkeypatch.setattr(_small_gemm, "linear_blocks", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    out = routed_ffn(*leaves, counts, token, weight, activation="silu", gated=True)
    assert len(calls) == 2 and grouped_mm_calls == []
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w1, w2)]
    ref = _bf16_decode_reference(*ref_leaves, counts, token, weight)
    assert (out.double() - ref).abs().max() <= 3e-2 * ref.abs().max()
    g = torch.linspace(-1, 1, out.numel()).view(out.shape)
    grads = torch.autograd.grad((out.float() * g).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * g.double()).sum(), ref_leaves)
    for got, want in zip(grads, ref_grads):
        used = want.isfinite()  # (the idle expert's float64 gradient is NaN·0)
        assert (got.double()[used] - want[used]).abs().max() <= 3e-2 * want[used].abs().max()
    assert (grads[1][1] == 0).all() and (grads[2][1] == 0).all()  # the idle expert: exact zeros


def test_bf16_decode_with_unaligned_dims_stays_on_the_loop(monkeypatch):
    """torch._grouped_mm needs 16-byte strides: D = 12 bf16 elements takes the loop."""
    torch.manual_seed(0)
    x = torch.randn(3, 12, dtype=torch.bfloat16)
    w1, w2 = torch.randn(2, 16, 12, dtype=torch.bfloat16), torch.randn(2, 12, 8, dtype=torch.bfloat16)
    calls = _count_grouped_mm(monkeypatch)
    out = routed_ffn(x, w1, w2, torch.tensor([2, 1]), torch.tensor([0, 2, 1]), torch.rand(3), activation="silu", gated=True)
    assert calls == [] and torch.isfinite(out).all()


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """t rounded to bf16 (nearest even), back in t's dtype."""
    return t.to(torch.bfloat16).to(t.dtype)


@pytest.mark.skipif(
    grouped._compute_dtype(torch.empty(0, dtype=torch.bfloat16)) == torch.bfloat16,
    reason="this CPU multiplies bf16 natively: bf16 products, not float32 ones",
)
def test_bf16_routed_forward_rounds_where_a_native_bf16_layer_would():
    """A bf16 layer's forward on blocks of 9-64 rows (float32 products of bf16 operands, both
    projections through moe_ffn's kernel where it is built): every element within one bf16
    rounding of a float64 loop that rounds to bf16 where the layer does (the first
    projection, the activation, each slot's down projection; the weighted sum in float64).
    Products summed in float32 flip a rounding now and then (no element here); a 0.3 % error
    in the activation put 22 % of the elements outside, a 1 % one 57 %."""
    torch.manual_seed(11)
    D, F, E, T = 96, 80, 4, 48
    counts = torch.tensor([30, 0, 9, 57])  # (an idle expert; blocks of 9 to 57 rows)
    N = int(counts.sum())
    token = torch.randint(0, T, (N,))
    weight = torch.rand(N)
    x = torch.randn(T, D).bfloat16()
    w1 = (torch.randn(E, 2 * F, D) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F) / F**0.5).bfloat16()
    out = routed_ffn(x, w1, w2, counts, token, weight, activation="silu", gated=True).double()
    want = torch.zeros(T, D, dtype=torch.float64)
    expert = torch.repeat_interleave(torch.arange(E), counts)
    for n in range(N):
        e, t = int(expert[n]), int(token[n])
        h = _bf16(w1[e].double() @ x[t].double())
        a = _bf16(torch.nn.functional.silu(h[:F]) * h[F:])
        want[t] += float(weight[n]) * _bf16(w2[e].double() @ a)
    want = _bf16(want)  # (the layer's output is bf16)
    close = (out - want).abs() <= 2.0**-7 * want.abs() + 1e-6
    assert close.float().mean() >= 0.97, f"{(~close).sum().item()} of {close.numel()} elements off"


@pytest.mark.skipif(
    grouped._compute_dtype(torch.empty(0, dtype=torch.bfloat16)) == torch.bfloat16,
    reason="this CPU multiplies bf16 natively: no decode path",
)
@pytest.mark.parametrize("routed", [True, False])
@pytest.mark.parametrize("kernel", [True, False])
def test_bf16_one_row_blocks_run_in_one_call_per_projection(monkeypatch, routed, kernel):
    """Blocks of one row each (a one-token decode step) go to moe_ffn's kernel, one call per
    projection (its row-by-row read of bf16 weights), or where it is not built through
    torch.mv, two per block; outputs and gradients are the per-block loop's, within bf16
    rounding of float64; the dropped last row stays zero and the idle expert (NaN weights) is
    never read."""
    if kernel and not _small_gemm.available():
        pytest.skip("moe_ffn's kernel is not built or switched off here")
    if not kernel:
        monkeypatch.setattr(_small_gemm, "available", lambda: False)
    torch.manual_seed(8)
    D, F, E = 16, 8, 4
    counts = torch.tensor([1, 0, 1, 1])
    token, weight = torch.tensor([2, 0, 1, 3]), torch.rand(4)
    x = torch.randn(4, D, dtype=torch.bfloat16)
    w1, w2 = torch.randn(E, 2 * F, D, dtype=torch.bfloat16), torch.randn(E, D, F, dtype=torch.bfloat16)
    w1[1], w2[1] = float("nan"), float("nan")

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, weight)]
        if routed:
            out = routed_ffn(*leaves[:3], counts, token, leaves[3], activation="silu", gated=True)
        else:
            out = grouped_ffn(*leaves[:3], counts, activation="silu", gated=True)
        g = torch.linspace(-1, 1, out.numel()).view(out.shape)
        return out, torch.autograd.grad((out.float() * g).sum(), leaves[: 4 if routed else 3])

    mv_calls, kernel_calls = [], []
    real_mv, real_blocks = torch.mv, _small_gemm.linear_blocks
    monkeypatch.setattr(torch, "mv", lambda *a, **k: mv_calls.append(1) or real_mv(*a, **k))
    monkeypatch.setattr(_small_gemm, "linear_blocks", lambda *a, **k: kernel_calls.append(a[2]) or real_blocks(*a, **k))
    out, grads = run()
    if kernel:  # the forward's two projections, each over all three blocks
        assert mv_calls == [] and kernel_calls == [[(0, 0, 1), (2, 1, 2), (3, 2, 3)]] * 2
    else:
        assert len(mv_calls) == 6 and kernel_calls == []
    calls = len(mv_calls)
    monkeypatch.setattr(grouped, "_decode_projection", lambda *args: None)
    out_loop, loop_grads = run()
    assert len(mv_calls) == calls  # the loop did not call it

    ref = torch.zeros(out.shape, dtype=torch.float64)
    for n, e in enumerate([0, 2, 3]):
        h = w1[e].double() @ x[token[n] if routed else n].double()
        y = w2[e].double() @ (torch.nn.functional.silu(h[:F]) * h[F:])
        if routed:
            ref[token[n]] += weight[n].double() * y
        else:
            ref[n] = y
    scale = float(ref.abs().max())
    assert (out.double() - ref).abs().max() <= 3e-2 * scale
    torch.testing.assert_close(out, out_loop, atol=2e-2 * scale, rtol=0)
    if not routed:
        assert (out[3] == 0).all()
    for name, a, b in zip(["x", "w1", "w2", "weight"], grads, loop_grads):
        a, b = torch.nan_to_num(a.double()), torch.nan_to_num(b.double())
        torch.testing.assert_close(a, b, atol=2e-2 * float(b.abs().max()), rtol=0, msg=name)
    assert (grads[1][1] == 0).all() and (grads[2][1] == 0).all()


@pytest.mark.parametrize("bias", [False, True])
def test_float32_decode_sized_blocks_match_float64(bias):
    """float32 blocks of 1, 3 and 12 rows against weights of 2^18–2^19 elements: the sizes at
    which the products switch kernels (oneDNN for one row, W·xᵀ for a few; see grouped._linear)
    give the float64 loop's outputs and gradients to float32 accuracy."""
    _float32_blocks_match_float64(torch.tensor([1, 3, 0, 12]), 512, 512, bias)


def test_thin_weight_gradients_as_outer_products_match_float64(monkeypatch):
    """Weight gradients from 2–4 rows are sums of outer products (grouped._OUTER_INNER), also
    when an expert's block is cut into 2-row pieces whose gradients accumulate: float64 loop.
    (Where moe_ffn's kernels are built they take these first, as where they are not built
    this path runs: switched off here.)"""
    monkeypatch.setattr(grouped._small_gemm, "avx512_weight_grad_into", lambda *args, **kwargs: False)
    monkeypatch.setattr(grouped._small_gemm, "weight_grad_into", lambda *args, **kwargs: False)
    calls = []
    real = grouped._outer_products_into
    monkeypatch.setattr(grouped, "_outer_products_into", lambda out, a, b, acc: calls.append((a.shape[1], acc)) or real(out, a, b, acc))
    _float32_blocks_match_float64(torch.tensor([1, 3, 0, 4]), 256, 128, bias=True)
    assert sorted(set(calls)) == [(3, False), (4, False)]
    calls.clear()
    monkeypatch.setattr(grouped, "_GROUP_ELEMENTS", 2 * 2 * 128)  # pieces of 2 rows
    monkeypatch.setattr(grouped, "_ONE_GROUP_FACTOR", 1)  # (several groups, as the budget says)
    monkeypatch.setattr(grouped, "_PIECE_ELEMENTS", 2 * 2 * 128)
    _float32_blocks_match_float64(torch.tensor([1, 3, 0, 4]), 256, 128, bias=True)
    assert sorted(set(calls)) == [(2, False), (2, True)]


def test_wide_input_gradients_on_sgemm_match_float64(monkeypatch):
    """The down projection's input gradient into a result 3× wider than the gradient
    (grouped._WIDE_SGEMM_MIN_ROWS, forced down to 8 rows here): float64 loop."""
    monkeypatch.setattr(grouped, "_WIDE_SGEMM_MIN_ROWS", 8)
    _float32_blocks_match_float64(torch.tensor([1, 9, 0, 12]), 128, 384, bias=False)



def test_wide_input_gradients_as_weight_times_gradient_match_float64(monkeypatch, torch_kernels_only):
    """Between grouped._WIDE_W_XT_ROWS (forced to 8–16 rows here) the down projection's input
    gradient runs as W·gᵀ on the transposed weight view on AVX2 CPUs: taken for the 9- and
    12-row blocks, not for the 1-row one, and the float64 loop's gradients come out."""
    monkeypatch.setattr(grouped, "_WIDE_W_XT_ROWS", (8, 16))
    monkeypatch.setattr(grouped, "_torch_on_avx512", lambda: False)
    calls = []
    real = torch.mm
    def spy(a, b, *args, **kwargs):
        if tuple(a.shape) == (384, 128) and not a.is_contiguous():
            calls.append(b.shape[1])
        return real(a, b, *args, **kwargs)
    monkeypatch.setattr(torch, "mm", spy)
    _float32_blocks_match_float64(torch.tensor([1, 9, 0, 12]), 128, 384, bias=False)
    assert sorted(calls) == [9, 12]


def test_input_gradients_from_one_or_two_rows_split_the_inner_dim_and_match_float64(monkeypatch, torch_kernels_only):
    """g·W from 1–2 rows (grouped._SPLIT_INNER_MAX_ROWS) runs as a batch of two half products:
    taken for the 1- and 2-row blocks' two input gradients (through W2, then W1), not for the
    3-row block, and the float64 loop's outputs and gradients come out (the AVX2 CPUs' choice)."""
    monkeypatch.setattr(grouped, "_torch_on_avx512", lambda: False)
    calls = []
    real = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b, *args, **kw: calls.append(tuple(b.shape)) or real(a, b, *args, **kw))
    _float32_blocks_match_float64(torch.tensor([1, 2, 0, 3]), 64, 96, bias=False)
    # through W2 ([64, 96]): halves of its 64 rows; through W1 ([192, 64]): halves of 192
    assert sorted(calls) == [(2, 32, 96)] * 2 + [(2, 96, 64)] * 2

def test_avx512_choices_input_gradients_on_sgemm_and_small_forwards_as_w_xt(monkeypatch, torch_kernels_only):
    """On AVX-512 CPUs (grouped._torch_on_avx512, forced here) every input gradient g·W runs on
    MKL's sgemm as torch.mm(g, W) into its block of the output, and forward blocks of up to
    grouped._AVX512_W_XT_MAX_ROWS rows as W·xᵀ; larger forward blocks do not; the float64
    loop's outputs and gradients come out."""
    monkeypatch.setattr(grouped, "_torch_on_avx512", lambda: True)
    input_grad_rows, w_xt_rows = [], []
    real_mm = torch.mm

    def mm_spy(a, b, *args, **kwargs):
        if a.is_contiguous() and b.stride(0) == 1 and b.shape[1] > 0 and a.shape[1] == b.shape[0] > 1:
            w_xt_rows.append(b.shape[1])
        if "out" in kwargs and a.is_contiguous() and b.is_contiguous() and a.shape[1] == b.shape[0] > 1:
            input_grad_rows.append(a.shape[0])  # g [rows, O] · W [O, I]
        return real_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "mm", mm_spy)
    big = grouped._AVX512_W_XT_MAX_ROWS + 1
    _float32_blocks_match_float64(torch.tensor([1, 9, 0, big]), 64, 96, bias=False)
    assert sorted(input_grad_rows) == [1, 1, 9, 9, big, big]  # through W2, then W1, per block
    assert sorted(w_xt_rows) == [1, 1, 9, 9]  # both forward projections of the small blocks


def _float32_blocks_match_float64(counts, D, F, bias):
    torch.manual_seed(11)
    E = counts.numel()
    N = int(counts.sum())
    x64 = torch.randn(N, D, **f64)
    w1_64 = torch.randn(E, 2 * F, D, **f64) / D**0.5
    w2_64 = torch.randn(E, D, F, **f64) / F**0.5
    b1_64 = torch.randn(E, 2 * F, **f64) if bias else None
    b2_64 = torch.randn(E, D, **f64) if bias else None
    leaves32 = [t.float().requires_grad_() for t in (x64, w1_64, w2_64) + ((b1_64, b2_64) if bias else ())]
    leaves64 = [t.clone().requires_grad_() for t in (x64, w1_64, w2_64) + ((b1_64, b2_64) if bias else ())]
    y = grouped_ffn(*leaves32[:3], counts, *(leaves32[3:] or (None, None)), activation="silu", gated=True)
    x, w1, w2 = leaves64[:3]
    rows = []
    for e, s, t in _blocks(counts.tolist()):
        if t > s:
            h = x[s:t] @ w1[e].T + (leaves64[3][e] if bias else 0)
            rows.append((act("silu", h[:, :F]) * h[:, F:]) @ w2[e].T + (leaves64[4][e] if bias else 0))
    ref = torch.cat(rows)
    torch.testing.assert_close(y.double(), ref, atol=1e-4 * float(ref.detach().abs().max()), rtol=0)
    g = torch.randn_like(ref)
    got = torch.autograd.grad((y.double() * g).sum(), leaves32)
    want = torch.autograd.grad((ref * g).sum(), leaves64)
    for name, a, r in zip(["x", "w1", "w2", "b1", "b2"], got, want):
        torch.testing.assert_close(a.double(), r, atol=1e-4 * float(r.abs().max()), rtol=0, msg=name)


@pytest.mark.parametrize("gated", [True, False])
def test_bf16_blocks_upcast_with_biases_match_float64(gated):
    """bf16 blocks of 12 and 40 rows (multiplied in fp32 on CPUs without bf16 matrix units,
    see grouped._NATIVE_LOWP_MAX_ROWS) with biases: within bf16 rounding of the float64 loop."""
    torch.manual_seed(2)
    D, F, E = 16, 12, 3
    H = 2 * F if gated else F
    counts = torch.tensor([12, 0, 40])
    x = torch.randn(52, D).bfloat16()
    w1, w2 = torch.randn(E, H, D).bfloat16() / 4, torch.randn(E, D, F).bfloat16() / 4
    b1, b2 = torch.randn(E, H).bfloat16(), torch.randn(E, D).bfloat16()
    y = grouped_ffn(x, w1, w2, counts, b1, b2, activation="silu", gated=gated)
    assert y.dtype == torch.bfloat16
    rows = []
    for e, s, t in _blocks(counts.tolist()):
        if t > s:
            h = x[s:t].double() @ w1[e].double().T + b1[e].double()
            a = act("silu", h[:, :F]) * h[:, F:] if gated else act("silu", h)
            rows.append(a @ w2[e].double().T + b2[e].double())
    ref = torch.cat(rows)
    assert (y.double() - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_grouped_linear_input_gradient_is_differentiable_again():
    """With create_graph=True the input gradient of grouped_linear is itself differentiable
    (the eager path hands such backwards to the ops): second derivatives equal those of a
    float64 per-block loop."""
    torch.manual_seed(5)
    counts = torch.tensor([2, 0, 3])
    x64, w64 = torch.randn(6, 8, **f64), torch.randn(3, 5, 8, **f64)

    def second_order(linear, x, w):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        (gx,) = torch.autograd.grad(linear(x, w).square().sum(), x, create_graph=True)
        return torch.autograd.grad((gx * torch.arange(1.0, 9.0, **f64)).sum(), (x, w))

    def loop(x, w):
        rows = [x[s:t] @ w[e].T for e, s, t in _blocks(counts.tolist()) if t > s]
        return torch.cat(rows + [x.new_zeros(x.shape[0] - int(counts.sum()), w.shape[1])])

    got = second_order(lambda x, w: grouped_linear(x.float(), w.float(), counts).double(), x64, w64)
    want = second_order(loop, x64, w64)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4 * float(b.abs().max()), rtol=0)


@pytest.mark.parametrize("routed", [False, True])
def test_inference_forward_reuses_one_group_buffer_for_the_first_projection(monkeypatch, routed):
    """Under no_grad nothing is kept for backward: the first projection goes into one buffer of
    the largest group's rows (3 here: groups of rows [0, 3), [3, 5), [5, 8)), reused group after
    group, instead of an [N, H] tensor; the output is the training forward's, bit for bit. (The
    per-group loop: blocks this small would otherwise go to the kernel's one call for all
    blocks, grouped._kernel_blocks.)"""
    monkeypatch.setattr(grouped._small_gemm, "blocks_fit", lambda blocks: False)
    torch.manual_seed(9)
    counts = torch.tensor([2, 1, 0, 2, 3])
    D, F, N = 6, 4, 8
    monkeypatch.setattr(grouped, "_GROUP_ELEMENTS", 3 * 2 * F)
    monkeypatch.setattr(grouped, "_ONE_GROUP_FACTOR", 1)  # (several groups, as the budget says)
    shapes = []
    real = grouped._memory.empty
    monkeypatch.setattr(grouped._memory, "empty", lambda like, *shape, **kw: shapes.append(shape) or real(like, *shape, **kw))
    x = torch.randn(N, D)
    w1, w2 = torch.randn(5, 2 * F, D), torch.randn(5, D, F)
    if routed:
        token_N, weight_N = torch.randperm(N), torch.rand(N)
        run = lambda x, w1: routed_ffn(x, w1, w2, counts, token_N, weight_N, activation="silu", gated=True)
    else:
        run = lambda x, w1: grouped_ffn(x, w1, w2, counts, activation="silu", gated=True)
    y_train = run(x, w1.requires_grad_())
    assert (N, 2 * F) in shapes
    shapes.clear()
    with torch.no_grad():
        y_infer = run(x, w1)
    assert (3, 2 * F) in shapes and (N, 2 * F) not in shapes
    assert torch.equal(y_infer, y_train)


# --- the CUDA path's logic, run on CPU ---------------------------------------------------
# On CUDA (bf16, compute capability ≥ 8.0) grouped_linear runs torch._grouped_mm with the
# block boundaries as a device tensor, and its backward two more grouped products, without a
# host sync. No GPU was lent to this project; torch's CPU _grouped_mm takes the same operands
# under the same stride rules, so these tests force that path on CPU (float32 and bf16) and
# hold it to a float64 loop. They check the path's logic (offsets, rows past the last block
# masked, the backward's products, biases, no host sync), not CUDA's kernels.

_cpu_grouped_mm = pytest.mark.skipif(not grouped._cpu_grouped_mm_available(), reason="torch lacks CPU _grouped_mm")


def force_grouped_mm_path(monkeypatch):
    """Send grouped_linear down the grouped-GEMM path on CPU; any host sync fails the test.
    Returns the list that counts torch._grouped_mm calls."""
    monkeypatch.setattr(grouped, "_use_torch_grouped_mm", lambda x, w: grouped._grouped_mm_aligned(x, w))

    def no_host_sync(*args, **kwargs):
        raise AssertionError("the grouped-GEMM path read the counts back to the host")

    monkeypatch.setattr(grouped, "_row_blocks", no_host_sync)
    monkeypatch.setattr(torch.Tensor, "tolist", no_host_sync)
    monkeypatch.setattr(torch.Tensor, "item", no_host_sync)
    return _count_grouped_mm(monkeypatch)


@_cpu_grouped_mm
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_on_the_grouped_mm_path_matches_float64_loop(monkeypatch, dtype, tol, bias):
    """Expert 1 idle, rows 35–39 in no block: their outputs and their share of every
    gradient are exact zeros (torch's kernel leaves those output rows unwritten)."""
    counts = torch.tensor([8, 0, 20, 7])
    N, I, O, E = 40, 16, 24, 4
    x64 = torch.randn(N, I, **f64)
    w64 = torch.randn(E, O, I, **f64) / 4
    b64 = torch.randn(E, O, **f64) if bias else None
    g64 = torch.randn(N, O, **f64)
    # the reference: float64 on the same (rounded) values
    x64, w64, g64 = (t.to(dtype).double() for t in (x64, w64, g64))
    b64 = None if b64 is None else b64.to(dtype).double()
    leaves64 = [t.requires_grad_() for t in (x64, w64, b64) if t is not None]
    rows = [x64[s:t] @ w64[e].T + (b64[e] if bias else 0) for e, s, t in _blocks(counts.tolist())]
    ref = torch.cat(rows + [x64.new_zeros(N - int(counts.sum()), O)])
    want = torch.autograd.grad((ref * g64).sum(), leaves64)

    calls = force_grouped_mm_path(monkeypatch)
    leaves = [t.detach().to(dtype).requires_grad_() for t in leaves64]
    y = grouped_linear(leaves[0], leaves[1], counts, leaves[2] if bias else None)
    assert len(calls) == 1 and y.dtype == dtype
    assert (y[35:] == 0).all()
    torch.testing.assert_close(y.double(), ref.detach(), atol=tol * 8, rtol=tol)
    got = torch.autograd.grad(y, leaves, g64.to(dtype))
    assert len(calls) == 3  # the input gradient and every weight gradient: one product each
    for name, a, r in zip(["x", "w", "b"], got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), r, atol=tol * 8, rtol=tol, msg=lambda m: f"grad {name}: {m}")
    assert (got[0][35:] == 0).all() and (got[1][1] == 0).all()
    if bias:
        assert (got[2][1] == 0).all()


@_cpu_grouped_mm
def test_grouped_mm_path_is_taken_only_for_aligned_operands(monkeypatch):
    """Strides the kernel cannot take (I = 12 bf16 elements: 24 bytes) stay on the loop."""
    monkeypatch.setattr(grouped, "_use_torch_grouped_mm", lambda x, w: grouped._grouped_mm_aligned(x, w))
    calls = _count_grouped_mm(monkeypatch)
    counts = torch.tensor([3, 2])
    x = torch.randn(5, 12, dtype=torch.bfloat16)
    y = grouped_linear(x, torch.randn(2, 16, 12, dtype=torch.bfloat16), counts)
    assert calls == [] and y.shape == (5, 16)
    grouped_linear(torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(2, 16, 16, dtype=torch.bfloat16), counts)
    assert len(calls) == 1


@pytest.mark.parametrize("outer_rows", [128, None])
def test_gradients_on_the_avx512_blocked_product_where_sgemm_runs_at_avx2_width(monkeypatch, outer_rows):
    """Where MKL's sgemm runs at AVX2 width on an AVX-512 CPU (_small_gemm.sgemm_at_avx2_width,
    forced here), every float32 input gradient g·W runs on the blocked product, and so do the
    weight gradients of blocks past SGEMM_AVX2_WEIGHT_GRAD_ROWS (with 128 there, the 130-row
    block's, not the others'; with its own 8192, none: the deep panels of the weight-gradient
    kernel take them); the float64 loop's outputs and gradients come out."""
    if grouped._small_gemm._avx512_entry_points() is None or grouped._small_gemm._matmul_entry_point() is None:
        pytest.skip("no AVX-512 kernels here (CPU without AVX-512, or the library not built)")
    monkeypatch.setattr(grouped._small_gemm, "sgemm_at_avx2_width", lambda: True)
    if outer_rows is not None:
        monkeypatch.setattr(grouped._small_gemm, "SGEMM_AVX2_WEIGHT_GRAD_ROWS", (1, outer_rows))
    calls = []
    real = grouped._small_gemm.avx512_matmul_into

    def spy(out, a, b):
        ran = real(out, a, b)
        calls.append(("weight" if a.stride(0) == 1 and a.shape[1] > 1 else "input", a.shape[0] if a.stride(0) != 1 else a.shape[1], ran))
        return ran

    monkeypatch.setattr(grouped._small_gemm, "avx512_matmul_into", spy)
    D, F = 96, 80
    _float32_blocks_match_float64(torch.tensor([1, 130, 0, 12]), D, F, bias=False)
    assert all(ran for *_, ran in calls)
    inputs = sorted(rows for kind, rows, _ in calls if kind == "input")
    weights = sorted(rows for kind, rows, _ in calls if kind == "weight")
    assert inputs == [1, 1, 12, 12, 130, 130]  # through W2, then W1, per block
    assert weights == ([130, 130] if outer_rows == 128 else [])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("avx2_width", [True, False])
def test_large_float32_forward_blocks_on_onednn_where_sgemm_runs_at_avx2_width(monkeypatch, bias, avx2_width):
    """Forward blocks past grouped._ONEDNN_MAX_ROWS go to oneDNN's inner product where MKL's
    sgemm runs at AVX2 width on an AVX-512 CPU (_small_gemm.sgemm_at_avx2_width, forced here),
    to the BLAS elsewhere (forced off): the 520-row block's two projections, not the others'
    (in oneDNN's row parts: its first 512 rows in one product); the float64 loop's outputs and
    gradients come out either way. sgemm at AVX2 width is a state of CPUs that torch runs at
    AVX-512 only: where it runs at AVX2, moe_ffn's AVX2 kernel takes these blocks first and
    its AVX-512 ones cannot run, so the forced state does not exist there."""
    if not grouped._onednn_linear_available():
        pytest.skip("torch has no oneDNN inner product here")
    if avx2_width and not _small_gemm._torch_on_avx512():
        pytest.skip("torch runs at AVX2 here: sgemm at AVX2 width on an AVX-512 CPU cannot be forced")
    monkeypatch.setattr(grouped._small_gemm, "sgemm_at_avx2_width", lambda: avx2_width)
    # (the AVX-512 forward kernel below the 512-row head, which it would take on Zen 4)
    monkeypatch.setattr(grouped._small_gemm, "_avx512_forward_rows", lambda: (1, 96))
    rows = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, w, *args):
        rows.append(x.shape[0])
        return real(x, w, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    big = grouped._ONEDNN_MAX_ROWS + 8
    _float32_blocks_match_float64(torch.tensor([1, big, 0, 12]), 128, 128, bias=bias)
    head = big - big % grouped._ONEDNN_ROW_QUANTUM
    assert [r for r in rows if r >= head] == ([head, head] if avx2_width else [])


@pytest.mark.parametrize("avx512", [True, False])
def test_float32_forward_blocks_past_256_rows_on_sgemm_where_torch_runs_at_avx512(monkeypatch, avx512):
    """Where torch runs at AVX-512 and MKL's sgemm at its full width (Intel's CPUs), forward
    blocks of 257–512 rows go to sgemm whole (grouped._ONEDNN_MAX_ROWS_AVX512), not to oneDNN's
    inner product in row parts as on AVX2 CPUs; 65–256-row blocks go to oneDNN either way (of
    torch's kernels: moe_ffn's own decline here). The float64 loop's outputs and gradients come
    out either way."""
    if not grouped._onednn_linear_available():
        pytest.skip("torch has no oneDNN inner product here")
    monkeypatch.setattr(grouped._small_gemm, "sgemm_at_avx2_width", lambda: False)
    monkeypatch.setattr(grouped, "_torch_on_avx512", lambda: avx512)
    # (moe_ffn's own float32 kernels, which take such blocks first on AVX2 CPUs, declining)
    monkeypatch.setattr(grouped._small_gemm, "linear_into", lambda *args: False)
    monkeypatch.setattr(grouped._small_gemm, "avx512_linear_into", lambda *args: False)
    monkeypatch.setattr(grouped._small_gemm, "linear_blocks", lambda *args, **kwargs: None)
    assert grouped._ONEDNN_MAX_ROWS_AVX512 == 256
    rows = []
    real = torch.ops.mkldnn._linear_pointwise

    forward = []  # (set while the forward runs: its products only)
    real_forward = grouped._ffn_forward

    def spy(x, w, *args):
        if forward:
            rows.append(x.shape[0])
        return real(x, w, *args)

    def in_forward(*args, **kwargs):
        forward.append(True)
        try:
            return real_forward(*args, **kwargs)
        finally:
            forward.clear()

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    monkeypatch.setattr(grouped, "_ffn_forward", in_forward)
    _float32_blocks_match_float64(torch.tensor([300, 0, 200, 12]), 256, 256, bias=False)
    assert rows.count(200) == 2  # both projections of the 200-row block on oneDNN
    # the 300-row block: on sgemm, or its first 256 rows on oneDNN (the other 44 as such a block goes)
    assert sorted(r for r in rows if r >= 256) == ([] if avx512 else [256, 256])


@pytest.mark.parametrize("amx", [False, True])
def test_bf16_blocks_reach_onednn_in_row_parts(monkeypatch, torch_kernels_only, amx):
    """Native bf16 blocks on torch's GEMM (oneDNN's on CPUs; forced here) are multiplied as
    their largest multiple of grouped._ONEDNN_ROW_QUANTUM rows, then the rest: the 300-row
    block as 256 + 44 in the forward and in both input gradients, the 256- and 40-row blocks
    whole; on CPUs with AMX (`amx`, forced) every block whole. Outputs and gradients within
    bf16 rounding of the float64 loop."""
    monkeypatch.setattr(grouped, "_lowp_is_slow", lambda t: False)
    monkeypatch.setattr(grouped, "_bf16_blocks_whole", lambda: amx)
    assert grouped._ONEDNN_ROW_QUANTUM == 256
    rows = []
    for name in ("mm", "addmm"):
        real = getattr(torch, name)

        def spy(*args, real=real, **kwargs):
            a = args[-2]  # x (or g) of x·wᵀ; the weight gradients' gᵀ·x have rows inner
            if a.dtype == torch.bfloat16 and a.is_contiguous():
                rows.append(a.shape[0])
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, name, spy)
    torch.manual_seed(5)
    D, F = 32, 24
    counts = torch.tensor([300, 0, 256, 40])
    E, N = counts.numel(), int(counts.sum())
    x64 = torch.randn(N, D, **f64)
    w1_64, w2_64 = torch.randn(E, 2 * F, D, **f64) / D**0.5, torch.randn(E, D, F, **f64) / F**0.5
    leaves = [t.bfloat16().requires_grad_() for t in (x64, w1_64, w2_64)]
    y = grouped_ffn(*leaves, counts, None, None, activation="silu", gated=True)
    want_rows = sorted(([300] if amx else [256, 44]) + [256, 40]) * 2
    assert sorted(rows) == sorted(want_rows)  # both projections
    g = torch.randn(N, D, **f64)
    rows.clear()
    got = torch.autograd.grad((y.double() * g).sum(), leaves)
    assert sorted(rows) == sorted(want_rows)  # both input gradients
    refs64 = [t.clone().requires_grad_() for t in (x64, w1_64, w2_64)]
    x, w1, w2 = (t.bfloat16().double() for t in refs64)  # the bf16 values, in float64
    outs = []
    for e, s, t in _blocks(counts.tolist()):
        if t > s:
            h = x[s:t] @ w1[e].T
            outs.append((act("silu", h[:, :F]) * h[:, F:]) @ w2[e].T)
    ref = torch.cat(outs)
    torch.testing.assert_close(y.double(), ref, atol=2e-2 * float(ref.detach().abs().max()), rtol=0)
    want = torch.autograd.grad((ref * g).sum(), refs64)
    for name, a, r in zip(["x", "w1", "w2"], got, want):
        torch.testing.assert_close(a.double(), r, atol=3e-2 * float(r.abs().max()), rtol=0, msg=name)


@pytest.mark.parametrize(
    "dtype, upcast", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)], ids=["bf16", "bf16-upcast", "fp32"]
)
def test_token_sums_live_on_scratch_memory_only_where_they_are_cast(monkeypatch, dtype, upcast):
    """The forward's float32 sum over each token's slots and the backward's input gradient sum
    are temporaries where the result is cast from them (bf16 layers): scratch memory, reused
    step after step; where the sum is the result itself (float32) it is fresh memory, never
    the pool's; where the forward and the backward sum token by token
    (`_small_gemm.slot_sum_rows`), each token's float32 sum is rounded into the bf16 result
    itself and neither needs one. A bf16 layer multiplied in float32 (`grouped._lowp_is_slow`,
    forced either way here) sums its backward group by group (see
    test_routed_sums_token_by_token_are_the_group_by_group_sums), into one such temporary.
    The results match the float32 op either way."""
    monkeypatch.setattr(grouped, "_lowp_is_slow", lambda t: upcast and t.dtype == torch.bfloat16)
    calls = []
    real = grouped._memory.scratch
    monkeypatch.setattr(
        grouped._memory, "scratch", lambda like, *shape, dtype=None: calls.append((shape, dtype)) or real(like, *shape, dtype=dtype)
    )
    torch.manual_seed(3)
    T, D, F = 64, 32, 16
    x = torch.randn(T, D).to(dtype).requires_grad_()
    w1, w2 = (torch.randn(2, 2 * F, D) / 6).to(dtype), (torch.randn(2, D, F) / 4).to(dtype)
    token_N = torch.randperm(2 * T) % T  # two slots a token: the groups' row temporaries are
    weight_N = torch.rand(2 * T)  # [2T, D], told apart from the [T, D] sums
    counts = torch.tensor([60, 68])
    y = routed_ffn(x, w1, w2, counts, token_N, weight_N, activation="silu", gated=True)
    y.backward(torch.ones_like(y))
    sums = [c for c in calls if c == ((T, D), torch.float32)]
    by_token = _small_gemm.slot_sums_fit(x, dtype)  # the forward; the backward where not upcast
    if dtype == torch.bfloat16:
        assert len(sums) == (0 if by_token else 1) + (0 if by_token and not upcast else 1)
    else:
        assert sums == []
    x32 = x.detach().float().requires_grad_()
    y32 = routed_ffn(x32, w1.float(), w2.float(), counts, token_N, weight_N, activation="silu", gated=True)
    y32.backward(torch.ones_like(y32))
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.float(), y32, atol=tol, rtol=tol)
    torch.testing.assert_close(x.grad.float(), x32.grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("declined", [False, True])
@pytest.mark.parametrize("T", [3, 64])
def test_routed_bf16_result_is_the_float32_sum_rounded_once_in_the_op(monkeypatch, T, declined):
    """A bf16 layer's routed_ffn returns bf16 from the op itself (each token's float32 sum
    rounded once: by the slot-sum kernel straight into the result, or, with the kernel
    declined, cast at the op's end), where it used to return the float32 sum for a cast
    outside: bit for bit that composition, forward and every gradient (its output gradient
    now arrives in bf16, which float32 holds exactly). T = 3 is a decode step."""
    if declined:
        monkeypatch.setattr(grouped._small_gemm, "slot_sum_rows", lambda *args, **kwargs: False)
    torch.manual_seed(7)
    D, F, E = 32, 16, 4
    leaves = [
        torch.randn(T, D).bfloat16(), (torch.randn(E, 2 * F, D) / 6).bfloat16(), (torch.randn(E, D, F) / 4).bfloat16()
    ]
    token_N = torch.randperm(2 * T) % T
    counts = torch.bincount(torch.randint(0, E, (2 * T,)), minlength=E)
    weight_N = torch.rand(2 * T)
    new = [t.clone().requires_grad_() for t in leaves] + [weight_N.clone().requires_grad_()]
    old = [t.clone().requires_grad_() for t in leaves] + [weight_N.clone().requires_grad_()]
    y = routed_ffn(*new[:3], counts, token_N, new[3], activation="silu", gated=True)
    y32, _ = grouped._call(
        grouped._routed_ffn_op, grouped._RoutedFFNEager, *old[:3], counts, token_N, old[3], None, None, "silu", True,
        torch.float32,
    )
    assert y.dtype == torch.bfloat16 and y32.dtype == torch.float32
    assert torch.equal(y, y32.to(torch.bfloat16))
    g = torch.randn(T, D).bfloat16()
    y.backward(g)
    y32.to(torch.bfloat16).backward(g)
    for a, b in zip(new, old):
        assert a.grad.dtype == b.grad.dtype and torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("T, K", [(40, 2), (300, 4)])
def test_bf16_layer_reads_the_tokens_rows_by_index(monkeypatch, T, K):
    """On AVX512-BF16 CPUs without AMX the routed bf16 layer's first projection (with SwiGLU's
    activation in it, `bf16_swiglu_forward_blocks`) and its weight gradient read the tokens'
    rows by index (`bf16_weight_grad_blocks(..., b_index=)`): no gathered copy of x is made for
    either, and the output (inference and training) and every gradient are bit for bit what
    the gathered rows give through the plain product and the activation's pass after it."""
    if _small_gemm._bf16_linear_rows_entry_point() is None or _small_gemm._bf16_weight_grad_rows_entry_point() is None:
        pytest.skip("no AVX512-BF16 kernels here (not an AVX512-BF16 CPU without AMX, or not built)")
    torch.manual_seed(T)
    E, D, F = 6, 64, 48
    x = torch.randn(T, D).bfloat16()
    w1, w2 = (torch.randn(E, 2 * F, D) / 8).bfloat16(), (torch.randn(E, D, F) / 8).bfloat16()
    ids = (torch.arange(T)[:, None] + torch.arange(K)[None, :]) % E  # (every expert 13-200 rows: none decode-sized)
    order = ids.flatten().argsort(stable=True)
    token = (order // K).contiguous()
    counts = torch.bincount(ids.flatten(), minlength=E)
    weight = torch.rand(T * K)[order].contiguous()
    gathers = []
    real_rows = grouped._rows
    monkeypatch.setattr(grouped, "_rows", lambda t, *a: gathers.append(t.data_ptr()) or real_rows(t, *a))

    def run():
        gathers.clear()
        with torch.no_grad():
            inference = routed_ffn(x, w1, w2, counts, token, weight, activation="silu", gated=True)
        xg, w1g, w2g = (t.clone().requires_grad_() for t in (x, w1, w2))
        out = routed_ffn(xg, w1g, w2g, counts, token, weight, activation="silu", gated=True)
        out.float().square().sum().backward()
        of_x = sum(ptr in (x.data_ptr(), xg.data_ptr()) for ptr in gathers)  # (not grad_out's)
        return of_x, (inference, out.detach(), xg.grad, w1g.grad, w2g.grad)

    by_index, results = run()
    monkeypatch.setattr(_small_gemm, "_bf16_linear_rows_entry_point", lambda: None)
    monkeypatch.setattr(_small_gemm, "_bf16_swiglu_forward_entry_point", lambda: None)
    monkeypatch.setattr(_small_gemm, "_bf16_weight_grad_rows_entry_point", lambda: None)
    gathered, expected = run()
    # without: a gather of x in each forward (inference and training) and in the backward's
    # group; at T = 40 both forwards take the one-call decode forward (its own gather) instead
    assert by_index == 0 and gathered == (1 if T == 40 else 3)
    for a, b in zip(results, expected):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("T", [80, 300])
def test_bf16_layer_forward_runs_swiglu_in_the_first_projection(monkeypatch, T):
    """On AVX512-BF16 CPUs without AMX the bf16 SwiGLU layer's first projection forms a =
    silu(gate)·up in its own pass over the weight (`_small_gemm.bf16_swiglu_forward_blocks`):
    no `_hidden` pass after it, in inference and in training, and the output and every gradient
    bit for bit what the plain product and `_hidden` give (blocks of ~20 and ~75 rows: the dot
    tiles' and the outer products'; decode-sized steps take the one-call forward instead)."""
    if _small_gemm._bf16_swiglu_forward_entry_point() is None:
        pytest.skip("no AVX512-BF16 kernels here (not an AVX512-BF16 CPU without AMX, or not built)")
    torch.manual_seed(T)
    moe = MoE(dim=64, hidden_dim=96, num_experts=8, top_k=2).bfloat16()
    x = torch.randn(T, 64).bfloat16()
    fused, hidden = [], []
    real_fused, real_hidden = _small_gemm.bf16_swiglu_forward_blocks, grouped._hidden
    monkeypatch.setattr(_small_gemm, "bf16_swiglu_forward_blocks", lambda *a, **k: fused.append(1) or real_fused(*a, **k))
    monkeypatch.setattr(grouped, "_hidden", lambda *a, **k: hidden.append(1) or real_hidden(*a, **k))

    def run():
        with torch.no_grad():
            inference = moe(x)
        xg = x.clone().requires_grad_()
        for p in moe.parameters():
            p.grad = None
        y = moe(xg)
        y.float().square().sum().backward()
        return inference, y.detach(), xg.grad, *(p.grad for p in moe.parameters())

    got = run()
    assert len(fused) == 2 and hidden == []
    monkeypatch.setattr(grouped, "_swiglu_forward_kernel", lambda *a: (None, False))
    want = run()
    assert len(fused) == 2 and len(hidden) == 2
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16))
