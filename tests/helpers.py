"""Shared test utilities: random per-device gradients, per-leaf float64 references, and a
per-leaf comparison.

References are built from the leaves themselves (summed over devices in float64 numpy), never
laid out with the bucket layout under test. Library results are brought back to leaves through
the public API: the gathered shards of bucket ``k`` are the whole reduced bucket ``k`` and
``sync.unflatten`` gives the params-shaped tree. Comparisons are per leaf, so a small leaf (a
norm scale next to an embedding) is held to its own scale, not to its bucket's largest value.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jax_drain as jd
from jax_drain.layout import leaf_paths


def random_tree(
    rng: np.random.Generator,
    template,
    leading: tuple[int, ...] = (),
    dtype=None,
    scale: Callable[[str], float] | None = None,
):
    """Random normal leaves (never zeros/ones) shaped like ``template`` with extra leading dims.

    Each leaf gets its own random factor in [0.5, 3); ``scale(path)`` multiplies it further, to
    put leaves of very different magnitudes (1e-3 next to 1) in one tree.
    """
    leaves, treedef = jax.tree.flatten(template)
    paths = leaf_paths(template)
    out = []
    for path, t in zip(paths, leaves):
        values = rng.normal(size=leading + tuple(t.shape)) * rng.uniform(0.5, 3.0)
        if scale is not None:
            values = values * scale(path)
        out.append(jnp.asarray(values, dtype or t.dtype))
    return jax.tree.unflatten(treedef, out)


def per_device_grads(rng: np.random.Generator, params, n: int, scale: Callable[[str], float] | None = None):
    """Gradients stacked over a leading device axis of size ``n``, in the params' dtypes."""
    return random_tree(rng, params, leading=(n,), scale=scale)


def scale_by(scales: dict[str, float]) -> Callable[[str], float]:
    """``path -> scale``: the value of the first key of ``scales`` contained in the path, else 1."""
    return lambda path: next((s for key, s in scales.items() if key in path), 1.0)


# -- float64 references, per leaf ---------------------------------------------------------------

def device_sum(stacked, axes: Sequence[int] = (0,), divisor: float = 1.0, absolute: bool = False):
    """float64 sum over the device axes ``axes`` of every leaf, divided by ``divisor``.

    ``absolute=True`` sums ``|g|`` instead: the magnitude a float32 sum's rounding error scales
    with (the bound for elements whose sum cancels to near zero).
    """
    def reduce(g):
        g = np.asarray(g, np.float64)
        return (np.abs(g) if absolute else g).sum(axis=tuple(axes)) / divisor

    return jax.tree.map(reduce, stacked)


def leaves_of(sync, buckets) -> object:
    """The params-shaped float64 tree of whole reduced buckets (``sync.unflatten``): the public
    way from the gathered shards back to leaves."""
    return jax.tree.map(lambda a: np.asarray(a, np.float64), sync.unflatten(buckets))


def assert_padding_zero(layout, buckets, what: str = "result") -> None:
    """Every bucket's padding (after its ``num_elements`` used elements) is exactly zero."""
    for bucket, array in zip(layout.buckets, buckets):
        pad = np.asarray(array)[..., bucket.num_elements:]
        assert not np.any(pad), f"{what}: bucket {bucket.index} has non-zero padding {pad[pad != 0][:4]}"


# -- per-leaf comparison ------------------------------------------------------------------------

def leaf_errors(got, ref) -> dict[str, float]:
    """``||got - ref|| / ||ref||`` per leaf path (``inf`` if ``ref`` is zero and ``got`` is not)."""
    out = {}
    for path, g, r in _pairs(got, ref):
        diff, norm = np.linalg.norm(g - r), np.linalg.norm(r)
        out[path] = diff / norm if norm else (0.0 if diff == 0 else np.inf)
    return out


def assert_tree_close(got, ref, rtol: float, atol=None, what: str = "result") -> dict[str, float]:
    """Per leaf: the same shape, ``||got - ref|| / ||ref|| <= rtol``, and per element
    ``|got - ref| <= atol + rtol * |ref|``.

    ``atol``: ``None`` is ``rtol`` times the leaf's own largest ``|ref|`` (the leaf's scale, never
    its bucket's); a float; or a tree like ``ref`` of per-element bounds (e.g. ``rtol`` times
    the sum of ``|g|`` over devices, for sums that cancel to near zero). Fails naming the worst
    leaves by path; returns the per-leaf relative errors.
    """
    atols = jax.tree.leaves(atol) if atol is not None and not np.isscalar(atol) else None
    errors, failures = {}, []
    for k, (path, g, r) in enumerate(_pairs(got, ref)):
        if not np.all(np.isfinite(g)):
            failures.append((np.inf, f"{path}: non-finite values"))
            continue
        diff, norm = np.abs(g - r), np.linalg.norm(r)
        rel = np.linalg.norm(diff) / norm if norm else (0.0 if not np.any(diff) else np.inf)
        errors[path] = rel
        if atols is not None:
            bound = np.asarray(atols[k], np.float64) + rtol * np.abs(r)
        else:
            a = rtol * np.max(np.abs(r), initial=0.0) if atol is None else float(atol)
            bound = a + rtol * np.abs(r)
        excess = diff / np.where(bound > 0, bound, np.finfo(np.float64).tiny)
        worst = np.unravel_index(np.argmax(excess), excess.shape) if excess.size else None
        over = worst is not None and excess[worst] > 1
        if rel > rtol or over:
            msg = f"{path} {tuple(r.shape)}: ||got-ref||/||ref|| = {rel:.3e} (rtol {rtol:.0e})"
            if over:
                at = tuple(int(i) for i in worst)
                msg += (f"; element {at}: got {g[at]:.9g}, ref {r[at]:.9g}, |diff| {diff[at]:.3e} "
                        f"> bound {bound[at]:.3e}")
            failures.append((max(rel / rtol, float(excess[worst]) if over else 0.0), msg))
    if failures:
        failures.sort(key=lambda f: -f[0])
        lines = "\n  ".join(msg for _, msg in failures[:8])
        raise AssertionError(f"{what}: {len(failures)} leaf/leaves out of tolerance, worst first:\n  {lines}")
    return errors


def _pairs(got, ref):
    """(path, got, ref) per leaf as float64 arrays, after checking structures and shapes agree."""
    got_leaves, got_def = jax.tree.flatten(got)
    ref_leaves, ref_def = jax.tree.flatten(ref)
    assert got_def == ref_def, f"tree structures differ:\n  got {got_def}\n  ref {ref_def}"
    for path, g, r in zip(leaf_paths(ref), got_leaves, ref_leaves):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert g.shape == r.shape, f"{path}: shape {g.shape}, reference {r.shape}"
        yield path, g, r


# -- running the sync ---------------------------------------------------------------------------

def run_reduce_scatter(sync: jd.GradSync, stacked_grads, mesh: Mesh) -> list[np.ndarray]:
    """Runs ``sync.reduce_scatter`` under shard_map; returns each bucket's gathered shards
    (device r's shard at elements ``[r * n, (r + 1) * n)``: the whole reduced bucket)."""

    def step(stacked):
        local = jax.tree.map(lambda g: g[0], stacked)
        return sync.reduce_scatter(local)

    fn = jax.jit(
        jd._compat.shard_map(step, mesh=mesh, in_specs=P(sync.axis), out_specs=P(sync.axis))
    )
    return [np.asarray(s) for s in fn(stacked_grads)]
