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


needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() not in ("madvise", "always"),
    reason="needs Linux with transparent huge pages in madvise or always mode",
)


def test_empty_has_the_requested_shape_dtype_and_device():
    like = torch.zeros(3, dtype=torch.bfloat16)
    t = _memory.empty(like, 4, 5, 6)
    assert t.shape == (4, 5, 6) and t.dtype == torch.bfloat16 and t.device == like.device


def _fresh_floats(n: int) -> torch.Tensor:
    """n float32 on a fresh private anonymous mapping: no page touched yet. (torch.empty may
    reuse heap memory freed by earlier tests, already faulted in on 4 KiB pages.)"""
    return torch.frombuffer(mmap.mmap(-1, n * 4, flags=mmap.MAP_PRIVATE), dtype=torch.float32)


@needs_thp
def test_advised_buffers_are_backed_by_huge_pages_once_touched(monkeypatch):
    monkeypatch.setattr(_memory, "huge_pages_pay", lambda: True)  # (whatever this machine's probe says)
    t = _memory.advise_huge_pages(_fresh_floats(16 << 20))  # 64 MiB
    t.fill_(1.0)
    assert _huge_kib_at(t.data_ptr() + t.numel() * 2) >= 2048
    if _thp_mode() == "madvise":  # without the advice the same buffer gets 4 KiB pages
        plain = _fresh_floats(16 << 20)
        plain.fill_(1.0)
        assert _huge_kib_at(plain.data_ptr() + plain.numel() * 2) == 0


def test_large_empty_buffers_are_advised_on_their_aligned_interior(monkeypatch):
    calls = []
    monkeypatch.setattr(_memory, "huge_pages_pay", lambda: True)
    monkeypatch.setattr(_memory, "_madvise", lambda: lambda *a: calls.append(a))
    t = _memory.empty(torch.empty(0), 16 << 20)
    [(start, length, advice)] = calls
    assert advice == 14 and start % (1 << 21) == 0 and length % (1 << 21) == 0  # MADV_HUGEPAGE
    assert t.data_ptr() <= start and start + length <= t.data_ptr() + t.numel() * 4
    assert length >= t.numel() * 4 - 2 * (1 << 21)


def test_small_buffers_are_left_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(_memory, "huge_pages_pay", lambda: True)
    monkeypatch.setattr(_memory, "_madvise", lambda: lambda *a: calls.append(a))
    _memory.empty(torch.empty(0), 1000)
    assert calls == []
    _memory.empty(torch.empty(0), 4 << 20)
    (start, length, advice), = calls
    assert start % (2 << 20) == 0 and length % (2 << 20) == 0 and advice == 14


def test_no_advice_where_huge_pages_do_not_pay(monkeypatch):
    calls = []
    monkeypatch.setattr(_memory, "_madvise", lambda: lambda *a: calls.append(a))
    monkeypatch.setattr(_memory, "huge_pages_pay", lambda: False)
    t = _memory.empty(torch.empty(0), 16 << 20)
    assert calls == [] and t.shape == (16 << 20,)


@pytest.mark.parametrize("plain, advised, expected", [(1.0, 5.0, False), (2.0, 1.0, True), (1.0, 1.0, True)])
def test_huge_pages_pay_where_they_fault_in_at_least_as_fast(monkeypatch, plain, advised, expected):
    """The probe's decision from its two timings (faked here), and the environment's setting
    over any probe."""
    monkeypatch.delenv("MOE_FFN_HUGE_PAGES", raising=False)
    monkeypatch.setattr(_memory, "_madvise", lambda: lambda *a: 0)
    monkeypatch.setattr(_memory, "_first_touch_seconds", lambda advise: advised if advise else plain)
    assert _memory.huge_pages_pay.__wrapped__() is expected
    for setting, decided in (("0", False), ("1", True)):
        monkeypatch.setenv("MOE_FFN_HUGE_PAGES", setting)
        assert _memory.huge_pages_pay.__wrapped__() is decided


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs madvise")
def test_huge_pages_probe_sums_its_rounds(monkeypatch):
    """One slow advised touch among fast ones (the kernel compacting memory for a huge page)
    decides against the advice: the times are summed over the rounds, not the best taken."""
    monkeypatch.delenv("MOE_FFN_HUGE_PAGES", raising=False)
    monkeypatch.setattr(_memory, "_madvise", lambda: lambda *a: 0)
    advised = iter([0.02] + [0.0001] * (_memory._PROBE_ROUNDS - 1))
    monkeypatch.setattr(_memory, "_first_touch_seconds", lambda advise: next(advised) if advise else 0.001)
    assert _memory.huge_pages_pay.__wrapped__() is False
    advised = iter([0.0001] * _memory._PROBE_ROUNDS)
    assert _memory.huge_pages_pay.__wrapped__() is True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs madvise")
def test_first_touch_probe_times_a_real_first_touch():
    for advise in (False, True):
        seconds = _memory._first_touch_seconds(advise)
        assert 0 < seconds < 5


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the pages under t's own byte range that are mapped in, from /proc/self/pagemap
    (bit 63 of each page's entry: present). Not smaps' Rss: the kernel merges neighbouring
    mappings with the same flags into one, so a mapping's Rss can count another tensor's pages
    (on 2026-12-06 a gradient's mapping merged with the huge-page weights' beside it)."""
    page = mmap.PAGESIZE
    first = t.data_ptr() // page
    last = (t.data_ptr() + t.numel() * t.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = pagemap.read((last - first + 1) * 8)
    present = sum(int.from_bytes(entries[i : i + 8], "little") >> 63 for i in range(0, len(entries), 8))
    return present * page


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")
def test_idle_experts_gradients_are_exact_zeros_never_written():
    """One token, top-1 of 32 experts, float64 (16 and 8 MiB weight gradients): the gradients
    equal the per-token float64 loop's, the 31 idle experts' are exact zeros, and the pages of
    those zeros were never touched (the pages under the gradient stay near one expert's)."""
    from moe_ffn import MoE
    from reference import moe_forward

    torch.manual_seed(0)
    moe = MoE(dim=256, hidden_dim=128, num_experts=32, top_k=1).double()
    x = torch.randn(1, 256, dtype=torch.float64)
    g = torch.randn(1, 256, dtype=torch.float64)
    moe(x).backward(g)
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    for grad in (gate_up.grad, down.grad):  # (before the checks below read them: on 4 KiB pages
        # those reads mapped pages here, 2026-12-03, where on huge pages they map the zero page)
        resident = _resident_bytes(grad)
        one_expert = grad[0].numel() * grad.element_size()
        # the active expert's slice, rounded out to whole (huge) pages
        assert resident <= one_expert + 2 * (2 << 20), (resident, grad.numel() * grad.element_size())
    ref_gate_up, ref_down = (p.detach().clone().requires_grad_() for p in (gate_up, down))
    ref = moe_forward(x, moe.router.weight.detach(), ref_gate_up, ref_down, 1)
    ref.backward(g)
    torch.testing.assert_close(gate_up.grad, ref_gate_up.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(down.grad, ref_down.grad, atol=1e-12, rtol=0)
    (active,) = moe.stats.expert_ids_TK[0].tolist()
    idle = [e for e in range(32) if e != active]
    assert (gate_up.grad[idle] == 0).all() and (down.grad[idle] == 0).all()


# --- a weight's gradient memory, kept for its next gradient ---------------------------------

needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mapped buffers are Linux-only")


@pytest.fixture
def keep(monkeypatch):
    monkeypatch.setattr(_memory, "_keep_gradient_memory", lambda: True)
    yield
    _memory.release_gradient_memory()


@needs_linux
def test_gradient_memory_is_reused_only_once_no_tensor_holds_it(keep):
    weight = torch.empty(4, 512, 1024)  # 8 MiB: the mapped path
    like = torch.empty(0)
    first, stale = _memory.gradient_memory(weight, like, [0, 1, 2])
    assert first.shape == weight.shape and first.dtype == torch.float32 and (first == 0).all() and not stale
    first.fill_(3.0)
    view = first[2, :4, :4]
    del first
    second, stale = _memory.gradient_memory(weight, like, [0, 1, 2])  # the view still holds the first
    assert (view == 3.0).all() and (second == 0).all() and not stale
    assert not (view.data_ptr() - weight.numel() * 4 < second.data_ptr() < view.data_ptr() + weight.numel() * 4)
    address = second.data_ptr()
    second.fill_(5.0)
    del second
    # the second is gone: its memory again, the written experts' slices stale, the idle one zero
    third, stale = _memory.gradient_memory(weight, like, [0, 1, 2])
    assert third.data_ptr() == address and stale
    assert (third[:3] == 5.0).all() and (third[3] == 0).all() and (view == 3.0).all()
    third.fill_(7.0)
    del third
    # one expert of four written: the idle slices' pages are given back and read as zeros, the
    # written slice keeps its pages (stale)
    fourth, stale = _memory.gradient_memory(weight, like, [1])
    assert fourth.data_ptr() == address and stale
    assert (fourth[1] == 7.0).all() and (fourth[[0, 2, 3]] == 0).all()


@needs_linux
@pytest.mark.parametrize(
    "shape", [(9, 120, 1000), (9, 128, 1024), (9, 120, 1001), (1200, 1, 1000)],
    ids=["slices-of-480000-B", "page-aligned-slices", "odd-slices", "slices-under-a-page"],
)
def test_giving_back_idle_slices_clears_exactly_them(keep, shape):
    """Mostly idle: each idle slice's whole pages are given back and the parts of pages it
    shares with a neighbour zeroed by hand; the written slices, and the bytes of shared pages
    that belong to them, keep their values."""
    weight = torch.empty(shape)
    like = torch.empty(0)
    E = shape[0]
    first, _ = _memory.gradient_memory(weight, like, list(range(E)))
    values = torch.arange(1.0, E + 1.0).view(E, 1, 1).expand(shape)
    first.copy_(values)
    del first
    written = [2, 3, 7]
    grad, stale = _memory.gradient_memory(weight, like, written)
    assert stale
    assert torch.equal(grad[written], values[written])
    idle = [e for e in range(E) if e not in written]
    assert (grad[idle] == 0).all()


@needs_linux
def test_gradient_memory_goes_with_the_weight_and_on_release(keep):
    weight = torch.empty(4, 512, 1024)
    grad, _ = _memory.gradient_memory(weight, torch.empty(0), [0, 1, 2, 3])
    assert len(_memory._kept) == 1
    del weight
    assert len(_memory._kept) == 0
    weight = torch.empty(4, 512, 1024)
    del grad
    _memory.gradient_memory(weight, torch.empty(0), [0, 1, 2, 3])
    _memory.release_gradient_memory()
    assert len(_memory._kept) == 0


def test_gradient_memory_switched_off_gives_fresh_zeros(monkeypatch):
    monkeypatch.setattr(_memory, "_keep_gradient_memory", lambda: False)
    weight = torch.empty(4, 512, 1024)
    a, stale = _memory.gradient_memory(weight, torch.empty(0), [0, 1, 2, 3])
    a.fill_(1.0)
    del a
    b, stale = _memory.gradient_memory(weight, torch.empty(0), [0, 1, 2, 3])
    assert (b == 0).all() and not stale and len(_memory._kept) == 0


@needs_linux
@pytest.mark.parametrize("tokens", [(64, 1), (1, 64), (64, 64)], ids=["all-then-one", "one-then-all", "all-then-all"])
@pytest.mark.parametrize("large", [False, True], ids=["cache-sized", "as-if-large"])
def test_steps_on_kept_gradient_memory_match_the_reference_loop(keep, tokens, large, monkeypatch):
    """Two training steps, `.grad` dropped in between as `zero_grad()` does: each step's
    weight gradients equal the float64 per-token loop's, the second step's are made on the
    first step's memory, and experts idle in a step have exact zero gradients whatever the
    memory held (64 tokens reach most of the 32 experts, 1 token one of them). as-if-large:
    every gradient is treated as one that outgrows the cache (grouped._ACCUMULATE_ELEMENTS),
    which is written onto zeros when fresh and over the old gradient when kept."""
    from moe_ffn import MoE, grouped
    from reference import moe_forward

    if large:
        monkeypatch.setattr(grouped, "_ACCUMULATE_ELEMENTS", 0)
    torch.manual_seed(0)
    moe = MoE(dim=256, hidden_dim=128, num_experts=32, top_k=1).double()
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    addresses = []
    for T in tokens:
        x = torch.randn(T, 256, dtype=torch.float64)
        g = torch.randn(T, 256, dtype=torch.float64)
        moe(x).backward(g)
        ref_gate_up, ref_down = (p.detach().clone().requires_grad_() for p in (gate_up, down))
        moe_forward(x, moe.router.weight.detach(), ref_gate_up, ref_down, 1).backward(g)
        torch.testing.assert_close(gate_up.grad, ref_gate_up.grad, atol=1e-12, rtol=0)
        torch.testing.assert_close(down.grad, ref_down.grad, atol=1e-12, rtol=0)
        active = set(moe.stats.expert_ids_TK.flatten().tolist())
        idle = [e for e in range(32) if e not in active]
        assert idle and (gate_up.grad[idle] == 0).all() and (down.grad[idle] == 0).all()
        addresses.append((gate_up.grad.data_ptr(), down.grad.data_ptr()))
        moe.zero_grad(set_to_none=True)
    assert addresses[0] == addresses[1]


@needs_linux
def test_accumulating_over_micro_batches_on_kept_gradient_memory(keep):
    """`.grad` kept between backward calls: the second call's gradient needs memory of its
    own (the first is still `.grad`), and the sum is the sum of the two calls' gradients;
    a third call reuses the second's memory once autograd has added it in."""
    from moe_ffn import MoE

    torch.manual_seed(0)
    moe = MoE(dim=256, hidden_dim=128, num_experts=32, top_k=2).double()
    xs = [torch.randn(48, 256, dtype=torch.float64) for _ in range(3)]
    expected = []
    for x in xs:
        moe.zero_grad(set_to_none=True)
        moe(x).sum().backward()
        expected.append(moe.experts.gate_up_proj.grad.clone())
    _memory.release_gradient_memory()
    moe.zero_grad(set_to_none=True)
    for x in xs:
        moe(x).sum().backward()
    torch.testing.assert_close(moe.experts.gate_up_proj.grad, sum(expected), atol=1e-10, rtol=0)


def test_environment_switch_turns_kept_gradient_memory_off():
    import os
    import subprocess

    code = "from moe_ffn import _memory; print(_memory._keep_gradient_memory())"
    for value, expected in (("0", "False"), ("1", "True")):
        env = dict(os.environ, MOE_FFN_KEEP_GRADIENT_MEMORY=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected


# --- scratch memory for temporaries ----------------------------------------------------------

@pytest.fixture
def pool():
    """An empty scratch pool for the test, emptied again after it."""
    if not sys.platform.startswith("linux"):
        pytest.skip("scratch mappings are made on Linux only")
    _memory.release_gradient_memory()
    yield _memory._pool
    _memory.release_gradient_memory()


def test_scratch_is_reused_only_once_no_tensor_holds_it(pool):
    like = torch.empty(0)
    a = _memory.scratch(like, 2048, 1024)  # 8 MiB
    assert a.shape == (2048, 1024) and a.dtype == torch.float32 and len(pool) == 1
    address = a.data_ptr()
    b = _memory.scratch(like, 2048, 1024)
    assert b.data_ptr() != address and len(pool) == 2  # a still holds the first mapping
    view = a[10:20]
    del a
    c = _memory.scratch(like, 2048, 1024)
    assert c.data_ptr() not in (address, b.data_ptr()) and len(pool) == 3  # a view holds it too
    del view
    d = _memory.scratch(like, 1900, 1024, dtype=torch.float32)  # a little smaller: the same size class
    assert d.data_ptr() == address and len(pool) == 3
    d.fill_(2.0)
    assert bool((d == 2).all())


def test_scratch_of_other_sizes_and_small_or_huge_requests(pool):
    like = torch.empty(0, dtype=torch.bfloat16)
    a = _memory.scratch(like, 4096, 1024)  # 8 MiB
    address = a.data_ptr()
    del a
    big = _memory.scratch(like, 4096, 4096)  # 32 MiB: more than twice the free mapping, a new one
    assert big.data_ptr() != address and len(pool) == 2
    small = _memory.scratch(like, 16, 16)  # under _SCRATCH_MIN_BYTES: an ordinary tensor, not pooled
    assert small.shape == (16, 16) and len(pool) == 2
    assert _memory._size_class(1) == 2 << 20 and _memory._size_class((2 << 20) + 1) == 4 << 20
    assert _memory._size_class(37 << 20) == 40 << 20  # 8 steps per doubling past 32 MiB: 4 MiB steps


def test_scratch_pools_temporaries_from_128_kib_not_only_huge_page_sized_ones(pool):
    like = torch.empty(0)
    assert _memory._SCRATCH_MIN_BYTES == 128 << 10 < _memory._MIN_BYTES
    a = _memory.scratch(like, 256, 128)  # exactly 128 KiB: pooled
    assert len(pool) == 1
    address = a.data_ptr()
    del a
    b = _memory.scratch(like, 512, 1024)  # 2 MiB, the same size class: the same mapping again
    assert b.data_ptr() == address and len(pool) == 1
    c = _memory.scratch(like, 255, 128)  # a row short of 128 KiB: malloc's, as before
    assert len(pool) == 1 and c.shape == (255, 128)


def test_a_training_steps_temporaries_come_from_the_pool_after_warm_up(pool, monkeypatch):
    """The regression guard for _SCRATCH_MIN_BYTES: after a warm-up step, every temporary of a
    fp32 forward+backward step of 128 KiB or more (here 0.25–2 MiB: a group's gathered rows,
    activations and their gradients) lies in a pool mapping, and the step maps nothing new.
    With the pool starting at 4 MiB, these went to malloc, whose heap trimming made them fault
    in afresh every step: ~1100–1800 pages a step for this layer in a fresh process (2-core
    Xeon), ~2700 for Mixtral's fp32 forward+backward at T = 256."""
    from moe_ffn import MoE

    torch.manual_seed(0)
    moe = MoE(dim=256, hidden_dim=512, num_experts=4, top_k=2)
    x, g = torch.randn(512, 256, requires_grad=True), torch.randn(512, 256)

    def step():
        moe.zero_grad(set_to_none=True)
        x.grad = None
        moe(x).backward(g)

    step()
    real_scratch, real_map = _memory.scratch, _memory._map
    sizes, outside, mapped = [], [], []

    def scratch(like, *shape, dtype=None):
        t = real_scratch(like, *shape, dtype=dtype)
        nbytes = t.numel() * t.element_size()
        if nbytes >= 128 << 10:
            sizes.append(nbytes)
            spans = [(torch.frombuffer(b, dtype=torch.uint8).data_ptr(), len(b)) for b in pool]
            if not any(s <= t.data_ptr() and t.data_ptr() + nbytes <= s + n for s, n in spans):
                outside.append(nbytes)
        return t

    monkeypatch.setattr(_memory, "scratch", scratch)
    monkeypatch.setattr(_memory, "_map", lambda nbytes: mapped.append(nbytes) or real_map(nbytes))
    step()
    assert any(n < _memory._MIN_BYTES for n in sizes), sizes  # (the sizes the guard is about)
    assert not outside, f"temporaries of {outside} bytes not on the pool's mappings"
    assert not mapped, f"a step after warm-up mapped {mapped} bytes anew"


def test_scratch_keeps_at_most_the_free_bytes_allowed(pool, monkeypatch):
    monkeypatch.setattr(_memory, "_POOL_FREE_BYTES", 10 << 20)
    like = torch.empty(0)
    held = [_memory.scratch(like, 1 << 20) for _ in range(3)]  # 4 MiB each
    assert len(pool) == 3
    del held
    _memory.scratch(like, 4 << 20)  # 16 MiB: the three free ones (12 MiB) are trimmed to 8 MiB
    assert len(pool) == 3 and sorted(len(b) for b in pool) == [4 << 20, 4 << 20, 16 << 20]


def test_environment_switch_turns_scratch_memory_off():
    import subprocess

    code = "import torch; from moe_ffn import _memory; _memory.scratch(torch.empty(0), 1 << 22); print(len(_memory._pool))"
    env = dict(__import__("os").environ, MOE_FFN_KEEP_SCRATCH_MEMORY="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


# --- expert weights on huge pages -------------------------------------------------------------

def _interior(t: torch.Tensor) -> int:
    """An address inside t's memory at least a huge page from its ends."""
    return t.data_ptr() + t.numel() * t.element_size() // 2


def _bank_weights(bank) -> list[torch.Tensor]:
    return [w for w, _ in bank._projections()]


@needs_thp
@pytest.mark.parametrize("make", ["gated", "classic", "dense"])
def test_expert_weights_are_made_on_huge_pages(monkeypatch, make):
    from moe_ffn import GatedExperts, MLPExperts, SwiGLU

    monkeypatch.setattr(_memory, "huge_pages_pay", lambda: True)
    bank = {  # weights of 4-23 MiB
        "gated": lambda: GatedExperts(num_experts=8, dim=256, hidden_dim=512),
        "classic": lambda: MLPExperts(num_experts=4, dim=512, hidden_dim=1024),
        "dense": lambda: SwiGLU(dim=1024),
    }[make]()
    for w in _bank_weights(bank):
        assert isinstance(w, torch.nn.Parameter) and w.requires_grad and w.is_contiguous()
        assert _huge_kib_at(_interior(w)) >= 2048, w.shape
        bound = 1.0 / w.shape[-1] ** 0.5  # initialised as before (nn.Linear's bound), not left empty
        assert 0 < w.abs().max() <= bound and w.std() > bound / 3


@needs_thp
def test_expert_weights_moved_by_to_land_on_huge_pages(monkeypatch):
    from moe_ffn import MoE

    monkeypatch.setattr(_memory, "huge_pages_pay", lambda: False)
    moe = MoE(dim=512, hidden_dim=512, num_experts=8, top_k=2)  # (bf16 weights of 8 and 4 MiB)
    params = _bank_weights(moe.experts)
    for w in params:  # onto 4 KiB pages for certain (torch.empty may hand back heap memory that
        w.data = _fresh_floats(w.numel()).view(w.shape).copy_(w.detach())  # an earlier test advised)
    if _thp_mode() == "madvise":
        assert all(_huge_kib_at(_interior(w)) == 0 for w in params)
    expected = [w.detach().to(torch.bfloat16) for w in params]
    monkeypatch.setattr(_memory, "huge_pages_pay", lambda: True)
    moe.to(torch.bfloat16)
    for w, want, before in zip(_bank_weights(moe.experts), expected, params):
        assert w is before and w.dtype == torch.bfloat16 and w.requires_grad  # the same Parameter
        assert torch.equal(w, want)
        assert _huge_kib_at(_interior(w)) >= 2048
    moved = [w.data_ptr() for w in params]
    moe.to(torch.bfloat16)  # nothing moved: nothing copied
    assert [w.data_ptr() for w in params] == moved


@needs_linux
def test_weights_in_shared_memory_stay_there(monkeypatch):
    from moe_ffn import GatedExperts

    monkeypatch.setattr(_memory, "huge_pages_pay", lambda: True)
    bank = GatedExperts(num_experts=8, dim=256, hidden_dim=512)
    bank.share_memory()
    assert all(w.is_shared() for w in _bank_weights(bank))


def test_on_huge_pages_copies_only_whole_plain_cpu_tensors_where_they_pay(monkeypatch):
    monkeypatch.setattr(_memory, "huge_pages_pay", lambda: True)
    big = torch.randn(2, 1 << 20)  # 8 MiB
    if sys.platform.startswith("linux"):
        copy = _memory.on_huge_pages(big)
        assert copy is not big and copy.data_ptr() != big.data_ptr() and torch.equal(copy, big)
        assert copy.dtype == big.dtype and copy.shape == big.shape and copy.is_contiguous()
    leaves = [
        torch.randn(1000),  # small
        torch.randn(3, 1 << 20)[1:],  # a view into a larger storage
        torch.randn(1 << 20, 2).t(),  # not contiguous
        torch.randn(2, 1 << 20).share_memory_(),  # shared memory
        torch.nn.Parameter(torch.randn(2, 1 << 20)),  # a subclass (e.g. a parameter, not its .data)
    ]
    for t in leaves:
        assert _memory.on_huge_pages(t) is t
    monkeypatch.setattr(_memory, "huge_pages_pay", lambda: False)
    assert _memory.on_huge_pages(big) is big


@needs_linux
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_on_huge_page_weights_computes_the_same_bits(monkeypatch, dtype):
    """Where the weights lie (our page-aligned mapping or torch's allocation) changes no path
    or sum: the output and every gradient are the same bits."""
    from moe_ffn import MoE

    layers = []
    for pay in (False, True):
        monkeypatch.setattr(_memory, "huge_pages_pay", lambda pay=pay: pay)
        torch.manual_seed(0)
        layers.append(MoE(dim=256, hidden_dim=512, num_experts=8, top_k=2).to(dtype))
    monkeypatch.undo()
    x = torch.randn(24, 256, dtype=dtype)
    g = torch.randn(24, 256, dtype=dtype)
    results = []
    for layer in layers:
        xi = x.clone().requires_grad_()
        layer(xi).backward(g)
        results.append([xi.grad] + [p.grad for p in layer.parameters()])
        results[-1].append(layer(x))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@needs_thp
def test_expert_parallel_shards_are_copied_onto_huge_pages(monkeypatch):
    from moe_ffn import GatedExperts
    from moe_ffn.parallel import ExpertParallelExperts

    monkeypatch.setattr(_memory, "huge_pages_pay", lambda: True)
    full = GatedExperts(num_experts=8, dim=512, hidden_dim=512)
    shard = ExpertParallelExperts(full, None, rank=1, world_size=2)  # experts 4-7 (8 and 4 MiB)
    for mine, whole in zip(_bank_weights(shard), _bank_weights(full)):
        assert isinstance(mine, torch.nn.Parameter) and mine.requires_grad
        assert torch.equal(mine, whole[4:]) and mine.data_ptr() != whole[4:].data_ptr()
        assert _huge_kib_at(_interior(mine)) >= 2048
