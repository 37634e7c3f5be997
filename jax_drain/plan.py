"""Plan a training step on XLA's GPU compiler before renting GPUs: memory and schedule.

Compiles a step for compile-only GPU devices (:mod:`jax_drain.gpu_targets`) and reports XLA's
own buffer assignment (``memory_analysis()``) and final schedule (``as_text()``, parsed by
:mod:`jax_drain.schedule`): temp/argument/output bytes, the gradient-sync collectives with their
kind, dtype and bytes, how many buckets are in flight at once, whether each collective overlaps
compute, and an approximate live-bytes curve.

Python::

    import jax_drain as jd
    from jax_drain import plan

    report = plan.plan_preset("gpt-blocks", strategy="fp32_accum+drain", num_buckets=24)
    print(report.table())

    # or any jitted step over a mesh of compile-only devices, with abstract inputs:
    mesh = jd.gpu_targets.gpu_mesh((8,), ("data",))
    report = plan.plan(step, abstract_params, abstract_batch)

CLI::

    python -m jax_drain.plan --preset gpt-blocks --strategy fp32_accum+drain --num-buckets 24 \\
        --json plan.json --plot plan.png
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import re
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_drain import _compat, models
from jax_drain.collectives import REDUCE_MODES
from jax_drain.drain import sequenced_map
from jax_drain.gpu_targets import gpu_mesh, parse_topology
from jax_drain.layout import BucketLayout
from jax_drain.order import grad_ready_order
from jax_drain.schedule import Collective, Schedule, parse_schedule
from jax_drain.sync import SCOPE_PREFIX, GradSync, local_params

#: Baseline strategies; every reduce mode ``m`` adds ``m`` (undrained), ``m+drain`` (one
#: bucket in flight) and ``m+drainK`` (K buckets in flight).
BASELINES = ("gspmd", "gspmd+flags", "no_comm")

_BUCKET_SCOPE = re.compile(re.escape(SCOPE_PREFIX) + r"/bucket(\d+)")


class PlanError(ValueError):
    """A step could not be traced, lowered or compiled for the GPU target."""


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How gradients are synchronised: a baseline or a jax_drain reduce mode and drain depth."""

    name: str
    reduce: str | None = None  # None for baselines
    max_in_flight: int | None = None  # None: undrained

    @classmethod
    def parse(cls, name: str) -> "Strategy":
        """``"gspmd"``, ``"no_comm"``, ``"fp32_accum"``, ``"fp32_accum+drain"``, ``"bf16+drain2"``..."""
        if name in BASELINES:
            return cls(name)
        mode, _, drain = name.partition("+")
        match = re.fullmatch(r"drain(\d*)", drain)
        if mode in REDUCE_MODES and (not drain or match):
            depth = int(match.group(1) or 1) if drain else None
            if depth is not None and depth < 1:
                raise ValueError(f"strategy {name!r}: the drain depth must be >= 1")
            return cls(name, mode, depth)
        known = list(BASELINES) + [f"{m}[+drain[K]]" for m in REDUCE_MODES]
        raise ValueError(f"unknown strategy {name!r}; use one of {', '.join(known)}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What XLA's GPU compiler made of one step. Bytes are per device."""

    target: str
    topology: str
    num_devices: int
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    compile_s: float
    collectives: tuple[Collective, ...]  # the sync's (or, without a scope, all) collectives
    buckets_in_flight: int  # most buckets whose collectives are in flight at once
    collectives_in_flight: int  # most single collectives in flight at once
    live_bytes: tuple[int, ...]  # approximate, over the ENTRY schedule (Schedule.live_bytes)
    num_buckets: int | None = None
    strategy: str | None = None
    bucket_size: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def pairs(self) -> int:
        """Async start/done pairs among the collectives."""
        return sum(1 for c in self.collectives if c.done != c.start)

    @property
    def overlapped(self) -> int:
        """Of the pairs, how many have compute scheduled between start and done."""
        return sum(1 for c in self.collectives if c.done != c.start and c.overlapped)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; the field names are stable."""
        return {
            "strategy": self.strategy,
            "target": self.target,
            "topology": self.topology,
            "num_devices": self.num_devices,
            "num_buckets": self.num_buckets,
            "bucket_size": self.bucket_size,
            "temp_bytes": self.temp_bytes,
            "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes,
            "pairs": self.pairs,
            "overlapped": self.overlapped,
            "buckets_in_flight": self.buckets_in_flight,
            "collectives_in_flight": self.collectives_in_flight,
            "peak_live_bytes": max(self.live_bytes, default=0),
            "compile_s": round(self.compile_s, 3),
            "collectives": [
                {
                    "kind": c.kind,
                    "dtype": c.dtype,
                    "bytes": c.bytes,
                    "bucket": _bucket_of(c),
                    "start": c.start,
                    "done": c.done,
                    "computation": c.computation,
                    "overlapped": c.overlapped,
                    "is_sync": c.is_sync,
                }
                for c in self.collectives
            ],
            "notes": list(self.notes),
        }

    def table(self) -> str:
        """A readable summary and one row per collective."""
        mib = lambda b: f"{b / 2**20:,.1f} MiB"
        head = [
            f"step on {self.num_devices}x {self.target} ({self.topology})"
            + (f", strategy {self.strategy}" if self.strategy else "")
            + (f", {self.num_buckets} buckets" if self.num_buckets is not None else ""),
            f"  temp {mib(self.temp_bytes)}   arguments {mib(self.argument_bytes)}   "
            f"outputs {mib(self.output_bytes)}   compile {self.compile_s:.1f} s",
            f"  collectives: {len(self.collectives)} ({self.pairs} async pairs, {self.overlapped} "
            f"overlap compute); in flight at once: {self.buckets_in_flight} buckets, "
            f"{self.collectives_in_flight} collectives",
        ]
        head += [f"  note: {n}" for n in self.notes]
        rows = [("bucket", "kind", "dtype", "bytes", "start", "done", "overlap")]
        for c in self.collectives:
            bucket = _bucket_of(c)
            rows.append((
                "-" if bucket is None else str(bucket), c.kind, c.dtype, f"{c.bytes:,}",
                str(c.start), str(c.done), "sync" if c.is_sync else ("yes" if c.overlapped else "no"),
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        body = ["  " + "  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
        return "\n".join(head + body)

    def plot(self, path: str) -> None:
        """Writes a PNG: live bytes over the schedule, with each collective's span shaded."""
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(9, 4))
        ax.plot([b / 2**20 for b in self.live_bytes], lw=1, color="tab:blue", label="live bytes (approx.)")
        for c in self.collectives:
            if c.done != c.start:
                ax.axvspan(c.start, c.done, color="tab:orange", alpha=0.2, lw=0)
        ax.axhline(self.temp_bytes / 2**20, color="tab:red", ls="--", lw=1, label="XLA temp bytes")
        ax.set_xlabel("ENTRY schedule position (shaded: sync collectives in flight)")
        ax.set_ylabel("MiB per device")
        ax.set_title(f"{self.strategy or 'step'} on {self.num_devices}x {self.target}")
        ax.legend(loc="upper left")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("plotting needs matplotlib: pip install 'jax_drain[plot]'") from e
    return plt


def _bucket_of(c: Collective) -> int | None:
    for name in c.op_names:
        if m := _BUCKET_SCOPE.search(name):
            return int(m.group(1))
    return None


def _buckets_in_flight(sched: Schedule, collectives: Sequence[Collective]) -> int:
    """Most buckets in flight at once: a bucket spans its first start to its last done."""
    spans: dict[tuple[str, int], list[int]] = {}
    for c in collectives:
        buckets = {int(m.group(1)) for n in c.op_names if (m := _BUCKET_SCOPE.search(n))} or {-1 - c.start}
        end = c.start if c.is_sync else c.done
        for b in buckets:
            span = spans.setdefault((c.computation, b), [c.start, end])
            span[0], span[1] = min(span[0], c.start), max(span[1], end)
    events = sorted((pos, kind) for (_, _), (s, e) in spans.items() for pos, kind in ((s, 0), (e, 1)))
    best = live = 0
    for _, kind in events:  # starts sort before ends at the same index: both inclusive
        live += 1 if kind == 0 else -1
        best = max(best, live)
    return best


def plan(
    step: Callable[..., Any],
    *abstract_args: Any,
    target: str = "h100",
    topology: str = "",
    compiler_options: dict[str, Any] | None = None,
    scope: str | None = SCOPE_PREFIX,
    **report_fields: Any,
) -> Plan:
    """Compiles ``step(*abstract_args)`` for the GPU target and reports memory and schedule.

    Args:
        step: a function whose arrays live on a mesh of compile-only GPU devices
            (:func:`jax_drain.gpu_targets.gpu_mesh`); jitted here if it is not already.
        abstract_args: ``jax.ShapeDtypeStruct`` (or array) pytrees.
        target, topology: labels for the report (the devices are the mesh's).
        compiler_options: XLA options for this compile, e.g.
            ``{"xla_gpu_reduce_scatter_combine_threshold_bytes": 2**26}``.
        scope: only collectives whose op name contains this are the sync's; ``None`` keeps all.
        report_fields: ``strategy``, ``num_buckets``, ``bucket_size``, ``notes`` for the report.
    """
    jitted = step if hasattr(step, "lower") else jax.jit(step)
    start = time.perf_counter()
    try:
        lowered = jitted.lower(*abstract_args)
    except Exception as e:
        raise PlanError(f"could not trace the step: {type(e).__name__}: {e}") from e
    try:
        compiled = lowered.compile(compiler_options=compiler_options) if compiler_options else lowered.compile()
    except Exception as e:
        raise PlanError(f"XLA could not compile the step for {target}: {type(e).__name__}: {e}") from e
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    sched = parse_schedule(compiled.as_text())
    mine = tuple(c for c in sched.collectives if scope is None or c.in_scope(scope))
    devices = _step_devices(lowered, compiled)
    return Plan(
        target=target,
        topology=topology,
        num_devices=devices,
        temp_bytes=int(memory.temp_size_in_bytes),
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        compile_s=compile_s,
        collectives=mine,
        buckets_in_flight=_buckets_in_flight(sched, mine),
        collectives_in_flight=sched.max_in_flight(lambda c: c in mine),
        live_bytes=tuple(sched.live_bytes()),
        **report_fields,
    )


def _step_devices(lowered: Any, compiled: Any) -> int:
    try:
        return len(jax.tree.leaves(compiled.input_shardings)[0].device_set)
    except Exception:  # pragma: no cover - a step without array inputs
        return 1


# -- built-in presets: the benchmark's steps --------------------------------------------------

def bucket_size_for(params: Any, num_buckets: int, axis_size: int = 8, order: Sequence[int] | None = None) -> int:
    """The largest bucket size (elements) that gives at least ``num_buckets`` real buckets.

    Buckets close once they reach the size, so ``total / num_buckets`` can give fewer, larger
    buckets than asked for; this searches for the size instead (fewer if leaves run out).
    """
    count = lambda size: BucketLayout.build(params, size, math.lcm(axis_size, 128), order).num_buckets
    total = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
    want = min(num_buckets, count(1))  # count(1): one bucket per leaf, the most possible
    low, high = 1, max(1, total)
    while low < high:  # the largest size with count >= want
        mid = (low + high + 1) // 2
        low, high = (mid, high) if count(mid) >= want else (low, mid - 1)
    return low


def build_step(
    strategy: Strategy | str,
    config: models.GPTConfig,
    mesh: Mesh,
    axis: str = "data",
    bucket_size: int | None = None,
    micro_batch: int = 1,
) -> tuple[Callable[..., Any], tuple[Any, ...], GradSync | None]:
    """A jitted gradient step for ``config`` on ``mesh`` with ``strategy``, its abstract inputs
    (params, batch) and its :class:`GradSync` (``None`` for baselines)."""
    strategy = Strategy.parse(strategy) if isinstance(strategy, str) else strategy
    params = models.abstract_params(config)
    batch = models.example_batch(config, micro_batch * mesh.shape[axis])
    loss_fn = models.make_loss(config)

    if strategy.name in ("gspmd", "gspmd+flags"):
        n = mesh.shape[axis]
        grad_spec = lambda p: P(axis) if p.ndim and p.shape[0] % n == 0 else P()
        step = jax.jit(
            jax.grad(loss_fn),
            in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P(axis))),
            out_shardings=jax.tree.map(lambda p: NamedSharding(mesh, grad_spec(p)), params),
        )
        return step, (params, batch), None

    order = grad_ready_order(loss_fn, params, batch)
    sync = GradSync(
        params, mesh, axis=axis, bucket_size=bucket_size, reduce=strategy.reduce or "fp32_accum",
        drain=strategy.max_in_flight is not None, max_in_flight=strategy.max_in_flight, order=order,
    )
    if strategy.name == "no_comm":
        def local_step(p, b):
            loss, grads = jax.value_and_grad(loss_fn)(local_params(p, axis), b)
            loss = jax.lax.pmean(loss, axis)
            n = sync.axis_size
            # Each bucket reduced over its own chunks, locally: the sync's work minus the wire.
            # Drained like the sync, so only the wire is missing from the comparison.
            shards = sequenced_map(
                lambda k, bucket: jnp.sum(bucket.reshape(n, -1).astype(jnp.float32), axis=0),
                sync.flatten(grads), 1,
            )
            return loss, shards
        fn = local_step
    else:
        fn = sync.value_and_grad(loss_fn)
    step = jax.jit(_compat.shard_map(fn, mesh=mesh, in_specs=(P(), P(axis)), out_specs=(P(), P(axis))))
    return step, (params, batch), sync


def plan_preset(
    preset: str | models.GPTConfig = "gpt-blocks",
    strategy: str = "fp32_accum+drain",
    target: str = "h100",
    topology: str = "1x1x8",
    bucket_size: int | None = None,
    num_buckets: int | None = None,
    micro_batch: int = 1,
    compiler_options: dict[str, Any] | None = None,
) -> Plan:
    """Plans a built-in GPT preset (:mod:`jax_drain.models`) with one strategy.

    Give ``bucket_size`` (elements) or ``num_buckets`` (the report holds the real count).
    ``"gspmd+flags"`` compiles with XLA's reduce-scatter combine threshold at the bucket's
    bytes and the latency-hiding scheduler on. XLA keeps one async collective in flight by
    default; a drain depth K > 1 needs
    ``compiler_options={"xla_gpu_experimental_parallel_collective_overlap_limit": K}``.
    """
    config = models.preset(preset) if isinstance(preset, str) else preset
    strat = Strategy.parse(strategy)
    slices, hosts, gpus = parse_topology(topology)
    mesh = gpu_mesh((slices * hosts * gpus,), ("data",), target=target, topology=topology)
    params = models.abstract_params(config)
    if bucket_size is None:
        order = grad_ready_order(models.make_loss(config), params, models.example_batch(config, mesh.size))
        bucket_size = bucket_size_for(params, num_buckets or 1, mesh.size, order)
    step, args, sync = build_step(strat, config, mesh, bucket_size=bucket_size, micro_batch=micro_batch)
    options, notes = dict(compiler_options or {}), []
    if strat.name == "gspmd+flags":
        itemsize = jnp.dtype(config.param_dtype).itemsize
        options.setdefault("xla_gpu_reduce_scatter_combine_threshold_bytes", bucket_size * itemsize)
        options.setdefault("xla_gpu_enable_latency_hiding_scheduler", True)
    if options:
        notes.append(f"XLA options {options}")
    return plan(
        step, *args, target=target, topology=topology, compiler_options=options or None,
        scope=None if sync is None else SCOPE_PREFIX,
        strategy=strat.name, num_buckets=None if sync is None else sync.num_buckets,
        bucket_size=bucket_size, notes=tuple(notes),
    )


# -- CLI ----------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_drain.plan",
        description="Compile a training step for a virtual GPU host (no GPU needed) and report "
        "XLA's memory and schedule for the gradient sync.",
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
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per device")
    p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an XLA compile option, e.g. xla_gpu_experimental_parallel_collective_overlap_limit=2")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot live bytes over the schedule")
    return p


def preset_config(name: str, layers: int | None = None, d_model: int | None = None,
                  heads: int | None = None, seq: int | None = None) -> models.GPTConfig:
    """A preset with optional overrides of its size."""
    config = models.preset(name)
    changes = {k: v for k, v in (("num_layers", layers), ("d_model", d_model), ("num_heads", heads),
                                 ("seq_len", seq)) if v is not None}
    return dataclasses.replace(config, **changes)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.step:
            report = _plan_user_step(args.step, args.target, args.topology, _xla_options(args.xla_option))
        else:
            config = preset_config(args.preset, args.layers, args.d_model, args.heads, args.seq)
            report = plan_preset(
                config, args.strategy, args.target, args.topology, bucket_size=args.bucket_size,
                num_buckets=None if args.bucket_size else args.num_buckets, micro_batch=args.micro_batch,
                compiler_options=_xla_options(args.xla_option),
            )
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


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")  # compile-only: never touch a local GPU
    sys.exit(main())
