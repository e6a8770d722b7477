"""Stage 1: the top-k router. Logits → scores → the k experts and their weights per token.

Legend: T tokens, D model dim, E experts, K top-k.

NOTE: the router runs in at least float32 whatever the input dtype: logits, softmax/sigmoid
and the combine weights. A bf16 router picks different experts than the full-precision one
on near-ties and is a known source of loss spikes; float64 inputs stay float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_ffn import _memory
from moe_ffn.config import Routing

__all__ = ["TopKRouter", "RouterOutput", "router_dtype"]


def router_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype routing math runs in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class RouterOutput:
    logits_TE: Tensor  # x·Wᵀ in router precision
    probs_TE: Tensor  # the full distribution the balance loss uses (softmax, or sigmoid normalised)
    expert_ids_TK: Tensor  # chosen experts, int64
    weights_TK: Tensor  # their combine weights, router precision


class TopKRouter(nn.Module):
    """Linear router with top-k selection.

    Args:
        dim, num_experts, top_k: D, E, K.
        routing: "softmax_topk", "topk_softmax" or "sigmoid_topk" (see config.Routing).
        norm_topk_prob: renormalise the k weights to sum 1 (softmax_topk, sigmoid_topk).
        routed_scaling_factor: multiplies the final weights.
        expert_bias: keep a per-expert selection bias (aux-loss-free balancing). It is added
            to the scores for choosing experts only, never to the combine weights.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        routing: Routing = "softmax_topk",
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        expert_bias: bool = False,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.routing = routing
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, dim, device=device, dtype=dtype))
        if expert_bias:
            # float32 always: updates of size ~1e-3 must not vanish in bf16.
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As nn.Linear: U(−1/√D, 1/√D). The selection bias starts at zero."""
        bound = 1.0 / math.sqrt(self.dim)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.expert_bias is not None:
            nn.init.zeros_(self.expert_bias)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"routing={self.routing!r}, norm_topk_prob={self.norm_topk_prob}"
        )

    def forward(self, x_TD: Tensor) -> RouterOutput:
        """x_TD: [T, D] → the routing of every token (logits, probabilities, top-k, weights)."""
        dtype = router_dtype(x_TD.dtype)
        x_r = self._in_router_dtype(x_TD, dtype)
        if torch.is_autocast_enabled(x_TD.device.type):
            with torch.autocast(x_TD.device.type, enabled=False):
                logits_TE = F.linear(x_r, self.weight.to(dtype))
        else:  # (entering an autocast context costs more than the whole router at decode)
            logits_TE = F.linear(x_r, self.weight.to(dtype))
        return self.route(logits_TE)

    def _in_router_dtype(self, x_TD: Tensor, dtype: torch.dtype) -> Tensor:
        """x in the router's dtype (exact: a widening). Without autograd the copy is a temporary
        of this call and goes on scratch memory (reused from call to call): a fresh float32 copy
        of a bf16 step faulted its pages in every call, 19.9 → 6.5 ms for Mixtral's router at
        T = 8192 (inference, the 2-core EPYC of family 26), 26.7 → 14.4 ms for 64 experts. With
        autograd the copy is saved for the weight's gradient and stays a fresh tensor (on scratch
        memory the step ran 38 → 68 ms there)."""
        if x_TD.dtype == dtype or (torch.is_grad_enabled() and (x_TD.requires_grad or self.weight.requires_grad)):
            return x_TD.to(dtype)
        return _memory.scratch(x_TD, *x_TD.shape, dtype=dtype).copy_(x_TD)

    def route(self, logits_TE: Tensor) -> RouterOutput:
        """The selection rule alone: given logits [T, E] → top-k experts and their weights.

        Public so that tools which perturb the logits (the profiler's --skew) reuse this rule
        instead of copying it.
        """
        K = self.top_k
        bias_E = None if self.expert_bias is None else self.expert_bias.to(logits_TE.dtype)

        if self.routing == "topk_softmax":
            select_TE = logits_TE if bias_E is None else logits_TE + bias_E
            expert_ids_TK = select_TE.topk(K, dim=-1).indices
            weights_TK = logits_TE.gather(-1, expert_ids_TK).softmax(dim=-1)
            probs_TE = logits_TE.softmax(dim=-1)
        else:
            if self.routing == "softmax_topk":
                probs_TE = logits_TE.softmax(dim=-1)
                scores_TE = probs_TE
            else:  # sigmoid_topk
                scores_TE = logits_TE.sigmoid()
                probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
            if bias_E is None:  # the selected scores are the weights: topk returns them
                weights_TK, expert_ids_TK = scores_TE.topk(K, dim=-1)
            else:
                expert_ids_TK = (scores_TE + bias_E).topk(K, dim=-1).indices
                weights_TK = scores_TE.gather(-1, expert_ids_TK)
            if self.norm_topk_prob:
                weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights_TK = weights_TK * self.routed_scaling_factor
        return RouterOutput(logits_TE, probs_TE, expert_ids_TK, weights_TK)
