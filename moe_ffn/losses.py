"""Auxiliary router losses. Pure functions of the router's outputs: no global state.

Legend: T tokens, E experts, K top-k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_ffn.config import AuxLossNormalization

__all__ = ["load_balancing_loss", "router_z_loss", "tokens_per_expert"]


def _token_weights(n_tokens: int, mask_T: Tensor | None, like: Tensor) -> Tensor:
    if mask_T is None:
        return like.new_ones(n_tokens)
    return mask_T.to(like.dtype)


def tokens_per_expert(expert_ids_TK: Tensor, num_experts: int, mask_T: Tensor | None = None) -> Tensor:
    """[E] int64: how many of the (unmasked) tokens' K assignments each expert received."""
    ids_N = expert_ids_TK.reshape(-1)
    ones_N = torch.ones_like(ids_N)
    if mask_T is not None:
        ones_N = mask_T.to(torch.int64).repeat_interleave(expert_ids_TK.shape[1])
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_N.device)
    return counts_E.scatter_add_(0, ids_N, ones_N)


def load_balancing_loss(
    probs_TE: Tensor,
    expert_ids_TK: Tensor,
    mask_T: Tensor | None = None,
    normalization: AuxLossNormalization = "per_layer",
) -> Tensor:
    """Switch-Transformer balance loss E·Σ_e f_e·P_e.

    P_e is the mean router probability of expert e, f_e the share of the top-k assignments
    it received. "per_layer" divides f by k (f sums to 1, perfectly uniform routing → 1.0;
    Megatron, MegaBlocks); "transformers" does not (f sums to k, uniform → k; what
    transformers' `load_balancing_loss_func` computes on logits pooled over layers, which
    `pooled_load_balancing_loss` in moe.py reproduces). Masked-out (padding) tokens count
    in neither f nor P. Differentiable through P only (the counts are not).

    Args:
        probs_TE: [T, E] router probabilities.
        expert_ids_TK: [T, K] chosen experts.
        mask_T: optional [T] bool, True for real tokens.
    """
    T, E = probs_TE.shape
    K = expert_ids_TK.shape[1]
    m_T = _token_weights(T, mask_T, probs_TE)
    n_tokens = m_T.sum().clamp(min=1)
    counts_E = tokens_per_expert(expert_ids_TK, E, mask_T).to(probs_TE.dtype)
    f_E = counts_E / n_tokens
    if normalization == "per_layer":
        f_E = f_E / K
    P_E = (probs_TE * m_T.unsqueeze(1)).sum(0) / n_tokens
    return E * (f_E * P_E).sum()


def router_z_loss(logits_TE: Tensor, mask_T: Tensor | None = None) -> Tensor:
    """ST-MoE z-loss: mean over tokens of logsumexp(logits)², keeping logits small."""
    m_T = _token_weights(logits_TE.shape[0], mask_T, logits_TE)
    z_T = torch.logsumexp(logits_TE, dim=-1)
    return (z_T.square() * m_T).sum() / m_T.sum().clamp(min=1)
