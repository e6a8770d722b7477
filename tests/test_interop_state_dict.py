"""State-dict converters: round trips, completeness, gate/up order, strict all-or-nothing loading.

No transformers needed: the transformers side is written out by hand here (w1 = gate, w3 = up,
w2 = down; Conv1D stores [in, out]), and checked against transformers' own modules in
test_interop_hf.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_ffn import FeedForward, GatedFFN, MoE, MoEConfig
from moe_ffn.interop import hf_keys, load_hf_state_dict, to_hf_state_dict

# Non-square everywhere: D != F != S, E not a power of two.
D, F_, E, K, S = 6, 10, 5, 2, 14


def distinct_fill(module: torch.nn.Module) -> None:
    """Every element of every tensor a different integer (exact in float32), so any
    misplaced, swapped or transposed slice changes some value."""
    offset = 0
    with torch.no_grad():
        for t in module.state_dict(keep_vars=True).values():
            n = t.numel()
            t.copy_((torch.arange(n, dtype=torch.float64) + offset + 1).reshape(t.shape))
            offset += n


def zero_fill(module):
    with torch.no_grad():
        for t in module.state_dict(keep_vars=True).values():
            t.zero_()


def modules_and_layouts():
    mixtral = MoEConfig(dim=D, hidden_dim=F_, num_experts=E, top_k=K)
    qwen = mixtral.replace(num_shared_experts=1, shared_hidden_dim=S, shared_expert_gate=True, norm_topk_prob=False)
    return [
        ("v5", lambda: MoE(mixtral)),
        ("mixtral_v4", lambda: MoE(mixtral)),
        ("qwen_moe_v4", lambda: MoE(mixtral)),
        ("v5", lambda: MoE(qwen)),
        ("qwen_moe_v4", lambda: MoE(qwen)),
        ("llama_mlp", lambda: GatedFFN(D, F_)),
        ("llama_mlp", lambda: GatedFFN(D, F_, bias=True)),
        ("gpt2_mlp", lambda: FeedForward(D, F_, "gelu_tanh", bias=True)),
    ]


CASES = modules_and_layouts()
IDS = [f"{layout}-{i}" for i, (layout, _) in enumerate(CASES)]


@pytest.mark.parametrize("layout,make", CASES, ids=IDS)
def test_round_trip_is_exact_and_covers_every_element_once(layout, make):
    src = make()
    distinct_fill(src)
    sd = to_hf_state_dict(src, layout, prefix="model.layers.3.mlp.")
    # Every element exported exactly once: the counts match and all values are distinct.
    values = torch.cat([t.reshape(-1) for t in sd.values()])
    assert values.numel() == sum(p.numel() for p in src.state_dict().values())
    assert values.unique().numel() == values.numel()
    assert all(t.is_contiguous() for t in sd.values())

    dst = make()
    zero_fill(dst)
    load_hf_state_dict(dst, sd, layout, prefix="model.layers.3.mlp.")
    for key, value in src.state_dict().items():
        assert torch.equal(dst.state_dict()[key], value), key


def test_export_is_a_copy():
    moe = MoE(dim=D, hidden_dim=F_, num_experts=E, top_k=K)
    sd = to_hf_state_dict(moe, "v5")
    sd["experts.gate_up_proj"].add_(1.0)
    assert not torch.equal(sd["experts.gate_up_proj"], moe.experts.gate_up_proj)


def test_expected_keys_and_shapes_written_out():
    moe = MoE(dim=D, hidden_dim=F_, num_experts=E, top_k=K, num_shared_experts=1, shared_hidden_dim=S,
              shared_expert_gate=True)
    keys = hf_keys(moe, "qwen_moe_v4")
    expected = {"gate.weight": (E, D), "shared_expert.gate_proj.weight": (S, D), "shared_expert.up_proj.weight": (S, D),
                "shared_expert.down_proj.weight": (D, S), "shared_expert_gate.weight": (1, D)}
    for e in range(E):
        expected.update({f"experts.{e}.gate_proj.weight": (F_, D), f"experts.{e}.up_proj.weight": (F_, D),
                         f"experts.{e}.down_proj.weight": (D, F_)})
    assert keys == expected
    assert hf_keys(moe, "v5")["experts.gate_up_proj"] == (E, 2 * F_, D)
    assert hf_keys(FeedForward(D, F_), "gpt2_mlp") == {"c_fc.weight": (D, F_), "c_fc.bias": (F_,),
                                                       "c_proj.weight": (F_, D), "c_proj.bias": (D,)}


def test_mixtral_v4_gate_and_up_never_swapped():
    """Load random w1/w2/w3 per expert and compare with silu(x·W1ᵀ)⊙(x·W3ᵀ)·W2ᵀ by hand, float64."""
    g = torch.Generator().manual_seed(0)
    sd = {"gate.weight": torch.randn(E, D, generator=g, dtype=torch.float64)}
    for e in range(E):
        sd[f"experts.{e}.w1.weight"] = torch.randn(F_, D, generator=g, dtype=torch.float64)
        sd[f"experts.{e}.w3.weight"] = torch.randn(F_, D, generator=g, dtype=torch.float64)
        sd[f"experts.{e}.w2.weight"] = torch.randn(D, F_, generator=g, dtype=torch.float64)
    moe = MoE(dim=D, hidden_dim=F_, num_experts=E, top_k=K, dtype=torch.float64)
    load_hf_state_dict(moe, sd, "mixtral_v4")
    x = torch.randn(9, D, generator=g, dtype=torch.float64)
    out = moe(x)

    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ sd["gate.weight"].T, dim=-1)
        top = probs.topk(K)
        for w, e in zip(top.values / top.values.sum(), top.indices.tolist()):
            w1, w2, w3 = (sd[f"experts.{e}.w{i}.weight"] for i in (1, 2, 3))
            expected[t] += w * ((F.silu(x[t] @ w1.T) * (x[t] @ w3.T)) @ w2.T)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_llama_mlp_gate_and_up_never_swapped():
    g = torch.Generator().manual_seed(1)
    sd = {"gate_proj.weight": torch.randn(F_, D, generator=g, dtype=torch.float64),
          "up_proj.weight": torch.randn(F_, D, generator=g, dtype=torch.float64),
          "down_proj.weight": torch.randn(D, F_, generator=g, dtype=torch.float64)}
    ffn = GatedFFN(D, F_, dtype=torch.float64)
    load_hf_state_dict(ffn, sd, "llama_mlp")
    x = torch.randn(4, 3, D, generator=g, dtype=torch.float64)
    expected = (F.silu(x @ sd["gate_proj.weight"].T) * (x @ sd["up_proj.weight"].T)) @ sd["down_proj.weight"].T
    torch.testing.assert_close(ffn(x), expected, rtol=1e-12, atol=1e-12)


def test_gpt2_conv1d_weights_are_transposed():
    g = torch.Generator().manual_seed(2)
    sd = {"c_fc.weight": torch.randn(D, F_, generator=g, dtype=torch.float64),
          "c_fc.bias": torch.randn(F_, generator=g, dtype=torch.float64),
          "c_proj.weight": torch.randn(F_, D, generator=g, dtype=torch.float64),
          "c_proj.bias": torch.randn(D, generator=g, dtype=torch.float64)}
    ffn = FeedForward(D, F_, "gelu_new", dtype=torch.float64)
    load_hf_state_dict(ffn, sd, "gpt2_mlp")
    x = torch.randn(5, D, generator=g, dtype=torch.float64)
    h = x @ sd["c_fc.weight"] + sd["c_fc.bias"]  # Conv1D: x·W + b with W stored [in, out]
    h = 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)))
    expected = h @ sd["c_proj.weight"] + sd["c_proj.bias"]
    torch.testing.assert_close(ffn(x), expected, rtol=1e-12, atol=1e-12)


def test_v4_and_v5_layouts_agree():
    """Loading the same weights through the on-disk and the in-memory layout gives one module."""
    a = MoE(dim=D, hidden_dim=F_, num_experts=E, top_k=K)
    distinct_fill(a)
    b = MoE(dim=D, hidden_dim=F_, num_experts=E, top_k=K)
    load_hf_state_dict(b, to_hf_state_dict(a, "mixtral_v4"), "mixtral_v4")
    v5 = to_hf_state_dict(b, "v5")
    w1 = to_hf_state_dict(a, "mixtral_v4")
    for e in range(E):
        assert torch.equal(v5["experts.gate_up_proj"][e, :F_], w1[f"experts.{e}.w1.weight"])
        assert torch.equal(v5["experts.gate_up_proj"][e, F_:], w1[f"experts.{e}.w3.weight"])
        assert torch.equal(v5["experts.down_proj"][e], w1[f"experts.{e}.w2.weight"])


def test_dtype_is_cast_on_load():
    src = GatedFFN(D, F_, dtype=torch.float64)
    distinct_fill(src)
    dst = GatedFFN(D, F_, dtype=torch.bfloat16)
    load_hf_state_dict(dst, to_hf_state_dict(src, "llama_mlp"), "llama_mlp")
    assert dst.gate_up_proj.dtype == torch.bfloat16
    assert torch.equal(dst.gate_up_proj.double(), src.gate_up_proj.to(torch.bfloat16).double())


# --- strict, all-or-nothing loading ------------------------------------------------------------


def fresh_pair():
    moe = MoE(dim=D, hidden_dim=F_, num_experts=E, top_k=K)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    src = MoE(dim=D, hidden_dim=F_, num_experts=E, top_k=K)
    distinct_fill(src)
    return moe, before, to_hf_state_dict(src, "mixtral_v4", prefix="block_sparse_moe.")


def assert_untouched(moe, before):
    for k, v in moe.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was modified by a failed load"


def test_missing_and_unexpected_keys_are_listed_and_nothing_is_loaded():
    moe, before, sd = fresh_pair()
    del sd["block_sparse_moe.experts.3.w3.weight"]
    sd["block_sparse_moe.experts.5.w1.weight"] = torch.zeros(F_, D)  # a sixth expert
    with pytest.raises(KeyError) as info:
        load_hf_state_dict(moe, sd, "mixtral_v4", prefix="block_sparse_moe.")
    msg = str(info.value)
    assert "missing keys ['block_sparse_moe.experts.3.w3.weight']" in msg
    assert "unexpected keys ['block_sparse_moe.experts.5.w1.weight']" in msg
    assert_untouched(moe, before)


def test_keys_outside_the_prefix_are_ignored_but_inside_it_are_strict():
    moe, before, sd = fresh_pair()
    sd["model.embed_tokens.weight"] = torch.zeros(3, D)  # the rest of a model's state dict
    sd["block_sparse_moe_2.weight"] = torch.zeros(1)  # shares the text but not the module path
    load_hf_state_dict(moe, sd, "mixtral_v4", prefix="block_sparse_moe.")
    assert torch.equal(moe.router.weight, sd["block_sparse_moe.gate.weight"])
    with pytest.raises(KeyError, match="unexpected keys"):
        load_hf_state_dict(moe, sd, "mixtral_v4")  # no prefix: every key counts


def test_shape_mismatch_names_both_shapes_and_nothing_is_loaded():
    moe, before, sd = fresh_pair()
    sd["block_sparse_moe.experts.0.w2.weight"] = torch.zeros(F_, D)  # transposed by mistake
    sd["block_sparse_moe.gate.weight"] = torch.zeros(E + 1, D)
    with pytest.raises(ValueError) as info:
        load_hf_state_dict(moe, sd, "mixtral_v4", prefix="block_sparse_moe.")
    msg = str(info.value)
    assert f"block_sparse_moe.experts.0.w2.weight: checkpoint has shape ({F_}, {D}), MoE expects ({D}, {F_})" in msg
    assert f"block_sparse_moe.gate.weight: checkpoint has shape ({E + 1}, {D}), MoE expects ({E}, {D})" in msg
    assert_untouched(moe, before)


def test_integer_tensor_is_rejected():
    ffn = GatedFFN(D, F_)
    sd = to_hf_state_dict(ffn, "llama_mlp")
    sd["up_proj.weight"] = sd["up_proj.weight"].to(torch.int64)
    with pytest.raises(ValueError, match="up_proj.weight: expected a floating-point tensor, got torch.int64"):
        load_hf_state_dict(ffn, sd, "llama_mlp")


def test_wrong_layout_for_module_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"layout 'gpt2_mlp' does not fit a MoE; expected one of \['v5', 'mixtral_v4', 'qwen_moe_v4'\]"):
        to_hf_state_dict(MoE(dim=D, hidden_dim=F_, num_experts=E, top_k=K), "gpt2_mlp")
    with pytest.raises(ValueError, match=r"expected one of \['llama_mlp'\]"):
        load_hf_state_dict(GatedFFN(D, F_), {}, "v5")


def test_unsupported_module_lists_the_supported_ones():
    with pytest.raises(TypeError, match=r"no transformers layout for Linear; supported modules: \['MoE', 'GatedFFN', 'FeedForward'\]"):
        to_hf_state_dict(torch.nn.Linear(2, 2), "v5")


def test_features_transformers_cannot_hold_are_refused():
    with pytest.raises(ValueError, match=r"has no place for \['experts.down_bias', 'experts.gate_up_bias'\]"):
        to_hf_state_dict(MoE(dim=D, hidden_dim=F_, num_experts=E, top_k=K, bias=True), "v5")
    with pytest.raises(ValueError, match="router.expert_bias"):
        to_hf_state_dict(MoE(dim=D, hidden_dim=F_, num_experts=E, top_k=K, expert_bias_update_rate=1e-3), "v5")
    shared = MoE(dim=D, hidden_dim=F_, num_experts=E, top_k=K, num_shared_experts=1, shared_expert_gate=True)
    with pytest.raises(ValueError, match="'mixtral_v4' has no shared experts"):
        to_hf_state_dict(shared, "mixtral_v4")
    with pytest.raises(ValueError, match="always has a sigmoid gate"):
        to_hf_state_dict(MoE(dim=D, hidden_dim=F_, num_experts=E, top_k=K, num_shared_experts=1), "v5")
    with pytest.raises(ValueError, match="always have biases"):
        to_hf_state_dict(FeedForward(D, F_, bias=False), "gpt2_mlp")
