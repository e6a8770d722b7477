"""Profile expert throughput: where time and tokens go in one MoE configuration.

Legend: S steps, L layers, T tokens per step, D model dim, F expert hidden dim, E experts,
K top-k, N = T·K assignments.

`run_profile(ProfileOptions(...))` builds a residual stack of L MoE layers
(x ← x + moe(rmsnorm(x)), the FFN half of a pre-norm transformer), runs forward+backward
steps on fresh random tokens, and returns a `ProfileResult`; `write_outputs` turns it into
TensorBoard scalars and histograms, PNGs and a summary.json, and `format_report` into the
printed table. `moe-ffn profile` (moe_ffn/cli.py) is a thin layer over these.

One run, in order:
  1. one untimed step (first-call costs: lazy imports, allocator growth);
  2. under `torch.profiler` with schedule(wait=S, warmup=1, active=A): the S "wait" steps
     are timed (the profiler records nothing then, so its overhead stays out of tokens/s),
     the A active steps are traced to `<logdir>/<run>/` with `tensorboard_trace_handler`
     and give the time share of each labelled region (`key_averages`);
  3. the machine's GEMM peak, the best of a few large x·Wᵀ matmuls in the run's dtype,
     measured before 1 and after 2 (the higher is kept: the machine may be shared).
Expert load (tokens per expert, drops, aux losses) is recorded on every step of 2.

Routing overrides (forward hooks on each layer's router; the MoE layer itself is unchanged):
  * skew a > 0: every token's router logit for expert e gets −a·ln(e+1) added before the
    top-k choice. With uninformative logits the choice then follows a Zipf(a) law over the
    experts, expert 0 hottest; a = 0 is the plain router. Probabilities, top-k and combine
    weights are rebuilt from the shifted logits with the router's own rule (`routing`,
    `norm_topk_prob`, `routed_scaling_factor`, selection bias), so the balance loss and
    z-loss see the skewed routing.
  * balanced: assignment n = t·K + k goes to expert n mod E (round robin). Each expert gets
    ⌊N/E⌋ or ⌈N/E⌉ rows, exactly N/E when E divides T·K (CV 0), and a token's K experts
    are distinct. The combine weights are the router's probabilities of those experts,
    renormalised to sum 1, so the router stays in the backward graph.

Expert parallelism (ep = W > 1, one process per rank under `torchrun --nproc-per-node W`;
`init_expert_parallel` sets up the process group): every rank builds the same stack from the
same seed and shards each layer with `moe_ffn.parallel.expert_parallel`, then steps on its
own tokens (the input seed includes the rank). The step is forward+backward only: no optimizer
step, hence no all-reduce of the replicated gradients. Each rank writes its own trace
(worker name rank<r>) into the same run folder; the numbers are made global once the steps
are done: tokens per expert, drops summed over ranks (they sum to W·T·K per layer); aux losses
averaged over ranks; a step's time is the slowest rank's; tokens/s = W·T / step time; the GEMM
peak is the sum of the ranks' peaks measured at the same time; region times are averaged over
ranks. The `all_to_all` region holds the four exchanges per layer and step: two in the forward,
which sit inside `experts` and are taken out of it (so `experts` is the local expert compute),
and two in the backward, taken out of `backward`. Exchange time includes waiting for the
slowest rank.

Numbers: expert FLOPs per step = 3 (forward + backward) × Σ_layers [6·D·F·(T·K − dropped)
+ 6·D·F_shared·T]; the router's 2·D·E per token is not counted. On CUDA the steps are timed
with CUDA events and region times are device times; on CPU with `time.perf_counter` and
CPU times.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Literal, Sequence

import torch
from torch import Tensor, nn

from moe_ffn.config import MoEConfig
from moe_ffn.moe import MoE, collect_aux_loss
from moe_ffn.presets import Preset, load_preset
from moe_ffn.router import RouterOutput, TopKRouter

__all__ = [
    "DEFAULT_PRESET",
    "REGIONS",
    "LayerLoad",
    "MoEStack",
    "ProfileOptions",
    "ProfileResult",
    "SweepPoint",
    "expert_flops_per_step",
    "default_run_name",
    "format_paths",
    "format_report",
    "format_sweep",
    "check_launch",
    "init_expert_parallel",
    "launched_world_size",
    "install_routing_override",
    "load_stats",
    "measure_gemm_peak",
    "resolve_preset",
    "run_profile",
    "run_sweep",
    "write_outputs",
    "write_sweep_outputs",
]

# Mixtral's shape (F = 3.5·D, 8 experts, top-2) at a width a 2-core CPU steps through in
# a fraction of a second (forward + backward of 512 tokens, ~17 GFLOP).
DEFAULT_PRESET = Preset(
    name="mixtral-shaped-small",
    num_layers=4,
    ffn=MoEConfig(dim=256, hidden_dim=896, num_experts=8, top_k=2),
    description="Mixtral-shaped MoE (F = 3.5·D, E = 8, top-2) at D = 256: the `moe-ffn profile` default.",
)

# Regions the MoE forward labels with record_function, in pipeline order. On CPU the dispatch
# is fused into the experts' op (grouped.routed_ffn): "permute" is the routing plan alone and
# the gather and weighted sum count under "experts", so "unpermute" appears only on the
# unfused paths (CUDA, expert parallelism); `all_to_all` only with expert parallelism. A step
# of up to 16 tokens on CPU runs router, plan and experts in one call of the library
# (moe_ffn/_decode.py): one "decode_step" region then, in place of the first three.
REGIONS = ("router", "permute", "experts", "decode_step", "unpermute", "shared_experts", "all_to_all")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    config: str | None = None  # preset name or .toml path; None: DEFAULT_PRESET
    layers: int | None = None  # stack depth; None: the preset's num_layers
    tokens: int = 512  # T per step; keeps the default run well under a minute on 2 cores
    steps: int = 6  # timed steps (median step time → tokens/s)
    trace_steps: int = 2  # profiler "active" steps written as traces
    dtype: Literal["fp32", "bf16"] = "fp32"  # parameters and activations (router math is fp32 anyway)
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    skew: float = 0.0  # Zipf exponent a of the router-logit bias −a·ln(e+1); 0: plain router
    balanced: bool = False  # round-robin routing (uniform load); excludes skew
    seed: int = 0  # weights, tokens and hence routing are a function of it
    logdir: str = "runs"  # parent folder of the run folders (`tensorboard --logdir` it)
    run_name: str | None = None  # run folder name; None: <preset>-<routing>-<date-time>
    ep: int = 1  # expert-parallel degree W: > 1 needs W processes (torchrun) in an initialised group
    progress: bool = True  # tqdm bar on stderr

    def __post_init__(self) -> None:
        for name in ("tokens", "steps", "trace_steps", "ep"):
            _positive_int(name, getattr(self, name))
        if self.layers is not None:
            _positive_int("layers", self.layers)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", str(self.device)):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not (isinstance(self.skew, (int, float)) and math.isfinite(self.skew) and self.skew >= 0):
            raise ValueError(f"skew must be a finite number >= 0, got {self.skew!r}")
        if self.balanced and self.skew:
            raise ValueError("skew and balanced exclude each other (balanced forces uniform routing)")

    @property
    def routing_label(self) -> str:
        if self.balanced:
            return "balanced"
        return f"skew{self.skew:g}" if self.skew else "router"


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def resolve_preset(config: str | None) -> Preset:
    """The preset to profile: DEFAULT_PRESET, or `load_preset(config)` which must be a MoE.

    Raises FileNotFoundError / ValueError (from load_preset) for a missing file, an unknown
    name or key; ValueError for a dense preset.
    """
    if config is None:
        return DEFAULT_PRESET
    preset = load_preset(config)
    if not isinstance(preset.ffn, MoEConfig):
        raise ValueError(f"{config}: preset {preset.name!r} is dense; profiling needs a [moe] preset")
    return preset


def check_device(device: str) -> torch.device:
    """torch.device for `device`, or ValueError when that device is not available here."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available (torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    return dev


# ----------------------------------------------------------------------------- expert parallelism

# A stuck collective raises after this long instead of waiting forever (torchrun also stops
# every rank as soon as one fails); long enough for a large stack's step on a CPU.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def launched_world_size() -> int:
    """The number of processes torchrun started (its WORLD_SIZE variable); 1 without torchrun."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def check_launch(ep: int, device: str = "cpu") -> None:
    """The checks of `init_expert_parallel` that need no collective: they depend only on what
    every rank sees alike (the launch variables, the flags), so a bad launch fails on every
    rank at once and no rank is left waiting for a peer.

    Raises:
        ValueError: ep > 1 without torchrun's variables, ep ≠ the number of processes (also
            ep = 1 under a multi-process torchrun), or "cuda:N" with ep > 1. The message
            names the flag.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world != ep:
            raise ValueError(f"--ep {ep}: the initialised process group has {world} ranks; --ep must equal it")
    else:
        world = launched_world_size()
        if ep == 1 and world > 1:
            raise ValueError(f"--ep 1 but torchrun started {world} processes; pass --ep {world} "
                             "(each process would otherwise profile the whole stack on its own)")
        missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if ep > 1 and missing:
            raise ValueError(
                f"--ep {ep} needs {ep} processes started by torchrun (no {', '.join(missing)} in the environment): "
                f"torchrun --nproc-per-node {ep} -m moe_ffn.profile --ep {ep} ..."
            )
        if world != ep:
            raise ValueError(
                f"--ep {ep} must equal the number of processes, but torchrun started {world} "
                f"(--nproc-per-node {world}); pass --ep {world} or --nproc-per-node {ep}"
            )
        if ep > 1 and not dist.is_available():
            raise ValueError(f"--ep {ep}: this torch build has no torch.distributed")
    if ep > 1 and re.fullmatch(r"cuda:\d+", device):
        raise ValueError(f"--device {device}: with --ep each rank uses cuda:LOCAL_RANK; pass --device cuda")


def init_expert_parallel(ep: int, device: str = "cpu") -> torch.device:
    """Join the default process group of the `ep` processes torchrun started; return this
    rank's device.

    `check_launch` first; then this rank's own device is checked (a failing rank exits and
    torchrun stops its peers), and the default group is initialised unless it already is:
    gloo on CPU, NCCL on CUDA with rank on cuda:LOCAL_RANK.

    Args:
        ep: the expert-parallel degree, which must equal the number of processes.
        device: "cpu" or "cuda" (not "cuda:N": each rank takes its own GPU).
    Returns: the device this rank runs on.
    Raises:
        ValueError: see `check_launch`; CUDA unavailable or too few GPUs on this rank.
    """
    import torch.distributed as dist

    check_launch(ep, device)
    dev = torch.device("cpu")
    if device.startswith("cuda"):
        # NOTE: the CUDA branch (NCCL, one GPU per rank) is written but has not run on a GPU.
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        try:
            dev = check_device(f"cuda:{local_rank}")
        except ValueError as e:
            raise ValueError(f"--device {device}: {e}") from None
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        if dev.type == "cuda":
            dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=dev)
        else:
            dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    return dev


def _world() -> tuple[int, int]:
    """(rank, world size) of the default group; (0, 1) when torch.distributed is not in use."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(t: Tensor, op: str, device: torch.device) -> Tensor:
    """`t` reduced over the default group ("sum" or "max"), on the CPU. The collective runs
    on `device` (NCCL only reduces CUDA tensors, gloo CPU ones)."""
    import torch.distributed as dist

    t = t.to(device).clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.cpu()


def _all_gather_object(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------- the model


class MoEStack(nn.Module):
    """x ← x + moe_l(rmsnorm_l(x)) for l = 0 … L−1: the FFN half of L pre-norm blocks.

    Attention is left out on purpose: the profile is about the FFN layers.
    """

    def __init__(self, config: MoEConfig, num_layers: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(config.dim, device=device, dtype=dtype) for _ in range(num_layers))
        self.layers = nn.ModuleList(MoE(config, device=device, dtype=dtype) for _ in range(num_layers))

    def shard_experts(self, group=None) -> "MoEStack":
        """Shard every layer's experts over `group` (`moe_ffn.parallel.expert_parallel`; a
        collective: every rank calls it, having built the stack from the same seed)."""
        from moe_ffn.parallel import expert_parallel

        for moe in self.layers:
            expert_parallel(moe, group)
        return self

    def forward(self, x_TD: Tensor) -> Tensor:
        for norm, moe in zip(self.norms, self.layers):
            x_TD = x_TD + moe(norm(x_TD))
        return x_TD


# ----------------------------------------------------------------------------- routing overrides


def zipf_logit_bias(num_experts: int, exponent: float) -> Tensor:
    """[E] float64: −a·ln(e+1). Added to logits, softmax weights expert e by (e+1)^−a."""
    return -exponent * torch.arange(1, num_experts + 1, dtype=torch.float64).log()


def round_robin_ids(num_tokens: int, top_k: int, num_experts: int, device=None) -> Tensor:
    """[T, K] int64: assignment t·K + k → expert (t·K + k) mod E."""
    n_N = torch.arange(num_tokens * top_k, device=device)
    return (n_N % num_experts).view(num_tokens, top_k)


def _skew_hook(exponent: float) -> Callable:
    def hook(router: TopKRouter, inputs, out: RouterOutput) -> RouterOutput:
        bias_E = zipf_logit_bias(router.num_experts, exponent).to(out.logits_TE)
        return router.route(out.logits_TE + bias_E)

    return hook


def _balanced_hook(router: TopKRouter, inputs, out: RouterOutput) -> RouterOutput:
    T = out.logits_TE.shape[0]
    ids_TK = round_robin_ids(T, router.top_k, router.num_experts, out.logits_TE.device)
    weights_TK = out.probs_TE.gather(-1, ids_TK)
    weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True) * router.routed_scaling_factor
    return RouterOutput(out.logits_TE, out.probs_TE, ids_TK, weights_TK)


def install_routing_override(model: nn.Module, *, skew: float = 0.0, balanced: bool = False) -> list:
    """Hook every MoE router in `model` (see the module docstring). Returns the hook handles
    (`handle.remove()` restores the plain router); none when skew = 0 and not balanced."""
    if skew and balanced:
        raise ValueError("skew and balanced exclude each other")
    if not skew and not balanced:
        return []
    hook = _balanced_hook if balanced else _skew_hook(float(skew))
    return [m.router.register_forward_hook(hook) for m in model.modules() if isinstance(m, MoE)]


# ----------------------------------------------------------------------------- numbers


def expert_flops_per_step(config: MoEConfig, num_layers: int, num_tokens: int, dropped_per_layer: float = 0.0) -> float:
    """Forward+backward FLOPs of the active experts in one step (module docstring).

    A gated expert row costs 2·D·2F (gate_up) + 2·F·D (down) = 6·D·F forward; backward
    is twice that (input and weight gradients).
    """
    D, F = config.dim, config.hidden_dim
    kept = num_tokens * config.top_k - dropped_per_layer
    per_layer = 6 * D * F * kept + 6 * D * config.shared_width * num_tokens
    return 3.0 * per_layer * num_layers


def measure_gemm_peak(device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 3) -> dict:
    """FLOP/s of the best of `repeats` square x·Wᵀ matmuls (the expert forward's layout).

    Returns {"flops": FLOP/s, "size": n, "dtype": str}. Size: 768 on CPU (~10 ms in fp32 on
    2 cores, large enough for BLAS to reach its rate), 8192 on CUDA.
    """
    n = size or (8192 if device.type == "cuda" else 768)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    timer = _Timer(device)
    best = math.inf
    for i in range(repeats + 1):  # the first is a warm-up
        timer.start()
        torch.mm(a, b.t())
        seconds = timer.stop()
        if i:
            best = min(best, seconds)
    return {"flops": 2.0 * n**3 / best, "size": n, "dtype": str(dtype).removeprefix("torch."), "repeats": repeats}


def _better_peak(a: dict, b: dict) -> dict:
    # The peak is measured before and after the steps and the higher kept: on a shared
    # machine one measurement can land in someone else's burst and make "% of peak" exceed 100.
    best = dict(max(a, b, key=lambda p: p["flops"]))
    best["repeats"] = a["repeats"] + b["repeats"]
    return best


class _Timer:
    """Wall time of a region: perf_counter on CPU; CUDA events on CUDA (device time between
    the two events, read after a synchronize)."""

    # NOTE: the CUDA branch is written for GPUs but has not run on one: the development
    # machine has none. It is the standard event pattern (record, record, synchronize, elapsed).

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._begin.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since start()."""
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._begin.elapsed_time(self._end) / 1e3
        return time.perf_counter() - self._t0


@dataclass(frozen=True)
class LayerLoad:
    """One layer's expert load: tokens per expert averaged over the steps (they sum to T·K)."""

    min: float
    mean: float
    max: float
    cv: float  # population std / mean
    max_over_mean: float
    dropped_fraction: float  # dropped / (T·K), over all steps
    balance_loss: float  # mean over steps
    z_loss: float
    aux_loss: float


def load_stats(counts_E: Tensor) -> tuple[float, float, float, float, float]:
    """(min, mean, max, CV, max/mean) of a load vector; CV = population std / mean."""
    c = counts_E.to(torch.float64)
    mean = c.mean().item()
    cv = (c.std(correction=0) / mean).item() if mean > 0 else 0.0
    return c.min().item(), mean, c.max().item(), cv, (c.max().item() / mean if mean > 0 else 0.0)


# ----------------------------------------------------------------------------- the run


@dataclass
class ProfileResult:
    """Everything one `run_profile` measured. Per-step arrays are indexed [step][layer].

    With expert parallelism (world_size W > 1) every field is global (module docstring) and
    the same on every rank, except `param_bytes` (this rank's share) and `run_dir`'s traces,
    one per rank.
    """

    options: ProfileOptions
    preset: Preset
    num_layers: int
    run_dir: Path
    step_seconds: list[float]  # the timed steps
    gemm_peak: dict
    flops_per_step: float
    region_ms: dict[str, float]  # per traced step; REGIONS present + "forward (other)", "backward", "other"
    # (mean over ranks with W > 1; "experts" and "backward" then exclude the all_to_all inside them)
    region_time_kind: str  # "CPU" or "CUDA device"
    peak_memory_bytes: int | None
    peak_memory_kind: str
    param_bytes: int
    counts_SLE: list[list[list[int]]]  # tokens per expert, every recorded step
    dropped_SL: list[list[int]]
    balance_loss_SL: list[list[float]]
    z_loss_SL: list[list[float]]
    aux_loss_SL: list[list[float]]
    trace_files: list[Path] = field(default_factory=list)  # every rank's
    world_size: int = 1  # expert-parallel ranks W
    exchange_ms: dict[str, float] = field(default_factory=dict)  # all_to_all per step: "forward", "backward"
    region_ms_by_rank: list[dict[str, float]] = field(default_factory=list)  # W > 1: each rank's region_ms
    paths: dict[str, Path] = field(default_factory=dict)  # filled by write_outputs

    @property
    def global_tokens(self) -> int:
        """Tokens per step over all ranks, W·T."""
        return self.options.tokens * self.world_size

    @property
    def step_time(self) -> float:
        """Median timed step, seconds (median: the machine may be shared)."""
        return statistics.median(self.step_seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.global_tokens / self.step_time

    @property
    def tflops(self) -> float:
        return self.flops_per_step / self.step_time / 1e12

    @property
    def peak_fraction(self) -> float:
        return self.flops_per_step / self.step_time / self.gemm_peak["flops"]

    def layer_loads(self) -> list[LayerLoad]:
        counts = torch.tensor(self.counts_SLE, dtype=torch.float64)  # [S, L, E]
        S = counts.shape[0]
        N = self.global_tokens * self.preset.ffn.top_k
        dropped = torch.tensor(self.dropped_SL, dtype=torch.float64)
        loads = []
        for l in range(self.num_layers):
            mn, mean, mx, cv, mom = load_stats(counts[:, l].mean(0))
            loads.append(LayerLoad(
                min=mn, mean=mean, max=mx, cv=cv, max_over_mean=mom,
                dropped_fraction=dropped[:, l].sum().item() / (S * N),
                balance_loss=statistics.fmean(s[l] for s in self.balance_loss_SL),
                z_loss=statistics.fmean(s[l] for s in self.z_loss_SL),
                aux_loss=statistics.fmean(s[l] for s in self.aux_loss_SL),
            ))
        return loads


def default_run_name(opts: ProfileOptions, preset: Preset, kind: str = "") -> str:
    """<preset>[-<kind>]-<routing>-<date-time>, e.g. tiny-moe-sweep-router-20250101-120000."""
    parts = [preset.name, kind, opts.routing_label, time.strftime("%Y%m%d-%H%M%S")]
    return "-".join(p for p in parts if p)


def _setup(opts: ProfileOptions) -> tuple[Preset, torch.device, int, int]:
    """(preset, device, rank, world size) of a run; checks that --ep matches the process group."""
    preset = resolve_preset(opts.config)
    device = check_device(opts.device)
    rank, world = _world()
    if opts.ep != world:
        raise ValueError(
            f"ep={opts.ep} but the default process group has {world} rank(s)"
            + ("; call init_expert_parallel (or dist.init_process_group) first" if world == 1 else "")
        )
    if world > 1:
        E = preset.ffn.num_experts
        if E % world:
            raise ValueError(f"--ep {world} does not divide the {E} experts of {preset.name}")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return preset, device, rank, world


def _build(opts: ProfileOptions, preset: Preset, device: torch.device, num_layers: int) -> MoEStack:
    # Same seed on every rank: expert_parallel slices each rank's block out of identical banks.
    torch.manual_seed(opts.seed)
    stack = MoEStack(preset.ffn, num_layers, device=device, dtype=DTYPES[opts.dtype])
    if opts.ep > 1:
        stack.shard_experts()
    install_routing_override(stack, skew=opts.skew, balanced=opts.balanced)
    return stack


def _step_inputs(opts: ProfileOptions, dim: int, device: torch.device, step: int, rank: int = 0) -> Tensor:
    # One generator per step, on the CPU: the same tokens whatever the device and whatever
    # ran before, so a seed fixes every step's routing. Rank r > 0 draws its own tokens (rank 0
    # draws what a single process would). NOTE: the CPU generator (mt19937) keeps only the low
    # 32 bits of a seed, so the rank's offset must live in them.
    gen = torch.Generator().manual_seed((opts.seed * 1_000_003 + step + rank * 0x9E3779B1) % 2**32)
    return torch.randn(opts.tokens, dim, generator=gen).to(device=device, dtype=DTYPES[opts.dtype])


def _train_step(stack: MoEStack, x_TD: Tensor) -> list:
    """Forward + backward; returns each layer's (counts, dropped, balance, z, aux) tensors."""
    from torch.profiler import record_function

    for p in stack.parameters():
        p.grad = None
    with record_function("forward"):
        out_TD = stack(x_TD)
        loss = out_TD.float().square().mean() + collect_aux_loss(stack)
    with record_function("backward"):
        loss.backward()
    return [
        (m.stats.tokens_per_expert_E, m.stats.num_dropped, m.stats.balance_loss.detach(),
         m.stats.z_loss.detach(), m.stats.aux_loss.detach())
        for m in stack.layers
    ]


def _exchange_times(prof, cuda: bool) -> tuple[float, float, float]:
    """(forward, backward, backward inside the "backward" range) µs of the all_to_all ranges
    over the traced steps.

    key_averages merges the forward exchanges (nested in "experts") with the backward ones, so
    the ranges are classified one by one by their enclosing range. On CPU the autograd engine
    runs the backward on the calling thread, inside "backward"; on CUDA it runs on its own
    thread, outside any of our ranges (hence the third number).
    """
    fwd = bwd = bwd_nested = 0.0
    for e in prof.events():
        if e.name != "all_to_all":
            continue
        t = e.device_time_total if cuda else e.cpu_time_total
        parent = e.cpu_parent
        while parent is not None and parent.name not in ("forward", "backward"):
            parent = parent.cpu_parent
        if parent is not None and parent.name == "forward":
            fwd += t
        else:
            bwd += t
            bwd_nested += t if parent is not None else 0.0
    return fwd, bwd, bwd_nested


def _region_times(prof, cuda: bool) -> tuple[dict[str, float], dict[str, float], str]:
    """Per-step milliseconds of each labelled region from the profiler's key_averages, and of
    the forward and backward all_to_all exchanges (module docstring: no time counted twice)."""
    # CPU: inclusive CPU time of each record_function range. CUDA: the device time of the
    # kernels each range launched (not run here, see _Timer); the backward runs on autograd's
    # own thread there, so it is what remains of all kernel time after the forward.
    averages = {e.key: e for e in prof.key_averages()}
    steps = [e for k, e in averages.items() if k.startswith("ProfilerStep")]
    n_steps = max(1, sum(e.count for e in steps))
    labels = set(REGIONS) | {"forward", "backward"}
    if cuda:
        # Kernel time is self time of the op that launched it; annotations are left out so a
        # GPU-side copy of a range is not counted twice.
        total = sum(e.self_device_time_total for k, e in averages.items()
                    if k not in labels and not k.startswith("ProfilerStep"))
        value = lambda name: averages[name].device_time_total if name in averages else 0.0  # noqa: E731
    else:
        total = sum(e.cpu_time_total for e in steps)
        value = lambda name: averages[name].cpu_time_total if name in averages else 0.0  # noqa: E731
    regions = {r: value(r) for r in REGIONS if r in averages}
    fwd_a2a = bwd_a2a = bwd_a2a_nested = 0.0
    if "all_to_all" in regions:
        fwd_a2a, bwd_a2a, bwd_a2a_nested = _exchange_times(prof, cuda)
        regions["all_to_all"] = fwd_a2a + bwd_a2a
        regions["experts"] = max(0.0, regions.get("experts", 0.0) - fwd_a2a)
    forward = value("forward")
    out = dict(regions)
    out["forward (other)"] = max(0.0, forward - sum(regions.values()) + bwd_a2a)
    if cuda:
        out["backward + other"] = max(0.0, total - forward - bwd_a2a)
    else:
        backward = value("backward")
        out["backward"] = max(0.0, backward - bwd_a2a_nested)
        out["other"] = max(0.0, total - forward - backward - (bwd_a2a - bwd_a2a_nested))
    per_step = lambda v: v / 1e3 / n_steps  # noqa: E731
    exchanges = {"forward": per_step(fwd_a2a), "backward": per_step(bwd_a2a)} if "all_to_all" in regions else {}
    return {k: per_step(v) for k, v in out.items()}, exchanges, ("CUDA device" if cuda else "CPU")


def _trace_peak_memory(trace_files: Sequence[Path]) -> int | None:
    """Highest "Total Allocated" of the CPU allocator's [memory] events in the traces."""
    # The CPU allocator counts only bytes allocated while the profiler runs (from the
    # warm-up step on), so this is activations + gradients, not the weights made before.
    peak = None
    for path in trace_files:
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
        for e in events:
            args = e.get("args", {})
            if e.get("name") == "[memory]" and args.get("Device Type") == 0 and "Total Allocated" in args:
                peak = max(peak or 0, int(args["Total Allocated"]))
    return peak


def _gemm_peak(device: torch.device, dtype: torch.dtype, world: int) -> dict:
    """measure_gemm_peak; with W ranks the sum of the ranks' peaks, measured at the same time
    (after a barrier), which is what the ranks' devices give together (on one CPU they share it)."""
    if world == 1:
        return measure_gemm_peak(device, dtype)
    import torch.distributed as dist

    dist.barrier()
    peak = measure_gemm_peak(device, dtype)
    peak["flops"] = _all_reduce(torch.tensor([peak["flops"]], dtype=torch.float64), "sum", device).item()
    peak["ranks"] = world
    return peak


def _mean_dicts(dicts: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = list(dict.fromkeys(k for d in dicts for k in d))  # first-seen order
    return {k: statistics.fmean(d.get(k, 0.0) for d in dicts) for k in keys}


def run_profile(opts: ProfileOptions) -> ProfileResult:
    """Run the profile described in the module docstring; traces go to <logdir>/<run>/.

    With opts.ep > 1 every rank of the default process group (of exactly ep ranks, see
    `init_expert_parallel`) must call it; every rank gets the same, global result.
    """
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
    from tqdm import tqdm

    preset, device, rank, world = _setup(opts)
    num_layers = opts.layers or preset.num_layers
    run_name = opts.run_name or default_run_name(opts, preset)
    if world > 1:
        run_name = _all_gather_object(run_name)[0]  # rank 0's clock names the folder
    run_dir = Path(opts.logdir) / run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    worker = f"rank{rank}" if world > 1 else None  # None: the handler's <host>_<pid>
    trace_glob = f"{worker}.*.pt.trace.json*" if worker else "*.pt.trace.json*"
    old_traces = set(run_dir.glob(trace_glob))  # a reused --run folder keeps earlier traces
    dtype = DTYPES[opts.dtype]
    cuda = device.type == "cuda"

    stack = _build(opts, preset, device, num_layers)
    gemm_peak = _gemm_peak(device, dtype, world)
    timer = _Timer(device)
    step_seconds: list[float] = []
    recorded: list[list] = []

    total_steps = 1 + opts.steps + 1 + opts.trace_steps
    bar = tqdm(total=total_steps, desc=f"profile {preset.name}" + (f" (ep {world})" if world > 1 else ""),
               unit="step", disable=not opts.progress or rank != 0, file=sys.stderr)
    _train_step(stack, _step_inputs(opts, preset.ffn.dim, device, step=-1, rank=rank))  # untimed first step
    bar.update()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(
        activities=activities,
        schedule=schedule(wait=opts.steps, warmup=1, active=opts.trace_steps, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(run_dir), worker_name=worker),
        record_shapes=True,
        profile_memory=True,
    ) as prof:
        for step in range(opts.steps + 1 + opts.trace_steps):
            x_TD = _step_inputs(opts, preset.ffn.dim, device, step, rank=rank)
            timed = step < opts.steps
            if timed:
                timer.start()
            recorded.append(_train_step(stack, x_TD))
            if timed:
                step_seconds.append(timer.stop())
            prof.step()
            bar.update()
    bar.close()

    gemm_peak = _better_peak(gemm_peak, _gemm_peak(device, dtype, world))
    region_ms, exchange_ms, region_kind = _region_times(prof, cuda)
    trace_files = sorted(set(run_dir.glob(trace_glob)) - old_traces)
    if cuda:
        peak_mem, mem_kind = torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    else:
        peak_mem, mem_kind = _trace_peak_memory(trace_files), "CPU allocator peak in the traced steps, weights excluded"

    counts_SLE = torch.stack([torch.stack([layer[0] for layer in step]) for step in recorded]).to(torch.int64)
    dropped_SL = torch.tensor([[int(layer[1]) for layer in step] for step in recorded], dtype=torch.int64)
    losses_SL3 = torch.tensor([[[layer[i].item() for i in (2, 3, 4)] for layer in step] for step in recorded],
                              dtype=torch.float64)
    by_rank: list[dict[str, float]] = []
    if world > 1:
        # Global numbers, made once the steps are done so that no extra collective runs in them.
        counts_SLE = _all_reduce(counts_SLE, "sum", device)
        dropped_SL = _all_reduce(dropped_SL, "sum", device)
        losses_SL3 = _all_reduce(losses_SL3, "sum", device) / world  # each rank's own batch: mean over ranks
        step_seconds = _all_reduce(torch.tensor(step_seconds, dtype=torch.float64), "max", device).tolist()
        by_rank = _all_gather_object(region_ms)
        region_ms = _mean_dicts(by_rank)
        exchange_ms = _mean_dicts(_all_gather_object(exchange_ms))
        peaks = [p for p in _all_gather_object(peak_mem) if p is not None]
        peak_mem = max(peaks) if peaks else None
        mem_kind += f"; the largest of {world} ranks"
        trace_files = sorted(Path(t) for ts in _all_gather_object([str(t) for t in trace_files]) for t in ts)
    counts = counts_SLE.cpu().tolist()
    dropped = dropped_SL.tolist()
    mean_dropped = statistics.fmean(d for step in dropped for d in step)
    return ProfileResult(
        options=opts,
        preset=preset,
        num_layers=num_layers,
        run_dir=run_dir,
        step_seconds=step_seconds,
        gemm_peak=gemm_peak,
        flops_per_step=expert_flops_per_step(preset.ffn, num_layers, opts.tokens * world, mean_dropped),
        region_ms=region_ms,
        region_time_kind=region_kind,
        peak_memory_bytes=peak_mem,
        peak_memory_kind=mem_kind,
        param_bytes=sum(p.numel() * p.element_size() for p in stack.parameters()),
        counts_SLE=counts,
        dropped_SL=dropped,
        balance_loss_SL=losses_SL3[..., 0].tolist(),
        z_loss_SL=losses_SL3[..., 1].tolist(),
        aux_loss_SL=losses_SL3[..., 2].tolist(),
        trace_files=trace_files,
        world_size=world,
        exchange_ms=exchange_ms,
        region_ms_by_rank=by_rank,
    )


# ----------------------------------------------------------------------------- sweep


@dataclass(frozen=True)
class SweepPoint:
    tokens: int  # per rank
    step_seconds: float  # median of the timed steps
    tokens_per_s: float
    tflops: float
    peak_fraction: float
    load_cv: float  # mean over layers of the CV of the step-averaged load


def run_sweep(opts: ProfileOptions, token_counts: Sequence[int]) -> tuple[list[SweepPoint], dict]:
    """Timed steps (no tracing) for each token count on one stack; returns (points, gemm_peak).

    With opts.ep = W > 1 every rank calls it; a point's tokens are per rank, its tokens/s and
    load over all ranks (as in `run_profile`).
    """
    from tqdm import tqdm

    for t in token_counts:
        _positive_int("sweep token count", t)
    preset, device, rank, world = _setup(opts)
    num_layers = opts.layers or preset.num_layers
    stack = _build(opts, preset, device, num_layers)
    gemm_peak = _gemm_peak(device, DTYPES[opts.dtype], world)
    timer = _Timer(device)
    measured = []  # (T, median step seconds, FLOPs per step, load CV)
    bar = tqdm(total=len(token_counts) * (opts.steps + 1), desc=f"sweep {preset.name}", unit="step",
               disable=not opts.progress or rank != 0, file=sys.stderr)
    for T in token_counts:
        o = replace(opts, tokens=T)
        seconds, counts, dropped = [], [], []
        for step in range(-1, opts.steps):
            x_TD = _step_inputs(o, preset.ffn.dim, device, step, rank=rank)
            timer.start()
            stats = _train_step(stack, x_TD)
            elapsed = timer.stop()
            bar.update()
            if step >= 0:
                seconds.append(elapsed)
                counts.append(torch.stack([s[0] for s in stats]).to(torch.int64))
                dropped.append([int(s[1]) for s in stats])
        counts_SLE = torch.stack(counts)
        dropped_SL = torch.tensor(dropped, dtype=torch.int64)
        if world > 1:
            seconds = _all_reduce(torch.tensor(seconds, dtype=torch.float64), "max", device).tolist()
            counts_SLE = _all_reduce(counts_SLE, "sum", device)
            dropped_SL = _all_reduce(dropped_SL, "sum", device)
        step_s = statistics.median(seconds)
        flops = expert_flops_per_step(preset.ffn, num_layers, T * world, dropped_SL.double().mean().item())
        load_LE = counts_SLE.cpu().double().mean(0)
        cv = statistics.fmean(load_stats(load_LE[l])[3] for l in range(num_layers))
        measured.append((T, step_s, flops, cv))
    bar.close()
    gemm_peak = _better_peak(gemm_peak, _gemm_peak(device, DTYPES[opts.dtype], world))
    points = [SweepPoint(T, s, T * world / s, f / s / 1e12, f / s / gemm_peak["flops"], cv) for T, s, f, cv in measured]
    return points, gemm_peak


# ----------------------------------------------------------------------------- report


def _describe(preset: Preset, num_layers: int, opts: ProfileOptions) -> str:
    c = preset.ffn
    shared = f", shared F={c.shared_width}" if c.num_shared_experts else ""
    ep = (f" · expert-parallel over {opts.ep} ranks ({c.num_experts // opts.ep} experts each), "
          f"T={opts.tokens} tokens/step per rank") if opts.ep > 1 else f" · T={opts.tokens} tokens/step"
    return (f"{preset.name}: {num_layers} × MoE(D={c.dim}, F={c.hidden_dim}, E={c.num_experts}, K={c.top_k}{shared}) "
            f"· {opts.dtype} · {opts.device}{ep} · routing={opts.routing_label} · seed {opts.seed}")


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def format_report(r: ProfileResult) -> str:
    """The printed table: throughput, time by region, memory, per-layer expert load."""
    o, c = r.options, r.preset.ffn
    peak = r.gemm_peak
    W = r.world_size
    ep = W > 1
    lines = [
        _describe(r.preset, r.num_layers, o),
        "",
        f"throughput (median of {len(r.step_seconds)} timed forward+backward steps, profiler not recording"
        + (f"; a step's time is the slowest of the {W} ranks)" if ep else ")"),
        f"  step time        {r.step_time * 1e3:10.1f} ms   (fastest {min(r.step_seconds) * 1e3:.1f} ms)",
        f"  tokens/s         {r.tokens_per_s:10.0f}" + (f"   (all ranks: {W} × {o.tokens} tokens per step)" if ep else ""),
        f"  expert TFLOP/s   {r.tflops:10.4g}   (3 × 6·D·F per kept assignment, fwd+bwd"
        + (", all ranks)" if ep else ")"),
        f"  GEMM peak        {peak['flops'] / 1e12:10.4g}   TFLOP/s ({peak['dtype']} {peak['size']}² x·Wᵀ, best of {peak['repeats']}, before and after"
        + (f"; sum of {W} ranks measuring at once)" if ep else ")"),
        f"  of GEMM peak     {100 * r.peak_fraction:10.1f} %",
        f"  peak memory      {_mib(r.peak_memory_bytes):>10}   ({r.peak_memory_kind}; weights "
        f"{_mib(r.param_bytes)}{' on rank 0' if ep else ''})",
        "",
        f"time by region ({o.trace_steps} traced steps, {r.region_time_kind} time, ms per step"
        + (f", mean over {W} ranks)" if ep else ")"),
        f"  {'region':<18}{'ms/step':>10}{'share':>9}",
    ]
    total = sum(r.region_ms.values()) or 1.0
    for name, ms in r.region_ms.items():
        lines.append(f"  {name:<18}{ms:10.2f}{100 * ms / total:8.1f}%")
    if r.exchange_ms:
        fwd, bwd = r.exchange_ms["forward"], r.exchange_ms["backward"]
        lines.append(f"  all_to_all = {fwd:.2f} ms forward (taken out of experts, which is the local experts' "
                     f"compute here) + {bwd:.2f} ms backward (taken out of backward); it includes waiting for the "
                     "slowest rank")
        if r.region_ms_by_rank:
            per_rank = []
            for rank, regions in enumerate(r.region_ms_by_rank):
                share = 100 * regions.get("all_to_all", 0.0) / (sum(regions.values()) or 1.0)
                per_rank.append(f"rank {rank} {regions.get('all_to_all', 0.0):.2f} ms ({share:.1f}%)")
            lines.append("  all_to_all by rank: " + ", ".join(per_rank))
    N = r.global_tokens * c.top_k
    lines += [
        "",
        f"expert load per layer (tokens per expert averaged over {len(r.counts_SLE)} steps; "
        + (f"summed over {W} ranks, W·T·K = {N}" if ep else f"T·K = {N}")
        + f", uniform = {N / c.num_experts:g})",
        f"  {'layer':>5}{'min':>9}{'mean':>9}{'max':>9}{'CV':>8}{'max/mean':>10}{'dropped':>9}"
        f"{'balance':>9}{'z_loss':>9}{'aux':>9}",
    ]
    for l, ld in enumerate(r.layer_loads()):
        lines.append(
            f"  {l:>5}{ld.min:9.1f}{ld.mean:9.1f}{ld.max:9.1f}{ld.cv:8.3f}{ld.max_over_mean:10.3f}"
            f"{100 * ld.dropped_fraction:8.1f}%{ld.balance_loss:9.4f}{ld.z_loss:9.4f}{ld.aux_loss:9.4f}"
        )
    return "\n".join(lines)


def format_paths(paths: dict[str, Path], logdir: str | Path) -> str:
    """The closing list of what was written, and the command that shows it."""
    lines = ["written:"]
    for label, path in paths.items():
        lines.append(f"  {label:<14}{path}")
    lines.append("view with:")
    lines.append(f"  tensorboard --logdir {shlex.quote(str(logdir))}")
    return "\n".join(lines)


def format_sweep(points: Sequence[SweepPoint], gemm_peak: dict) -> str:
    ranks = gemm_peak.get("ranks", 1)
    ep = f"; {ranks} expert-parallel ranks: tokens per rank, tokens/s and load over all ranks" if ranks > 1 else ""
    lines = [
        f"token sweep (median of timed steps; GEMM peak {gemm_peak['flops'] / 1e12:.4g} TFLOP/s {gemm_peak['dtype']}{ep})",
        f"  {'tokens':>8}{'step ms':>10}{'tokens/s':>11}{'TFLOP/s':>10}{'of peak':>9}{'load CV':>9}",
    ]
    for p in points:
        lines.append(f"  {p.tokens:>8}{p.step_seconds * 1e3:10.1f}{p.tokens_per_s:11.0f}{p.tflops:10.4g}"
                     f"{100 * p.peak_fraction:8.1f}%{p.load_cv:9.3f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- outputs


def write_outputs(r: ProfileResult) -> dict[str, Path]:
    """TensorBoard scalars/histograms, the two PNGs and summary.json into r.run_dir.

    Scalar tags (step = profile step): load/cv/layer<l>, load/max_over_mean/layer<l>,
    load/dropped_fraction/layer<l>, aux/balance_loss/layer<l>, aux/z_loss/layer<l>,
    aux/aux_loss/layer<l>; for the timed steps time/step_ms and throughput/tokens_per_s.
    Histogram tags expert_load/layer<l>: one bucket per expert index holding its tokens.
    """
    from torch.utils.tensorboard import SummaryWriter

    E = r.preset.ffn.num_experts
    writer = SummaryWriter(log_dir=str(r.run_dir))
    try:
        for s, step in enumerate(r.counts_SLE):
            for l, counts in enumerate(step):
                c_E = torch.tensor(counts)
                _, _, _, cv, mom = load_stats(c_E)
                writer.add_scalar(f"load/cv/layer{l}", cv, s)
                writer.add_scalar(f"load/max_over_mean/layer{l}", mom, s)
                writer.add_scalar(f"load/dropped_fraction/layer{l}", r.dropped_SL[s][l] / c_E.sum().item(), s)
                writer.add_scalar(f"aux/balance_loss/layer{l}", r.balance_loss_SL[s][l], s)
                writer.add_scalar(f"aux/z_loss/layer{l}", r.z_loss_SL[s][l], s)
                writer.add_scalar(f"aux/aux_loss/layer{l}", r.aux_loss_SL[s][l], s)
                e_E = torch.arange(E, dtype=torch.float64)
                writer.add_histogram_raw(
                    f"expert_load/layer{l}",
                    min=0, max=E - 1, num=int(c_E.sum()),
                    sum=float((e_E * c_E).sum()), sum_squares=float((e_E**2 * c_E).sum()),
                    bucket_limits=[e + 0.5 for e in range(E)], bucket_counts=counts,
                    global_step=s,
                )
        for s, seconds in enumerate(r.step_seconds):
            writer.add_scalar("time/step_ms", seconds * 1e3, s)
            writer.add_scalar("throughput/tokens_per_s", r.global_tokens / seconds, s)
        writer.add_text("summary", "```\n" + format_report(r) + "\n```", 0)
    finally:
        writer.close()

    paths = {"run folder": r.run_dir}
    for i, t in enumerate(r.trace_files):
        paths["trace" if i == 0 else f"trace {i + 1}"] = t
    paths["events"] = max(r.run_dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    paths["load heatmap"] = _plot_load_heatmap(r, r.run_dir / "expert_load.png")
    paths["region times"] = _plot_regions(r, r.run_dir / "time_by_region.png")
    paths["summary"] = r.run_dir / "summary.json"
    paths["summary"].write_text(json.dumps(_summary(r), indent=1))
    r.paths = paths
    return paths


def _summary(r: ProfileResult) -> dict:
    return {
        "options": asdict(r.options),
        "preset": {"name": r.preset.name, "num_layers": r.num_layers, "ffn": asdict(r.preset.ffn)},
        "step_seconds": r.step_seconds,
        "step_time_median_s": r.step_time,
        "tokens_per_s": r.tokens_per_s,
        "expert_flops_per_step": r.flops_per_step,
        "expert_tflops": r.tflops,
        "gemm_peak": r.gemm_peak,
        "peak_fraction": r.peak_fraction,
        "region_ms_per_step": r.region_ms,
        "region_time_kind": r.region_time_kind,
        "peak_memory_bytes": r.peak_memory_bytes,
        "peak_memory_kind": r.peak_memory_kind,
        "param_bytes": r.param_bytes,
        "layer_loads": [asdict(ld) for ld in r.layer_loads()],
        "tokens_per_expert_SLE": r.counts_SLE,
        "dropped_SL": r.dropped_SL,
        "balance_loss_SL": r.balance_loss_SL,
        "z_loss_SL": r.z_loss_SL,
        "aux_loss_SL": r.aux_loss_SL,
        "trace_files": [str(p) for p in r.trace_files],
        "world_size": r.world_size,
        "all_to_all_ms_per_step": r.exchange_ms,
        "region_ms_per_step_by_rank": r.region_ms_by_rank,
    }


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


def _plot_load_heatmap(r: ProfileResult, path: Path) -> Path:
    plt = _pyplot()
    load_LE = torch.tensor(r.counts_SLE, dtype=torch.float64).mean(0).numpy()
    L, E = load_LE.shape
    fig, ax = plt.subplots(figsize=(1.2 + 0.55 * E, 1.2 + 0.45 * L), constrained_layout=True)
    im = ax.imshow(load_LE, aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_xticks(range(E))
    ax.set_yticks(range(L))
    if L * E <= 256:  # numbers stay readable only on small grids
        lo, hi = load_LE.min(), load_LE.max()
        for l in range(L):
            for e in range(E):
                bright = hi > lo and (load_LE[l, e] - lo) / (hi - lo) > 0.6  # viridis turns yellow
                ax.text(e, l, f"{load_LE[l, e]:.0f}", ha="center", va="center", fontsize=7,
                        color="black" if bright else "white")
    fig.colorbar(im, ax=ax, label="tokens per step")
    ep = f", {r.world_size} ranks" if r.world_size > 1 else ""
    ax.set_title(f"expert load ({r.preset.name}, {r.options.routing_label}{ep}, "
                 f"{'W·' if ep else ''}T·K = {r.global_tokens * r.preset.ffn.top_k})", fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_regions(r: ProfileResult, path: Path) -> Path:
    plt = _pyplot()
    names, ms = list(r.region_ms), list(r.region_ms.values())
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(names) + 1.2), constrained_layout=True)
    ax.barh(names[::-1], ms[::-1], color="tab:blue")
    total = sum(ms) or 1.0
    for i, v in enumerate(ms[::-1]):
        ax.text(v, i, f" {v:.1f} ms ({100 * v / total:.0f}%)", va="center", fontsize=8)
    ax.set_xlabel(f"ms per step ({r.region_time_kind} time, profiler key_averages)")
    ax.set_xlim(0, max(ms) * 1.35 if max(ms) > 0 else 1)
    ax.set_title(f"time by region ({r.preset.name}, {r.options.routing_label})", fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_sweep_outputs(opts: ProfileOptions, preset_name: str, points: Sequence[SweepPoint], gemm_peak: dict,
                        run_dir: Path) -> dict[str, Path]:
    """sweep.png (tokens/s and fraction of GEMM peak against T), sweep.json and TensorBoard
    scalars sweep/tokens_per_s and sweep/tflops with the token count as step."""
    from torch.utils.tensorboard import SummaryWriter

    run_dir.mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(log_dir=str(run_dir))
    try:
        for p in points:
            writer.add_scalar("sweep/tokens_per_s", p.tokens_per_s, p.tokens)
            writer.add_scalar("sweep/tflops", p.tflops, p.tokens)
            writer.add_scalar("sweep/load_cv", p.load_cv, p.tokens)
    finally:
        writer.close()
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6), constrained_layout=True)
    T = [p.tokens for p in points]
    ax.plot(T, [p.tokens_per_s for p in points], "o-", color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per step")
    ax.set_ylabel("tokens/s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(T, [100 * p.peak_fraction for p in points], "s--", color="tab:orange")
    ax2.set_ylabel("% of GEMM peak (expert FLOPs)", color="tab:orange")
    ax.set_title(f"token sweep ({preset_name}, {opts.dtype}, {opts.device}, {opts.routing_label})", fontsize=9)
    png = run_dir / "sweep.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    summary = run_dir / "sweep.json"
    summary.write_text(json.dumps({"options": asdict(opts), "gemm_peak": gemm_peak,
                                   "points": [asdict(p) for p in points]}, indent=1))
    events = max(run_dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    return {"run folder": run_dir, "events": events, "sweep plot": png, "summary": summary}


if __name__ == "__main__":  # python -m moe_ffn.profile [flags]: the same as `moe-ffn profile`
    from moe_ffn.cli import main

    raise SystemExit(main(["profile", *sys.argv[1:]]))
