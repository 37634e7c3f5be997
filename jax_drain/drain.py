"""Sequencing: bound how many bucket collectives are in flight with explicit data dependencies.

XLA schedules collectives by data dependencies alone: left free, its latency-hiding scheduler
starts every bucket's collective early and waits late, so every bucket's scratch buffer is live
at once (or its combiner merges all buckets into one collective at the end of backward). Tying
bucket ``k + depth``'s collective *input* to bucket ``k``'s *finished* result with
``jax.lax.optimization_barrier`` makes ``k``'s collective (and the fp32 sum that consumes its
scratch) complete before ``k + depth``'s starts -- Megatron-LM's "drain the predecessor at
dispatch time" (PR #4940), with ``depth = 1``. The barrier is a scheduling fence only: values
pass through it unchanged, so drained results are bit-identical to undrained ones.

Example:
    >>> import jax.numpy as jnp
    >>> outs = sequenced_map(lambda k, x: x * 2, [jnp.ones(3), jnp.ones(3)], max_in_flight=1)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import jax
import jax.numpy as jnp

from jax_drain import _compat

X = TypeVar("X")
Y = TypeVar("Y")


def check_max_in_flight(max_in_flight: int | None) -> int | None:
    """Validates a drain depth: ``None`` (unbounded) or an int >= 1."""
    if max_in_flight is None:
        return None
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise ValueError(
            f"max_in_flight must be an int >= 1 (1 = Megatron's drain) or None (no chain), "
            f"got {max_in_flight!r}"
        )
    return max_in_flight


def drain_depth(drain: bool, max_in_flight: int | None) -> int | None:
    """The chain depth of a sync built with ``drain`` and ``max_in_flight``.

    ``drain=True`` means ``max_in_flight`` buckets in flight (default 1, Megatron's drain);
    ``drain=False`` means no chain (``None``), and then ``max_in_flight`` must not be given.
    """
    depth = check_max_in_flight(max_in_flight)
    if depth is not None and not drain:
        raise ValueError("max_in_flight bounds the drain chain; it needs drain=True")
    return (1 if depth is None else depth) if drain else None


def sequenced_map(
    fn: Callable[[int, X], Y], inputs: Sequence[X], max_in_flight: int | None
) -> tuple[Y, ...]:
    """``tuple(fn(k, x) for k, x in enumerate(inputs))`` with at most ``max_in_flight`` unfinished.

    Input ``k`` is fenced behind output ``k - max_in_flight``, so ``fn``'s work on input ``k``
    cannot begin before output ``k - max_in_flight`` exists; where its type allows, that output
    is returned through the same fence (its readers also wait for input ``k``, which keeps XLA
    from dropping the fence). ``None`` adds no fences.
    """
    depth = check_max_in_flight(max_in_flight)
    outputs: list[Y] = []
    for k, x in enumerate(inputs):
        if depth is not None and k >= depth:
            fenced, x = jax.lax.optimization_barrier((outputs[k - depth], x))
            # The predecessor is returned through the barrier where that keeps its type: XLA's
            # simplifier drops a barrier operand whose output nothing reads once the operand has
            # no other reader left (it folds a reshape of a sum into its consumer, say), and the
            # fence with it. A predecessor the barrier would type as varying along more axes (a
            # gathered parameter fencing a shard) keeps its own value.
            if _same_types(fenced, outputs[k - depth]):
                outputs[k - depth] = fenced
        outputs.append(fn(k, x))
    return tuple(outputs)


def _same_types(a: Any, b: Any) -> bool:
    """Whether every array of ``a`` varies along the same manual axes as its twin in ``b``."""
    return all(_compat.varying_axes(x) == _compat.varying_axes(y)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def fence(behind: Any, x: X) -> X:
    """``x``, fenced behind every array of ``behind``: what reads the result waits for ``behind``.

    ``jax.lax.optimization_barrier`` types all its outputs as varying along every manual axis
    any operand varies along. Where ``behind`` varies along axes some leaves of ``x`` do not (a
    model-sharded shard fencing a model-replicated gradient), those leaves wait instead for a
    one-element token of ``behind`` made equal along those axes (a scalar ``pmax``), so each
    leaf keeps its type. Values pass through unchanged.
    """
    leaves, treedef = jax.tree.flatten(x)
    deps = jax.tree.leaves(behind)
    dep_axes = frozenset().union(*(_compat.varying_axes(d) for d in deps))
    if all(dep_axes <= _compat.varying_axes(leaf) for leaf in leaves):
        return jax.lax.optimization_barrier((behind, x))[1]
    token = sum(jnp.ravel(d)[0].astype(jnp.float32) for d in deps)
    return jax.tree.unflatten(treedef, [jax.lax.optimization_barrier((_typed_for(token, leaf), leaf))[1]
                                        for leaf in leaves])


def after(value: jax.Array, x: jax.Array, *, whole: bool = False) -> jax.Array:
    """``x``, bit for bit, computed from ``value``: whatever reads the result waits for ``value``.

    A data dependency for where :func:`fence`'s barrier would be dropped: XLA removes an
    ``optimization_barrier`` operand whose output nothing reads (its algebraic simplifier), so a
    barrier fences only where the program goes on to read the fencing value from it. Here one
    element of ``value`` is compared with itself plus one (false for every bit pattern), and that
    false is OR-ed into ``x``'s bits. It costs an elementwise pass over ``x``: for small arrays
    (a parameter shard before its all-gather), where XLA must not start early.

    ``whole``: compare the largest of ``value``'s bit patterns instead of its first element,
    for a ``value`` split over automatic mesh axes (GSPMD), whose first element lives on one
    device: a local reduction and a one-element all-reduce instead of moving that element.

    Example::

        >>> x = after(jnp.ones(4), jnp.arange(3.0))   # [0., 1., 2.], available after jnp.ones(4)
    """
    unsigned = _UNSIGNED[value.dtype.itemsize]
    bits = (jnp.max(jax.lax.bitcast_convert_type(value, unsigned)) if whole
            else jax.lax.bitcast_convert_type(jnp.ravel(value)[0], unsigned))
    never = _typed_for((bits == bits + 1).astype(jnp.uint8), x)  # 0 for every bit pattern
    if x.dtype == jnp.bool_:
        return x | never.astype(bool)
    x_bits = jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize])
    return jax.lax.bitcast_convert_type(x_bits | never.astype(x_bits.dtype), x.dtype)


_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _typed_for(token: jax.Array, x: jax.Array) -> jax.Array:
    """``token`` made equal (``pmax``) along the manual axes it varies along and ``x`` does not,
    so that what is computed from both keeps ``x``'s type."""
    extra = tuple(a for a in _compat.varying_axes(token) if a not in _compat.varying_axes(x))
    return jax.lax.pmax(token, extra) if extra else token

