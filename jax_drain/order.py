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

from jax_drain._compat import Literal

# Primitives whose body runs once, in line: positions inside them are meaningful.
_INLINE_CALLS = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call", "custom_lin"}
)

Position = tuple[int, ...]


def grad_ready_order(loss_fn: Callable[..., Any], params: Any, *example_args: Any, has_aux: bool = False) -> tuple[int, ...]:
    """Leaf indices of ``params`` (``jax.tree.leaves`` order) in the order backward finishes them.

    Args:
        loss_fn: ``loss_fn(params, *example_args)`` returns a scalar (or ``(scalar, aux)`` with
            ``has_aux=True``). It is only traced, never run.
        params: arrays or ``jax.ShapeDtypeStruct``s with global shapes.
        example_args: the other arguments, arrays or ``jax.ShapeDtypeStruct``s.

    Returns:
        A permutation of ``range(len(jax.tree.leaves(params)))`` to pass as ``GradSync(order=...)``.
    """
    closed = jax.make_jaxpr(jax.grad(loss_fn, has_aux=has_aux))(params, *example_args)
    grad_vars = closed.jaxpr.outvars[: len(jax.tree.leaves(params))]
    positions = _output_positions(closed.jaxpr)
    ranked = sorted(
        range(len(grad_vars)),
        key=lambda i: (positions.get(_var_key(grad_vars[i]), (-1,)), -i),
    )
    return tuple(ranked)


def _var_key(v: Any) -> Any:
    # Literals (constant gradients) are never produced by an equation: they are ready first.
    return None if isinstance(v, Literal) else v


def _sub_jaxpr(eqn: Any) -> Any:
    if eqn.primitive.name not in _INLINE_CALLS:
        return None
    sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
    if sub is None or len(sub.outvars) != len(eqn.outvars):
        return None
    return sub


def _output_positions(jaxpr: Any) -> dict[Any, Position]:
    """Maps each variable defined in ``jaxpr`` to the (nested) position that produces it."""
    positions: dict[Any, Position] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if all(isinstance(v, Literal) for v in eqn.invars):
            # A constant (e.g. the zero gradient of an unused leaf, materialised at the end).
            positions.update((out, (-1,)) for out in eqn.outvars)
            continue
        sub = _sub_jaxpr(eqn)
        inner = _output_positions(sub) if sub is not None else {}
        for k, out in enumerate(eqn.outvars):
            tail: Position = ()
            if sub is not None:
                sub_out = sub.outvars[k]
                # An output that just forwards a sub-input is ready when the call starts.
                tail = inner.get(_var_key(sub_out), (-1,))
            positions[out] = (i, *tail)
    return positions
