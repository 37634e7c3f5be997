"""The fastest configuration that fits: a search over bucket layouts, drain depths, reduce modes
and ZeRO stages, ranked by XLA's predicted step time, kept to a memory budget.

:func:`search_model` (your ``loss_fn(params, batch)``) and :func:`search_preset` (a built-in
GPT) compile gradient steps for compile-only GPUs, as :func:`jax_drain.planner.compare.plan_model`
does, and return a :class:`Search`: every configuration compiled (XLA's temp and argument bytes
per device, its predicted step), the time-memory frontier, and the choice: the configuration
with the lowest predicted step whose temp + arguments fit ``memory_budget``, as a
:class:`jax_drain.TrainConfig` (:meth:`Search.config`).

How it searches (each compile takes seconds to minutes, so it compiles few):

1. The floor, ``no_comm`` (the same step without gradient communication): no configuration is
   predicted faster, so a choice that reaches it ends the search. Not compiled when the whole
   parameters alone exceed the budget: then only ZeRO-3 can fit, whose gathers the floor lacks.
2. The default strategies (:data:`DEFAULT_CANDIDATES`) at the default bucket count: the choice
   is never slower than any of them that fits.
3. Around the fastest configuration that fits (the first found at that time; while none fits,
   the smallest): twice and half the buckets, one bucket more or less in flight, the other
   reduce modes, split leaves, buckets that follow the remat blocks, the ZeRO stage and, with
   ZeRO-3, ``reshard_after_forward``; one compile at a time, until no neighbour is left or
   ``max_compiles`` is spent. The choice is the fastest that fits; of configurations within
   0.1% of it (XLA's pricing noise) and no slower than a fitting default, the smallest.

A candidate is skipped without a compile when what is known shows it cannot fit or cannot be
faster (``Search.pruned`` says which and why): its arguments alone exceed the budget (the
parameters, whole or as ZeRO-3 shards, and this device's batch); a compiled configuration that
keeps at most as much alive (the same layout with fewer buckets in flight or smaller buckets, or
resharding) is already over the budget; it lays out the very buckets of one already seen; or
the same work, compiled at another bucket count or depth, already costs as much compute alone
(within 2%) as the choice's whole step. The second and last are rules of thumb: XLA's heap
packing and pricing need not be monotone.

Example::

    from jax_drain import plan

    found = plan.search_preset("gpt-blocks", 1200 * 2**20)
    print(found)              # the table: every compile, the frontier, the choice
    config = found.config()   # a jd.TrainConfig
    found.plot("frontier.png")
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from jax_drain import models
from jax_drain.collectives import REDUCE_MODES
from jax_drain.order import remat_groups
from jax_drain.planner._report import Progress, mib, pyplot, total_buckets
from jax_drain.planner.compare import DEFAULT_STRATEGIES, PreparedModel, prepare_model
from jax_drain.planner.plan import (
    SCOPE_PREFIX, Plan, PlanError, Strategy, StrategyUnavailable, plan, preset_config,
    split_supported,
)
from jax_drain.planner.targets import parse_topology
from jax_drain.scan import ScanGradSync
from jax_drain.sync import GradSync
from jax_drain.train import TrainConfig

#: The reduce modes searched by default: fp32 accumulation at bf16 wire cost, whole-bucket
#: all-to-all and streamed. Modes with other numerics (``bf16``'s bf16 sums, the quantized
#: wires) are searched only when asked for (``modes=``): a faster step is no reason to change
#: what the gradients are.
SEARCH_MODES = ("fp32_accum", "fp32_accum_streamed")

#: The default strategies, compiled first at the default bucket count: the planner's
#: :data:`~jax_drain.planner.compare.DEFAULT_STRATEGIES` that are configurations (not plain
#: ``jax.jit`` nor the no-communication floor) and ZeRO-3. The choice is no slower than any of
#: them that fits.
DEFAULT_CANDIDATES = tuple(name for name in DEFAULT_STRATEGIES if not Strategy.parse(name).is_baseline) + (
    "zero3+drain",)

#: The deepest drain searched: at most this many buckets in flight.
MAX_DEPTH = 3

# Compute XLA prices for the same work varies a little with the bucket count (gpt-blocks:
# 53.2 ms at 12 buckets, 52.7 at 49); a bound from another count keeps this margin.
_COMPUTE_MARGIN = 0.02
_OVERLAP_LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"
# XLA prices each small op at ~0.01 us, so two layouts of one step differ by a few us of noise
# (plan_my_model: 15.6223 against 15.6248 ms); within this fraction they are one time.
_SAME_TIME = 1e-3


def _choose(rows: Sequence["SearchRow"]) -> "SearchRow | None":
    """The fitting row with the lowest predicted step; of those within :data:`_SAME_TIME` of it
    (and no slower than a fitting default), the one that needs the least memory."""
    fitting = [r for r in rows if r.fits and r.predicted_step_s is not None]
    if not fitting:
        return None
    bound = min(r.predicted_step_s for r in fitting) * (1 + _SAME_TIME)
    bound = min([bound] + [r.predicted_step_s for r in fitting if r.default])
    near = [r for r in fitting if r.predicted_step_s <= bound]
    return min(near, key=lambda r: (r.temp_plus_args_bytes, r.predicted_step_s))


class BudgetTooSmall(PlanError):
    """No configuration searched fits the memory budget. ``search``: what was compiled (``None``
    when the arguments alone ruled everything out before any compile); ``smallest_bytes``: the
    least temp + arguments seen, or the least the arguments alone need."""

    def __init__(self, message: str, search: "Search | None" = None, smallest_bytes: int | None = None):
        super().__init__(message)
        self.search = search
        self.smallest_bytes = smallest_bytes


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search space: everything a :class:`jax_drain.TrainConfig` says about
    the gradient sync, with the bucket size asked for as a count.

    ``max_in_flight``: buckets in flight (``None``: undrained); ``blocks``: no bucket across two
    remat blocks (``bucket_boundaries="remat"``); ``shard_params``: ZeRO-3.

    Example::

        >>> Candidate("fp32_accum", 2, shard_params=True, num_buckets=48).strategy
        'fp32_accum+drain2+zero3'
    """

    reduce: str = "fp32_accum"
    max_in_flight: int | None = 1
    split_leaves: bool = False
    blocks: bool = False
    shard_params: bool = False
    reshard_after_forward: bool = True
    num_buckets: int = 24

    def __post_init__(self) -> None:
        if self.reduce not in REDUCE_MODES:
            raise ValueError(f"unknown reduce mode {self.reduce!r}; use one of {', '.join(REDUCE_MODES)}")
        if self.max_in_flight is not None and (isinstance(self.max_in_flight, bool) or self.max_in_flight < 1):
            raise ValueError(f"max_in_flight must be None (undrained) or >= 1, got {self.max_in_flight!r}")
        if not self.reshard_after_forward and not self.shard_params:
            raise ValueError("reshard_after_forward=False needs shard_params=True (ZeRO-3)")

    @classmethod
    def of(cls, strategy: str | Strategy, num_buckets: int) -> "Candidate":
        """The candidate of a strategy name (not a baseline).

        Example::

            >>> Candidate.of("zero3+drain", 24).shard_params
            True
        """
        s = Strategy.parse(strategy) if isinstance(strategy, str) else strategy
        if s.is_baseline:
            raise ValueError(f"{s.name} is not a jax_drain configuration")
        if s.stages > 1:
            raise ValueError(f"{s.name}: the search does not try pipeline stages yet; compare +ppN strategies with "
                             "plan_model (the CLI's --strategy)")
        return cls(s.reduce, s.max_in_flight, s.split, s.blocks, s.zero3, s.reshard_after_forward, num_buckets)

    @property
    def strategy(self) -> str:
        """The planner's strategy name (:class:`Strategy`)."""
        k = self.max_in_flight
        depth = "" if k is None else "+drain" + (str(k) if k > 1 else "")
        return (self.reduce + depth + ("+split" if self.split_leaves else "") + ("+zero3" if self.shard_params else "")
                + ("+blocks" if self.blocks else "") + ("" if self.reshard_after_forward else "+noreshard"))

    @property
    def layout(self) -> tuple:
        """Everything but the bucket count: with the bucket size, what makes two candidates one."""
        return dataclasses.astuple(dataclasses.replace(self, num_buckets=0))

    @property
    def work(self) -> tuple:
        """What decides the step's work, drain depth and bucket count aside."""
        return (self.reduce, self.split_leaves, self.blocks, self.shard_params, self.reshard_after_forward)

    def replace(self, **changes: Any) -> "Candidate":
        return dataclasses.replace(self, **changes)

    def compiler_options(self) -> dict[str, Any]:
        """XLA options the step needs to be planned (and run) as configured: XLA's GPU scheduler
        keeps one collective in flight unless told more, so a deeper drain needs its limit."""
        return {_OVERLAP_LIMIT: self.max_in_flight} if self.max_in_flight and self.max_in_flight > 1 else {}

    def config_fields(self, bucket_size: int, *, scan_layers: bool = False) -> dict[str, Any]:
        """The :class:`jax_drain.TrainConfig` fields of this candidate at ``bucket_size``
        elements. ZeRO-3 gathers one bucket ahead (``gather_max_in_flight=1``), as planned."""
        fields = {"bucket_size": bucket_size, "reduce": self.reduce, "drain": self.max_in_flight is not None,
                  "max_in_flight": self.max_in_flight, "split_leaves": self.split_leaves,
                  "bucket_boundaries": "remat" if self.blocks else None, "shard_params": self.shard_params,
                  "reshard_after_forward": self.reshard_after_forward, "scan_layers": scan_layers}
        if self.shard_params:
            fields["gather_max_in_flight"] = 1
        return fields


@dataclasses.dataclass(frozen=True)
class SearchRow:
    """One compiled configuration: its :class:`Plan` (or why it did not compile) and its
    :class:`jax_drain.TrainConfig` fields."""

    candidate: Candidate
    bucket_size: int
    config: dict[str, Any]
    plan: Plan | None = None
    default: bool = False
    fits: bool = False
    error: str | None = None

    @property
    def strategy(self) -> str:
        return self.candidate.strategy

    @property
    def num_buckets(self) -> int | None:
        """The real bucket count (the count asked for is ``candidate.num_buckets``)."""
        return None if self.plan is None else self.plan.num_buckets

    @property
    def temp_plus_args_bytes(self) -> int | None:
        return None if self.plan is None else self.plan.temp_bytes + self.plan.argument_bytes

    @property
    def predicted_step_s(self) -> float | None:
        return None if self.plan is None else self.plan.predicted_step_s

    def label(self) -> str:
        """``"fp32_accum+drain with 13 buckets"``."""
        return f"{self.strategy} with {self.num_buckets if self.num_buckets is not None else '?'} buckets"

    def to_json(self) -> dict[str, Any]:
        """``strategy``, ``config`` (TrainConfig fields), ``compiler_options``, ``num_buckets``,
        ``bucket_size``, ``temp_bytes``, ``argument_bytes``, ``temp_plus_args_bytes``,
        ``predicted_step_s``, ``exposed_comm_s``, ``compute_s``, ``compile_s``, ``fits``,
        ``default``, ``error``."""
        p = self.plan
        time_ = p.step_time if p is not None else None
        return {"strategy": self.strategy, "config": dict(self.config),
                "compiler_options": self.candidate.compiler_options(), "num_buckets": self.num_buckets,
                "num_buckets_asked": self.candidate.num_buckets, "bucket_size": self.bucket_size,
                "temp_bytes": None if p is None else p.temp_bytes,
                "argument_bytes": None if p is None else p.argument_bytes,
                "temp_plus_args_bytes": self.temp_plus_args_bytes, "predicted_step_s": self.predicted_step_s,
                "exposed_comm_s": None if p is None else p.exposed_comm_s,
                "compute_s": None if time_ is None else time_.compute_s,
                "compile_s": None if p is None else round(p.compile_s, 3),
                "fits": self.fits, "default": self.default, "error": self.error}


@dataclasses.dataclass(frozen=True)
class Pruned:
    """A candidate the search did not compile, and why."""

    candidate: Candidate
    bucket_size: int
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.candidate.strategy, "num_buckets_asked": self.candidate.num_buckets,
                "bucket_size": self.bucket_size, "why": self.why}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.2f} ms"


@dataclasses.dataclass(frozen=True)
class Search:
    """What a search compiled and what it chose; bytes per device, times in seconds.

    ``print(search)`` shows :meth:`table`; :meth:`config` is the choice as a
    :class:`jax_drain.TrainConfig`.
    """

    rows: tuple[SearchRow, ...]  # in the order compiled
    memory_budget_bytes: int
    floor: Plan | None
    pruned: tuple[Pruned, ...]
    compiles: int
    compile_s: float
    search_s: float
    stopped: str
    target: str
    topology: str
    num_devices: int
    model: str = ""
    #: The tensor-parallel axes and sizes (``None``: data parallel only) and the parameters'
    #: specs over them, which every configuration shares.
    model_axes: Mapping[str, int] | None = None
    param_specs: Any = dataclasses.field(default=None, repr=False)

    @property
    def choice(self) -> SearchRow | None:
        """The fitting row with the lowest predicted step (of those within 0.1% of it and no
        slower than any fitting default, the smallest); ``None`` when none fits."""
        return _choose(self.rows)

    def defaults(self) -> list[SearchRow]:
        """The default strategies' rows (:data:`DEFAULT_CANDIDATES`) that compiled."""
        return [r for r in self.rows if r.default]

    def config(self, **overrides: Any) -> TrainConfig:
        """The choice as a :class:`jax_drain.TrainConfig`, with ``overrides`` (any other field:
        ``microbatches``, ``axis``, ...). On a tensor-parallel mesh it carries the searched
        ``param_specs`` with ``tensor_parallel="gspmd"``.

        Example::

            step = jd.make_train_step(model, loss_fn, tx, mesh, found.config(max_grad_norm=1.0))
        """
        choice = self.choice
        if choice is None:
            raise BudgetTooSmall(f"no configuration fits {mib(self.memory_budget_bytes)}: nothing to configure",
                                 self)
        shared = {} if self.param_specs is None else {"tensor_parallel": "gspmd", "param_specs": self.param_specs}
        return TrainConfig(**{**shared, **choice.config, **overrides})

    def frontier(self) -> list[SearchRow]:
        """The time-memory frontier: each compiled row that no other row beats on both predicted
        step and temp + arguments, from the least memory up."""
        priced = sorted((r for r in self.rows if r.predicted_step_s is not None),
                        key=lambda r: (r.temp_plus_args_bytes, r.predicted_step_s))
        out: list[SearchRow] = []
        for r in priced:
            if not out or r.predicted_step_s < out[-1].predicted_step_s:
                out.append(r)
        return out

    def to_json(self) -> dict[str, Any]:
        """``rows`` (:meth:`SearchRow.to_json` each, with ``frontier`` and ``chosen``), ``choice``
        (``config``, ``strategy``, ``num_buckets``, ``predicted_step_s``,
        ``temp_plus_args_bytes``, ...; ``None`` when nothing fits), ``memory_budget_bytes``,
        ``floor``, ``compiles``, ``compile_s``, ``search_s``, ``pruned`` (each with why),
        ``stopped``, ``target``, ``topology``, ``num_devices``, ``model``, ``model_axes``."""
        choice, front = self.choice, {id(r) for r in self.frontier()}
        rows = [{**r.to_json(), "frontier": id(r) in front, "chosen": r is choice} for r in self.rows]
        floor = None if self.floor is None else {
            "strategy": "no_comm", "num_buckets": self.floor.num_buckets,
            "temp_plus_args_bytes": self.floor.temp_bytes + self.floor.argument_bytes,
            "predicted_step_s": self.floor.predicted_step_s}
        return {"rows": rows, "choice": None if choice is None else choice.to_json(),
                "memory_budget_bytes": self.memory_budget_bytes, "floor": floor, "compiles": self.compiles,
                "compile_s": round(self.compile_s, 3), "search_s": round(self.search_s, 3),
                "pruned": [p.to_json() for p in self.pruned], "stopped": self.stopped, "target": self.target,
                "topology": self.topology, "num_devices": self.num_devices, "model": self.model,
                "model_axes": None if self.model_axes is None else dict(self.model_axes)}

    def table(self) -> str:
        """Every compiled configuration from the least temp + arguments up (``#``: the order
        compiled; ``frontier``: on the time-memory frontier), the floor, then the choice against
        the fastest default strategy that fits."""
        choice, front = self.choice, {id(r) for r in self.frontier()}
        where = f" on {self.num_devices}x {self.target} ({self.topology})"
        head = [f"search: the fastest step within {mib(self.memory_budget_bytes)} per device (temp + arguments)"
                + (f", {self.model}" if self.model else "") + where,
                f"  {self.compiles} compiles, {self.compile_s:.1f} s compiling ({self.search_s:.1f} s in all); "
                f"{len(self.pruned)} candidate{'' if len(self.pruned) == 1 else 's'} pruned without a compile; "
                f"stopped: {self.stopped}",
                "  step, exposed: XLA's predicted step time and the communication it leaves exposed (estimates)"]
        cells = [("#", "strategy", "buckets", "bucket size", "temp+args", "step", "exposed", "")]
        order = {id(r): k + 1 for k, r in enumerate(self.rows)}
        key = lambda r: (r.temp_plus_args_bytes is None, r.temp_plus_args_bytes or 0, r.predicted_step_s or 0)
        for r in sorted(self.rows, key=key):
            notes = ["chosen" if r is choice else "", "default" if r.default else "",
                     "frontier" if id(r) in front else "", "" if r.fits or r.plan is None else "over budget",
                     f"failed: {r.error}" if r.error else ""]
            p = r.plan
            cells.append((str(order[id(r)]), r.strategy, "-" if r.num_buckets is None else str(r.num_buckets),
                          f"{r.bucket_size:,}", "-" if p is None else mib(r.temp_plus_args_bytes),
                          _ms(r.predicted_step_s), _ms(None if p is None else p.exposed_comm_s),
                          ", ".join(n for n in notes if n)))
        widths = [max(len(c[i]) for c in cells) for i in range(7)]
        lines = ["  " + "  ".join([c[0].rjust(widths[0]), c[1].ljust(widths[1])]
                                  + [v.rjust(w) for v, w in zip(c[2:7], widths[2:7])] + [c[7]]).rstrip()
                 for c in cells]
        if self.floor is not None:
            lines.append(f"  floor: no_comm (the same step without gradient communication, not a configuration) "
                         f"{mib(self.floor.temp_bytes + self.floor.argument_bytes)}, "
                         f"{_ms(self.floor.predicted_step_s)}")
        return "\n".join(head + lines + ["", self.verdict()])

    def verdict(self) -> str:
        """The choice in words, against the fastest fitting default, with its TrainConfig."""
        choice = self.choice
        if choice is None:
            return f"no configuration fits {mib(self.memory_budget_bytes)}."
        fitting = [r for r in self.defaults() if r.fits and r.predicted_step_s is not None]
        best = min(fitting, key=lambda r: r.predicted_step_s, default=None)
        against = (f"the fastest default strategy that fits, {best.label()}, {_ms(best.predicted_step_s)}"
                   if best is not None else "no default strategy fits")
        fields = ", ".join(f"{k}={v!r}" for k, v in choice.config.items())
        if self.param_specs is not None:  # too long to print: the specs the search was given
            fields = f"tensor_parallel='gspmd', param_specs=<the specs searched>, {fields}"
        options = choice.candidate.compiler_options()
        lines = [f"choice: {choice.label()}: {_ms(choice.predicted_step_s)} a step, "
                 f"{mib(choice.temp_plus_args_bytes)} of temp + arguments; {against}.",
                 f"  jd.TrainConfig({fields})"]
        if options:
            flags = " ".join(f"--{k}={v}" for k, v in options.items())
            lines.append(f"  XLA keeps one collective in flight unless told more: run it with XLA_FLAGS=\"{flags}\"")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    __repr__ = __str__

    def plot(self, path: str | pathlib.Path) -> pathlib.Path:
        """Writes a PNG: predicted step against temp + arguments for every compiled
        configuration, the frontier, the budget, the floor and the choice marked. Returns the
        absolute path written."""
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(8, 4.5))
        priced = [r for r in self.rows if r.predicted_step_s is not None]
        for fits, style, label in ((True, dict(marker="o", color="tab:blue"), "fits"),
                                   (False, dict(marker="x", color="tab:gray"), "over budget")):
            pts = [r for r in priced if r.fits is fits]
            if pts:
                ax.scatter([r.temp_plus_args_bytes / 2**20 for r in pts], [r.predicted_step_s * 1e3 for r in pts],
                           s=24, label=label, **style)
        defaults = [r for r in priced if r.default]
        if defaults:
            ax.scatter([r.temp_plus_args_bytes / 2**20 for r in defaults], [r.predicted_step_s * 1e3 for r in defaults],
                       s=90, facecolors="none", edgecolors="tab:orange", label="default strategies")
        front = self.frontier()
        if front:
            ax.step([r.temp_plus_args_bytes / 2**20 for r in front], [r.predicted_step_s * 1e3 for r in front],
                    where="post", color="tab:blue", lw=1, alpha=0.6, label="frontier")
        ax.axvline(self.memory_budget_bytes / 2**20, color="tab:red", ls="--", lw=1, label="budget")
        if self.floor is not None and self.floor.predicted_step_s is not None:
            ax.axhline(self.floor.predicted_step_s * 1e3, color="tab:green", ls=":", lw=1, label="no_comm floor")
        choice = self.choice
        if choice is not None:
            x, y = choice.temp_plus_args_bytes / 2**20, choice.predicted_step_s * 1e3
            ax.scatter([x], [y], marker="*", s=220, color="tab:red", zorder=5, label="choice")
            ax.annotate(choice.label(), (x, y), textcoords="offset points", xytext=(8, 8), fontsize="small")
        ax.set_xlabel("temp + arguments, MiB per device")
        ax.set_ylabel("predicted step, ms (XLA's estimate)")
        name = self.model.split(":")[0]
        ax.set_title(f"{name + ' on ' if name else ''}{self.num_devices}x {self.target}: the fastest step within "
                     f"{mib(self.memory_budget_bytes)}", fontsize="small")
        ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return pathlib.Path(path).absolute()


def _nbytes(tree: Any, divide: int = 1) -> int:
    return sum(-(-math.prod(x.shape) // divide) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class _Built:
    """A candidate's step, built (its bucket layout known) but not compiled."""

    strategy: Strategy
    bucket_size: int
    step: Callable[..., Any]
    args: tuple[Any, ...]
    sync: Any


def _buckets_key(sync: Any) -> tuple:
    """Every bucket of ``sync``'s chains: dtype, padded size and the leaf pieces it holds."""
    return tuple((b.dtype, b.padded_size, b.pieces) for chain in sync.chains for b in chain.layout.buckets)


class _Run:
    """One search's state: what was compiled, what was pruned, and the next candidate."""

    def __init__(self, model: PreparedModel, budget: int, *, modes: Sequence[str], num_buckets: int,
                 max_compiles: int, compiler_options: dict[str, Any], progress: bool):
        self.model, self.budget, self.modes, self.max_compiles = model, budget, tuple(modes), max_compiles
        self.num_buckets, self.options = num_buckets, compiler_options
        self.scanned = model.stacked is not None
        n = model.data_size
        batch = _nbytes(model.batch, n)
        # What the arguments need before any compile: the parameters (this device's blocks along
        # the model axes), or (ZeRO-3) their 1/n shards, and this device's part of the batch.
        # XLA's argument bytes are these (checked on the presets); padding only adds to them.
        params = model.local_params
        self.args_bound = {False: _nbytes(params) + batch, True: _nbytes(params, n) + batch}
        self.groups = None
        if not self.scanned:
            local = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]), x.dtype), model.batch)
            try:
                groups = remat_groups(model.loss_fn, model.params, local)
            except Exception:  # a loss the remat reader cannot trace: bucket sizes alone
                groups = None
            # Buckets that follow the blocks differ from plain ones only with two blocks or more.
            self.groups = groups if groups is not None and len(set(groups)) > 1 else None
        self.can_split = split_supported(ScanGradSync if self.scanned else GradSync)
        self.rows: list[SearchRow] = []
        self.pruned: list[Pruned] = []
        self.seen: set[tuple] = set()  # (layout, bucket size) of every candidate admitted or not
        self.layouts: dict[tuple, Candidate] = {}  # what a step does, buckets included -> its candidate
        self.sizes: dict[tuple, int] = {}
        self.floor: Plan | None = None
        self.compile_s = 0.0
        self.compiles = 0
        self.shown = Progress(progress, max_compiles, model.description, header=(
            f"searching {model.description} on {model.num_devices}x {model.target} ({model.topology}) for the fastest step "
            f"within {mib(budget)} (temp + arguments), at most {max_compiles} compiles"))

    # -- one candidate -----------------------------------------------------------------------

    def bucket_size(self, c: Candidate) -> int:
        key = (c.split_leaves, c.blocks, c.num_buckets)
        if key not in self.sizes:
            self.sizes[key] = self.model.bucket_size(c.num_buckets, split_leaves=c.split_leaves,
                                                     groups=self.groups if c.blocks else None)
        return self.sizes[key]

    def build(self, strategy: Strategy, bucket_size: int) -> _Built:
        """The step of ``strategy`` at ``bucket_size``, built but not compiled."""
        step, args, sync = self.model.build_step(strategy, bucket_size, groups=self.groups if strategy.blocks else None)
        return _Built(strategy, bucket_size, step, args, sync)

    def compile(self, built: _Built, options: dict[str, Any]) -> Plan:
        m, options = self.model, {**options, **self.options}
        self.shown.compiling(self.compiles, f"{built.strategy.name} with {total_buckets(built.sync)} buckets")
        self.compiles += 1
        try:
            report = plan(built.step, *built.args, target=m.target, topology=m.topology,
                          compiler_options=options or None, scope=SCOPE_PREFIX, strategy=built.strategy.name,
                          num_buckets=total_buckets(built.sync), bucket_size=built.bucket_size,
                          notes=(f"XLA options {options}",) if options else ())
        except PlanError as e:
            self.shown.failed(f"failed: {' '.join(str(e).split())[:120]}")
            raise
        except BaseException:
            self.shown.failed()
            raise
        self.compile_s += report.compile_s
        return report

    def compile_floor(self) -> None:
        """``no_comm`` at the default bucket count: the time no configuration beats."""
        size = self.bucket_size(Candidate(num_buckets=self.num_buckets))
        self.floor = self.compile(self.build(Strategy.parse("no_comm"), size), {})
        self.shown.compiled(self.floor.temp_bytes, f"{mib(self.floor.temp_bytes + self.floor.argument_bytes)} "
                            f"temp + arguments, {_ms(self.floor.predicted_step_s)} (the floor)")

    def was_seen(self, c: Candidate) -> bool:
        return (c.layout, self.bucket_size(c)) in self.seen

    def admit(self, c: Candidate, *, default: bool = False) -> _Built | None:
        """``c``'s step, built, when it is new and nothing known rules it out (then it is to be
        compiled); ``None`` when its buckets were seen or it is pruned now (recorded with why),
        or it could not be built (recorded as a row with the error)."""
        if self.was_seen(c):
            return None
        size = self.bucket_size(c)
        self.seen.add((c.layout, size))
        why = self.why_pruned(c, size, exact_only=default)
        if why is None:
            try:
                built = self.build(Strategy.parse(c.strategy), size)
            except (StrategyUnavailable, ValueError) as e:
                error = " ".join(str(e).split())
                self.rows.append(SearchRow(c, size, c.config_fields(size, scan_layers=self.scanned), default=default,
                                           error=error))
                return None
            # Two bucket counts (or block boundaries, split leaves) can give the very same buckets.
            key = (c.reduce, c.max_in_flight, c.shard_params, c.reshard_after_forward, _buckets_key(built.sync))
            twin = self.layouts.setdefault(key, c)
            if twin is c:
                return built
            why = f"the same buckets as {twin.strategy} with {twin.num_buckets} buckets asked"
        self.pruned.append(Pruned(c, size, why))
        return None

    def evaluate(self, c: Candidate, built: _Built, *, default: bool = False) -> SearchRow:
        """Compiles ``c``'s step (from :meth:`admit`); its row, with the error where XLA could not
        compile it."""
        fields = c.config_fields(built.bucket_size, scan_layers=self.scanned)
        try:
            report = self.compile(built, c.compiler_options())
        except PlanError as e:
            row = SearchRow(c, built.bucket_size, fields, default=default, error=" ".join(str(e).split()))
        else:
            total = report.temp_bytes + report.argument_bytes
            row = SearchRow(c, built.bucket_size, fields, report, default, fits=total <= self.budget)
            self.shown.compiled(report.temp_bytes, f"{mib(total)} temp + arguments "
                                f"({'fits' if row.fits else 'over budget'}), {_ms(report.predicted_step_s)}")
        self.rows.append(row)
        return row

    def why_pruned(self, c: Candidate, size: int, *, exact_only: bool = False) -> str | None:
        """Why ``c`` cannot fit or cannot be faster than the choice so far, from what is known;
        ``None`` when only a compile can tell. ``exact_only`` (the defaults, which the choice
        must match): the arguments' bound alone, no rule of thumb."""
        if c.shard_params and c.split_leaves and self.model.param_specs is not None:
            return ("ZeRO-3 on a tensor-parallel mesh gathers whole leaves (tensor_parallel='gspmd' with "
                    "shard_params=True takes split_leaves=False)")
        args = self.args_bound[c.shard_params]
        if args > self.budget:
            what = "the parameter shards" if c.shard_params else "the whole parameters"
            return f"its arguments alone ({what} and this device's batch) need {mib(args)}"
        if exact_only:
            return None
        for r in self.rows:
            if r.plan is not None and not r.fits and _keeps_at_least(c, size, r):
                return f"it keeps at least as much alive as {r.label()}, which needs {mib(r.temp_plus_args_bytes)}"
        best = self.best()
        if best is not None:
            for r in self.rows:
                t = r.plan.step_time if r.plan is not None else None
                if (t is not None and t.compute_s is not None and r.candidate.work == c.work
                        and t.compute_s * (1 - _COMPUTE_MARGIN) >= best.predicted_step_s):
                    return (f"it does the work of {r.label()}, whose compute alone XLA prices at "
                            f"{_ms(t.compute_s)}, no faster than the choice so far ({_ms(best.predicted_step_s)})")
        return None

    # -- the walk ----------------------------------------------------------------------------

    def best(self) -> SearchRow | None:
        return _choose(self.rows)

    def neighbours(self, c: Candidate, *, toward_less_memory: bool) -> list[Candidate]:
        """The candidates one step from ``c``: those likely to be faster first; while nothing
        fits, only the moves that can lower memory (more buckets, ZeRO-3, fewer in flight,
        resharding, the other modes and layouts)."""
        more, fewer = c.replace(num_buckets=2 * c.num_buckets), c.replace(num_buckets=max(1, c.num_buckets // 2))
        depth = c.max_in_flight
        deeper = [c.replace(max_in_flight=depth + 1)] if depth is not None and depth < MAX_DEPTH else []
        shallower = ([c.replace(max_in_flight=1)] if depth is None else
                     [c.replace(max_in_flight=depth - 1)] if depth > 1 else [c.replace(max_in_flight=None)])
        modes = [c.replace(reduce=m) for m in self.modes if m != c.reduce]
        zero3 = [c.replace(shard_params=not c.shard_params, reshard_after_forward=True)]
        reshard = [c.replace(reshard_after_forward=not c.reshard_after_forward)] if c.shard_params else []
        split = [c.replace(split_leaves=not c.split_leaves)] if self.can_split else []
        blocks = [c.replace(blocks=not c.blocks)] if self.groups is not None else []
        if toward_less_memory:
            zero3 = zero3 if not c.shard_params else []
            reshard = reshard if not c.reshard_after_forward else []
            shallower = [n for n in shallower if n.max_in_flight is not None]  # undrained keeps every bucket
            order = [more, *zero3, *modes, *shallower, *reshard, *blocks, *split]
        else:
            order = [fewer, more, *deeper, *shallower, *modes, *reshard, *zero3, *blocks, *split]
        return [n for n in order if n != c]

    def step(self) -> str | None:
        """Compiles the next candidate; why the search ends, or ``None`` to go on."""
        best = self.best()
        floor_s = None if self.floor is None else self.floor.predicted_step_s
        if best is not None and floor_s is not None and best.predicted_step_s <= floor_s:
            return "the choice is as fast as the step without gradient communication (no_comm)"
        if best is not None:
            # From the first row compiled at the best time: a tie that needs less memory becomes
            # the choice, but walking on from it costs compiles for no faster step.
            fastest = min(r.predicted_step_s for r in self.rows if r.fits and r.predicted_step_s is not None)
            start = next(r for r in self.rows if r.fits and r.predicted_step_s is not None
                         and r.predicted_step_s <= fastest * (1 + _SAME_TIME))
        else:  # nothing fits yet: walk down from the smallest configuration compiled
            start = min((r for r in self.rows if r.plan is not None), key=lambda r: r.temp_plus_args_bytes,
                        default=None)
        if start is None:
            return "nothing compiled to start from"
        for n in self.neighbours(start.candidate, toward_less_memory=best is None):
            if self.was_seen(n):
                continue
            if self.compiles >= self.max_compiles:
                return f"max_compiles ({self.max_compiles}) reached"
            built = self.admit(n)
            if built is not None:
                self.evaluate(n, built)
                return None
        if best is None:
            return "no move from the smallest configuration compiled lowers its memory further"
        return "no neighbour of the choice is left to try (a local optimum)"


def _depth_rank(depth: int | None) -> float:
    return math.inf if depth is None else depth


def _keeps_at_least(c: Candidate, size: int, r: SearchRow) -> bool:
    """Whether ``c`` keeps at least as much alive as compiled row ``r``: the same layout rules
    and reduce mode, at least as many buckets in flight, no resharding where ``r`` reshards,
    and, drained, buckets at least as large (each of the buckets in flight is larger)."""
    o = r.candidate
    if (c.reduce, c.split_leaves, c.blocks, c.shard_params) != (o.reduce, o.split_leaves, o.blocks, o.shard_params):
        return False
    if _depth_rank(c.max_in_flight) < _depth_rank(o.max_in_flight):
        return False
    if c.reshard_after_forward and not o.reshard_after_forward:
        return False
    if c.max_in_flight is None or o.max_in_flight is None:
        return size == r.bucket_size
    return size >= r.bucket_size


def _check_budget(memory_budget: Any) -> int:
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or not memory_budget > 0:
        raise ValueError(f"memory_budget must be a positive number of bytes per device (e.g. 1200 * 2**20), "
                         f"got {memory_budget!r}")
    return int(memory_budget)


def search_model(
    loss_fn: Callable[[Any, Any], Any],
    params: Any,
    batch: Any,
    memory_budget: int,
    *,
    modes: Sequence[str] = SEARCH_MODES,
    num_buckets: int = 24,
    max_compiles: int = 24,
    target: str = "h100",
    topology: str = "1x1x8",
    compiler_options: dict[str, Any] | None = None,
    scan: bool | None = None,
    name: str = "",
    progress: bool = True,
    model_axes: Mapping[str, int] | None = None,
    param_specs: Any = None,
) -> Search:
    """The configuration of ``loss_fn``'s gradient step with the lowest predicted step time
    whose temp + argument bytes per device fit ``memory_budget`` (module doc: how it searches).

    Args:
        loss_fn, params, batch: as for :func:`jax_drain.planner.compare.plan_model`.
        memory_budget: bytes per device for XLA's temp and argument buffers of the gradient
            step (the optimizer's state is not in it), e.g. ``1200 * 2**20``.
        modes: the reduce modes searched (:data:`SEARCH_MODES`).
        num_buckets: the bucket count the defaults compile at and the walk starts from.
        max_compiles: at most this many compiles, the floor's included.
        compiler_options: XLA options for every compile.
        progress: one line per compile on stderr.
        model_axes, param_specs: a tensor-parallel mesh, ``{"model": 2}``, and how each
            parameter splits over it (:func:`jax_drain.planner.compare.prepare_model`); every
            configuration then has ``tensor_parallel="gspmd"`` and these ``param_specs``.

    Returns:
        A :class:`Search`; ``search.config()`` is the choice as a ``jd.TrainConfig``.

    Raises:
        BudgetTooSmall: nothing searched fits; the message names the least memory seen.

    Example::

        found = search_model(loss, params, batch, 600 * 2**20)
        print(found)
        step = jd.make_train_step(params, loss, tx, mesh, found.config())
    """
    budget = _check_budget(memory_budget)
    modes = tuple(dict.fromkeys(modes))
    unknown = [m for m in modes if m not in REDUCE_MODES]
    if not modes or unknown:
        raise ValueError(f"modes must name reduce modes from {', '.join(REDUCE_MODES)}; got {list(modes)}")
    for value, what in ((num_buckets, "num_buckets"), (max_compiles, "max_compiles")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
    start = time.perf_counter()
    model = prepare_model(loss_fn, params, batch, target=target, topology=topology, scan=scan, name=name,
                          model_axes=model_axes, param_specs=param_specs)
    run = _Run(model, budget, modes=modes, num_buckets=num_buckets, max_compiles=max_compiles,
               compiler_options=dict(compiler_options or {}), progress=progress)
    least = min(run.args_bound.values())
    if least > budget:
        raise BudgetTooSmall(
            f"no configuration fits {mib(budget)} per device: the arguments alone need at least {mib(least)} "
            f"(ZeRO-3's parameter shards and this device's batch); give a budget of at least "
            f"{math.ceil(least / 2**20) + 1} MiB, a smaller batch or more devices", None, least)

    if run.args_bound[False] <= budget:
        # Otherwise only ZeRO-3 can fit, whose forward gathers are work the floor does not do:
        # the floor would cost a compile and never end the search.
        run.compile_floor()
    stopped = None
    for default in DEFAULT_CANDIDATES:
        if run.compiles >= max_compiles:
            stopped = f"max_compiles ({max_compiles}) reached"
            break
        candidate = Candidate.of(default, num_buckets)
        built = run.admit(candidate, default=True)
        if built is not None:
            run.evaluate(candidate, built, default=True)
    if stopped is None:
        if any(r.plan is not None for r in run.rows) and all(
                r.predicted_step_s is None for r in run.rows if r.plan is not None):
            why = next((u for r in run.rows if r.plan is not None and r.plan.step_time is not None
                        for u in r.plan.step_time.unpriced), "XLA gave no time")
            raise PlanError(f"the search ranks configurations by XLA's predicted step, and XLA prices no step of "
                            f"this model: {why}")
        while (stopped := run.step()) is None:
            pass
    found = Search(tuple(run.rows), budget, run.floor, tuple(run.pruned), run.compiles, run.compile_s,
                   time.perf_counter() - start, stopped, target, topology, model.num_devices, model.description,
                   dict(model_axes) if model_axes else None, model.param_specs)
    if found.choice is None:
        smallest = min((r for r in found.rows if r.plan is not None), key=lambda r: r.temp_plus_args_bytes,
                       default=None)
        seen = (f"the smallest found, {smallest.label()}, needs {mib(smallest.temp_plus_args_bytes)} of temp + "
                "arguments" if smallest is not None else "nothing compiled")
        if stopped.startswith("max_compiles"):
            advice = f"allow more compiles (--max-compiles; {max_compiles} now) or give a larger budget"
        else:
            advice = (f"give a budget of at least {math.ceil(smallest.temp_plus_args_bytes / 2**20)} MiB, a smaller "
                      "batch or more devices" if smallest is not None else "see the pruned candidates")
        raise BudgetTooSmall(f"no configuration fits {mib(budget)} per device: {seen}; {advice} "
                             f"({found.compiles} compiles; stopped: {stopped})", found,
                             None if smallest is None else smallest.temp_plus_args_bytes)
    return found


def search_preset(
    preset: str | models.GPTConfig = "gpt-blocks",
    memory_budget: int = 1200 * 2**20,
    *,
    micro_batch: int = 1,
    **options: Any,
) -> Search:
    """:func:`search_model` on a built-in GPT preset (:mod:`jax_drain.models`; a name, or a
    :class:`~jax_drain.models.GPTConfig` such as :func:`preset_config`'s) with ``micro_batch``
    sequences per data-parallel device; ``options`` as for :func:`search_model`. With
    ``model_axes={"model": k}`` and no ``param_specs``, the blocks split Megatron's way
    (:func:`jax_drain.models.tensor_parallel_specs`).

    Example::

        found = search_preset("gpt-blocks", 600 * 2**20)
        found.choice.strategy, found.choice.num_buckets
    """
    config = preset_config(preset) if isinstance(preset, str) else preset
    slices, hosts, gpus = parse_topology(options.get("topology", "1x1x8"))
    params = models.abstract_params(config)
    model_axes = options.get("model_axes") or {}
    data = slices * hosts * gpus // max(1, math.prod(model_axes.values()))
    if model_axes and options.get("param_specs") is None:
        if len(model_axes) != 1:
            raise ValueError(f"a preset splits over one model axis (Megatron's split); got model_axes {model_axes}")
        options["param_specs"] = models.tensor_parallel_specs(params, next(iter(model_axes)))
    batch = models.example_batch(config, micro_batch * data)
    options.setdefault("name", f"preset {preset if isinstance(preset, str) else 'custom'}")
    return search_model(models.make_loss(config), params, batch, memory_budget, **options)
