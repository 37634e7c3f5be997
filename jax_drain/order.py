"""The order in which backward finishes each parameter's gradient, read from the traced loss.

Megatron buckets parameters in reverse registration order, which is backward order for a
PyTorch module. A JAX pytree is ordered by sorted keys, so reverse leaf order is often *not*
backward order, and a parameter used in several places (a tied embedding) is complete only when
backward reaches its *first* use. Bucketing in the wrong order makes the drain chain wait behind
a bucket whose gradient is ready last. So we trace ``jax.grad(loss_fn)`` and rank each gradient
by the position of the equation that produces its final value, looking inside calls (``jit``,
``checkpoint``/remat) for finer positions. Loops are opaque: their outputs are all ready when
the loop ends, and ties keep reverse leaf order.

Example:
    >>> import jax, jax.numpy as jnp
    >>> def loss(p, x):  # "a" is used first in forward, so its gradient is ready last
    ...     return jnp.sum(jnp.tanh(x @ p["a"]) @ p["b"])
    >>> p = {"a": jnp.ones((3, 3)), "b": jnp.ones((3, 3))}
    >>> grad_ready_order(loss, p, jnp.ones((2, 3)))
    (1, 0)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_drain import _compat
from jax_drain._jaxpr import PLAIN_CALLS, REMAT, TYPE_CASTS, call_body, is_literal
from jax_drain.mesh import auto_mesh, split_specs

Position = tuple[int, ...]


def grad_ready_order(
    loss_fn: Callable[..., Any],
    params: Any,
    *example_args: Any,
    has_aux: bool = False,
    mesh: Mesh | None = None,
    in_specs: Any = None,
    axis_names: Any = None,
) -> tuple[int, ...]:
    """Leaf indices of ``params`` (``jax.tree.leaves`` order) in the order backward finishes them.

    Args:
        loss_fn: ``loss_fn(params, *example_args)`` returns a scalar (or ``(scalar, aux)`` with
            ``has_aux=True``). It is only traced, never run.
        params: arrays or ``jax.ShapeDtypeStruct``s with global shapes.
        example_args: the other arguments, arrays or ``jax.ShapeDtypeStruct``s.
        mesh, in_specs: trace ``loss_fn`` inside ``jax.shard_map(mesh=mesh, in_specs=in_specs)``
            (``in_specs`` for ``(params, *example_args)``), for a loss that runs on local blocks
            and uses collectives (tensor parallel: a ``psum`` over the model axis).
        axis_names: with ``mesh``, the axes the ``shard_map`` makes manual (``None``: all): a
            ``tensor_parallel="gspmd"`` loss runs on global shapes along the others.
            ``in_specs`` are the global arrays' own then (cut to these axes here).

    Returns:
        A permutation of ``range(len(jax.tree.leaves(params)))`` to pass as ``GradSync(order=...)``.
    """
    num_leaves = len(jax.tree.leaves(params))
    jaxpr, grad_vars = _traced(loss_fn, params, example_args, has_aux, mesh, in_specs, axis_names, grad=True)
    positions = _output_positions(jaxpr)
    ranked = sorted(range(num_leaves), key=lambda i: (positions.get(_var_key(grad_vars[i]), (-1,)), -i))
    return tuple(ranked)


def remat_groups(
    loss_fn: Callable[..., Any],
    params: Any,
    *example_args: Any,
    has_aux: bool = False,
    mesh: Mesh | None = None,
    in_specs: Any = None,
    axis_names: Any = None,
) -> tuple[int | None, ...]:
    """Per leaf of ``params``: the ``jax.checkpoint`` (remat) region of the loss that reads it
    first, numbered in forward order, or ``None`` for a leaf first read outside every region
    (an embedding, a final norm). Arguments as for :func:`grad_ready_order`.

    ``GradSync(..., bucket_groups=remat_groups(...))`` closes a bucket wherever the group
    changes, so no bucket holds two blocks' parameters: each block's buckets are complete when
    its backward ends, and ZeRO-3 gathers a bucket in one block's rematerialised backward only.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> block = jax.checkpoint(lambda w, x: jnp.tanh(x @ w))
        >>> def loss(p, x):
        ...     return jnp.sum(block(p["w2"], block(p["w1"], x @ p["embed"])))
        >>> p = {"embed": jnp.ones((3, 3)), "w1": jnp.ones((3, 3)), "w2": jnp.ones((3, 3))}
        >>> remat_groups(loss, p, jnp.ones((2, 3)))
        (None, 0, 1)
    """
    num_leaves = len(jax.tree.leaves(params))
    jaxpr, _ = _traced(loss_fn, params, example_args, has_aux, mesh, in_specs, axis_names, grad=False)
    readers = _first_remat_readers(jaxpr, jaxpr.invars[:num_leaves])
    numbers = {at: k for k, at in enumerate(sorted({r for r in readers if r is not None}))}
    return tuple(None if r is None else numbers[r] for r in readers)


def _first_remat_readers(jaxpr: Any, variables: Any) -> list[Any]:
    """For each of ``variables``: the position of the first remat equation that reads it
    (looking through plain calls such as ``jit``), ``None`` if an equation of another kind reads
    it first."""
    out: list[Position | None] = [None] * len(variables)
    todo = {v: i for i, v in enumerate(variables) if not is_literal(v)}
    done: set[int] = set()
    for position, eqn in enumerate(jaxpr.eqns):
        read = [(k, todo[v]) for k, v in enumerate(eqn.invars)
                if not is_literal(v) and v in todo and todo[v] not in done]
        if not read:
            continue
        if eqn.primitive.name in TYPE_CASTS:  # the same value, typed as varying over more axes
            todo.update((out, i) for out, (_, i) in zip(eqn.outvars, read))
            continue
        if eqn.primitive.name in REMAT:
            for _, i in read:
                out[i] = (position,)
        elif (body := call_body(eqn, PLAIN_CALLS)) is not None:
            inner = _first_remat_readers(body[0], [body[0].invars[k] for k, _ in read])
            for (_, i), reader in zip(read, inner):
                out[i] = None if reader is None else (position, *reader)
        done.update(i for _, i in read)
    return out


def _traced(loss_fn: Callable, params: Any, example_args: tuple, has_aux: bool, mesh: Mesh | None,
            in_specs: Any, axis_names: Any, *, grad: bool) -> tuple[Any, list]:
    """The jaxpr of ``jax.grad(loss_fn)`` (``grad``) or of ``loss_fn`` (inside ``shard_map``
    with ``mesh``; its first inputs are the parameter leaves) and its first outputs."""
    num_leaves = len(jax.tree.leaves(params))
    fn = jax.grad(loss_fn, has_aux=has_aux) if grad else loss_fn
    if mesh is None:
        closed = jax.make_jaxpr(fn)(params, *example_args)
        return closed.jaxpr, closed.jaxpr.outvars[:num_leaves]
    return _traced_in_shard_map(fn, mesh, in_specs, params, example_args, num_leaves, has_aux, axis_names)


def _traced_in_shard_map(
    grad: Callable, mesh: Mesh, in_specs: Any, params: Any, args: tuple, num_leaves: int, has_aux: bool,
    axis_names: Any = None,
):
    """The body jaxpr of ``grad`` under ``shard_map`` and its gradient variables."""
    axes = tuple(mesh.axis_names) if axis_names is None else tuple(a for a in mesh.axis_names if a in set(axis_names))
    full_specs = in_specs

    def body(p, *a):
        # Every leaf varies along every axis: no psum is inserted and any out_spec is valid.
        g = grad(jax.tree.map(lambda x: _compat.mark_varying(x, axes), p), *a)
        g = g[0] if has_aux else g
        # shard_map outputs need a dimension to split over the mesh.
        return [x.reshape((1, *x.shape)) for x in jax.tree.leaves(g)[:num_leaves]]

    if axis_names is None:
        mapped = _compat.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=P(axes))
    else:
        mesh = auto_mesh(mesh)
        outer, _ = split_specs(tuple(in_specs), axes)
        mapped = _compat.shard_map(body, mesh=mesh, in_specs=outer, out_specs=P(axes), axis_names=frozenset(axes))
    # Inputs placed as in_specs says (a mesh with explicit axes checks it).
    placed = jax.tree.map(
        lambda spec, tree: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), tree),
        tuple(full_specs), (params, *args), is_leaf=lambda x: isinstance(x, P) or x is None,
    )
    closed = jax.make_jaxpr(mapped)(*placed)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
    inner = getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"])
    producers = {out: e for e in inner.eqns for out in e.outvars}
    grad_vars = []
    for v in inner.outvars:  # undo the reshape
        e = None if is_literal(v) else producers.get(v)
        grad_vars.append(e.invars[0] if e is not None and e.primitive.name == "reshape" else v)
    return inner, grad_vars


def _var_key(v: Any) -> Any:
    # Literals (constant gradients) are never produced by an equation: they are ready first.
    return None if is_literal(v) else v


def _output_positions(jaxpr: Any) -> dict[Any, Position]:
    """Maps each variable defined in ``jaxpr`` to the (nested) position that produces it."""
    positions: dict[Any, Position] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if all(is_literal(v) for v in eqn.invars):
            # A constant (e.g. the zero gradient of an unused leaf, materialised at the end).
            positions.update((out, (-1,)) for out in eqn.outvars)
            continue
        body = call_body(eqn)
        inner = _output_positions(body[0]) if body is not None else {}
        for k, out in enumerate(eqn.outvars):
            tail: Position = ()
            if body is not None:
                # An output that just forwards a sub-input is ready when the call starts.
                tail = inner.get(_var_key(body[0].outvars[k]), (-1,))
            positions[out] = (i, *tail)
    return positions
