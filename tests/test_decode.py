"""A decode step in one call of the library (moe_ffn/_decode.py, _decode.cpp): where it runs,
that it routes and computes what the per-token float64 reference does, that it gives the
experts' part the same bits as the layer's ops for the same routing, and that everything it
does not take goes back to the layer's ops."""

from __future__ import annotations

import ctypes

import pytest
import torch

from moe_ffn import MoE, _decode
from moe_ffn.router import RouterOutput
from reference import moe_forward

D, F, E, K = 64, 32, 16, 4


def _kind_here(dtype: torch.dtype, tokens: int = 1):
    return _decode._kind(dtype, tokens, E, 2 * F, D, F)


def _needs_the_call(dtype: torch.dtype) -> None:
    if _decode._entry_point() is None or _kind_here(dtype) is None:
        pytest.skip(f"no one-call decode step for {dtype} here (library not built, or not this CPU's kernels)")


def _layer(dtype=torch.float32, dim=D, hidden=F, **fields) -> MoE:
    torch.manual_seed(0)
    return MoE(dim=dim, hidden_dim=hidden, num_experts=E, top_k=K, **fields).to(dtype).eval()


@pytest.fixture
def calls(monkeypatch):
    """What each `_decode.step` of the test returned: (out_TD is not None, route is not None)."""
    seen = []
    step = _decode.step

    def spy(*args):
        out, route = step(*args)
        seen.append((out is not None, route is not None))
        return out, route

    monkeypatch.setattr(_decode, "step", spy)
    return seen


def _reference(moe: MoE, x_TD: torch.Tensor, **routing) -> torch.Tensor:
    r = moe.router
    with torch.no_grad():
        return moe_forward(
            x_TD.double(), r.weight.double(), moe.experts.gate_up_proj.double(), moe.experts.down_proj.double(), K,
            routing=r.routing, norm_topk_prob=r.norm_topk_prob, scale=r.routed_scaling_factor,
            bias_E=None if r.expert_bias is None else r.expert_bias.double(),
        )


def _reference_route(moe: MoE, logits_TE: torch.Tensor):
    """The float64 route of the step's own float32 logits: (ids [T, K], weights [T, K])."""
    from reference import route_token

    r = moe.router
    bias = None if r.expert_bias is None else r.expert_bias.double()
    routes = [route_token(l.double(), K, r.routing, r.norm_topk_prob, r.routed_scaling_factor, bias) for l in logits_TE]
    return torch.tensor([ids for ids, _ in routes]), torch.stack([w for _, w in routes])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_the_step_runs_in_one_call_and_matches_the_float64_reference(dtype, tokens, calls):
    _needs_the_call(dtype)
    moe = _layer(dtype)
    x = torch.randn(tokens, D).to(dtype)
    with torch.no_grad():
        y = moe(x)
    assert calls and calls[-1][1], "the routing ran in the call"
    if dtype == torch.bfloat16 or tokens <= 8:  # (float32 blocks past 8 rows may go back to the ops)
        assert calls[-1][0], "the whole step ran in the call"
    assert y.dtype == dtype and y.shape == x.shape
    ref = _reference(moe, x)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-5 + 8 * 2.0**-24 * float(ref.abs().max()))
    else:  # bf16 weights and activations between the products: within a few bf16 units
        torch.testing.assert_close(y.double(), ref, rtol=2**-6, atol=2**-6 * float(ref.abs().max()))
    ids, weights = _reference_route(moe, moe.stats.router_logits_TE)
    assert torch.equal(moe.stats.expert_ids_TK, ids)
    # double sums rounded once to float32: within one float32 unit of the float64 weights
    torch.testing.assert_close(moe.stats.weights_TK.double(), weights, rtol=2.0**-23, atol=0)
    probs = torch.softmax(moe.stats.router_logits_TE.double(), -1)
    torch.testing.assert_close(moe.stats.router_probs_TE.double(), probs, rtol=2.0**-23, atol=1e-12)
    assert int(moe.stats.num_dropped) == 0 and int(moe.stats.tokens_per_expert_E.sum()) == tokens * K


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_experts_part_is_the_layers_ops_bit_for_bit_on_the_same_route(dtype, calls, monkeypatch):
    """Given the route the call made, the layer's own ops (plan, experts' op, weighted sum)
    give the same output bits: the call runs the same kernels on the same blocks."""
    _needs_the_call(dtype)
    moe = _layer(dtype)
    x = torch.randn(3, D).to(dtype)
    with torch.no_grad():
        y = moe(x)
        route = RouterOutput(*(getattr(moe.stats, n) for n in ("router_logits_TE", "router_probs_TE", "expert_ids_TK", "weights_TK")))
        monkeypatch.setattr(type(moe.router), "forward", lambda self, x_TD: route)
        monkeypatch.setattr(type(moe), "_decodes_in_one_call", lambda self: False)
        y_ops = moe(x)
    assert calls == [(True, True)]
    assert torch.equal(y, y_ops)


def test_bf16_logits_are_the_routers_own():
    _needs_the_call(torch.bfloat16)
    moe = _layer(torch.bfloat16)
    x = torch.randn(4, D).to(torch.bfloat16)
    with torch.no_grad():
        moe(x)
        assert torch.equal(moe.stats.router_logits_TE, moe.router(x).logits_TE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "fields",
    [
        dict(routing="topk_softmax"),
        dict(routing="sigmoid_topk", norm_topk_prob=True, routed_scaling_factor=2.5),
        dict(routing="sigmoid_topk", norm_topk_prob=False),
        dict(norm_topk_prob=False),
        dict(expert_bias_update_rate=1e-3),
        dict(num_shared_experts=1, shared_expert_gate=True),
    ],
    ids=["topk_softmax", "sigmoid_norm_scaled", "sigmoid_unnormalised", "softmax_unnormalised", "expert_bias", "shared"],
)
def test_every_routing_rule_in_the_call_matches_the_reference(dtype, fields, calls):
    _needs_the_call(dtype)
    moe = _layer(dtype, **fields)
    if moe.router.expert_bias is not None:  # a bias large enough to move the choice
        moe.router.expert_bias.copy_(torch.linspace(-0.5, 0.5, E))
    x = torch.randn(6, D).to(dtype)
    with torch.no_grad():
        y = moe(x)
    assert calls == [(True, True)]
    ids, weights = _reference_route(moe, moe.stats.router_logits_TE)
    assert torch.equal(moe.stats.expert_ids_TK, ids)
    torch.testing.assert_close(moe.stats.weights_TK.double(), weights, rtol=2.0**-23, atol=0)
    if fields.get("num_shared_experts"):
        # against the layer's own ops: the shared expert is added to the call's output
        with torch.no_grad():
            moe._decodes_in_one_call = lambda: False
            y_ops = moe(x)
        atol = 1e-5 if dtype == torch.float32 else 2**-6 * float(y_ops.abs().max())
        torch.testing.assert_close(y.float(), y_ops.float(), rtol=0, atol=atol)
        return
    ref = _reference(moe, x)
    tol = 1e-5 + 8 * 2.0**-24 * float(ref.abs().max()) if dtype == torch.float32 else 2**-6 * float(ref.abs().max())
    torch.testing.assert_close(y.double(), ref, rtol=0 if dtype == torch.float32 else 2**-6, atol=tol)


def test_equal_scores_take_the_lower_expert_first(calls):
    _needs_the_call(torch.float32)
    moe = _layer()
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[[3, 5, 9, 12, 14]] = 1.0  # five equal logits for four places
        x = torch.ones(1, D)
        moe(x)
    assert calls == [(True, True)]
    assert moe.stats.expert_ids_TK.tolist() == [[3, 5, 9, 12]]
    torch.testing.assert_close(moe.stats.weights_TK, torch.full((1, K), 0.25), rtol=0, atol=0)


def test_float32_blocks_past_the_kernels_rows_go_back_to_the_layers_ops_with_the_calls_route(calls):
    _needs_the_call(torch.float32)
    moe = _layer()
    _, most, *_ = _kind_here(torch.float32, 16)
    with torch.no_grad():
        moe.router.weight[0] = 10.0  # expert 0 in every token's choice
        x = torch.rand(most + 1, D) + 0.5
        y = moe(x)
    assert calls == [(False, True)]
    assert (moe.stats.expert_ids_TK[:, 0] == 0).all()
    ref = _reference(moe, x)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-5 + 8 * 2.0**-24 * float(ref.abs().max()))


@pytest.mark.parametrize(
    "case",
    ["jitter", "17 tokens", "capacity", "expert biases", "gelu experts", "autocast", "nan"],
)
def test_what_the_call_does_not_take_runs_on_the_layers_ops(case, calls):
    _needs_the_call(torch.float32)
    fields = {
        "capacity": dict(capacity_factor=1.0),
        "expert biases": dict(bias=True),
        "gelu experts": dict(activation="gelu"),
    }.get(case, {})
    moe = _layer(**fields)
    x = torch.randn(17 if case == "17 tokens" else 3, D)
    if case == "nan":
        x[1, 0] = float("nan")
    if case == "jitter":  # training with router jitter: the router sees other tokens than the experts
        moe = _layer(jitter_noise=0.1, jitter_scope="router").train()
    context = torch.autocast("cpu", dtype=torch.bfloat16) if case == "autocast" else torch.no_grad()
    with torch.no_grad(), context:
        y = moe(x)
    if case in ("jitter", "17 tokens", "capacity", "expert biases", "gelu experts"):
        assert calls == []
    else:  # asked, declined: nothing ran in the call
        assert calls == [(False, False)]
    if case == "nan":
        assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
    elif case != "autocast":
        ref = _reference(moe, x.detach()) if case == "17 tokens" else None
        if ref is not None:
            torch.testing.assert_close(y.detach().double(), ref, rtol=0, atol=1e-5 + 8 * 2.0**-24 * float(ref.abs().max()))


def test_attention_mask_leaves_padding_out_of_the_calls_counts(calls):
    _needs_the_call(torch.float32)
    moe = _layer()
    x = torch.randn(1, 4, D)
    mask = torch.tensor([[1, 1, 0, 1]])
    with torch.no_grad():
        moe(x, attention_mask=mask)
    assert calls == [(True, True)]
    assert int(moe.stats.tokens_per_expert_E.sum()) == 3 * K


def test_a_wrong_width_is_refused_before_the_call(calls):
    moe = _layer()
    with torch.no_grad(), pytest.raises(ValueError, match=str(D)):
        moe(torch.randn(1, D + 1))
    assert calls == []


def test_training_mode_without_autograd_runs_the_call_and_its_dropout(calls):
    """A training-mode layer under no_grad (no jitter) takes the call; the layer's dropout then
    applies to the call's output as to the ops'."""
    _needs_the_call(torch.float32)
    moe = _layer(dropout=0.5)
    x = torch.randn(4, D)
    with torch.no_grad():
        y_eval = moe(x)
        torch.manual_seed(1)
        y_train = moe.train()(x)
    assert calls == [(True, True), (True, True)]
    dropped = y_train == 0
    assert 0 < int(dropped.sum()) < dropped.numel()
    torch.testing.assert_close(y_train[~dropped], 2 * y_eval[~dropped], rtol=0, atol=0)


@pytest.mark.parametrize("where", ["router hook", "global hook", "router forward"])
def test_a_hooked_or_replaced_router_runs_on_the_layers_ops(where, calls):
    """Hooks on the router (the profiler's routing overrides are forward hooks) see the step."""
    moe = _layer()
    seen = []
    if where == "router hook":
        handle = moe.router.register_forward_hook(lambda module, args, out: seen.append(out))
    elif where == "global hook":
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, out: seen.append(out) if module is moe.router else None
        )
    else:
        plain = moe.router.forward
        moe.router.forward = lambda x_TD: seen.append(x_TD) or plain(x_TD)
        handle = None
    try:
        with torch.no_grad():
            moe(torch.randn(2, D))
    finally:
        if handle is not None:
            handle.remove()
    assert calls == [] and len(seen) == 1


def _grads(moe: MoE, x: torch.Tensor, g: torch.Tensor, one_call: bool, monkeypatch) -> list[torch.Tensor]:
    """Gradients of x and every parameter of Σ y·g + aux loss, with the call or the layer's ops."""
    monkeypatch.setattr(type(moe), "_decodes_in_one_call", _ONE_CALL if one_call else (lambda self: False))
    moe.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    y = moe(leaf)
    ((y.float() * g.float()).sum() + 10 * moe.stats.aux_loss).backward()
    return [leaf.grad, *(p.grad for p in moe.parameters())]


_ONE_CALL = MoE._decodes_in_one_call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "fields",
    [dict(), dict(norm_topk_prob=False), dict(routing="topk_softmax"), dict(routing="sigmoid_topk", routed_scaling_factor=2.5),
     dict(routing="sigmoid_topk", norm_topk_prob=False)],
    ids=["softmax_topk", "softmax_unnormalised", "topk_softmax", "sigmoid_scaled", "sigmoid_unnormalised"],
)
def test_with_autograd_the_call_is_one_node_with_the_reference_gradients(dtype, fields, calls, monkeypatch):
    """x's, the router's and the experts' gradients through the call (its outputs and the aux
    losses on its logits and probs) against float64 autograd of the per-token reference and the
    layer's ops."""
    _needs_the_call(dtype)
    moe = _layer(dtype, aux_loss_coef=0.01, z_loss_coef=0.001, **fields).train()
    x, g = torch.randn(5, D).to(dtype), torch.randn(5, D).to(dtype)
    got = _grads(moe, x, g, True, monkeypatch)
    assert calls == [(True, True)]
    ops = _grads(moe, x, g, False, monkeypatch)
    # float64 autograd of the reference loop (the output's part; the aux losses as moe_ffn's losses)
    params = [p.detach().double().requires_grad_() for p in (moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj)]
    leaf = x.double().requires_grad_()
    r = moe.router
    y = moe_forward(leaf, *params, K, routing=r.routing, norm_topk_prob=r.norm_topk_prob, scale=r.routed_scaling_factor)
    (y * g.double()).sum().backward()
    for a, b, name in zip(got, ops, ["x", "router", "gate_up", "down"]):
        scale = float(b.float().abs().max())
        tol = 1e-5 * scale if dtype == torch.float32 else 2**-6 * scale
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=tol, msg=f"{name} against the ops")
    if not moe.config.aux_loss_coef:
        return
    for a, ref, name in zip([got[2], got[3]], [params[1].grad, params[2].grad], ["gate_up", "down"]):
        # the experts' weights get no aux-loss gradient: their gradient is the reference's
        scale = float(ref.abs().max())
        tol = 1e-5 * scale if dtype == torch.float32 else 2**-5 * scale
        torch.testing.assert_close(a.double(), ref, rtol=0, atol=tol, msg=f"{name} against float64")


def test_a_backward_that_records_a_graph_is_refused_as_by_the_layers_ops(calls, monkeypatch):
    """create_graph: neither the call's node nor the experts' op of the layer's ops has a
    second derivative; both say so."""
    _needs_the_call(torch.float32)
    moe = _layer()
    for one_call in (True, False):
        monkeypatch.setattr(type(moe), "_decodes_in_one_call", _ONE_CALL if one_call else (lambda self: False))
        leaf = torch.randn(3, D, requires_grad=True)
        (gx,) = torch.autograd.grad(moe(leaf).square().sum(), leaf, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice|no autograd formula"):
            gx.square().sum().backward()
    assert calls == [(True, True)]


def test_with_autograd_blocks_past_the_kernels_rows_route_again_on_the_layers_ops(calls, monkeypatch):
    """A step the call gives back after routing (status 2) routes again by the ops, whose route
    carries the router's gradient."""
    _needs_the_call(torch.float32)
    moe = _layer()
    _, most, *_ = _kind_here(torch.float32, 16)
    with torch.no_grad():
        moe.router.weight[0] = 0.05  # expert 0 in every token's choice, its softmax not saturated
    x, g = torch.rand(most + 1, D) + 0.5, torch.randn(most + 1, D)
    got = _grads(moe, x, g, True, monkeypatch)
    assert calls == [(False, False)]
    assert (moe.stats.expert_ids_TK == 0).any(dim=1).all()
    ops = _grads(moe, x, g, False, monkeypatch)
    assert got[1].abs().sum() > 0
    for a, b in zip(got, ops):
        assert torch.equal(a, b)


def test_an_input_without_gradient_gives_the_parameters_the_layers_gradients(calls, monkeypatch):
    """x without a gradient (a model trained from its MoE layers on): the call's node still
    gives every parameter the gradient the layer's ops give it."""
    _needs_the_call(torch.float32)
    moe = _layer()
    x, g = torch.randn(3, D), torch.randn(3, D)

    def grads(one_call: bool):
        monkeypatch.setattr(type(moe), "_decodes_in_one_call", _ONE_CALL if one_call else (lambda self: False))
        moe.zero_grad(set_to_none=True)
        (moe(x) * g).sum().backward()
        return [p.grad for p in moe.parameters()]

    got, ops = grads(True), grads(False)
    assert calls == [(True, True)]
    for a, b in zip(got, ops):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * float(b.abs().max()))


def _needs_the_backward_call(dtype: torch.dtype) -> None:
    _needs_the_call(dtype)
    if _decode._backward_entry_point(dtype) is None:
        pytest.skip(
            f"no one-call {dtype} decode backward here (not an AVX512-BF16 CPU with torch at AVX-512; float32: "
            "MKL's sgemm not at AVX2 width)"
        )


_DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def _widths(dtype: torch.dtype) -> tuple[int, int]:
    """(D, F) of a layer whose float32 backward the one call takes: the float32 blocks kernels
    want 64 elements of I a thread through both weights (bf16: the module's D, F)."""
    least = 64 * torch.get_num_threads() if dtype == torch.float32 else 0
    return max(D, least), max(F, least)


def _node_grads(moe: MoE, x, g, one_call_backward: bool, monkeypatch, x_grad=True, aux=True):
    """Gradients of x and every parameter through the step's node, its backward in one call of
    the library or in the node's general calls."""
    entry = _decode._backward_entry_point(x.dtype)
    monkeypatch.setattr(_decode, "_backward_entry_point", lambda dtype: entry if one_call_backward else None)
    moe.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_(x_grad)
    y = moe(leaf)
    ((y.float() * g.float()).sum() + (10 * moe.stats.aux_loss if aux else 0)).backward()
    return [leaf.grad, *(p.grad for p in moe.parameters())]


@pytest.fixture
def backward_calls(monkeypatch):
    """What each `_decode._backward_in_one_call` of the test returned: whether it gave gradients."""
    seen = []
    run = _decode._backward_in_one_call

    def spy(*args):
        grads = run(*args)
        seen.append(grads is not None)
        return grads

    monkeypatch.setattr(_decode, "_backward_in_one_call", spy)
    return seen


@pytest.mark.parametrize("tokens, dim", [(1, 64), (5, 100), (16, 1024)])
def test_the_float32_router_backward_is_the_float64_products_rounded_once(tokens, dim):
    """The float32 node's router products (moe_ffn_decode_router_backward_f32, also inside the
    one-call backward): g·r and gᵀ·x against float64 matmuls rounded to float32, every operand
    read through its row stride (a slice of a wider tensor), a width that leaves a tail."""
    _needs_the_call(torch.float32)
    torch.manual_seed(3)
    g = torch.randn(tokens, E + 3)[:, 1 : E + 1]
    x, r = torch.randn(tokens, dim + 5)[:, :dim], torch.randn(E, dim + 2)[:, 2:]
    gx, gr = _decode._router_backward_f32(g, x, r, True, True)
    torch.testing.assert_close(gx, (g.double() @ r.double()).float(), rtol=2**-23, atol=0)
    torch.testing.assert_close(gr, (g.double().t() @ x.double()).float(), rtol=2**-23, atol=0)
    assert _decode._router_backward_f32(g, x, r, False, True)[0] is None
    assert _decode._router_backward_f32(g, x, r, True, False)[1] is None


@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize(
    "fields",
    [dict(), dict(norm_topk_prob=False), dict(routing="topk_softmax"), dict(routing="sigmoid_topk", routed_scaling_factor=2.5)],
    ids=["softmax_topk", "softmax_unnormalised", "topk_softmax", "sigmoid_scaled"],
)
@pytest.mark.parametrize("aux, x_grad", [(True, True), (False, True), (True, False)], ids=["aux", "no_aux", "x_frozen"])
@_DTYPES
def test_the_backward_in_one_call_gives_the_nodes_general_bits(dtype, tokens, fields, aux, x_grad, calls, backward_calls, monkeypatch):
    """moe_ffn_decode_backward_bf16 / _f32 (the experts', the routing's and the router's
    backward in one call) against the node's general backward on the same step: every gradient
    bit for bit, with the aux losses' gradients on the logits and probs or without, x with or
    without a gradient."""
    _needs_the_backward_call(dtype)
    d, f = _widths(dtype)
    moe = _layer(dtype, d, f, aux_loss_coef=0.01, z_loss_coef=0.001, **fields).train()
    x, g = torch.randn(tokens, d).to(dtype), torch.randn(tokens, d).to(dtype)
    got = _node_grads(moe, x, g, True, monkeypatch, x_grad, aux)
    general = _node_grads(moe, x, g, False, monkeypatch, x_grad, aux)
    assert calls == [(True, True)] * 2 and backward_calls == [True]
    assert (got[0] is None) == (not x_grad)
    for a, b, name in zip(got, general, ["x", "router", "gate_up", "down"]):
        if b is None:
            assert a is None, name
            continue
        assert torch.equal(a, b), name
    assert got[1].abs().sum() > 0 and got[2].abs().sum() > 0


@_DTYPES
def test_a_frozen_router_or_expert_weight_takes_the_general_backward(dtype, calls, backward_calls, monkeypatch):
    """A frozen router: the call gives no router gradient (its product skipped), the same bits
    as the general backward; a frozen expert weight: the general backward (the call writes both
    weights' gradients), which gives the other its gradient."""
    _needs_the_backward_call(dtype)
    d, f = _widths(dtype)
    moe = _layer(dtype, d, f).train()
    x, g = torch.randn(4, d).to(dtype), torch.randn(4, d).to(dtype)
    moe.router.weight.requires_grad_(False)
    got = _node_grads(moe, x, g, True, monkeypatch)
    general = _node_grads(moe, x, g, False, monkeypatch)
    assert backward_calls == [True] and got[1] is None
    assert all(torch.equal(a, b) for a, b in zip([got[0], *got[2:]], [general[0], *general[2:]]))
    moe.router.weight.requires_grad_(True)
    moe.experts.down_proj.requires_grad_(False)
    got = _node_grads(moe, x, g, True, monkeypatch)
    general = _node_grads(moe, x, g, False, monkeypatch)
    assert backward_calls == [True] and calls == [(True, True)] * 4
    assert got[3] is None and all(torch.equal(a, b) for a, b in zip(got[:3], general[:3]))


@_DTYPES
def test_a_declined_backward_call_is_computed_again_whole(dtype, calls, monkeypatch):
    """Where the call declines after writing part of the gradients (status -1), the node's
    general backward computes every gradient again: the same bits as without the call."""
    _needs_the_backward_call(dtype)
    entry = _decode._backward_entry_point(dtype)
    declined = []
    size = torch.empty((), dtype=dtype).element_size()
    d, f = _widths(dtype)

    def declining(*args):
        assert entry(*args) == 0
        for at, nbytes in ((28, size * E * 2 * f * d), (31, size * E * d * f), (37, size * 3 * d)):  # gradients scribbled over
            ctypes.memset(args[at], 0x7F, nbytes)
        declined.append(True)
        return -1

    moe = _layer(dtype, d, f, aux_loss_coef=0.01).train()
    x, g = torch.randn(3, d).to(dtype), torch.randn(3, d).to(dtype)
    general = _node_grads(moe, x, g, False, monkeypatch)
    moe.zero_grad(set_to_none=True)
    monkeypatch.setattr(_decode, "_backward_entry_point", lambda dtype: declining)
    leaf = x.clone().requires_grad_()
    y = moe(leaf)
    ((y.float() * g.float()).sum() + 10 * moe.stats.aux_loss).backward()
    assert declined == [True]
    for a, b in zip([leaf.grad, *(p.grad for p in moe.parameters())], general):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "loss",
    [lambda y: (y * torch.randn(1, y.shape[1]).to(y.dtype)).sum(), lambda y: (y.float() * torch.randn(y.shape[1], 6).t()).sum(),
     lambda y: y[2:4].float().square().sum()],
    ids=["one_row_expanded", "transposed", "rows_sliced"],
)
@_DTYPES
def test_the_one_call_backward_takes_output_gradients_of_any_layout(dtype, loss, backward_calls, monkeypatch):
    """The output's gradient as autograd hands it over: a row expanded over the tokens (rows 0
    elements apart, read as they lie), transposed (made contiguous first), zero outside a
    slice: the same bits as the node's general backward."""
    _needs_the_backward_call(dtype)
    d, f = _widths(dtype)
    moe = _layer(dtype, d, f).train()
    x = torch.randn(6, d).to(dtype)
    grads, entry = [], _decode._backward_entry_point(dtype)
    for one_call in (True, False):
        monkeypatch.setattr(_decode, "_backward_entry_point", lambda dtype: entry if one_call else None)
        moe.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        torch.manual_seed(1)
        loss(moe(leaf)).backward()
        grads.append([leaf.grad, *(p.grad for p in moe.parameters())])
    assert backward_calls == [True]
    assert all(torch.equal(a, b) for a, b in zip(*grads))
