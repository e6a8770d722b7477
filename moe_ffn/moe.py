"""The Mixture-of-Experts layer: router → permute → experts → unpermute → dropout.

Legend: T tokens, D model dim, E experts, K top-k, N = T·K assignments.

Each stage lives in its own module and data flows one way:
router.py (which experts, what weights) → dispatch.py (rows into expert order) →
experts.py (grouped matmuls over the batched weights) → dispatch.py (back, weighted sum).
The layer keeps the routing of its last forward in `self.stats` (no global lists).
A step of a few tokens on CPU runs those stages in one call of the library instead
(`_decode.py`: the same stages in C++, with autograd one node), where the layer's parts are
the ones it computes.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module_hooks
from torch.profiler import record_function

from moe_ffn import _decode, dispatch
from moe_ffn._checks import check_features
from moe_ffn.config import AuxLossNormalization, MoEConfig
from moe_ffn.dense import GatedFFN
from moe_ffn.experts import GatedExperts
from moe_ffn.losses import load_balancing_loss, router_z_loss, tokens_per_expert
from moe_ffn.router import RouterOutput, TopKRouter

__all__ = ["MoE", "MoEStats", "collect_aux_loss", "pooled_load_balancing_loss", "update_expert_biases"]


def _region(name: str):
    """A profiler label for a stage; nothing while no profiler runs (a label costs ~15 µs here,
    a tenth of a decode step's overhead). Under torch.compile the label is always traced."""
    if torch.compiler.is_compiling() or torch.autograd.profiler._is_profiler_enabled:
        return record_function(name)
    return nullcontext()


@dataclass(frozen=True)
class MoEStats:
    """What one forward of a MoE layer routed, and its auxiliary losses.

    Per-token fields cover every token; counts and losses leave masked (padding) tokens out.
    The counts and losses are computed on first access, from the tensors kept here: a forward
    whose stats nobody reads (inference, decode) does not pay for them. Reading them later
    gives the same tensors, with the same autograd graph to the router, as computing them in
    the forward would.
    """

    router_logits_TE: Tensor  # router precision (float32, or float64)
    router_probs_TE: Tensor  # the distribution the balance loss averages
    expert_ids_TK: Tensor  # chosen experts
    weights_TK: Tensor  # combine weights
    mask_T: Tensor | None  # True for real tokens; None: all tokens are real
    num_dropped: Tensor  # assignments dropped by the capacity limit (0-dim int64)
    num_experts: int  # E
    aux_loss_normalization: AuxLossNormalization  # how balance_loss normalises f
    aux_loss_coef: float  # weight of balance_loss in aux_loss
    z_loss_coef: float  # weight of z_loss in aux_loss

    @cached_property
    def tokens_per_expert_E(self) -> Tensor:
        """[E] int64: routed assignments per expert (before capacity drops)."""
        return tokens_per_expert(self.expert_ids_TK, self.num_experts, self.mask_T)

    @cached_property
    def balance_loss(self) -> Tensor:
        """Load-balancing loss, normalised as configured."""
        return load_balancing_loss(self.router_probs_TE, self.expert_ids_TK, self.mask_T, self.aux_loss_normalization)

    @cached_property
    def z_loss(self) -> Tensor:
        """Router z-loss."""
        return router_z_loss(self.router_logits_TE, self.mask_T)

    @cached_property
    def aux_loss(self) -> Tensor:
        """aux_loss_coef·balance_loss + z_loss_coef·z_loss."""
        return self.aux_loss_coef * self.balance_loss + self.z_loss_coef * self.z_loss


class MoE(nn.Module):
    """Sparse Mixture-of-Experts FFN with top-k routing over a bank of gated experts.

    Build it with keyword fields of `MoEConfig`, or from a config:
        MoE(dim=4096, hidden_dim=14336, num_experts=8, top_k=2)   # Mixtral's FFN
        MoE(config, device="meta")

    Attributes:
        router.weight: [E, D]
        experts.gate_up_proj: [E, 2F, D], rows [:F] gate, [F:] up
        experts.down_proj: [E, D, F]
        shared_experts: a GatedFFN applied to every token (if num_shared_experts > 0)
        stats: MoEStats of the last forward (None before the first)
    """

    def __init__(self, config: MoEConfig | None = None, *, device=None, dtype=None, **fields) -> None:
        super().__init__()
        if config is None:
            config = MoEConfig(**fields)
        elif not isinstance(config, MoEConfig):
            raise TypeError(
                f"MoE expects a MoEConfig or keyword fields (MoE(dim=..., ...)), got {type(config).__name__}"
            )
        elif fields:
            raise TypeError(f"pass either a MoEConfig or keyword fields, not both (got {sorted(fields)})")
        self.config = cfg = config
        kw = {"device": device, "dtype": dtype}
        self.router = TopKRouter(
            cfg.dim,
            cfg.num_experts,
            cfg.top_k,
            cfg.routing,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
            expert_bias=cfg.expert_bias_update_rate is not None,
            **kw,
        )
        self.experts = GatedExperts(cfg.num_experts, cfg.dim, cfg.hidden_dim, cfg.activation, cfg.bias, **kw)
        self.shared_experts = None
        self.shared_expert_gate = None
        if cfg.num_shared_experts:
            self.shared_experts = GatedFFN(cfg.dim, cfg.shared_width, cfg.bias, activation=cfg.activation, **kw)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(cfg.dim, 1, bias=False, **kw)
        if cfg.expert_bias_update_rate is not None:
            # Assignments per expert since the last `update_expert_bias()`; not saved.
            self.register_buffer(
                "expert_load", torch.zeros(cfg.num_experts, dtype=torch.int64, device=device), persistent=False
            )
        self.dropout = nn.Dropout(cfg.dropout)
        self.stats: MoEStats | None = None

    def reset_parameters(self) -> None:
        """Router, experts and shared experts as nn.Linear initialises (see each module)."""
        self.router.reset_parameters()
        self.experts.reset_parameters()
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.reset_parameters()

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Args:
            x: [..., D] floating point.
            attention_mask: optional [...] (x.shape[:-1]); 1/True marks real tokens. Padding
                tokens are still computed but leave the balance loss, z-loss and counts.
        Returns: [..., D] in x's dtype.
        """
        cfg = self.config
        check_features(x, cfg.dim, "MoE")
        x_TD = x.reshape(-1, cfg.dim)
        mask_T = self._flat_mask(attention_mask, x.shape[:-1])

        x_router_TD = x_TD
        if self.training and cfg.jitter_noise > 0:
            noise_TD = torch.empty_like(x_TD).uniform_(1.0 - cfg.jitter_noise, 1.0 + cfg.jitter_noise)
            x_router_TD = x_TD * noise_TD
            if cfg.jitter_scope == "router_and_experts":
                x_TD = x_router_TD

        route = out_TD = None
        if (
            not torch.compiler.is_compiling()  # (first: no guard on the token count in a traced graph)
            and x_TD.shape[0] <= _decode.MAX_TOKENS and x_router_TD is x_TD and self._decodes_in_one_call()
        ):
            # a few tokens (and no jitter): the whole step in one call of the library, with
            # autograd one node (_decode.py: out_TD None where it does not run, route too unless
            # the routing ran); dropout and the load count below apply to it as to the ops'
            with _region("decode_step"):
                out_TD, route = _decode.step(self.router, self.experts, x_TD)
        if out_TD is None:
            out_TD, num_dropped, route = self._routed(x_TD, x_router_TD, route)
        else:
            num_dropped = torch.zeros((), dtype=torch.int64)

        if self.shared_experts is not None:
            with _region("shared_experts"):
                shared_TD = self.shared_experts(x_TD)
                if self.shared_expert_gate is not None:
                    shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
                out_TD = out_TD + shared_TD

        self.stats = self._stats(route, num_dropped, mask_T)
        if self.training and cfg.expert_bias_update_rate is not None:
            self.expert_load += self.stats.tokens_per_expert_E
        if self.training and self.dropout.p > 0:  # (an identity dropout call costs ~50 µs at decode)
            out_TD = self.dropout(out_TD)
        return out_TD.reshape(x.shape)

    def _flat_mask(self, attention_mask: Tensor | None, token_shape: torch.Size) -> Tensor | None:
        if attention_mask is None:
            return None
        if tuple(attention_mask.shape) != tuple(token_shape):
            raise ValueError(
                f"attention_mask must have shape {tuple(token_shape)} (the input's shape without "
                f"its last dim), got {tuple(attention_mask.shape)}"
            )
        return attention_mask.reshape(-1).to(torch.bool)

    def _routed(
        self, x_TD: Tensor, x_router_TD: Tensor, route: RouterOutput | None
    ) -> tuple[Tensor, Tensor, RouterOutput]:
        """(out_TD, the assignments dropped, route): router (unless `route` is given) → plan →
        experts, in the layer's ops. The named regions are what `moe-ffn profile` reports time
        shares for."""
        cfg = self.config
        if route is None:
            with _region("router"):
                route = self.router(x_router_TD)
        fused = self.experts.can_fuse_dispatch(x_TD)
        with _region("permute"):
            capacity = None
            if cfg.capacity_factor is not None:
                capacity = dispatch.expert_capacity(cfg.capacity_factor, x_TD.shape[0], cfg.top_k, cfg.num_experts)
            plan = dispatch.plan(
                route.expert_ids_TK, route.weights_TK, cfg.num_experts, capacity, cfg.drop_policy, inverse=not fused
            )
            if not fused:
                x_ND = dispatch.permute(x_TD, plan)
        if fused:
            # CPU: gather, experts and weighted sum in one op, group by group (grouped.routed_ffn):
            # no [N, D] rows of permute/unpermute are kept for backward, row copies live one
            # group of experts at a time. "permute" is then the plan alone.
            with _region("experts"):
                weight_N = route.weights_TK.reshape(-1).index_select(0, plan.order_N)
                out_TD = self.experts.routed(x_TD, plan, weight_N)
        else:
            with _region("experts"):
                y_ND = self.experts(x_ND, plan.tokens_per_expert_E)
            with _region("unpermute"):
                out_TD = dispatch.unpermute(y_ND, plan, route.weights_TK, x_TD.dtype)
        return out_TD, plan.num_dropped, route

    def _decodes_in_one_call(self) -> bool:
        """Whether this layer's parts are those `_decode.step` computes: its own router, with no
        hooks on it (the profiler's routing overrides are forward hooks) and its own forward,
        gated SiLU experts without biases whose dispatch may be fused (not a bank that moves
        rows itself, as expert parallelism's), no capacity limit."""
        router, experts = self.router, self.experts
        return (
            self.config.capacity_factor is None and type(router) is TopKRouter and isinstance(experts, GatedExperts)
            and experts.fuses_dispatch and experts.gate_up_bias is None and experts.activation == "silu"
            and not (router._forward_hooks or router._forward_pre_hooks or "forward" in router.__dict__)
            and not (_module_hooks._global_forward_hooks or _module_hooks._global_forward_pre_hooks)
        )

    def _stats(self, route, num_dropped: Tensor, mask_T: Tensor | None) -> MoEStats:
        cfg = self.config
        return MoEStats(
            router_logits_TE=route.logits_TE,
            router_probs_TE=route.probs_TE,
            expert_ids_TK=route.expert_ids_TK,
            weights_TK=route.weights_TK,
            mask_T=mask_T,
            num_dropped=num_dropped,
            num_experts=cfg.num_experts,
            aux_loss_normalization=cfg.aux_loss_normalization,
            aux_loss_coef=cfg.aux_loss_coef,
            z_loss_coef=cfg.z_loss_coef,
        )

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing step (DeepSeek-V3); call after each optimizer step.

        Rule: b_e ← b_e + u·sign(mean_load − load_e), with load_e the assignments expert e
        received in training forwards since the last call and u = expert_bias_update_rate.
        Over-loaded experts become less likely to be selected, under-loaded ones more; the
        bias never enters the combine weights. The load counter is reset.
        """
        rate = self.config.expert_bias_update_rate
        if rate is None:
            raise RuntimeError("update_expert_bias needs MoEConfig.expert_bias_update_rate to be set")
        load_E = self.expert_load.to(torch.float32)
        self.router.expert_bias += rate * torch.sign(load_E.mean() - load_E)
        self.expert_load.zero_()

    def extra_repr(self) -> str:
        cfg = self.config
        parts = [f"dim={cfg.dim}, hidden_dim={cfg.hidden_dim}, num_experts={cfg.num_experts}, top_k={cfg.top_k}"]
        if cfg.capacity_factor is not None:
            parts.append(f"capacity_factor={cfg.capacity_factor}")
        return ", ".join(parts)


def _moe_layers(model_or_layers: nn.Module | Iterable[MoE]) -> list[MoE]:
    if isinstance(model_or_layers, nn.Module):
        return [m for m in model_or_layers.modules() if isinstance(m, MoE)]
    return list(model_or_layers)


def collect_aux_loss(model: nn.Module | Iterable[MoE]) -> Tensor:
    """Sum of `stats.aux_loss` over every MoE layer of `model` that has run a forward.

    Add it to the task loss: `loss = task_loss + collect_aux_loss(model)`.
    """
    losses = [m.stats.aux_loss for m in _moe_layers(model) if m.stats is not None]
    if not losses:
        return torch.zeros(())
    return torch.stack([l.to(losses[0].dtype) for l in losses]).sum()


def pooled_load_balancing_loss(model: nn.Module | Iterable[MoE]) -> Tensor:
    """transformers' convention: one balance loss over the tokens of all layers pooled.

    E·Σ_e f_e·P_e with f (summing to k) and P averaged over every layer's tokens together,
    masks included — what `load_balancing_loss_func` returns for the same router logits,
    before `router_aux_loss_coef`. All layers must have the same E and k.
    """
    stats = [m.stats for m in _moe_layers(model) if m.stats is not None]
    if not stats:
        raise ValueError("no MoE layer has run a forward yet")
    probs = torch.cat([s.router_probs_TE for s in stats])
    ids = torch.cat([s.expert_ids_TK for s in stats])
    masks = [s.mask_T for s in stats]
    mask = None
    if any(m is not None for m in masks):
        mask = torch.cat([m if m is not None else torch.ones(s.expert_ids_TK.shape[0], dtype=torch.bool, device=ids.device) for m, s in zip(masks, stats)])
    return load_balancing_loss(probs, ids, mask, "transformers")


def update_expert_biases(model: nn.Module) -> None:
    """`update_expert_bias()` on every MoE layer of `model` that has balancing on."""
    for m in _moe_layers(model):
        if m.config.expert_bias_update_rate is not None:
            m.update_expert_bias()
