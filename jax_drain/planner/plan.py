"""Plan a training step on XLA's GPU compiler before renting GPUs: memory and schedule.

Compiles a step for compile-only GPU devices (:mod:`jax_drain.planner.targets`) and reports
XLA's own buffer assignment (``memory_analysis()``) and final schedule (``as_text()``, parsed by
:mod:`jax_drain.planner.schedule`): temp/argument/output bytes, the gradient-sync collectives with their
kind, dtype, bytes and devices per group, how many buckets are in flight at once per bucket
chain (dense ``jax_drain/bucket{k}``, expert ``jax_drain/expert/bucket{k}``; a collective XLA
combined from several buckets without a name is attributed by what feeds it), whether each
collective overlaps compute, and an approximate live-bytes curve. :func:`build_user_step` builds
any ``loss_fn(params, batch)``'s gradient step with a :class:`Strategy` (the presets' steps and
baselines, :func:`build_step`, are built with it; :mod:`jax_drain.planner.compare` compares them
on your model; ``gspmd_fsdp`` is the ZeRO-3-style baseline with params sharded by annotations,
:func:`fsdp_spec`); :func:`build_mesh_step` builds a tensor-parallel HSDP step
(``("replica", "data", "model")``) to plan.

Python (``jax_drain.plan`` re-exports this module's public names and the targets')::

    from jax_drain import plan

    report = plan.plan_preset("gpt-blocks", strategy="fp32_accum+drain", num_buckets=24)
    print(report)   # report.table()

    # or any jitted step over a mesh of compile-only devices, with abstract inputs:
    mesh = plan.gpu_mesh((8,), ("data",))
    report = plan.plan(step, abstract_params, abstract_batch)

CLI (:mod:`jax_drain.planner.cli`)::

    python -m jax_drain.plan --preset gpt-blocks --strategy fp32_accum+drain --num-buckets 24 \\
        --json plan.json --plot plan.png
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import pathlib
import re
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_drain import _compat, models, pipeline, zero3
from jax_drain.collectives import REDUCE_MODES
from jax_drain.drain import sequenced_map
from jax_drain.chain import ChainedSync
from jax_drain.layout import BucketLayout
from jax_drain.order import grad_ready_order, remat_groups
from jax_drain.planner._report import pyplot, total_buckets
from jax_drain.planner.schedule import COLLECTIVE_KINDS, Collective, Schedule, parse_schedule
from jax_drain.planner.targets import gpu_mesh, parse_topology
from jax_drain.planner.timing import StepTime, read_schedule_dump, schedule_dump_options
from jax_drain.scan import LAYER_SCOPE, ScanGradSync, stacked_leaves
from jax_drain.sync import EXPERT_SCOPE, SCOPE_PREFIX, GradSync, Shards
from jax_drain.train import TrainConfig, make_train_step

#: Baseline strategies; every reduce mode ``m`` adds ``m`` (undrained), ``m+drain`` (one
#: bucket in flight) and ``m+drainK`` (K buckets in flight). ``gspmd_fsdp``: params and
#: gradients sharded over the data axis by annotations (:func:`fsdp_spec`); XLA gathers.
BASELINES = ("gspmd", "gspmd+flags", "no_comm", "gspmd_fsdp")


#: Bucket chains of a :class:`GradSync` (dense, expert) or a :class:`ScanGradSync` (the
#: per-layer buckets inside the backward scan) and the named scope each one's buckets run under.
CHAIN_SCOPES = {"dense": SCOPE_PREFIX, "expert": EXPERT_SCOPE, "layers": LAYER_SCOPE}
_CHAIN_OF_SUBSCOPE = {scope.removeprefix(SCOPE_PREFIX + "/"): chain
                      for chain, scope in CHAIN_SCOPES.items() if scope != SCOPE_PREFIX}
_CHAIN_BUCKET = re.compile(
    re.escape(SCOPE_PREFIX) + "/(?:(" + "|".join(map(re.escape, _CHAIN_OF_SUBSCOPE)) + r")/)?bucket(\d+)"
)

#: (chain, bucket index) that a collective carries, e.g. ``("expert", 0)``.
BucketRef = tuple[str, int]


class PlanError(ValueError):
    """A step could not be traced, lowered or compiled for the GPU target."""


class StrategyUnavailable(PlanError):
    """A strategy this version of the runtime cannot build (e.g. ``+split`` without
    ``GradSync(split_leaves=...)``); comparisons report it in its row instead of failing."""


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How gradients are synchronised: a baseline or a jax_drain reduce mode and drain depth.

    ``split``: the ``+split`` suffix, leaves larger than a bucket split across buckets
    (``GradSync(split_leaves=True)``, where the runtime has that option). ``zero3``: parameters
    sharded like the gradients and gathered bucket by bucket (:mod:`jax_drain.zero3`):
    ``"zero3+drain"`` (``fp32_accum``), or a ``+zero3`` suffix on any mode. ``blocks``: the
    ``+blocks`` suffix, no bucket spanning two remat blocks (``GradSync(bucket_groups=
    remat_groups(...))``, :class:`TrainConfig <jax_drain.TrainConfig>`'s default).
    ``reshard_after_forward``: with ``zero3``, ``False`` is the ``+noreshard`` suffix: each
    bucket gathered once and kept from forward to backward
    (``TrainConfig(reshard_after_forward=False)``). ``stages``: the ``+ppN`` suffix, the data
    devices split into ``N`` pipeline stages (``TrainConfig(stage_axis="stage")``), in the GPipe
    schedule or, with a ``+1f1b`` suffix too, 1F1B (``+1f1b_lockstep``: in lock step)
    (``schedule``, ``TrainConfig(pipeline_schedule=...)``).
    """

    name: str
    reduce: str | None = None  # None for baselines
    max_in_flight: int | None = None  # None: undrained
    split: bool = False
    zero3: bool = False
    blocks: bool = False
    reshard_after_forward: bool = True
    stages: int = 1
    schedule: str = "gpipe"

    @property
    def is_baseline(self) -> bool:
        return self.reduce is None

    @classmethod
    def parse(cls, name: str) -> "Strategy":
        """``"gspmd"``, ``"no_comm"``, ``"fp32_accum"``, ``"fp32_accum+drain"``, ``"bf16+drain2"``,
        ``"fp32_accum+drain+split"``..."""
        name = name.strip()
        if name in BASELINES:
            return cls(name)
        mode, *flags = name.split("+")
        zero3 = mode == "zero3" or "zero3" in flags
        blocks = "blocks" in flags
        reshard = "noreshard" not in flags
        piped = [f for f in flags if re.fullmatch(r"pp\d+", f)]
        stages = int(piped[-1][2:]) if piped else 1
        if len(piped) > 1 or (piped and stages < 2):
            raise ValueError(f"strategy {name!r}: give at most one +ppN, N >= 2 pipeline stages (e.g. '+pp2')")
        schedules = [f for f in flags if f in pipeline.SCHEDULES[1:]]
        schedule = schedules[-1] if schedules else "gpipe"
        if len(schedules) > 1:
            raise ValueError(f"strategy {name!r}: give one schedule, +1f1b or +1f1b_lockstep")
        if schedules and not piped:
            raise ValueError(f"strategy {name!r}: +{schedule} is the schedule of a stage axis; it needs +ppN too "
                             f"(e.g. 'fp32_accum+drain+pp2+{schedule}')")
        if not reshard and not zero3:
            raise ValueError(f"strategy {name!r}: +noreshard keeps ZeRO-3's gathered buckets from forward to "
                             "backward; it needs +zero3 (e.g. 'zero3+drain+noreshard')")
        flags = [f for f in flags if f not in ("zero3", "blocks", "noreshard", *schedules, *piped)]
        mode = "fp32_accum" if mode == "zero3" else mode
        split = bool(flags) and flags[-1] == "split"
        flags = flags[:-1] if split else flags
        match = re.fullmatch(r"drain(\d*)", flags[0]) if len(flags) == 1 else None
        if mode in REDUCE_MODES and (not flags or match):
            depth = int(match.group(1) or 1) if match else None
            if depth is not None and depth < 1:
                raise ValueError(f"strategy {name!r}: the drain depth must be >= 1")
            return cls(name, mode, depth, split, zero3, blocks, reshard, stages, schedule)
        known = (list(BASELINES)
                 + [f"{m}[+drain[K]][+split][+zero3[+noreshard]][+blocks][+ppN[+1f1b[_lockstep]]]"
                    for m in REDUCE_MODES]
                 + ["zero3[+drain[K]][+blocks][+noreshard][+ppN[+1f1b[_lockstep]]]"])
        raise ValueError(f"unknown strategy {name!r}; use one of {', '.join(known)}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What XLA's GPU compiler made of one step. Bytes are per device.

    ``print(plan)`` (and its ``repr``) shows :meth:`table`.
    """

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
    # Per collective (same order): the (chain, bucket) pairs it carries; () when unattributed.
    collective_buckets: tuple[tuple[BucketRef, ...], ...] = ()
    # Per bucket chain ("dense", "expert") that has collectives: most of its buckets in flight.
    chains_in_flight: dict[str, int] = dataclasses.field(default_factory=dict, hash=False)
    # Every collective of the compiled program, XLA's own included (``collectives`` above are
    # the sync's only); empty for a Plan built by hand.
    all_collectives: tuple[Collective, ...] = ()
    # XLA's predicted time of the step (:mod:`jax_drain.planner.timing`); None for a Plan built
    # by hand.
    step_time: StepTime | None = None

    @property
    def predicted_step_s(self) -> float | None:
        """XLA's predicted step time in seconds (``None`` where it cannot price the step)."""
        return None if self.step_time is None else self.step_time.step_s

    @property
    def exposed_comm_s(self) -> float | None:
        """The time the step's collectives leave exposed, in seconds, by XLA's estimate."""
        return None if self.step_time is None else self.step_time.exposed_comm_s

    def collective_counts(self) -> list[dict[str, Any]]:
        """Every collective of the compiled program by kind and dtype: ``{"kind", "dtype",
        "count", "bytes"}`` (bytes summed), kinds in :data:`COLLECTIVE_KINDS` order. A collective
        inside a loop body counts once.

        Example::

            >>> report.collective_counts()  # doctest: +SKIP
            [{'kind': 'all-reduce', 'dtype': 'f32', 'count': 1, 'bytes': 4},
             {'kind': 'all-to-all', 'dtype': 'bf16', 'count': 6, 'bytes': 4718592}]
        """
        return collective_counts(self.all_collectives)

    def collectives_summary(self) -> str:
        """``"1x all-reduce f32, 6x all-to-all bf16"``: :meth:`collective_counts` in words."""
        return summarize_collectives(self.all_collectives)

    def buckets_of(self, c: Collective) -> tuple[BucketRef, ...]:
        """The (chain, bucket) pairs collective ``c`` of this plan carries (several when XLA
        combined buckets); ``()`` for a collective of no bucket.

        Example::

            >>> [report.buckets_of(c) for c in report.collectives]  # doctest: +SKIP
            [(('dense', 0),), ..., (('dense', 5), ('expert', 0)), ...]
        """
        if self.collective_buckets:
            return self.collective_buckets[self.collectives.index(c)]
        return _named_buckets(c.op_names)  # a Plan built by hand, without the schedule

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
            "chains_in_flight": dict(self.chains_in_flight),
            "collectives_in_flight": self.collectives_in_flight,
            "peak_live_bytes": max(self.live_bytes, default=0),
            "compile_s": round(self.compile_s, 3),
            **(self.step_time.to_json() if self.step_time is not None else {"predicted_step_s": None, "exposed_comm_s": None}),
            "all_collectives": self.collective_counts(),
            "collectives": [
                {
                    "kind": c.kind,
                    "dtype": c.dtype,
                    "bytes": c.bytes,
                    "group_size": c.group_size,
                    # "bucket"/"chain": the first carried; "buckets": all, when XLA combined some.
                    "bucket": refs[0][1] if (refs := self.buckets_of(c)) else None,
                    "chain": refs[0][0] if refs else None,
                    "buckets": [list(r) for r in refs],
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
            f"overlap compute); in flight at once: {self.buckets_in_flight} buckets"
            + (f" ({', '.join(f'{k} {v}' for k, v in self.chains_in_flight.items())})"
               if len(self.chains_in_flight) > 1 else "")
            + f", {self.collectives_in_flight} collectives",
            f"  all collectives in the program: {self.collectives_summary()}",
        ]
        if self.step_time is not None:
            head.append(f"  {self.step_time.summary()}")
        head += [f"  note: {n}" for n in self.notes]
        rows = [("chain", "bucket", "kind", "dtype", "bytes", "group", "start", "done", "overlap")]
        for c in self.collectives:
            by_chain: dict[str, list[int]] = {}
            for chain, k in self.buckets_of(c):
                by_chain.setdefault(chain, []).append(k)
            rows.append((
                "+".join(by_chain) or "-",
                "+".join(_ranges(ks) for ks in by_chain.values()) or "-", c.kind, c.dtype, f"{c.bytes:,}",
                "-" if c.group_size is None else str(c.group_size),
                str(c.start), str(c.done), "sync" if c.is_sync else ("yes" if c.overlapped else "no"),
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        body = ["  " + "  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
        return "\n".join(head + body)

    def __str__(self) -> str:
        return self.table()

    __repr__ = __str__

    def plot(self, path: str | pathlib.Path) -> pathlib.Path:
        """Writes a PNG: live bytes over the schedule, with each collective's span shaded.

        Returns the absolute path written."""
        plt = pyplot()
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
        return pathlib.Path(path).absolute()


def collective_counts(collectives: Sequence[Collective]) -> list[dict[str, Any]]:
    """``{"kind", "dtype", "count", "bytes"}`` per (kind, dtype) of ``collectives``, kinds in
    :data:`COLLECTIVE_KINDS` order, then dtype."""
    counts: dict[tuple[str, str], list[int]] = {}
    for c in collectives:
        entry = counts.setdefault((c.kind, c.dtype), [0, 0])
        entry[0] += 1
        entry[1] += c.bytes
    rank = {kind: i for i, kind in enumerate(COLLECTIVE_KINDS)}
    return [{"kind": kind, "dtype": dtype, "count": n, "bytes": b}
            for (kind, dtype), (n, b) in sorted(counts.items(), key=lambda kv: (rank.get(kv[0][0], 99), kv[0]))]


def summarize_collectives(collectives: Sequence[Collective]) -> str:
    """``"3x all-reduce f32, 24x all-to-all bf16"`` (``"none"`` without collectives)."""
    return ", ".join(f"{e['count']}x {e['kind']} {e['dtype'] or '-'}" for e in collective_counts(collectives)) or "none"


def _ranges(ks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``: a combined collective can carry a whole chain."""
    parts: list[str] = []
    for k in sorted(set(ks)):
        if parts and parts[-1].rpartition("-")[2] == str(k - 1):
            parts[-1] = f"{parts[-1].partition('-')[0]}-{k}"
        else:
            parts.append(str(k))
    return ",".join(parts)


def _named_buckets(op_names: Sequence[str]) -> tuple[BucketRef, ...]:
    """The (chain, bucket) pairs named by bucket scopes in ``op_names``, sorted."""
    refs = {(_CHAIN_OF_SUBSCOPE.get(m.group(1), "dense"), int(m.group(2)))
            for name in op_names if (m := _CHAIN_BUCKET.search(name))}
    return tuple(sorted(refs))


def _bucket_of(c: Collective) -> int | None:
    """The first dense bucket a named collective carries (the one-chain form)."""
    return next((k for chain, k in _named_buckets(c.op_names) if chain == "dense"), None)


def collective_buckets(sched: Schedule, c: Collective) -> tuple[BucketRef, ...]:
    """The (chain, bucket) pairs a collective carries, sorted: from its op names or, when XLA
    combined collectives into one without a name, from the op names that feed it
    (:meth:`Schedule.op_names_of`). ``()`` for a collective of no :class:`GradSync` bucket.

    Example::

        >>> collective_buckets(sched, merged)  # doctest: +SKIP
        (('dense', 5), ('expert', 0))
    """
    return _named_buckets(sched.op_names_of(c))


def bucket_spans(
    sched: Schedule, collectives: Sequence[Collective] | None = None, computation: str | None = None
) -> dict[str, dict[int, tuple[int, int]]]:
    """Chain -> bucket -> (first start, last end) of the bucket's collectives in one
    computation (default: ENTRY). A synchronous collective ends at its start; a combined one
    counts for every bucket it carries.

    Example::

        >>> bucket_spans(sched)["expert"]  # doctest: +SKIP
        {0: (812, 840), 1: (851, 877)}
    """
    computation = computation or sched.entry
    spans: dict[str, dict[int, tuple[int, int]]] = {}
    for c in sched.collectives if collectives is None else collectives:
        if c.computation != computation:
            continue
        end = c.start if c.is_sync else c.done
        for chain, k in collective_buckets(sched, c):
            s, e = spans.setdefault(chain, {}).get(k, (c.start, end))
            spans[chain][k] = (min(s, c.start), max(e, end))
    return spans


def max_overlap(spans: Sequence[tuple[int, int]]) -> int:
    """Most of the inclusive ``(start, end)`` spans that overlap at one position.

    Example::

        >>> max_overlap([(0, 3), (3, 5), (6, 7)])
        2
    """
    events = sorted([(s, 0) for s, _ in spans] + [(e, 1) for _, e in spans])
    best = live = 0
    for _, kind in events:  # starts sort before ends at the same index: both inclusive
        live += 1 if kind == 0 else -1
        best = max(best, live)
    return best


def _in_flight(sched: Schedule, collectives: Sequence[Collective]) -> tuple[int, dict[str, int]]:
    """(most buckets in flight at once in any one chain, per chain the most of its buckets).

    Chains run independently (their drains do not wait on each other), so each is bounded on
    its own. Collectives of no bucket (XLA's own, or everything when planning without a scope)
    each count as a one-collective bucket of their own group, which bounds the first number too.
    """
    per_chain: dict[str, int] = {}
    loose = 0
    for comp in dict.fromkeys(c.computation for c in collectives):
        for chain, spans in bucket_spans(sched, collectives, comp).items():
            per_chain[chain] = max(per_chain.get(chain, 0), max_overlap(list(spans.values())))
        loose = max(loose, max_overlap([(c.start, c.start if c.is_sync else c.done) for c in collectives
                                        if c.computation == comp and not collective_buckets(sched, c)]))
    ordered = {k: per_chain[k] for k in CHAIN_SCOPES if k in per_chain}
    return max([loose, *ordered.values()]), ordered


def _is_sync_collective(sched: Schedule, c: Collective, scope: str | None) -> bool:
    """In ``scope`` by op name; an unnamed (combined) collective by what feeds it, when that
    names a sync bucket."""
    if scope is None or c.in_scope(scope):
        return True
    return not c.op_name and bool(collective_buckets(sched, c)) and any(
        scope in n for n in sched.feeding_op_names(c))


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
            (:func:`jax_drain.planner.targets.gpu_mesh`); jitted here if it is not already.
        abstract_args: ``jax.ShapeDtypeStruct`` (or array) pytrees.
        target, topology: labels for the report (the devices are the mesh's).
        compiler_options: XLA options for this compile, e.g.
            ``{"xla_gpu_reduce_scatter_combine_threshold_bytes": 2**26}``.
        scope: only collectives whose op name contains this are the sync's (and unnamed ones
            XLA combined from sync buckets, see :func:`collective_buckets`); ``None`` keeps all.
        report_fields: ``strategy``, ``num_buckets``, ``bucket_size``, ``notes`` for the report.
    """
    jitted = step if hasattr(step, "lower") else jax.jit(step)
    start = time.perf_counter()
    try:
        lowered = jitted.lower(*abstract_args)
    except Exception as e:
        raise PlanError(f"could not trace the step: {type(e).__name__}: {e}") from e
    with tempfile.TemporaryDirectory(prefix="jax_drain_schedule_") as dump:
        # XLA writes its scheduler's price list of this very compile there.
        options = {**(compiler_options or {}), **schedule_dump_options(dump)}
        try:
            compiled = lowered.compile(compiler_options=options)
        except Exception as e:
            raise PlanError(f"XLA could not compile the step for {target}: {type(e).__name__}: {e}") from e
        compile_s = time.perf_counter() - start
        step_time = read_schedule_dump(dump)
    memory = compiled.memory_analysis()
    sched = parse_schedule(compiled.as_text())
    mine = tuple(c for c in sched.collectives if _is_sync_collective(sched, c, scope))
    buckets_in_flight, chains_in_flight = _in_flight(sched, mine)
    devices = _step_devices(compiled)
    return Plan(
        target=target,
        topology=topology,
        num_devices=devices,
        temp_bytes=int(memory.temp_size_in_bytes),
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        compile_s=compile_s,
        collectives=mine,
        buckets_in_flight=buckets_in_flight,
        collectives_in_flight=sched.max_in_flight(lambda c: c in mine),
        live_bytes=tuple(sched.live_bytes()),
        collective_buckets=tuple(collective_buckets(sched, c) for c in mine),
        chains_in_flight=chains_in_flight,
        all_collectives=sched.collectives,
        step_time=step_time,
        **report_fields,
    )


def _step_devices(compiled: Any) -> int:
    try:
        return len(jax.tree.leaves(compiled.input_shardings)[0].device_set)
    except Exception:  # pragma: no cover - a step without array inputs
        return 1


# -- built-in presets: the benchmark's steps --------------------------------------------------

def bucket_size_for(
    params: Any, num_buckets: int, axis_size: int = 8, order: Sequence[int] | None = None, *,
    split_leaves: bool = False, groups: Sequence[Any] | None = None,
) -> int:
    """The bucket size (elements) whose layout has the bucket count nearest ``num_buckets``.

    Buckets close once they reach the size, so ``total / num_buckets`` can give fewer, larger
    buckets than asked for. The count falls as the size grows, in steps: this searches for the
    two sizes whose counts bracket ``num_buckets``, keeps the nearer count (the larger one on a
    tie) and returns the largest size that gives it. The count lands within 10% of
    ``num_buckets`` whenever any size gets there. It cannot always: there is at most one bucket
    per leaf (per dtype), and a leaf larger than ``total / num_buckets`` fills a bucket by
    itself, so the remaining leaves must make up the other buckets; with few of them, or
    leaves of equal size (whose counts jump from ``L`` to ``L / 2``), the nearest achievable
    count is returned. ``groups``: the layout's (``BucketLayout.build``), counted with them.

    Example::

        >>> params = {f"w{i}": jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16) for i in range(12)}
        >>> BucketLayout.build(params, bucket_size_for(params, 4), 128).num_buckets
        4
    """
    if isinstance(num_buckets, bool) or int(num_buckets) < 1:
        raise ValueError(f"num_buckets must be a positive integer, got {num_buckets!r}")
    count = lambda size: BucketLayout.build(params, size, math.lcm(axis_size, 128), order,  # noqa: E731
                                            groups=groups).num_buckets
    total = max(1, sum(math.prod(p.shape) for p in jax.tree.leaves(params)))
    if split_leaves:  # buckets of exactly the size: the total over the count, padded up
        multiple = math.lcm(axis_size, 128)
        return max(multiple, -(-total // (int(num_buckets) * multiple)) * multiple)

    def largest(at_least: int) -> int:  # the largest size whose count is >= at_least
        low, high = 1, total
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if count(mid) >= at_least else (low, mid - 1)
        return low

    size = largest(min(num_buckets, count(1)))  # count(1): one bucket per leaf, the most possible
    if size < total:
        fewer = count(size + 1)  # the next count down: below num_buckets
        if abs(fewer - num_buckets) < abs(count(size) - num_buckets):
            size = largest(fewer)
    return size


def build_step(
    strategy: Strategy | str,
    config: models.GPTConfig,
    mesh: Mesh,
    axis: str = "data",
    bucket_size: int | None = None,
    micro_batch: int = 1,
) -> tuple[Callable[..., Any], tuple[Any, ...], GradSync | ScanGradSync | None]:
    """A jitted gradient step for ``config`` on ``mesh`` with ``strategy``, its abstract inputs
    (params, batch) and its sync (``None`` for baselines): :func:`build_user_step` on the
    preset's loss, params and a batch of ``micro_batch`` sequences per device.

    A scanned preset (``config.scan_layers``) syncs with :class:`ScanGradSync`: each layer's
    buckets are reduce-scattered inside the backward scan. Its ``no_comm`` floor keeps the
    stacked gradients and reduces their buckets locally, as the scanned model without
    jax_drain's in-scan sync would have to.
    """
    params = models.abstract_params(config)
    batch = models.example_batch(config, micro_batch * mesh.shape[axis])
    loss_fn = models.make_loss(config)
    stacked = stacked_leaves(loss_fn, params, batch) if config.scan_layers else None
    return build_user_step(strategy, loss_fn, params, batch, mesh, axis=axis, bucket_size=bucket_size,
                           stacked=stacked)


def split_supported(cls: type = GradSync) -> bool:
    """Whether this version's ``cls`` (``GradSync``, ``ScanGradSync``) has the ``split_leaves``
    option that the ``+split`` strategies need."""
    try:
        return "split_leaves" in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # pragma: no cover - a signature inspect cannot read
        return False


def build_user_step(
    strategy: Strategy | str,
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    mesh: Mesh,
    *,
    axis: str = "data",
    bucket_size: int | None = None,
    order: Sequence[int] | None = None,
    stacked: Any = None,
    groups: Sequence[Any] | None = None,
    param_specs: Any = None,
    tensor_parallel: str = "gspmd",
) -> tuple[Callable[..., Any], tuple[Any, ...], GradSync | ScanGradSync | None]:
    """A jitted gradient step of any ``loss_fn(params, batch)`` with ``strategy`` on ``mesh``
    (data parallel over ``axis``), its abstract inputs (params, batch) and its sync (``None``
    for baselines).

    ``params`` and ``batch`` are global-shape pytrees of arrays or ``jax.ShapeDtypeStruct``;
    the batch is split along its leading axis over ``axis``, params are replicated over it,
    and ``loss_fn`` gets this device's part of the batch (its per-device mean loss).

    ``param_specs`` (a ``PartitionSpec`` per parameter over the mesh's other axes) makes the
    step tensor parallel, the parameters split as the specs say on every strategy.
    ``tensor_parallel`` says how the loss is written, as :class:`jax_drain.TrainConfig`'s:
    ``"gspmd"`` (global shapes, XLA partitions it) or ``"manual"`` (local blocks and its own
    collectives over the model axes; the baselines ``gspmd*`` need ``"gspmd"``).

    * ``gspmd``/``gspmd+flags``: plain ``jax.jit(jax.grad(loss_fn))``, gradients sharded where
      their leading dimension divides (with ``param_specs``: the first dimension the specs
      leave free that divides); XLA places the communication.
    * ``gspmd_fsdp``: the same ``jax.jit(jax.grad(loss_fn))`` with params *and* gradients sharded
      over ``axis`` by annotations, as MaxText's ``fsdp`` axis does (ZeRO-3 without an
      optimizer): each leaf along the dimension :func:`fsdp_spec` picks (its smallest one that
      the axis size divides, ``d_model`` for a transformer's weights; never a scanned leaf's
      layer axis nor a dimension ``param_specs`` splits; replicated when none divides), params
      in and gradients out with that sharding, the batch split over ``axis``. XLA inserts the
      all-gathers (in the forward, and again in a rematerialised backward) and the gradient
      reduce-scatters itself; no bucket layout, no scope. XLA flags (combine thresholds,
      pipelined all-gather, ...) go in as ``compiler_options``.
    * ``no_comm``: the same buckets, each reduced over its own chunks locally (drained): the
      sync's work minus the wire, the floor a gradient sync can approach.
    * ``MODE[+drain[K]][+split][+blocks]``: :class:`GradSync` (``reduce=MODE``), or with ``stacked``
      (a mask of scanned leaves, :func:`jax_drain.stacked_leaves`) :class:`ScanGradSync`
      (whose layer buckets follow the layers already: ``+blocks`` changes nothing there).
    * ``...+ppN``: the data devices split into ``N`` pipeline stages, the loss's layer scan
      piped over them (:func:`jax_drain.make_train_step` with ``TrainConfig(stage_axis=
      "stage")``, the most micro-batches up to ``2N`` that divide the ``N`` devices' rows). The
      step compiled is the whole train step with plain SGD (no optimizer state), its inputs the
      train state and the batch: the gradient, each stage's chain and an in-place update.

    ``order`` (the gradient-ready order, :func:`jax_drain.grad_ready_order`) and, for
    ``+blocks``, ``groups`` (:func:`jax_drain.remat_groups`) are traced from ``loss_fn`` when not
    given. Raises :class:`StrategyUnavailable` for a ``+split`` strategy
    when the runtime has no ``split_leaves`` option, or for a ``gspmd*`` baseline of a
    ``"manual"`` loss.
    """
    strategy = Strategy.parse(strategy) if isinstance(strategy, str) else strategy
    if strategy.stages > 1:
        return _staged_step(strategy, loss_fn, params, batch, mesh, axis, bucket_size, param_specs, tensor_parallel)
    specs = jax.tree.map(lambda _: P(), params) if param_specs is None else param_specs
    if strategy.is_baseline and strategy.name != "no_comm":
        if tensor_parallel != "gspmd" and param_specs is not None:
            raise StrategyUnavailable(f"{strategy.name} partitions a loss written for global shapes; this loss runs "
                                      "on local blocks (tensor_parallel='manual')")
        return _baseline_step(strategy, loss_fn, params, batch, mesh, axis, specs, stacked)

    tp = {} if param_specs is None else dict(param_specs=param_specs, tensor_parallel=tensor_parallel)
    scanned = stacked is not None and any(jax.tree.leaves(stacked))
    if order is None:
        order = grad_ready_order(loss_fn, params, batch, **_traced_in(mesh, axis, specs, tp))
    extra: dict[str, Any] = dict(tp)
    if strategy.split:
        cls = ScanGradSync if scanned and strategy.name != "no_comm" else GradSync
        if not split_supported(cls):
            raise StrategyUnavailable(
                f"not available in this version: {cls.__name__} has no split_leaves option")
        extra["split_leaves"] = True
    drain = strategy.max_in_flight is not None
    if scanned and strategy.name != "no_comm":
        sync: ChainedSync = ScanGradSync(
            params, mesh, axis=axis, stacked=stacked, bucket_size=bucket_size,
            reduce=strategy.reduce, drain=drain, max_in_flight=strategy.max_in_flight, order=order, **extra,
        )
    else:
        if strategy.blocks:
            extra["bucket_groups"] = (remat_groups(loss_fn, params, batch, **_traced_in(mesh, axis, specs, tp))
                                      if groups is None else groups)
        sync = GradSync(
            params, mesh, axis=axis, bucket_size=bucket_size, reduce=strategy.reduce or "fp32_accum",
            drain=drain, max_in_flight=strategy.max_in_flight, order=order, **extra,
        )
    if strategy.zero3:
        return _zero3_step(sync, loss_fn, batch, strategy.reshard_after_forward)
    # no_comm: the sync's work minus the wire (each bucket summed over its own chunks, drained).
    floor = strategy.name == "no_comm"
    fn = _no_comm_grad(sync, loss_fn, sync.shard_specs()) if floor else sync.value_and_grad(loss_fn)
    step = jax.jit(sync.shard_map(fn, in_specs=(sync.param_specs, sync.batch_spec),
                                  out_specs=(P(), sync.shard_specs())),
                   in_shardings=_placed(sync, (sync.param_specs, sync.batch_spec)))
    return step, (params, batch), sync


#: The pipeline-stage axis a ``+ppN`` strategy splits the data devices into.
STAGE_AXIS = "stage"


def _staged_step(strategy: Strategy, loss_fn: Callable[..., Any], params: Any, batch: Any, mesh: Mesh, axis: str,
                 bucket_size: int | None, param_specs: Any, tensor_parallel: str) -> tuple[Any, tuple[Any, ...], Any]:
    """A ``+ppN`` strategy's train step: ``axis`` split into (``axis``, :data:`STAGE_AXIS`),
    stage neighbours adjacent in the mesh's device order."""
    stages = strategy.stages
    names, shape = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    k, n = names.index(axis), int(mesh.shape[axis])
    if n % stages:
        raise StrategyUnavailable(f"{strategy.name}: the {n} devices of {axis!r} do not split into {stages} stages")
    staged = Mesh(mesh.devices.reshape(shape[:k] + (n // stages, stages) + shape[k + 1:]),
                  names[:k] + (axis, STAGE_AXIS) + names[k + 1:])
    tp = {} if param_specs is None else dict(param_specs=param_specs, tensor_parallel=tensor_parallel)
    rows = {x.shape[0] // n for x in jax.tree.leaves(batch) if x.ndim} or {1}
    piped = stages * min(rows)  # the rows a stage pipes
    microbatches = max(m for m in range(1, 2 * stages + 1) if piped % m == 0)
    config = TrainConfig(
        axis=axis, stage_axis=STAGE_AXIS, pipeline_microbatches=microbatches, pipeline_schedule=strategy.schedule,
        bucket_size=bucket_size,
        reduce=strategy.reduce, drain=strategy.max_in_flight is not None, max_in_flight=strategy.max_in_flight,
        split_leaves=strategy.split, shard_params=strategy.zero3, reshard_after_forward=strategy.reshard_after_forward,
        bucket_boundaries="remat" if strategy.blocks else None, **tp)
    try:
        step = make_train_step(params, loss_fn, optax.sgd(1e-3), staged, config, example_batch=batch)
    except ValueError as e:
        raise StrategyUnavailable(f"{strategy.name}: {e}") from e
    return step, (step.abstract_state(), batch), step.sync


def _placed(sync: ChainedSync, specs: Any) -> Any:
    """A ``NamedSharding`` for each of ``specs`` on the sync's mesh: the step's inputs placed as a train
    step places them. With ``"gspmd"`` the ``shard_map`` states only the data axes, and XLA
    would otherwise pick the model axes' layout of an argument itself (a gathered embedding
    replicated, say)."""
    return jax.tree.map(lambda spec: NamedSharding(sync.mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def _traced_in(mesh: Mesh, axis: str, specs: Any, tp: dict[str, Any]) -> dict[str, Any]:
    """How :func:`grad_ready_order` and :func:`remat_groups` trace a tensor-parallel loss: inside
    the step's ``shard_map``, manual over ``axis`` only when XLA partitions the loss."""
    if not tp:
        return {}
    return dict(mesh=mesh, in_specs=(specs, P(axis)),
                axis_names=(axis,) if tp["tensor_parallel"] == "gspmd" else None)


def _free_dims(spec: P, ndim: int) -> list[int]:
    """The dimensions ``spec`` leaves unsplit."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return [d for d in range(ndim) if entries[d] is None]


def _add_axis(spec: P, ndim: int, dim: int | None, axis: str) -> P:
    """``spec`` with ``axis`` on dimension ``dim`` too (unchanged for ``None``)."""
    if dim is None:
        return spec
    entries = list(tuple(spec) + (None,) * (ndim - len(spec)))
    entries[dim] = axis
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _baseline_step(strategy: Strategy, loss_fn: Callable, params: Any, batch: Any, mesh: Mesh, axis: str,
                   specs: Any, stacked: Any) -> tuple[Callable[..., Any], tuple[Any, ...], None]:
    """``gspmd``, ``gspmd+flags`` and ``gspmd_fsdp``: ``jax.jit(jax.grad(loss_fn))``, the params
    split over the model axes by ``specs``, XLA placing the communication."""
    n = mesh.shape[axis]
    mask = jax.tree.map(lambda _: False, params) if stacked is None else stacked
    is_spec = lambda x: isinstance(x, P)  # noqa: E731

    def grad_spec(p: Any, spec: P) -> P:
        free = [d for d in _free_dims(spec, p.ndim) if p.shape[d] % n == 0]
        # Replicated leaves along their leading dimension only; a split one along any free dimension.
        dim = free[0] if free and (free[0] == 0 or len(_free_dims(spec, p.ndim)) < p.ndim) else None
        return _add_axis(spec, p.ndim, dim, axis)

    def fsdp(p: Any, spec: P, stacked_leaf: Any) -> P:
        split = [d for d in range(p.ndim) if d not in _free_dims(spec, p.ndim)]
        picked = tuple(fsdp_spec(p.shape, n, axis, bool(stacked_leaf), exclude=split))
        return _add_axis(spec, p.ndim, picked.index(axis) if axis in picked else None, axis)

    param_specs = specs
    if strategy.name == "gspmd_fsdp":
        param_specs = jax.tree.map(fsdp, params, specs, mask, is_leaf=is_spec)
        grad_specs = param_specs
    else:
        grad_specs = jax.tree.map(grad_spec, params, specs, is_leaf=is_spec)
    named = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=is_spec)  # noqa: E731
    step = jax.jit(jax.grad(loss_fn), in_shardings=(named(param_specs), NamedSharding(mesh, P(axis))),
                   out_shardings=named(grad_specs))
    return step, (params, batch), None


def _zero3_step(sync: ChainedSync, loss_fn: Callable, batch: Any,
                reshard_after_forward: bool = True) -> tuple[Any, tuple, ChainedSync]:
    """A ZeRO-3 gradient step of ``sync`` and its abstract inputs: the parameter shards (global,
    split like the gradient shards) and the batch. The gathers run one bucket ahead
    (``gather_max_in_flight=1``) whatever the drain depth."""
    zero3.check_shardable(sync)
    shards = sync.pack_shards([jax.ShapeDtypeStruct(chain.global_shard_shape(k), chain.layout.buckets[k].dtype)
                               for chain, k in sync.flat_chains])
    grad_fn = zero3.value_and_grad(sync, loss_fn, reshard_after_forward=reshard_after_forward)
    step = jax.jit(sync.shard_map(grad_fn, in_specs=(sync.shard_specs(), sync.batch_spec),
                                  out_specs=(P(), sync.shard_specs())),
                   in_shardings=_placed(sync, (sync.shard_specs(), sync.batch_spec)))
    return step, (shards, batch), sync


def fsdp_spec(shape: Sequence[int], axis_size: int, axis: str = "data", stacked: bool = False,
              rule: str = "smallest", exclude: Sequence[int] = ()) -> P:
    """The ``gspmd_fsdp`` baseline's ``PartitionSpec`` of one leaf (``rule="smallest"``): its
    smallest dimension that ``axis_size`` divides is sharded over ``axis`` (on a tie the first,
    the most major one); a leaf with no such dimension (a scalar, an odd-sized bias) is
    replicated. A ``stacked`` leaf's leading (layer) axis is never picked: the scan slices it
    one layer at a time, and sharding it would make XLA gather the whole stack before the loop.

    For a transformer's weights the smallest dimension is ``d_model``, the ``embed`` dimension
    that MaxText's ``fsdp`` logical axis shards: ``qkv`` ``(d, 3d)``, ``fc_in`` ``(d, 4d)`` and
    ``fc_out`` ``(4d, d)`` all along ``d``, norms ``(d,)`` along ``d``, ``attn/out`` ``(d, d)``
    along its first. XLA then gathers each weight whole and keeps the activations batch-sharded
    (plain ZeRO-3: on the GPT presets all-gathers of exactly 2x the params, forward and
    rematerialised backward, reduce-scatters of exactly 1/axis_size of them, nothing else).

    ``exclude``: dimensions never picked (those a tensor-parallel spec already splits).

    ``rule="largest"`` (the largest divisible dimension) is the other rule that needs no axis
    names. Without activation sharding constraints (a plain ``loss_fn`` has none) XLA's
    sharding propagation carries a weight's sharded output-feature dimension into the
    activations: on ``gpt-blocks`` it reshards the attention with all-to-alls and computes part
    of the gradient model-parallel (more temp bytes). Neither rule suits every model: a tied
    embedding ``(vocab, d)`` sharded along ``d`` hands ``d``-sharded activations to the blocks
    (``gpt-tied`` is better off with ``"largest"``, which shards the vocabulary), where
    MaxText's activation constraints keep the batch sharding.

    Example::

        >>> fsdp_spec((2048, 8192), 8)
        P('data',)
        >>> fsdp_spec((8, 2048), 8, stacked=True)  # the layer axis is never sharded
        P(None, 'data')
        >>> fsdp_spec((2048, 8192), 8, rule="largest")
        P(None, 'data')
        >>> fsdp_spec((3,), 8)
        P()
    """
    if rule not in ("smallest", "largest"):
        raise ValueError(f"fsdp_spec: unknown rule {rule!r}; use 'smallest' or 'largest'")
    dims = [d for d in range(1 if stacked else 0, len(shape)) if shape[d] % axis_size == 0 and d not in exclude]
    if not dims:
        return P()
    sign = 1 if rule == "smallest" else -1
    best = min(dims, key=lambda d: (sign * shape[d], d))
    return P(*([None] * best + [axis]))


def strategy_options(strategy: Strategy, bucket_bytes: int | None) -> dict[str, Any]:
    """XLA options a strategy compiles with: for ``gspmd+flags`` the reduce-scatter combine
    threshold at one bucket's bytes and the latency-hiding scheduler; none otherwise."""
    if strategy.name != "gspmd+flags":
        return {}
    options: dict[str, Any] = {}
    if bucket_bytes:
        options["xla_gpu_reduce_scatter_combine_threshold_bytes"] = bucket_bytes
    options["xla_gpu_enable_latency_hiding_scheduler"] = True
    return options


def mesh_block_params(layers: int, d_model: int, expert: bool = False, num_experts: int = 4,
                      dtype: Any = jnp.bfloat16) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
    """Abstract params of :func:`mesh_block_loss`'s block stack (global shapes).

    Per block ``layer{i}``: a float32 ``norm``, ``w_in`` ``(d, 4d)`` and ``w_out`` ``(4d, d)``
    in ``dtype``, and with ``expert`` a stack ``experts`` ``(num_experts, d, 2d)``.

    Example::

        >>> mesh_block_params(2, 64)["layer1"]["w_in"].shape
        (64, 256)
    """
    layer = {"w_in": jax.ShapeDtypeStruct((d_model, 4 * d_model), dtype),
             "w_out": jax.ShapeDtypeStruct((4 * d_model, d_model), dtype),
             "norm": jax.ShapeDtypeStruct((d_model,), jnp.float32)}
    if expert:
        layer["experts"] = jax.ShapeDtypeStruct((num_experts, d_model, 2 * d_model), dtype)
    return {f"layer{i}": dict(layer) for i in range(layers)}


def mesh_block_specs(params: Any, model_axis: str = "model", expert_axis: str = "expert") -> Any:
    """Megatron tensor-parallel ``PartitionSpec``s for :func:`mesh_block_params`: ``w_in``
    column-parallel, ``w_out`` row-parallel, experts split over ``expert_axis`` (and their
    hidden dimension over ``model_axis``), norms replicated.

    Example::

        >>> mesh_block_specs(mesh_block_params(1, 64))["layer0"]["w_out"]
        P('model', None)
    """
    tp = {"w_in": P(None, model_axis), "w_out": P(model_axis, None), "norm": None,
          "experts": P(expert_axis, None, model_axis)}
    return {name: {k: tp[k] for k in layer} for name, layer in params.items()}


def mesh_block_loss(p: Any, x: jax.Array, expert_axis: str | None = None,
                    model_axis: str | None = "model") -> jax.Array:
    """A residual stack of tensor-parallel MLP blocks, per device inside ``shard_map``.

    Each block: ``x -> tanh(norm(x) @ w_in) @ w_out`` with ``w_in`` column- and ``w_out``
    row-parallel, so one ``psum`` over ``model_axis`` per block (Megatron's MLP). With
    ``model_axis=None`` the same stack on global shapes, written for GSPMD: no collectives, XLA
    partitions it (``tensor_parallel="gspmd"``). With ``expert_axis``: then tokens go to the
    ranks along it (all-to-all), through the local expert (its hidden dimension split over
    ``model_axis``) and back.

    Example::

        >>> loss = lambda p, x: mesh_block_loss(p, x, expert_axis="expert")  # doctest: +SKIP
    """
    h = x
    d = x.shape[-1]
    for i in range(len(p)):
        q = p[f"layer{i}"]
        z = jnp.tanh((h * q["norm"]).astype(q["w_in"].dtype) @ q["w_in"])
        y = z @ q["w_out"]
        h = h + (jax.lax.psum(y, model_axis) if model_axis else y).astype(h.dtype)
        if expert_axis:
            n = _compat.axis_size(expert_axis)
            blocks = jax.lax.all_to_all(h.astype(q["experts"].dtype).reshape(n, -1, d), expert_axis, 0, 0, tiled=True)
            y = jnp.einsum("ncd,de->nce", blocks, q["experts"][0])
            y = jax.lax.psum(y @ q["experts"][0].T, model_axis)
            h = h + jax.lax.all_to_all(y, expert_axis, 0, 0, tiled=True).reshape(-1, d).astype(h.dtype)
    return jnp.mean(h ** 2)


def build_mesh_step(
    mesh: Mesh,
    layers: int = 4,
    d_model: int = 256,
    reduce: str = "fp32_accum",
    drain: bool = True,
    max_in_flight: int | None = None,
    bucket_size: int | None = None,
    expert: bool = False,
    tokens_per_device: int = 64,
    outer_axis: str | None = "replica",
    model_axis: str = "model",
    *,
    tensor_parallel: str = "manual",
    dtype: Any = jnp.bfloat16,
) -> tuple[Callable[..., Any], tuple[Any, ...], GradSync]:
    """A jitted gradient step of :func:`mesh_block_loss` on a ``("replica", "data", "model")``
    mesh (with ``expert``: ``("replica", "data", "expert", "model")``): tensor parallel over
    ``model_axis``, HSDP (inner reduce-scatter over the data axes, outer all-reduce over
    ``outer_axis``), expert params in their own chain. Returns the step, its abstract inputs
    (params, batch) and its :class:`GradSync`, ready for :func:`plan`.

    ``tensor_parallel``: ``"manual"``, the loss on local blocks with its own ``psum``; or
    ``"gspmd"``, the loss on global shapes, partitioned by XLA, the buckets reduced on local
    blocks in the nested region (not with ``expert``). ``reduce="no_comm"``: the floor, the
    same buckets each summed over its own chunks locally (drained), the sync's work minus
    the wire. ``bucket_size`` (elements) defaults to one local ``w_in`` block per bucket.

    Example::

        mesh = gpu_mesh((2, 4, 2), ("replica", "data", "model"), topology="1x2x8")
        report = plan(*build_mesh_step(mesh, layers=8, d_model=1024)[:2], topology="1x2x8")
    """
    missing = [a for a in (outer_axis, model_axis, "data", "expert" if expert else None)
               if a and a not in mesh.axis_names]
    if missing:
        raise ValueError(f"build_mesh_step needs mesh axes {missing} (the mesh has {mesh.axis_names}); "
                         "name them, e.g. gpu_mesh((2, 4, 2), ('replica', 'data', 'model'))")
    if expert and tensor_parallel == "gspmd":
        raise ValueError("build_mesh_step: expert params are not supported with tensor_parallel='gspmd'")
    params = mesh_block_params(layers, d_model, expert, dtype=dtype)
    if bucket_size is None:
        bucket_size = 4 * d_model * d_model // mesh.shape[model_axis]
    chains = dict(axis=("data", "expert"), expert=lambda path: path.endswith("experts"),
                  expert_axis="data") if expert else {}
    floor = reduce == "no_comm"
    sync = GradSync(params, mesh, bucket_size=bucket_size, reduce="fp32_accum" if floor else reduce, drain=drain,
                    max_in_flight=max_in_flight, outer_axis=outer_axis,
                    param_specs=mesh_block_specs(params, model_axis), tensor_parallel=tensor_parallel, **chains)
    in_loss = None if tensor_parallel == "gspmd" else model_axis
    loss = (lambda p, x: mesh_block_loss(p, x, "expert", in_loss)) if expert else \
        (lambda p, x: mesh_block_loss(p, x, None, in_loss))
    out_specs = Shards(sync.shard_spec, sync.expert_shard_spec) if expert else sync.shard_spec
    if floor:  # nothing all-reduced over the outer axes either: each replica keeps its own shards
        out_specs = _over_outer_axes(sync, out_specs)
    step = jax.jit(sync.shard_map(_no_comm_grad(sync, loss, out_specs) if floor else sync.value_and_grad(loss),
                                  in_specs=(sync.param_specs, sync.batch_spec), out_specs=(P(), out_specs)),
                   in_shardings=_placed(sync, (sync.param_specs, sync.batch_spec)))
    batch = jax.ShapeDtypeStruct((sync.axis_size * sync.outer_size * tokens_per_device, d_model), jnp.float32)
    return step, (params, batch), sync


def _over_outer_axes(sync: GradSync, specs: Any) -> Any:
    """Shard ``specs`` split over the sync's outer axes too, first (each replica its own)."""
    def widen(spec: P) -> P:
        entry = spec[-1]
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        return P(*spec[:-1], (*sync.outer_axes, *axes))

    return jax.tree.map(widen, specs, is_leaf=lambda x: isinstance(x, P))


def _no_comm_grad(sync: GradSync, loss_fn: Callable, shard_specs: Any) -> Callable:
    """``(params, batch) -> (loss, shards)`` with no gradient communication: each device's
    local gradient, every bucket summed over its own chunks on the device (drained, one chain),
    shards of the sync's shapes, split over ``shard_specs``. The floor a sync's temp memory can
    approach."""
    n = sync.axis_size

    def local_sums(grads: Any) -> tuple[jax.Array, ...]:
        buckets = sync.flat_shards(sync.flatten(grads))
        return sync.pack_shards(sequenced_map(
            lambda k, bucket: jnp.sum(bucket.reshape(n, -1).astype(jnp.float32), axis=0), buckets, 1))

    def step(params: Any, batch: Any) -> tuple[jax.Array, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(sync.local_params(params), batch)
        shards = sync.on_local_blocks(local_sums, (sync.param_specs,), shard_specs)(grads)
        return jax.lax.pmean(loss, sync.data_axes), shards

    return step


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
    bytes and the latency-hiding scheduler on; ``"gspmd_fsdp"`` with none (give its XLA flags
    in ``compiler_options``; the bucket size does not reach it). XLA keeps one async collective
    in flight by default; a drain depth K > 1 needs
    ``compiler_options={"xla_gpu_experimental_parallel_collective_overlap_limit": K}``.
    """
    config = models.preset(preset) if isinstance(preset, str) else preset
    strat = Strategy.parse(strategy)
    slices, hosts, gpus = parse_topology(topology)
    mesh = gpu_mesh((slices * hosts * gpus,), ("data",), target=target, topology=topology)
    params = models.abstract_params(config)
    if bucket_size is None:
        loss, example = models.make_loss(config), models.example_batch(config, mesh.size)
        order = grad_ready_order(loss, params, example)
        groups = remat_groups(loss, params, example) if strat.blocks else None
        bucket_size = bucket_size_for(params, num_buckets or 1, mesh.size, order, split_leaves=strat.split,
                                      groups=groups)
    step, args, sync = build_step(strat, config, mesh, bucket_size=bucket_size, micro_batch=micro_batch)
    options, notes = dict(compiler_options or {}), []
    for name, value in strategy_options(strat, bucket_size * jnp.dtype(config.param_dtype).itemsize).items():
        options.setdefault(name, value)
    if options:
        notes.append(f"XLA options {options}")
    return plan(
        step, *args, target=target, topology=topology, compiler_options=options or None,
        scope=None if sync is None else SCOPE_PREFIX,
        strategy=strat.name, num_buckets=total_buckets(sync),
        bucket_size=bucket_size, notes=tuple(notes),
    )


def preset_config(name: str, layers: int | None = None, d_model: int | None = None,
                  heads: int | None = None, seq: int | None = None,
                  scan_layers: bool | None = None) -> models.GPTConfig:
    """A preset with optional overrides of its size (and of whether its blocks are scanned)."""
    config = models.preset(name)
    changes = {k: v for k, v in (("num_layers", layers), ("d_model", d_model), ("num_heads", heads),
                                 ("seq_len", seq), ("scan_layers", scan_layers)) if v is not None}
    return dataclasses.replace(config, **changes)
