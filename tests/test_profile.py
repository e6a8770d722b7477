"""moe_ffn.profile as a library: routing overrides, load statistics, FLOP counts, a run.

Truth here is hand-computed (Zipf weights of a zero router, round-robin counts, FLOP
formulas, capacity drops recounted from the routed counts).
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_ffn import MoEConfig
from moe_ffn.presets import Preset, load_preset
from moe_ffn.profile import (
    MoEStack,
    ProfileOptions,
    expert_flops_per_step,
    install_routing_override,
    load_stats,
    resolve_preset,
    run_profile,
)

TINY = load_preset("tiny-moe")  # D=64, F=128, E=8, K=2, 2 layers


def _stack(config: MoEConfig = TINY.ffn, layers: int = 2, seed: int = 0) -> MoEStack:
    torch.manual_seed(seed)
    return MoEStack(config, layers)


def _counts(stack: MoEStack, T: int, batches: int = 1, seed: int = 0) -> torch.Tensor:
    """[L, E] tokens per expert summed over `batches` forwards of fresh random tokens."""
    gen = torch.Generator().manual_seed(seed)
    total = 0
    with torch.no_grad():
        for _ in range(batches):
            stack(torch.randn(T, stack.layers[0].config.dim, generator=gen))
            total = total + torch.stack([m.stats.tokens_per_expert_E for m in stack.layers])
    return total


def test_skew_of_a_zero_router_is_zipf():
    # Zero router weights → zero logits; the skew bias alone decides: softmax ∝ (e+1)^-a,
    # so every token picks experts 0 and 1 with weights 1/(1+2^-a) and 2^-a/(1+2^-a).
    a = 1.5
    stack = _stack(TINY.ffn.replace(top_k=2))
    for m in stack.layers:
        torch.nn.init.zeros_(m.router.weight)
    install_routing_override(stack, skew=a)
    with torch.no_grad():
        stack(torch.randn(10, 64))
    s = stack.layers[0].stats
    assert s.expert_ids_TK.tolist() == [[0, 1]] * 10
    w1 = 2.0**-a
    torch.testing.assert_close(s.weights_TK[0], torch.tensor([1 / (1 + w1), w1 / (1 + w1)]))
    zipf = torch.arange(1, 9, dtype=torch.float64) ** -a
    torch.testing.assert_close(s.router_probs_TE[0].double(), zipf / zipf.sum(), rtol=1e-6, atol=0)
    assert s.tokens_per_expert_E.tolist() == [10, 10, 0, 0, 0, 0, 0, 0]


def test_skew_raises_the_load_cv():
    cvs = []
    for a in (0.0, 0.5, 2.0):
        stack = _stack()
        install_routing_override(stack, skew=a)
        counts_LE = _counts(stack, T=256, batches=2)
        cvs.append(max(load_stats(c)[3] for c in counts_LE))
    assert cvs[0] < cvs[1] < cvs[2], cvs
    assert cvs[2] > 0.5  # Zipf(2) over 8 experts is far from uniform


def test_balanced_gives_exactly_uniform_load():
    stack = _stack()
    install_routing_override(stack, balanced=True)
    counts_LE = _counts(stack, T=64)  # T·K = 128 = 16 per expert
    assert counts_LE.tolist() == [[16] * 8, [16] * 8]
    assert all(load_stats(c)[3] == 0.0 for c in counts_LE)
    s = stack.layers[1].stats
    assert torch.equal(s.expert_ids_TK[:5], torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [0, 1]]))
    torch.testing.assert_close(s.weights_TK.sum(-1), torch.ones(64))


def test_balanced_uneven_split_differs_by_at_most_one():
    stack = _stack(TINY.ffn.replace(top_k=3))
    install_routing_override(stack, balanced=True)
    counts = _counts(stack, T=7)[0]  # 21 assignments over 8 experts
    assert counts.tolist() == [3, 3, 3, 3, 3, 2, 2, 2]
    ids = stack.layers[0].stats.expert_ids_TK
    assert all(len(set(row)) == 3 for row in ids.tolist())  # a token's experts are distinct


def test_balanced_router_still_gets_gradients():
    stack = _stack()
    install_routing_override(stack, balanced=True)
    stack(torch.randn(32, 64)).square().mean().backward()
    g = stack.layers[0].router.weight.grad
    assert g is not None and g.abs().sum() > 0


def test_removing_the_hooks_restores_the_router():
    plain = _counts(_stack(), T=128)
    stack = _stack()
    handles = install_routing_override(stack, skew=3.0)
    assert not torch.equal(_counts(stack, T=128), plain)
    for h in handles:
        h.remove()
    assert torch.equal(_counts(stack, T=128), plain)


def test_override_arguments():
    assert install_routing_override(_stack()) == []
    with pytest.raises(ValueError, match="exclude"):
        install_routing_override(_stack(), skew=1.0, balanced=True)


def test_load_stats_by_hand():
    mn, mean, mx, cv, mom = load_stats(torch.tensor([1, 2, 3, 6]))
    assert (mn, mean, mx, mom) == (1.0, 3.0, 6.0, 2.0)
    assert cv == pytest.approx(math.sqrt(3.5) / 3)  # population std: sqrt((4+1+0+9)/4)


def test_expert_flops_by_hand():
    # 2 layers, T=10, K=2, D=64, F=128: 3 · 6·64·128·20 per layer.
    assert expert_flops_per_step(TINY.ffn, 2, 10) == 3 * 6 * 64 * 128 * 20 * 2 == 5_898_240
    # 4 of the 20 assignments dropped: 16 rows computed.
    assert expert_flops_per_step(TINY.ffn, 1, 10, dropped_per_layer=4) == 3 * 6 * 64 * 128 * 16
    # A shared expert of width 32 runs on all 10 tokens.
    cfg = MoEConfig(dim=8, hidden_dim=4, num_experts=4, top_k=1, num_shared_experts=1, shared_hidden_dim=32)
    assert expert_flops_per_step(cfg, 1, 10) == 3 * (6 * 8 * 4 * 10 + 6 * 8 * 32 * 10)


def test_options_validation_names_the_field():
    for kwargs, name in [
        ({"tokens": 0}, "tokens"),
        ({"steps": -1}, "steps"),
        ({"layers": 0}, "layers"),
        ({"trace_steps": 1.5}, "trace_steps"),
        ({"seed": -1}, "seed"),
        ({"dtype": "fp16"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"skew": -1.0}, "skew"),
        ({"skew": 1.0, "balanced": True}, "balanced"),
    ]:
        with pytest.raises(ValueError, match=name):
            ProfileOptions(**kwargs)


def test_resolve_preset_rejects_dense(tmp_path):
    path = tmp_path / "dense.toml"
    path.write_text('name = "d"\n[dense]\nkind = "gated"\ndim = 8\n')
    with pytest.raises(ValueError, match="dense"):
        resolve_preset(str(path))
    assert isinstance(resolve_preset(None), Preset)


def _capacity_preset(tmp_path) -> str:
    path = tmp_path / "capped.toml"
    path.write_text(
        'name = "capped"\nnum_layers = 2\n[moe]\ndim = 32\nhidden_dim = 48\nnum_experts = 4\ntop_k = 2\n'
        "capacity_factor = 1.0\nz_loss_coef = 0.01\n"
    )
    return str(path)


def test_run_is_deterministic_and_counts_drops(tmp_path):
    opts = dict(config=_capacity_preset(tmp_path), tokens=48, steps=1, trace_steps=1, seed=7,
                logdir=str(tmp_path / "runs"), progress=False)
    a = run_profile(ProfileOptions(run_name="a", **opts))
    b = run_profile(ProfileOptions(run_name="b", **opts))
    assert a.counts_SLE == b.counts_SLE and a.dropped_SL == b.dropped_SL
    assert a.balance_loss_SL == b.balance_loss_SL and a.z_loss_SL == b.z_loss_SL

    # 1 untimed step is not recorded: steps + warm-up + active = 3 recorded steps.
    assert len(a.counts_SLE) == 3 and len(a.step_seconds) == 1
    capacity = math.ceil(1.0 * 48 * 2 / 4)  # ceil(factor·T·k/E) = 24
    for step_counts, step_dropped in zip(a.counts_SLE, a.dropped_SL):
        for counts_E, dropped in zip(step_counts, step_dropped):
            assert sum(counts_E) == 48 * 2
            assert dropped == sum(max(0, c - capacity) for c in counts_E)
    total_dropped = sum(map(sum, a.dropped_SL))
    assert total_dropped > 0  # random routing over 4 experts overflows somewhere
    loads = a.layer_loads()
    assert sum(ld.dropped_fraction for ld in loads) == pytest.approx(total_dropped / (3 * 96))
    # aux = 0.01·z with aux_loss_coef 0.
    assert loads[0].aux_loss == pytest.approx(0.01 * loads[0].z_loss)
    # Region times from the trace: every MoE region ran, the shares are positive.
    # CPU: the dispatch is fused into the experts' op, so no "unpermute" region (profile.REGIONS)
    assert {"router", "permute", "experts", "backward"} <= set(a.region_ms)
    assert "unpermute" not in a.region_ms
    assert all(v >= 0 for v in a.region_ms.values()) and a.region_ms["experts"] > 0
    assert a.peak_memory_bytes and a.peak_memory_bytes > 0


def test_a_decode_sized_step_is_one_region(tmp_path):
    """A step of a few tokens runs in one call of the library (moe_ffn/_decode.py): its trace
    shows the "decode_step" region in place of router, permute and experts."""
    from moe_ffn import _decode

    if _decode._entry_point() is None or _decode._kind(torch.float32, 8, 4, 96, 32, 48) is None:
        pytest.skip("no one-call decode step here (library not built, or not this CPU's kernels)")
    path = tmp_path / "small.toml"
    path.write_text('name = "small"\nnum_layers = 2\n[moe]\ndim = 32\nhidden_dim = 48\nnum_experts = 4\ntop_k = 2\n')
    a = run_profile(ProfileOptions(config=str(path), tokens=8, steps=1, trace_steps=1, seed=7,
                                   logdir=str(tmp_path / "runs"), progress=False, run_name="decode"))
    assert a.region_ms["decode_step"] > 0
    assert not {"router", "permute", "experts"} & set(a.region_ms)
