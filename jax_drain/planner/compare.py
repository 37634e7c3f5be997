"""Plan your own model: compile its gradient step once per strategy and say what sets the peak.

:func:`plan_model` takes any ``loss_fn(params, batch)`` (the per-device mean loss) with
global-shape params and batch (arrays or ``jax.ShapeDtypeStruct``), builds each strategy's step
with :func:`jax_drain.planner.plan.build_user_step` (the presets' machinery: ``gspmd`` = plain
``jax.jit``, ``no_comm`` = the same buckets without the wire, jax_drain's reduce modes drained
or not), compiles them for compile-only GPU devices and returns a :class:`Comparison`: one row
per strategy (XLA's temp and argument bytes, approximate peak live bytes, buckets, every
collective of the program by kind and dtype, overlap) and a plain-language verdict: whether the
activations or the gradient sync set the peak, and which strategy and bucket size to use.

Example::

    from jax_drain import plan

    report = plan.plan_model(loss_fn, abstract_params, abstract_batch, num_buckets=12)
    print(report)                 # the table, then the verdict (report.table(), report.verdict())
    report.plot("plan.png")       # live bytes per strategy

While it compiles, :func:`plan_model` writes one line per strategy to stderr (``progress=False``
for none).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_drain.mesh import leaf_specs, local_shape, spec_axes
from jax_drain.order import grad_ready_order
from jax_drain.planner._report import Progress, mib, pyplot, total_buckets
from jax_drain.planner.plan import (
    SCOPE_PREFIX, Plan, PlanError, Strategy, StrategyUnavailable, build_user_step,
    bucket_size_for, plan, strategy_options,
)
from jax_drain.planner.targets import gpu_mesh, parse_topology
from jax_drain.scan import stacked_leaves

#: What :func:`plan_model` and ``python -m jax_drain.plan --loss`` compare by default: plain
#: ``jax.jit``, the no-communication floor, and fp32-accumulated reduce-scatter undrained,
#: drained and streamed.
DEFAULT_STRATEGIES = ("gspmd", "no_comm", "fp32_accum", "fp32_accum+drain", "fp32_accum_streamed+drain")

#: The data-parallel axis of the planner's meshes.
DATA_AXIS = "data"

_MIB = 2**20
# Two temps within this of each other are "close": 10% of the larger, at least 64 KiB.
_CLOSE_FRACTION, _CLOSE_BYTES = 0.10, 64 * 1024


def _buckets(p: Plan) -> str:
    """``" with 12 buckets (--bucket-size 196608)"``, as far as known."""
    size = f" (--bucket-size {p.bucket_size})" if p.bucket_size is not None else ""
    return f" with {p.num_buckets} buckets{size}" if p.num_buckets is not None else size


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.2f} ms"


def _strategy(name: str) -> Strategy | None:
    try:
        return Strategy.parse(name)
    except ValueError:  # a user step's own label
        return None


@dataclasses.dataclass(frozen=True)
class Row:
    """One strategy of a :class:`Comparison`: its :class:`Plan`, or why it could not be built."""

    strategy: str
    plan: Plan | None = None
    unavailable: str | None = None

    def to_json(self) -> dict[str, Any]:
        """``strategy``, ``available``, ``num_buckets``, ``bucket_size``, ``temp_bytes``,
        ``argument_bytes``, ``output_bytes``, ``peak_live_bytes``, ``collectives`` (every
        collective of the program: ``{kind, dtype, count, bytes}``), ``sync_collectives`` (the
        gradient sync's, one entry each, as in :meth:`Plan.to_json`), ``pairs``, ``overlapped``,
        ``buckets_in_flight``, ``compile_s``, ``notes``; ``unavailable`` instead of the numbers
        for a strategy this version cannot build."""
        if self.plan is None:
            return {"strategy": self.strategy, "available": False, "unavailable": self.unavailable,
                    "num_buckets": None, "temp_bytes": None, "argument_bytes": None, "collectives": [],
                    "predicted_step_s": None, "exposed_comm_s": None}
        full = self.plan.to_json()
        keys = ("num_buckets", "bucket_size", "temp_bytes", "argument_bytes", "output_bytes", "peak_live_bytes",
                "pairs", "overlapped", "buckets_in_flight", "chains_in_flight", "collectives_in_flight",
                "compile_s", "target", "topology", "num_devices", "notes", "predicted_step_s", "exposed_comm_s")
        timing = {k: full[k] for k in ("exposed_comm_by_kind", "hidden_compute_s", "compute_s", "unpriced") if k in full}
        return {"strategy": self.strategy, "available": True, **{k: full[k] for k in keys}, **timing,
                "collectives": self.plan.collective_counts(), "sync_collectives": full["collectives"]}

    def __repr__(self) -> str:
        if self.plan is None:
            return f"Row({self.strategy!r}, unavailable={self.unavailable!r})"
        return f"Row({self.strategy!r}, temp {mib(self.plan.temp_bytes)}, arguments {mib(self.plan.argument_bytes)})"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Strategies compiled side by side for one model; bytes per device.

    ``print(comparison)`` (and its ``repr``) shows :meth:`report`: the table, then the verdict.
    """

    rows: tuple[Row, ...]
    target: str
    topology: str
    num_devices: int
    model: str = ""  # one line about the model, for the table's head
    largest_leaf: tuple[str, int] | None = None  # (path, elements) of the largest parameter

    def row(self, strategy: str) -> Row | None:
        return next((r for r in self.rows if r.strategy == strategy), None)

    def _plans(self) -> dict[str, Plan]:
        return {r.strategy: r.plan for r in self.rows if r.plan is not None}

    def to_json(self) -> list[dict[str, Any]]:
        """One :meth:`Row.to_json` per strategy, in order."""
        return [r.to_json() for r in self.rows]

    def table(self) -> str:
        """One line per strategy: temp, arguments, peak live bytes, buckets, every collective of
        the compiled program by kind and dtype, and overlapped/async gradient-sync collectives."""
        head = [f"{self.model + ' ' if self.model else ''}on {self.num_devices}x {self.target} ({self.topology})",
                "  bytes per device: temp and arguments from XLA's buffer assignment, peak live approximate",
                "  overlap: sync collectives overlapping compute / async ones; collectives: all in the program",
                "  step, exposed: XLA's predicted step time and the communication it leaves exposed (estimates)"]
        rows = [("strategy", "temp", "arguments", "peak live", "buckets", "overlap", "step", "exposed", "collectives")]
        for r in self.rows:
            p = r.plan
            if p is None:
                rows.append((r.strategy, r.unavailable or "not available"))
                continue
            rows.append((r.strategy, mib(p.temp_bytes), mib(p.argument_bytes), mib(max(p.live_bytes, default=0)),
                         "-" if p.num_buckets is None else str(p.num_buckets),
                         f"{p.overlapped}/{p.pairs}" if p.pairs else "-", _ms(p.predicted_step_s),
                         _ms(p.exposed_comm_s), p.collectives_summary()))
        widths = [max(len(row[i]) for row in rows if len(row) > 2) for i in range(8)]
        widths[0] = max(len(row[0]) for row in rows)
        lines = []
        for row in rows:
            if len(row) == 2:  # not available: the reason in place of the numbers
                lines.append(f"  {row[0].ljust(widths[0])}  {row[1]}")
                continue
            cells = [row[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(row[1:8], widths[1:8])] + [row[8]]
            lines.append("  " + "  ".join(cells))
        return "\n".join(head + lines)

    def recommended(self) -> str | None:
        """The jax_drain strategy to use: the drained one (any, without drained rows) with the
        least temp; among those within 2% of it, the one whose collectives overlap most."""
        syncs = {n: p for n, p in self._plans().items() if (s := _strategy(n)) is not None and not s.is_baseline}
        drained = {n: p for n, p in syncs.items() if _strategy(n).max_in_flight is not None} or syncs
        if not drained:
            return None
        least = min(p.temp_bytes for p in drained.values())
        near = [n for n, p in drained.items() if p.temp_bytes <= least + max(0.02 * least, _CLOSE_BYTES)]
        return max(near, key=lambda n: (drained[n].overlapped / drained[n].pairs if drained[n].pairs else 0,
                                         -drained[n].temp_bytes))

    def verdict(self) -> str:
        """Where the peak is and what to use, in words, with the numbers (temp bytes).

        Activations set the peak when ``no_comm`` (the same step without gradient communication)
        needs about as much temp as ``gspmd`` and the recommended jax_drain strategy (within 10%);
        the gradient sync sets it when ``gspmd`` or an undrained strategy needs well more.
        """
        plans = self._plans()
        if not plans:
            return "verdict: no strategy compiled."
        floor, gspmd = plans.get("no_comm"), plans.get("gspmd")
        best_name = self.recommended()
        best = plans.get(best_name) if best_name else None
        if floor is None:
            lowest = min(plans, key=lambda n: plans[n].temp_bytes)
            return (f"verdict: without a no_comm row the activations cannot be told from the gradient sync "
                    f"(add --strategy no_comm); the least temp is {lowest}'s, {mib(plans[lowest].temp_bytes)}"
                    + (f"; use {best_name}{_buckets(best)}." if best is not None else "."))
        f = floor.temp_bytes
        above = lambda p: p.temp_bytes - f
        heavy = lambda p: above(p) > max(_CLOSE_FRACTION * max(p.temp_bytes, f), _CLOSE_BYTES)
        label = lambda n: {"gspmd": "gspmd (plain jax.jit)"}.get(n, f"{n} (undrained)" if n in undrained else n)
        undrained = {n: p for n, p in plans.items()
                     if (s := _strategy(n)) is not None and s.reduce and s.max_in_flight is None}
        heavy_others = {n: p for n, p in [("gspmd", gspmd), *undrained.items()] if p is not None and heavy(p)}
        use = f"{best_name}{_buckets(best)}: {mib(best.temp_bytes)} temp" if best is not None else ""
        lines = []
        if heavy_others:
            needs = [f"{label(n)} {mib(p.temp_bytes)}" for n, p in heavy_others.items()]
            most = max(above(p) for p in heavy_others.values())
            lines.append(
                f"verdict: the gradient sync sets the peak. {' and '.join(needs)} of temp: up to {mib(most)} "
                f"({100 * most / max(f, 1):.0f}%) above the {mib(f)} of the same step without gradient "
                "communication (no_comm).")
            if best is not None:
                baseline = gspmd if gspmd is not None else max(heavy_others.values(), key=lambda p: p.temp_bytes)
                base_name = "gspmd" if gspmd is not None else max(heavy_others, key=lambda n: heavy_others[n].temp_bytes)
                saved = baseline.temp_bytes - best.temp_bytes
                lines.append(f"Use {use}, {mib(abs(saved))} {'less' if saved >= 0 else 'more'} than {base_name} "
                             f"and {mib(abs(above(best)))} {'above' if above(best) > 0 else 'below'} no_comm.")
        elif best is None or not heavy(best):
            shown = [(n, p) for n, p in (("gspmd", gspmd), (best_name, best)) if p is not None]
            spread = max([abs(above(p)) for _, p in shown], default=0)
            lines.append(
                f"verdict: activations set the peak. The step without gradient communication (no_comm) needs "
                f"{mib(f)} of temp" + "".join(f", {n} {mib(p.temp_bytes)}" for n, p in shown)
                + f": within {mib(spread)} ({100 * spread / max(f, 1):.0f}%), so the gradient sync adds little and "
                "the bucket count will not move the peak; a smaller micro-batch, a shorter sequence or more "
                "rematerialisation will.")
            if best is not None:
                lines.append(f"For fp32-accumulated gradients use {use}.")
        else:
            lines.append(
                f"verdict: activations set gspmd's peak ({mib(gspmd.temp_bytes)} against {mib(f)} without "
                f"gradient communication), but {best_name}'s bucket scratch sets its own: "
                f"{mib(best.temp_bytes)}, {mib(above(best))} above no_comm." if gspmd is not None else
                f"verdict: {best_name}'s bucket scratch sets its peak: {mib(best.temp_bytes)}, "
                f"{mib(above(best))} above the {mib(f)} without gradient communication (no_comm).")
            lines.append("Use plain jax.jit (gspmd) unless you need fp32 accumulation; for it, use "
                         f"{use}." if gspmd is not None else f"Use {use}.")
        if best is not None and heavy(best):
            leaf = self.largest_leaf
            if leaf is not None and best.bucket_size is not None and leaf[1] >= best.bucket_size:
                lines.append(f"{best_name} stays {mib(above(best))} above no_comm: its largest bucket holds "
                             f"{leaf[0]} ({leaf[1]:,} elements) alone, and no bucket count splits a leaf.")
            elif best.num_buckets is not None:
                lines.append(f"{best_name} stays {mib(above(best))} above no_comm, about one bucket's scratch: more "
                             f"buckets should lower it (try --num-buckets {2 * best.num_buckets}).")
        drained = lambda n: (s := _strategy(n)) is not None and s.max_in_flight is not None  # noqa: E731
        if best is not None and best.predicted_step_s is not None:
            # XLA's price of each step decides; a step it could not price is no rival.
            rivals = [(n, p) for n, p in plans.items() if n != best_name and drained(n)
                      and p.predicted_step_s is not None and p.predicted_step_s < best.predicted_step_s]
            if rivals:
                n, p = min(rivals, key=lambda kv: kv[1].temp_bytes)
                lines.append(f"{n} needs {mib(p.temp_bytes - best.temp_bytes)} more ({mib(p.temp_bytes)}) but XLA "
                             f"predicts {_ms(p.predicted_step_s)} a step against {_ms(best.predicted_step_s)} "
                             f"({_ms(p.exposed_comm_s)} of communication exposed against "
                             f"{_ms(best.exposed_comm_s)}): pick it if step time matters more than that memory.")
        elif best is not None and best.pairs:
            rivals = [(n, p) for n, p in plans.items() if n != best_name and drained(n)
                      and p.pairs and p.overlapped / p.pairs > best.overlapped / best.pairs]
            if rivals:
                n, p = min(rivals, key=lambda kv: kv[1].temp_bytes)
                lines.append(f"{n} needs {mib(p.temp_bytes - best.temp_bytes)} more ({mib(p.temp_bytes)}) but "
                             f"overlaps {p.overlapped}/{p.pairs} of its collectives with compute against "
                             f"{best.overlapped}/{best.pairs}: pick it if step time matters more than that memory.")
        return "\n".join(lines)

    def report(self) -> str:
        """The table, then the verdict."""
        return f"{self.table()}\n\n{self.verdict()}"

    def __str__(self) -> str:
        return self.report()

    __repr__ = __str__

    def plot(self, path: str | pathlib.Path) -> pathlib.Path:
        """Writes a PNG: each strategy's approximate live bytes over its (normalised) schedule.

        Returns the absolute path written."""
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(9, 4))
        for name, p in self._plans().items():
            n = max(len(p.live_bytes) - 1, 1)
            ax.plot([i / n for i in range(len(p.live_bytes))], [b / _MIB for b in p.live_bytes], lw=1,
                    label=f"{name} (temp {p.temp_bytes / _MIB:,.1f} MiB)")
        ax.set_xlabel("position in the ENTRY schedule (fraction)")
        ax.set_ylabel("live MiB per device (approx.)")
        ax.set_title(f"{self.num_devices}x {self.target}")
        ax.legend(loc="upper left", fontsize="small")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return pathlib.Path(path).absolute()


def abstract_tree(tree: Any, what: str = "tree") -> Any:
    """``tree`` with every leaf as a ``jax.ShapeDtypeStruct``; a clear error for a leaf that is
    not an array (or a ShapeDtypeStruct) and for an empty tree."""
    if tree is None:
        raise ValueError(f"{what} is None; it must be a pytree of arrays or jax.ShapeDtypeStructs")
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        raise ValueError(f"{what} has no leaves; it must be a pytree of arrays or jax.ShapeDtypeStructs")
    for path, leaf in leaves:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            where = jax.tree_util.keystr(path) or "the value"
            raise ValueError(f"{what}: {where} is a {type(leaf).__name__}, not an array or jax.ShapeDtypeStruct")
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), tree)


def describe_model(params: Any, batch: Any) -> str:
    """``"2.4M params (4.6 MiB bf16), batch tokens int32[64,129]"``."""
    leaves = jax.tree.leaves(params)
    count = sum(math.prod(p.shape) for p in leaves)
    nbytes = sum(math.prod(p.shape) * jnp.dtype(p.dtype).itemsize for p in leaves)
    dtypes = "/".join(dict.fromkeys(jnp.dtype(p.dtype).name.replace("bfloat16", "bf16").replace("float", "f")
                                    for p in leaves))
    shown = [f"{jax.tree_util.keystr(k).strip('[]').strip(chr(39))} "
             f"{jnp.dtype(v.dtype).name}[{','.join(map(str, v.shape))}]"
             for k, v in jax.tree_util.tree_leaves_with_path(batch)]
    batch_text = ", ".join(shown[:3]) + (f", ... ({len(shown)} arrays)" if len(shown) > 3 else "")
    return f"{count / 1e6:,.1f}M params ({mib(nbytes)} {dtypes}), batch {batch_text}"


def _per_layer(params: Any, stacked: Any) -> list[jax.ShapeDtypeStruct]:
    """The leaves one layer's buckets hold: stacked leaves without their layer axis."""
    return [jax.ShapeDtypeStruct(p.shape[1:], p.dtype) for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(stacked))
            if s]


@dataclasses.dataclass(frozen=True)
class PreparedModel:
    """A user's model checked and traced once, ready to build steps for: what
    :func:`plan_model` and :func:`jax_drain.planner.search.search_model` share.

    ``params``/``batch``: global-shape ``jax.ShapeDtypeStruct`` pytrees; ``order``: the
    gradient-ready order; ``stacked``: the scanned leaves (``None``: no scan); ``mesh``: the
    compile-only mesh of ``target`` GPUs on ``topology``, data parallel over ``"data"`` and, with
    ``param_specs`` (one ``PartitionSpec`` per parameter), tensor parallel over the model axes,
    the loss on global shapes partitioned by XLA;
    ``description``: one line for a table's head.
    """

    loss_fn: Callable[[Any, Any], Any]
    params: Any
    batch: Any
    mesh: Any
    order: tuple[int, ...]
    stacked: Any
    description: str
    target: str = "h100"
    topology: str = "1x1x8"
    param_specs: Any = None

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    @property
    def data_size(self) -> int:
        """The devices the batch is split over (and ZeRO-3 splits the parameters over)."""
        return int(self.mesh.shape[DATA_AXIS])

    @property
    def local_params(self) -> Any:
        """``params`` as each device holds them: its blocks along the model axes."""
        if self.param_specs is None:
            return self.params
        return jax.tree.map(
            lambda p, spec: jax.ShapeDtypeStruct(local_shape("param", p.shape, spec, self.mesh), p.dtype),
            self.params, self.param_specs, is_leaf=lambda x: isinstance(x, P))

    def build_step(self, strategy: Strategy, bucket_size: int, *, groups: Sequence[Any] | None = None) -> Any:
        """:func:`build_user_step` of this model: ``(step, args, sync)``."""
        return build_user_step(strategy, self.loss_fn, self.params, self.batch, self.mesh, axis=DATA_AXIS,
                               bucket_size=bucket_size, order=self.order, stacked=self.stacked, groups=groups,
                               param_specs=self.param_specs, tensor_parallel="gspmd")

    def bucket_size(self, num_buckets: int, *, split_leaves: bool = False, groups: Sequence[Any] | None = None) -> int:
        """The bucket size (elements) nearest ``num_buckets`` buckets (:func:`bucket_size_for`)
        of each device's parameter blocks; of a scanned stack, per layer: each layer's buckets
        are that count over the layers.

        Example::

            >>> model.bucket_size(12)  # doctest: +SKIP
            786432
        """
        n, params = self.data_size, self.local_params
        if self.stacked is None:
            return bucket_size_for(params, num_buckets, n, self.order, split_leaves=split_leaves, groups=groups)
        layers = next(p.shape[0] for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(self.stacked)) if s)
        return bucket_size_for(_per_layer(params, self.stacked), max(1, round(num_buckets / layers)), n,
                               split_leaves=split_leaves)


def _model_mesh(n: int, model_axes: Mapping[str, int] | None, target: str, topology: str) -> Any:
    """The compile-only mesh: ``"data"`` over what ``model_axes`` (name -> size) leave."""
    axes = dict(model_axes or {})
    for name, size in axes.items():
        if name == DATA_AXIS or not isinstance(name, str):
            raise ValueError(f"model_axes names the tensor-parallel axes besides {DATA_AXIS!r}; got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"model_axes[{name!r}] must be a positive integer, got {size!r}")
    model = math.prod(axes.values())
    if n % model:
        raise ValueError(f"model_axes {axes} take {model} devices, which do not divide the {n} of {topology}")
    return gpu_mesh((n // model, *axes.values()), (DATA_AXIS, *axes), target=target, topology=topology)


def prepare_model(
    loss_fn: Callable[[Any, Any], Any],
    params: Any,
    batch: Any,
    *,
    target: str = "h100",
    topology: str = "1x1x8",
    scan: bool | None = None,
    name: str = "",
    model_axes: Mapping[str, int] | None = None,
    param_specs: Any = None,
) -> PreparedModel:
    """Checks ``loss_fn``, ``params`` and ``batch`` as :func:`plan_model` takes them (clear
    errors before any compile) and traces what every strategy's step needs once.

    ``model_axes`` (``{"model": 2}``) and ``param_specs`` (a ``PartitionSpec`` per parameter
    over those axes, a prefix of ``params``) make the mesh tensor parallel; ``loss_fn`` is then
    written for global shapes and XLA partitions it (``TrainConfig(tensor_parallel="gspmd")``):
    the model's own ``with_sharding_constraint`` calls over the model axes are kept.

    Example::

        model = prepare_model(loss, params, batch, topology="1x1x8")
        model.bucket_size(24), model.description
    """
    params = abstract_tree(params, "params")
    batch = abstract_tree(batch, "batch")
    if (param_specs is None) != (not model_axes):
        raise ValueError("give model_axes (the tensor-parallel axes and their sizes, e.g. {'model': 2}) and "
                         "param_specs (how each parameter splits over them) together")
    slices, hosts, gpus = parse_topology(topology)
    mesh = _model_mesh(slices * hosts * gpus, model_axes, target, topology)
    n = int(mesh.shape[DATA_AXIS])
    specs = None
    if param_specs is not None:
        specs = jax.tree.unflatten(jax.tree.structure(params), leaf_specs(params, param_specs))
        unknown = sorted({a for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
                          for a in spec_axes(s)} - set(model_axes))
        if unknown:
            raise ValueError(f"param_specs name axes {unknown} that model_axes {dict(model_axes)} lacks")
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        if not leaf.shape or leaf.shape[0] % n:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or '(the batch)'} has shape {tuple(leaf.shape)}: its leading "
                f"dimension must divide over the {n} data-parallel devices")
    # Traced plainly: a loss for global shapes gives the same order and scan on its parameters
    # whether or not XLA later splits them over the model axes.
    local_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]), x.dtype), batch)
    try:
        out = jax.eval_shape(loss_fn, params, local_batch)
    except Exception as e:
        raise PlanError(f"could not trace loss_fn(params, batch): {type(e).__name__}: {e}") from e
    if not (hasattr(out, "shape") and out.shape == () and jnp.issubdtype(out.dtype, jnp.floating)):
        raise PlanError(f"loss_fn(params, batch) must return a float scalar (the per-device mean loss), "
                        f"got {getattr(out, 'shape', type(out).__name__)}")
    try:
        order = grad_ready_order(loss_fn, params, local_batch)
        stacked = stacked_leaves(loss_fn, params, local_batch) if scan is not False else None
    except Exception as e:
        raise PlanError(f"could not trace jax.grad(loss_fn): {type(e).__name__}: {e}") from e
    if stacked is not None and not any(jax.tree.leaves(stacked)):
        if scan:
            raise ValueError("scan=True, but loss_fn scans over no leaf of params")
        stacked = None
    description = (f"{name}: " if name else "") + describe_model(params, batch)
    if model_axes:
        description += ", tensor parallel over " + ", ".join(f"{a}={k}" for a, k in model_axes.items())
    return PreparedModel(loss_fn, params, batch, mesh, tuple(order), stacked, description, target, topology,
                         specs)


def plan_model(
    loss_fn: Callable[[Any, Any], Any],
    params: Any,
    batch: Any,
    strategies: Sequence[str | Strategy] = DEFAULT_STRATEGIES,
    *,
    target: str = "h100",
    topology: str = "1x1x8",
    num_buckets: int | None = 24,
    bucket_size: int | None = None,
    compiler_options: dict[str, Any] | None = None,
    scan: bool | None = None,
    name: str = "",
    progress: bool = True,
    model_axes: Mapping[str, int] | None = None,
    param_specs: Any = None,
) -> Comparison:
    """Compiles ``loss_fn``'s gradient step once per strategy on ``topology`` (data parallel over
    every GPU) for compile-only ``target`` GPUs and compares them (:class:`Comparison`).

    Args:
        loss_fn: ``loss_fn(params, batch)``, the per-device mean loss (of this device's part of
            the batch); differentiable in ``params``.
        params, batch: global-shape pytrees of arrays or ``jax.ShapeDtypeStruct``; every batch
            leaf is split along its leading axis over the data-parallel devices, params are replicated there.
        strategies: names (``gspmd``, ``gspmd+flags``, ``no_comm``, ``MODE[+drain[K]][+split]``);
            one the runtime cannot build (``+split`` without ``split_leaves``) gets a row saying
            so instead of numbers.
        num_buckets, bucket_size: about this many buckets (:func:`bucket_size_for`), or this
            bucket size in elements.
        scan: sync scanned leaves inside the backward scan (:class:`jax_drain.ScanGradSync`);
            ``None``: when the loss scans over some leaves (:func:`jax_drain.stacked_leaves`).
        name: a label for the table's head.
        progress: write one line per strategy to stderr while compiling (each takes seconds
            to minutes); ``False``: nothing.
        model_axes, param_specs: tensor parallel as well: the model axes and their sizes
            (``{"model": 2}``; the data axis gets the other devices) and each parameter's
            ``PartitionSpec`` over them; ``loss_fn`` is written for global shapes
            (:func:`prepare_model`).

    Returns:
        A :class:`Comparison`; ``print(...)`` it for the table and the verdict.

    Example::

        report = plan_model(loss, params, batch, ["gspmd", "no_comm", "fp32_accum+drain"])
        print(report)
    """
    parsed = [Strategy.parse(s) if isinstance(s, str) else s for s in strategies]
    if not parsed:
        raise ValueError("give at least one strategy")
    model = prepare_model(loss_fn, params, batch, target=target, topology=topology, scan=scan, name=name,
                          model_axes=model_axes, param_specs=param_specs)
    n, params = model.num_devices, model.params
    if bucket_size is None:
        bucket_size = model.bucket_size(num_buckets or 1)
    itemsize = max(jnp.dtype(p.dtype).itemsize for p in jax.tree.leaves(params))
    shown = Progress(progress, len(parsed), f"{model.description} on {n}x {target} ({topology})")

    rows = []
    for k, strat in enumerate(parsed):
        try:
            step, args, sync = model.build_step(strat, bucket_size)
        except StrategyUnavailable as e:
            shown.unavailable(k, strat.name)
            rows.append(Row(strat.name, unavailable=str(e)))
            continue
        options = {**strategy_options(strat, bucket_size * itemsize), **(compiler_options or {})}
        shown.compiling(k, strat.name)
        try:
            report = plan(step, *args, target=target, topology=topology, compiler_options=options or None,
                          scope=None if sync is None else SCOPE_PREFIX, strategy=strat.name,
                          num_buckets=total_buckets(sync), bucket_size=None if sync is None else bucket_size,
                          notes=(f"XLA options {options}",) if options else ())
        except BaseException:
            shown.failed()
            raise
        shown.compiled(report.temp_bytes)
        rows.append(Row(strat.name, report))
    return Comparison(tuple(rows), target, topology, n, model.description, largest_leaf(params))


def largest_leaf(params: Any) -> tuple[str, int] | None:
    """(path, elements) of the largest leaf of ``params``."""
    leaves = [(jax.tree_util.keystr(k), math.prod(v.shape)) for k, v in jax.tree_util.tree_leaves_with_path(params)]
    return max(leaves, key=lambda kv: kv[1], default=None)
