"""Aux losses: hand-computed values, the uniform constants, masks, and where gradients go."""

import math

import pytest
import torch

from moe_ffn import MoE, collect_aux_loss, load_balancing_loss, pooled_load_balancing_loss, router_z_loss

f64 = dict(dtype=torch.float64)


def test_balance_loss_hand_computed_k1():
    probs = torch.tensor([[0.7, 0.3], [0.4, 0.6]], **f64)
    ids = torch.tensor([[0], [0]])
    # f = [1, 0], P = [0.55, 0.45] → 2·(1·0.55) = 1.1 (k = 1: both normalisations agree)
    assert load_balancing_loss(probs, ids).item() == pytest.approx(1.1, abs=1e-15)
    assert load_balancing_loss(probs, ids, normalization="transformers").item() == pytest.approx(1.1, abs=1e-15)


def test_balance_loss_hand_computed_k2():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]], **f64)
    ids = torch.tensor([[0, 1], [1, 2]])
    # counts [1, 2, 1]; P = [0.3, 0.45, 0.25]
    # per layer: f = counts/(T·k) = [.25, .5, .25] → 3·(.075 + .225 + .0625) = 1.0875
    assert load_balancing_loss(probs, ids).item() == pytest.approx(1.0875, abs=1e-15)
    # transformers: f = counts/T = [.5, 1, .5] → 2.175
    assert load_balancing_loss(probs, ids, normalization="transformers").item() == pytest.approx(2.175, abs=1e-15)


@pytest.mark.parametrize("E, k", [(4, 1), (8, 2), (6, 3)])
def test_uniform_routing_gives_the_known_constant(E, k):
    T = 4 * E
    probs = torch.full((T, E), 1.0 / E, **f64)
    ids = (torch.arange(T * k) % E).reshape(T, k)  # every expert gets T·k/E assignments
    assert load_balancing_loss(probs, ids).item() == pytest.approx(1.0, abs=1e-14)
    assert load_balancing_loss(probs, ids, normalization="transformers").item() == pytest.approx(k, abs=1e-14)


def test_z_loss_hand_computed():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], **f64)
    # logsumexp = ln 2, ln 4 → mean of squares
    expected = (math.log(2) ** 2 + math.log(4) ** 2) / 2
    assert router_z_loss(logits).item() == pytest.approx(expected, abs=1e-15)
    assert router_z_loss(logits, torch.tensor([True, False])).item() == pytest.approx(math.log(2) ** 2, abs=1e-15)


def test_layer_losses_follow_the_config_and_reach_the_router_only():
    moe = MoE(dim=8, hidden_dim=12, num_experts=4, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001, dtype=torch.float64)
    x = torch.randn(3, 5, 8, **f64)
    moe(x)
    s = moe.stats
    probs = torch.softmax(x.reshape(-1, 8) @ moe.router.weight.T, -1)
    ids = probs.topk(2).indices
    counts = torch.zeros(4, **f64).index_add_(0, ids.flatten(), torch.ones(30, **f64))
    expected_balance = 4 * ((counts / 30) * probs.mean(0)).sum()
    torch.testing.assert_close(s.balance_loss, expected_balance, atol=1e-14, rtol=0)
    torch.testing.assert_close(s.aux_loss, 0.01 * s.balance_loss + 0.001 * s.z_loss)
    assert s.tokens_per_expert_E.sum().item() == 30
    collect_aux_loss(moe).backward()
    assert moe.router.weight.grad.abs().sum() > 0
    assert moe.experts.gate_up_proj.grad is None and moe.experts.down_proj.grad is None


def test_default_coefficients_are_zero():
    moe = MoE(dim=8, hidden_dim=12, num_experts=4, top_k=2)
    moe(torch.randn(5, 8))
    assert moe.stats.aux_loss.item() == 0.0 and moe.stats.balance_loss.item() > 0


def test_padding_mask_equals_the_unpadded_input():
    """Padded batch + mask gives the same losses, counts and router gradient as the real tokens alone."""
    moe = MoE(dim=8, hidden_dim=12, num_experts=4, top_k=2, aux_loss_coef=1.0, z_loss_coef=0.1, dtype=torch.float64)
    lengths = [5, 2, 4]
    x = torch.randn(3, 5, 8, **f64)
    mask = torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]
    x_real = torch.cat([x[b, :n] for b, n in enumerate(lengths)])

    moe(x_real)
    real = moe.stats
    moe.router.weight.grad = None
    real.aux_loss.backward()
    grad_real = moe.router.weight.grad.clone()

    moe(x, attention_mask=mask)
    padded = moe.stats
    moe.router.weight.grad = None
    padded.aux_loss.backward()

    torch.testing.assert_close(padded.balance_loss, real.balance_loss, atol=1e-14, rtol=0)
    torch.testing.assert_close(padded.z_loss, real.z_loss, atol=1e-14, rtol=0)
    assert padded.tokens_per_expert_E.tolist() == real.tokens_per_expert_E.tolist()
    torch.testing.assert_close(moe.router.weight.grad, grad_real, atol=1e-14, rtol=0)
    # without the mask the padding counts, and the loss differs
    moe(x)
    assert not torch.allclose(moe.stats.balance_loss, real.balance_loss)


def test_pooled_loss_over_layers_is_not_the_sum_of_layer_losses():
    layers = [MoE(dim=8, hidden_dim=12, num_experts=4, top_k=2, dtype=torch.float64) for _ in range(2)]
    xs = [torch.randn(6, 8, **f64), torch.randn(6, 8, **f64)]
    for layer, x in zip(layers, xs):
        layer(x)
    probs = torch.cat([torch.softmax(x @ l.router.weight.T, -1) for l, x in zip(layers, xs)])
    ids = probs.topk(2).indices
    f = torch.zeros(4, **f64).index_add_(0, ids.flatten(), torch.ones(24, **f64)) / 12  # sums to k
    expected = 4 * (f * probs.mean(0)).sum()
    torch.testing.assert_close(pooled_load_balancing_loss(layers), expected, atol=1e-14, rtol=0)
    model = torch.nn.ModuleList(layers)
    torch.testing.assert_close(pooled_load_balancing_loss(model), expected, atol=1e-14, rtol=0)


def test_collect_aux_loss_sums_layers():
    model = torch.nn.Sequential(*[MoE(dim=8, hidden_dim=12, num_experts=4, top_k=2, aux_loss_coef=0.5) for _ in range(3)])
    model(torch.randn(4, 8))
    total = collect_aux_loss(model)
    torch.testing.assert_close(total, sum(0.5 * m.stats.balance_loss for m in model))
