"""Elementwise activations by name, shared by the classic and gated blocks.

Names follow the papers; the transformers spellings are accepted as aliases because
people import checkpoints whose configs say `hidden_act="gelu_new"` (GPT-2) or
`"gelu_pytorch_tanh"` (Gemma). Both mean the tanh approximation of GELU.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ACTIVATIONS", "ALIASES", "canonical_activation", "get_activation"]


def _gelu_tanh(x: Tensor) -> Tensor:
    # 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), max error 4.7e-4 against the erf form.
    return F.gelu(x, approximate="tanh")


def _identity(x: Tensor) -> Tensor:
    return x


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact: x·Φ(x), through erf
    "gelu_tanh": _gelu_tanh,
    "silu": F.silu,  # x·σ(x), also called Swish
    "sigmoid": torch.sigmoid,  # the gate of the original GLU
    "identity": _identity,  # the bilinear layer: no activation
}

ALIASES: dict[str, str] = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "swish": "silu",
    "linear": "identity",
}


def canonical_activation(name: str, allowed: tuple[str, ...] | None = None) -> str:
    """The canonical name for `name` (aliases resolved), or ValueError listing the valid names."""
    canonical = ALIASES.get(name, name)
    valid = tuple(ACTIVATIONS) if allowed is None else allowed
    if canonical not in valid:
        aliases = sorted(a for a, c in ALIASES.items() if c in valid)
        raise ValueError(
            f"unknown activation {name!r}; expected one of {sorted(valid)} "
            f"(aliases: {aliases})"
        )
    return canonical


def get_activation(name: str) -> Callable[[Tensor], Tensor]:
    return ACTIVATIONS[canonical_activation(name)]
