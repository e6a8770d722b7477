"""profiling/bench.py's bookkeeping: warm-up and round counts, the roofline's FLOPs and bytes,
and the verdicts on the issue's targets. Times come from a fake clock, so nothing here is
timed; the numbers checked are worked out by hand in each test."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

_PATH = Path(__file__).resolve().parents[1] / "profiling" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("moe_ffn_bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


class _Clock:
    """perf_counter for the bench: advanced only by the fake implementations' calls."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def _impls(clock, durations):
    """name -> (module, fn); the k-th call of `name` takes durations[name][k] seconds (the last
    entry repeats). Returns the impls and the list the calls are logged to."""
    log = []

    def make(name):
        def fn(x):
            k = sum(1 for n in log if n == name)
            log.append(name)
            clock.now += durations[name][min(k, len(durations[name]) - 1)]
            return x * 1.0

        return nn.Linear(1, 1), fn

    return {name: make(name) for name in durations}, log


def _run(bench, monkeypatch, durations, warmup_s, budget_s=3.0, reps_max=11):
    clock = _Clock()
    monkeypatch.setattr(bench.time, "perf_counter", clock.perf_counter)
    impls, log = _impls(clock, durations)
    x = torch.ones(2, 1)
    times, warm = bench.run_case(impls, list(durations), x, torch.ones(2, 1), False, reps_max, budget_s, warmup_s)
    return times, warm, log


def test_warm_up_runs_each_implementation_until_its_calls_fill_the_warm_up_time(bench, monkeypatch):
    # fast: 0.5 s calls, 4 fill 2 s; slow: one 2.5 s call fills it; cold: 1.5 s then 0.2 s
    # calls, 1.5 + 0.2 + 0.2 + 0.2 = 2.1 s after 4.
    times, warm, log = _run(bench, monkeypatch, {"fast": [0.5], "slow": [2.5], "cold": [1.5, 0.2]}, warmup_s=2.0)
    assert warm["fast"] == (4, pytest.approx(2.0))
    assert warm["slow"] == (1, pytest.approx(2.5))
    assert warm["cold"] == (4, pytest.approx(2.1))
    # Rounds from the last warm-up call: 3 s / 0.5 = 6, 3 s / 2.5 → at least 3, 3 s / 0.2 = 15 → 11.
    assert [len(times[n]) for n in ("fast", "slow", "cold")] == [6, 3, 11]
    assert times["cold"] == [pytest.approx(0.2)] * 11
    # warm-up in rounds: the first runs all three, the second the two still due (slow is warm)
    assert sorted(log[:3]) == ["cold", "fast", "slow"] and sorted(log[3:5]) == ["cold", "fast"]


def test_each_implementation_runs_after_each_other_and_never_twice_in_a_row(bench, monkeypatch):
    """What ran just before a call changes its time (its weights in the caches, its dirty lines
    written back): over the rounds every implementation follows each of the others, and none
    follows itself while another is left."""
    names = ["a", "b", "c", "d", "e"]
    times, _, log = _run(bench, monkeypatch, {n: [0.01] for n in names}, warmup_s=0.0, budget_s=0.5, reps_max=30)
    assert all(len(times[n]) == 30 for n in names)
    pairs = list(zip(log, log[1:]))
    assert all(before != after for before, after in pairs)
    for n in names:
        assert {before for before, after in pairs if after == n} == set(names) - {n}, n
    # the same order in every run (a seeded shuffle)
    assert _run(bench, monkeypatch, {n: [0.01] for n in names}, warmup_s=0.0, budget_s=0.5, reps_max=30)[2] == log


def test_no_warm_up_time_means_one_warm_up_call(bench, monkeypatch):
    _, warm, _ = _run(bench, monkeypatch, {"a": [0.1], "b": [0.3]}, warmup_s=0.0)
    assert warm == {"a": (1, pytest.approx(0.1)), "b": (1, pytest.approx(0.3))}


def test_warm_up_stops_at_its_call_limit(bench, monkeypatch):
    _, warm, _ = _run(bench, monkeypatch, {"tiny": [0.001]}, warmup_s=10.0)
    assert warm["tiny"][0] == bench._WARMUP_MAX_CALLS


def test_a_call_longer_than_three_budgets_is_timed_once(bench, monkeypatch):
    times, _, _ = _run(bench, monkeypatch, {"huge": [10.0]}, warmup_s=2.0, budget_s=3.0)
    assert times["huge"] == [pytest.approx(10.0)]


def test_active_cost_counts_the_active_experts_flops_and_bytes(bench):
    mixtral = bench.SHAPES["mixtral"]  # D=1024, F=3584, k=2
    flops, nbytes = bench.active_cost(mixtral, 16, 8, 4, backward=False, dense=False)
    assert flops == 2 * 16 * 2 * 3 * 1024 * 3584 == 704_643_072
    assert nbytes == 8 * 3 * 1024 * 3584 * 4 + 2 * 16 * 1024 * 4 == 352_452_608
    flops, nbytes = bench.active_cost(mixtral, 16, 8, 4, backward=True, dense=False)
    assert flops == 3 * 704_643_072
    assert nbytes == 3 * 8 * 3 * 1024 * 3584 * 4 + 2 * 2 * 16 * 1024 * 4
    # the dense k·F block reads k experts' worth of weights whatever the routing
    _, nbytes = bench.active_cost(mixtral, 1, 1, 2, backward=False, dense=True)
    assert nbytes == 2 * 3 * 1024 * 3584 * 2 + 2 * 1024 * 2


def test_roofline_is_the_slower_of_compute_and_memory(bench):
    ceilings = {"gemm_fp32_gflops": 100.0, "gemm_best_gflops": 100.0, "bandwidth_gbs": 10.0}
    row = {"dtype": "fp32", "flops": 2e9, "bytes": 1e8, "median_s": 0.04}  # 20 ms of GEMM, 10 ms of memory
    bench._add_roofline(row, ceilings)
    assert row["roofline_s"] == pytest.approx(0.02) and row["frac_roofline"] == pytest.approx(0.5)
    row = {"dtype": "fp32", "flops": 1e8, "bytes": 1e9, "median_s": 0.2}  # 1 ms of GEMM, 100 ms of memory
    bench._add_roofline(row, ceilings)
    assert row["roofline_s"] == pytest.approx(0.1) and row["frac_roofline"] == pytest.approx(0.5)


def _row(impl, T, median_s, roofline_s=None, pass_name="fwd+bwd", frac=0.9):
    return {"config": "mixtral", "dtype": "fp32", "pass": pass_name, "T": T, "impl": impl,
            "median_s": median_s, "roofline_s": roofline_s, "frac_roofline": frac, "frac_best": frac}


def test_targets_scale_the_2x_goal_by_what_the_roofline_leaves(bench):
    rows = [
        # T=16: transformers at 1.0 s, roofline 0.2 s leaves 5× → the goal is 2×; 0.45 s is 2.22×.
        _row("moe_ffn", 16, 0.45, 0.2), _row("hf_grouped_mm", 16, 1.0), _row("hf_eager", 16, 3.0),
        # T=256: transformers at 0.5 s, roofline 0.25 s leaves 2× → goal 0.75·2 = 1.5×; 0.4 s is 1.25×.
        _row("moe_ffn", 256, 0.4, 0.25), _row("hf_grouped_mm", 256, 0.5),
        # forward T=1 at 0.9× of transformers: "never slower" is missed.
        _row("moe_ffn", 1, 1.0, 0.5, "fwd"), _row("hf_grouped_mm", 1, 0.9, None, "fwd"),
    ]
    bench._add_speedups(rows)
    text = bench.targets({"rows": rows})
    assert "- MISSED: never slower than the faster transformers path (slower at 1 of 3 cases: mixtral fp32 fwd 1 ×0.90)" in text
    assert "- met: mixtral fp32 fwd+bwd T=16: ×2.22 over hf_grouped_mm (target ×2.00; the roofline allows ×5.0)" in text
    assert "- MISSED: mixtral fp32 fwd+bwd T=256: ×1.25 over hf_grouped_mm (target ×1.50; the roofline allows ×2.0)" in text


def test_a_row_faster_than_the_roofline_marks_the_run_unreliable(bench):
    rows = [_row("moe_ffn", 16, 0.45, 0.2), _row("hf_grouped_mm", 16, 1.0)]
    bench._add_speedups(rows)
    assert "NOT RELIABLE" not in bench.targets({"rows": rows})
    rows[1]["frac_best"] = rows[1]["frac_roofline"] = 1.17  # transformers' row above the roofline
    text = bench.targets({"rows": rows})
    assert "- NOT RELIABLE: 1 rows ran faster than this run's roofline (up to 1.17 of it)" in text


def test_ceilings_are_the_best_readings_over_all_probes(bench):
    """Short probes between cases carry fp32 and at most the case's dtype: each ceiling is the
    best reading of the probes that have it, with that probe's layout."""
    start = {"gemm_fp32_gflops": 80.0, "gemm_fp32_layout": "a@bT", "gemm_bf16_gflops": 11.0,
             "gemm_bf16_layout": "a@bT", "bandwidth_gbs": 16.0, "gemm_best_gflops": 80.0}
    between = [{"gemm_fp32_gflops": 117.0, "gemm_fp32_layout": "a@b", "bandwidth_gbs": 20.5, "gemm_best_gflops": 117.0},
               {"gemm_fp32_gflops": 90.0, "gemm_fp32_layout": "a@bT", "gemm_bf16_gflops": 17.5,
                "gemm_bf16_layout": "a@bT", "bandwidth_gbs": 15.0, "gemm_best_gflops": 90.0}]
    end = dict(start, gemm_fp32_gflops=91.0, gemm_best_gflops=91.0)
    best = bench.best_ceilings([start, *between, end])
    assert best == {"gemm_fp32_gflops": 117.0, "gemm_fp32_layout": "a@b", "gemm_bf16_gflops": 17.5,
                    "gemm_bf16_layout": "a@bT", "bandwidth_gbs": 20.5, "gemm_best_gflops": 117.0}
    result = dict(_result("cpu"), ceilings=best, ceiling_probes=[start, *between, end])
    text = bench.table(result)
    assert "(the best of the probes before and after the grid and 2 short ones between its cases)" in text
    assert "start probe 80 / 11 GFLOP/s, 16.0 GB/s; end probe 91 / 11 GFLOP/s, 16.0 GB/s" in text
    assert "between cases fp32 90–117 GFLOP/s, 15.0–20.5 GB/s." in text


def test_probe_between_cases_reads_plausible_rates(bench):
    probe = bench.probe_between_cases(torch.device("cpu"), {"fp32": "a@bT", "bf16": "a@bT"}, "bf16")
    assert set(probe) == {"gemm_fp32_gflops", "gemm_fp32_layout", "gemm_bf16_gflops", "gemm_bf16_layout",
                          "bandwidth_gbs", "gemm_best_gflops"}
    assert 0.1 < probe["gemm_bf16_gflops"] and probe["gemm_fp32_gflops"] < 1e5 and probe["bandwidth_gbs"] > 0.1
    assert probe["gemm_best_gflops"] == max(probe["gemm_fp32_gflops"], probe["gemm_bf16_gflops"])


def _result(device):
    ceilings = {"gemm_fp32_gflops": 50000.0, "gemm_bf16_gflops": 800000.0, "gemm_bf16_layout": "a@bT",
                "bandwidth_gbs": 4000.0, "gemm_best_gflops": 800000.0}
    row = dict(_row("moe_ffn", 16, 0.002, 0.001), gflops=1500.0, runs=5, tokens_per_s=8000.0, speedup_vs_hf=None,
               frac_roofline=0.5, frac_best=0.5)
    return {"date": "d", "machine": "m", "command": "c", "device": device, "ceilings": ceilings,
            "rows": [row], "notes": []}


def test_table_gives_gpu_rates_in_tflops(bench):
    gpu, cpu = bench.table(_result("cuda")), bench.table(_result("cpu"))
    assert "GEMM fp32 50.0 TFLOP/s, GEMM bf16 800.0 TFLOP/s" in gpu and "| TFLOP/s |" in gpu
    assert "| 2.00 | 5 | 8000 | 1.5 |" in gpu  # 1500 GFLOP/s
    assert "GEMM fp32 50000.0 GFLOP/s" in cpu and "| 2.00 | 5 | 8000 | 1500.0 |" in cpu


@pytest.mark.gpu
def test_bench_runs_on_cuda(bench, tmp_path):
    """A small grid on the GPU: every implementation timed, peak memory from the CUDA
    allocator, results under bench_cuda.*, and profiling/README.md (the CPU table) untouched."""
    readme = _PATH.parent / "README.md"
    before = readme.read_text()
    bench.main(["--device", "cuda", "--quick", "--configs", "mixtral", "--dtypes", "bf16", "--tokens", "16",
                "--no-dense-check", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench_cuda_quick.json").read_text())
    assert result["device"] == "cuda" and readme.read_text() == before
    rows = {(r["pass"], r["impl"]): r for r in result["rows"]}
    assert {impl for _, impl in rows} >= {"moe_ffn", "dense", "dense_nn"}
    assert all(r["median_s"] > 0 for r in rows.values())
    assert rows[("fwd+bwd", "moe_ffn")]["peak_total_mib"] > 0
