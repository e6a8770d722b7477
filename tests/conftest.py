import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/reference.py


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _clear_kernel_caches():
    """Forget what the kernel modules found out and cached (entry points, CPU checks)."""
    from moe_ffn import _amx, _decode, _small_gemm

    for module in (_small_gemm, _amx, _decode):
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


@pytest.fixture
def layer_ops(monkeypatch):
    """MoE layers on their ops (router → plan → experts' op), the one-call decode step
    (moe_ffn/_decode.py) switched off: for tests that pin the calls those ops make."""
    from moe_ffn import MoE

    monkeypatch.setattr(MoE, "_decodes_in_one_call", lambda self: False)


@pytest.fixture
def torch_kernels_only(monkeypatch):
    """moe_ffn without its own CPU kernel (moe_ffn/_small_gemm.py): every product on torch's
    kernels, as on machines where the kernel is not built. For tests of that path's choices.
    The entry points cached before are forgotten for the test, and the ones it finds missing
    after it (a None cached without the library switched the kernels off for every later test
    in the process: test_amx's found its blocks entry points gone after test_grouped's)."""
    from moe_ffn import _small_gemm

    monkeypatch.setattr(_small_gemm, "library", lambda: None)
    _clear_kernel_caches()
    yield
    monkeypatch.undo()
    _clear_kernel_caches()


@pytest.fixture(params=["avx2", "avx512"])
def torch_choices(request, monkeypatch):
    """grouped.py's choices among torch's kernels as made on an AVX2 CPU, then as on an AVX-512
    one (grouped._torch_on_avx512), whatever this CPU is: both sets compute the same function."""
    from moe_ffn import grouped

    monkeypatch.setattr(grouped, "_torch_on_avx512", lambda: request.param == "avx512")
    return request.param
