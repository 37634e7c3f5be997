"""Shared test utilities: random per-device gradients, per-leaf float64 references, and a
per-leaf comparison.

References are built from the leaves themselves (summed over devices in float64 numpy), never
laid out with the bucket layout under test. Library results are brought back to leaves through
the public API: the gathered shards of bucket ``k`` are the whole reduced bucket ``k`` and
``sync.unflatten`` gives the params-shaped tree. Comparisons are per leaf, so a small leaf (a
norm scale next to an embedding) is held to its own scale, not to its bucket's largest value.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
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


# -- tolerances derived from the computation ----------------------------------------------------

EPS32 = float(np.finfo(np.float32).eps)  # 2**-23; one float32 rounding moves a value by <= EPS32 / 2 of it


EPS_BF16 = float(jnp.finfo(jnp.bfloat16).eps)  # 2**-7; one bf16 rounding moves a value by <= EPS_BF16 / 2 of it


# Eight devices' terms added in float32 and the mean's division: the relative bound of every
# device sum the tests compare against float64, times the sum of |terms| per element.
DEVICE_SUM_RTOL = 9 * EPS32


def part_slices(parts, size: int) -> dict[str, slice]:
    """Consecutive slices of a flat bucket of ``size`` elements, one per ``(name, length, ...)``
    in ``parts``; a ``None`` length takes the rest."""
    out, start = {}, 0
    for name, length, *_ in parts:
        stop = size if length is None else start + length
        out[name] = slice(start, stop)
        start = stop
    return out


def rounding_bound(additions: int, scale, eps: float = EPS32):
    """How far two evaluations of one computation may drift apart by rounding alone.

    A float sum of ``n`` terms computed in any order is within ``(n - 1) * eps / 2`` of the
    sum of the terms' magnitudes from the exact sum, so two evaluations that add in different
    orders (another fusion, device count, thread split or micro-batching) differ by at most
    ``n * eps`` times it. A longer computation adds its steps' bounds: ``additions`` is the
    number of roundings on the longest chain from the inputs to the result (the contraction
    lengths along forward and backward, the examples summed, the devices and micro-batches),
    counted from the computation under test; ``scale`` the magnitude of what is added there
    (the result's own for sums of like-signed terms, the sum of ``|terms|`` where they cancel).
    A tolerance is this bound, never a number tuned until the test passes.
    """
    return additions * eps * np.asarray(scale, np.float64)


def typical_rounding(additions: int, scale, eps: float = EPS32):
    """How far rounding typically moves a computation of ``additions`` roundings: errors of
    random sign add like a random walk, ``sqrt(additions) * eps * scale`` (Higham, *Accuracy
    and Stability of Numerical Algorithms*, 2.8). For a quantity divided by a small number (a
    finite difference's step), where :func:`rounding_bound`'s worst case over a chain of
    thousands would exceed the quantity itself."""
    return np.sqrt(additions) * eps * np.asarray(scale, np.float64)


def assert_within_rounding(got, want, *, additions: int, scale=None, eps: float = EPS32,
                           what: str = "result") -> None:
    """Per leaf and element, ``|got - want| <= rounding_bound(additions, scale, eps)``.

    ``scale``: ``None`` is each leaf's own largest ``|want|`` (never its bucket's); a number; or a
    tree like ``want`` of per-element scales. Fails naming the worst leaves by path.
    """
    def bound(w, s):
        s = np.max(np.abs(w), initial=0.0) if s is None else s
        return rounding_bound(additions, s, eps)

    want_leaves = jax.tree.leaves(want)
    if scale is None or np.isscalar(scale):
        bounds = [bound(np.asarray(w, np.float64), scale) for w in want_leaves]
    else:
        bounds = [bound(None, s) for s in jax.tree.leaves(scale)]
    assert_within(got, want, jax.tree.unflatten(jax.tree.structure(want), bounds),
                  what=f"{what} ({additions} roundings of {eps:.2e})")


def assert_bf16_sum_close(got, ref, magnitude, *, roundings: int, what: str = "result") -> dict[str, float]:
    """A sum computed in bf16 against its exact (float64) value, per element: each of
    ``roundings`` roundings (the terms cast to bf16, each partial sum of a ring reduce-scatter,
    a mean's division) moves it by at most ``EPS_BF16 / 2`` of the sum of ``|terms|``
    (``magnitude``, a tree like ``ref``). Returns the per-leaf relative errors, to check that
    bf16 visibly rounded what it summed."""
    bound = jax.tree.map(lambda m: roundings * EPS_BF16 / 2 * np.asarray(m, np.float64), magnitude)
    assert_within(got, ref, bound, what=f"{what} ({roundings} bf16 roundings)")
    return leaf_errors(got, ref)


def assert_within(got, want, bound, *, what: str = "result") -> None:
    """Per leaf and element, ``|got - want| <= bound`` (a number or a tree like ``want``); fails
    naming the worst leaves by path, with the element, both values and its bound."""
    bounds = jax.tree.leaves(bound) if not np.isscalar(bound) else None
    failures = []
    for k, (path, g, w) in enumerate(_pairs(got, want)):
        b = np.broadcast_to(np.asarray(bound if bounds is None else bounds[k], np.float64), w.shape)
        diff = np.where(np.isfinite(g), np.abs(g - w), np.inf)
        excess = diff / np.maximum(b, np.finfo(np.float64).tiny)
        if excess.size and np.max(excess) > 1:
            at = np.unravel_index(np.argmax(excess), excess.shape)
            failures.append((float(excess[at]), f"{path} {tuple(w.shape)} element {tuple(int(i) for i in at)}: got "
                             f"{g[at]:.9g}, want {w[at]:.9g}, |diff| {diff[at]:.3e} > bound {b[at]:.3e}"))
    if failures:
        failures.sort(key=lambda f: -f[0])
        lines = "\n  ".join(msg for _, msg in failures[:8])
        raise AssertionError(f"{what}: {len(failures)} leaf/leaves beyond their bound, worst first:\n  {lines}")


_MOVES = frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice", "dynamic_slice",
    "dynamic_update_slice", "gather", "concatenate", "pad", "select_n", "convert_element_type", "copy", "copy_p",
    "rev", "iota", "stop_gradient", "optimization_barrier", "device_put", "sharding_constraint", "pvary", "pcast",
    "axis_index", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "argmax", "argmin", "sign", "abs", "neg",
    "max", "min", "floor", "ceil", "round", "is_finite", "random_bits", "random_wrap", "random_unwrap",
    "random_seed", "random_fold_in", "threefry2x32", "shift_right_logical", "shift_left", "bitcast_convert_type",
})


def rounding_chain(fn: Callable, *args) -> int:
    """The number of float roundings on the longest chain from ``fn``'s inputs to its outputs,
    counted on its traced jaxpr: a contraction or reduction of ``n`` terms adds ``n``, every
    other arithmetic operation one, data movement (reshapes, slices, casts, comparisons) none;
    a scan's body counts once per iteration. The ``additions`` of :func:`rounding_bound` for
    ``fn`` (add the devices and micro-batches a sync sums over)."""
    return _chain(jax.make_jaxpr(fn)(*args).jaxpr, None)


def _chain(jaxpr, inputs) -> int:
    depth = {}
    for var, d in zip(jaxpr.invars, inputs or [0] * len(jaxpr.invars)):
        depth[var] = d
    get = lambda v: depth.get(v, 0) if not hasattr(v, "val") else 0
    for eqn in jaxpr.eqns:
        start = max((get(v) for v in eqn.invars), default=0)
        name, params = eqn.primitive.name, eqn.params
        subs = [getattr(p, "jaxpr", p) for p in params.values() if hasattr(getattr(p, "jaxpr", p), "eqns")]
        subs += [getattr(b, "jaxpr", b) for b in params.get("branches", ())]
        if subs:  # calls, remat, custom derivatives, scan / while bodies, cond branches
            times = params.get("length", 1) if name == "scan" else 1
            cost = max(_chain(sub, None) for sub in subs) * times
        elif name == "dot_general":
            (lhs_contract, _), _ = params["dimension_numbers"]
            cost = int(np.prod([eqn.invars[0].aval.shape[d] for d in lhs_contract], dtype=np.int64))
        elif name in ("reduce_sum", "reduce_prod", "cumsum", "cumlogsumexp", "cumprod"):
            axes = params.get("axes", (params.get("axis", 0),))
            cost = int(np.prod([eqn.invars[0].aval.shape[a] for a in axes], dtype=np.int64))
        elif name in ("psum", "psum_scatter", "reduce_scatter", "all_to_all", "all_gather"):
            cost = 8  # at most the 8 test devices
        else:
            cost = 0 if name in _MOVES or name.startswith("reduce_") else 1
        for v in eqn.outvars:
            depth[v] = start + cost
    return max((get(v) for v in jaxpr.outvars), default=0)


def adam_rounding_bounds(gradients, *, additions: int, learning_rate: float, params=None, b1: float = 0.9,
                         b2: float = 0.999, eps: float = 1e-8, max_norm: float | None = None,
                         weight_decay: float = 0.0, rounding: float = EPS32, gradient_scales=None) -> list:
    """Per step and element, how far two AdamW runs may have moved apart after that step when
    each step's gradient is off by ``rounding_bound(additions, that leaf's largest |g|)``; to
    first order in the errors (:func:`adam_error_bounds`, at a constant ``learning_rate``).

    ``rounding``: the gradient's unit of error (float32's epsilon; ``1 / 127`` of a block's
    largest value for an int8 wire); ``gradient_scales``: per step, a tree of what that unit is
    relative to, instead of each leaf's largest ``|g|`` (e.g. the largest local gradient any
    device sends). Returns one tree per step.
    """
    errors = []
    for t, grads in enumerate(gradients):
        leaves, treedef = jax.tree.flatten(grads)
        scales = (jax.tree.leaves(gradient_scales[t]) if gradient_scales is not None
                  else [np.max(np.abs(np.asarray(g, np.float64)), initial=0.0) for g in leaves])
        errors.append(jax.tree.unflatten(treedef, [rounding_bound(additions, s, rounding) for s in scales]))
    return adam_error_bounds(gradients, errors, learning_rates=[learning_rate] * len(errors), params=params,
                             b1=b1, b2=b2, eps=eps, max_norm=max_norm, weight_decay=weight_decay)


def adam_update_limit(t: int, b1: float, b2: float) -> float:
    """The largest ``|m_hat| / sqrt(v_hat)`` Adam's step ``t`` (from 1) can produce, whatever the
    gradients: ``m_t = (1 - b1) sum_s b1**(t-s) g_s`` and ``v_t = (1 - b2) sum_s b2**(t-s) g_s**2``, so
    by Cauchy-Schwarz ``|m_t| <= (1 - b1) sqrt(sum_k (b1**2 / b2)**k) sqrt(v_t / (1 - b2))`` (``k < t``);
    with the bias corrections ``1 - b1**t`` and ``1 - b2**t`` that is this number (1 at ``t = 1``,
    where the update is ``sign(g)``; about 1 for the first steps of any usual ``b1``, ``b2``).
    Two runs' updates therefore differ by at most twice it, however far apart their gradients."""
    weights = sum((b1 * b1 / b2) ** k for k in range(t))
    return (1 - b1) / np.sqrt(1 - b2) * np.sqrt(weights) * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)


def adam_error_bounds(gradients, errors, *, learning_rates: Sequence[float], params=None, b1: float = 0.9,
                      b2: float = 0.999, eps: float = 1e-8, max_norm: float | None = None,
                      weight_decay: float = 0.0) -> list:
    """Per step and element, how far two AdamW runs' parameters may have moved apart after that
    step when step ``t``'s gradient differs between them by at most ``errors[t]`` (a tree like the
    gradients of per-element bounds, or of per-leaf numbers); to first order in the errors,
    evaluated on the reference run's ``gradients`` (one tree per step, before ``max_norm``
    clipping). ``learning_rates[t]``: step ``t``'s (the schedule's value at count ``t``).

    Global-norm clipping multiplies a gradient by ``c = max_norm / |g|``; to first order that
    moves element ``i`` by ``c (delta_i + |g_i| |delta| / |g|)``, the second term being the norm's
    own change (Cauchy-Schwarz). The moments carry ``dm = b1 dm + (1 - b1) delta`` and ``dv = b2 dv
    + (1 - b2) 2 |g| delta``, and the update ``m_hat / (sqrt(v_hat) + eps)`` moves by its
    sensitivity ``dm_hat / (sqrt(v_hat) + eps) + |update| dv_hat / (2 sqrt(v_hat) (sqrt(v_hat) +
    eps))``. Adam divides by ``sqrt(v)``, so for a gradient near zero (or an error as large as
    the gradient) that first-order figure exceeds what two updates can differ by at all, twice
    :func:`adam_update_limit`: the smaller of the two is taken. The step moves the parameters'
    bound by its learning rate times that; decoupled weight decay carries the bound on (times
    ``1 + lr * weight_decay``), and the update adds its own few float32 roundings and the
    parameters' (``params``: their magnitudes) -- none on a step whose learning rate is 0, which
    leaves both runs' parameters exactly as they were. Returns one tree per step.

    Only the given gradient errors are propagated: a gradient computed at parameters that already
    differ also moves by the loss's curvature times that difference, which this does not bound.
    """
    trees = [jax.tree.map(lambda x: np.asarray(x, np.float64), g) for g in gradients]
    treedef = jax.tree.structure(trees[0])
    param_scales = ([np.abs(np.asarray(x, np.float64)) for x in jax.tree.leaves(params)] if params is not None
                    else [0.0] * treedef.num_leaves)
    m, v, dm, dv, bound = ([np.zeros_like(x) for x in jax.tree.leaves(trees[0])] for _ in range(5))
    out = []
    for t, (tree, error, lr) in enumerate(zip(trees, errors, learning_rates), 1):
        step = jax.tree.leaves(tree)
        delta = [np.broadcast_to(np.asarray(e, np.float64), g.shape) for e, g in zip(jax.tree.leaves(error), step)]
        norm = np.sqrt(sum(np.sum(g ** 2) for g in step))
        clipped = max_norm is not None and norm > max_norm
        clip = max_norm / norm if clipped else 1.0
        moved = np.sqrt(sum(np.sum(d ** 2) for d in delta)) / norm if clipped else 0.0
        limit = 2 * adam_update_limit(t, b1, b2)
        for i, (g, d) in enumerate(zip(step, delta)):
            d = clip * (d + np.abs(g) * moved)
            g = clip * g
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g ** 2
            dm[i] = b1 * dm[i] + (1 - b1) * d
            dv[i] = b2 * dv[i] + (1 - b2) * 2 * np.abs(g) * d
            m_hat, dm_hat = m[i] / (1 - b1 ** t), dm[i] / (1 - b1 ** t)
            v_hat, dv_hat = v[i] / (1 - b2 ** t), dv[i] / (1 - b2 ** t)
            root = np.sqrt(v_hat)
            update = np.abs(m_hat) / (root + eps)
            sensitivity = dm_hat / (root + eps) + update * dv_hat / np.maximum(2 * root * (root + eps), eps ** 2)
            if lr:
                own = rounding_bound(4, lr * update) + rounding_bound(2, param_scales[i])
                bound[i] = bound[i] * (1 + lr * weight_decay) + lr * np.minimum(sensitivity, limit) + own
        out.append(jax.tree.unflatten(treedef, [b.copy() for b in bound]))
    return out


def cast_error_bounds(bounds, values, dtype=jnp.bfloat16):
    """Per element, how far the casts to ``dtype`` of two values that differ by at most ``bounds``
    may differ (e.g. the bf16 working copies of float32 master parameters, ``values`` being one
    run's): each cast rounds to the nearest, so the two may land on opposite sides of a rounding
    boundary, ``bound`` plus one unit in the last place of ``dtype`` at ``|value| + bound``; and
    exactly 0 where ``bound`` is 0 (equal values cast equally)."""
    def one(b, x):
        b = np.asarray(b, np.float64)
        return np.where(b > 0, b + ulp(np.abs(np.asarray(x, np.float64)) + b, dtype), 0.0)

    return jax.tree.map(one, bounds, values)


def ulp(magnitude, dtype=jnp.bfloat16):
    """The spacing of ``dtype`` at ``magnitude`` (``>= 0``): ``eps * 2**floor(log2 magnitude)``,
    at least the smallest subnormal."""
    info = jnp.finfo(dtype)
    magnitude = np.asarray(magnitude, np.float64)
    _, exponent = np.frexp(magnitude)  # magnitude = f * 2**exponent, f in [0.5, 1)
    spacing = np.where(magnitude > 0, np.ldexp(float(info.eps), exponent - 1), 0.0)
    return np.maximum(spacing, float(info.smallest_subnormal))


def device_mean_errors(device_gradients, *, additions: int, dtype=None) -> list:
    """Per step and element, how far two evaluations of the mean over devices of their local
    gradients may differ (``device_gradients``: one tree per step, each leaf's leading axis the
    devices). Each device's backward rounds within ``rounding_bound(additions, its leaf's largest
    |g|)`` (``additions``: the local gradient's :func:`rounding_chain`); a gradient cast to
    ``dtype`` at the end (a bf16 working copy's) adds an ulp (:func:`cast_error_bounds`); the sum
    over the devices and the division add ``rounding_bound(devices + 1, mean |g|)``. Returns one
    tree per step (the device axis averaged out)."""
    def one(g):
        g = np.asarray(g, np.float64)
        devices = g.shape[0]
        largest = np.max(np.abs(g).reshape(devices, -1), axis=1).reshape((devices,) + (1,) * (g.ndim - 1))
        local = rounding_bound(additions, largest) * np.ones_like(g)
        if dtype is not None:
            local = np.asarray(cast_error_bounds(local, g, dtype))
        return local.mean(axis=0) + rounding_bound(devices + 1, np.abs(g).mean(axis=0))

    return [jax.tree.map(one, grads) for grads in device_gradients]


def quantized_wire_errors(device_gradients, *, qmax: float = 127.0, error_feedback: bool = True,
                          eps: float = EPS_BF16) -> list:
    """Per step and element, how far the mean over devices of what a quantized wire
    (``reduce="int8_accum"``) delivers may be from the mean of the gradients the devices meant to
    send; ``device_gradients``: one tree per step, each leaf's leading axis the devices, in the
    buckets' dtype (epsilon ``eps``).

    A device quantizes its bucket in blocks with scale ``absmax / qmax`` and rounds each element
    to the nearest step, moving it by at most half a step. A block never spans two leaves, so its
    ``absmax`` is at most the leaf's largest value on that device. Without error feedback a device
    sends ``Q(g)``, off by ``s / 2``. With it (:mod:`jax_drain.feedback`) it sends ``Q(b)`` for
    ``b = bf16(g + r)``, ``r`` the residual it kept from the previous step, and keeps
    ``r' = bf16(g + r - Q(b))``: what it sends is ``g + r - (g + r - Q(b))``, off from ``g`` by at
    most ``|r| + |g + r - Q(b)|``, where ``|g + r - Q(b)| <= (eps / 2 + EPS32) (|g| + |r|) + s / 2``
    (``b``'s rounding, the float32 sums, the quantization, with ``s`` from ``max |b|``) and
    ``|r'|`` is that times ``1 + eps / 2``. Error feedback's gain is that these errors cancel from
    one step to the next in what the optimizer accumulates; a per-step bound cannot count on
    that, so it is the larger one. Returns one tree per step (the device axis averaged out).
    """
    out, residual = [], None
    for grads in device_gradients:
        grads = jax.tree.map(lambda g: np.abs(np.asarray(g, np.float64)), grads)
        kept = residual if error_feedback and residual is not None else jax.tree.map(np.zeros_like, grads)

        def rounded(g, r):  # |g + r - Q(bf16(g + r))| per device and element (|g - Q(g)| without feedback)
            largest = np.max((g + r).reshape(g.shape[0], -1), axis=1).reshape((-1,) + (1,) * (g.ndim - 1))
            if not error_feedback:
                return largest / qmax / 2
            return (eps / 2 + EPS32) * (g + r) + largest * (1 + eps / 2) / qmax / 2

        off = jax.tree.map(rounded, grads, kept)
        out.append(jax.tree.map(lambda r, o: np.mean(r + o, axis=0), kept, off))
        residual = jax.tree.map(lambda o: o * (1 + eps / 2), off)
    return out


def sgd_rounding_bounds(gradients, *, additions: int, learning_rate: float, momentum: float = 0.0,
                        nesterov: bool = False, params=None, max_norm: float | None = None) -> list:
    """Per step and element, how far two SGD runs (heavy-ball or Nesterov momentum) may have
    moved apart after that step when each step's gradient is off by ``rounding_bound(additions,
    that leaf's largest |g|)``: the update is linear in the gradient, so its errors add up
    through the momentum buffer (Nesterov's update is the gradient plus ``momentum`` times the
    new buffer, so it carries both); plus the parameters' (``params``) own roundings.
    ``gradients``: the reference run's, one tree per step, before ``max_norm`` clipping."""
    trees = [jax.tree.map(lambda x: np.asarray(x, np.float64), g) for g in gradients]
    treedef = jax.tree.structure(trees[0])
    scales = ([np.abs(np.asarray(x, np.float64)) for x in jax.tree.leaves(params)] if params is not None
              else [0.0] * treedef.num_leaves)
    buffer, bound = ([np.zeros_like(x) for x in jax.tree.leaves(trees[0])] for _ in range(2))
    out = []
    for tree in trees:
        step = jax.tree.leaves(tree)
        norm = np.sqrt(sum(np.sum(x ** 2) for x in step))
        clip = 1.0 if max_norm is None or norm <= max_norm else max_norm / norm
        for i, g in enumerate(step):
            error = clip * rounding_bound(additions, np.max(np.abs(g), initial=0.0))
            buffer[i] = momentum * buffer[i] + error
            update = error + momentum * buffer[i] if nesterov else buffer[i]
            bound[i] = bound[i] + learning_rate * update + rounding_bound(2, scales[i])
        out.append(jax.tree.unflatten(treedef, [b.copy() for b in bound]))
    return out


def train_on(step, batches, state=None):
    """``step`` run over ``batches`` from ``state`` (``step.init()`` if ``None``), none of its
    steps skipped; the state after the last."""
    state = step.init() if state is None else state
    for batch in batches:
        state, metrics = step(state, batch)
        assert not bool(metrics.skipped)
    return state


def reference_run(loss_fn: Callable, params, tx, batches) -> tuple:
    """Plain optax on one device over whole ``batches``: the final params, and each step's loss
    and gradient (the trajectory bounds' inputs)."""
    state, losses, gradients = tx.init(params), [], []
    step = jax.jit(jax.value_and_grad(loss_fn))
    # One program per update, not one per operation: an eager optax update compiles each of
    # its operations apart, which costs more than the whole test's steps.
    update = jax.jit(lambda g, s, p: _applied(tx, g, s, p))
    for batch in batches:
        loss, grads = step(params, batch)
        params, state = update(grads, state, params)
        losses.append(float(loss))
        gradients.append(grads)
    return params, losses, gradients


def _applied(tx, grads, state, params) -> tuple:
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def loss_rounding_bounds(losses, gradients, param_bounds, *, additions: int, eps: float = EPS32,
                         failure: float | None = None) -> np.ndarray:
    """Per step, how far two runs' reported losses may differ: step ``t``'s loss is computed on
    the parameters after step ``t - 1``, which differ by ``param_bounds[t - 1]`` (e.g. from
    :func:`adam_rounding_bounds`) and move the loss by at most ``sum(|g_t| * bound)`` to first
    order, plus the loss's own ``additions`` roundings. ``losses`` and ``gradients`` (one tree
    per step) come from the reference run.

    ``failure``: where that worst case (every element's difference of the sign that moves the
    loss most) is larger than what the test must tell apart, the elements' differences taken as
    independent and of random sign instead: :func:`random_sign_bound` of the terms, exceeded with
    probability at most ``failure``.
    """
    out = []
    for t, (loss, grads) in enumerate(zip(losses, gradients)):
        terms = [] if t == 0 else [np.abs(np.asarray(g, np.float64)) * b
                                   for g, b in zip(jax.tree.leaves(grads), jax.tree.leaves(param_bounds[t - 1]))]
        carried = (sum(float(np.sum(x)) for x in terms) if failure is None
                   else random_sign_bound(terms, failure=failure))
        out.append(carried + float(rounding_bound(additions, abs(float(loss)), eps)))
    return np.asarray(out)


def random_sign_bound(magnitudes, *, failure: float = 1e-6) -> float:
    """How large a sum of independent, zero-mean terms, term ``i`` at most ``magnitudes[i]`` in size
    (a tree or list of arrays), can be except with probability ``failure``: Hoeffding's inequality,
    ``P(|sum X_i| >= t) <= 2 exp(-t**2 / (2 sum a_i**2))``, solved for ``t``. Rounding and
    quantization errors of many elements are the usual such terms (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 2.8): their sum grows like the square root of their
    count, where the worst case (:func:`rounding_bound`) grows like the count."""
    squares = sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a in jax.tree.leaves(magnitudes))
    return float(np.sqrt(2 * np.log(2 / failure) * squares))


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


def remat_block_stack(layers: int, d: int, tokens: int):
    """``(params, batch, loss)`` of a bf16 stack of ``layers`` remat MLP blocks of width ``d``
    (abstract, ``tokens`` rows in the batch): the compile-only GPU tests' model, large enough
    for XLA to schedule it like a real one."""
    params = {f"layer{i}": {"w1": jax.ShapeDtypeStruct((d, 4 * d), jnp.bfloat16),
                            "w2": jax.ShapeDtypeStruct((4 * d, d), jnp.bfloat16)} for i in range(layers)}

    def loss(p, x):
        block = jax.checkpoint(lambda h, q: h + jnp.tanh(h @ q["w1"]) @ q["w2"])
        h = x
        for i in range(layers):
            h = block(h, p[f"layer{i}"])
        return jnp.mean(h.astype(jnp.float32) ** 2)

    return params, jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16), loss


BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (registered in ``sys.modules`` first, so that its
    dataclasses and pickled rows resolve)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
