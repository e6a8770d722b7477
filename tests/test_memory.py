"""moe_ffn._memory: large fresh CPU buffers on transparent huge pages."""

import mmap
import re
import sys
from pathlib import Path

import pytest
import torch

from moe_ffn import _memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    if not THP.exists():
        return None
    return re.search(r"\[(\w+)\]", THP.read_text()).group(1)


def _smaps_kib(address: int, field: str) -> int:
    """A field (KiB) of the mapping holding `address`, from /proc/self/smaps."""
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            current = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif current and line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _huge_kib_at(address: int) -> int:
    return _smaps_kib(address, "AnonHugePages")


def test_empty_has_the_requested_shape_dtype_and_device():
    like = torch.zeros(3, dtype=torch.bfloat16)
    t = _memory.empty(like, 4, 5, 6)
    assert t.shape == (4, 5, 6) and t.dtype == torch.bfloat16 and t.device == like.device


def _fresh_floats(n: int) -> torch.Tensor:
    """n float32 on a fresh private anonymous mapping: no page touched yet. (torch.empty may
    reuse heap memory freed by earlier tests, already faulted in on 4 KiB pages.)"""
    return torch.frombuffer(mmap.mmap(-1, n * 4, flags=mmap.MAP_PRIVATE), dtype=torch.float32)


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() not in ("madvise", "always"),
                    reason="needs Linux with transparent huge pages in madvise or always mode")
def test_advised_buffers_are_backed_by_huge_pages_once_touched():
    t = _memory.advise_huge_pages(_fresh_floats(16 << 20))  # 64 MiB
    t.fill_(1.0)
    assert _huge_kib_at(t.data_ptr() + t.numel() * 2) >= 2048
    if _thp_mode() == "madvise":  # without the advice the same buffer gets 4 KiB pages
        plain = _fresh_floats(16 << 20)
        plain.fill_(1.0)
        assert _huge_kib_at(plain.data_ptr() + plain.numel() * 2) == 0


def test_large_empty_buffers_are_advised_on_their_aligned_interior(monkeypatch):
    calls = []
    monkeypatch.setattr(_memory, "_madvise", lambda: lambda *a: calls.append(a))
    t = _memory.empty(torch.empty(0), 16 << 20)
    [(start, length, advice)] = calls
    assert advice == 14 and start % (1 << 21) == 0 and length % (1 << 21) == 0  # MADV_HUGEPAGE
    assert t.data_ptr() <= start and start + length <= t.data_ptr() + t.numel() * 4
    assert length >= t.numel() * 4 - 2 * (1 << 21)


def test_small_buffers_are_left_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(_memory, "_madvise", lambda: lambda *a: calls.append(a))
    _memory.empty(torch.empty(0), 1000)
    assert calls == []
    _memory.empty(torch.empty(0), 4 << 20)
    (start, length, advice), = calls
    assert start % (2 << 20) == 0 and length % (2 << 20) == 0 and advice == 14


def _rss_kib_at(address: int) -> int:
    return _smaps_kib(address, "Rss")


def test_zeros_reads_as_zeros_and_owns_its_memory():
    t = _memory.zeros(torch.empty(0), 3, 1 << 20)  # 12 MiB: the mapped path
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.abs().sum() == 0
    t[1].fill_(2.0)
    view = t[1, :5]
    del t  # the view keeps the mapping alive
    assert view.tolist() == [2.0] * 5
    small = _memory.zeros(torch.empty(0, dtype=torch.bfloat16), 10)
    assert small.dtype == torch.bfloat16 and small.abs().sum() == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_idle_experts_gradients_are_exact_zeros_never_written():
    """One token, top-1 of 32 experts, float64 (16 and 8 MiB weight gradients): the gradients
    equal the per-token float64 loop's, the 31 idle experts' are exact zeros, and the pages of
    those zeros were never touched (the mapping's resident size stays near one expert's)."""
    from moe_ffn import MoE
    from reference import moe_forward

    torch.manual_seed(0)
    moe = MoE(dim=256, hidden_dim=128, num_experts=32, top_k=1).double()
    x = torch.randn(1, 256, dtype=torch.float64)
    g = torch.randn(1, 256, dtype=torch.float64)
    moe(x).backward(g)
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    ref_gate_up, ref_down = (p.detach().clone().requires_grad_() for p in (gate_up, down))
    ref = moe_forward(x, moe.router.weight.detach(), ref_gate_up, ref_down, 1)
    ref.backward(g)
    torch.testing.assert_close(gate_up.grad, ref_gate_up.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(down.grad, ref_down.grad, atol=1e-12, rtol=0)
    (active,) = moe.stats.expert_ids_TK[0].tolist()
    idle = [e for e in range(32) if e != active]
    assert (gate_up.grad[idle] == 0).all() and (down.grad[idle] == 0).all()
    for grad in (gate_up.grad, down.grad):
        resident = _rss_kib_at(grad.data_ptr()) * 1024
        one_expert = grad[0].numel() * grad.element_size()
        # the active expert's slice, rounded out to whole (huge) pages; the reads above of the
        # idle experts map the kernel's shared zero page, which is not counted as resident
        assert resident <= one_expert + 2 * (2 << 20), (resident, grad.numel() * grad.element_size())
