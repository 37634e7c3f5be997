"""Shared test utilities: random per-device gradients and float64 references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jax_drain as jd


def random_tree(rng: np.random.Generator, template, leading: tuple[int, ...] = (), dtype=None):
    """Random normal leaves (never zeros/ones) shaped like ``template`` with extra leading dims."""
    return jax.tree.map(
        lambda t: jnp.asarray(
            rng.normal(size=leading + tuple(t.shape)) * rng.uniform(0.5, 3.0),
            dtype or t.dtype,
        ),
        template,
    )


def per_device_grads(rng: np.random.Generator, params, n: int):
    """Gradients stacked over a leading device axis of size ``n``, in the params' dtypes."""
    return random_tree(rng, params, leading=(n,))


def reference_shards(sync: jd.GradSync, stacked_grads, average: bool) -> list[np.ndarray]:
    """float64 sum (or mean) over devices of each bucket: the exact reduce-scatter result."""
    n = sync.axis_size
    buckets = [np.zeros(size, np.float64) for size in sync.bucket_sizes]
    leaves = jax.tree.leaves(stacked_grads)
    for slot in sync.layout.slots:
        total = np.asarray(leaves[slot.index], np.float64).reshape(n, -1).sum(axis=0)
        buckets[slot.bucket][slot.offset : slot.offset + slot.size] = total
    return [b / n if average else b for b in buckets]


def run_reduce_scatter(sync: jd.GradSync, stacked_grads, mesh: Mesh) -> list[np.ndarray]:
    """Runs ``sync.reduce_scatter`` under shard_map; returns each bucket's gathered shards."""

    def step(stacked):
        local = jax.tree.map(lambda g: g[0], stacked)
        return sync.reduce_scatter(local)

    fn = jax.jit(
        jd._compat.shard_map(step, mesh=mesh, in_specs=P(sync.axis), out_specs=P(sync.axis))
    )
    return [np.asarray(s) for s in fn(stacked_grads)]
