"""moe_ffn._memory: large fresh CPU buffers on transparent huge pages."""

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


def _huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            current = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif current and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_empty_has_the_requested_shape_dtype_and_device():
    like = torch.zeros(3, dtype=torch.bfloat16)
    t = _memory.empty(like, 4, 5, 6)
    assert t.shape == (4, 5, 6) and t.dtype == torch.bfloat16 and t.device == like.device


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() not in ("madvise", "always"),
                    reason="needs Linux with transparent huge pages in madvise or always mode")
def test_large_buffers_are_backed_by_huge_pages_once_touched():
    # 64 MiB: glibc maps it fresh, so no page is touched before the advice.
    t = _memory.empty(torch.empty(0), 16 << 20)
    t.fill_(1.0)
    assert _huge_kib_at(t.data_ptr() + t.numel() * 2) >= 2048
    if _thp_mode() == "madvise":  # without the advice the same buffer gets 4 KiB pages
        plain = torch.empty(16 << 20)
        plain.fill_(1.0)
        assert _huge_kib_at(plain.data_ptr() + plain.numel() * 2) == 0


def test_small_buffers_are_left_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(_memory, "_madvise", lambda: lambda *a: calls.append(a))
    _memory.empty(torch.empty(0), 1000)
    assert calls == []
    _memory.empty(torch.empty(0), 4 << 20)
    (start, length, advice), = calls
    assert start % (2 << 20) == 0 and length % (2 << 20) == 0 and advice == 14
