"""The planner's command line: ``python -m jax_drain.plan`` (``jax_drain/plan.py`` runs :func:`run`).

Exit status: 0 planned; 2 bad input or the step did not plan; 3 no usable CUDA PJRT plugin (the
one-line :class:`~jax_drain.planner.targets.GpuCompileUnavailable` message on stderr).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from typing import Any, NoReturn, Sequence

import jax

from jax_drain import models
from jax_drain.collectives import REDUCE_MODES
from jax_drain.planner.plan import Plan, plan, plan_preset, preset_config
from jax_drain.planner.targets import GpuCompileUnavailable, gpu_mesh, parse_topology


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_drain.plan",
        description="Compile a training step for a virtual GPU host (no GPU needed) and report "
        "XLA's memory and schedule for the gradient sync.",
        epilog="exit status: 0 planned; 2 bad input or the step did not plan; 3 no usable CUDA PJRT "
        "plugin (pip install -e '.[gpu-compile]')",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="gpt-blocks", help=f"model preset: {', '.join(models.PRESETS)}")
    src.add_argument("--step", metavar="MODULE:FUNCTION",
                     help="your own step: FUNCTION(mesh) returns (jitted_step, abstract_args)")
    p.add_argument("--strategy", default="fp32_accum+drain",
                   help="gspmd, gspmd+flags, no_comm, MODE, MODE+drain or MODE+drainK "
                   f"(MODE: {', '.join(REDUCE_MODES)})")
    p.add_argument("--target", default="h100", help="GPU target: h100, h200, a100")
    p.add_argument("--topology", default="1x1x8", help="SLICESxHOSTSxGPUS, e.g. 1x1x8 or 1x2x8")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--bucket-size", type=int, help="bucket size in elements")
    size.add_argument("--num-buckets", type=int, default=24, help="about this many buckets (default 24)")
    p.add_argument("--layers", type=int, help="override the preset's number of blocks")
    p.add_argument("--d-model", type=int, help="override the preset's model width")
    p.add_argument("--heads", type=int, help="override the preset's attention heads")
    p.add_argument("--seq", type=int, help="override the preset's sequence length")
    p.add_argument("--scan-layers", action="store_true",
                   help="run the blocks under nnx.scan; the sync reduce-scatters inside the backward scan")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per device")
    p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an XLA compile option, e.g. xla_gpu_experimental_parallel_collective_overlap_limit=2")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot live bytes over the schedule")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.step:
            report = _plan_user_step(args.step, args.target, args.topology, _xla_options(args.xla_option))
        else:
            config = preset_config(args.preset, args.layers, args.d_model, args.heads, args.seq,
                                   args.scan_layers or None)
            report = plan_preset(
                config, args.strategy, args.target, args.topology, bucket_size=args.bucket_size,
                num_buckets=None if args.bucket_size else args.num_buckets, micro_batch=args.micro_batch,
                compiler_options=_xla_options(args.xla_option),
            )
    except GpuCompileUnavailable as e:  # no usable CUDA PJRT plugin: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 3
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    if args.plot:
        report.plot(args.plot)
    return 0


def _xla_options(pairs: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--xla-option takes NAME=VALUE, got {pair!r}")
        lowered = value.lower()
        options[name] = (lowered == "true") if lowered in ("true", "false") else (
            int(value) if re.fullmatch(r"-?\d+", value) else value)
    return options


def _plan_user_step(spec: str, target: str, topology: str, options: dict[str, Any]) -> Plan:
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name:
        raise ValueError(f"--step takes MODULE:FUNCTION, got {spec!r}")
    make = getattr(importlib.import_module(module_name), func_name)
    slices, hosts, gpus = parse_topology(topology)
    mesh = gpu_mesh((slices * hosts * gpus,), ("data",), target=target, topology=topology)
    step, args = make(mesh)
    return plan(step, *args, target=target, topology=topology, compiler_options=options or None)


def run() -> NoReturn:
    """The command line: plan on compile-only devices, never touching a local GPU."""
    jax.config.update("jax_platforms", "cpu")
    sys.exit(main())


if __name__ == "__main__":
    run()
