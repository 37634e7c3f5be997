"""What the two checks of a ``tx`` share: the flat-shard check (:func:`jax_drain.optimizer.check_transform`)
and the whole-parameter check (:func:`jax_drain.ownership.check_per_parameter`).

Each runs ``tx`` for a few steps on a small random copy of the parameters, once on the tree it is
written for and once the way the runtime would, and compares the updates leaf by leaf.

Each check comes in two halves, so that a train step can prepare it on a thread beside its own
compiles: preparing traces and compiles the check's programs and touches no device; the
:class:`Verdict` it returns runs them, on the thread that calls it. A program run from a
second thread while a multi-device program waits in a collective can deadlock XLA:CPU (its
devices' threads wait on each other until XLA ends the process after its rendezvous timeout),
so no check runs a program on a thread of its own.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Sequence

import jax
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


class Verdict:
    """A prepared check: calling it runs the check's compiled programs on the calling thread and
    raises ``ValueError`` if ``tx`` is refused. A pass is remembered (later calls return at
    once); a refusal is raised again at each call."""

    def __init__(self, run: Callable[[], None]):
        self._run, self._passed, self._lock = run, False, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            if not self._passed:
                self._run()
                self._passed = True


def compiled(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """``fn`` traced and lowered for ``args`` now; the returned call compiles it and runs it on
    ``args``, on the calling thread."""
    lowered = jax.jit(fn).lower(*args)
    return lambda: lowered.compile()(*args)


def updates_on_tree(tx: optax.GradientTransformation, start: PyTree, grads: Sequence[PyTree]) -> Callable[[], list]:
    """Each step's updates of ``tx`` run on the parameter tree ``start``: one program, compiled
    here, run by the returned call."""

    def steps(tree: PyTree, grads: list[PyTree]) -> list[PyTree]:
        state, out = tx.init(tree), []
        for g in grads:
            updates, state = tx.update(g, state, tree)
            tree = optax.apply_updates(tree, updates)
            out.append(updates)
        return out

    return compiled(steps, start, list(grads))


def host_unflatten(layout: BucketLayout, shards: Sequence[jax.Array]) -> PyTree:
    """The parameter tree from buckets given as ``[devices, shard]`` rows (``layout.unflatten``,
    on the host)."""
    buckets = [np.asarray(s).reshape(-1) for s in shards]
    leaves = [np.zeros((slot.size,), np.float32) for slot in layout.slots]
    for bucket, whole in zip(layout.buckets, buckets):
        for p in bucket.pieces:
            leaves[p.leaf][p.start:p.start + p.size] = whole[p.offset:p.offset + p.size]
    return jax.tree.unflatten(layout.treedef, [x.reshape(slot.shape) for x, slot in zip(leaves, layout.slots)])
