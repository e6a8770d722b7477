"""pytest plugin: run the suite on an AVX-512/AMX CPU as on one that torch runs at AVX2 only
(the AVX2-only EPYC that CI ran on, 2026-12-04): `make test-avx2`, which sets
ATEN_CPU_CAPABILITY=avx2. MKL and oneDNN still choose their own code for the CPU they find
(limiting them too, MKL_ENABLE_INSTRUCTIONS / ONEDNN_MAX_CPU_ISA = AVX2, changed the order of
an sgemm's sums on a Xeon that the real AVX2 EPYC keeps: two bit-for-bit router tests failed
there and not on the EPYC).

torch's CPU feature queries and moe_ffn's own AVX-512/AMX entry points are made to answer
"no" before any test runs, so every routing choice and every test expectation takes its AVX2
branch; the kernels that run are the AVX2 ones. Checked against that CI run: at the commit
it failed on, this reproduced its failures and its pass and skip counts exactly."""
import os

import torch

import moe_ffn._amx as _amx
import moe_ffn._small_gemm as _small_gemm

if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() != "avx2":
    raise RuntimeError(f"avx2_machine needs ATEN_CPU_CAPABILITY=avx2, got {os.environ.get('ATEN_CPU_CAPABILITY')!r}")

for _name in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
_amx.available = lambda: False
_amx.swiglu_available = lambda: False
_amx.swiglu_forward_available = lambda: False
_small_gemm._avx512_entry_points = lambda: None
