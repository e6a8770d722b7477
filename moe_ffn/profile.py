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

Numbers: expert FLOPs per step = 3 (forward + backward) × Σ_layers [6·D·F·(T·K − dropped)
+ 6·D·F_shared·T]; the router's 2·D·E per token is not counted. On CUDA the steps are timed
with CUDA events and region times are device times; on CPU with `time.perf_counter` and
CPU times.
"""

from __future__ import annotations

import json
import math
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

# Regions the MoE forward labels with record_function, in pipeline order; `all_to_all` only
# appears with expert parallelism.
REGIONS = ("router", "permute", "experts", "unpermute", "shared_experts", "all_to_all")

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
    ep: int = 1  # expert-parallel degree; > 1 needs moe_ffn.parallel (not wired in yet)
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


# ----------------------------------------------------------------------------- the model


class MoEStack(nn.Module):
    """x ← x + moe_l(rmsnorm_l(x)) for l = 0 … L−1: the FFN half of L pre-norm blocks.

    Attention is left out on purpose: the profile is about the FFN layers.
    """

    def __init__(self, config: MoEConfig, num_layers: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(config.dim, device=device, dtype=dtype) for _ in range(num_layers))
        self.layers = nn.ModuleList(MoE(config, device=device, dtype=dtype) for _ in range(num_layers))
        # NOTE: for --ep N this is where each layer would be handed to
        # moe_ffn.parallel.expert_parallel(layer, group); its all_to_all region is already in REGIONS.

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
    """Everything one `run_profile` measured. Per-step arrays are indexed [step][layer]."""

    options: ProfileOptions
    preset: Preset
    num_layers: int
    run_dir: Path
    step_seconds: list[float]  # the timed steps
    gemm_peak: dict
    flops_per_step: float
    region_ms: dict[str, float]  # per traced step; REGIONS present + "forward (other)", "backward", "other"
    region_time_kind: str  # "CPU" or "CUDA device"
    peak_memory_bytes: int | None
    peak_memory_kind: str
    param_bytes: int
    counts_SLE: list[list[list[int]]]  # tokens per expert, every recorded step
    dropped_SL: list[list[int]]
    balance_loss_SL: list[list[float]]
    z_loss_SL: list[list[float]]
    aux_loss_SL: list[list[float]]
    trace_files: list[Path] = field(default_factory=list)
    paths: dict[str, Path] = field(default_factory=dict)  # filled by write_outputs

    @property
    def step_time(self) -> float:
        """Median timed step, seconds (median: the machine may be shared)."""
        return statistics.median(self.step_seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.options.tokens / self.step_time

    @property
    def tflops(self) -> float:
        return self.flops_per_step / self.step_time / 1e12

    @property
    def peak_fraction(self) -> float:
        return self.flops_per_step / self.step_time / self.gemm_peak["flops"]

    def layer_loads(self) -> list[LayerLoad]:
        counts = torch.tensor(self.counts_SLE, dtype=torch.float64)  # [S, L, E]
        S = counts.shape[0]
        N = self.options.tokens * self.preset.ffn.top_k
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


def _build(opts: ProfileOptions, preset: Preset, device: torch.device, num_layers: int) -> MoEStack:
    if opts.ep > 1:
        # The place for expert parallelism: wrap each layer of the stack (see MoEStack).
        raise NotImplementedError("--ep > 1: expert parallelism is not wired into the profiler yet")
    torch.manual_seed(opts.seed)
    stack = MoEStack(preset.ffn, num_layers, device=device, dtype=DTYPES[opts.dtype])
    install_routing_override(stack, skew=opts.skew, balanced=opts.balanced)
    return stack


def _step_inputs(opts: ProfileOptions, dim: int, device: torch.device, step: int) -> Tensor:
    # One generator per step, on the CPU: the same tokens whatever the device and whatever
    # ran before, so a seed fixes every step's routing.
    gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + step)
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


def _region_times(prof, cuda: bool) -> tuple[dict[str, float], str]:
    """Per-step milliseconds of each labelled region from the profiler's key_averages."""
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
    forward = value("forward")
    out = dict(regions)
    out["forward (other)"] = max(0.0, forward - sum(regions.values()))
    if cuda:
        out["backward + other"] = max(0.0, total - forward)
    else:
        backward = value("backward")
        out["backward"] = backward
        out["other"] = max(0.0, total - forward - backward)
    return {k: v / 1e3 / n_steps for k, v in out.items()}, ("CUDA device" if cuda else "CPU")


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


def run_profile(opts: ProfileOptions) -> ProfileResult:
    """Run the profile described in the module docstring; traces go to <logdir>/<run>/."""
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
    from tqdm import tqdm

    preset = resolve_preset(opts.config)
    device = check_device(opts.device)
    num_layers = opts.layers or preset.num_layers
    run_dir = Path(opts.logdir) / (opts.run_name or default_run_name(opts, preset))
    run_dir.mkdir(parents=True, exist_ok=True)
    old_traces = set(run_dir.glob("*.pt.trace.json*"))  # a reused --run folder keeps earlier traces
    dtype = DTYPES[opts.dtype]
    cuda = device.type == "cuda"

    stack = _build(opts, preset, device, num_layers)
    gemm_peak = measure_gemm_peak(device, dtype)
    timer = _Timer(device)
    step_seconds: list[float] = []
    recorded: list[list] = []

    total_steps = 1 + opts.steps + 1 + opts.trace_steps
    bar = tqdm(total=total_steps, desc=f"profile {preset.name}", unit="step", disable=not opts.progress, file=sys.stderr)
    _train_step(stack, _step_inputs(opts, preset.ffn.dim, device, step=-1))  # untimed first step
    bar.update()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(
        activities=activities,
        schedule=schedule(wait=opts.steps, warmup=1, active=opts.trace_steps, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(run_dir)),
        record_shapes=True,
        profile_memory=True,
    ) as prof:
        for step in range(opts.steps + 1 + opts.trace_steps):
            x_TD = _step_inputs(opts, preset.ffn.dim, device, step)
            timed = step < opts.steps
            if timed:
                timer.start()
            recorded.append(_train_step(stack, x_TD))
            if timed:
                step_seconds.append(timer.stop())
            prof.step()
            bar.update()
    bar.close()

    gemm_peak = _better_peak(gemm_peak, measure_gemm_peak(device, dtype))
    region_ms, region_kind = _region_times(prof, cuda)
    trace_files = sorted(set(run_dir.glob("*.pt.trace.json*")) - old_traces)
    if cuda:
        peak_mem, mem_kind = torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    else:
        peak_mem, mem_kind = _trace_peak_memory(trace_files), "CPU allocator peak in the traced steps, weights excluded"

    as_int = lambda t: int(t.item())  # noqa: E731
    counts = [[layer[0].tolist() for layer in step] for step in recorded]
    dropped = [[as_int(layer[1]) for layer in step] for step in recorded]
    mean_dropped = statistics.fmean(d for step in dropped for d in step)
    return ProfileResult(
        options=opts,
        preset=preset,
        num_layers=num_layers,
        run_dir=run_dir,
        step_seconds=step_seconds,
        gemm_peak=gemm_peak,
        flops_per_step=expert_flops_per_step(preset.ffn, num_layers, opts.tokens, mean_dropped),
        region_ms=region_ms,
        region_time_kind=region_kind,
        peak_memory_bytes=peak_mem,
        peak_memory_kind=mem_kind,
        param_bytes=sum(p.numel() * p.element_size() for p in stack.parameters()),
        counts_SLE=counts,
        dropped_SL=dropped,
        balance_loss_SL=[[layer[2].item() for layer in step] for step in recorded],
        z_loss_SL=[[layer[3].item() for layer in step] for step in recorded],
        aux_loss_SL=[[layer[4].item() for layer in step] for step in recorded],
        trace_files=trace_files,
    )


# ----------------------------------------------------------------------------- sweep


@dataclass(frozen=True)
class SweepPoint:
    tokens: int
    step_seconds: float  # median of the timed steps
    tokens_per_s: float
    tflops: float
    peak_fraction: float
    load_cv: float  # mean over layers of the CV of the step-averaged load


def run_sweep(opts: ProfileOptions, token_counts: Sequence[int]) -> tuple[list[SweepPoint], dict]:
    """Timed steps (no tracing) for each token count on one stack; returns (points, gemm_peak)."""
    from tqdm import tqdm

    for t in token_counts:
        _positive_int("sweep token count", t)
    preset = resolve_preset(opts.config)
    device = check_device(opts.device)
    num_layers = opts.layers or preset.num_layers
    stack = _build(opts, preset, device, num_layers)
    gemm_peak = measure_gemm_peak(device, DTYPES[opts.dtype])
    timer = _Timer(device)
    measured = []  # (T, median step seconds, FLOPs per step, load CV)
    bar = tqdm(total=len(token_counts) * (opts.steps + 1), desc=f"sweep {preset.name}", unit="step",
               disable=not opts.progress, file=sys.stderr)
    for T in token_counts:
        o = replace(opts, tokens=T)
        seconds, counts_SLE, dropped = [], [], []
        for step in range(-1, opts.steps):
            x_TD = _step_inputs(o, preset.ffn.dim, device, step)
            timer.start()
            stats = _train_step(stack, x_TD)
            elapsed = timer.stop()
            bar.update()
            if step >= 0:
                seconds.append(elapsed)
                counts_SLE.append([s[0].tolist() for s in stats])
                dropped.append(statistics.fmean(int(s[1].item()) for s in stats))
        step_s = statistics.median(seconds)
        flops = expert_flops_per_step(preset.ffn, num_layers, T, statistics.fmean(dropped))
        load_LE = torch.tensor(counts_SLE, dtype=torch.float64).mean(0)
        cv = statistics.fmean(load_stats(load_LE[l])[3] for l in range(num_layers))
        measured.append((T, step_s, flops, cv))
    bar.close()
    gemm_peak = _better_peak(gemm_peak, measure_gemm_peak(device, DTYPES[opts.dtype]))
    points = [SweepPoint(T, s, T / s, f / s / 1e12, f / s / gemm_peak["flops"], cv) for T, s, f, cv in measured]
    return points, gemm_peak


# ----------------------------------------------------------------------------- report


def _describe(preset: Preset, num_layers: int, opts: ProfileOptions) -> str:
    c = preset.ffn
    shared = f", shared F={c.shared_width}" if c.num_shared_experts else ""
    return (f"{preset.name}: {num_layers} × MoE(D={c.dim}, F={c.hidden_dim}, E={c.num_experts}, K={c.top_k}{shared}) "
            f"· {opts.dtype} · {opts.device} · T={opts.tokens} tokens/step · routing={opts.routing_label} · seed {opts.seed}")


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def format_report(r: ProfileResult) -> str:
    """The printed table: throughput, time by region, memory, per-layer expert load."""
    o, c = r.options, r.preset.ffn
    peak = r.gemm_peak
    lines = [
        _describe(r.preset, r.num_layers, o),
        "",
        f"throughput (median of {len(r.step_seconds)} timed forward+backward steps, profiler not recording)",
        f"  step time        {r.step_time * 1e3:10.1f} ms   (fastest {min(r.step_seconds) * 1e3:.1f} ms)",
        f"  tokens/s         {r.tokens_per_s:10.0f}",
        f"  expert TFLOP/s   {r.tflops:10.4g}   (3 × 6·D·F per kept assignment, fwd+bwd)",
        f"  GEMM peak        {peak['flops'] / 1e12:10.4g}   TFLOP/s ({peak['dtype']} {peak['size']}² x·Wᵀ, best of {peak['repeats']}, before and after)",
        f"  of GEMM peak     {100 * r.peak_fraction:10.1f} %",
        f"  peak memory      {_mib(r.peak_memory_bytes):>10}   ({r.peak_memory_kind}; weights {_mib(r.param_bytes)})",
        "",
        f"time by region ({o.trace_steps} traced steps, {r.region_time_kind} time, ms per step)",
        f"  {'region':<18}{'ms/step':>10}{'share':>9}",
    ]
    total = sum(r.region_ms.values()) or 1.0
    for name, ms in r.region_ms.items():
        lines.append(f"  {name:<18}{ms:10.2f}{100 * ms / total:8.1f}%")
    N = o.tokens * c.top_k
    lines += [
        "",
        f"expert load per layer (tokens per expert averaged over {len(r.counts_SLE)} steps; T·K = {N}, "
        f"uniform = {N / c.num_experts:g})",
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
    lines = [
        f"token sweep (median of timed steps; GEMM peak {gemm_peak['flops'] / 1e12:.4g} TFLOP/s {gemm_peak['dtype']})",
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
            writer.add_scalar("throughput/tokens_per_s", r.options.tokens / seconds, s)
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
    ax.set_title(f"expert load ({r.preset.name}, {r.options.routing_label}, T·K = {r.options.tokens * r.preset.ffn.top_k})",
                 fontsize=9)
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
