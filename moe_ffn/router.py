"""Stage 1: the top-k router. Logits → scores → the k experts and their weights per token.

Legend: T tokens, D model dim, E experts, K top-k.

NOTE: the router runs in at least float32 whatever the input dtype: logits, softmax/sigmoid
and the combine weights. A bf16 router picks different experts than the full-precision one
on near-ties and is a known source of loss spikes; float64 inputs stay float64. The float32
logits of bf16 tokens are float32 sums of the exact products in whatever order the kernel
takes (MKL's on a widened copy, the AMX tiles', or for a few tokens moe_ffn's one-thread
kernel: `_FEW_TOKENS`), so their low bits are not fixed. Of equal
scores the top-k takes the lower expert first where the kernel runs (on CPU, at 4096 scores
or more; torch.topk leaves that order unspecified).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_ffn import _amx, _memory, _small_gemm
from moe_ffn.config import Routing

__all__ = ["TopKRouter", "RouterOutput", "router_dtype"]


def router_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype routing math runs in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _logits(x_TD: Tensor, w_ED: Tensor) -> Tensor:
    """x·Wᵀ in the router's dtype. Low-precision tokens are widened exactly (a copy of x in
    float32) on scratch memory, a temporary of the call reused from call to call, where a fresh
    float32 copy of a bf16 step faulted its pages in every call; with autograd the copy is not
    saved for backward either (`_WidenedLogits`). The 2-core EPYC of family 26, Mixtral's router
    at T = 8192 alone, inference 19.9 → 6.5 ms, 64 experts 26.7 → 14.4 ms."""
    dtype = router_dtype(x_TD.dtype)
    if x_TD.dtype == dtype:  # (one product with autograd and without: the same logits)
        return F.linear(x_TD, w_ED.to(dtype))
    if torch.compiler.is_compiling():  # traced: plain ops (the kernels and scratch memory are
        return F.linear(x_TD.to(dtype), w_ED.to(dtype))  # eager-mode choices, which dynamo can't trace)
    if torch.is_grad_enabled() and (x_TD.requires_grad or w_ED.requires_grad):
        return _WidenedLogits.apply(x_TD, w_ED)
    return _widened_linear(x_TD, w_ED, dtype)


_ONEDNN_MIN_MACS = 1 << 22


def _linear32(a: Tensor, b: Tensor) -> Tensor:
    """a·bᵀ, on oneDNN's inner product for float32 where MKL's sgemm runs its AVX2 code on an
    AVX-512 CPU (AMD's: _small_gemm.sgemm_at_avx2_width), F.linear elsewhere. The router's thin
    products on the 2-core EPYC of family 26 (ms, medians of 9, D = 1024, E = 64 / 8), sgemm →
    oneDNN: logits x·Wᵀ at T = 2048 1.64 → 0.64 / 0.50 → 0.29, at T = 8192 6.88 → 2.79 / 2.72
    → 1.19; the weight gradient gᵀ·x at T = 2048 2.08 → 0.79 / 0.51 → 0.26, at T = 8192 9.08
    → 3.66 / 3.15 → 1.59. Below _ONEDNN_MIN_MACS multiply-adds oneDNN's hand-off to its two
    threads costs more than it saves (the router's forward+backward alone at T = 16: 0.16 →
    0.21 ms, 0.25 → 0.29; at T = 256 level). (The input gradient g·W: see `_matmul32`.)"""
    if a.device.type == "cpu" and a.dtype == torch.float32 and a.shape[0] * b.numel() >= _ONEDNN_MIN_MACS:
        if _small_gemm.sgemm_at_avx2_width() and _small_gemm.onednn_linear_available():
            return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    return F.linear(a, b)


def _matmul32(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """out = a·b for float32 [T, E]·[E, D] (the input gradient g·W, into scratch memory): on
    moe_ffn's AVX-512 blocked product where MKL's sgemm runs its AVX2 code (as `_linear32`),
    torch.mm elsewhere. Its k ≤ E steps of a sum, output-bound: on the 2-core EPYC of family 26
    (ms, medians of 10) torch.mm → the kernel E = 64 at T = 256 / 2048 / 8192 0.18 → 0.11,
    1.50 → 0.77, 6.66 → 3.07; E = 8 at T = 2048 / 8192 0.77 → 0.28, 3.68 → 1.45. oneDNN's
    inner product wrote a fresh [T, D] result, faulted in page by page (11.3 ms at T = 8192)."""
    if _small_gemm.sgemm_at_avx2_width() and _small_gemm.avx512_matmul_into(out, a, b):
        return out
    return torch.mm(a, b, out=out)


def _widened(t: Tensor, dtype: torch.dtype) -> Tensor:
    return _memory.scratch(t, *t.shape, dtype=dtype).copy_(t)


_AMX_PADDED_MIN_TOKENS = 32

# Up to this many bf16 tokens (a decode step's) the logits and their gradients are float32 sums
# of the exact products on the calling thread (`_small_gemm.router_logits`, `router_backward`:
# AVX-512 CPUs), not GEMMs on widened copies: for so few tokens the GEMMs' cost was mostly the
# copies of x and W, whose fresh lines the other thread then fetched from this core's cache. The
# Zen 4 EPYC (2026-12-07, router alone, µs, min of 5 × 3000 calls, GEMMs → kernel): E = 64, T =
# 1 forward 55 → 27, forward+backward 179 → 81; E = 8 31 → 20 / 132 → 63; E = 64, T = 16 96 →
# 88 / 290 → 217, T = 32 148 → 159 / 482 → 363 (the forward past it slower: hence 16).
_FEW_TOKENS = 16


def _widened_linear(x_TD: Tensor, w_ED: Tensor, dtype: torch.dtype) -> Tensor:
    """x·Wᵀ of low-precision x in `dtype`: on AMX CPUs, for bf16 x and W, the tiles' float32
    sums of the exact products (`_amx.linear_float32`, no widened copy); for up to _FEW_TOKENS
    bf16 tokens on AVX-512 CPUs moe_ffn's one-thread kernel's (no copies either); past them on
    AVX512-BF16 CPUs without AMX the pair products' (`_small_gemm.router_logits_on_pairs`: W
    packed in pairs once a call, no copy of x; Zen 4 EPYC, E = 64, medians of 35 calls, widened
    GEMM → pairs: T = 32 / 64 / 256 / 2048 0.132 / 0.171 / 0.303 / 1.482 → 0.034 / 0.055 / 0.113
    / 0.603 ms; layer bf16 forward fine-grained T = 256 0.983×, T = 2048 0.987×, Mixtral T = 256
    0.993×, forward+backward fine-grained T = 256 0.981×; the few tokens' kernel takes the same
    sums there, so a token's logits are the same bits whatever the step's token count); else the
    float32 GEMM of widened copies. The tiles form 16 logits a row: fewer experts (Mixtral's 8) pad the
    weight with zero rows, a copy that costs more than it saves below _AMX_PADDED_MIN_TOKENS
    (2-core Xeon, E = 8, widened → tiles: T = 16 / 32 / 256 17.4 / 31.8 / 102.5 → 18.0 / 19.2
    / 43.5 µs)."""
    if dtype == torch.float32 and (w_ED.shape[0] % 16 == 0 or x_TD.shape[0] >= _AMX_PADDED_MIN_TOKENS):
        logits = _amx.linear_float32(x_TD, w_ED)
        if logits is not None:
            return logits
    if dtype == torch.float32 and x_TD.shape[0] <= _FEW_TOKENS:
        logits = _small_gemm.router_logits(x_TD, w_ED)
        if logits is not None:
            return logits
    if dtype == torch.float32:
        logits = _small_gemm.router_logits_on_pairs(x_TD, w_ED)
        if logits is not None:
            return logits
    return _linear32(_widened(x_TD, dtype), w_ED.to(dtype))


class _WidenedLogits(torch.autograd.Function):
    """x·Wᵀ of low-precision x in the router's dtype (float32), with the gradients that
    F.linear(x.to(dtype), W.to(dtype)) has (its products, each rounded back to its input's dtype
    once; the logits and the weight's gradient on `_linear32`'s kernel), keeping x as it is for
    backward and widening it again there on scratch memory, instead of saving a fresh widened
    copy (x.to(dtype) made one, autograd kept it, and the gradient of x went through a fresh
    float32 [T, D] too). Router forward+backward alone, Mixtral's at T = 8192: ~33 ms before
    (three thin sgemms on fresh memory 17, the casts 10). On AMX CPUs, bf16 x and W: the logits
    on the tiles (`_widened_linear`) and, from _TILES_BACKWARD_MIN_MACS, both gradients too
    (`_tiles_backward`), without widened copies. Up to _FEW_TOKENS bf16 tokens on AVX-512 CPUs
    the logits and both gradients come from moe_ffn's kernels, also without copies
    (`_small_gemm.router_backward`: float32 sums of the exact products, each gradient rounded
    to bf16 once, as the GEMMs' results are); on AMD's AVX-512 CPUs (`sgemm_at_avx2_width`)
    the gradients of any number of tokens do (on torch's team past 2^22 multiply-adds a
    product). Zen 4 EPYC (2026-12-07), the router's backward alone, medians of 17: E = 64, T = 64
    / 256 / 2048 0.319 / 0.711 / 5.079 → 0.114 / 0.371 / 3.542 ms; E = 8 0.208 / 0.377 / 1.655
    → 0.055 / 0.154 / 0.606."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, w_ED: Tensor) -> Tensor:
        ctx.save_for_backward(x_TD, w_ED)
        return _widened_linear(x_TD, w_ED, router_dtype(x_TD.dtype))

    @staticmethod
    def backward(ctx, g_TE: Tensor):
        x_TD, w_ED = ctx.saved_tensors
        dtype = g_TE.dtype
        on_tiles = _tiles_backward(g_TE, x_TD, w_ED, *ctx.needs_input_grad[:2])
        if on_tiles is not None:
            return on_tiles
        if x_TD.shape[0] <= _FEW_TOKENS or _small_gemm.sgemm_at_avx2_width():
            kernel = _small_gemm.router_backward(g_TE, x_TD, w_ED, *ctx.needs_input_grad[:2])
            if kernel is not None:
                return kernel
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g_TD = _memory.scratch(g_TE, x_TD.shape[0], x_TD.shape[1], dtype=dtype)
            grad_x = _matmul32(g_TD, g_TE, w_ED.to(dtype)).to(x_TD.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _linear32(g_TE.t().contiguous(), _widened(x_TD, dtype).t()).to(w_ED.dtype)
        return grad_x, grad_w


# Below this many scores torch.topk's call costs less than the kernel's (2-core Xeon: T = 16,
# E = 64 5 against 9 µs; T = 256 150 against 58).
_TOPK_KERNEL_MIN_SCORES = 1 << 12


def _top_k(scores_TE: Tensor, k: int, select_TE: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(weights, ids) of each token's k largest of `select_TE` (default: the scores themselves),
    largest first, the weights being the scores at those experts: by `_small_gemm.topk_ids`
    (equal values: lower expert first) where it runs and the values are many, then a gather of
    the scores; else torch.topk's (equal values in its own order). 2-core Xeon, medians of 15,
    E = 64, k = 8: T = 2048 / 8192 0.63 / 2.63 → 0.26 / 1.06 ms; E = 8, k = 2: 0.12 / 0.26 →
    0.07 / 0.18."""
    select_TE = scores_TE if select_TE is None else select_TE
    if select_TE.numel() >= _TOPK_KERNEL_MIN_SCORES:
        ids_TK = _small_gemm.topk_ids(select_TE.detach(), k)
        if ids_TK is not None:
            return scores_TE.gather(-1, ids_TK), ids_TK
    if select_TE is scores_TE:
        return scores_TE.topk(k, dim=-1)
    ids_TK = select_TE.topk(k, dim=-1).indices
    return scores_TE.gather(-1, ids_TK), ids_TK


def _bf16_parts(g_TE: Tensor, width: int) -> Tensor:
    """[T, width] bf16: float32 g's three bf16 parts side by side (hi | mid | lo, then zero
    columns), whose sum is g exactly: hi = g rounded, mid the rest rounded, lo what remains (at
    most 8 significant bits, exact in bf16), each step exact in float32. (Below 2^-110 a part
    can fall under bf16's normal range, which the tiles count as zero.)"""
    T, E = g_TE.shape
    parts = g_TE.new_zeros(T, width, dtype=torch.bfloat16)
    parts[:, :E] = g_TE
    rest = g_TE - parts[:, :E].float()
    parts[:, E : 2 * E] = rest
    parts[:, 2 * E : 3 * E] = rest - parts[:, E : 2 * E].float()
    return parts


_TILES_BACKWARD_MIN_MACS = 1 << 25


def _tiles_backward(g_TE: Tensor, x_TD: Tensor, w_ED: Tensor, need_x: bool, need_w: bool) -> Optional[tuple]:
    """(grad_x, grad_w) of the logits of bf16 x and W on AMX tiles, or None where they do not
    run: float32 g split exactly into three bf16 parts (`_bf16_parts`), so that g·W is the tiles'
    product of the parts against W three times over (3E deep, padded to 32: `_amx.input_grad`,
    its float32 sums rounded to bf16 once) and gᵀ·x the parts' product against x, the three
    float32 partial sums added in order and rounded once (`_amx.weight_grad_float32`). Float32
    sums of exact products as the float32 GEMMs on widened copies form them (in another order,
    3E terms deep), without those copies: the fine-grained router's backward at T = 2048 / 8192
    took 4.5 / 19.9 ms of a bf16 step (two thin float32 GEMMs at ~200 GFLOP/s, x widened, casts).
    Interleaved A/B in one process, bf16 forward+backward: fine-grained T = 256 / 2048 / 8192
    1.005 and 0.998 / 1.010–1.024 / 1.012–1.028× (three runs), Mixtral T = 2048 / 8192 0.997
    and 0.981 / 0.996–1.028×; below _TILES_BACKWARD_MIN_MACS (fine-grained from T = 512,
    Mixtral from 4096) its dozen small ops cost more than they save (T = 1 0.95–0.97× with the
    caches swept)."""
    T, E = g_TE.shape
    D = x_TD.shape[1]
    if not (
        g_TE.dtype == torch.float32 and x_TD.dtype == w_ED.dtype == torch.bfloat16 and T > 0 and D % 32 == 0
        and T * E * D >= _TILES_BACKWARD_MIN_MACS
        and _amx.available() and x_TD.stride(1) == 1 and w_ED.stride(1) == 1
    ):
        return None
    if not g_TE.abs().max() <= 2.0**126:  # (near float32's top hi would round to inf; NaN: as well)
        return None
    width = -(-3 * E // 32) * 32
    parts_TP = _bf16_parts(g_TE.contiguous(), width)
    grad_x = grad_w = None
    if need_x:
        w_PD = w_ED.new_zeros(width, D)
        w_PD[: 3 * E] = w_ED.repeat(3, 1)
        grad_x = x_TD.new_empty(T, D)
        most = _amx.input_grad_max_rows((width, D))
        for start in range(0, T, most):
            rows = slice(start, min(T, start + most))
            if _amx.input_grad(parts_TP[rows], w_PD.t(), out=grad_x[rows]) is None:
                return None
    if need_w:
        sums_PD = _amx.weight_grad_float32(parts_TP.t(), x_TD)
        if sums_PD is None:
            return None
        grad_w = (sums_PD[:E] + sums_PD[E : 2 * E] + sums_PD[2 * E : 3 * E]).to(w_ED.dtype)
    return grad_x, grad_w


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
        if torch.is_autocast_enabled(x_TD.device.type):
            with torch.autocast(x_TD.device.type, enabled=False):
                logits_TE = _logits(x_TD, self.weight)
        else:  # (entering an autocast context costs more than the whole router at decode)
            logits_TE = _logits(x_TD, self.weight)
        return self.route(logits_TE)

    def route(self, logits_TE: Tensor) -> RouterOutput:
        """The selection rule alone: given logits [T, E] → top-k experts and their weights.

        Public so that tools which perturb the logits (the profiler's --skew) reuse this rule
        instead of copying it.
        """
        K = self.top_k
        bias_E = None if self.expert_bias is None else self.expert_bias.to(logits_TE.dtype)

        if self.routing == "topk_softmax":
            chosen_TK, expert_ids_TK = _top_k(logits_TE, K, None if bias_E is None else logits_TE + bias_E)
            weights_TK = chosen_TK.softmax(dim=-1)
            probs_TE = logits_TE.softmax(dim=-1)
        else:
            if self.routing == "softmax_topk":
                probs_TE = logits_TE.softmax(dim=-1)
                scores_TE = probs_TE
            else:  # sigmoid_topk
                scores_TE = logits_TE.sigmoid()
                probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
            weights_TK, expert_ids_TK = _top_k(scores_TE, K, None if bias_E is None else scores_TE + bias_E)
            if self.norm_topk_prob:
                weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights_TK = weights_TK * self.routed_scaling_factor
        return RouterOutput(logits_TE, probs_TE, expert_ids_TK, weights_TK)
