"""Regression guard for the fast path: overheads that do not depend on FLOPs or wall time.

Speed itself is measured by profiling/bench.py. These tests pin what makes it fast and stays
true on a noisy machine: one host synchronisation per grouped op, no tensor of E·T·D
elements and no copy of the weights per token, decode touching only the chosen experts'
weights, and no Python loop over tokens. Each probe is first shown to catch the defect it
guards against, so none of them passes vacuously.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from moe_ffn import MoE, SwiGLU, _small_gemm
from moe_ffn.grouped import grouped_ffn

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# T tokens, D model dim, F hidden, E experts, K top-k: small, but E·T·D stands apart from
# every legitimate size (N·D, N·2F, one expert's weights, the weight gradients E·2F·D).
T, D, F, E, K = 32, 16, 8, 16, 2


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    return MoE(dim=D, hidden_dim=F, num_experts=E, top_k=K, **kw)


def _fwd_bwd(moe: MoE, x: torch.Tensor) -> None:
    moe.zero_grad(set_to_none=True)
    moe(x).square().sum().backward()


# --- probes ---------------------------------------------------------------------------------

class _SyncCounter:
    """Counts the ways a CPU/GPU program waits for the device: Tensor.tolist from Python, and
    aten ops that copy a value to the host (_local_scalar_dense: .item(), bool(), int()) or
    produce data-dependent shapes (nonzero, unique)."""

    PY_METHODS = ("tolist",)
    ATEN = ("aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_consecutive")

    def __init__(self, monkeypatch):
        self.python_calls = {name: 0 for name in self.PY_METHODS}
        for name in self.PY_METHODS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _name=name, _original=original, **kwargs):
                self.python_calls[_name] += 1
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)

    def run(self, fn) -> int:
        """Runs fn; returns the number of host synchronisations it made."""
        before = sum(self.python_calls.values())
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        aten = sum(e.count for e in prof.key_averages() if e.key in self.ATEN)
        return sum(self.python_calls.values()) - before + aten


def _largest_allocation(fn) -> int:
    """Bytes of the largest single CPU allocation made while fn runs (inside custom ops too),
    read from the profiler's per-allocation memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    sizes = [e["args"]["Bytes"] for e in events if e.get("name") == "[memory]"]
    return max(sizes, default=0)


def _op_count(fn) -> int:
    """Number of aten op calls fn makes (custom ops' insides included)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


# --- host synchronisation -------------------------------------------------------------------

def test_sync_probe_catches_a_sync(monkeypatch):
    counter = _SyncCounter(monkeypatch)
    counts = torch.tensor([1, 2, 3])
    assert counter.run(lambda: counts.sum().item()) == 1
    assert counter.run(lambda: counts.nonzero()) == 1
    assert counter.run(lambda: counts.tolist()) == 1


@pytest.mark.parametrize("num_experts", [4, 16])
def test_one_host_sync_per_pass_whatever_the_number_of_experts(monkeypatch, num_experts):
    counter = _SyncCounter(monkeypatch)
    torch.manual_seed(0)
    moe = MoE(dim=D, hidden_dim=F, num_experts=num_experts, top_k=K)
    x = torch.randn(T, D, requires_grad=True)
    assert counter.run(lambda: moe(x)) == 1  # the counts the expert loop needs
    y = moe(x)
    assert counter.run(lambda: y.sum().backward()) == 1


def test_dense_block_never_syncs(monkeypatch):
    counter = _SyncCounter(monkeypatch)
    block = SwiGLU(D, hidden_dim=F)
    x = torch.randn(T, D, requires_grad=True)
    assert counter.run(lambda: block(x).sum().backward()) == 0


# --- no [E, T, D] tensors, no per-token weight copies ---------------------------------------

def test_allocation_probe_catches_an_E_T_D_tensor():
    itemsize = torch.empty((), dtype=torch.float32).element_size()
    assert _largest_allocation(lambda: torch.zeros(E, T, D)) >= E * T * D * itemsize


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_E_T_D_tensor_in_forward_and_backward(dtype):
    moe = _moe().to(dtype)
    x = torch.randn(T, D, dtype=dtype, requires_grad=True)
    _fwd_bwd(moe, x)  # warm-up: one-time allocations are not the layer's
    limit = E * T * D * dtype.itemsize
    assert _largest_allocation(lambda: _fwd_bwd(moe, x)) < limit
    # a per-token copy of the weights, [T·K, 2F, D], would be larger still
    assert T * K * 2 * F * D * dtype.itemsize > limit


def test_forward_copies_neither_the_bank_nor_weights_per_token():
    """Forward allocates less than one copy of the expert bank: at most one expert's weights
    at a time (the fp32 upcast of a bf16 block, a BLAS packing buffer), never one per token."""
    moe = _moe()
    x = torch.randn(T, D)
    with torch.no_grad():
        moe(x)
        largest = _largest_allocation(lambda: moe(x))
    bank = moe.experts.gate_up_proj.numel() * 4
    assert largest < bank
    assert T * K * moe.experts.gate_up_proj[0].numel() * 4 > bank  # a per-token copy is larger still


# --- nothing of N·D kept between forward and backward (the fused CPU dispatch) -------------

def _saved_shapes(moe: MoE, x: torch.Tensor) -> list[tuple[int, ...]]:
    """Shapes of every tensor autograd keeps for backward during one forward."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe(x)
    return shapes


def test_cpu_moe_keeps_no_copy_of_the_token_rows_for_backward():
    """N = T·K rows of D (K copies of the tokens) are what permute → experts → unpermute keep
    for backward (the gathered inputs, the expert outputs); the fused op keeps the tokens
    [T, D] and the first projection [N, 2F] only. D > 2F here, so [N, D] is unambiguous."""
    torch.manual_seed(0)
    D_, F_ = 32, 8
    moe = MoE(dim=D_, hidden_dim=F_, num_experts=E, top_k=K)
    x = torch.randn(T, D_, requires_grad=True)
    N = T * K
    moe.experts.fuses_dispatch = False  # the probe catches the unfused stages' [N, D] tensors
    assert (N, D_) in _saved_shapes(moe, x)
    moe.experts.fuses_dispatch = True
    shapes = _saved_shapes(moe, x)
    assert (N, D_) not in shapes
    assert (N, 2 * F_) in shapes and (T, D_) in shapes


def _zero_filled_shapes(fn) -> list[tuple[int, ...]]:
    """Shapes of the tensors zero-filled (fill_/zero_, as torch.zeros does) while fn runs."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [
        tuple(e.input_shapes[0])
        for e in prof.events()
        if e.name in ("aten::fill_", "aten::zero_") and e.input_shapes and e.input_shapes[0]
    ]


@pytest.mark.parametrize("dense", [False, True])
def test_backward_builds_no_zero_gradient_for_the_kept_first_projection(dense):
    """The ops keep the first projection [N, 2F] for backward as a second, non-differentiable
    output; autograd would materialise a zero gradient of that size for it on every backward
    (117 MiB for Mixtral fp32 at T = 2048) unless told not to."""
    torch.manual_seed(0)
    block = SwiGLU(D, hidden_dim=F) if dense else _moe()
    x = torch.randn(T, D, requires_grad=True)
    N = T if dense else T * K
    assert (N, 2 * F) in _zero_filled_shapes(lambda: torch.zeros(N, 2 * F))  # the probe sees it
    assert (N, 2 * F) not in _zero_filled_shapes(lambda: block(x).square().sum().backward())


# --- decode touches only the chosen experts -------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_only_the_active_experts(dtype):
    """Idle experts' weights are NaN: any product that read them would turn the output NaN."""
    moe = _moe().to(dtype)
    x = torch.randn(1, D, dtype=dtype, requires_grad=True)
    with torch.no_grad():
        moe(x)
    active = set(moe.stats.expert_ids_TK.flatten().tolist())
    assert len(active) == K
    idle = [e for e in range(E) if e not in active]
    with torch.no_grad():
        for w in (moe.experts.gate_up_proj, moe.experts.down_proj):
            w[idle] = float("nan")
    with torch.no_grad():  # inference runs the forward outside the autograd Function
        assert torch.isfinite(moe(x)).all()
    y = moe(x)
    assert torch.isfinite(y).all()
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    for w in (moe.experts.gate_up_proj, moe.experts.down_proj):
        assert torch.equal(w.grad[idle], torch.zeros_like(w.grad[idle]))  # exact zeros
        assert torch.isfinite(w.grad[sorted(active)]).all()


@pytest.mark.parametrize("dtype, tokens", [(torch.float32, 1), (torch.float32, T), (torch.bfloat16, 1), (torch.bfloat16, T)])
def test_inference_forward_is_the_training_forward(dtype, tokens, monkeypatch):
    """Under no_grad the experts run without the autograd Function: the same output, bit for bit.
    (A step of up to 16 tokens without autograd runs in one call of the library instead, whose
    routing is computed in double and rounded once: its weights can differ from torch's float32
    ops in the last bits, so it is switched off here; tests/test_decode.py shows its experts'
    part bit for bit the layer's ops on the same route.)"""
    monkeypatch.setattr(MoE, "_decodes_in_one_call", lambda self: False)
    moe = _moe().to(dtype)
    x = torch.randn(tokens, D, dtype=dtype)
    with torch.no_grad():
        y_infer = moe(x)
    y_train = moe(x.requires_grad_())
    assert y_train.grad_fn is not None and torch.equal(y_infer, y_train)


def test_nan_probe_catches_a_read_of_every_expert():
    """The NaN probe above works: a dense product over all experts would be NaN."""
    moe = _moe()
    with torch.no_grad():
        moe.experts.gate_up_proj[E - 1] = float("nan")
        everything = torch.einsum("td,efd->tef", torch.randn(1, D), moe.experts.gate_up_proj)
    assert not torch.isfinite(everything).all()


def test_grouped_ffn_skips_experts_without_rows():
    w1 = torch.full((3, 2 * F, D), float("nan"))
    w2 = torch.full((3, D, F), float("nan"))
    torch.manual_seed(0)
    w1[1], w2[1] = torch.randn(2 * F, D), torch.randn(D, F)
    x = torch.randn(5, D)
    y = grouped_ffn(x, w1, w2, torch.tensor([0, 4, 0]), activation="silu", gated=True)
    assert torch.isfinite(y[:4]).all()
    assert torch.equal(y[4], torch.zeros(D))  # a row past the counted ones is zero


# --- no Python loop over tokens ---------------------------------------------------------------

@pytest.mark.parametrize("kernels", ["torch", "default"])
def test_op_count_does_not_grow_with_tokens(kernels, request):
    """top_k = E: every expert is busy at any T, so only a loop over tokens could add ops.
    (From 5 tokens up: blocks of 2–4 rows write their weight gradients as one outer product
    per row, grouped._OUTER_INNER, a bounded number of extra ops, not a loop over tokens.)
    With moe_ffn's own CPU kernel (the default where it is built) blocks run their products
    there, outside aten, in the rows _small_gemm.ranges() gives this CPU (1–8 forward rows on
    AVX-512 CPUs), decode-sized forwards in one call for all blocks (up to
    _small_gemm.BLOCKS_MAX_ROWS rows each); the two token counts stay within those ranges."""
    if kernels == "torch":
        request.getfixturevalue("torch_kernels_only")
    torch.manual_seed(0)
    moe = MoE(dim=D, hidden_dim=F, num_experts=4, top_k=4)
    limits = _small_gemm.ranges()
    counts = []
    for tokens in (5, 32) if kernels == "torch" else (5, min(16, limits.forward, limits.input_grad, _small_gemm.BLOCKS_MAX_ROWS)):
        x = torch.randn(tokens, D, requires_grad=True)
        _fwd_bwd(moe, x)
        counts.append(_op_count(lambda: _fwd_bwd(moe, x)))
    assert counts[0] == counts[1]


def test_op_count_probe_catches_a_token_loop():
    x = torch.randn(8, D)
    per_token = lambda n: [row * 2 for row in x[:n]]  # noqa: E731
    assert _op_count(lambda: per_token(8)) > _op_count(lambda: per_token(2))



_FIRST_STEP = """
import sys, torch
from moe_ffn import MoE, SwiGLU, grouped_linear
torch.manual_seed(0)
x = torch.randn(8, 16, requires_grad=True)
for block in (MoE(dim=16, hidden_dim=8, num_experts=4, top_k=2), SwiGLU(dim=16, hidden_dim=8)):
    block(x).square().sum().backward()
w = torch.randn(3, 4, 16, requires_grad=True)
grouped_linear(x, w, torch.tensor([5, 0, 3])).square().sum().backward()
assert block.gate_up_proj.grad is not None and x.grad is not None
print("torch._dynamo" in sys.modules)
"""


@pytest.mark.parametrize("through_op", [False, True])
def test_eager_training_step_does_not_import_the_compiler(through_op):
    """The first eager forward+backward in a fresh process (MoE, SwiGLU, grouped_linear) stays
    off the custom-op dispatcher, whose first call imports torch._dynamo (2.5–3.5 s on the
    2-core EPYC). The probe is shown to catch it: calling a backward op, as the eager
    backward used to, imports it."""
    script = _FIRST_STEP
    if through_op:
        script = script.replace("print(", (
            "from moe_ffn import grouped\n"
            "ones = torch.ones(2, 16)\n"
            "grouped._grouped_ffn_backward_op(ones, ones, ones, block.gate_up_proj.detach(), "
            "block.down_proj.detach(), None, 'silu', True, True, True, False)\n"
            "print("
        ))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == str(through_op)

# --- the bf16 path on CPU (fp32 products, bf16 results) ---------------------------------------

# blocks of ~2 rows: native bf16 GEMMs; ~20, ~80 and ~200 rows: fp32 products of upcast
# blocks (see grouped._NATIVE_LOWP_MAX_ROWS)
@pytest.mark.parametrize("tokens", [3, 40, 160, 400])
def test_bf16_output_and_gradients_match_float64_within_bf16_rounding(tokens):
    torch.manual_seed(0)
    # top-1 without renormalising: the combine weight is the router probability, so the
    # router's gradient is not identically zero
    cfg = dict(dim=D, hidden_dim=F, num_experts=2, top_k=1, norm_topk_prob=False)
    ref = MoE(**cfg).double()
    moe = MoE(**cfg).bfloat16()
    moe.load_state_dict(ref.state_dict())
    ref.load_state_dict(moe.state_dict())  # the same (bf16-valued) weights: routing agrees
    x64 = torch.randn(tokens, D, dtype=torch.float64, requires_grad=True)
    x16 = x64.detach().bfloat16().requires_grad_()
    g = torch.randn(tokens, D, dtype=torch.float64)
    y16, y64 = moe(x16), ref(x16.detach().double().requires_grad_())
    assert torch.equal(moe.stats.expert_ids_TK, ref.stats.expert_ids_TK)  # same routing
    y16.backward(g.bfloat16())
    y64.backward(g)

    def close(got, want):  # bf16 keeps 8 bits: ~0.4% per rounding, a few roundings deep
        scale = want.abs().max()
        assert (got.double() - want).abs().max() <= 3e-2 * scale

    close(y16, y64)
    for name, p in moe.named_parameters():
        close(p.grad, dict(ref.named_parameters())[name].grad)
