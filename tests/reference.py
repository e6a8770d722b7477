"""Obviously-correct per-token reference implementations, for the tests only.

They loop over tokens and experts in Python with plain float64 tensor math, written from the
formulas (the seeds and the papers), sharing no code with moe_ffn beyond the weight layout.
"""

from __future__ import annotations

import math

import torch


def act(name, z):
    if name == "silu":
        return z / (1 + torch.exp(-z))
    if name == "gelu":
        return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
    if name == "gelu_tanh":
        return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    if name == "relu":
        return torch.clamp(z, min=0)
    if name == "sigmoid":
        return 1 / (1 + torch.exp(-z))
    if name == "identity":
        return z
    raise KeyError(name)


def gated_expert(x_D, gate_up_2FD, down_DF, activation="silu", gate_up_b=None, down_b=None):
    """(act(W_gate x) ⊙ W_up x) W_down for one token and one expert."""
    F = down_DF.shape[1]
    h = gate_up_2FD @ x_D
    if gate_up_b is not None:
        h = h + gate_up_b
    g, u = h[:F], h[F:]
    y = down_DF @ (act(activation, g) * u)
    if down_b is not None:
        y = y + down_b
    return y


def classic_ffn(x_D, up_FD, down_DF, activation, up_b=None, down_b=None):
    h = up_FD @ x_D
    if up_b is not None:
        h = h + up_b
    y = down_DF @ act(activation, h)
    return y if down_b is None else y + down_b


def route_token(logits_E, top_k, routing="softmax_topk", norm_topk_prob=True, scale=1.0, bias_E=None):
    """Returns (list of expert ids, list of weights) for one token, by sorting in Python."""
    E = logits_E.shape[0]
    if routing == "softmax_topk":
        m = logits_E.max()
        ex = torch.exp(logits_E - m)
        scores = ex / ex.sum()
    elif routing == "sigmoid_topk":
        scores = 1 / (1 + torch.exp(-logits_E))
    else:  # topk_softmax
        scores = logits_E
    select = [scores[e].detach().item() + (0.0 if bias_E is None else bias_E[e].item()) for e in range(E)]
    ids = sorted(range(E), key=lambda e: -select[e])[:top_k]
    if routing == "topk_softmax":
        chosen = torch.stack([logits_E[e] for e in ids])
        ex = torch.exp(chosen - chosen.max())
        weights = ex / ex.sum()
    else:
        weights = torch.stack([scores[e] for e in ids])
        if norm_topk_prob:
            weights = weights / weights.sum()
    return ids, weights * scale


def moe_forward(x_TD, router_ED, gate_up_E2FD, down_EDF, top_k, *, routing="softmax_topk",
                norm_topk_prob=True, scale=1.0, bias_E=None, activation="silu", keep=None,
                shared=None):
    """Per-token MoE. `keep(t, slot) -> bool` marks assignments that survive a capacity limit.
    `shared`: (gate_up_2SD, down_DS, gate_weight_1D or None) applied to every token."""
    outs = []
    for t in range(x_TD.shape[0]):
        x = x_TD[t]
        ids, weights = route_token(router_ED @ x, top_k, routing, norm_topk_prob, scale, bias_E)
        y = torch.zeros_like(x)
        for slot, (e, w) in enumerate(zip(ids, weights)):
            if keep is not None and not keep(t, slot):
                continue
            y = y + w * gated_expert(x, gate_up_E2FD[e], down_EDF[e], activation)
        if shared is not None:
            gu, dn, gate_w = shared
            s = gated_expert(x, gu, dn, activation)
            if gate_w is not None:
                s = s / (1 + torch.exp(-(gate_w[0] @ x)))
            y = y + s
        outs.append(y)
    if not outs:
        return x_TD.new_zeros(0, x_TD.shape[1]) + 0 * router_ED.sum() + 0 * gate_up_E2FD.sum() + 0 * down_EDF.sum()
    return torch.stack(outs)


def assert_close_f32(actual, expected, msg=None):
    """float32 parity between two implementations of the same sums (e.g. moe_ffn against
    transformers): within 1e-5 plus 8 ulp of the largest expected value. Both compute the same
    float32 sums in different orders, so they differ by rounding, which scales with the terms
    summed, not with the (possibly cancelled) result: measured 1.9e-5 on outputs up to 64 and
    1.2e-5 on an output of 1.5 whose terms were ~40. A wrong layout or mapping is off in the
    first digit."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5 + 8 * 2.0**-24 * scale, msg=msg)


# Sums that land on bf16 rounding boundaries, for the kernels' float32 → bf16 rounding: x · wᵀ with
# x = [1, t, t²] (t = 2^-8, half a bf16 unit at 1) against these rows of w, each sum exact in
# float32 (a few powers of two apart). Hand-worked: the first three round to 1, 1 + 4t, 1 + 2t.
BF16_TIE_T = 2.0**-8
BF16_TIE_ROWS = [
    [1.0, 1.0, 0.0],  # 1 + t: a tie, to the even 1
    [1.0 + 2 * BF16_TIE_T, 1.0, 0.0],  # 1 + 3t: a tie, to the even 1 + 4t
    [1.0, 1.0, 1.0],  # 1 + t + t²: just above the tie, up
    [-1.0, -1.0, 0.0],  # −(1 + t): to −1
    [-1.0, -1.0, 1.0],  # −1 − t + t²: just below the tie in size, to −1
    [(2 - 2**-7) * 2.0**127, 2.0**127, 0.0],  # bf16's largest + half its unit, finite in
    # float32: a tie, to the even of bf16's largest (odd) and 2^128, i.e. inf
    [float("inf"), 0.0, 0.0],
    [float("inf"), float("-inf"), 0.0],  # inf − inf: NaN
    [0.0, 0.0, 0.0],
    [-0.0, 0.0, 0.0],
]


def routed_rows(T: int, K: int, E: int, D: int, F: int, dtype=torch.float32, pad: int = 2):
    """A routed step's pieces for the one-call kernels' tests: x [T + 1, D] (the last token without
    rows), w1 [E, 2F, D] (rows with a stride of their own: `pad` columns on each side cut off),
    w2 [E, D, F], each token's K distinct experts sorted by expert as the plan sorts them:
    (x, w1, w2, token [T·K], expert [T·K], float32 weight [T·K], blocks (expert, start, stop))."""
    x = torch.randn(T + 1, D).to(dtype)
    w1 = (torch.randn(E, 2 * F, D + 2 * pad) / D**0.5).to(dtype)[:, :, pad : D + pad]
    w2 = (torch.randn(E, D, F) / F**0.5).to(dtype)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).reshape(-1)
    order = torch.argsort(ids, stable=True)
    blocks, start = [], 0
    for e, count in enumerate(torch.bincount(ids, minlength=E).tolist()):
        if count:
            blocks.append((e, start, start + count))
            start += count
    return x, w1, w2, order // K, ids[order], torch.rand(T * K), blocks
