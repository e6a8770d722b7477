"""The MoE layer against a float64 per-token loop: outputs and every gradient."""

import math

import pytest
import torch
from torch import nn

from moe_ffn import MoE, MoEConfig, SwiGLU
from moe_ffn import grouped
from moe_ffn.experts import MLPExperts, _ExpertBank
from reference import classic_ffn, gated_expert, moe_forward, route_token

ATOL = 1e-12


def make(dim=8, hidden=12, experts=4, k=2, **kw):
    return MoE(dim=dim, hidden_dim=hidden, num_experts=experts, top_k=k, dtype=torch.float64, **kw)


def reference(moe, x_TD, **kw):
    cfg = moe.config
    shared = None
    if moe.shared_experts is not None:
        gate_w = None if moe.shared_expert_gate is None else moe.shared_expert_gate.weight
        shared = (moe.shared_experts.gate_up_proj[0], moe.shared_experts.down_proj[0], gate_w)
    bias = None if moe.router.expert_bias is None else moe.router.expert_bias
    return moe_forward(
        x_TD, moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj, cfg.top_k,
        routing=cfg.routing, norm_topk_prob=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor,
        bias_E=bias, activation=cfg.activation, shared=shared, **kw)


def assert_matches_reference(moe, x, **ref_kw):
    """Output and gradients of the input and of every parameter, against the loop."""
    x = x.detach().requires_grad_()
    y = moe(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    ref = reference(moe, x.reshape(-1, moe.config.dim), **ref_kw).reshape(x.shape)
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=0)
    w = torch.randn_like(y)
    params = [p for p in moe.parameters()]
    g = torch.autograd.grad((y * w).sum(), [x, *params], allow_unused=True)
    g_ref = torch.autograd.grad((ref * w).sum(), [x, *params], allow_unused=True)
    for name, a, b in zip(["input"] + [n for n, _ in moe.named_parameters()], g, g_ref):
        a = torch.zeros_like(x if name == "input" else dict(moe.named_parameters())[name]) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m: f"grad of {name}: {m}")
    return y


@pytest.mark.parametrize("T", [0, 1, 7, 64])
@pytest.mark.parametrize("D", [8, 100])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_matches_per_token_loop(T, D, k):
    moe = make(dim=D, hidden=12, experts=4, k=k)
    assert_matches_reference(moe, torch.randn(T, D, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 4)])
def test_multi_dim_inputs(shape):
    moe = make()
    assert_matches_reference(moe, torch.randn(*shape, 8, dtype=torch.float64))


@pytest.mark.parametrize(
    "options",
    [
        {"norm_topk_prob": False},
        {"routing": "topk_softmax"},
        {"routing": "sigmoid_topk"},
        {"routing": "sigmoid_topk", "norm_topk_prob": False, "routed_scaling_factor": 2.5},
        {"activation": "gelu_tanh"},
        {"num_shared_experts": 1},
        {"num_shared_experts": 2, "shared_expert_gate": True},
        {"num_shared_experts": 1, "shared_hidden_dim": 20, "shared_expert_gate": True},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_routing_options_match_loop(options):
    moe = make(experts=6, k=2, **options)
    assert_matches_reference(moe, torch.randn(2, 11, 8, dtype=torch.float64))


def test_experts_without_tokens_get_exact_zero_gradients():
    moe = make(experts=8, k=1)
    with torch.no_grad():  # make expert 0 win every token, so 1..7 get none
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0
    x = torch.rand(6, 8, dtype=torch.float64) + 0.1
    assert_matches_reference(moe, x)
    moe(x).sum().backward()
    g = moe.experts.gate_up_proj.grad
    assert moe.stats.tokens_per_expert_E.tolist() == [6, 0, 0, 0, 0, 0, 0, 0]
    assert torch.isfinite(g).all() and (g[1:] == 0).all() and (moe.experts.down_proj.grad[1:] == 0).all()
    assert g[0].abs().sum() > 0


def test_top_k_equals_num_experts_uses_every_expert():
    moe = make(experts=3, k=3)
    y = assert_matches_reference(moe, torch.randn(5, 8, dtype=torch.float64))
    assert moe.stats.tokens_per_expert_E.tolist() == [5, 5, 5]
    assert y.shape == (5, 8)


def test_expert_bias_changes_selection_not_weights():
    moe = make(experts=4, k=2, expert_bias_update_rate=0.01)
    x = torch.randn(9, 8, dtype=torch.float64)
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([0.0, 5.0, 0.0, 5.0]))  # force experts 1 and 3
    assert_matches_reference(moe, x)
    assert sorted(set(moe.stats.expert_ids_TK.flatten().tolist())) == [1, 3]
    probs = torch.softmax(x @ moe.router.weight.T, -1)
    chosen = probs.gather(1, moe.stats.expert_ids_TK)
    torch.testing.assert_close(moe.stats.weights_TK, chosen / chosen.sum(1, keepdim=True))


def test_expert_bias_update_rule():
    moe = make(experts=4, k=1, expert_bias_update_rate=0.001)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0
    moe.train()
    moe(torch.rand(10, 8, dtype=torch.float64))  # every token to expert 2
    assert moe.expert_load.tolist() == [0, 0, 10, 0]
    moe.update_expert_bias()
    # mean load 2.5: expert 2 is over-loaded (bias down), the others under-loaded (bias up)
    torch.testing.assert_close(moe.router.expert_bias, torch.tensor([0.001, 0.001, -0.001, 0.001]))
    assert moe.expert_load.tolist() == [0, 0, 0, 0]
    assert "router.expert_bias" in moe.state_dict() and "expert_load" not in moe.state_dict()
    with pytest.raises(RuntimeError, match="expert_bias_update_rate"):
        make().update_expert_bias()


def test_jitter_noise_on_router_only_and_on_experts():
    x = torch.randn(12, 8, dtype=torch.float64)
    for scope in ("router", "router_and_experts"):
        moe = make(experts=4, k=2, jitter_noise=0.3, jitter_scope=scope)
        moe.eval()
        assert_matches_reference(moe, x)  # no noise in eval
        moe.train()
        torch.manual_seed(7)
        y = moe(x)
        torch.manual_seed(7)
        noise = torch.empty_like(x).uniform_(0.7, 1.3)
        assert (noise - 1).abs().max() <= 0.3 and (noise - 1).abs().max() > 0.2
        jittered = x * noise  # the router sees jittered inputs
        ref = []
        for t in range(12):
            e_ids, w = route_token(moe.router.weight @ jittered[t], 2)
            xe = jittered[t] if scope == "router_and_experts" else x[t]
            ref.append(sum(wi * gated_expert(xe, moe.experts.gate_up_proj[e], moe.experts.down_proj[e]) for e, wi in zip(e_ids, w)))
        torch.testing.assert_close(y, torch.stack(ref), atol=ATOL, rtol=0)


# --- capacity -------------------------------------------------------------------------

def _keep_fn(moe, x, capacity, policy):
    """Which (token, slot) assignments survive, decided by a direct simulation."""
    T = x.shape[0]
    routes = [route_token(moe.router.weight @ x[t], moe.config.top_k) for t in range(T)]
    by_expert = {}
    for t, (ids, w) in enumerate(routes):
        for slot, e in enumerate(ids):
            by_expert.setdefault(e, []).append((t, slot, float(w[slot].detach())))
    kept = set()
    for e, items in by_expert.items():
        if policy == "probs":
            items = sorted(items, key=lambda it: -it[2])
        kept |= {(t, s) for t, s, _ in items[:capacity]}
    return (lambda t, slot: (t, slot) in kept), sum(len(v) for v in by_expert.values()) - len(kept)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_drops_match_simulation(policy, factor):
    moe = make(experts=4, k=2, capacity_factor=factor, drop_policy=policy)
    x = torch.randn(13, 8, dtype=torch.float64)
    capacity = math.ceil(factor * 13 * 2 / 4)
    keep, n_dropped = _keep_fn(moe, x, capacity, policy)
    assert_matches_reference(moe, x, keep=keep)
    assert moe.stats.num_dropped.item() == n_dropped
    if factor == 0.5:
        assert n_dropped > 0


def test_capacity_large_enough_is_dropless():
    x = torch.randn(10, 8, dtype=torch.float64)
    moe = make(capacity_factor=4.0)
    assert_matches_reference(moe, x)
    assert moe.stats.num_dropped.item() == 0


# --- equivalences and invariants ---------------------------------------------------------

def test_one_expert_top1_is_the_dense_block():
    moe = make(dim=10, hidden=14, experts=1, k=1)
    dense = SwiGLU(10, hidden_dim=14).double()
    dense.load_state_dict({"gate_up_proj": moe.experts.gate_up_proj, "down_proj": moe.experts.down_proj})
    x1 = torch.randn(3, 4, 10, dtype=torch.float64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = moe(x1), dense(x2)
    torch.testing.assert_close(y1, y2, atol=1e-12, rtol=0)
    w = torch.randn_like(y1)
    (y1 * w).sum().backward()
    (y2 * w).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(moe.experts.gate_up_proj.grad, dense.gate_up_proj.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(moe.experts.down_proj.grad, dense.down_proj.grad, atol=1e-12, rtol=0)


def test_bitwise_deterministic_on_cpu():
    moe = MoE(dim=32, hidden_dim=48, num_experts=8, top_k=2)
    x = torch.randn(50, 32)
    assert torch.equal(moe(x), moe(x))


def test_token_outputs_do_not_depend_on_the_batch():
    moe = MoE(dim=32, hidden_dim=48, num_experts=8, top_k=2)
    x = torch.randn(40, 32)
    full = moe(x)
    scale = full.abs().max().item()
    for t in (0, 17, 39):
        alone = moe(x[t : t + 1])
        assert (alone - full[t : t + 1]).abs().max() <= 1e-6 * scale
    torch.testing.assert_close(moe(x[:9]), full[:9], atol=1e-6 * scale, rtol=0)


def test_nan_in_one_token_stays_in_that_token():
    moe = MoE(dim=16, hidden_dim=24, num_experts=4, top_k=2)
    x = torch.randn(10, 16)
    clean = moe(x)
    x[3, 5] = float("nan")
    y = moe(x)
    others = [t for t in range(10) if t != 3]
    assert torch.isfinite(y[others]).all()
    # Equal up to BLAS blocking: the NaN token may move to other experts, which changes the
    # row-block sizes the GEMMs see (the same tolerance as batch independence above).
    scale = clean.abs().max().item()
    torch.testing.assert_close(y[others], clean[others], atol=1e-6 * scale, rtol=0)
    assert torch.isnan(y[3]).any()


@pytest.mark.parametrize(
    "options",
    [{}, {"norm_topk_prob": False}, {"routing": "topk_softmax"}, {"routing": "sigmoid_topk"}, {"expert_bias": True}],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default",
)
def test_router_choice_on_ties_is_the_lower_expert(monkeypatch, options):
    """Float32 scores, many of them equal: the router's experts are the loop's (Python's stable
    sort: of equal scores the lower expert first) and its weights the loop's, with enough scores
    that the top-k kernel runs (`router._top_k`); with it switched off torch.topk picks the
    same set of scores (its order among equal ones unspecified)."""
    from moe_ffn import router as router_module

    if router_module._small_gemm.library() is None:
        pytest.skip("the kernel library is not built here")
    bias = options.pop("expert_bias", False)
    T, E, K = 100, 64, 8
    router = router_module.TopKRouter(16, E, K, expert_bias=bias, **options)
    torch.manual_seed(3)
    if bias:
        router.expert_bias.copy_(torch.randint(0, 2, (E,)).float() * 0.25)
    logits = torch.randint(0, 3, (T, E)).float()  # ties everywhere, in the scores too
    ran = []
    real = router_module._small_gemm.topk_ids
    monkeypatch.setattr(router_module._small_gemm, "topk_ids", lambda *a: ran.append(1) or real(*a))
    out = router.route(logits)
    assert ran
    cfg = dict(routing=router.routing, norm_topk_prob=router.norm_topk_prob, bias_E=router.expert_bias)
    for t in range(T):
        ids, weights = route_token(logits[t], K, **cfg)
        assert out.expert_ids_TK[t].tolist() == ids
        torch.testing.assert_close(out.weights_TK[t], weights, atol=1e-6, rtol=0)
    monkeypatch.setattr(router_module._small_gemm, "topk_ids", lambda *a: None)
    plain = router.route(logits)
    select = logits if router.routing == "topk_softmax" else plain.probs_TE if router.routing == "softmax_topk" else logits.sigmoid()
    if bias:
        select = select + router.expert_bias
    assert torch.equal(select.gather(1, plain.expert_ids_TK), select.gather(1, out.expert_ids_TK))


def test_bf16_input_picks_the_float64_router_choice():
    torch.manual_seed(3)
    moe = MoE(dim=64, hidden_dim=32, num_experts=8, top_k=2)
    x = torch.randn(256, 64).bfloat16()
    moe.to(torch.bfloat16)  # the whole layer, router weight included, in bf16
    logits64 = x.double() @ moe.router.weight.double().T
    ids64 = torch.topk(logits64, 2).indices.sort(-1).values
    y = moe(x)
    assert y.dtype == torch.bfloat16
    assert moe.stats.router_logits_TE.dtype == torch.float32
    ids = moe.stats.expert_ids_TK.sort(-1).values
    top3 = logits64.topk(3).values
    clear = (top3[:, 1] - top3[:, 2]).abs() > 1e-4  # ties aside
    assert clear.sum() > 200
    assert torch.equal(ids[clear], ids64[clear])


@pytest.mark.parametrize("route", ["sgemm", "onednn", "small", "amx", "pairs", "kernel"])
@pytest.mark.parametrize("grad", [False, True])
def test_bf16_router_logits_are_the_float64_products_rounded_once(monkeypatch, grad, route):
    """The router's float32 logits of bf16 tokens: each x·w sum, widened exactly, within one
    float32 rounding of the float64 product, with and without autograd; the widened copy of x
    is a temporary on scratch memory (`_memory.scratch`) either way (with autograd made again
    for the weight's gradient), and the gradients are within float32 rounding of float64's and
    bit for bit those of the float32 products on the widened tensors: F.linear's, or where MKL's
    sgemm runs at AVX2 width (forced on here) oneDNN's inner product for the logits and the
    weight's gradient, unless they are small ("small": F.linear's, these products are below
    router._ONEDNN_MIN_MACS; "onednn" forces them past it), and moe_ffn's AVX-512 blocked
    product for the input's (where it runs; its own order of the sums: checked against
    float64 only); on AMX CPUs ("amx") the logits are the tiles' float32 sums of the exact
    products (`_amx.linear_float32`: no widened copy in the forward, its own order of the sums,
    so checked against float64 only), the gradients as "sgemm"'s, and elsewhere the AMX path is
    switched off; on AVX512-BF16 CPUs without AMX ("pairs") the logits are the pair products'
    float32 sums (`_small_gemm.router_logits_on_pairs`: no widened copy either, checked against
    float64 only), the gradients as "sgemm"'s, and elsewhere that path is switched off; on AMD's
    AVX-512 CPUs ("kernel", forced on where the kernel runs) the gradients are moe_ffn's kernel's
    (`_small_gemm.router_backward`: no widened copies, their own order of the sums, so checked
    against float64 only), and elsewhere it is switched off past a few tokens."""
    from moe_ffn import router as router_module

    onednn, amx, pairs, kernel = route == "onednn", route == "amx", route == "pairs", route == "kernel"
    if onednn and not router_module._small_gemm.onednn_linear_available():
        pytest.skip("torch has no oneDNN inner product here")
    if amx and not router_module._amx.available():
        pytest.skip("no AMX kernel here (not an AMX CPU, or the library not built)")
    if pairs and router_module._small_gemm._router_pairs_entry_point() is None:
        pytest.skip("no AVX512-BF16 router kernel here (CPU without AVX512-BF16, or the library not built)")
    if kernel and router_module._small_gemm._router_entry_points() is None:
        pytest.skip("no AVX-512 router kernel here (CPU without AVX-512, or the library not built)")
    if not pairs:
        monkeypatch.setattr(router_module._small_gemm, "router_logits_on_pairs", lambda x, w: None)
    if not kernel:
        monkeypatch.setattr(router_module._small_gemm, "router_backward", lambda *a: None)
    if not amx:
        monkeypatch.setattr(router_module._amx, "linear_float32", lambda x, w: None)
        monkeypatch.setattr(router_module, "_tiles_backward", lambda *a: None)
    else:
        monkeypatch.setattr(router_module, "_TILES_BACKWARD_MIN_MACS", 0)
    monkeypatch.setattr(router_module._small_gemm, "sgemm_at_avx2_width", lambda: route not in ("sgemm", "amx", "pairs"))
    if onednn:
        monkeypatch.setattr(router_module, "_ONEDNN_MIN_MACS", 0)
    calls, kernel_runs = [], []
    real = router_module._memory.scratch
    monkeypatch.setattr(
        router_module._memory, "scratch", lambda like, *shape, dtype=None: calls.append(shape) or real(like, *shape, dtype=dtype)
    )
    real_kernel = router_module._small_gemm.avx512_matmul_into
    def spy_kernel(*args):
        kernel_runs.append(real_kernel(*args))
        return kernel_runs[-1]

    monkeypatch.setattr(router_module._small_gemm, "avx512_matmul_into", spy_kernel)
    torch.manual_seed(5)
    moe = MoE(dim=96, hidden_dim=32, num_experts=8, top_k=2).to(torch.bfloat16)
    x = torch.randn(300, 96).bfloat16().requires_grad_(grad)
    x64, w64 = x.detach().double(), moe.router.weight.detach().double()
    with torch.set_grad_enabled(grad):
        routed = moe.router(x)
    bound = 96 * 2.0**-24 * (x64.abs() @ w64.abs().T)
    assert ((routed.logits_TE.detach().double() - x64 @ w64.T).abs() <= bound).all()
    assert calls == ([] if amx or pairs else [(300, 96)])
    with torch.no_grad():
        again = moe.router(x).logits_TE
    assert torch.equal(again, routed.logits_TE.detach())
    calls.clear()
    if grad:
        g = torch.randn(300, 8)
        routed.logits_TE.backward(g)
        # backward: g·W's float32 result, x widened again; on the tiles neither (g in three bf16
        # parts: 3E-deep sums for x's gradient, three partial sums for W's)
        assert calls == ([] if amx or kernel else [(300, 96), (300, 96)])
        terms = 3 if amx else 1
        g64 = g.double()
        w_bound = (300 + 2) * terms * 2.0**-24 * (g64.abs().T @ x64.abs()) + 2.0**-8 * (g64.T @ x64).abs()
        assert ((moe.router.weight.grad.double() - g64.T @ x64).abs() <= w_bound).all()  # (+ bf16 rounding)
        x_bound = 8 * terms * 2.0**-24 * (g64.abs() @ w64.abs()) + 2.0**-8 * (g64 @ w64).abs()
        assert ((x.grad.double() - g64 @ w64).abs() <= x_bound).all()
        sg = router_module._small_gemm
        kernel_here = sg._avx512_entry_points() is not None and sg._torch_on_avx512()
        assert kernel_runs == ([] if route in ("sgemm", "amx", "pairs", "kernel") else [kernel_here])
        xf, wf = x.detach().float(), moe.router.weight.detach().float()
        if onednn:
            linear = lambda a, b: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
            plain, want_w = linear(xf, wf), linear(g.t().contiguous(), xf.t()).bfloat16()
        else:
            plain = torch.nn.functional.linear(x.float(), moe.router.weight.float())
            want_x, want_w = torch.autograd.grad(plain, (x, moe.router.weight), g)
            if not any(kernel_runs) and not (amx or kernel):
                assert torch.equal(x.grad, want_x)
        if not (amx or kernel):
            if not pairs:  # (the pairs' logits: their own order of the sums, checked above)
                assert torch.equal(plain.detach(), routed.logits_TE.detach())
            assert torch.equal(moe.router.weight.grad, want_w)


def test_bf16_router_logits_on_pairs_do_not_depend_on_the_token_count():
    """On AVX512-BF16 CPUs without AMX a bf16 token's logits are the same bits in a step of any
    size (the few tokens' kernel and the team's pair products sum alike), with autograd and
    without, so its routing does not change with the batch it came in."""
    from moe_ffn import router as router_module

    if router_module._amx.available() or router_module._small_gemm._router_pairs_entry_point() is None:
        pytest.skip("no AVX512-BF16 router kernel here, or an AMX CPU (whose tiles make the logits)")
    torch.manual_seed(11)
    moe = MoE(dim=256, hidden_dim=64, num_experts=64, top_k=8).to(torch.bfloat16)
    x = torch.randn(600, 256).bfloat16()
    with torch.no_grad():
        whole = moe.router(x).logits_TE
    for part in (x[:1], x[:16], x[:17], x[:300]):
        with torch.no_grad():
            assert torch.equal(moe.router(part).logits_TE.view(torch.int32), whole[: part.shape[0]].view(torch.int32))
    graded = moe.router(x[:40].requires_grad_()).logits_TE
    assert torch.equal(graded.detach().view(torch.int32), whole[:40].view(torch.int32))


@pytest.mark.parametrize("T", [1, 16, 17])
def test_bf16_router_of_a_few_tokens_on_the_kernel(monkeypatch, T):
    """Up to router._FEW_TOKENS bf16 tokens the logits and both gradients come from moe_ffn's
    one-thread kernel (no widened copies on scratch memory), with and without autograd the
    same logits, each within float32's rounding of the float64 products (the gradients before
    one bf16 rounding); past it the logits come from the pair products or the widened GEMMs,
    and the gradients from the kernel on AMD's AVX-512 CPUs, else from the widened GEMMs
    (`test_bf16_router_logits_are_...`)."""
    from moe_ffn import router as router_module

    if router_module._small_gemm._router_entry_points() is None:
        pytest.skip("no AVX-512 router kernel here (CPU without AVX-512, or the library not built)")
    monkeypatch.setattr(router_module._amx, "linear_float32", lambda x, w: None)
    monkeypatch.setattr(router_module, "_tiles_backward", lambda *a: None)
    runs = []
    for name in ("router_logits", "router_backward"):
        real = getattr(router_module._small_gemm, name)
        monkeypatch.setattr(router_module._small_gemm, name, lambda *a, real=real, name=name: runs.append(name) or real(*a))
    few = T <= router_module._FEW_TOKENS
    torch.manual_seed(T)
    moe = MoE(dim=96, hidden_dim=32, num_experts=8, top_k=2).to(torch.bfloat16)
    x = torch.randn(T, 96).bfloat16().requires_grad_()
    routed = moe.router(x)
    with torch.no_grad():
        again = moe.router(x).logits_TE
    assert torch.equal(again, routed.logits_TE.detach())
    g = torch.randn(T, 8)
    routed.logits_TE.backward(g)
    on_kernel = few or router_module._small_gemm.sgemm_at_avx2_width()  # (the gradients past a few tokens: AMD's)
    assert runs == (["router_logits", "router_logits"] if few else []) + (["router_backward"] if on_kernel else [])
    x64, w64, g64 = x.detach().double(), moe.router.weight.detach().double(), g.double()
    assert ((routed.logits_TE.detach().double() - x64 @ w64.T).abs() <= 96 * 2.0**-24 * (x64.abs() @ w64.abs().T)).all()
    want_x, want_w = g64 @ w64, g64.T @ x64
    assert ((x.grad.double() - want_x).abs() <= 8 * 2.0**-24 * (g64.abs() @ w64.abs()) + 2.0**-8 * want_x.abs()).all()
    w_bound = T * 2.0**-24 * (g64.abs().T @ x64.abs()) + 2.0**-8 * want_w.abs()
    assert ((moe.router.weight.grad.double() - want_w).abs() <= w_bound).all()


@pytest.mark.parametrize("E", [8, 64])
def test_router_backward_on_tiles(monkeypatch, E):
    """The logits' gradients of bf16 tokens on the AMX tiles (`router._tiles_backward`), past the
    tiles' row limits (x's gradient in chunks of rows, W's in chunks of depth): float32 g split
    into three bf16 parts that sum to it exactly, then each gradient within float32's bound for
    sums of 3E (x) or 3·T (W) exact products of float64's, rounded to bf16 once."""
    from moe_ffn import router as router_module

    if not router_module._amx.available():
        pytest.skip("no AMX kernel here (not an AMX CPU, or the library not built)")
    monkeypatch.setattr(router_module, "_TILES_BACKWARD_MIN_MACS", 0)  # (these are below it)
    torch.manual_seed(E)
    T, D = 4200, 64
    g = torch.randn(T, E) * torch.logspace(-6, 2, T)[:, None]
    parts = router_module._bf16_parts(g, -(-3 * E // 32) * 32)
    assert torch.equal(parts[:, :E].double() + parts[:, E : 2 * E].double() + parts[:, 2 * E : 3 * E].double(), g.double())
    assert (parts[:, 3 * E :] == 0).all()
    x, w = torch.randn(T, D).bfloat16(), torch.randn(E, D).bfloat16()
    grads = router_module._tiles_backward(g, x, w, True, True)
    assert grads is not None
    g64, x64, w64 = g.double(), x.double(), w.double()
    x_bound = (3 * E + 2) * 2.0**-24 * (g64.abs() @ w64.abs()) + 2.0**-8 * (g64 @ w64).abs()
    assert grads[0].dtype == torch.bfloat16 and ((grads[0].double() - g64 @ w64).abs() <= x_bound).all()
    w_bound = (3 * T + 4) * 2.0**-24 * (g64.abs().T @ x64.abs()) + 2.0**-8 * (g64.T @ x64).abs()
    assert grads[1].dtype == torch.bfloat16 and ((grads[1].double() - g64.T @ x64).abs() <= w_bound).all()
    assert router_module._tiles_backward(g, x, w, False, True)[0] is None
    assert router_module._tiles_backward(g, x.float(), w, True, True) is None
    g[5, 1] = 3e38  # its bf16 rounding would overflow: left to the float32 products
    assert router_module._tiles_backward(g, x, w, True, True) is None


def test_autocast_cpu():
    moe = MoE(dim=32, hidden_dim=48, num_experts=4, top_k=2)
    x = torch.randn(6, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    assert y.dtype == torch.float32  # output in the input dtype
    torch.testing.assert_close(y, moe(x), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compile_fullgraph_dynamic_over_token_counts(dtype):
    """The whole layer, forward and backward, traces as one graph over token counts; bf16
    too, whose router runs on moe_ffn's kernels and scratch memory in eager mode and on plain
    ops when traced (a bf16 layer with autograd failed to trace before 2026-12-07)."""
    torch.manual_seed(0)
    moe = MoE(dim=16, hidden_dim=24, num_experts=4, top_k=2, num_shared_experts=1).to(dtype)
    compiled = torch.compile(moe, fullgraph=True, dynamic=True, backend="eager")
    tol = {} if dtype == torch.float32 else dict(rtol=0, atol=2e-2)
    for T in (3, 8, 21):
        x = torch.randn(T, 16).to(dtype).requires_grad_()
        y, y_eager = compiled(x), moe(x)
        torch.testing.assert_close(y, y_eager, **tol)
        (g,) = torch.autograd.grad(y.float().square().sum(), x)
        (g_eager,) = torch.autograd.grad(y_eager.float().square().sum(), x)
        torch.testing.assert_close(g, g_eager, **tol)


def test_one_dropout_on_the_layer_output():
    moe = MoE(dim=16, hidden_dim=24, num_experts=4, top_k=2, dropout=0.5)
    assert sum(isinstance(m, nn.Dropout) for m in moe.modules()) == 1
    x = torch.randn(40, 16)
    moe.eval()
    clean = moe(x)
    moe.train()
    y = moe(x)
    kept = y != 0
    torch.testing.assert_close(y[kept], 2 * clean[kept])


# --- construction and bad input ---------------------------------------------------------

def test_api_names_and_shapes():
    moe = MoE(dim=64, hidden_dim=96, num_experts=8, top_k=2, dropout=0.0, device="meta")
    assert moe.router.weight.shape == (8, 64)
    assert moe.experts.gate_up_proj.shape == (8, 192, 64)
    assert moe.experts.down_proj.shape == (8, 64, 96)
    cfg = MoEConfig(dim=64, hidden_dim=96)
    assert MoE(cfg).config == cfg and cfg.num_experts == 8 and cfg.top_k == 2  # Mixtral defaults
    big = MoE(dim=4096, hidden_dim=14336, device="meta")
    assert sum(p.numel() for p in big.parameters()) == 8 * 176_160_768 + 8 * 4096


@pytest.mark.parametrize(
    "kwargs, match",
    [({"top_k": 0}, "top_k"), ({"top_k": 5}, "top_k"), ({"num_experts": 0}, "num_experts"),
     ({"capacity_factor": 0.0}, "capacity_factor"), ({"capacity_factor": -1.0}, "capacity_factor"),
     ({"routing": "softmax"}, "routing"), ({"dim": 0}, "dim")],
)
def test_bad_construction(kwargs, match):
    base = {"dim": 8, "hidden_dim": 12, "num_experts": 4, "top_k": 2}
    with pytest.raises(ValueError, match=match):
        MoE(**{**base, **kwargs})


def test_bad_forward_input():
    moe = make()
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\].*\(3, 9\)"):
        moe(torch.randn(3, 9, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        moe(torch.randn(2, 3, 8, dtype=torch.float64), attention_mask=torch.ones(2, 4))
    with pytest.raises(TypeError, match="floating"):
        moe(torch.ones(3, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="MoEConfig"):
        MoE(64)


# --- the CUDA path's logic, run on CPU -----------------------------------------------------

@pytest.mark.skipif(not grouped._cpu_grouped_mm_available(), reason="torch lacks CPU _grouped_mm")
@pytest.mark.parametrize("kind", ["gated", "mlp"])
def test_layer_on_the_projection_by_projection_path_matches_per_token_loop(monkeypatch, kind):
    """On CUDA the layer permutes the rows, runs the bank as one grouped_linear per projection
    (torch._grouped_mm) and takes the weighted sum, with no host sync. Forced here on CPU in
    float32 (see test_grouped.force_grouped_mm_path), with a capacity that drops assignments:
    output and every gradient match the float64 loop on the same weights."""
    from test_grouped import force_grouped_mm_path

    factor, policy, T = 0.75, "probs", 13
    moe, moe32 = (make(dim=16, hidden=24, experts=4, k=2, capacity_factor=factor, drop_policy=policy)
                  for _ in range(2))
    moe32.float()
    if kind == "mlp":  # classic experts with biases
        moe.experts = MLPExperts(4, 16, 24, activation="gelu", bias=True, dtype=torch.float64)
        moe32.experts = MLPExperts(4, 16, 24, activation="gelu", bias=True, dtype=torch.float32)
    moe32.load_state_dict(moe.state_dict())
    x = torch.randn(T, 16, dtype=torch.float64, requires_grad=True)
    keep, n_dropped = _keep_fn(moe, x.detach(), math.ceil(factor * T * 2 / 4), policy)
    assert n_dropped > 0
    ref = reference(moe, x, keep=keep) if kind == "gated" else _mlp_reference(moe, x, keep)
    w = torch.randn_like(ref)
    params = dict(moe.named_parameters())
    want = torch.autograd.grad((ref * w).sum(), [x, *params.values()])

    monkeypatch.setattr(_ExpertBank, "runs_by_projection", lambda self, x: True)
    calls = force_grouped_mm_path(monkeypatch)
    x32 = x.detach().float().requires_grad_()
    y = moe32(x32)
    assert len(calls) == 2  # one grouped product per projection
    torch.testing.assert_close(y.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    got = torch.autograd.grad((y * w.float()).sum(), [x32, *moe32.parameters()])
    assert len(calls) == 6  # and per projection one for its input and one for its weight gradient
    for name, a, b in zip(["input", *params], got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=lambda m: f"grad of {name}: {m}")


def _mlp_reference(moe, x_TD, keep):
    ex, outs = moe.experts, []
    for t in range(x_TD.shape[0]):
        ids, weights = route_token(moe.router.weight @ x_TD[t], moe.config.top_k)
        y = torch.zeros_like(x_TD[t])
        for slot, (e, wt) in enumerate(zip(ids, weights)):
            if keep(t, slot):
                h = classic_ffn(x_TD[t], ex.up_proj[e], ex.down_proj[e], ex.activation, ex.up_bias[e], ex.down_bias[e])
                y = y + wt * h
        outs.append(y)
    return torch.stack(outs)
