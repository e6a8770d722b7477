# `make test` and `make profile` work on a fresh machine: they create .venv, install torch
# (pinned, overridable: `make test TORCH="torch==2.14.1"`), then this package with its extras.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-slow test-avx2 profile bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml moe_ffn/_small_gemm.cpp moe_ffn/_amx.cpp moe_ffn/_avx512.cpp moe_ffn/_decode.cpp moe_ffn/_team.h moe_ffn/_bf16x16.h moe_ffn/_exp16.h moe_ffn/_swiglu16.h moe_ffn/_entry_points.h moe_ffn/_bf16.h
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,profile]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# the suite as on a CPU that torch runs at AVX2 only, on any x86 CPU (see tests/avx2_machine.py)
test-avx2: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=tests $(PY) -m pytest -q -p avx2_machine

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow"

profile: $(STAMP)
	$(VENV)/bin/moe-ffn profile

bench: $(STAMP)
	$(PY) profiling/bench.py

clean:
	rm -rf $(VENV) runs profiling/results/*.trace.json
