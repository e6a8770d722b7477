"""`moe-ffn profile --ep 2`: two real gloo ranks on the CPU, launched by torchrun.

Truth:
  * the global tokens per expert are recounted here by one process holding the whole,
    unsharded stack (same seed) and routing each rank's tokens;
  * the all_to_all split is recomputed from each rank's trace file: which annotation ranges
    lie inside the "forward" and "backward" ranges, by their timestamps;
  * counts of exchanges by design: 2 forward + 2 backward per layer and step.
A hard timeout kills the launch (its whole process group), so a hang fails instead of blocking.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from cli_checks import one_line_error

ROOT = Path(__file__).resolve().parent.parent
W, T, K, E, LAYERS = 2, 64, 2, 8, 2  # tiny-moe: 8 experts, top-2, 2 layers
STEPS, TRACE_STEPS, SEED = 2, 1, 5
RECORDED = STEPS + 1 + TRACE_STEPS  # timed + profiler warm-up + traced
LAUNCH_TIMEOUT_S = 150


def _torchrun(*args: str, nproc: int = W, timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node nproc -m moe_ffn.profile args` (standalone: a
    free rendezvous port, so parallel launches do not collide)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "moe_ffn.profile", *args]
    # A session of its own: on timeout the launcher AND its ranks are killed.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout} s (hang?)\n--- stdout\n{out}\n--- stderr\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("runs")
    # --run-name, not --run: torchrun's own parser would take --run for its --run-path.
    proc = _torchrun("--ep", str(W), "--config", "tiny-moe", "--tokens", str(T), "--steps", str(STEPS),
                     "--trace-steps", str(TRACE_STEPS), "--seed", str(SEED), "--logdir", str(logdir),
                     "--run-name", "ep")
    assert proc.returncode == 0, proc.stderr
    run_dir = logdir / "ep"
    return proc.stdout, run_dir, json.loads((run_dir / "summary.json").read_text())


def _region_rows(out: str) -> dict[str, tuple[float, float]]:
    """{region: (ms per step, share %)} from the printed time-by-region table."""
    table = out.split("time by region", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines():
        m = re.fullmatch(r"  (\S.*?)\s+([\d.]+)\s+([\d.]+)%", line)
        if m:
            rows[m[1]] = (float(m[2]), float(m[3]))
    return rows


def test_report_has_a_positive_all_to_all_share(ep_run):
    out = ep_run[0]
    assert out.count("time by region") == 1  # rank 0 prints, rank 1 does not
    assert "expert-parallel over 2 ranks (4 experts each)" in out
    rows = _region_rows(out)
    assert {"router", "permute", "experts", "unpermute", "all_to_all", "backward"} <= set(rows)
    assert rows["all_to_all"][0] > 0 and rows["all_to_all"][1] > 0
    assert sum(share for _, share in rows.values()) == pytest.approx(100, abs=0.5)
    assert "taken out of experts" in out and "taken out of backward" in out
    assert "all_to_all by rank: rank 0 " in out and ", rank 1 " in out


def test_each_rank_wrote_its_trace_and_rank_0_the_rest(ep_run):
    _, run_dir, summary = ep_run
    for r in range(W):
        traces = list(run_dir.glob(f"rank{r}.*.pt.trace.json"))
        assert len(traces) == 1, (r, os.listdir(run_dir))
        trace = json.loads(traces[0].read_text())
        assert trace["distributedInfo"]["rank"] == r and trace["distributedInfo"]["world_size"] == W
        names = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
        assert names.count("all_to_all") == 4 * LAYERS * TRACE_STEPS  # 2 forward + 2 backward per layer
    assert sorted(Path(p).name.split(".")[0] for p in summary["trace_files"]) == ["rank0", "rank1"]
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1  # only rank 0 writes the scalars
    assert (run_dir / "expert_load.png").exists() and (run_dir / "time_by_region.png").exists()


def test_torch_tb_profiler_finds_one_worker_per_rank(ep_run):
    # The plugin's own loader, in a thread with a deadline (it parses traces in a subprocess).
    from torch_tb_profiler import io
    from torch_tb_profiler.profiler.loader import RunLoader

    box = {}
    thread = threading.Thread(target=lambda: box.update(run=RunLoader("ep", str(ep_run[1]), io.Cache()).load()),
                              daemon=True)
    thread.start()
    thread.join(timeout=90)
    assert "run" in box, "torch-tb-profiler did not finish loading within 90 s"
    assert sorted(p.worker for p in box["run"].get_profiles()) == ["rank0", "rank1"]


def _inside(e: dict, outer: list[dict]) -> bool:
    return any(o["tid"] == e["tid"] and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"] for o in outer)


def test_all_to_all_split_matches_each_trace(ep_run):
    # From the trace file: forward exchanges are the all_to_all ranges inside "forward" (they
    # sit in "experts"), backward ones those inside "backward"; the report moves them out.
    _, run_dir, summary = ep_run
    assert summary["world_size"] == W
    fwd_mean = bwd_mean = 0.0
    for r, regions in enumerate(summary["region_ms_per_step_by_rank"]):
        (trace,) = run_dir.glob(f"rank{r}.*.pt.trace.json")
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "user_annotation"]
        by_name: dict[str, list[dict]] = {}
        for e in events:
            by_name.setdefault(e["name"], []).append(e)
        dur = lambda es: sum(e["dur"] for e in es) / 1e3 / TRACE_STEPS  # noqa: E731  ms per step
        a2a = by_name["all_to_all"]
        fwd = dur([e for e in a2a if _inside(e, by_name["forward"])])
        bwd = dur([e for e in a2a if _inside(e, by_name["backward"])])
        assert fwd > 0 and bwd > 0 and fwd + bwd == pytest.approx(dur(a2a), rel=1e-6)
        assert regions["all_to_all"] == pytest.approx(fwd + bwd, rel=1e-3, abs=1e-3)
        assert regions["experts"] == pytest.approx(dur(by_name["experts"]) - fwd, rel=1e-3, abs=1e-3)
        assert regions["backward"] == pytest.approx(dur(by_name["backward"]) - bwd, rel=1e-3, abs=1e-3)
        fwd_mean += fwd / W
        bwd_mean += bwd / W
    split = summary["all_to_all_ms_per_step"]
    assert split["forward"] == pytest.approx(fwd_mean, rel=1e-3, abs=1e-3)
    assert split["backward"] == pytest.approx(bwd_mean, rel=1e-3, abs=1e-3)


def test_load_is_global_and_recounted_by_one_unsharded_process(ep_run):
    from moe_ffn.profile import MoEStack, ProfileOptions, _step_inputs, resolve_preset

    out, _, summary = ep_run
    counts = summary["tokens_per_expert_SLE"]
    assert len(counts) == RECORDED
    assert all(len(step) == LAYERS and all(len(c) == E and sum(c) == W * T * K for c in step) for step in counts)
    header = next(line for line in out.splitlines() if line.strip().startswith("layer"))
    rows = out.split(header, 1)[1].strip().splitlines()[:LAYERS]
    assert [float(r.split()[2]) for r in rows] == [W * T * K / E] * LAYERS  # the table's mean column
    assert "W·T·K = 256" in out

    # The whole stack in this process, built from the same seed, on each rank's tokens.
    preset = resolve_preset("tiny-moe")
    torch.manual_seed(SEED)
    stack = MoEStack(preset.ffn, LAYERS)
    opts = ProfileOptions(config="tiny-moe", tokens=T, seed=SEED)
    want = []
    with torch.no_grad():
        for step in range(RECORDED):
            per_rank = []
            for r in range(W):
                stack(_step_inputs(opts, preset.ffn.dim, torch.device("cpu"), step, rank=r))
                per_rank.append(torch.stack([m.stats.tokens_per_expert_E for m in stack.layers]))
            assert not torch.equal(per_rank[0], per_rank[1])  # the ranks had their own tokens
            want.append(sum(per_rank).tolist())
    assert counts == want


def test_throughput_counts_every_rank(ep_run):
    summary = ep_run[2]
    step = summary["step_time_median_s"]
    assert summary["tokens_per_s"] == pytest.approx(W * T / step)
    assert summary["gemm_peak"]["ranks"] == W


# ---------------------------------------------------------------- bad launches: one line, exit 2

TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def _bad(capsys, *argv: str) -> str:
    return one_line_error(capsys, "--config", "tiny-moe", "--no-progress", *argv)


def test_ep_not_matching_the_processes(monkeypatch, capsys):
    # What each rank of `torchrun --nproc-per-node 2` sees; the check runs before any
    # collective (MASTER_PORT 1 would fail a rendezvous), so it cannot hang.
    monkeypatch.setenv("WORLD_SIZE", "2")
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    err = _bad(capsys, "--ep", "3")
    assert "--ep 3" in err and "torchrun started 2" in err
    err = _bad(capsys, "--ep", "1")
    assert "--ep 1" in err and "pass --ep 2" in err
    assert "--device cuda:1" in _bad(capsys, "--ep", "2", "--device", "cuda:1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert "--ep 3 does not divide the 8 experts" in _bad(capsys, "--ep", "3")


def test_ep_without_torchrun(monkeypatch, capsys):
    for k in ("WORLD_SIZE", *TORCHRUN_ENV):
        monkeypatch.delenv(k, raising=False)
    err = _bad(capsys, "--ep", "2")
    assert "--ep 2" in err and "torchrun --nproc-per-node 2" in err


def test_run_profile_needs_the_process_group():
    from moe_ffn.profile import ProfileOptions, run_profile

    with pytest.raises(ValueError, match="ep=2 but the default process group has 1 rank"):
        run_profile(ProfileOptions(config="tiny-moe", ep=2, progress=False))


def test_torchrun_with_the_wrong_ep_exits_2_on_every_rank(tmp_path):
    proc = _torchrun("--ep", "4", "--config", "tiny-moe", "--logdir", str(tmp_path), timeout=90)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("moe-ffn profile: error:")]
    # torchrun stops the other rank as soon as one exits, so the second line may not come.
    assert 1 <= len(ours) <= W and all("--ep 4 must equal the number of processes" in line for line in ours)
    assert "exitcode  : 2" in proc.stderr  # torchrun's report: the first rank to fail exited 2
    assert not list(tmp_path.iterdir())  # nothing ran


# ---------------------------------------------------------------- more launches (slow: ~15 s each here)


@pytest.mark.slow
def test_balanced_routing_is_uniform_over_all_ranks(tmp_path):
    # Round robin on each rank: every expert gets exactly T·K/E rows from each rank.
    proc = _torchrun("--ep", str(W), "--config", "tiny-moe", "--tokens", str(T), "--steps", "1", "--trace-steps", "1",
                     "--balanced", "--logdir", str(tmp_path), "--run-name", "b", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert all(c == [W * T * K // E] * E for step in summary["tokens_per_expert_SLE"] for c in step)
    assert [ld["cv"] for ld in summary["layer_loads"]] == [0.0] * LAYERS


@pytest.mark.slow
def test_sweep_under_expert_parallelism(tmp_path):
    proc = _torchrun("--ep", str(W), "--config", "tiny-moe", "--sweep", "16,48", "--steps", "1",
                     "--logdir", str(tmp_path), "--run-name", "sw", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("token sweep") == 1 and "2 expert-parallel ranks" in proc.stdout
    points = json.loads((tmp_path / "sw" / "sweep.json").read_text())["points"]
    assert [p["tokens"] for p in points] == [16, 48]
    for p in points:
        assert p["tokens_per_s"] == pytest.approx(W * p["tokens"] / p["step_seconds"])
