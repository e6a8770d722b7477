"""Input validation shared by every block: clear errors instead of silent wrong answers."""

from __future__ import annotations

import torch
from torch import Tensor


def positive_int(name: str, value: object, who: str = "") -> int:
    """`value` if it is an int >= 1 (bools are not), else ValueError naming `who`.`name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        prefix = f"{who}: " if who else ""
        raise ValueError(f"{prefix}{name} must be a positive int, got {value!r}")
    return value


def check_features(x: Tensor, dim: int, who: str) -> None:
    """x must be a floating tensor whose last dimension is `dim`."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{who} expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{who} expects a floating-point input, got dtype {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != dim:
        raise ValueError(
            f"{who} expects input of shape [..., {dim}], got {tuple(x.shape)}"
        )
