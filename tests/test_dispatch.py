"""permute / unpermute are an inverse pair; plan sorts stably and counts exactly."""

import pytest
import torch

from moe_ffn import dispatch


def test_plan_sorts_stably_by_expert():
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    p = dispatch.plan(ids, torch.ones(3, 2), num_experts=4)
    # flat assignments: 0:e2 1:e0 2:e0 3:e1 4:e2 5:e1 → by expert, ties in token order
    assert p.order_N.tolist() == [1, 2, 3, 5, 0, 4]
    assert p.tokens_per_expert_E.tolist() == [2, 2, 2, 0]
    assert p.num_dropped.item() == 0


def test_permute_then_unpermute_is_identity_for_unit_weights():
    T, K, D, E = 7, 3, 5, 4
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    x = torch.randn(T, D, dtype=torch.float64)
    p = dispatch.plan(ids, torch.ones(T, K), E)
    x_ND = dispatch.permute(x, p)
    assert x_ND.shape == (T * K, D)
    # each sorted row is a copy of its token's row
    torch.testing.assert_close(x_ND, x[p.order_N // K])
    w = torch.full((T, K), 1.0 / K, dtype=torch.float64)
    torch.testing.assert_close(dispatch.unpermute(x_ND, p, w, torch.float64), x)


def test_unpermute_weights_each_slot():
    ids = torch.tensor([[0, 1], [1, 0]])
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5]], dtype=torch.float64)
    p = dispatch.plan(ids, w, 2)
    # pretend expert e returns (e + 1)·x
    x = torch.tensor([[1.0], [2.0]], dtype=torch.float64)
    x_ND = dispatch.permute(x, p)
    expert_of_row = ids.reshape(-1)[p.order_N]
    y = dispatch.unpermute(x_ND * (expert_of_row + 1).unsqueeze(1), p, w, torch.float64)
    torch.testing.assert_close(y, torch.tensor([[0.25 * 1 + 0.75 * 2], [2 * (0.5 * 2 + 0.5 * 1)]], dtype=torch.float64))


def test_capacity_moves_dropped_rows_to_the_end():
    ids = torch.tensor([[0], [0], [0], [1]])
    w = torch.tensor([[0.1], [0.9], [0.5], [1.0]])
    p = dispatch.plan(ids, w, 2, capacity=2, drop_policy="probs")
    assert p.tokens_per_expert_E.tolist() == [2, 1]
    assert p.num_dropped.item() == 1
    assert p.order_N.tolist() == [1, 2, 3, 0]  # expert 0 keeps its two heaviest, token 0 dropped
    p = dispatch.plan(ids, w, 2, capacity=2, drop_policy="position")
    assert p.order_N.tolist() == [0, 1, 3, 2]  # earliest tokens kept


def test_capacity_formula():
    assert dispatch.expert_capacity(1.0, 10, 2, 8) == 3  # ceil(2.5)
    assert dispatch.expert_capacity(1.25, 64, 2, 8) == 20


from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=40, deadline=None)
@given(T=st.integers(0, 30), E=st.integers(1, 9), data=st.data())
def test_plan_is_a_permutation_with_exact_counts(T, E, data):
    K = data.draw(st.integers(1, E))
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)
    w = torch.rand(T, K)
    capacity = data.draw(st.one_of(st.none(), st.integers(1, max(1, T))))
    p = dispatch.plan(ids, w, E, capacity)
    assert sorted(p.order_N.tolist()) == list(range(T * K))
    routed = torch.bincount(ids.flatten(), minlength=E)
    expected = routed if capacity is None else routed.clamp(max=capacity)
    assert p.tokens_per_expert_E.tolist() == expected.tolist()
    assert p.num_dropped.item() == (routed - expected).sum().item()
    kept = int(expected.sum())
    experts_in_order = ids.flatten()[p.order_N[:kept]]
    assert experts_in_order.tolist() == sorted(experts_in_order.tolist())


def test_plan_without_inverse_is_refused_by_permute():
    ids = torch.tensor([[0, 1], [1, 0]])
    p = dispatch.plan(ids, torch.ones(2, 2), 2, inverse=False)
    assert p.inverse_TK is None and p.token_N.tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="inverse=True"):
        dispatch.permute(torch.randn(2, 3), p)


@pytest.mark.parametrize("T, K, E", [(0, 2, 8), (1, 2, 8), (5, 8, 64), (3, 1, 4), (4096, 8, 64)])
def test_plan_on_the_kernel_is_the_plan_of_torchs_ops(monkeypatch, T, K, E):
    """The CPU plan by the kernel (a counting sort, `_small_gemm.plan_rows`): order, counts,
    tokens and inverse exactly those of torch's stable argsort, bincount and division (the plan
    with the kernel switched off), experts without assignments included; an id out of range
    raises a ValueError."""
    from moe_ffn import _small_gemm

    if _small_gemm.library() is None:
        pytest.skip("the kernel library is not built here")
    torch.manual_seed(T + K + E)
    ids = torch.randint(0, E, (T, K))
    ran = []
    real = _small_gemm.plan_rows
    monkeypatch.setattr(_small_gemm, "plan_rows", lambda *a: ran.append(1) or real(*a))
    kernel = dispatch.plan(ids, torch.rand(T, K), E)
    assert ran
    monkeypatch.setattr(_small_gemm, "plan_rows", lambda *a: None)
    ops = dispatch.plan(ids, torch.rand(T, K), E)
    for name in ("order_N", "tokens_per_expert_E", "num_dropped", "inverse_TK", "token_N"):
        assert torch.equal(getattr(kernel, name), getattr(ops, name)), name
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        real(torch.tensor([0, 3, 1]), 3, 1)
