"""grouped_linear and grouped_ffn against a per-expert loop (float64): outputs and gradients."""

import pytest
import torch

from moe_ffn.grouped import grouped_ffn, grouped_linear
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
