"""Dense FFN blocks: the expert bank with one expert and no router.

Each block is an `_ExpertBank` subclass with E = 1, so it holds the same tensors
(`gate_up_proj` [1, 2F, D], `down_proj` [1, D, F], ...) and runs the same compute code as
the MoE experts; `MoE(num_experts=1, top_k=1)` with these weights is the same function.
One dropout sits on the block's output; there is none inside.
"""

from __future__ import annotations

from torch import Tensor, nn

from moe_ffn._checks import check_features
from moe_ffn.experts import GatedExperts, MLPExperts
from moe_ffn.sizes import llama_intermediate_size

__all__ = ["FeedForward", "GatedFFN", "SwiGLU", "GeGLU", "ReGLU", "GLU", "Bilinear"]


class _DenseForward:
    """The forward every dense block shares: all tokens to the one expert, then dropout."""

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., D] → [..., D]."""
        check_features(x, self.dim, type(self).__name__)
        y_TD = super().forward(x.reshape(-1, self.dim))
        return self.dropout(y_TD.reshape(x.shape))


class FeedForward(_DenseForward, MLPExperts):
    """Classic FFN: act(x·W1ᵀ + b1)·W2ᵀ + b2, then dropout.

    Args:
        dim: model width D.
        hidden_dim: F, default 4·D.
        activation: "relu", "gelu" (exact erf), "gelu_tanh" (aliases "gelu_new",
            "gelu_pytorch_tanh"), or "silu".
        bias: biases on both projections (the GPT default).
        dropout: probability of the one dropout on the output.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int | None = None,
        activation: str = "gelu",
        bias: bool = True,
        dropout: float = 0.0,
        *,
        device=None,
        dtype=None,
    ) -> None:
        if hidden_dim is None and isinstance(dim, int):
            hidden_dim = 4 * dim
        super().__init__(1, dim, hidden_dim, activation, bias, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout)


class GatedFFN(_DenseForward, GatedExperts):
    """Gated FFN: (act(x·W_gateᵀ) ⊙ x·W_upᵀ)·W_downᵀ, then dropout.

    The activation is on the gate branch only. `SwiGLU`, `GeGLU`, `ReGLU`, `GLU` and
    `Bilinear` fix it; use this class with `activation=` for any other.

    Args:
        dim: model width D.
        hidden_dim: F, default `llama_intermediate_size(dim)` (⌊8D/3⌋ rounded up to 256).
        bias: biases on the three projections (off, as in T5, LLaMA and the GLU paper).
        dropout: probability of the one dropout on the output.
        activation: gate activation name (keyword only).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int | None = None,
        bias: bool = False,
        dropout: float = 0.0,
        *,
        activation: str = "silu",
        device=None,
        dtype=None,
    ) -> None:
        if hidden_dim is None and isinstance(dim, int) and dim > 0:
            hidden_dim = llama_intermediate_size(dim)
        super().__init__(1, dim, hidden_dim, activation, bias, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout)


class SwiGLU(GatedFFN):
    """Gated FFN with a SiLU (Swish) gate: LLaMA, Mistral, the Mixtral experts."""

    def __init__(self, dim, hidden_dim=None, bias=False, dropout=0.0, *, device=None, dtype=None):
        super().__init__(dim, hidden_dim, bias, dropout, activation="silu", device=device, dtype=dtype)


class GeGLU(GatedFFN):
    """Gated FFN with a tanh-approximate GELU gate, as Gemma."""

    def __init__(self, dim, hidden_dim=None, bias=False, dropout=0.0, *, device=None, dtype=None):
        super().__init__(dim, hidden_dim, bias, dropout, activation="gelu_tanh", device=device, dtype=dtype)


class ReGLU(GatedFFN):
    """Gated FFN with a ReLU gate."""

    def __init__(self, dim, hidden_dim=None, bias=False, dropout=0.0, *, device=None, dtype=None):
        super().__init__(dim, hidden_dim, bias, dropout, activation="relu", device=device, dtype=dtype)


class GLU(GatedFFN):
    """Gated FFN with a sigmoid gate (Dauphin et al.'s GLU)."""

    def __init__(self, dim, hidden_dim=None, bias=False, dropout=0.0, *, device=None, dtype=None):
        super().__init__(dim, hidden_dim, bias, dropout, activation="sigmoid", device=device, dtype=dtype)


class Bilinear(GatedFFN):
    """Gated FFN with no activation: the bilinear layer."""

    def __init__(self, dim, hidden_dim=None, bias=False, dropout=0.0, *, device=None, dtype=None):
        super().__init__(dim, hidden_dim, bias, dropout, activation="identity", device=device, dtype=dtype)
