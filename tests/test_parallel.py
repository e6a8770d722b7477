"""Expert parallelism with real processes: gloo on CPU, ranks spawned by the test.

Truth: one process holding the whole (unsharded) float64 layer, run on all ranks' tokens
concatenated, with loss Σ_r L_r (L_r = Σ out_r ⊙ g_r for a random g). Every rank compares its
output slice, its input gradient and the gradient of every parameter it holds (its expert block,
and the replicated parameters after summing over ranks) with that reference.

Spawning is slow, so one launch of 4 processes runs everything: the 2-rank cases run on the
groups {0, 1} and {2, 3} (two independent pairs, different seeds), then the 4-rank cases on the
world group. Each rank records an outcome per case; the tests below read them. A hard timeout
kills the ranks, so a hang fails the tests instead of blocking the suite; gloo's own timeout
turns a stuck collective into an error that names the case.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import socket
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAUNCH_TIMEOUT_S = 180  # hard limit on the whole launch (spawn + all cases)
COLLECTIVE_TIMEOUT_S = 60  # gloo raises instead of waiting forever
WORLD = 4

F64 = torch.float64


# ---------------------------------------------------------------- cases (run inside each rank)


def _run_against_reference(cfg, tokens_per_rank, group, seed, *, prep=None, per_batch_reference=False,
                           input_requires_grad=True):
    """Run the sharded layer on this rank's tokens and compare with the unsharded reference.

    Args:
        prep: optional fn(full_moe) applied to the full layer before sharding (shared by both).
        per_batch_reference: run the reference on each rank's batch separately (capacity
            semantics under EP) instead of on the concatenation.
    Returns: (sharded moe, reference moe, reference per-batch outputs info dict)
    """
    from moe_ffn import MoE
    from moe_ffn.parallel import all_reduce_replicated_grads, expert_parallel

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(seed)
    moe = MoE(cfg, dtype=F64)
    if prep is not None:
        prep(moe)
    ref = copy.deepcopy(moe)
    T_all = sum(tokens_per_rank)
    x_all = torch.randn(T_all, cfg.dim, dtype=F64)
    if prep is not None and getattr(prep, "constant_last_feature", False):
        x_all[:, -1] = 1.0
    g_all = torch.randn(T_all, cfg.dim, dtype=F64)
    lo = sum(tokens_per_rank[:rank])
    hi = lo + tokens_per_rank[rank]

    expert_parallel(moe, group)
    L = cfg.num_experts // W
    assert tuple(moe.experts.gate_up_proj.shape) == (L, 2 * cfg.hidden_dim, cfg.dim)
    x = x_all[lo:hi].clone().requires_grad_(input_requires_grad)
    out = moe(x)
    (out * g_all[lo:hi]).sum().backward()
    all_reduce_replicated_grads(moe, group)

    x_ref = x_all.clone().requires_grad_()
    info = {}
    if per_batch_reference:
        outs, dropped = [], 0
        for chunk in x_ref.split(tokens_per_rank):
            outs.append(ref(chunk))
            dropped += int(ref.stats.num_dropped)
        out_ref = torch.cat(outs)
        info["num_dropped"] = dropped
    else:
        out_ref = ref(x_ref)
        info["tokens_per_expert"] = ref.stats.tokens_per_expert_E.tolist()
        info["num_dropped"] = int(ref.stats.num_dropped)
    (out_ref * g_all).sum().backward()

    torch.testing.assert_close(out, out_ref[lo:hi])
    if input_requires_grad:
        torch.testing.assert_close(x.grad, x_ref.grad[lo:hi])
    e0 = rank * L
    names = [n for n, _ in moe.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()], (names, [n for n, _ in ref.named_parameters()])
    for name, p in moe.named_parameters():
        want = ref.get_parameter(name).grad
        if name.startswith("experts."):
            want = want[e0 : e0 + L]
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, want, msg=lambda m: f"grad of {name}: {m}")
    return moe, ref, info


def _cfg(**kw):
    from moe_ffn import MoEConfig

    base = dict(dim=8, hidden_dim=6, num_experts=4, top_k=2)
    base.update(kw)
    return MoEConfig(**base)


def case_uneven_tokens(group, seed):
    W = dist.get_world_size(group)
    tokens = [5, 11, 2, 7][:W]
    _run_against_reference(_cfg(num_experts=2 * W, num_shared_experts=1, shared_expert_gate=True, bias=True),
                           tokens, group, seed)


def case_rank_without_tokens(group, seed):
    W = dist.get_world_size(group)
    tokens = [6, 0, 9, 0][:W]
    _run_against_reference(_cfg(num_experts=2 * W), tokens, group, seed)


def case_expert_without_tokens(group, seed):
    W = dist.get_world_size(group)
    idle = 1  # global expert that no token picks

    def prep(moe):
        with torch.no_grad():  # last input feature is 1: a large negative logit, never in the top-k
            moe.router.weight[idle, -1] = -100.0

    prep.constant_last_feature = True
    _, _, info = _run_against_reference(_cfg(num_experts=2 * W), [7, 4, 3, 8][:W], group, seed, prep=prep)
    assert info["tokens_per_expert"][idle] == 0, info  # the case really has an idle expert
    assert all(c > 0 for e, c in enumerate(info["tokens_per_expert"]) if e != idle), info


def case_top_k_all_experts(group, seed):
    W = dist.get_world_size(group)
    _run_against_reference(_cfg(num_experts=W, top_k=W, routing="topk_softmax"), [3, 5, 4, 1][:W], group, seed)


def case_capacity_drops(group, seed):
    W = dist.get_world_size(group)
    moe, _, info = _run_against_reference(
        _cfg(num_experts=2 * W, capacity_factor=0.5), [9, 4, 12, 6][:W], group, seed, per_batch_reference=True
    )
    assert info["num_dropped"] > 0, info  # drops really happen
    assert moe.experts.global_num_dropped == info["num_dropped"]


def case_input_without_grad_on_one_rank(group, seed):
    # Rank 0's input needs no gradient: the backward exchanges must still run on every rank.
    rank = dist.get_rank(group)
    W = dist.get_world_size(group)
    _run_against_reference(_cfg(num_experts=2 * W), [4, 6, 5, 3][:W], group, seed, input_requires_grad=rank != 0)


def case_expert_load_summed(group, seed):
    # Aux-loss-free balancing: after summing the per-rank loads, every rank moves the replicated
    # router biases as one process that saw all tokens would.
    from moe_ffn import MoE, update_expert_biases
    from moe_ffn.parallel import all_reduce_expert_load, expert_parallel, expert_parallel_names

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    cfg = _cfg(num_experts=2 * W, expert_bias_update_rate=0.01)
    torch.manual_seed(seed)
    moe = MoE(cfg)
    ref = copy.deepcopy(moe)
    tokens = [7, 3, 9, 4][:W]
    x_all = torch.randn(sum(tokens), cfg.dim)
    expert_parallel(moe, group)
    assert "expert_load" in expert_parallel_names(moe)
    moe(x_all[sum(tokens[:rank]) : sum(tokens[: rank + 1])])
    ref(x_all)
    all_reduce_expert_load(moe)
    torch.testing.assert_close(moe.expert_load, ref.expert_load, rtol=0, atol=0)
    update_expert_biases(moe)
    update_expert_biases(ref)
    torch.testing.assert_close(moe.router.expert_bias, ref.router.expert_bias, rtol=0, atol=0)
    assert ref.router.expert_bias.abs().sum() > 0


def case_profiler_labels(group, seed):
    # The profiler's all-to-all share reads these regions: 2 forward (counts and rows out in one,
    # results back in the other) and 2 backward (the reverse of each row exchange).
    from torch.profiler import ProfilerActivity, profile

    from moe_ffn import MoE
    from moe_ffn.parallel import expert_parallel

    W = dist.get_world_size(group)
    torch.manual_seed(seed)
    moe = expert_parallel(MoE(_cfg(num_experts=2 * W)), group)
    x = torch.randn(5, 8, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        moe(x).sum().backward()
    names = [e.name for e in prof.events()]
    assert names.count("all_to_all") == 4, [n for n in names if "all" in n]


def case_ddp(group, seed):
    """DDP over the non-expert parameters: the experts excluded, gradients summed by the hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from moe_ffn import MoE
    from moe_ffn.parallel import allreduce_sum_hook, exclude_experts_from_ddp, expert_parallel

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    cfg = _cfg(num_experts=2 * W, num_shared_experts=1)
    torch.manual_seed(seed)
    moe = MoE(cfg, dtype=F64)
    ref = copy.deepcopy(moe)
    if rank != 0:  # DDP must broadcast rank 0's replicated weights; the experts stay put
        with torch.no_grad():
            moe.router.weight.mul_(3.0)
    tokens = [6, 3, 8, 5][:W]
    x_all = torch.randn(sum(tokens), cfg.dim, dtype=F64)
    g_all = torch.randn(sum(tokens), cfg.dim, dtype=F64)
    lo = sum(tokens[:rank])
    hi = lo + tokens[rank]

    expert_parallel(moe, group)
    exclude_experts_from_ddp(moe)
    ddp = DDP(moe, process_group=group)
    ddp.register_comm_hook(group, allreduce_sum_hook)
    out = ddp(x_all[lo:hi])
    (out * g_all[lo:hi]).sum().backward()

    out_ref = ref(x_all)
    (out_ref * g_all).sum().backward()
    torch.testing.assert_close(out, out_ref[lo:hi])
    L = cfg.num_experts // W
    for name, p in moe.named_parameters():
        want = ref.get_parameter(name).grad
        if name.startswith("experts."):
            want = want[rank * L : (rank + 1) * L]
        torch.testing.assert_close(p.grad, want, msg=lambda m: f"grad of {name}: {m}")


def case_checkpoint(group, seed):
    from moe_ffn import MoE
    from moe_ffn.parallel import expert_parallel, gather_full_state_dict, load_full_state_dict

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    cfg = _cfg(num_experts=2 * W, bias=True, num_shared_experts=1)
    torch.manual_seed(seed)
    moe = MoE(cfg, dtype=F64)
    full = {k: v.clone() for k, v in moe.state_dict().items()}
    expert_parallel(moe, group)
    gathered = gather_full_state_dict(moe)
    assert gathered.keys() == full.keys()
    for k in full:
        torch.testing.assert_close(gathered[k], full[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")

    other = MoE(cfg, dtype=F64)  # different weights (the RNG moved on)
    load_full_state_dict(moe, other.state_dict())
    L = cfg.num_experts // W
    torch.testing.assert_close(moe.experts.down_proj, other.experts.down_proj[rank * L : (rank + 1) * L])
    x_all = torch.randn(5 * W, cfg.dim, dtype=F64)
    with torch.no_grad():
        torch.testing.assert_close(moe(x_all[5 * rank : 5 * rank + 5]), other(x_all)[5 * rank : 5 * rank + 5])
    regathered = gather_full_state_dict(moe)
    for k, v in other.state_dict().items():
        torch.testing.assert_close(regathered[k], v, rtol=0, atol=0)

    bad = dict(other.state_dict())
    bad["experts.down_proj"] = bad["experts.down_proj"][:L]  # a shard, not the full layout
    try:
        load_full_state_dict(moe, bad)
    except ValueError as e:
        assert "experts.down_proj" in str(e) and f"{cfg.num_experts} experts" in str(e), str(e)
    else:
        raise AssertionError("a sharded tensor given as the full layout was accepted")


def case_meta_build_then_load(group, seed):
    # Build without memory on the meta device, shard, then load the full checkpoint.
    from moe_ffn import MoE
    from moe_ffn.parallel import expert_parallel, load_full_state_dict

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    cfg = _cfg(num_experts=2 * W)
    torch.manual_seed(seed)
    source = MoE(cfg, dtype=F64)
    moe = expert_parallel(MoE(cfg, dtype=F64, device="meta"), group)
    load_full_state_dict(moe, source.state_dict(), assign=True)
    x_all = torch.randn(4 * W, cfg.dim, dtype=F64)
    with torch.no_grad():
        torch.testing.assert_close(moe(x_all[4 * rank : 4 * rank + 4]), source(x_all)[4 * rank : 4 * rank + 4])


def case_world_not_dividing_experts(group, seed):
    from moe_ffn import MoE
    from moe_ffn.parallel import expert_parallel

    W = dist.get_world_size(group)
    moe = MoE(_cfg(num_experts=W + 1, top_k=1))
    try:
        expert_parallel(moe, group)
    except ValueError as e:
        assert f"{W} ranks must divide num_experts={W + 1}" in str(e), str(e)
    else:
        raise AssertionError("no ValueError")


def case_different_configs(group, seed):
    from moe_ffn import MoE
    from moe_ffn.parallel import expert_parallel

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    # The last rank differs in top_k and hidden_dim; everything else agrees.
    cfg = _cfg(num_experts=2 * W) if rank != W - 1 else _cfg(num_experts=2 * W, top_k=1, hidden_dim=10)
    try:
        expert_parallel(MoE(cfg), group)
    except ValueError as e:
        msg = str(e)
        assert "top_k (" in msg and "hidden_dim (" in msg, msg
        assert f"rank {W - 1}: 1" in msg and f"rank {W - 1}: 10" in msg, msg
        assert "num_experts (" not in msg and "dim (" not in msg.replace("hidden_dim (", ""), msg
    else:
        raise AssertionError("no ValueError")
    # the group is still usable: nobody was left inside a collective
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == W


def case_not_a_moe_on_one_rank(group, seed):
    from moe_ffn import MoE
    from moe_ffn.parallel import expert_parallel

    rank = dist.get_rank(group)
    layer = MoE(_cfg()) if rank != 0 else torch.nn.Linear(8, 8)
    try:
        expert_parallel(layer, group)
    except ValueError as e:
        assert "rank 0: expert_parallel expects a moe_ffn.MoE, got Linear" in str(e), str(e)
    else:
        raise AssertionError("no ValueError")


def case_experts_by_projection(group, seed):
    """The sharded bank as CUDA runs it (one grouped_linear per projection, see
    _ExpertBank.runs_by_projection), forced on CPU, under expert parallelism, against the
    unsharded layer on its CPU path: uneven tokens, a rank without tokens, capacity drops."""
    from moe_ffn.parallel import ExpertParallelExperts

    W = dist.get_world_size(group)
    ExpertParallelExperts.runs_by_projection = lambda self, x: True  # the sharded bank only
    try:
        _run_against_reference(_cfg(num_experts=2 * W), [6, 0, 9, 0][:W], group, seed)
        moe, _, info = _run_against_reference(
            _cfg(num_experts=2 * W, capacity_factor=0.5), [9, 4, 12, 6][:W], group, seed, per_batch_reference=True
        )
        assert info["num_dropped"] > 0 and moe.experts.global_num_dropped == info["num_dropped"], info
    finally:
        del ExpertParallelExperts.runs_by_projection


CASES_2 = [
    case_uneven_tokens,
    case_rank_without_tokens,
    case_expert_without_tokens,
    case_top_k_all_experts,
    case_capacity_drops,
    case_input_without_grad_on_one_rank,
    case_expert_load_summed,
    case_profiler_labels,
    case_ddp,
    case_checkpoint,
    case_world_not_dividing_experts,
    case_different_configs,
    case_not_a_moe_on_one_rank,
    case_experts_by_projection,
]
CASES_4 = [
    case_uneven_tokens,
    case_rank_without_tokens,
    case_expert_without_tokens,
    case_top_k_all_experts,
    case_capacity_drops,
    case_ddp,
    case_checkpoint,
    case_meta_build_then_load,
    case_world_not_dividing_experts,
    case_different_configs,
    case_experts_by_projection,
]


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    outcomes = {}
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timeout
        )
        # every rank creates every group; new_group does not inherit the timeout
        pairs = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]
        pair = rank // 2
        runs = [(2, c, pairs[pair], 100 * pair) for c in CASES_2] + [(4, c, None, 7) for c in CASES_4]
        for world, case, group, seed in runs:
            key = f"{world}:{case.__name__}"
            try:
                case(group, seed)
                outcomes[key] = "ok"
            except Exception:
                outcomes[key] = traceback.format_exc()
            _write(out_dir, rank, outcomes)  # kept even if a later case hangs
            if outcomes[key] != "ok":
                # Peers may be inside a collective this rank will never join: stop here; they
                # stop too when their collective times out.
                break
            dist.barrier(group)
    except Exception:
        outcomes["setup"] = traceback.format_exc()
    _write(out_dir, rank, outcomes)
    # Skip interpreter and process-group teardown: seconds of a 2-core budget, nothing to keep.
    os._exit(0)


def _write(out_dir: str, rank: int, outcomes: dict) -> None:
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(outcomes, f)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------- the launch and the tests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def outcomes():
    """Each rank's {case key: "ok" or traceback}, the ranks killed by the timeout, exit codes."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, port, out_dir), daemon=True) for r in range(WORLD)]
        for p in procs:
            p.start()
        end = time.monotonic() + LAUNCH_TIMEOUT_S
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        per_rank: dict[int, dict[str, str]] = {}
        for r in range(WORLD):
            path = os.path.join(out_dir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    per_rank[r] = json.load(f)
        return {"per_rank": per_rank, "hung": hung, "exitcodes": [p.exitcode for p in procs]}


def _check(outcomes, world: int, case) -> None:
    key = f"{world}:{case.__name__}"
    per_rank = {r: o[key] for r, o in outcomes["per_rank"].items() if key in o}
    failures = {r: o for r, o in per_rank.items() if o != "ok"}
    assert not failures, f"{key} failed:\n" + "\n".join(f"--- rank {r}\n{o}" for r, o in failures.items())
    missing = [r for r in range(WORLD) if r not in per_rank]  # the 2-rank cases run on both pairs
    if missing:
        # Not run: show why (the first failure on each rank, or the hang).
        why = [f"ranks still running after {LAUNCH_TIMEOUT_S}s, killed: {outcomes['hung']}"] if outcomes["hung"] else []
        for r, o in sorted(outcomes["per_rank"].items()):
            why += [f"--- rank {r}, {k}:\n{v}" for k, v in o.items() if v != "ok"][:1]
        pytest.fail(f"{key}: no outcome from ranks {missing} (exit codes {outcomes['exitcodes']})\n" + "\n".join(why))


@pytest.mark.parametrize("case", CASES_2, ids=lambda c: c.__name__)
def test_two_ranks(outcomes, case):
    _check(outcomes, 2, case)


@pytest.mark.parametrize("case", CASES_4, ids=lambda c: c.__name__)
def test_four_ranks(outcomes, case):
    _check(outcomes, 4, case)


def test_needs_initialised_process_group():
    from moe_ffn import MoE
    from moe_ffn.parallel import expert_parallel

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        expert_parallel(MoE(_cfg()))
