"""torch.compile with the default (inductor) backend. Slow on 2 cores: `make test-slow`.

The fast suite checks fullgraph tracing with the eager backend (test_moe, test_dense).
"""

import pytest
import torch

from moe_ffn import MoE, SwiGLU

pytestmark = pytest.mark.slow


def test_inductor_dense_fullgraph():
    block = SwiGLU(32, hidden_dim=64)
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(5, 32)
    torch.testing.assert_close(compiled(x), block(x))


def test_inductor_moe_fullgraph_dynamic_forward_and_backward():
    moe = MoE(dim=32, hidden_dim=48, num_experts=4, top_k=2)
    compiled = torch.compile(moe, fullgraph=True, dynamic=True)
    for T in (3, 11, 30):
        x = torch.randn(T, 32, requires_grad=True)
        y = compiled(x)
        torch.testing.assert_close(y, moe(x))
        (g,) = torch.autograd.grad(y.square().sum(), x)
        (g_ref,) = torch.autograd.grad(moe(x).square().sum(), x)
        torch.testing.assert_close(g, g_ref)
