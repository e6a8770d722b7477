"""Hidden-size rules of the gated FFN."""

from __future__ import annotations

from moe_ffn._checks import positive_int

__all__ = ["llama_intermediate_size"]


def llama_intermediate_size(
    dim: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None
) -> int:
    """LLaMA's hidden width for a gated FFN of model width `dim`.

    ⌊8·dim/3⌋ keeps the three-matrix block at the parameter count of a classic 4·dim block;
    an optional `ffn_dim_multiplier` scales it (truncated, as LLaMA 2 70B does); the result is
    rounded **up** to a multiple of `multiple_of` for efficient matmuls.
    4096 → 11008, 5120 → 13824, (8192, multiple_of=4096, ffn_dim_multiplier=1.3) → 28672.
    """
    positive_int("dim", dim)
    positive_int("multiple_of", multiple_of)
    hidden = (8 * dim) // 3
    if ffn_dim_multiplier is not None:
        if not ffn_dim_multiplier > 0:
            raise ValueError(f"ffn_dim_multiplier must be > 0, got {ffn_dim_multiplier!r}")
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * -(-hidden // multiple_of)
