"""The `moe-ffn` command. A thin layer: parse flags, call moe_ffn.profile, print.

    moe-ffn profile [--config PRESET_OR_TOML] [--layers N] [--tokens N] [--steps N]
                    [--dtype fp32|bf16] [--device cpu|cuda] [--skew A | --balanced]
                    [--seed N] [--logdir DIR] [--run NAME] [--sweep [T1,T2,...]]
    torchrun --nproc-per-node W -m moe_ffn.profile --ep W [flags]   # expert parallelism

Bad input (a missing or invalid config, a non-positive count, an unavailable device, --ep
not matching the processes torchrun started) ends with one line on stderr naming the flag or
file, and exit status 2 (on every rank).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["main"]

EXIT_USAGE = 2


class _UsageError(Exception):
    """Bad input: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage before its error; one line says enough.
    def error(self, message: str):
        raise _UsageError(f"{self.prog}: error: {message}")


def _int_at_least(minimum: int, what: str):
    """An argparse type: an int >= minimum, else an error saying what was expected and got."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _skew(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a Zipf exponent >= 0, got {text!r}") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite Zipf exponent >= 0, got {text!r}")
    return value


def _device(text: str) -> str:
    import re

    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def _token_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _build_parser() -> _Parser:
    parser = _Parser(prog="moe-ffn", description="Transformer FFN / Mixture-of-Experts tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "profile",
        help="profile expert throughput of a MoE stack (traces, load report, plots)",
        description="Run forward+backward steps of a stack of MoE layers under torch.profiler and report "
        "throughput, time by region, memory and expert load; write TensorBoard traces, scalars and PNGs.",
    )
    p.add_argument("--config", metavar="PRESET|FILE.toml",
                   help="preset name from configs/ or a TOML path (default: an embedded Mixtral-shaped "
                   "4-layer stack, D=256, F=896, 8 experts, top-2)")
    p.add_argument("--layers", type=_positive_int, help="stack depth (default: the preset's num_layers)")
    p.add_argument("--tokens", type=_positive_int, default=512, help="tokens per step (default 512)")
    p.add_argument("--steps", type=_positive_int, default=6, help="timed steps (default 6)")
    p.add_argument("--trace-steps", type=_positive_int, default=2, help="traced profiler steps (default 2)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="default fp32")
    p.add_argument("--device", type=_device, default="cpu", help="cpu (default), cuda or cuda:N")
    routing = p.add_mutually_exclusive_group()
    routing.add_argument("--skew", type=_skew, default=0.0, metavar="A",
                         help="bias router logits by -A*ln(e+1) for expert e: Zipf(A) load, expert 0 hottest")
    routing.add_argument("--balanced", action="store_true",
                         help="round-robin routing: every expert gets T*K/E rows (best case)")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="weights and tokens (default 0)")
    p.add_argument("--logdir", default="runs", help="parent folder of run folders (default runs/)")
    # --run-name: under torchrun, whose parser reads "--run" as an ambiguous abbreviation of its --run-path.
    p.add_argument("--run", "--run-name", dest="run_name",
                   help="run folder name (default <preset>-<routing>-<time>); under torchrun spell it --run-name")
    p.add_argument("--sweep", nargs="?", const="", type=lambda s: _token_list(s) if s else [],
                   metavar="T1,T2,...",
                   help="time steps at several token counts instead (default: T/4, T/2, T, 2T); "
                   "prints a table and writes sweep.png")
    p.add_argument("--ep", type=_positive_int, default=1, metavar="W",
                   help="expert-parallel degree: shard every layer's experts over W processes started with "
                   "torchrun --nproc-per-node W (gloo on CPU, NCCL on CUDA); default 1")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return parser


def _profile(args: argparse.Namespace) -> int:
    try:
        from moe_ffn import profile as prof
    except ImportError as e:  # torch itself missing is not a usage error: let it raise
        raise _UsageError(f"moe-ffn profile: error: {e}; install the extra: pip install 'moe_ffn[profile]'") from None
    for module in ("matplotlib", "tqdm", "tensorboard"):
        try:
            __import__(module)
        except ImportError:
            raise _UsageError(
                f"moe-ffn profile: error: needs {module}; install the extra: pip install 'moe_ffn[profile]'"
            ) from None

    if args.ep > 1 or prof.launched_world_size() > 1:
        # First, and alike on every rank: a bad launch fails everywhere at once.
        try:
            prof.check_launch(args.ep, args.device)
        except ValueError as e:
            raise _UsageError(f"moe-ffn profile: error: {e}") from None
    try:
        preset = prof.resolve_preset(args.config)
    except (OSError, ValueError, TypeError) as e:
        # OSError: missing/unreadable file; ValueError: unknown preset or key, bad TOML or field value.
        raise _UsageError(f"moe-ffn profile: error: --config {args.config}: {e}") from None
    if args.ep > 1 and preset.ffn.num_experts % args.ep:
        raise _UsageError(f"moe-ffn profile: error: --ep {args.ep} does not divide the {preset.ffn.num_experts} "
                          f"experts of {preset.name}")
    if args.ep > 1:
        import torch.distributed as dist

        ours = not dist.is_initialized()
        try:
            prof.init_expert_parallel(args.ep, args.device)
        except (ValueError, RuntimeError) as e:
            raise _UsageError(f"moe-ffn profile: error: {e}") from None
        try:
            status = _run(prof, args, preset)
            dist.barrier()  # every rank done before any tears the group down
        finally:
            if ours:
                dist.destroy_process_group()
        if ours:
            # This process is a rank we set up: it ends here, without the interpreter's
            # finalization. There a gloo worker thread that still held a finished all_gather's
            # work (torch's all_gather_object drops its tensors before the worker drops the
            # work) frees the tensors' Python objects, takes the GIL of a finalizing interpreter,
            # and the process aborts ("terminate called without an active exception", seen in
            # 4 of 20 `--ep 2` launches on a 2-core Xeon; a barrier before the teardown made it
            # rare, not impossible: 1 failed `make test` in 3).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        return status
    try:
        prof.check_device(args.device)
    except (ValueError, RuntimeError) as e:
        raise _UsageError(f"moe-ffn profile: error: --device: {e}") from None
    return _run(prof, args, preset)


def _run(prof, args: argparse.Namespace, preset) -> int:
    """The run itself; with --ep every rank runs it and rank 0 writes the outputs and prints."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    opts = prof.ProfileOptions(
        config=args.config, layers=args.layers, tokens=args.tokens, steps=args.steps,
        trace_steps=args.trace_steps, dtype=args.dtype, device=args.device, skew=args.skew,
        balanced=args.balanced, seed=args.seed, logdir=args.logdir, run_name=args.run_name,
        ep=args.ep, progress=args.progress,
    )
    if args.sweep is not None:
        counts = args.sweep or sorted({max(1, args.tokens // 4), max(1, args.tokens // 2), args.tokens, 2 * args.tokens})
        points, peak = prof.run_sweep(opts, counts)
        if rank != 0:
            return 0
        run_dir = Path(opts.logdir) / (opts.run_name or prof.default_run_name(opts, preset, "sweep"))
        paths = prof.write_sweep_outputs(opts, preset.name, points, peak, run_dir)
        print(prof.format_sweep(points, peak))
        print()
        print(prof.format_paths(paths, opts.logdir))
        return 0

    result = prof.run_profile(opts)
    if rank != 0:
        return 0
    prof.write_outputs(result)
    print(prof.format_report(result))
    print()
    print(prof.format_paths(result.paths, opts.logdir))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `moe-ffn`. Returns the exit status (0, or 2 for bad input)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "profile":
            return _profile(args)
        raise _UsageError(f"moe-ffn: error: unknown command {args.command!r}")
    except _UsageError as e:
        print(str(e), file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
