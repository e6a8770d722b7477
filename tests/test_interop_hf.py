"""Parity with transformers' own FFN modules: outputs, router logits, the balance loss, export.

Tiny random modules built from transformers' config classes, float32, weights drawn with a
larger std than transformers' init so routing and activations are far from trivial.

float32 comparisons: reference.assert_close_f32 (1e-5 plus 8 ulp of the largest value).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)
from transformers.models.gemma.modeling_gemma import GemmaMLP  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402
from transformers.models.mistral.modeling_mistral import MistralMLP  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import (  # noqa: E402
    MixtralSparseMoeBlock,
    load_balancing_loss_func,
)
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock  # noqa: E402
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP, Qwen2MoeSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

from moe_ffn import FeedForward, GatedFFN, MoE, pooled_load_balancing_loss  # noqa: E402
from moe_ffn.interop import from_hf_module, load_hf_state_dict, to_hf_state_dict  # noqa: E402
from reference import assert_close_f32  # noqa: E402

D = 12  # model width; every hidden width below differs from it and from each other
ATTN = dict(num_attention_heads=2, num_key_value_heads=1)


def mixtral_cfg(**kw):
    return MixtralConfig(hidden_size=D, intermediate_size=20, num_local_experts=5, num_experts_per_tok=2, **ATTN, **kw)


def qwen2_cfg(**kw):
    kw = {"norm_topk_prob": False, **kw}
    return Qwen2MoeConfig(hidden_size=D, intermediate_size=16, moe_intermediate_size=20,
                          shared_expert_intermediate_size=28, num_experts=6, num_experts_per_tok=3, **ATTN, **kw)


def qwen3_cfg(**kw):
    return Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=20, num_experts=7, num_experts_per_tok=3,
                          norm_topk_prob=True, **ATTN, **kw)


def olmoe_cfg(**kw):
    return OlmoeConfig(hidden_size=D, intermediate_size=20, num_experts=6, num_experts_per_tok=2, **ATTN, **kw)


SPARSE = {
    "mixtral": lambda: MixtralSparseMoeBlock(mixtral_cfg()),
    "qwen2_moe": lambda: Qwen2MoeSparseMoeBlock(qwen2_cfg()),
    "qwen2_moe_norm": lambda: Qwen2MoeSparseMoeBlock(qwen2_cfg(norm_topk_prob=True)),
    "qwen3_moe": lambda: Qwen3MoeSparseMoeBlock(qwen3_cfg()),
    "olmoe": lambda: OlmoeSparseMoeBlock(olmoe_cfg()),
}
DENSE = {
    "llama": lambda: LlamaMLP(LlamaConfig(hidden_size=D, intermediate_size=20, **ATTN)),
    "llama_bias": lambda: LlamaMLP(LlamaConfig(hidden_size=D, intermediate_size=20, mlp_bias=True, **ATTN)),
    "mistral": lambda: MistralMLP(MistralConfig(hidden_size=D, intermediate_size=20, **ATTN)),
    "gemma": lambda: GemmaMLP(GemmaConfig(hidden_size=D, intermediate_size=20, head_dim=6, **ATTN)),
    "gemma_legacy_gelu": lambda: GemmaMLP(GemmaConfig(hidden_size=D, intermediate_size=20, head_dim=6,
                                                      hidden_act="gelu", **ATTN)),
    "qwen2_moe_dense": lambda: Qwen2MoeMLP(qwen2_cfg()),
    "gpt2": lambda: GPT2MLP(20, GPT2Config(n_embd=D, n_head=2)),
}


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module.eval()


def inputs(seed: int, shape=(3, 7, D)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_sparse_block_output_and_router_logits_match(name):
    hf = randomize(SPARSE[name](), seed=1)
    ours = from_hf_module(hf)
    assert isinstance(ours, MoE)
    x = inputs(2)
    with torch.no_grad():
        expected = hf(x.clone())
        logits_hf = hf.gate(x)[0]
        got = ours(x)
    assert_close_f32(got, expected)
    torch.testing.assert_close(ours.stats.router_logits_TE, logits_hf, rtol=0, atol=1e-6)
    # Same experts chosen for every token (ties are measure-zero with random weights).
    ids_hf = hf.gate(x)[2]
    assert torch.equal(ours.stats.expert_ids_TK.sort(-1).values, ids_hf.sort(-1).values)


@pytest.mark.parametrize("name", sorted(DENSE))
def test_dense_mlp_output_matches(name):
    hf = randomize(DENSE[name](), seed=3)
    ours = from_hf_module(hf).eval()
    assert isinstance(ours, FeedForward if name == "gpt2" else GatedFFN)
    x = inputs(4)
    with torch.no_grad():
        assert_close_f32(ours(x), hf(x.clone()))


def test_activations_are_read_from_the_modules():
    assert from_hf_module(randomize(DENSE["gemma"](), 0)).activation == "gelu_tanh"
    assert from_hf_module(randomize(DENSE["gemma_legacy_gelu"](), 0)).activation == "gelu_tanh"
    assert from_hf_module(randomize(DENSE["gpt2"](), 0)).activation == "gelu_tanh"
    assert from_hf_module(randomize(DENSE["llama"](), 0)).activation == "silu"
    qwen = from_hf_module(randomize(SPARSE["qwen2_moe"](), 0))
    cfg = qwen.config
    assert (cfg.num_shared_experts, cfg.shared_width, cfg.shared_expert_gate, cfg.norm_topk_prob) == (1, 28, True, False)


def test_mixtral_jitter_matches_in_training():
    """transformers multiplies the hidden states in place, so the experts see the noise too;
    with the same seed both draw the same U(1−ε, 1+ε) noise."""
    hf = MixtralSparseMoeBlock(mixtral_cfg(router_jitter_noise=0.3))
    randomize(hf, seed=5).train()
    ours = from_hf_module(hf).train()
    assert ours.config.jitter_scope == "router_and_experts" and ours.config.jitter_noise == 0.3
    x = inputs(6)
    torch.manual_seed(7)
    with torch.no_grad():
        expected = hf(x.clone())
    torch.manual_seed(7)
    with torch.no_grad():
        got = ours(x)
    assert_close_f32(got, expected)
    torch.manual_seed(7)
    with torch.no_grad():
        assert not torch.allclose(hf.eval()(x.clone()), expected)  # the noise mattered


def test_gradients_match_mixtral():
    hf = randomize(SPARSE["mixtral"](), seed=8).train()
    ours = from_hf_module(hf).train()
    x = inputs(9)
    g = inputs(10)
    (hf(x.clone()) * g).sum().backward()
    (ours(x) * g).sum().backward()
    assert_close_f32(ours.router.weight.grad, hf.gate.weight.grad)
    assert_close_f32(ours.experts.gate_up_proj.grad, hf.experts.gate_up_proj.grad)
    assert_close_f32(ours.experts.down_proj.grad, hf.experts.down_proj.grad)


@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe"])
def test_pooled_balance_loss_equals_load_balancing_loss_func(name):
    layers_hf = [randomize(SPARSE[name](), seed=s) for s in (11, 12, 13)]
    layers = [from_hf_module(m) for m in layers_hf]
    B, S = 3, 7
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[2, 5:] = 0  # right padding
    logits = []
    for i, (hf, ours) in enumerate(zip(layers_hf, layers)):
        x = inputs(20 + i, (B, S, D))
        with torch.no_grad():
            ours(x, attention_mask=mask)
            logits.append(hf.gate(x)[0])
    E, K = layers[0].config.num_experts, layers[0].config.top_k
    for attention_mask in (mask, None):
        if attention_mask is None:
            for i, ours in enumerate(layers):
                with torch.no_grad():
                    ours(inputs(20 + i, (B, S, D)))
        expected = load_balancing_loss_func(tuple(logits), E, K, attention_mask)
        torch.testing.assert_close(pooled_load_balancing_loss(layers), expected, rtol=1e-6, atol=1e-7)


def test_mixtral_model_aux_loss_equals_pooled_loss_of_converted_layers():
    """End to end: MixtralForCausalLM's own aux_loss (output_router_logits) on a padded batch."""
    config = mixtral_cfg(vocab_size=32, num_hidden_layers=3)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    randomize(model, seed=14)
    captured = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, args: captured.append(args[0].detach().clone()))
             for layer in model.model.layers]
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(15))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    for h in hooks:
        h.remove()
    layers = [from_hf_module(layer.mlp) for layer in model.model.layers]
    with torch.no_grad():
        for layer, x in zip(layers, captured):
            layer(x, attention_mask=mask)
    torch.testing.assert_close(pooled_load_balancing_loss(layers), out.aux_loss, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "gpt2", "llama_bias"])
def test_export_loads_strictly_into_transformers(name):
    """moe_ffn → transformers' in-memory layout → `load_state_dict(strict=True)` → same outputs."""
    src_hf = randomize((SPARSE | DENSE)[name](), seed=16)
    ours = from_hf_module(src_hf)
    with torch.no_grad():  # move ours away from the source so equality is not inherited
        for p in ours.parameters():
            p.mul_(1.5)
    layout = {"mixtral": "v5", "qwen2_moe": "v5", "gpt2": "gpt2_mlp", "llama_bias": "llama_mlp"}[name]
    dst_hf = (SPARSE | DENSE)[name]().eval()
    dst_hf.load_state_dict(to_hf_state_dict(ours, layout), strict=True)
    x = inputs(17)
    with torch.no_grad():
        assert_close_f32(dst_hf(x.clone()), ours.eval()(x))


def test_qwen_v4_on_disk_layout_matches_the_transformers_module():
    """qwen_moe_v4 is the per-expert layout Qwen-MoE checkpoints use on disk."""
    hf = randomize(SPARSE["qwen2_moe"](), seed=18)
    sd = {"gate.weight": hf.gate.weight, "shared_expert_gate.weight": hf.shared_expert_gate.weight}
    F = hf.experts.down_proj.shape[2]
    for e in range(hf.experts.gate_up_proj.shape[0]):
        sd[f"experts.{e}.gate_proj.weight"] = hf.experts.gate_up_proj[e, :F]
        sd[f"experts.{e}.up_proj.weight"] = hf.experts.gate_up_proj[e, F:]
        sd[f"experts.{e}.down_proj.weight"] = hf.experts.down_proj[e]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        sd[f"shared_expert.{proj}.weight"] = getattr(hf.shared_expert, proj).weight
    ours = from_hf_module(randomize(SPARSE["qwen2_moe"](), seed=19))  # other weights, same shapes
    load_hf_state_dict(ours, sd, "qwen_moe_v4")
    x = inputs(20)
    with torch.no_grad():
        assert_close_f32(ours(x), hf(x.clone()))


def test_unsupported_module_lists_the_supported_ones():
    with pytest.raises(TypeError, match=r"unsupported module Linear; supported: \[.*'MixtralSparseMoeBlock'.*'GPT2MLP'\]"):
        from_hf_module(torch.nn.Linear(3, 3))


def test_unsupported_activation_lists_the_supported_ones():
    mlp = LlamaMLP(LlamaConfig(hidden_size=D, intermediate_size=20, hidden_act="relu2", **ATTN))
    with pytest.raises(ValueError, match=r"unsupported activation ReLUSquaredActivation; supported: \[.*'SiLUActivation'.*\]"):
        from_hf_module(mlp)
