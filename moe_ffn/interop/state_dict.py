"""State-dict converters between moe_ffn modules and transformers' checkpoint layouts.

Legend: E experts, D model dim, F hidden dim per expert, S shared-expert width.

moe_ffn keeps one layout (experts.py): `gate_up_proj` [E, 2F, D] with the gate rows first,
`down_proj` [E, D, F]. transformers has several, all with keys relative to the FFN block:

    layout        keys                                                   who
    "v5"          gate.weight [E, D]                                     in-memory transformers v5:
                  experts.gate_up_proj [E, 2F, D] (gate first)           Mixtral, Qwen2/3-MoE, OLMoE
                  experts.down_proj [E, D, F]
    "mixtral_v4"  gate.weight, experts.{e}.w1.weight [F, D] (gate)      Mixtral on disk
                  experts.{e}.w3.weight [F, D] (up), .w2.weight [D, F]  (`block_sparse_moe.` prefix)
    "qwen_moe_v4" gate.weight, experts.{e}.gate_proj/up_proj.weight      Qwen2/3-MoE and OLMoE on disk
                  [F, D], experts.{e}.down_proj.weight [D, F]
    "llama_mlp"   gate_proj/up_proj.weight [F, D], down_proj.weight      LLaMA, Mistral, Gemma MLPs
                  [D, F] (+ .bias with LLaMA's mlp_bias)
    "gpt2_mlp"    c_fc.weight [D, F], c_fc.bias [F],                     GPT-2 (Conv1D stores [in, out])
                  c_proj.weight [F, D], c_proj.bias [D]

The Qwen2-MoE shared expert adds `shared_expert.{gate,up,down}_proj.weight` and
`shared_expert_gate.weight` [1, D] to "v5" and "qwen_moe_v4".

Each layout is one table of pieces: a transformers key and the view of a moe_ffn tensor that
holds it. Export reads the views, import writes into them, so the two directions cannot
disagree, and a test that every element is covered once proves the table complete.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Mapping

import torch
from torch import Tensor, nn

from moe_ffn.dense import FeedForward, GatedFFN
from moe_ffn.moe import MoE

__all__ = ["Layout", "LAYOUTS", "to_hf_state_dict", "load_hf_state_dict", "hf_keys"]

Layout = Literal["v5", "mixtral_v4", "qwen_moe_v4", "llama_mlp", "gpt2_mlp"]

# Which layouts each moe_ffn module can be written in.
LAYOUTS: dict[type, tuple[str, ...]] = {
    MoE: ("v5", "mixtral_v4", "qwen_moe_v4"),
    GatedFFN: ("llama_mlp",),
    FeedForward: ("gpt2_mlp",),
}


@dataclass(frozen=True)
class _Piece:
    hf_key: str  # key in the transformers layout, relative to the FFN block
    ours: str  # key in the moe_ffn module's state_dict
    view: Callable[[Tensor], Tensor]  # the part of our tensor that holds the transformers tensor


def _whole(t: Tensor) -> Tensor:
    return t


def _gated_pieces(prefix_ours: str, F: int, hf: tuple[str, str, str], e: int, bias: bool) -> list[_Piece]:
    """One gated FFN (expert e of a bank): gate = rows [:F] of gate_up, up = rows [F:]."""
    gate, up, down = hf
    pieces = [
        _Piece(f"{gate}.weight", f"{prefix_ours}gate_up_proj", lambda t: t[e, :F]),
        _Piece(f"{up}.weight", f"{prefix_ours}gate_up_proj", lambda t: t[e, F:]),
        _Piece(f"{down}.weight", f"{prefix_ours}down_proj", lambda t: t[e]),
    ]
    if bias:
        pieces += [
            _Piece(f"{gate}.bias", f"{prefix_ours}gate_up_bias", lambda t: t[e, :F]),
            _Piece(f"{up}.bias", f"{prefix_ours}gate_up_bias", lambda t: t[e, F:]),
            _Piece(f"{down}.bias", f"{prefix_ours}down_bias", lambda t: t[e]),
        ]
    return pieces


def _moe_pieces(moe: MoE, layout: str) -> list[_Piece]:
    cfg = moe.config
    E, F = cfg.num_experts, cfg.hidden_dim
    pieces = [_Piece("gate.weight", "router.weight", _whole)]
    if layout == "v5":
        pieces += [
            _Piece("experts.gate_up_proj", "experts.gate_up_proj", _whole),
            _Piece("experts.down_proj", "experts.down_proj", _whole),
        ]
    else:
        names = ("w1", "w3", "w2") if layout == "mixtral_v4" else ("gate_proj", "up_proj", "down_proj")
        for e in range(E):
            pieces += _gated_pieces("experts.", F, tuple(f"experts.{e}.{n}" for n in names), e, False)
    if moe.shared_experts is not None:
        if layout == "mixtral_v4":
            raise ValueError(
                "layout 'mixtral_v4' has no shared experts; this MoE has "
                f"num_shared_experts={cfg.num_shared_experts}; use 'qwen_moe_v4' or 'v5'"
            )
        if moe.shared_expert_gate is None:
            raise ValueError(
                "transformers' shared expert (Qwen2-MoE) always has a sigmoid gate; this MoE has shared "
                "experts without one (set shared_expert_gate=True)"
            )
        shared = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
        pieces += _gated_pieces("shared_experts.", cfg.shared_width, shared, 0, False)
        pieces.append(_Piece("shared_expert_gate.weight", "shared_expert_gate.weight", _whole))
    return pieces


def _pieces(module: nn.Module, layout: str) -> list[_Piece]:
    """The table for (module, layout); every tensor of the module's state_dict must be covered."""
    kind = next((cls for cls in LAYOUTS if isinstance(module, cls)), None)
    if kind is None:
        raise TypeError(
            f"no transformers layout for {type(module).__name__}; supported modules: "
            f"{[c.__name__ for c in LAYOUTS]}"
        )
    if layout not in LAYOUTS[kind]:
        raise ValueError(
            f"layout {layout!r} does not fit a {type(module).__name__}; expected one of {list(LAYOUTS[kind])}"
        )
    if isinstance(module, MoE):
        pieces = _moe_pieces(module, layout)
    elif isinstance(module, GatedFFN):
        bias = module.gate_up_bias is not None
        pieces = _gated_pieces("", module.hidden_dim, ("gate_proj", "up_proj", "down_proj"), 0, bias)
    else:  # FeedForward in GPT-2's Conv1D layout: weights stored [in, out], i.e. transposed
        if module.up_bias is None:
            raise ValueError("GPT-2's Conv1D layers always have biases; this FeedForward has bias=False")
        pieces = [
            _Piece("c_fc.weight", "up_proj", lambda t: t[0].T),
            _Piece("c_fc.bias", "up_bias", lambda t: t[0]),
            _Piece("c_proj.weight", "down_proj", lambda t: t[0].T),
            _Piece("c_proj.bias", "down_bias", lambda t: t[0]),
        ]
    covered = {p.ours for p in pieces}
    uncovered = sorted(set(module.state_dict()) - covered)
    if uncovered:
        raise ValueError(
            f"layout {layout!r} has no place for {uncovered} of this {type(module).__name__} "
            "(transformers' modules have no expert biases or selection bias)"
        )
    return pieces


def hf_keys(module: nn.Module, layout: Layout) -> dict[str, tuple[int, ...]]:
    """The transformers keys (relative to the FFN block) and shapes `module` maps to in `layout`."""
    ours = module.state_dict()
    return {p.hf_key: tuple(p.view(ours[p.ours]).shape) for p in _pieces(module, layout)}


def to_hf_state_dict(module: nn.Module, layout: Layout, prefix: str = "") -> dict[str, Tensor]:
    """Export `module`'s weights in a transformers layout.

    Args:
        module: a `MoE`, `GatedFFN` (or SwiGLU/GeGLU...) or `FeedForward`.
        layout: see the module docstring; `LAYOUTS` lists which fit which module.
        prefix: put in front of every key, e.g. "model.layers.3.block_sparse_moe.".
    Returns: {key: tensor}, each a contiguous copy (safe to save with safetensors).
    """
    ours = module.state_dict()
    return {
        prefix + p.hf_key: p.view(ours[p.ours]).detach().clone(memory_format=torch.contiguous_format)
        for p in _pieces(module, layout)
    }


def load_hf_state_dict(module: nn.Module, state_dict: Mapping[str, Tensor], layout: Layout, prefix: str = "") -> None:
    """Copy a transformers-layout state dict into `module`, strictly and all-or-nothing.

    Every expected key must be present and no other key may be: with a `prefix`, only keys that
    start with it are considered (so a whole model's state dict can be passed); without one,
    all are. Shapes must match exactly. Everything is checked before the first tensor is
    copied, so a failed load leaves `module` untouched. Values are cast to the module's dtype
    and device.

    Raises:
        KeyError: missing or unexpected keys (all listed).
        ValueError: shape mismatches (each with the checkpoint's and the expected shape).
    """
    pieces = _pieces(module, layout)
    given = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    expected = {p.hf_key for p in pieces}
    missing, unexpected = sorted(expected - set(given)), sorted(set(given) - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys {[prefix + k for k in missing]}")
        if unexpected:
            parts.append(f"unexpected keys {[prefix + k for k in unexpected]}")
        raise KeyError(f"cannot load layout {layout!r} into {type(module).__name__}: " + "; ".join(parts))

    targets = module.state_dict(keep_vars=True)
    bad = []
    for p in pieces:
        want = tuple(p.view(targets[p.ours]).shape)
        tensor = given[p.hf_key]
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            what = tensor.dtype if isinstance(tensor, Tensor) else type(tensor).__name__
            bad.append(f"{prefix + p.hf_key}: expected a floating-point tensor, got {what}")
        elif tuple(tensor.shape) != want:
            bad.append(f"{prefix + p.hf_key}: checkpoint has shape {tuple(tensor.shape)}, "
                       f"{type(module).__name__} expects {want}")
    if bad:
        raise ValueError(f"cannot load layout {layout!r} into {type(module).__name__}:\n  " + "\n  ".join(bad))

    with torch.no_grad():
        for p in pieces:
            p.view(targets[p.ours]).copy_(given[p.hf_key])
