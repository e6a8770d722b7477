"""`moe-ffn profile` end to end: the command, its table, and what TensorBoard and the
torch-tb-profiler plugin read back from the files it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import tomllib
from importlib import import_module
from pathlib import Path

import pytest

from cli_checks import one_line_error

from moe_ffn.cli import main

ROOT = Path(__file__).resolve().parent.parent
T, K, E, LAYERS = 64, 2, 8, 2  # tiny-moe: 8 experts, top-2, 2 layers
STEPS, TRACE_STEPS = 2, 1
RECORDED = STEPS + 1 + TRACE_STEPS  # timed + profiler warm-up + traced


def _python(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    return proc, time.perf_counter() - t0


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One real `python -m moe_ffn.profile` run on configs/tiny-moe.toml."""
    logdir = tmp_path_factory.mktemp("runs")
    proc, seconds = _python(
        "-m", "moe_ffn.profile", "--config", "tiny-moe", "--tokens", str(T), "--steps", str(STEPS),
        "--trace-steps", str(TRACE_STEPS), "--seed", "3", "--logdir", str(logdir), "--run", "tiny",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc, seconds, logdir, logdir / "tiny"


def test_tiny_cli_run_finishes_in_30_s(tiny_run):
    _, seconds, _, _ = tiny_run
    assert seconds < 30, f"moe-ffn profile on tiny-moe took {seconds:.1f} s"


def test_table_has_the_columns(tiny_run):
    out = tiny_run[0].stdout
    for label in ("tokens/s", "expert TFLOP/s", "GEMM peak", "of GEMM peak", "peak memory", "time by region"):
        assert label in out, label
    for region in ("router", "permute", "experts", "backward"):  # CPU: unpermute fused into experts
        assert f"\n  {region} " in out, region
    header = next(line for line in out.splitlines() if line.strip().startswith("layer"))
    assert header.split() == ["layer", "min", "mean", "max", "CV", "max/mean", "dropped", "balance", "z_loss", "aux"]
    rows = out.split(header, 1)[1].strip().splitlines()[:LAYERS]
    assert [r.split()[0] for r in rows] == ["0", "1"]
    assert all(float(r.split()[2]) == T * K / E for r in rows)  # mean tokens per expert


def test_closing_list_and_tensorboard_command(tiny_run):
    out, _, logdir, run_dir = tiny_run[0].stdout, *tiny_run[1:]
    assert f"tensorboard --logdir {logdir}" in out
    for name in ("expert_load.png", "time_by_region.png", "summary.json", ".pt.trace.json", "events.out.tfevents"):
        assert name in out, name
    listed = [Path(line.split()[-1]) for line in out.split("written:")[1].splitlines() if str(run_dir) in line]
    assert listed and all(p.exists() for p in listed)


def test_progress_bar_on_stderr(tiny_run):
    assert "profile tiny-moe" in tiny_run[0].stderr and "step" in tiny_run[0].stderr


def test_tokens_per_expert_sum_to_t_times_k(tiny_run):
    summary = json.loads((tiny_run[3] / "summary.json").read_text())
    counts = summary["tokens_per_expert_SLE"]
    assert len(counts) == RECORDED
    assert all(len(step) == LAYERS and all(sum(c) == T * K and len(c) == E for c in step) for step in counts)
    assert [ld["mean"] for ld in summary["layer_loads"]] == [T * K / E] * LAYERS
    shares = summary["region_ms_per_step"]
    assert shares["experts"] > 0 and shares["router"] > 0


def test_event_files_hold_the_scalars_and_histograms(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tiny_run[3]), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    for l in range(LAYERS):
        for tag in ("load/cv", "load/max_over_mean", "load/dropped_fraction", "aux/balance_loss", "aux/z_loss"):
            assert len(acc.Scalars(f"{tag}/layer{l}")) == RECORDED, tag
    assert [e.step for e in acc.Scalars("time/step_ms")] == list(range(STEPS))
    assert {"throughput/tokens_per_s"} <= scalars
    summary = json.loads((tiny_run[3] / "summary.json").read_text())
    for l in range(LAYERS):
        hists = acc.Histograms(f"expert_load/layer{l}")
        assert len(hists) == RECORDED
        for h in hists:
            buckets = list(h.histogram_value.bucket)
            assert buckets == summary["tokens_per_expert_SLE"][h.step][l]
            assert sum(buckets) == T * K


def test_traces_load_in_torch_tb_profiler(tiny_run):
    # The plugin's own loader (it parses each worker's trace in a spawned process); a thread
    # with a deadline keeps a hung loader from hanging the suite.
    from torch_tb_profiler import consts, io
    from torch_tb_profiler.profiler.loader import RunLoader

    run_dir = tiny_run[3]
    traces = [p for p in os.listdir(run_dir) if consts.WORKER_PATTERN.match(p)]
    assert len(traces) == 1
    box = {}
    thread = threading.Thread(target=lambda: box.update(run=RunLoader("tiny", str(run_dir), io.Cache()).load()),
                              daemon=True)
    thread.start()
    thread.join(timeout=90)
    assert "run" in box, "torch-tb-profiler did not finish loading within 90 s"
    run = box["run"]
    profiles = list(run.get_profiles())
    assert len(profiles) == 1, "the plugin found the trace but could not parse it"
    names = {v.display_name for v in run.views}
    assert {"Overview", "Operator", "Trace", "Memory"} <= names
    profile = profiles[0]
    assert len(profile.overview["steps"]["rows"]) == TRACE_STEPS

    # The operator view aggregates aten/custom ops (it leaves record_function ranges out);
    # the trace view serves the trace file, where the MoE regions are user annotations.
    ops = {row["name"] for row in profile.operation_table_by_name["data"]}
    assert {"aten::mm", "aten::topk"} <= ops  # (the router's products and top-k)
    with open(profile.trace_file_path) as f:
        events = json.load(f)["traceEvents"]
    annotations = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    # the experts' op: routed_ffn on CPU (the fused fast path; eager calls label it, see
    # grouped._call), grouped_linear on CUDA
    assert "moe_ffn::routed_ffn" in annotations or "moe_ffn::grouped_linear" in ops
    assert {"router", "permute", "experts", "forward", "backward"} <= annotations


def test_pngs_are_images(tiny_run):
    import matplotlib.image

    for name in ("expert_load.png", "time_by_region.png"):
        path = tiny_run[3] / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(path).shape[0] > 100


def _run_in_process(tmp_path, *flags: str) -> dict:
    code = main(["profile", "--config", "tiny-moe", "--tokens", str(T), "--steps", "1", "--trace-steps", "1",
                 "--logdir", str(tmp_path), "--run", "r", "--no-progress", *flags])
    assert code == 0
    return json.loads((tmp_path / "r" / "summary.json").read_text())


def test_balanced_flag_makes_the_cv_zero(tmp_path):
    balanced = _run_in_process(tmp_path, "--balanced")
    assert [ld["cv"] for ld in balanced["layer_loads"]] == [0.0] * LAYERS
    assert [ld["max_over_mean"] for ld in balanced["layer_loads"]] == [1.0] * LAYERS
    assert all(c == [T * K // E] * E for step in balanced["tokens_per_expert_SLE"] for c in step)


def test_sweep_with_skew(tmp_path, capsys, tiny_run):
    code = main(["profile", "--config", "tiny-moe", "--sweep", "16,32", "--steps", "1", "--skew", "2",
                 "--logdir", str(tmp_path), "--run", "sw", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    header = next(line for line in out.splitlines() if line.split()[:1] == ["tokens"])
    assert header.split() == ["tokens", "step", "ms", "tokens/s", "TFLOP/s", "of", "peak", "load", "CV"]
    rows = out.split(header, 1)[1].strip().splitlines()[:2]
    assert [int(r.split()[0]) for r in rows] == [16, 32]
    points = json.loads((tmp_path / "sw" / "sweep.json").read_text())["points"]
    assert [p["tokens"] for p in points] == [16, 32]
    assert (tmp_path / "sw" / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"tensorboard --logdir {tmp_path}" in out
    # --skew 2 skews the load far beyond the plain router's (the fixture run, same preset).
    plain = json.loads((tiny_run[3] / "summary.json").read_text())["layer_loads"]
    assert max(ld["cv"] for ld in plain) < 0.5 < min(p["load_cv"] for p in points)


def _bad(capsys, *argv: str) -> str:
    return one_line_error(capsys, *argv)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert "missing.toml" in _bad(capsys, "--config", str(tmp_path / "missing.toml"))
    bogus = tmp_path / "bogus.toml"
    bogus.write_text('name = "x"\n[moe]\ndim = 8\nnum_expertz = 4\n')
    err = _bad(capsys, "--config", str(bogus))
    assert "bogus.toml" in err and "num_expertz" in err
    assert "no-such-preset" in _bad(capsys, "--config", "no-such-preset")
    for flag in ("--tokens", "--steps", "--layers", "--trace-steps", "--ep"):
        assert flag in _bad(capsys, flag, "0")
    assert "--tokens" in _bad(capsys, "--tokens", "many")
    assert "--skew" in _bad(capsys, "--skew", "-1")
    assert "--balanced" in _bad(capsys, "--skew", "1", "--balanced")
    assert "--ep" in _bad(capsys, "--ep", "2")


def test_unavailable_device(capsys):
    import torch

    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    assert "--device" in _bad(capsys, "--device", device)
    assert "--device" in _bad(capsys, "--device", "tpu")


def test_module_entry_point_reports_bad_input_without_traceback():
    proc, _ = _python("-m", "moe_ffn.profile", "--tokens", "0", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "moe-ffn profile: error: argument --tokens: expected a positive integer, got '0'"
    ]


def test_console_script_points_at_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attr = scripts["moe-ffn"].partition(":")
    assert getattr(import_module(module), attr) is main
