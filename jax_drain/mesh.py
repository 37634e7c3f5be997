"""Mesh axes and parameter placement for :class:`~jax_drain.GradSync` on real meshes.

A gradient leaf is reduced over the mesh axes its parameter is *replicated* along and that
carry different data, and kept apart along the axes its parameter is *sharded* along:

* ``axis`` (inner, e.g. ``"data"``): the dense data-parallel axes; buckets are reduce-scattered
  over them (one axis or several, e.g. ``("data", "expert")``).
* ``outer_axis`` (e.g. ``"replica"``, across hosts): after the inner reduce-scatter, each
  shard is all-reduced over these axes (HSDP / Megatron's ``num_distributed_optimizer_instances``).
* ``param_specs``: a ``PartitionSpec`` per parameter over the *other* axes (tensor parallel
  ``"model"``, expert parallel ...). Inside ``shard_map`` a parameter is its local block, so the
  bucket layout is built from local shapes: each dimension divided by its spec's axis sizes.
* expert (MoE) parameters are reduce-scattered over ``expert_axis`` (their expert-data-parallel
  axes, a subset of ``axis``); every other dense data axis must shard them (expert parallel),
  otherwise their gradients would miss the tokens of the ranks along it.

Tensor parallelism comes in two modes (``TENSOR_PARALLEL_MODES``):

* ``"manual"``: the step's ``shard_map`` makes every mesh axis manual; the loss runs on local
  blocks and does its own ``psum`` over the model axis (Megatron style).
* ``"gspmd"``: the step's ``shard_map`` makes only the data-parallel axes manual
  (:func:`split_spec`); the loss runs on global shapes along the other axes and XLA inserts the
  tensor-parallel collectives (MaxText, EasyLM, Flax's partitioned examples). The bucket chains
  still run on local blocks, in a nested ``shard_map`` manual over the other axes.

This module validates those declarations against the mesh and computes per-leaf placements;
errors name the leaf and say what to change.

Example::

    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((4, 2), ("data", "model"))                    # doctest: +SKIP
    >>> placements = place_leaves({"w": jnp.zeros((8, 6))}, mesh, ("data",), (),
    ...                           {"w": P(None, "model")})                 # doctest: +SKIP
    >>> placements[0].local_shape, placements[0].reduce_axes               # doctest: +SKIP
    ((8, 3), ('data',))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec

from jax_drain import _compat
from jax_drain.layout import leaf_paths, path_str, unique_leaf_paths

PyTree = Any
Axes = tuple[str, ...]
AxisSpec = str | Sequence[str] | None
ExpertSpec = PyTree | Callable[[str], bool] | None


@dataclasses.dataclass(frozen=True)
class LeafPlacement:
    """How one parameter leaf sits on the mesh and which axes its gradient is reduced over."""

    path: str
    spec: PartitionSpec  # over non-reduction axes; P() when replicated
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]  # the per-device block inside shard_map
    dtype: np.dtype
    expert: bool
    reduce_axes: Axes  # inner reduce-scatter axes: ``axis`` for dense, ``expert_axis`` for experts

    @property
    def spec_axes(self) -> Axes:
        return spec_axes(self.spec)


def as_axes(axis: AxisSpec, what: str, allow_empty: bool = False) -> Axes:
    """``"data"`` -> ``("data",)``; tuples and lists kept in order; ``None`` -> ``()``.

    Example::

        >>> as_axes("data", "axis"), as_axes(("replica", "data"), "axis")
        (('data',), ('replica', 'data'))
    """
    if axis is None:
        axes: Axes = ()
    elif isinstance(axis, str):
        axes = (axis,)
    elif isinstance(axis, (tuple, list)) and all(isinstance(a, str) for a in axis):
        axes = tuple(axis)
    else:
        raise TypeError(f"{what} must be a mesh axis name or a tuple of them, got {axis!r}")
    if not axes and not allow_empty:
        raise ValueError(f"{what} must name at least one mesh axis")
    if len(set(axes)) != len(axes):
        raise ValueError(f"{what} names an axis twice: {axes}")
    return axes


def check_mesh(mesh: Any) -> None:
    """Raises ``TypeError`` unless ``mesh`` is a ``jax.sharding.Mesh`` (or an ``AbstractMesh``):
    a list, tuple or numpy array of devices has no axis names to reduce over.

    Example::

        >>> check_mesh(jax.devices())                                      # doctest: +SKIP
        TypeError: mesh must be a jax.sharding.Mesh, got a list of 8 devices; ...
    """
    if isinstance(mesh, (Mesh, jax.sharding.AbstractMesh)):
        return
    if isinstance(mesh, np.ndarray):
        got, shape, devices = f"a numpy array of shape {mesh.shape}", mesh.shape, "that_array"
    elif isinstance(mesh, (list, tuple)):
        got, shape, devices = f"a {type(mesh).__name__} of {len(mesh)} devices", (len(mesh),), "np.array(devices)"
    else:
        got, shape, devices = f"{type(mesh).__name__} {mesh!r:.80}", (len(jax.devices()),), "np.array(devices)"
    names = ("data",) if len(shape) == 1 else tuple(f"axis{i}" for i in range(len(shape)))
    raise TypeError(
        f"mesh must be a jax.sharding.Mesh, got {got}: a mesh names the axes gradients are "
        f"reduced over. Build one with jax.make_mesh({shape}, {names}) or "
        f"jax.sharding.Mesh({devices}, {names})"
    )


#: ``"manual"``: every mesh axis manual, the loss on local blocks with its own model-axis
#: collectives; ``"gspmd"``: only the data axes manual, the loss on global shapes, XLA's
#: tensor-parallel collectives.
TENSOR_PARALLEL_MODES = ("manual", "gspmd")


def check_tensor_parallel(mode: Any) -> str:
    """Returns ``mode`` if it is one of ``TENSOR_PARALLEL_MODES``, else raises ``ValueError``."""
    if not isinstance(mode, str) or mode not in TENSOR_PARALLEL_MODES:
        raise ValueError(
            f"tensor_parallel must be 'manual' (the loss runs on local blocks and psums over the model "
            f"axis itself) or 'gspmd' (the loss is written for global shapes; XLA partitions it), got {mode!r}"
        )
    return mode


OWNERSHIP_MODES = ("element", "param")


def check_ownership(mode: Any) -> str:
    """Returns ``mode`` if it is one of ``OWNERSHIP_MODES``, else raises ``ValueError``."""
    if not isinstance(mode, str) or mode not in OWNERSHIP_MODES:
        raise ValueError(
            f"ownership must be 'element' (each device holds a contiguous slice of every bucket) or 'param' "
            f"(each device holds whole parameters, for optimizers that need them), got {mode!r}")
    return mode


def auto_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis of type ``Auto`` (the same devices and names).

    A ``"gspmd"`` loss is written for GSPMD's automatic partitioning: on an ``Explicit`` axis
    (``jax.make_mesh``'s default since jax 0.7) the partial-manual region sees sharding-in-types
    instead, refuses ``with_sharding_constraint`` and all-gathers model-sharded weights.
    """
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _entry_axes(entry: Any) -> Axes:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _as_entry(axes: Sequence[str]) -> Any:
    return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def split_spec(spec: PartitionSpec | None, manual_axes: Sequence[str], what: str = "array") -> tuple[PartitionSpec, PartitionSpec]:
    """A global array's ``PartitionSpec`` as the two ``shard_map`` specs of a ``"gspmd"`` step:
    ``(outer, inner)``, ``outer`` over ``manual_axes`` only (the data-parallel region, the other
    axes automatic), ``inner`` over the other axes (the nested region that makes them manual too).

    Within each dimension the manual axes must come first (major): the outer region splits a
    dimension into contiguous pieces, which the inner one splits again.

    Example::

        >>> split_spec(PartitionSpec(("data", "model")), ("data",))
        (PartitionSpec('data',), PartitionSpec('model',))
        >>> split_spec(PartitionSpec(None, "model"), ("data",))
        (PartitionSpec(None, None), PartitionSpec(None, 'model'))
    """
    spec = PartitionSpec() if spec is None else spec
    manual = set(manual_axes)
    outer, inner = [], []
    for entry in spec:
        axes = _entry_axes(entry)
        mine = [a for a in axes if a in manual]
        if list(axes[:len(mine)]) != mine:
            raise ValueError(
                f"{what}: PartitionSpec {spec} splits a dimension over {axes}, a data-parallel axis "
                f"({', '.join(mine)}) after another one; in tensor_parallel='gspmd' the data axes must "
                "come first (major) within a dimension"
            )
        outer.append(_as_entry(mine))
        inner.append(_as_entry([a for a in axes if a not in manual]))
    return PartitionSpec(*outer), PartitionSpec(*inner)


def split_specs(specs: PyTree, manual_axes: Sequence[str]) -> tuple[PyTree, PyTree]:
    """:func:`split_spec` over a tree of ``PartitionSpec`` s (``None`` leaves stay ``None``:
    replicated, or a subtree of ``None`` s)."""
    is_leaf = lambda x: x is None or isinstance(x, PartitionSpec)
    pairs = jax.tree.map(lambda s: None if s is None else split_spec(s, manual_axes), specs, is_leaf=is_leaf)
    pick = lambda i: jax.tree.map(lambda pair: None if pair is None else pair[i], pairs,
                                  is_leaf=lambda x: x is None or isinstance(x, tuple) and len(x) == 2
                                  and all(isinstance(p, PartitionSpec) for p in x))
    return pick(0), pick(1)


def check_array_leaves(params: PyTree, what: str = "params") -> None:
    """Raises ``TypeError`` naming the first leaf of ``params`` that is not an array (or a
    ``jax.ShapeDtypeStruct``), e.g. a Python ``float``: gradients are synchronised per array."""
    for path, leaf in zip(unique_leaf_paths(params), jax.tree.leaves(params)):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"{what} leaf {path!r} is a Python {type(leaf).__name__} ({leaf!r:.40}), not an array: "
                f"make it one (jnp.asarray({leaf!r:.40})) or take it out of the trained tree "
                "(pass it to the loss some other way)"
            )


def check_mesh_axes(mesh: Mesh, axes: Axes, what: str) -> None:
    """Raises ``ValueError`` unless every axis in ``axes`` is one of ``mesh``'s."""
    for a in axes:
        if a not in mesh.axis_names:
            raise ValueError(f"mesh has no axis {a!r} ({what}); its axes are {tuple(mesh.axis_names)}")


def axes_size(mesh: Mesh, axes: Axes) -> int:
    """Number of devices along ``axes`` together (1 for no axes)."""
    return math.prod(int(mesh.shape[a]) for a in axes)


def spec_axes(spec: PartitionSpec) -> Axes:
    """The axis names a ``PartitionSpec`` uses, in order: ``P(None, ("a", "b"))`` -> ``("a", "b")``."""
    out: list[str] = []
    for entry in spec:
        if entry is None:
            continue
        out.extend((entry,) if isinstance(entry, str) else tuple(entry))
    return tuple(out)


def mesh_order(mesh: Mesh, axes: Sequence[str]) -> Axes:
    """``axes`` without repeats, in the mesh's axis order."""
    wanted = set(axes)
    return tuple(a for a in mesh.axis_names if a in wanted)


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def broadcast_prefix(prefix: PyTree, params: PyTree, what: str, is_leaf: Callable[[Any], bool]) -> list:
    """One entry per leaf of ``params`` from ``prefix``, a tree with the params' structure or a
    prefix of it (each entry applies to the whole subtree below it, as for optax masks)."""
    marker = object()
    try:
        full = jax.tree.map(
            lambda entry, sub: jax.tree.map(lambda _: (marker, entry), sub),
            prefix, params, is_leaf=is_leaf,
        )
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{what} must have the params' structure (or a prefix of it, e.g. one entry per "
            f"sub-module){_prefix_mismatch(prefix, params, is_leaf) or f': {e}'}"
        ) from None
    return [entry for _, entry in jax.tree.leaves(full, is_leaf=lambda x: isinstance(x, tuple) and x[:1] == (marker,))]


def _prefix_mismatch(prefix: PyTree, params: PyTree, is_leaf: Callable[[Any], bool]) -> str:
    """Which parameters no entry of ``prefix`` covers, and which entries match no parameter
    (readable paths, a few of each); empty where the paths match and the structures differ otherwise."""
    entries = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(prefix, is_leaf=is_leaf)[0]]
    leaves = leaf_paths(params)
    under = lambda leaf, entry: not entry or leaf == entry or leaf.startswith(entry + "/")
    missing = [leaf for leaf in leaves if not any(under(leaf, e) for e in entries)]
    extra = [e for e in entries if not any(under(leaf, e) for leaf in leaves)]
    show = lambda paths: ", ".join(repr(p) for p in paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    parts = ([f"no entry for the parameters {show(missing)}"] if missing else []) + (
        [f"entries {show(extra)} match no parameter"] if extra else [])
    if not parts:
        return ""
    return ": " + "; ".join(parts) + ". Give every parameter an entry (None: replicated), or one entry for a whole sub-tree"


def leaf_specs(params: PyTree, param_specs: PyTree | None) -> list[PartitionSpec]:
    """One ``PartitionSpec`` per leaf; ``None`` (anywhere) means replicated, ``P()``."""
    if param_specs is None:
        return [PartitionSpec()] * len(jax.tree.leaves(params))
    specs = broadcast_prefix(param_specs, params, "param_specs", _is_spec_leaf)
    paths = leaf_paths(params)
    out = []
    for path, spec in zip(paths, specs):
        spec = PartitionSpec() if spec is None else spec
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"param_specs entry for {path!r} must be a PartitionSpec or None, got {spec!r}")
        for entry in spec:
            ok = entry is None or isinstance(entry, str) or (
                isinstance(entry, tuple) and all(isinstance(a, str) for a in entry))
            if not ok:
                raise ValueError(
                    f"param_specs entry for {path!r} is {spec}; entries must be None, an axis name "
                    "or a tuple of axis names (no P.UNCONSTRAINED)"
                )
        out.append(spec)
    return out


def expert_flags(params: PyTree, expert: ExpertSpec) -> list[bool]:
    """Which leaves are expert parameters: from a pytree of bools (or a prefix of the params'
    structure), or a predicate on leaf paths such as ``lambda path: "/experts/" in path``."""
    paths = leaf_paths(params)
    if expert is None:
        return [False] * len(paths)
    if callable(expert):
        flags = [expert(p) for p in paths]
    else:
        flags = broadcast_prefix(expert, params, "expert", lambda x: isinstance(x, (bool, np.bool_)))
    for path, f in zip(paths, flags):
        if not isinstance(f, (bool, np.bool_)):
            raise TypeError(f"expert entry for {path!r} must be a Python bool, got {f!r}")
    return [bool(f) for f in flags]


def local_shape(path: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> tuple[int, ...]:
    """The per-device block shape of a parameter of global ``shape`` sharded by ``spec``."""
    if len(spec) > len(shape):
        raise ValueError(
            f"param {path!r} has shape {shape} but its PartitionSpec {spec} has {len(spec)} "
            "entries; give at most one entry per dimension"
        )
    out = list(shape)
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        n = axes_size(mesh, axes)
        if shape[dim] % n:
            raise ValueError(
                f"param {path!r} dimension {dim} has size {shape[dim]}, which does not split over "
                f"{axes} ({n} devices); pad the parameter or shard another dimension"
            )
        out[dim] = shape[dim] // n
    return tuple(out)


def place_leaves(
    params: PyTree,
    mesh: Mesh,
    axes: Axes,
    outer_axes: Axes,
    param_specs: PyTree | None = None,
    expert: ExpertSpec = None,
    expert_axes: Axes | None = None,
) -> list[LeafPlacement]:
    """Validates the axis declarations and returns one :class:`LeafPlacement` per leaf.

    Rules (each broken one raises ``ValueError`` naming the axis or leaf):

    * ``mesh`` is a ``jax.sharding.Mesh`` and every leaf an array (``TypeError`` otherwise);
    * every axis named anywhere exists in ``mesh``;
    * ``axes`` and ``outer_axes`` are disjoint (an axis is reduce-scattered or all-reduced);
    * ``expert_axes`` is a subset of ``axes``;
    * a dense param's spec names none of ``axes + outer_axes``; an expert param's spec names none
      of ``expert_axes + outer_axes`` (sharding over a reduced axis would be FSDP, not supported);
    * an expert param is sharded along every axis of ``axes`` not in ``expert_axes`` (expert
      parallel): replicated there, its gradient would lack the other ranks' tokens.
    """
    check_mesh(mesh)
    check_array_leaves(params)
    check_mesh_axes(mesh, axes, "axis")
    check_mesh_axes(mesh, outer_axes, "outer_axis")
    both = [a for a in axes if a in outer_axes]
    if both:
        raise ValueError(
            f"axis and outer_axis both name {both}: an axis is either reduce-scattered (axis) or "
            "all-reduced after it (outer_axis), not both"
        )
    flags = expert_flags(params, expert)
    if expert is not None:
        if expert_axes is None:
            raise ValueError(
                "expert params need expert_axis: the mesh axes their gradients are reduce-scattered "
                f"over (a subset of axis={axes}, e.g. {axes[:1]}); the other data axes shard them"
            )
        check_mesh_axes(mesh, expert_axes, "expert_axis")
        stray = [a for a in expert_axes if a not in axes]
        if stray:
            raise ValueError(
                f"expert_axis {stray} is not among the data-parallel axes {axes}: experts are "
                "reduced over a subset of the dense data-parallel group (Megatron's expert-data-"
                "parallel group); add the axis to axis=, or shard the experts along it instead"
            )
        if not any(flags):
            raise ValueError("expert selects no parameter; pass expert=None for a dense-only model")
        if all(flags):
            raise ValueError(
                "expert selects every parameter; GradSync needs at least one dense parameter "
                "(mark only the expert weights)"
            )
    elif expert_axes is not None:
        raise ValueError("expert_axis is given but expert is None: also pass expert= to mark the expert params")

    leaves = jax.tree.leaves(params)
    paths = leaf_paths(params)
    specs = leaf_specs(params, param_specs)
    placements = []
    for path, leaf, spec, is_expert in zip(paths, leaves, specs, flags):
        used = spec_axes(spec)
        if len(set(used)) != len(used):
            raise ValueError(f"param {path!r} spec {spec} names an axis twice")
        check_mesh_axes(mesh, used, f"in the PartitionSpec of param {path!r}")
        reduce_axes = tuple(expert_axes) if is_expert else axes
        clash = [a for a in used if a in reduce_axes + outer_axes]
        if clash:
            kind = "expert param" if is_expert else "param"
            raise ValueError(
                f"{kind} {path!r} is sharded along {clash} (spec {spec}), but its gradient is "
                f"reduced over {reduce_axes + outer_axes}. Parameters are replicated along the "
                "reduced axes: remove those axes from its PartitionSpec"
                + ("" if is_expert else ", or mark it as an expert param")
            )
        if is_expert:
            missing = [a for a in axes if a not in expert_axes and a not in used]
            if missing:
                raise ValueError(
                    f"expert param {path!r} (spec {spec}) is neither sharded along nor reduced over "
                    f"the data axes {missing}: its gradient would miss the tokens of the other ranks "
                    "there. Shard it along them (expert parallel: add them to its PartitionSpec) "
                    "or add them to expert_axis"
                )
        shape = tuple(int(d) for d in leaf.shape)
        dtype = np.dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)
        placements.append(
            LeafPlacement(path, spec, shape, local_shape(path, shape, spec, mesh), dtype, is_expert, reduce_axes)
        )
    return placements


def require_bound_axes(owner: str, mesh: Mesh, axes: Sequence[str], hint: str = "") -> None:
    """Raises ``ValueError`` unless the enclosing ``shard_map`` binds each of ``axes`` with its
    size in ``mesh``: ``owner`` (e.g. ``"GradSync.reduce_scatter"``) is called in the wrong place.

    Example::

        >>> require_bound_axes("GradSync.reduce_scatter", mesh, ("data",))  # doctest: +SKIP
        ValueError: GradSync.reduce_scatter must be called inside jax.shard_map over a mesh with axis 'data' ...
    """
    bound = _compat.bound_axis_sizes()
    unbound = [a for a in axes if a not in bound]
    if unbound:
        names = ", ".join(repr(a) for a in unbound)
        raise ValueError(
            f"{owner} must be called inside jax.shard_map over a mesh with "
            f"{'axis' if len(unbound) == 1 else 'axes'} {names} (currently bound axes: "
            f"{sorted(map(str, bound)) or 'none'}){hint}"
        )
    for a in axes:
        if bound[a] != int(mesh.shape[a]):
            raise ValueError(
                f"axis {a!r} has size {bound[a]} here but {int(mesh.shape[a])} in the mesh "
                f"{owner.split('.')[0]} was built with{hint}"
            )
