"""A MoE layer's decode step in one call of the library (`_decode.cpp`): the router's logits,
scores, top-k and combine weights, the dispatch plan and the experts' one-call forward with its
weighted sum, for a few tokens on the CPU; with autograd on, one node whose backward is the
experts' backward of the layer's ops, the routing's and the router's (`_DecodeStep`), on
AVX512-BF16 CPUs those three in one call too (`moe_ffn_decode_backward_bf16` / `_f32`).

Why: a decode step reads its routed experts' weights once (~25 MB for the fine-grained bf16
shape at T = 1), and that stream empties the caches of everything else: every op of the
router, of the plan and of the way into the experts' call then ran with its code and data
fetched from memory again. The Zen 4 EPYC (2026-12-07), fine-grained bf16 at T = 1 with a
dense block's weights streamed between steps: the layer's ops took 1.32 ms around a 0.84 ms
call of the experts' kernel (the router alone 0.21 ms, 0.03 back to back). Here those steps
are one crossing from Python; the layer's forward, the ops → the call, alternated in one
process (40 rounds, medians of pair ratios): fine-grained bf16 T = 1 0.77–0.80×, float32
0.81–0.85×, bf16 T = 16 0.96×; Mixtral-shaped (D = 1024, F = 3584, E = 8, k = 2) bf16 T = 1
0.83–0.84×, float32 0.93×.

Where it runs (`step` returns None elsewhere and the layer makes its usual calls): the layer's
experts are `GatedExperts` with SiLU and no biases, no capacity limit, routing one of
config.Routing's, at most MAX_TOKENS tokens, no router jitter this step, no autocast, not
compiling (the layer checks its parts and hooks: MoE._decodes_in_one_call); and the experts'
part runs on the kernel the layer's decode path chooses for the same blocks — bf16 on
AVX512-BF16 CPUs without AMX, float32 on the library's float32 kernels — so that part gives the
same bits. The routing's bits: bf16 tokens' logits are the router's own kernel's; float32
tokens' logits are double sums rounded once (F.linear's float32 sums differ in the last bits);
scores and weights are computed in double and rounded once (torch's float32 softmax and
division round at each step). The same tokens can so get weights a few ulps apart here and in
the layer's ops (past MAX_TOKENS tokens, or compiling), and, on a near-tie, another expert.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from moe_ffn import _amx, _memory, _small_gemm, grouped
from moe_ffn.router import RouterOutput

__all__ = ["MAX_TOKENS", "step"]

# The most tokens a step takes here: the router's few-token kernel's (router._FEW_TOKENS) and
# the bf16 decode blocks' (grouped._BF16_DECODE_ROWS); float32 blocks past the kernels' rows
# (BLOCKS_MAX_ROWS) come back to the layer's ops after the routing (status 2).
MAX_TOKENS = 16

_ROUTING = {"softmax_topk": 0, "topk_softmax": 1, "sigmoid_topk": 2}
_FLOAT32, _BF16 = 0, 1


@functools.lru_cache(maxsize=None)
def _entry_point():
    """moe_ffn_decode_step with its argument types, or None where the library is not built."""
    lib = _small_gemm.library()
    fn = getattr(lib, "moe_ffn_decode_step", None) if lib is not None else None
    if fn is None:
        return None
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [
        c_int, ptr, i64, i64, i64, ptr, i64, ptr, c_int, c_int, ctypes.c_double, i64, i64,  # x, router, routing
        ptr, i64, i64, ptr, i64, i64, i64, i64,  # the experts' weights, F, most rows
        ptr, ptr, ptr, ptr, ptr,  # logits, probs, ids, weights, out
        ptr, ptr, ptr, ptr, ptr,  # (kept for backward:) h, plan, rows' weights; linear1, linear2
        c_int, ptr, ptr, ptr,  # the team
    ]
    fn.restype = c_int
    return fn


@functools.lru_cache(maxsize=64)
def _kind(dtype: torch.dtype, rows: int, experts: int, hidden: int, dim: int, features: int):
    """(kind, most rows of a block, linear1, linear2, torch's OpenMP entry points) of the
    experts' call the layer's decode path makes here for a step of `rows` tokens of `dtype`
    through `experts` experts' w1 [experts, hidden, dim] and w2 [experts, dim, features] (rows
    contiguous), or None where it makes neither of the two this file calls
    (grouped._ffn_forward_decode says which). Kept per process, as the library keeps its entry
    points: the choice rests on the CPU, the library and torch's build alone, and asking again
    was ~60 µs of a ~1 ms step with the caches emptied (tests that pretend another CPU clear it)."""
    x_TD = torch.empty(rows, dim, dtype=dtype)  # (stand-ins of the step's tensors for the checks below)
    w1_EHD = torch.empty((), dtype=dtype).expand(experts, hidden, dim)
    w2_EDF = torch.empty((), dtype=dtype).expand(experts, dim, features)
    if dtype == torch.bfloat16:
        if not (
            _small_gemm._bf16_blocks_entry_points() is not None and _amx.swiglu_forward_available()
            and not _amx.available() and grouped._compute_dtype(x_TD) == torch.bfloat16
        ):
            return None
        kernel = _small_gemm._kernel_for((x_TD,), None)
        most = min(MAX_TOKENS, _small_gemm.bf16_forward_max_rows(experts))
        return None if kernel is None else (_BF16, most, None, None, kernel[1])
    if dtype == torch.float32 and _small_gemm.available():
        most = min(_small_gemm.BLOCKS_MAX_ROWS, _small_gemm.ranges().forward)
        block = [(0, 0, min(rows, most))]  # (the largest block the call takes)
        first = _small_gemm._linear_blocks_kernel(x_TD, w1_EHD, block, None)
        second = _small_gemm._linear_blocks_kernel(x_TD, w2_EDF, block, None)
        if first is None or second is None:
            return None
        linear1, linear2 = (ctypes.cast(k[0], ctypes.c_void_p) for k in (first, second))
        return _FLOAT32, most, linear1, linear2, first[1]
    return None


class _Declined(Exception):
    """The call ran the routing (route) or nothing (None) and left the rest to the layer's ops."""

    def __init__(self, route: Optional[RouterOutput]) -> None:
        super().__init__()
        self.route = route


def _run(fn, args: tuple, x_TD: Tensor, E: int, K: int, h_NH=None, plan=None, weight_N=None):
    """The library's call into new tensors: (out_TD, logits_TE, probs_TE, ids_TK, weights_TK);
    _Declined where it did not run the experts."""
    T, D = x_TD.shape
    logits_TE, probs_TE = torch.empty(T, E), torch.empty(T, E)
    ids_TK, weights_TK = torch.empty(T, K, dtype=torch.int64), torch.empty(T, K)
    out_TD = torch.empty(T, D, dtype=x_TD.dtype)
    kept = (None, None, None) if h_NH is None else (h_NH.data_ptr(), plan.data_ptr(), weight_N.data_ptr())
    status = fn(
        *args[0], logits_TE.data_ptr(), probs_TE.data_ptr(), ids_TK.data_ptr(), weights_TK.data_ptr(),
        out_TD.data_ptr(), *kept, *args[1],
    )
    if status == 1:
        raise _Declined(None)
    if status == 2:
        raise _Declined(RouterOutput(logits_TE, probs_TE, ids_TK, weights_TK))
    if status != 0:
        raise RuntimeError(f"decode step: the library's call failed (status {status}) for x {tuple(x_TD.shape)}")
    return out_TD, logits_TE, probs_TE, ids_TK, weights_TK


def step(router, experts, x_TD: Tensor) -> tuple[Optional[Tensor], Optional[RouterOutput]]:
    """(out_TD, route) of the layer (`router`, `experts`) for tokens x_TD [T, D] in one call:
    out_TD in x's dtype, route the router's output. (None, route) where the routing ran but a
    block has more rows than the experts' call takes (the caller runs the experts' ops on that
    route); (None, None) where the call does not run (see the module doc) or a logit is not
    finite (the caller's ops then give torch's answer, NaN included). With autograd on, the
    outputs and the route's logits, probs and weights carry one node (`_DecodeStep`) whose
    backward gives x, the router's and the experts' weights their gradients (once: as the
    experts' op of the layer's ops, it has no second derivative)."""
    fn = _entry_point()
    T = x_TD.shape[0]
    if fn is None or not 0 < T <= MAX_TOKENS or x_TD.device.type != "cpu" or x_TD.stride(1) != 1:
        return None, None
    if torch.compiler.is_compiling() or torch.is_autocast_enabled("cpu"):
        return None, None
    w1, w2, r = experts.gate_up_proj, experts.down_proj, router.weight
    bias_E = router.expert_bias
    if not (
        x_TD.dtype == w1.dtype == w2.dtype == r.dtype and w1.stride(2) == 1 and w2.stride(2) == 1 and r.stride(1) == 1
        and router.routing in _ROUTING and w1.device.type == w2.device.type == r.device.type == "cpu"
        and (bias_E is None or (bias_E.dim() == 1 and bias_E.device.type == "cpu"))
    ):
        return None, None
    if bias_E is not None:  # (a bf16 layer's `.to()` made it bf16; the router widens it as well)
        bias_E = bias_E.to(torch.float32).contiguous()
    (E, H, D), K = w1.shape, router.top_k
    kind = _kind(x_TD.dtype, T, *w1.shape, w2.shape[2])
    if kind is None:
        return None, None
    kind, most, linear1, linear2, team = kind
    routing = (_ROUTING[router.routing], router.norm_topk_prob, router.routed_scaling_factor)
    args = (
        (
            kind, x_TD.data_ptr(), x_TD.stride(0), T, D, r.data_ptr(), r.stride(0),
            None if bias_E is None else bias_E.data_ptr(), *routing, E, K, w1.data_ptr(), w1.stride(0),
            w1.stride(1), w2.data_ptr(), w2.stride(0), w2.stride(1), H // 2, most,
        ),
        (linear1, linear2, torch.get_num_threads(), *team),
    )
    recorded = torch.is_grad_enabled() and (x_TD.requires_grad or r.requires_grad or w1.requires_grad or w2.requires_grad)
    try:
        if recorded:
            backward = _backward_entry_point(x_TD.dtype)
            out_TD, *route = _DecodeStep.apply(x_TD, r, w1, w2, (fn, args, routing, backward))
        else:
            out_TD, *route = _run(fn, args, x_TD, E, K)
    except _Declined as declined:  # (a route made here carries no graph: with autograd the ops route again)
        return None, None if recorded else declined.route
    return out_TD, RouterOutput(*route)


@functools.lru_cache(maxsize=None)
def _routing_backward_entry_point():
    """moe_ffn_decode_routing_backward with its argument types (where the step's call is built)."""
    fn = _small_gemm.library().moe_ffn_decode_routing_backward
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [c_int, c_int, ctypes.c_double, i64, i64, i64] + [ptr] * 8
    fn.restype = c_int
    return fn


@functools.lru_cache(maxsize=None)
def _backward_entry_point(dtype: torch.dtype):
    """moe_ffn_decode_backward_bf16 / _f32 with its argument types where the experts' backward of
    a step of `dtype` is the AVX512-BF16 CPUs' one-call kernel it calls (`_small_gemm.avx512_
    routed_swiglu_backward_blocks`' CPUs: torch at AVX-512, its entry points ready; float32: where
    MKL's sgemm runs its AVX2 code, so that the float32 blocks kernels take any decode blocks, and
    the one- and few-row gradients' entry points are ready), else None."""
    if _small_gemm._avx512_routed_swiglu_backward_entry_point(dtype) is None or not _small_gemm._torch_on_avx512():
        return None
    if dtype == torch.float32 and not (
        _small_gemm.sgemm_at_avx2_width() and _small_gemm._one_row_gradients_f32_entry_point() is not None
    ):
        return None
    fn = getattr(_small_gemm.library(), "moe_ffn_decode_backward_" + ("bf16" if dtype == torch.bfloat16 else "f32"), None)
    if fn is None:
        return None
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [
        ptr, i64, ptr, i64, i64, i64, ptr, i64, c_int, c_int, ctypes.c_double, i64, i64,  # g, x, router, routing
        ptr, i64, i64, ptr, i64, i64, i64,  # the experts' weights, F
        ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr,  # kept: h, plan, rows' weights, logits, ids; the route's gradients
        ptr, i64, i64, ptr, i64, i64, c_int, c_int,  # the weights' gradients, streamed
        c_int, ptr, ptr, i64,  # want x, grad_x, grad_router, outer rows
        c_int, ptr, ptr, ptr,  # the team
    ]
    fn.restype = c_int
    return fn


@functools.lru_cache(maxsize=None)
def _router_backward_f32_entry_point():
    """moe_ffn_decode_router_backward_f32 with its argument types (where the step's call is built)."""
    fn = _small_gemm.library().moe_ffn_decode_router_backward_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64]
    fn.restype = ctypes.c_int
    return fn


def _router_backward_f32(g_TE: Tensor, x_TD: Tensor, r_ED: Tensor, need_x: bool, need_r: bool):
    """(x's, the router's gradient) of float32 logits x·rᵀ from their gradient g [T, E] (each None
    where not needed): the library's double sums, each rounded once, as the one-call backward's."""
    (T, D), E = x_TD.shape, r_ED.shape[0]
    gx = torch.empty(T, D) if need_x else None
    gr = torch.empty(E, D) if need_r else None
    status = _router_backward_f32_entry_point()(
        g_TE.data_ptr(), g_TE.stride(0), x_TD.data_ptr(), x_TD.stride(0), r_ED.data_ptr(), r_ED.stride(0), _ptr(gx),
        _ptr(gr), T, E, D,
    )
    if status != 0:
        raise RuntimeError(f"decode step: the router's backward failed (status {status})")
    return gx, gr


def _ptr(t: Optional[Tensor]):
    return None if t is None else t.data_ptr()


def _backward_in_one_call(fn, team, routing, g_out, g_route, saved, need_x: bool, need_r: bool):
    """The node's gradients (x, router, w1, w2) of a step from one call of the library
    (moe_ffn_decode_backward_bf16 / _f32: the calls of the node's general backward, on the same
    kernels in the same order, the same bits); None where the call declines or the general
    backward would not make the experts' part in one call (nothing kept: the caller computes
    them again). g_route: the gradients of the weights, probs and logits (None where none came)."""
    x_TD, r_ED, w1_EHD, w2_EDF, h_NH, plan, weight_N, logits_TE, ids_TK = saved
    (T, D), (E, H, _), K = x_TD.shape, w1_EHD.shape, ids_TK.shape[1]
    N = T * K
    # (grouped._ffn_backward's one call: at most this many rows, in one group of blocks, x's
    # gradient summed token by token; float32: the few-row gradients taking both weights, which
    # with sgemm at AVX2 width (the entry point's condition) rests on the weights' shapes alone)
    if not (
        N <= _small_gemm.ONE_CALL_BACKWARD_MAX_STEP_ROWS and N * H <= grouped._ONE_GROUP_FACTOR * grouped._GROUP_ELEMENTS
        and grouped._sums_by_token(x_TD, N, D)
        and (
            x_TD.dtype == torch.bfloat16
            or all(_small_gemm._few_row_gradients_for(w, []) is not None for w in (w1_EHD, w2_EDF))
        )
    ):
        return None
    g_out = g_out if g_out.stride(1) == 1 else g_out.contiguous()
    experts = ids_TK.view(-1).tolist()  # (the experts with rows; gradient_memory sorts them)
    gw1, _ = _memory.gradient_memory(w1_EHD, x_TD, experts)  # (stale or not: each expert with rows written over)
    gw2, _ = _memory.gradient_memory(w2_EDF, x_TD, experts)
    gx = torch.empty(T, D, dtype=x_TD.dtype)
    gr = torch.empty(E, D, dtype=r_ED.dtype) if need_r else None
    g_route = [None if g is None else g.contiguous() for g in g_route]
    status = fn(
        g_out.data_ptr(), g_out.stride(0), x_TD.data_ptr(), x_TD.stride(0), T, D, r_ED.data_ptr(), r_ED.stride(0),
        *routing, E, K, w1_EHD.data_ptr(), w1_EHD.stride(0), w1_EHD.stride(1), w2_EDF.data_ptr(), w2_EDF.stride(0),
        w2_EDF.stride(1), H // 2, h_NH.data_ptr(), plan.data_ptr(), weight_N.data_ptr(), logits_TE.data_ptr(),
        ids_TK.data_ptr(), *(_ptr(g) for g in g_route), gw1.data_ptr(), gw1.stride(0), gw1.stride(1), gw2.data_ptr(),
        gw2.stride(0), gw2.stride(1), int(_small_gemm._streamed_gradients(gw1)),
        int(_small_gemm._streamed_gradients(gw2)), int(need_x), gx.data_ptr(), _ptr(gr),
        _small_gemm.SGEMM_AVX2_WEIGHT_GRAD_ROWS[1], torch.get_num_threads(), *team,
    )
    return (gx if need_x else None, gr, gw1, gw2) if status == 0 else None


class _DecodeStep(torch.autograd.Function):
    """The step's call as one autograd node: outputs (out_TD, logits_TE, probs_TE, ids_TK,
    weights_TK). Its backward: the experts' (grouped._routed_ffn_backward on the call's plan and
    first projection: the layer's own backward of the experts' op), the routing's
    (moe_ffn_decode_routing_backward: the logits' gradient in double from the weights', probs'
    and logits' gradients) and the router's product's (_small_gemm.router_backward for bf16,
    as the router's own backward for a few tokens; float32: moe_ffn_decode_router_backward_f32,
    double sums rounded once, as the call's float32 logits), x's two parts added in x's dtype as
    autograd adds them. Where the experts' part is the AVX512-BF16 CPUs' one-call kernel and
    both expert weights want gradients, those three are one crossing (`_backward_in_one_call`:
    the same kernels in the same order, the same bits). Zen 4 EPYC, the benchmark's layer
    forward+backward with transformers' and the dense blocks stepped between (general → one
    call, medians): bf16 (30 rounds) fine-grained T = 1 0.885×, T = 16 0.93×, Mixtral-shaped
    T = 1 0.94×, T = 16 0.99×; float32 against the node's earlier calls (torch's mm for the
    router; 3 cases of ~11 rounds): fine-grained T = 1 0.92–0.96×, T = 16 0.99×, Mixtral-shaped
    T = 1 0.95–0.97×, T = 16 0.98×. (The float32 router products alone take longer than
    torch's two-thread mm at T = 16, 165 against 86 µs warm, one thread's double sums: under
    1 % of that step.)"""

    @staticmethod
    def forward(ctx, x_TD, r_ED, w1_EHD, w2_EDF, call):
        fn, args, routing, backward = call
        (E, H, _), T, K = w1_EHD.shape, x_TD.shape[0], args[0][12]
        N = T * K
        h_NH = torch.empty(N, H, dtype=x_TD.dtype)
        plan = torch.empty(2 * N + E, dtype=torch.int64)  # order [N], token [N], counts [E]
        weight_N = torch.empty(N)
        out_TD, logits_TE, probs_TE, ids_TK, weights_TK = _run(fn, args, x_TD, E, K, h_NH, plan, weight_N)
        ctx.save_for_backward(x_TD, r_ED, w1_EHD, w2_EDF, h_NH, plan, weight_N, logits_TE, ids_TK)
        ctx.routing, ctx.backward, ctx.team = routing, backward, args[1][3:]
        ctx.mark_non_differentiable(ids_TK)
        ctx.set_materialize_grads(False)
        return out_TD, logits_TE, probs_TE, ids_TK, weights_TK

    @staticmethod
    @once_differentiable
    def backward(ctx, g_out, g_logits, g_probs, _g_ids, g_weights):
        saved = ctx.saved_tensors
        need_x, need_r, need_w1, need_w2 = ctx.needs_input_grad[:4]
        if ctx.backward is not None and g_out is not None and need_w1 and need_w2:
            grads = _backward_in_one_call(
                ctx.backward, ctx.team, ctx.routing, g_out, (g_weights, g_probs, g_logits), saved, need_x, need_r
            )
            if grads is not None:
                return (*grads, None)
        x_TD, r_ED, w1_EHD, w2_EDF, h_NH, plan, weight_N, logits_TE, ids_TK = saved
        T, E, N = x_TD.shape[0], w1_EHD.shape[0], weight_N.shape[0]
        gx = gw1 = gw2 = g_rows = None
        if g_out is not None and (need_x or need_r or need_w1 or need_w2):
            # (x's gradient asked for always: the experts' one-call backward makes all of them,
            # and at a decode step's few rows it costs next to nothing)
            gx, gw1, gw2, _, _, g_rows = grouped._routed_ffn_backward(
                g_out.contiguous(), x_TD, h_NH, w1_EHD, w2_EDF, plan[2 * N :], plan[N : 2 * N], weight_N, None,
                "silu", True, True, need_w1 or need_w2, True,
            )
            gx = gx if need_x else None
        gr = None
        if (need_x or need_r) and (g_rows is not None or g_weights is not None or g_probs is not None or g_logits is not None):
            g_logits_TE = torch.empty(T, E)
            contiguous = [None if g is None else g.contiguous() for g in (g_weights, g_probs, g_logits)]
            status = _routing_backward_entry_point()(
                *ctx.routing, T, E, ids_TK.shape[1], logits_TE.data_ptr(), ids_TK.data_ptr(), plan.data_ptr(),
                _ptr(g_rows), *(_ptr(g) for g in contiguous), g_logits_TE.data_ptr(),
            )
            if status != 0:
                raise RuntimeError(f"decode step: the routing's backward failed (status {status})")
            if x_TD.dtype == torch.float32:
                router = _router_backward_f32(g_logits_TE, x_TD, r_ED, need_x, need_r)
            else:
                router = _small_gemm.router_backward(g_logits_TE, x_TD, r_ED, need_x, need_r)
            if router is None:  # (bf16 where the router's kernel does not run: F.linear's products)
                router = (
                    torch.mm(g_logits_TE, r_ED) if need_x else None,
                    torch.mm(g_logits_TE.t(), x_TD) if need_r else None,
                )
            gx_router, gr = router
            if need_x:
                gx = gx_router if gx is None else gx + gx_router
        return (
            gx if need_x else None, gr if need_r else None, gw1 if need_w1 else None, gw2 if need_w2 else None, None,
        )
