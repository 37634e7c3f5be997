"""What the two checks of a ``tx`` share: the flat-shard check (:func:`jax_drain.optimizer.check_transform`)
and the whole-parameter check (:func:`jax_drain.ownership.check_per_parameter`).

Each runs ``tx`` for a few steps on a small random copy of the parameters, once on the tree it is
written for and once the way the runtime would, and compares the updates leaf by leaf.

Each check comes in two halves, so that a train step can prepare it on a thread beside its own
compiles: preparing traces and compiles the check's programs and runs nothing on a device; the
:class:`Verdict` it returns runs them, on the thread that calls it. Programs run from a second
thread while a multi-device program waits in a collective can deadlock XLA:CPU (a device's
launch waits for programs queued behind it, until XLA ends the process after its rendezvous
timeout), so no check runs a program on a thread of its own.
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


def stepped(init: Callable[[Any], Any], step: Callable[[Any, Any], tuple[Any, Any]], start: Any,
            grads: Sequence[Any]) -> Callable[[], list]:
    """A run of ``tx`` for the checks: ``carry = init(start)``, then ``updates, carry = step(carry,
    g)`` for each of ``grads``. Both are traced and compiled here, on any thread, with nothing
    run on a device; the returned call runs them on the calling thread and returns each step's
    updates. One program per function, not per step: a transform's loops (Muon's Newton-Schulz)
    compile once."""

    def strong_init(x: Any) -> Any:
        return _strong(init(x))

    def strong_step(carry: Any, g: Any) -> tuple[Any, Any]:
        updates, carry = step(carry, g)
        return updates, _strong(carry)  # the carry's types stay the init's, step after step

    init_lowered = jax.jit(strong_init).lower(start)
    init_program = init_lowered.compile()
    step_program = jax.jit(strong_step).lower(init_lowered.out_info, grads[0]).compile()

    def run() -> list:
        carry, out = init_program(start), []
        for g in grads:
            updates, carry = step_program(carry, g)
            out.append(updates)
        return out

    return run


def _strong(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.lax.convert_element_type(x, jax.numpy.result_type(x)), tree)


def updates_on_tree(tx: optax.GradientTransformation, start: PyTree, grads: Sequence[PyTree]) -> Callable[[], list]:
    """Each step's updates of ``tx`` run on the parameter tree ``start`` (:func:`stepped`)."""

    def step(carry: tuple[Any, PyTree], g: PyTree) -> tuple[PyTree, tuple[Any, PyTree]]:
        state, tree = carry
        updates, state = tx.update(g, state, tree)
        return updates, (state, optax.apply_updates(tree, updates))

    return stepped(lambda tree: (tx.init(tree), tree), step, start, list(grads))


def first_difference(paths: Sequence[str], want: PyTree, got: PyTree, rtol: float) -> tuple | None:
    """``(path, want, got)`` of the first leaf whose updates differ by more than ``rtol`` of that
    leaf's largest update (float64 on the host), or ``None``."""
    for path, w, g in zip(paths, jax.tree.leaves(want), jax.tree.leaves(got)):
        w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
        if np.max(np.abs(g - w), initial=0.0) > rtol * np.max(np.abs(w), initial=0.0) + 1e-30:
            return path, w, g
    return None


def host_unflatten(layout: BucketLayout, shards: Sequence[jax.Array]) -> PyTree:
    """The parameter tree from buckets given as ``[devices, shard]`` rows (``layout.unflatten``,
    on the host)."""
    buckets = [np.asarray(s).reshape(-1) for s in shards]
    leaves = [np.zeros((slot.size,), np.float32) for slot in layout.slots]
    for bucket, whole in zip(layout.buckets, buckets):
        for p in bucket.pieces:
            leaves[p.leaf][p.start:p.start + p.size] = whole[p.offset:p.offset + p.size]
    return jax.tree.unflatten(layout.treedef, [x.reshape(slot.shape) for x, slot in zip(leaves, layout.slots)])
