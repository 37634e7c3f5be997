"""Parameter shardings from where users declare them, for ``tensor_parallel="gspmd"``.

GSPMD-style code declares how each parameter is sharded in one of a few places; this module reads
them, in this order of precedence (per parameter):

1. explicit ``param_specs`` (``TrainConfig(param_specs=...)``: not read here, they win outright);
2. the ``NamedSharding`` of the parameter array passed in (``jax.device_put(params,
   NamedSharding(mesh, P(None, "model")))``, or an nnx model built under ``jax.set_mesh``);
3. nnx ``Param`` sharding metadata (``nnx.with_partitioning(init, (None, "model"))``: the
   ``out_sharding`` / ``sharding`` metadata :func:`flax.nnx.get_partition_spec` reads);
4. linen boxes: ``nn.with_partitioning`` (``nn.Partitioned``: mesh axes) and
   ``nn.with_logical_partitioning`` (``nn.LogicallyPartitioned``: logical axes, mapped to mesh
   axes by ``rules`` as :func:`flax.linen.logical_to_mesh_axes` does; the box's own rules, or
   flax's ``nn.logical_axis_rules`` context, when ``rules`` is ``None``).

Names that are not mesh axes are taken as logical names and mapped by ``rules`` (nnx metadata
too). A declared sharding over an axis the mesh lacks, or over a data-parallel axis (parameters
are replicated over those; ZeRO-3 is ``TrainConfig(shard_params=True)``), is refused before
anything is traced, naming every parameter's path.

Inside the step, the model's own activation constraints keep their meaning on the axes left to
XLA: :func:`without_manual_axes` drops the axes the step has made manual (the data axes) from
each constraint, and refuses one whose intent those axes carry.

Example::

    specs = declared_specs(model, mesh, data_axes=("data",))          # an nnx model
    specs = declared_specs(variables["params"], mesh, rules=(("embed", None), ("mlp", "model")))
    params = unboxed(variables["params"])                             # the arrays, boxes removed
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from flax import linen as nn
from flax import nnx
from flax.core import meta as linen_meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_drain.layout import leaf_paths

PyTree = Any
Rules = Sequence[tuple[str, Any]] | None

__all__ = ["declared_specs", "has_boxes", "shards_any", "unboxed", "without_manual_axes"]


def _is_box(x: Any) -> bool:
    return isinstance(x, linen_meta.AxisMetadata)


def has_boxes(tree: PyTree) -> bool:
    """Whether ``tree`` holds linen metadata boxes (``nn.Partitioned``, ``nn.LogicallyPartitioned``)."""
    return any(_is_box(x) for x in jax.tree.leaves(tree, is_leaf=_is_box))


def unboxed(params: PyTree) -> PyTree:
    """``params`` as plain arrays: an nnx model or state -> its ``nnx.Param`` values as a pure dict
    (``nnx.to_pure_dict``), linen boxes -> their values (``flax.core.meta.unbox``), anything else
    unchanged."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if isinstance(params, nnx.State):
        return nnx.to_pure_dict(params)
    return linen_meta.unbox(params) if has_boxes(params) else params


def shards_any(specs: PyTree) -> bool:
    """Whether any ``PartitionSpec`` in ``specs`` (``None`` leaves: replicated) shards a dimension."""
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: x is None or isinstance(x, PartitionSpec))
    return any(s is not None and any(e is not None for e in s) for s in leaves)


def declared_specs(params: PyTree, mesh: Mesh, rules: Rules = None, *, data_axes: Sequence[str] = ()) -> PyTree:
    """The ``PartitionSpec`` of every parameter, read from where it is declared (module doc).

    Args:
        params: an nnx ``Module`` or ``State`` (its ``nnx.Param`` s), linen params or variables
            (boxed by ``nn.with_partitioning`` / ``nn.with_logical_partitioning``, or not), or a
            pytree of arrays (their ``NamedSharding`` s) or ``jax.ShapeDtypeStruct`` s (their
            ``sharding``).
        mesh: the mesh the step runs on; every declared axis must be one of its axes.
        rules: logical axis rules, ``((logical name, mesh axis or tuple of them or None), ...)``
            as for :func:`flax.linen.logical_to_mesh_axes`.
        data_axes: the data-parallel axes (``axis`` and ``outer_axis``); a parameter declared
            sharded over one is refused.

    Returns:
        A tree of ``PartitionSpec`` with the structure of :func:`unboxed` ``(params)`` (``P()``
        where nothing is declared).

    Raises:
        ValueError: naming the path of every parameter declared over an axis the mesh lacks,
            over a data axis, or over an axis twice.
    """
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if isinstance(params, nnx.State):
        is_var = lambda x: isinstance(x, nnx.Variable)
        tree = jax.tree.map(lambda v: _Declared(v.get_value(), _nnx_names(v), None), params, is_leaf=is_var)
        tree = nnx.to_pure_dict(tree)
    else:
        tree = jax.tree.map(_from_box, params, is_leaf=_is_box)
    is_declared = lambda x: isinstance(x, _Declared)
    declared = jax.tree.leaves(tree, is_leaf=is_declared)
    paths = leaf_paths(jax.tree.map(lambda d: d.value, tree, is_leaf=is_declared))
    axes, data = tuple(mesh.axis_names), set(data_axes)
    specs, errors = [], []
    for path, d in zip(paths, declared):
        spec, source = d.spec(mesh, rules)
        used = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
        missing = [a for a in used if a not in axes]
        if missing:
            errors.append(f"{path!r}: {source} {spec} names {missing}, which the mesh lacks (its axes: {axes})"
                          + (" - a logical name? pass its rules (TrainConfig(logical_axis_rules=...))"
                             if source != "NamedSharding" else ""))
        elif data.intersection(used):
            errors.append(f"{path!r}: {source} {spec} shards it over the data-parallel axis "
                          f"{sorted(data.intersection(used))}; parameters are replicated over the data axes "
                          "(ZeRO-3 is TrainConfig(shard_params=True)): declare it over the model axes only")
        elif len(set(used)) != len(used):
            errors.append(f"{path!r}: {source} {spec} names an axis twice")
        specs.append(spec)
    if errors:
        raise ValueError("declared parameter shardings the step cannot use:\n  " + "\n  ".join(errors))
    return jax.tree.unflatten(jax.tree.structure(tree, is_leaf=is_declared), specs)


class _Declared:
    """One parameter: its value, and the names its metadata declares (``None``: nothing)."""

    def __init__(self, value: Any, names: tuple | None, box_rules: Rules, logical: bool = False):
        self.value, self.names, self.box_rules, self.logical = value, names, box_rules, logical

    def spec(self, mesh: Mesh, rules: Rules) -> tuple[PartitionSpec, str]:
        sharding = getattr(self.value, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return _strip(sharding.spec), "NamedSharding"
        if self.names is None:
            return PartitionSpec(), "nothing"
        source = "logical partitioning" if self.logical else "sharding metadata"
        names = tuple(self.names)
        axes = set(mesh.axis_names)
        logical = self.logical or any(set(_entry_names(n)) - axes for n in names)
        if not logical:
            return _strip(PartitionSpec(*names)), source
        mapping = rules if rules is not None else self.box_rules
        if mapping is None:  # the nn.logical_axis_rules(...) context, if any
            mapping = nn.get_logical_axis_rules() or None
        if mapping is None:
            # Nothing maps them: leave them for the check, which names the unknown axes.
            return _strip(PartitionSpec(*names)), source
        return _strip(nn.logical_to_mesh_axes(names, mapping)), source


def _entry_names(entry: Any) -> tuple:
    """The mesh axis names of one ``PartitionSpec`` entry, in order."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _strip(spec: PartitionSpec) -> PartitionSpec:
    """Trailing ``None`` s dropped; one-axis tuples as the name; ``P.UNCONSTRAINED`` refused later."""
    entries = [e[0] if isinstance(e, tuple) and len(e) == 1 else (None if e == () else e) for e in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _nnx_names(var: Any) -> tuple | None:
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    for key in ("out_sharding", "sharding", "sharding_names"):
        names = meta.get(key)
        if names is not None:
            return tuple(names) if not isinstance(names, PartitionSpec) else tuple(names)
    return None


def _from_box(x: Any) -> _Declared:
    if isinstance(x, nn.LogicallyPartitioned):
        return _Declared(x.value, tuple(x.names), getattr(x, "rules", None), logical=True)
    if isinstance(x, linen_meta.Partitioned):
        return _Declared(x.value, tuple(x.names), None)
    if _is_box(x):
        return _Declared(linen_meta.unbox(x), None, None)
    return _Declared(x, None, None)


def without_manual_axes(sharding: Any, context_mesh: Any, *, data_axes: Sequence[str]) -> Any:
    """A model's activation constraint as it applies inside the step: the axes that are manual
    in ``context_mesh`` dropped from its spec, on the step's mesh.

    The step splits the batch over the data axes itself (they are manual there), so a
    constraint's data axes on the leading (batch) dimension are already in force; the model
    axes of the constraint stay, for XLA to keep. A data axis on another dimension asks for a
    layout the step cannot give (the batch replicated, something else split over the data), and
    is refused. Manual model axes (``tensor_parallel="manual"``) are dropped: the loss already
    holds their local blocks. ``sharding`` is returned unchanged where nothing is manual, where
    it is not a ``NamedSharding``, or where its axes are not the context mesh's.

    Example::

        # under the step's shard_map, "data" manual and "model" left to XLA:
        without_manual_axes(NamedSharding(mesh, P("data", None, "model")), context_mesh,
                            data_axes=("data",))   # -> NamedSharding(context_mesh, P(None, None, "model"))
    """
    manual = set(getattr(context_mesh, "manual_axes", ()))
    if not manual or not isinstance(sharding, NamedSharding):
        return sharding
    spec = sharding.spec
    named = {a for entry in spec for a in _entry_names(entry)}
    if not named & manual:
        return sharding
    if not named <= set(context_mesh.axis_names):
        return sharding  # another mesh's axes: jax says what is wrong with that
    for dim, entry in enumerate(spec):
        over_data = [a for a in _entry_names(entry) if a in data_axes]
        if dim and over_data:
            raise ValueError(
                f"the loss constrains an activation to {spec}, which splits its dimension {dim} over the "
                f"data axis {over_data[0]!r}; the step splits the batch (dimension 0) over the data axes "
                f"{tuple(data_axes)} itself, so that layout cannot be kept inside it. Put the data axes on the "
                f"batch dimension only, or leave them out of the constraint: "
                f"{PartitionSpec(*(_without(entry, set(data_axes)) for entry in spec))}")
    kept = PartitionSpec(*(_without(entry, manual) for entry in spec))
    return NamedSharding(context_mesh, kept)


def _without(entry: Any, axes: set) -> Any:
    """A spec entry with ``axes`` removed: ``None`` when nothing is left, one name or a tuple."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return entry
    left = tuple(a for a in _entry_names(entry) if a not in axes)
    return None if not left else left[0] if len(left) == 1 else left
