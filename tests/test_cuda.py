"""CUDA paths: bf16 through torch's grouped GEMM (compute capability ≥ 8.0), fp32 through the
per-expert loop. Their logic also runs on CPU in tests/test_grouped.py and tests/test_moe.py
(torch's CPU grouped GEMM, forced).

These need a GPU and are skipped without one (marker `gpu`); run them with
`.venv/bin/python -m pytest -m gpu` on a CUDA machine.
"""

import pytest
import torch

from moe_ffn import MoE, SwiGLU
from reference import moe_forward

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_moe_on_cuda_matches_float64_loop(dtype, tol):
    moe = MoE(dim=64, hidden_dim=96, num_experts=8, top_k=2, dtype=torch.float64)
    x = torch.randn(300, 64, dtype=torch.float64)
    ref = moe_forward(x, moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj, 2)
    moe_cuda = MoE(moe.config, device="cuda", dtype=dtype)
    moe_cuda.load_state_dict(moe.state_dict())
    y = moe_cuda(x.to("cuda", dtype))
    assert y.dtype == dtype
    torch.testing.assert_close(y.double().cpu(), ref.detach(), atol=tol, rtol=tol)
    g = torch.randn_like(ref)
    y.backward(g.to("cuda", dtype))
    params = dict(moe.named_parameters())
    want = torch.autograd.grad(ref, list(params.values()), g)
    for (name, p), w in zip(moe_cuda.named_parameters(), want):
        scale = w.abs().max().item()
        torch.testing.assert_close(p.grad.double().cpu() / scale, w / scale, atol=tol, rtol=tol, msg=name)


def test_bf16_bank_runs_on_grouped_gemm_without_host_sync(monkeypatch):
    """bf16 on compute capability ≥ 8.0: two grouped GEMMs forward, four backward, and the
    per-expert loop (which reads the counts back to the host) never runs."""
    from moe_ffn import grouped
    from test_grouped import _count_grouped_mm

    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("torch's grouped GEMM needs compute capability 8.0")
    calls = _count_grouped_mm(monkeypatch)

    def no_host_sync(*args, **kwargs):
        raise AssertionError("the per-expert loop ran")

    monkeypatch.setattr(grouped, "_row_blocks", no_host_sync)
    moe = MoE(dim=64, hidden_dim=96, num_experts=8, top_k=2, device="cuda", dtype=torch.bfloat16)
    y = moe(torch.randn(256, 64, device="cuda", dtype=torch.bfloat16))
    assert len(calls) == 2
    y.float().square().sum().backward()
    assert len(calls) == 6


def test_moe_cuda_with_capacity_drops_zero_rows():
    moe = MoE(dim=64, hidden_dim=96, num_experts=8, top_k=2, capacity_factor=0.5, device="cuda", dtype=torch.bfloat16)
    y = moe(torch.randn(128, 64, device="cuda", dtype=torch.bfloat16))
    assert moe.stats.num_dropped.item() > 0 and torch.isfinite(y).all()


def test_dense_on_cuda():
    block = SwiGLU(64, hidden_dim=128).double()
    x = torch.randn(10, 64, dtype=torch.float64)
    cuda_block = SwiGLU(64, hidden_dim=128, device="cuda", dtype=torch.bfloat16)
    cuda_block.load_state_dict(block.state_dict())
    torch.testing.assert_close(cuda_block(x.cuda().bfloat16()).double().cpu(), block(x), atol=3e-2, rtol=3e-2)
