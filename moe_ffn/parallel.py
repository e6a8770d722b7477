"""Expert parallelism on torch.distributed: each rank keeps a contiguous block of the experts.

Legend: T tokens, D model dim, E experts (all ranks), W ranks in the group, L = E/W experts
on this rank, N = T·K assignment rows (sorted by global expert id), M ≤ N of them kept (not
dropped by a capacity limit), R rows this rank's experts receive from all ranks, C = L + 1
columns of the count exchange.

`expert_parallel(moe, group)` replaces `moe.experts` in place by an `ExpertParallelExperts`:
rank r keeps experts r·L … (r+1)·L − 1 as `gate_up_proj` [L, 2F, D] and `down_proj` [L, D, F]
(the attribute names do not change). The router, the shared experts and everything else stay
replicated. The MoE forward is untouched: it routes and sorts this rank's tokens by global
expert id, then calls the expert stage, which

1. exchanges per-expert row counts with one `all_to_all_single` (each rank learns how many
   rows every rank sends to each of its experts, and the global drop count rides along);
2. sends the rows to the ranks that own their experts (`all_to_all_single`, uneven splits);
3. reorders the received rows from source-rank order to local-expert order and runs the
   local experts as one grouped matmul;
4. sends the results back with the reverse exchange; dropped rows come back as zeros.

Backward runs the two exchanges in reverse. All exchanges are labelled "all_to_all" in the
profiler.

Gradients. Take the loss to be the SUM over ranks of each rank's loss, L = Σ_r L_r. Expert
gradients then need nothing more: the reverse exchange brings every rank's contribution to the
expert's owner, so `experts.*.grad` is ∂L/∂W for the local block. The replicated parameters
see only their own rank's tokens and must be summed over the group: `all_reduce_replicated_grads`
does it without DDP; with DDP, leave the experts out of DDP (`exclude_experts_from_ddp`) and
register `allreduce_sum_hook` (DDP's default hook averages, which would be the gradient of
L/W for those parameters only). Every gradient then equals that of one process holding the
whole layer with loss Σ_r L_r. For a mean over ranks, divide each rank's loss by W.

Capacity. With `capacity_factor` set, drops are decided by each rank on its own tokens, as the
unsharded layer decides them on that rank's batch: capacity = ceil(factor·T_r·K/E) with T_r
the rank's token count. Outputs therefore equal one process running the whole layer on each
rank's batch separately, NOT on all ranks' tokens concatenated (whose capacity counts all
tokens at once). `experts.global_num_dropped` holds the sum of the drops over all ranks after
each forward. `moe.stats` (routing, counts, aux losses) stays per rank: an aux loss added to
each rank's loss is the sum of per-batch aux losses, not the aux loss of the concatenation.
For aux-loss-free balancing, call `all_reduce_expert_load(model)` before `update_expert_biases`.

Rules. Every rank of the group runs every forward and backward of a sharded layer, even with
zero tokens (the exchanges are collectives). Expert parallelism here spans one group; a
replicated copy of the same expert block on another group (EP × DP) would also need its
expert gradients all-reduced across those copies, which this module does not do. The exchanges
sync the host once per forward (split sizes), so the layer does not trace under torch.compile.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.profiler import record_function

from moe_ffn import _memory
from moe_ffn.experts import GatedExperts
from moe_ffn.moe import MoE

__all__ = [
    "ExpertParallelExperts",
    "all_reduce_expert_load",
    "all_reduce_replicated_grads",
    "allreduce_sum_hook",
    "exclude_experts_from_ddp",
    "expert_parallel",
    "expert_parallel_names",
    "gather_full_state_dict",
    "load_full_state_dict",
]

_SHARDED = ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias")


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """all_to_all_single with uneven splits whose backward is the reverse exchange.

    `anchor` is unused by the math: it is a parameter of the expert stage, passed so that the
    exchange is recorded in the autograd graph whenever the experts train, even on a rank whose
    input does not require grad. Backward collectives must run on every rank or on none; without
    the anchor, a rank whose input needs no gradient would skip the reverse exchange and its
    peers would wait forever.
    """

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group, anchor: Tensor) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        with record_function("all_to_all"):
            grad_x = _all_to_all(grad.contiguous(), in_splits, out_splits, ctx.group)
        return grad_x, None, None, None, None


def _source_to_expert_order(counts_WL: Tensor, num_rows: int) -> Tensor:
    """Index that regroups rows from (source rank, local expert) order to (local expert,
    source rank) order: position p of the result takes row index[p] of the received buffer."""
    c_WL = counts_WL
    flat = c_WL.flatten()
    src_start_WL = (flat.cumsum(0) - flat).view_as(c_WL)
    len_LW = c_WL.t().flatten()
    dst_start_LW = len_LW.cumsum(0) - len_LW
    shift_LW = src_start_WL.t().flatten() - dst_start_LW
    arange_R = torch.arange(num_rows, device=c_WL.device)
    return torch.repeat_interleave(shift_LW, len_LW, output_size=num_rows) + arange_R


class ExpertParallelExperts(GatedExperts):
    """This rank's block of a gated expert bank, fed through all-to-all exchanges.

    Same call contract as `GatedExperts.forward`, with the rows sorted by GLOBAL expert id and
    `tokens_per_expert_E` counting all E experts. `num_experts` is the local count L;
    `global_num_experts` is E and `expert_offset` the global id of the first local expert.

    Attributes:
        gate_up_proj: [L, 2F, D]; down_proj: [L, D, F]; biases [L, 2F] / [L, D] if any.
        global_num_dropped: capacity drops summed over all ranks in the last forward (int).
    """

    fuses_dispatch = False  # rows travel to their experts' ranks between permute and unpermute

    def __init__(self, experts: GatedExperts, group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        nn.Module.__init__(self)
        E = experts.num_experts
        L = E // world_size
        self._setup(L, experts.dim, experts.hidden_dim, experts.activation, None)
        self.global_num_experts, self.expert_offset, self.world_size = E, rank * L, world_size
        self.group = group
        self.global_num_dropped: int | None = None
        lo, hi = rank * L, (rank + 1) * L
        for name in _SHARDED:
            full = getattr(experts, name)
            if full is None:
                setattr(self, name, None)
                continue
            # a copy (the full bank is freed once the caller drops the old module), made as the
            # bank makes its own weights (on huge pages where they pay: experts.py)
            part = full.detach()[lo:hi]
            shard = _memory.empty_on_huge_pages(*part.shape, device=part.device, dtype=part.dtype).copy_(part)
            setattr(self, name, nn.Parameter(shard, full.requires_grad))

    def forward(self, x_ND: Tensor, tokens_per_expert_E: Tensor | None = None) -> Tensor:
        """Args:
            x_ND: [N, D] this rank's rows sorted by global expert; rows past
                `tokens_per_expert_E.sum()` were dropped by a capacity limit.
            tokens_per_expert_E: [E] kept rows per global expert.
        Returns: [N, D]; dropped rows are zero.
        """
        W, L, E = self.world_size, self.num_experts, self.global_num_experts
        if tokens_per_expert_E is None or tuple(tokens_per_expert_E.shape) != (E,):
            got = None if tokens_per_expert_E is None else tuple(tokens_per_expert_E.shape)
            raise ValueError(f"expert-parallel experts need tokens_per_expert_E of shape ({E},), got {got}")
        N = x_ND.shape[0]
        counts_WL = tokens_per_expert_E.view(W, L)
        with record_function("all_to_all"):
            # One exchange carries the counts and, in the last column, this rank's drop count
            # (the same to every peer), so every rank also learns the global drop count.
            dropped = N - tokens_per_expert_E.sum()
            send_WC = torch.cat([counts_WL, dropped.view(1, 1).expand(W, 1)], dim=1)
            recv_WC = _all_to_all(send_WC, [1] * W, [1] * W, self.group)
            recv_WL = recv_WC[:, :L]
            # NOTE: the one device→host copy: split sizes must be Python ints.
            sizes = torch.cat([counts_WL.sum(1), recv_WL.sum(1), recv_WC[:, L].sum().view(1)]).tolist()
            send_splits, recv_splits = sizes[:W], sizes[W : 2 * W]
            self.global_num_dropped = sizes[2 * W]
            kept = sum(send_splits)  # M
            x_RD = _Exchange.apply(x_ND[:kept], recv_splits, send_splits, self.group, self.gate_up_proj)
        R = x_RD.shape[0]
        to_expert_R = _source_to_expert_order(recv_WL, R)
        to_source_R = torch.empty_like(to_expert_R)
        to_source_R[to_expert_R] = torch.arange(R, device=to_expert_R.device)
        y_RD = super().forward(x_RD.index_select(0, to_expert_R), recv_WL.sum(0))
        y_RD = y_RD.index_select(0, to_source_R)
        with record_function("all_to_all"):
            y_MD = _Exchange.apply(y_RD, send_splits, recv_splits, self.group, self.gate_up_proj)
        if kept == N:
            return y_MD
        return torch.cat([y_MD, y_MD.new_zeros(N - kept, y_MD.shape[1])])

    def extra_repr(self) -> str:
        lo = self.expert_offset
        return f"experts {lo}..{lo + self.num_experts - 1} of {self.global_num_experts}, " + super().extra_repr()


def _setup_payload(moe: Any) -> dict:
    """What every rank must agree on, or the error this rank hit (sent instead of raising,
    so that no rank is left waiting in a collective)."""
    if not isinstance(moe, MoE):
        return {"error": f"expert_parallel expects a moe_ffn.MoE, got {type(moe).__name__}"}
    if isinstance(moe.experts, ExpertParallelExperts):
        return {"error": "this MoE is already expert-parallel"}
    fields = dataclasses.asdict(moe.config)
    weight = moe.experts.gate_up_proj
    fields["dtype"] = str(weight.dtype)
    fields["device type"] = weight.device.type
    return {"fields": fields}


def expert_parallel(moe: MoE, group: dist.ProcessGroup | None = None) -> MoE:
    """Shard `moe`'s experts over `group` in place and return it.

    Collective: every rank of `group` must call it. Rank r keeps experts r·E/W … (r+1)·E/W − 1
    sliced from its own full bank, so build the layer identically on every rank (same seed, or
    on device="meta" followed by `load_full_state_dict`). Build optimizers afterwards: the
    expert Parameters are new objects.

    Raises:
        ValueError: W does not divide E, or ranks disagree on the config (every rank raises,
            naming the differing fields).
        RuntimeError: torch.distributed is not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("expert_parallel needs torch.distributed initialised (dist.init_process_group)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    payloads: list[dict | None] = [None] * world
    dist.all_gather_object(payloads, _setup_payload(moe), group=group)
    errors = [f"rank {r}: {p['error']}" for r, p in enumerate(payloads) if "error" in p]
    if errors:
        raise ValueError("expert_parallel: " + "; ".join(errors))
    ref = payloads[0]["fields"]
    differing = []
    for name, value in ref.items():
        values = [p["fields"][name] for p in payloads]
        if any(v != value for v in values):
            differing.append(f"{name} (" + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values)) + ")")
    if differing:
        raise ValueError("expert_parallel: ranks were built with different MoE configs; differing fields: " + "; ".join(differing))
    E = moe.config.num_experts
    if E % world:
        raise ValueError(f"expert_parallel: the group's {world} ranks must divide num_experts={E} evenly")
    moe.experts = ExpertParallelExperts(moe.experts, group, rank, world)
    return moe


def _stages(model: nn.Module) -> list[tuple[str, ExpertParallelExperts]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertParallelExperts)]


def _prefixed(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def expert_parallel_names(model: nn.Module) -> list[str]:
    """Fully qualified names of the per-rank tensors of `model`: sharded expert parameters and
    the `expert_load` counters of sharded MoE layers (each rank counts its own tokens)."""
    names = []
    for prefix, stage in _stages(model):
        names += [_prefixed(prefix, n) for n in _SHARDED if getattr(stage, n) is not None]
    for prefix, m in model.named_modules():
        if isinstance(m, MoE) and isinstance(m.experts, ExpertParallelExperts) and hasattr(m, "expert_load"):
            names.append(_prefixed(prefix, "expert_load"))
    return names


def exclude_experts_from_ddp(model: nn.Module) -> nn.Module:
    """Tell DDP (before wrapping `model`) to leave the per-rank tensors alone: averaging one
    rank's expert block with another's would mix different experts."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_parallel_names(model))
    return model


# No annotations: DDP checks a hook's annotations against the real classes, and this module's
# postponed (string) annotations would fail that check.
def allreduce_sum_hook(group, bucket):
    """DDP comm hook that sums gradients instead of averaging them, so the replicated
    parameters get ∂(Σ_r L_r)/∂θ like the experts do. Register with
    `ddp.register_comm_hook(group, allreduce_sum_hook)` (group None: the default group).

    Args:
        group: the DDP process group (dist.ProcessGroup or None).
        bucket: dist.GradBucket of flattened gradients.
    Returns: torch.futures.Future[Tensor] of the summed bucket.
    """
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def all_reduce_replicated_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Without DDP: sum the gradients of every non-sharded parameter over `group` (call after
    backward, before the optimizer step). Parameters without a gradient on this rank count as
    zero; every rank must hold the same parameters."""
    sharded = set(expert_parallel_names(model))
    for name, p in model.named_parameters():
        if name in sharded or not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)


@torch.no_grad()
def all_reduce_expert_load(model: nn.Module) -> None:
    """Sum each sharded MoE layer's `expert_load` over its group, so that
    `update_expert_biases(model)` moves the replicated router biases identically on every rank."""
    for m in model.modules():
        if isinstance(m, MoE) and isinstance(m.experts, ExpertParallelExperts) and hasattr(m, "expert_load"):
            dist.all_reduce(m.expert_load, group=m.experts.group)


def gather_full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The state dict of `model` with every sharded expert tensor gathered to the full
    unsharded layout ([E, ...]). Collective over each sharded layer's group; every rank gets
    the whole dict (save it on one rank)."""
    state = model.state_dict()
    for prefix, stage in _stages(model):
        for name in _SHARDED:
            local = getattr(stage, name)
            if local is None:
                continue
            if local.device.type == "meta":
                raise ValueError(f"{_prefixed(prefix, name)} is on the meta device: nothing to gather")
            shards = [torch.empty_like(local) for _ in range(stage.world_size)]
            dist.all_gather(shards, local.detach().contiguous(), group=stage.group)
            state[_prefixed(prefix, name)] = torch.cat(shards)
    return state


def load_full_state_dict(model: nn.Module, state_dict: dict[str, Tensor], strict: bool = True, assign: bool = False):
    """Load an unsharded state dict (expert tensors [E, ...]) into a sharded `model`: each
    rank takes its block of experts. Not collective. Returns what `load_state_dict` returns."""
    local = dict(state_dict)
    for prefix, stage in _stages(model):
        lo, hi = stage.expert_offset, stage.expert_offset + stage.num_experts
        for name in _SHARDED:
            key = _prefixed(prefix, name)
            if getattr(stage, name) is None or key not in local:
                continue  # load_state_dict reports missing or unexpected keys
            full = local[key]
            if full.shape[0] != stage.global_num_experts:
                raise ValueError(
                    f"{key}: expected the full layout with {stage.global_num_experts} experts in dim 0, "
                    f"got shape {tuple(full.shape)}"
                )
            local[key] = full[lo:hi]
    return model.load_state_dict(local, strict=strict, assign=assign)
