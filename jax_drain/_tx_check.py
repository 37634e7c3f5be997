"""What the two checks of a ``tx`` share: the flat-shard check (:func:`jax_drain.optimizer.check_transform`)
and the whole-parameter check (:func:`jax_drain.ownership.check_per_parameter`).

Each runs ``tx`` for a few steps on a small random copy of the parameters, once on the tree it is
written for and once the way the runtime would, and compares the updates leaf by leaf.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_drain.layout import BucketLayout

PyTree = Any

#: One gradient scale per step: thresholds such as a clip's get crossed.
CHECK_SCALES = (1e-2, 1.0, 1e2, 1e4)


def once_per_tx(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(tx, *keys)`` run once per ``tx`` object and ``keys`` (hashable: a treedef, shapes):
    an optax transform is a pair of pure functions, so its answer holds for a step built again
    (a restore, another mesh, a planner's search). An exception is not kept, so a refusal is
    raised again each time; a ``tx`` holding unhashable parts is run every time."""
    cached = functools.lru_cache(maxsize=64)(fn)

    @functools.wraps(fn)
    def call(tx: optax.GradientTransformation, *keys: Any) -> Any:
        try:
            hash(tx)
        except TypeError:
            return fn(tx, *keys)
        return cached(tx, *keys)

    return call


def random_steps(abstract: PyTree) -> tuple[PyTree, list[PyTree]]:
    """A start tree and one gradient tree per :data:`CHECK_SCALES` entry, shaped like ``abstract``
    (random float32 values from a fixed seed, each leaf at its own scale)."""
    rng = np.random.default_rng(0)
    make = lambda scale: jax.tree.map(  # noqa: E731
        lambda s: np.asarray(rng.normal(size=s.shape) * scale * rng.uniform(0.5, 2.0), np.float32), abstract)
    return make(1.0), [make(scale) for scale in CHECK_SCALES]


def updates_on_tree(tx: optax.GradientTransformation, start: PyTree, grads: Sequence[PyTree], *,
                    compiled: bool = False) -> list[PyTree]:
    """Each step's updates of ``tx`` run on the parameter tree ``start``.

    Eagerly by default: on arrays this small, dispatching each operation costs less than
    compiling the steps, and the operations' executables are cached for the next check.
    ``compiled``: one compiled update for every step, for transforms with loops (Muon's
    Newton-Schulz ``fori_loop``), which compile afresh at each eager call."""
    update = jax.jit(tx.update) if compiled else tx.update
    tree = jax.tree.map(jnp.asarray, start)
    state, steps = tx.init(tree), []
    for g in grads:
        updates, state = update(jax.tree.map(jnp.asarray, g), state, tree)
        tree = optax.apply_updates(tree, updates)
        steps.append(updates)
    return steps


def host_unflatten(layout: BucketLayout, shards: Sequence[jax.Array]) -> PyTree:
    """The parameter tree from buckets given as ``[devices, shard]`` rows (``layout.unflatten``,
    on the host)."""
    buckets = [np.asarray(s).reshape(-1) for s in shards]
    leaves = [np.zeros((slot.size,), np.float32) for slot in layout.slots]
    for bucket, whole in zip(layout.buckets, buckets):
        for p in bucket.pieces:
            leaves[p.leaf][p.start:p.start + p.size] = whole[p.offset:p.offset + p.size]
    return jax.tree.unflatten(layout.treedef, [x.reshape(slot.shape) for x, slot in zip(leaves, layout.slots)])
