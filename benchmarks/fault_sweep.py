"""A fault sweep of jax_drain: bad inputs and faults against every public entry, each result
checked against a reference, every case classified.

What is swept (``--list`` prints every case): the arguments of every public entry
(``make_train_step``, every ``TrainConfig`` field, ``TrainStep`` and its methods, ``GradSync``,
``ScanGradSync``, ``DistributedOptimizer``, ``masked`` / ``clip_by_global_norm`` / ``adamw``, the
checkpoint functions), each given a list of bad values of many types and a few edge values of its
own; trees of odd shapes (empty, one scalar leaf, nested lists and tuples with ``None``, huge and
tiny leaves, leaves of size 0, non-contiguous arrays, colliding paths...); odd meshes (1, 3, 5,
6, 7 devices, two axes, the data axis missing or renamed, ``Explicit`` axes...); NaN, inf and
overflow in gradients and parameters in float32, bfloat16 and float16; optax transforms
(element-wise ones must train like one-device optax, the others must be refused); checkpoint
files damaged in every file type a saved step holds (truncated, deleted, bytes flipped, emptied,
replaced by another step's file); concurrent saves from threads; saves interrupted by killing the
process that writes them.

Categories (each case gets exactly one):

* ``correct``: it ran, and the result equals the reference within a bound derived from rounding:
  one-device optax for training (float32 master weights, the gradient of the whole batch at the
  working dtype, a step skipped exactly where that gradient is not finite), float64 numpy for the
  syncs, the saved values (bit for bit) for checkpoints.
* ``clear_error``: a Python exception that says what the user did: raised by a ``raise`` statement
  in jax_drain's own code, or in the user's own function (a loss or transform of this file, named
  ``user_*``), or a ``ValueError`` / ``TypeError`` / ``KeyError`` / file error whose message names the
  argument of the case (as a word, not inside a path) or the user's function.
* ``silent``: it ran without an error, but the result is wrong: outside the bound, a step lost
  (skipped where one device is finite), a save that returned but is not what is restored.
* ``crash``: the process died: a signal, or an exit without a Python exception.
* ``hang``: no result within the case's timeout (the process is killed).
* ``obscure_error``: any other exception, from deep inside JAX, orbax or numpy, that does not say
  what the user did.
* ``sweep_error``: this file's own code failed (a bug here, not in jax_drain); should be 0.

Bounds (the tests' rule, ``tests/helpers.py``): a training result is compared per element with
``|got - want| <= bound``; the bound is how far one-device optax itself moves when each step's
gradient is moved by its rounding bound, ``rounding_bound(additions, scale, eps)``, in either
direction (every corner of that box, one run each: exact at first order for element-wise
transforms), plus the master update's own roundings. ``additions``: the rounding chain of the
loss's gradient (``rounding_chain``), the devices and micro-batches summed, the mean's division;
``scale``: per leaf, the mean over devices of the largest local gradient element (what a wire's
per-block scale and a cancelling sum are relative to); ``eps``: the coarsest unit in the step
(float32, the parameter or working dtype, the wire: ``1/127`` for int8, ``2**-3`` for fp8).

How it runs: cases are batched into worker processes (``--jobs`` at once); each worker reports
each case as it starts and ends, so a worker that dies or stops answering (``--timeout``) costs
only the case it was on, classified ``crash`` or ``hang``, and a new worker takes the rest. A
concurrent-save case whose threads have not finished 30 s on is a ``hang`` too; its worker then
exits, so that the threads it leaves behind cannot block the cases after it.

Run (from the repository root; ~25 min on 2 cores, ~15 with ``--jobs 2``)::

    nice -n 10 python benchmarks/fault_sweep.py                  # every case; writes benchmarks/results/
    nice -n 10 python benchmarks/fault_sweep.py --quick          # every 10th case of each area
    nice -n 10 python benchmarks/fault_sweep.py --area checkpoint --jobs 2
    python benchmarks/fault_sweep.py --list                      # the cases, nothing run
    python benchmarks/fault_sweep.py --case 'checkpoint/save_checkpoint(max_to_keep=0)'   # one case

Writes ``benchmarks/results/fault_sweep.json`` (every case: area, name, category, expected,
message excerpt, seconds) and ``benchmarks/results/fault_sweep.md`` (counts per area and
category, and every case that is neither ``correct`` nor ``clear_error``, with a reproduction).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import pathlib
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
DEVICES = 8  # virtual CPU devices in every worker
CATEGORIES = ("correct", "clear_error", "silent", "crash", "hang", "obscure_error", "sweep_error")
BAD = ("silent", "crash", "hang", "obscure_error", "sweep_error")

# Set by load_jax() in a worker; the parent never imports jax.
jax = jnp = optax = jd = nnx = P = Mesh = None


def load_jax() -> None:
    """Imports jax and jax_drain (this checkout's) with DEVICES virtual CPU devices."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    import jax_drain  # first: keeps the CUDA plugin's start-up lines off stderr
    import jax as jax_
    import jax.numpy as jnp_
    import optax as optax_
    from flax import nnx as nnx_
    from jax.sharding import Mesh as Mesh_, PartitionSpec as P_

    globals().update(jax=jax_, jnp=jnp_, optax=optax_, jd=jax_drain, nnx=nnx_, P=P_, Mesh=Mesh_)


# -- cases ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One fault: ``fn(*args)`` returns ``(category, message)`` or raises :class:`Verdict`.

    ``keywords``: what a clear error message may name (the argument, leaf or file);
    ``expect``: ``"works"`` (a valid input: a refusal is listed as over-cautious), ``"refuse"``
    or ``"either"``; ``repro``: one line that reproduces it; ``timeout``: instead of ``--timeout``.
    """

    area: str
    name: str
    fn: Callable[..., tuple[str, str]]
    args: tuple = ()
    keywords: tuple[str, ...] = ()
    expect: str = "either"
    repro: str = ""
    timeout: float | None = None
    isolated: bool = False  # a worker of its own: it may leave threads behind

    @property
    def id(self) -> str:
        return f"{self.area}/{self.name}"


class Verdict(Exception):
    """A case's classification, raised from anywhere inside it."""

    def __init__(self, category: str, message: str):
        super().__init__(message)
        self.category, self.message = category, message


_current_keywords: tuple[str, ...] = ()


@contextlib.contextmanager
def acting(*extra: str):
    """Calls into jax_drain: an exception raised inside is classified (clear or obscure)."""
    try:
        yield
    except Verdict:
        raise
    except Exception as error:  # noqa: BLE001 - every library exception is classified
        raise Verdict(*classify(error, _current_keywords + extra)) from error


def classify(error: BaseException, keywords: tuple[str, ...]) -> tuple[str, str]:
    """``clear_error`` or ``obscure_error`` for an exception the library raised (see the docstring)."""
    text = f"{type(error).__name__}: {error}"
    frames = traceback.extract_tb(error.__traceback__)
    last = frames[-1] if frames else None
    where = f"{pathlib.Path(last.filename).name}:{last.lineno} in {last.name}" if last else "?"
    if last is not None and _in_jax_drain(last.filename) and (last.line or "").lstrip().startswith("raise "):
        return "clear_error", text
    if last is not None and last.name.startswith("user_"):
        return "clear_error", f"raised in the user's own {last.name}: {text}"
    message = str(error)
    if isinstance(error, ARGUMENT_ERRORS) and (re.search(r"\buser_\w+\(\)", message) or any(
            re.search(rf"(?<![\w./-]){re.escape(k)}(?![\w/-])", message, re.IGNORECASE) for k in keywords if k)):
        return "clear_error", text
    return "obscure_error", f"{text} [raised at {where}]"


# Exceptions that may name the argument at fault; an AttributeError or IndexError never says what the user did.
ARGUMENT_ERRORS = (ValueError, TypeError, KeyError, FileNotFoundError, FileExistsError, NotADirectoryError,
                   IsADirectoryError)


def _in_jax_drain(filename: str) -> bool:
    return os.path.realpath(filename).startswith(str(REPO / "jax_drain") + os.sep)


# -- bad values: many types, made in the worker --------------------------------------------------

GENERIC: dict[str, Callable[[], Any]] = {
    "None": lambda: None,
    "True": lambda: True,
    "0": lambda: 0,
    "-1": lambda: -1,
    "1.5": lambda: 1.5,
    "nan": lambda: float("nan"),
    "inf": lambda: float("inf"),
    "'bogus'": lambda: "bogus",
    "''": lambda: "",
    "[1, 2]": lambda: [1, 2],
    "{'a': 1}": lambda: {"a": 1},
    "object()": lambda: object(),
    "np.ones(3)": lambda: np.ones(3),
    "2**63": lambda: 2**63,
}


def values(edges: dict[str, Callable[[], Any]] | None = None, generic: bool = True) -> dict[str, Callable[[], Any]]:
    """The generic bad values and an argument's own edge values (the edges win on a label clash)."""
    return {**(GENERIC if generic else {}), **(edges or {})}


def dtype(name: str) -> Callable[[], Any]:
    return lambda: jnp.dtype(name)


# -- the toy problems ----------------------------------------------------------------------------

D_IN, D_OUT, STEPS = 6, 3, 2


def base_params(dtype_name: str = "float32", seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.normal(size=(D_IN, D_OUT)) * 0.5, dtype_name),
            "b": jnp.asarray(rng.normal(size=(D_OUT,)) * 0.1, dtype_name)}


def make_batches(examples: int, steps: int = STEPS, seed: int = 1, features: int = D_IN, same: bool = False) -> list:
    """``steps`` global batches of ``examples``; ``same``: every example identical."""
    out = []
    for t in range(steps):
        rng = np.random.default_rng([seed, t])
        x = rng.normal(size=(1 if same else examples, features)).astype(np.float32)
        y = rng.normal(size=(1 if same else examples, D_OUT)).astype(np.float32)
        if same:
            x, y = np.repeat(x, examples, 0), np.repeat(y, examples, 0)
        out.append({"x": x, "y": y})
    return out


def user_loss(p, batch, scale=1.0, constant=0.0):
    """The user's loss: mean squared error of a linear layer at the parameters' dtype."""
    w, b = p["w"], p["b"]
    err = batch["x"].astype(w.dtype) @ w + b - batch["y"].astype(w.dtype)
    return scale * jnp.mean(jnp.square(err.astype(jnp.float32))) + jax.lax.stop_gradient(constant)


def user_tree_loss(p, batch):
    """A loss of any pytree: every leaf's elements enter through ``sin``; a loss of the batch too."""
    # One concatenation, not a Python sum over leaves: XLA's CPU compile of a chain of 300 scalar sums
    # and its gradient grows quadratically (a plain jit of it with optax took longer than the step).
    leaves = [leaf.astype(jnp.float32).ravel() for leaf in jax.tree.leaves(p)]
    total = jnp.sum(jnp.sin(jnp.concatenate(leaves))) if leaves else jnp.zeros(())
    x = batch["x"]
    return jnp.mean(x[:, 0] * total + x[:, 1] * jnp.square(total) + jnp.square(x[:, 2]))


SCAN_L, SCAN_D = 3, 4


def scan_params(seed: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    return {"blocks": {"w": jnp.asarray(rng.normal(size=(SCAN_L, SCAN_D, SCAN_D)) * 0.4, jnp.float32),
                       "b": jnp.asarray(rng.normal(size=(SCAN_L, SCAN_D)) * 0.1, jnp.float32)},
            "head": jnp.asarray(rng.normal(size=(SCAN_D, D_OUT)) * 0.5, jnp.float32)}


def user_scan_loss(p, batch, scale=1.0, constant=0.0):
    """A scanned layer stack (``jax.lax.scan`` over stacked blocks) and a head."""
    h, _ = jax.lax.scan(lambda h, blk: (jnp.tanh(h @ blk["w"] + blk["b"]), None), batch["x"][:, :SCAN_D], p["blocks"])
    return scale * jnp.mean(jnp.square(h @ p["head"] - batch["y"])) + jax.lax.stop_gradient(constant)


class UserMLP:
    """An nnx model (made in the worker: nnx is imported there)."""

    @staticmethod
    def make(seed: int = 0):
        class MLP(nnx.Module):
            def __init__(self, rngs):
                self.lin = nnx.Linear(D_IN, D_OUT, rngs=rngs)

            def __call__(self, x):
                return self.lin(x)

        return MLP(nnx.Rngs(seed))


def user_nnx_loss(model, batch):
    return jnp.mean(jnp.square(model(batch["x"]) - batch["y"]))


def data_mesh(n: int = DEVICES, name: str = "data"):
    return Mesh(np.array(jax.devices()[:n]), (name,))


def base_config(**overrides):
    return jd.TrainConfig(**{"bucket_size": 8, **overrides})


def host(tree):
    return jax.tree.map(lambda x: np.array(x), jax.device_get(tree))


def leaf_names(tree) -> list[str]:
    from jax_drain.layout import leaf_paths

    return leaf_paths(tree)


# -- references and bounds -----------------------------------------------------------------------

WIRE_EPS = {"bf16": 2.0**-7, "int8_accum": 1 / 127, "int8_accum_streamed": 1 / 127, "fp8_accum": 2.0**-3}
EPS32 = 2.0**-23


def eps_of(d: Any) -> float:
    """The machine epsilon of a floating dtype; 0 for anything else (what the library ignored)."""
    try:
        d = jnp.dtype(d)
    except TypeError:
        return 0.0
    return float(jnp.finfo(d).eps) if jnp.issubdtype(d, jnp.floating) else 0.0


def step_eps(config, params) -> float:
    """The coarsest rounding unit of a train step (see the module docstring)."""
    units = [EPS32] + [eps_of(x.dtype) for x in jax.tree.leaves(params)]
    units.append(WIRE_EPS.get(config.reduce, 0.0) if isinstance(config.reduce, str) else 0.0)
    units += [eps_of(d) for d in (config.wire_dtype, config.param_dtype) if d is not None]
    if int(config.microbatches) > 1 and config.accum_dtype is not None:
        units.append(eps_of(config.accum_dtype))
    return max(units) * (2 if config.error_feedback else 1)


def rounding_bound(additions: int, scale, eps: float):
    from helpers import rounding_bound as bound  # tests/helpers.py: the tests' own rule

    return bound(additions, scale, eps)


@dataclasses.dataclass
class Reference:
    params: list  # final float32 master leaves, as float64
    bound: list  # per element
    skipped: list


def loss_source(params, loss, batches, shares: int, working: Any = None):
    """``grad_at(master, t)``, ``scales_at(master, t)`` and the gradient's rounding chain for a
    loss on one device over whole batches, the loss evaluated at the working dtype."""
    from helpers import rounding_chain

    leaves, treedef = jax.tree.flatten(params)
    dtypes = [working if working is not None else x.dtype for x in leaves]

    def at_working(master):
        return jax.tree.unflatten(treedef, [m.astype(d) for m, d in zip(jax.tree.leaves(master), dtypes)])

    def grad32(master, batch):
        grads = jax.grad(lambda w: loss(w, batch))(at_working(master))
        return jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    grad_fn = jax.jit(grad32)
    local_fn = jax.jit(jax.vmap(grad32, in_axes=(None, 0)))
    split = lambda b: jax.tree.map(lambda x: x.reshape(shares, x.shape[0] // shares, *x.shape[1:]), b)

    def scales_at(master, t):
        local = local_fn(master, split(batches[t]))
        return [float(np.mean(np.max(np.abs(np.asarray(g, np.float64)).reshape(shares, -1), axis=1)))
                if g.size else 0.0 for g in jax.tree.leaves(local)]

    master0 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    share = jax.tree.map(lambda x: x[: x.shape[0] // shares], batches[0])
    chain = rounding_chain(lambda m, b: jax.value_and_grad(lambda w: loss(w, b))(at_working(m)), master0, share)
    return (lambda master, t: grad_fn(master, batches[t])), scales_at, chain + shares + 2


def reference_train(params, tx, steps: int, grad_at, scales_at, *, eps: float, additions: int,
                    skip_nonfinite: bool = True, skip_above: float | None = None) -> Reference:
    """One-device optax on float32 master weights, a step skipped where its gradient is not
    finite (or its norm above ``skip_above``); the bound from runs with every step's gradient moved
    by ``rounding_bound(additions, scale, eps)`` either way (see the module docstring)."""
    master0 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    update = jax.jit(tx.update)
    as64 = lambda tree: [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]

    def run(plan=None, signs=None):
        master, state, made = master0, tx.init(master0), []
        for t in range(steps):
            g = grad_at(master, t)
            if plan is None:
                leaves = as64(g)
                finite = all(np.all(np.isfinite(x)) for x in leaves)
                norm = math.sqrt(sum(float(np.sum(x * x)) for x in leaves)) if finite else math.inf
                skip = (skip_nonfinite and not finite) or (skip_above is not None and norm > skip_above)
                delta = [rounding_bound(additions, s, eps) for s in scales_at(master, t)]
                made.append((skip, delta))
            else:
                skip, delta = plan[t]
                g = jax.tree.unflatten(jax.tree.structure(g), [
                    x + jnp.asarray(signs[t] * d, jnp.float32) for x, d in zip(jax.tree.leaves(g), delta)])
            if not skip:
                updates, state = update(g, state, master)
                master = optax.apply_updates(master, updates)
        return as64(master), made

    want, plan = run()
    spread = [np.zeros_like(w) for w in want]
    for signs in itertools.product((1.0, -1.0), repeat=steps):
        corner, _ = run(plan, signs)
        spread = [np.fmax(s, np.abs(c - w)) for s, c, w in zip(spread, corner, want)]
    own = [rounding_bound(4 * steps, np.abs(w), EPS32) for w in want]
    return Reference(want, [s + o for s, o in zip(spread, own)], [p[0] for p in plan])


def compare(got_leaves, want_leaves, bounds, paths, *, what: str = "params") -> tuple[str, str]:
    """``correct`` if every element is within its bound (non-finite exactly where the reference
    is), else ``silent`` naming the worst element."""
    worst, worst_text = 0.0, ""
    for path, g, w, b in zip(paths, got_leaves, want_leaves, bounds):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            return "silent", f"{what} {path}: shape {g.shape}, reference {w.shape}"
        finite = np.isfinite(w)
        if np.any(np.isfinite(g) != finite):
            at = tuple(int(i) for i in np.argwhere(np.isfinite(g) != finite)[0])
            return "silent", f"{what} {path}{list(at)}: got {g[at]!r}, reference {w[at]!r}"
        b = np.broadcast_to(np.asarray(b, np.float64), w.shape)
        ratio = np.where(finite, np.abs(g - w) / np.maximum(np.where(finite, b, 1.0), 1e-300), 0.0)
        if ratio.size and float(np.max(ratio)) > worst:
            at = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
            worst = float(ratio[at])
            worst_text = (f"{what} {path}{list(int(i) for i in at)}: got {g[at]:.9g}, want {w[at]:.9g}, "
                          f"|diff| {abs(g[at] - w[at]):.3g} > bound {b[at]:.3g}")
    if worst > 1:
        return "silent", worst_text
    return "correct", f"within the rounding bound (worst |diff|/bound {worst:.2g})"


def data_size(mesh, config) -> int:
    try:
        return math.prod(int(mesh.shape[a]) for a in config.data_axes)
    except Exception:  # noqa: BLE001 - a mesh the step will refuse
        return DEVICES


_EXAMPLE = object()  # train_check's default example_batch: the first batch


def train_check(model, tx, config, *, mesh=None, loss=user_loss, ref_params=None, ref_loss=None, ref_config=None,
                example_batch: Any = _EXAMPLE, mutable=(), batches=None, same: bool = False, steps: int = STEPS,
                mutate: Callable | None = None) -> tuple[str, str]:
    """Builds and runs a step (``acting``), then compares its master weights with one-device optax.

    ``model``: what ``make_train_step`` takes first; ``ref_params`` / ``ref_loss``: the same model
    as a params pytree and a loss of it for the reference (default: ``model`` and ``loss``);
    ``ref_config``: the config the reference follows where ``config`` is not a ``TrainConfig``;
    ``mutate(batches)`` edits the batches (e.g. a NaN in one device's share) before both runs.
    """
    mesh = data_mesh() if mesh is None else mesh
    ref_config = config if isinstance(config, jd.TrainConfig) else (ref_config or jd.TrainConfig())
    micro = _int_or(ref_config.microbatches, 1)
    size = data_size(mesh, ref_config)
    if batches is None:  # a micro-batch count too large for memory is refused before any batch is read
        batches = make_batches(2 * size * micro if micro <= 64 else 16, steps=steps, same=same)
        if mutate is not None:
            mutate(batches)
    with acting():
        step = jd.make_train_step(model, loss, tx, mesh, config, mutable=mutable,
                                  example_batch=batches[0] if example_batch is _EXAMPLE else example_batch)
        state = step.init()
        skipped = []
        for batch in batches:
            state, metrics = step(state, batch)
            skipped.append(bool(metrics.skipped))
        got = step.master_params(state)
    ref_params = model if ref_params is None else ref_params
    verdict = verify_training(got, skipped, ref_params, ref_loss or loss, tx, batches, size * micro, ref_config)
    if verdict[0] == "silent" and jax.tree.structure(state.params) == jax.tree.structure(got):
        own = verify_training(host(state.params), skipped, ref_params, ref_loss or loss, tx, batches, size * micro,
                              ref_config)
        if own[0] == "correct":
            return "silent", f"step.master_params(state) {verdict[1]} (the state's own params agree with optax)"
    return verdict


def verify_training(got, skipped, ref_params, ref_loss, tx, batches, shares: int, config) -> tuple[str, str]:
    """``got`` (master weights after ``batches``) and the skipped flags against one-device optax."""
    grad_at, scales_at, additions = loss_source(ref_params, ref_loss, batches, shares, config.param_dtype)
    ref = reference_train(ref_params, tx, len(batches), grad_at, scales_at, eps=step_eps(config, ref_params),
                          additions=additions, skip_nonfinite=bool(config.skip_nonfinite),
                          skip_above=config.skip_grad_norm_above)
    if skipped != ref.skipped:
        lost = [i for i, (a, b) in enumerate(zip(skipped, ref.skipped)) if a and not b]
        return "silent", (f"step(s) {lost} lost: skipped (reported only in metrics.skipped) where one-device "
                          "optax's gradient is finite" if lost else
                          f"skipped {skipped} but one device skips {ref.skipped}: a non-finite step applied")
    dtypes = [x.dtype for x in jax.tree.leaves(ref_params)]
    bounds = [b + rounding_bound(1, np.abs(w), eps_of(d)) for b, w, d in zip(ref.bound, ref.params, dtypes)]
    return compare(jax.tree.leaves(got), ref.params, bounds, leaf_names(ref_params))


def _int_or(value, default: int) -> int:
    try:
        return int(value)
    except Exception:  # noqa: BLE001
        return default


def stacked_grads(abstract, n: int, seed: int = 0):
    """Random per-device gradients ``[n, *shape]`` in each leaf's dtype (never zero)."""
    rng = np.random.default_rng(seed)

    def one(x):
        values_ = rng.normal(size=(n, *x.shape)) * rng.uniform(0.5, 3.0)
        return jnp.asarray(values_, x.dtype)

    return jax.tree.map(one, abstract)


def sync_eps(sync) -> float:
    wire = getattr(sync.chains[0], "wire_dtype", None)
    units = [EPS32, WIRE_EPS.get(sync.reduce, 0.0)] + ([eps_of(wire)] if wire is not None else [])
    if sync.reduce == "bf16":
        units.append(2.0**-7)
    return max(units)


def sync_check(sync, *, seed: int = 0, grads=None) -> tuple[str, str]:
    """``sync.reduce_scatter`` of random per-device gradients against their float64 mean (sum
    with ``average=False``); ``grads`` (stacked ``[n, ...]``) replaces the random ones."""
    if any(spec != P() and spec is not None and any(e is not None for e in spec)
           for spec in jax.tree.leaves(sync.param_specs, is_leaf=lambda x: isinstance(x, type(P())))):
        return "sweep_error", "sync_check takes replicated params only"
    n, axes = sync.data_size, sync.data_axes
    abstract = sync.abstract_params
    stacked = stacked_grads(abstract, n, seed) if grads is None else grads
    spec = P(axes[0] if len(axes) == 1 else axes)

    def local(g):
        return sync.reduce_scatter(jax.tree.map(lambda x: x[0], g))

    with acting():
        if isinstance(sync.mesh, Mesh):  # an Explicit mesh checks its inputs' shardings
            stacked = jax.device_put(stacked, jax.sharding.NamedSharding(sync.mesh, spec))
        if sync.tensor_parallel == "gspmd":
            run = sync.shard_map(local, in_specs=(spec,), out_specs=sync.shard_specs())
        else:
            run = jax.shard_map(local, mesh=sync.mesh, in_specs=(spec,), out_specs=sync.shard_specs())
        got = sync.unflatten(jax.jit(run)(stacked))
    divisor = n if sync.average else 1
    want = [np.asarray(g, np.float64).sum(axis=0) / divisor for g in jax.tree.leaves(stacked)]
    scale = [np.max(np.abs(np.asarray(g, np.float64)).reshape(n, -1), axis=1, initial=0.0).mean() * n / divisor
             for g in jax.tree.leaves(stacked)]
    bounds = [rounding_bound(n + 2, s, sync_eps(sync)) for s in scale]
    return compare(jax.tree.leaves(got), want, bounds, leaf_names(abstract), what="grads")


# -- area: TrainConfig ---------------------------------------------------------------------------

REDUCE = ("bf16", "fp32", "fp32_accum", "fp32_accum_streamed", "int8_accum", "fp8_accum", "int8_accum_streamed")


def valid(make: Callable[[], Any]) -> Callable[[], Any]:
    """Marks an edge value as valid input: a refusal of it is listed as over-cautious."""
    make.valid = True
    return make


def _const(value: Any) -> Callable[[], Any]:
    return lambda: value


CONFIG_EDGES: dict[str, dict[str, Callable[[], Any]]] = {
    "axis": {"'model'": _const("model"), "('data',)": valid(_const(("data",))), "['data']": _const(["data"]),
             "('data', 'data')": _const(("data", "data"))},
    "bucket_size": {"1": valid(_const(1)), "7": valid(_const(7)), "10**9": valid(_const(10**9)),
                    "np.int32(5)": valid(lambda: np.int32(5)), "None": valid(_const(None))},
    "reduce": {**{repr(m): valid(_const(m)) for m in REDUCE}, "'fp16'": _const("fp16"), "'FP32'": _const("FP32")},
    "drain": {"False": valid(_const(False))},
    "max_in_flight": {"1": valid(_const(1)), "2": valid(_const(2)), "100": valid(_const(100))},
    "microbatches": {"2": valid(_const(2)), "3": _const(3), "16": _const(16), "np.int64(2)": valid(lambda: np.int64(2))},
    "accum_dtype": {"bfloat16": valid(dtype("bfloat16")), "float16": valid(dtype("float16")), "float64": dtype("float64"),
                    "int32": dtype("int32"), "'float32'": valid(_const("float32")), "None": valid(_const(None))},
    "gather_max_in_flight": {"'sync'": valid(_const("sync")), "1": valid(_const(1)), "3": valid(_const(3)),
                             "100": valid(_const(100)), "None": valid(_const(None))},
    "donate": {"False": valid(_const(False))},
    "scan_layers": {"False": valid(_const(False)), "None": valid(_const(None))},
    "outer_axis": {"'data'": _const("data"), "'replica'": _const("replica"), "()": valid(_const(()))},
    "param_specs": {"{'w': P(), 'b': P()}": valid(lambda: {"w": P(), "b": P()}),
                    "{'w': P(None, 'model'), 'b': P()}": lambda: {"w": P(None, "model"), "b": P()},
                    "{'w': P('data'), 'b': P()}": lambda: {"w": P("data"), "b": P()}, "P()": valid(lambda: P())},
    "expert": {"lambda path: True": lambda: (lambda path: True), "{'w': True, 'b': False}": lambda: {"w": True, "b": False}},
    "expert_axis": {"'data'": _const("data"), "'model'": _const("model")},
    "skip_nonfinite": {"False": valid(_const(False))},
    "skip_grad_norm_above": {"1e-6": valid(_const(1e-6)), "1e6": valid(_const(1e6)),
                             "np.float32(1.0)": valid(lambda: np.float32(1.0))},
    "split_leaves": {"True": valid(_const(True))},
    "param_dtype": {"bfloat16": valid(dtype("bfloat16")), "float16": valid(dtype("float16")), "float64": dtype("float64"),
                    "int8": dtype("int8"), "'bfloat16'": valid(_const("bfloat16"))},
    "wire_dtype": {"bfloat16": valid(dtype("bfloat16")), "float16": valid(dtype("float16")), "int8": dtype("int8"),
                   "float32": valid(dtype("float32")), "float8_e4m3fn": dtype("float8_e4m3fn")},
    "error_feedback": {"False": valid(_const(False))},
    "shard_params": {"True": valid(_const(True))},
    "reshard_after_forward": {"False": valid(_const(False))},
    "tensor_parallel": {"'gspmd'": valid(_const("gspmd")), "'manual'": valid(_const("manual")), "'auto'": _const("auto")},
    "logical_axis_rules": {"(('embed', 'data'),)": valid(_const((("embed", "data"),))),
                           "(('embed',),)": _const((("embed",),)), "[['a', None]]": valid(_const([["a", None]]))},
}

CONFIG_COMBOS: dict[str, dict[str, Callable[[], Any]]] = {
    "error_feedback + int8_accum": {"error_feedback": _const(True), "reduce": _const("int8_accum")},
    "error_feedback + fp8_accum": {"error_feedback": _const(True), "reduce": _const("fp8_accum")},
    "error_feedback + bf16 wire": {"error_feedback": _const(True), "wire_dtype": dtype("bfloat16")},
    "shard_params + reshard_after_forward=False": {"shard_params": _const(True), "reshard_after_forward": _const(False)},
    "shard_params + microbatches=2": {"shard_params": _const(True), "microbatches": _const(2)},
    "shard_params + split_leaves": {"shard_params": _const(True), "split_leaves": _const(True)},
    "shard_params + param_dtype=bf16": {"shard_params": _const(True), "param_dtype": dtype("bfloat16")},
    "shard_params + error_feedback": {"shard_params": _const(True), "error_feedback": _const(True),
                                      "reduce": _const("int8_accum")},
    "microbatches=2 + accum_dtype=None": {"microbatches": _const(2), "accum_dtype": _const(None)},
    "microbatches=2 + accum_dtype=bf16": {"microbatches": _const(2), "accum_dtype": dtype("bfloat16")},
    "param_dtype=bf16 + reduce=bf16": {"param_dtype": dtype("bfloat16"), "reduce": _const("bf16")},
    "drain=False + max_in_flight=2": {"drain": _const(False), "max_in_flight": _const(2)},
    "bucket_size=1 + split_leaves": {"bucket_size": _const(1), "split_leaves": _const(True)},
    "bucket_size=None + microbatches=4": {"bucket_size": _const(None), "microbatches": _const(4)},
    "skip_nonfinite=False + skip_grad_norm_above=1e-6": {"skip_nonfinite": _const(False),
                                                         "skip_grad_norm_above": _const(1e-6)},
    "tensor_parallel=gspmd + shard_params": {"tensor_parallel": _const("gspmd"), "shard_params": _const(True)},
}


def config_case(overrides: dict[str, Callable[[], Any]]) -> tuple[str, str]:
    made = {key: make() for key, make in overrides.items()}
    with acting():
        config = base_config(**made)
    return train_check(base_params(), optax.adam(0.05), config)


def config_cases() -> list[Case]:
    cases = []
    for field, edges in CONFIG_EDGES.items():
        for label, make in values(edges).items():
            cases.append(Case("config", f"TrainConfig({field}={label})", config_case, ({field: make},), (field,),
                              "works" if getattr(make, "valid", False) else "either",
                              f"jd.TrainConfig(bucket_size=8, {field}={label}) on the toy problem"))
    for label, overrides in CONFIG_COMBOS.items():
        cases.append(Case("config", f"TrainConfig({label})", config_case, (overrides,), tuple(overrides), "either",
                          f"jd.TrainConfig(bucket_size=8, {label}) on the toy problem"))
    return cases


# -- area: make_train_step -----------------------------------------------------------------------


@dataclasses.dataclass
class Swap:
    """An argument value with what the reference needs instead of the defaults."""

    value: Any
    ref_params: Any = None
    ref_loss: Any = None
    loss: Any = None  # the loss to build the step with, where the value needs its own (an nnx model)


def user_vector_loss(p, batch):
    return jnp.mean(jnp.square(batch["x"] @ p["w"] + p["b"] - batch["y"]), axis=0)


def user_int_loss(p, batch):
    return jnp.sum(batch["x"] @ p["w"] > 0).astype(jnp.int32)


def user_complex_loss(p, batch):
    return jnp.mean(jnp.square(batch["x"] @ p["w"] + p["b"] - batch["y"])) * (1 + 0j)


def user_aux_loss(p, batch):
    return user_loss(p, batch), {"note": jnp.ones(())}


def user_weighted_loss(p, batch):
    err = batch["x"] @ p["w"] + p["b"] - batch["y"]
    return jd.WeightedLoss(jnp.sum(jnp.mean(jnp.square(err), axis=-1)), jnp.asarray(err.shape[0], jnp.float32))


def user_psum_loss(p, batch):
    return jax.lax.pmean(user_loss(p, batch), "data")


def user_raising_loss(p, batch):
    raise ValueError("the user's loss has a bug")


def user_one_arg_loss(p):
    return jnp.sum(p["w"])


def user_constant_loss(p, batch):
    return jnp.asarray(1.0, jnp.float32)


def user_bf16_loss(p, batch):
    return user_loss(p, batch).astype(jnp.bfloat16)


def user_shape1_loss(p, batch):
    return user_loss(p, batch)[None]


def user_nan_loss(p, batch):
    return user_loss(p, batch, constant=jnp.nan)


def user_update_raises(updates, state, params=None):
    raise RuntimeError("the user's transform has a bug")


def user_wrong_structure_update(updates, state, params=None):
    return {"unexpected": jnp.zeros(())}, state


def nnx_swap():
    model = UserMLP.make()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    pure = nnx.to_pure_dict(params)

    def user_functional_loss(p, batch):
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, p)
        return user_nnx_loss(nnx.merge(graphdef, state, rest), batch)

    return Swap(model, ref_params=jax.tree.map(jnp.asarray, pure), ref_loss=user_functional_loss, loss=user_nnx_loss)


def _const_fn(name: str) -> Callable[[], Any]:
    return lambda: globals()[name]


MAKE_EDGES: dict[str, dict[str, Callable[[], Any]]] = {
    "model": {
        "nnx MLP": valid(nnx_swap),
        "numpy params": valid(lambda: jax.tree.map(np.asarray, base_params())),
        "bf16 params": valid(lambda: base_params("bfloat16")),
        "{'w': ..., 'b': 0.5}": lambda: {"w": base_params()["w"], "b": 0.5},
        "{'w': ..., 'b': int32[3]}": lambda: {"w": base_params()["w"], "b": jnp.zeros(3, jnp.int32)},
        "ShapeDtypeStruct params": lambda: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), base_params()),
        "(w, b) tuple": lambda: tuple(base_params().values()),
        "params with an extra leaf": lambda: {**base_params(), "unused": jnp.ones(4)},
    },
    "loss_fn": {
        "vector loss": _const_fn("user_vector_loss"), "int32 loss": _const_fn("user_int_loss"),
        "complex loss": _const_fn("user_complex_loss"), "(loss, aux)": _const_fn("user_aux_loss"),
        "WeightedLoss": valid(lambda: Swap(user_weighted_loss, ref_loss=user_loss)),
        "pmean over data": _const_fn("user_psum_loss"), "raises": _const_fn("user_raising_loss"),
        "one argument": _const_fn("user_one_arg_loss"), "constant": _const_fn("user_constant_loss"),
        "bf16 loss": valid(_const_fn("user_bf16_loss")), "shape (1,)": _const_fn("user_shape1_loss"),
        "NaN loss, finite gradient": valid(_const_fn("user_nan_loss")),
    },
    "tx": {
        "optax.adam (uncalled)": lambda: optax.adam, "lambda: optax.adam(1)": lambda: (lambda: optax.adam(1.0)),
        "GradientTransformation(None, None)": lambda: optax.GradientTransformation(None, None),
        "update raises": lambda: optax.GradientTransformation(lambda p: optax.EmptyState(), user_update_raises),
        "update returns another tree": lambda: optax.GradientTransformation(lambda p: optax.EmptyState(),
                                                                            user_wrong_structure_update),
        "jd.adamw(0.05)": valid(lambda: jd.adamw(0.05)), "optax.sgd(0.1)": valid(lambda: optax.sgd(0.1)),
    },
    "mesh": {
        "jax.devices()": lambda: jax.devices(), "jax.devices()[0]": lambda: jax.devices()[0],
        "Mesh(('batch',))": lambda: data_mesh(DEVICES, "batch"), "1-device data mesh": valid(lambda: data_mesh(1)),
        "AbstractMesh": lambda: data_mesh().abstract_mesh,
    },
    "config": {
        "None": valid(_const(None)), "{'bucket_size': 8}": _const({"bucket_size": 8}),
        "TrainConfig (the class)": lambda: jd.TrainConfig, "TrainConfig()": valid(lambda: jd.TrainConfig()),
    },
    "example_batch": {
        "None": valid(_const(None)), "{}": _const({}), "15 examples": lambda: make_batches(15, 1)[0],
        "0 examples": lambda: make_batches(0, 1)[0], "scalar leaves": lambda: {"x": np.float32(1), "y": np.float32(2)},
        "ShapeDtypeStructs": valid(lambda: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                        make_batches(16, 1)[0])),
        "an extra key": valid(lambda: {**make_batches(16, 1)[0], "extra": np.zeros((16, 2), np.float32)}),
        "[x, y] list": lambda: list(make_batches(16, 1)[0].values()),
        "int32 x": valid(lambda: {"x": np.ones((16, D_IN), np.int32), "y": np.ones((16, D_OUT), np.float32)}),
        "wrong feature size": lambda: make_batches(16, 1, features=D_IN + 1)[0],
    },
    "mutable": {
        "['batch_stats']": _const(["batch_stats"]), "'batch_stats'": _const("batch_stats"),
        "['params']": _const(["params"]), "()": valid(_const(())), "[1]": _const([1]),
    },
}


def make_step_case(arg: str, make: Callable[[], Any]) -> tuple[str, str]:
    value = make()
    swap = value if isinstance(value, Swap) else Swap(value)
    call = {"model": base_params(), "loss_fn": user_loss, "tx": optax.adam(0.05), "mesh": data_mesh(),
            "config": base_config()}
    call[arg] = swap.value
    if swap.loss is not None:
        call["loss_fn"] = swap.loss
    kwargs = {arg: swap.value} if arg in ("example_batch", "mutable") else {}
    ref_params = swap.ref_params if swap.ref_params is not None else (swap.value if arg == "model" else base_params())
    return train_check(call["model"], call["tx"], call["config"], mesh=call["mesh"], loss=call["loss_fn"],
                       ref_params=ref_params, ref_loss=swap.ref_loss, ref_config=base_config(), **kwargs)


def make_step_cases() -> list[Case]:
    args = ("model", "loss_fn", "tx", "mesh", "config", "example_batch", "mutable")
    cases = []
    for arg in args:
        for label, make in values(MAKE_EDGES[arg]).items():
            cases.append(Case("make_train_step", f"{arg}={label}", make_step_case, (arg, make), (arg,),
                              "works" if getattr(make, "valid", False) else "either",
                              f"jd.make_train_step(... {arg}={label} ...) on the toy problem"))
    return cases


# -- area: TrainStep calls -----------------------------------------------------------------------


@functools.cache
def base_step():
    """The toy step (donating), built once per worker; each case starts from its own init()."""
    return other_step()


def other_step(tx_name: str = "adam", example: bool = True, **config):
    tx = {"adam": optax.adam(0.05), "sgd": optax.sgd(0.1)}[tx_name]
    return jd.make_train_step(base_params(), user_loss, tx, data_mesh(), base_config(**config),
                              example_batch=make_batches(16, 1)[0] if example else None)


@functools.cache
def nnx_step():
    model = UserMLP.make()
    return model, jd.make_train_step(model, user_nnx_loss, optax.adam(0.05), data_mesh(), base_config(),
                                     example_batch=make_batches(16, 1)[0])


def consumed_state():
    state = base_step().init()
    base_step()(state, make_batches(16, 1)[0])
    return state


STATE_EDGES = {
    "consumed (donated) state": consumed_state,
    "the params dict": lambda: base_params(),
    "state of another tx (sgd)": lambda: other_step("sgd").init(),
    "state of another bucket_size": lambda: other_step(bucket_size=4).init(),
    "host (device_get) state": valid(lambda: jax.device_get(base_step().init())),
    "tuple(state)": lambda: tuple(base_step().init()),
    "state with step=5 (a Python int)": valid(lambda: base_step().init()._replace(step=5)),
    "ZeRO-3 state": lambda: other_step(shard_params=True).init(),
    "abstract state": lambda: base_step().abstract_state(),
    "state with opt_state=None": lambda: base_step().init()._replace(opt_state=None),
}


def _nan_example(batch):
    batch["x"][3, 0] = np.nan
    return batch


BATCH_EDGES = {
    "15 examples": lambda: make_batches(15, 1)[0],
    "8 examples": valid(lambda: make_batches(8, 1)[0]),
    "32 examples": valid(lambda: make_batches(32, 1)[0]),
    "0 examples": lambda: make_batches(0, 1)[0],
    "a NaN in one example": valid(lambda: _nan_example(make_batches(16, 1)[0])),
    "leading dims 16 and 8": lambda: {"x": make_batches(16, 1)[0]["x"], "y": make_batches(8, 1)[0]["y"]},
    "wrong feature size": lambda: make_batches(16, 1, features=D_IN + 1)[0],
    "float64 numpy": valid(lambda: jax.tree.map(lambda x: x.astype(np.float64), make_batches(16, 1)[0])),
    "int32 x": valid(lambda: {"x": np.ones((16, D_IN), np.int32), "y": np.ones((16, D_OUT), np.float32)}),
    "[x, y] list": lambda: list(make_batches(16, 1)[0].values()),
    "jax arrays sharded over data": valid(lambda: jax.device_put(make_batches(16, 1)[0], jax.sharding.NamedSharding(
        data_mesh(), P("data")))),
    "an extra key": valid(lambda: {**make_batches(16, 1)[0], "extra": np.zeros((16, 2), np.float32)}),
    "bfloat16": valid(lambda: jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), make_batches(16, 1)[0])),
    "a string leaf": lambda: {**make_batches(16, 1)[0], "name": "abc"},
}

INIT_EDGES = {
    "None": valid(_const(None)),
    "other shapes": lambda: {"w": jnp.zeros((D_IN + 1, D_OUT)), "b": jnp.zeros(D_OUT)},
    "bfloat16 values": lambda: base_params("bfloat16"),
    "numpy params": valid(lambda: jax.tree.map(np.asarray, base_params(seed=5))),
    "ShapeDtypeStructs": lambda: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), base_params()),
    "an extra leaf": lambda: {**base_params(), "c": jnp.ones(2)},
    "other values": valid(lambda: base_params(seed=7)),
}


def call_state_case(make) -> tuple[str, str]:
    state = make()
    batch = make_batches(16, 1)[0]
    with acting("state"):
        new = base_step()(state, batch)
    return _one_step(new, batch)


def _one_step(result, batch, params=None) -> tuple[str, str]:
    state, metrics = result
    with acting():
        got = base_step().master_params(state)
    return verify_training(got, [bool(metrics.skipped)], base_params() if params is None else params, user_loss,
                           optax.adam(0.05), [batch], DEVICES, base_config())


def call_batch_case(make) -> tuple[str, str]:
    batch = make()
    with acting("batch"):
        result = base_step()(base_step().init(), batch)
    return _one_step(result, batch)


def init_case(make) -> tuple[str, str]:
    params = make()
    batch = make_batches(16, 1)[0]
    with acting("params", "init"):
        result = base_step()(base_step().init(params), batch)
    return _one_step(result, batch, base_params() if params is None else jax.tree.map(jnp.asarray, params))


def master_params_case(make) -> tuple[str, str]:
    state = make()
    with acting("state"):
        got = base_step().master_params(state)
    want = host(base_params())
    same = all(np.array_equal(np.asarray(g), w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    return ("correct", "the initial parameters, bit for bit") if same else ("silent", "not the initial parameters")


def update_model_case(arg: str, make) -> tuple[str, str]:
    model, step = nnx_step()
    state, _ = step(step.init(), make_batches(16, 1)[0])
    target, given = (make(), state) if arg == "model" else (UserMLP.make(), make())
    with acting(arg):
        step.update_model(target, given)
        want = step.master_params(state)
    got = nnx.to_pure_dict(nnx.state(target, nnx.Param))
    same = all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    return ("correct", "model holds the state's parameters") if same else ("silent", "model differs from the state")


def variables_case(make) -> tuple[str, str]:
    with acting("variables"):
        out = base_step().variables(make())
    return "silent", f"variables() of a params step returned {type(out).__name__}"


def abstract_state_case() -> tuple[str, str]:
    with acting("example_batch", "abstract_state"):
        out = other_step(example=False).abstract_state()
    return "silent", f"abstract_state() before the layout is known returned {type(out).__name__}"


LOWER_EDGES = {
    "abstract state and batch": valid(lambda: (base_step().abstract_state(), jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), make_batches(16, 1)[0]))),
    "concrete state and batch": valid(lambda: (base_step().init(), make_batches(16, 1)[0])),
    "(None, batch)": lambda: (None, make_batches(16, 1)[0]),
    "(state, None)": lambda: (base_step().init(), None),
    "(params, batch)": lambda: (base_params(), make_batches(16, 1)[0]),
    "(state, 15 examples)": lambda: (base_step().init(), make_batches(15, 1)[0]),
}


def lower_case(make) -> tuple[str, str]:
    state, batch = make()
    real = make_batches(16, 1)[0]
    with acting("state", "batch"):
        compiled = base_step().lower(state, batch).compile()
        result = compiled(base_step().init(), base_step().shard_batch(real))
    return _one_step(result, real)


def shard_batch_case(make) -> tuple[str, str]:
    batch = make()
    with acting("batch"):
        placed = base_step().shard_batch(batch)
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(batch)))
    return ("correct", "the batch's values, placed") if same else ("silent", "shard_batch changed the values")


def step_call_cases() -> list[Case]:
    cases = []
    add = lambda name, fn, args, kw, make, repro: cases.append(Case(
        "train_step", name, fn, args, kw, "works" if getattr(make, "valid", False) else "either", repro))
    for label, make in values(STATE_EDGES).items():
        add(f"step(state={label}, batch)", call_state_case, (make,), ("state",), make, f"step({label}, batch)")
    for label, make in values(BATCH_EDGES).items():
        add(f"step(state, batch={label})", call_batch_case, (make,), ("batch",), make, f"step(step.init(), {label})")
    for label, make in values(INIT_EDGES).items():
        add(f"init(params={label})", init_case, (make,), ("params",), make, f"step.init({label})")
    master = {"fresh state": valid(lambda: base_step().init()), "consumed state": consumed_state}
    for label, make in values(master).items():
        add(f"master_params(state={label})", master_params_case, (make,), ("state",), make,
            f"step.master_params({label})")
    models = {"the nnx model": valid(lambda: UserMLP.make(1)), "the params dict": lambda: base_params()}
    for label, make in values(models).items():
        add(f"update_model(model={label}, state)", update_model_case, ("model", make), ("model",), make,
            f"nnx_step.update_model({label}, state)")
    states = {"consumed state": lambda: _consumed_nnx_state()}
    for label, make in values(states).items():
        add(f"update_model(model, state={label})", update_model_case, ("state", make), ("state",), make,
            f"nnx_step.update_model(model, {label})")
    for label, make in {"fresh state": lambda: base_step().init(), "None": _const(None)}.items():
        add(f"variables(state={label})", variables_case, (make,), ("variables",), make, f"params_step.variables({label})")
    cases.append(Case("train_step", "abstract_state() without example_batch", abstract_state_case, (),
                      ("example_batch",), "refuse", "make_train_step(..., example_batch=None).abstract_state()"))
    for label, make in LOWER_EDGES.items():
        add(f"lower{label}", lower_case, (make,), ("state", "batch"), make, f"step.lower{label}")
    for label, make in values({"a batch": valid(lambda: make_batches(16, 1)[0])}).items():
        add(f"shard_batch({label})", shard_batch_case, (make,), ("batch",), make, f"step.shard_batch({label})")
    return cases


def _consumed_nnx_state():
    _, step = nnx_step()
    state = step.init()
    step(state, make_batches(16, 1)[0])
    return state


# -- area: GradSync and ScanGradSync -------------------------------------------------------------

SHORT = {k: GENERIC[k] for k in ("None", "True", "0", "-1", "1.5", "'bogus'", "object()", "np.ones(3)")}


def sync_base(kind: str) -> dict:
    if kind == "GradSync":
        return {"params": base_params(), "mesh": data_mesh(), "bucket_size": 8}
    return {"params": scan_params(), "mesh": data_mesh(), "bucket_size": 8,
            "stacked": lambda path: path.startswith("blocks/")}


def build_sync(kind: str, **kwargs):
    return (jd.GradSync if kind == "GradSync" else jd.ScanGradSync)(kwargs.pop("params"), kwargs.pop("mesh"), **kwargs)


def _shaped(dtype_name: str):
    return lambda: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype_name), base_params())


SYNC_EDGES = {
    "params": {"{}": _const({}), "{'w': ..., 'b': 0.5}": lambda: {"w": base_params()["w"], "b": 0.5},
               "int32 leaf": lambda: {"w": base_params()["w"], "b": jnp.zeros(3, jnp.int32)},
               "ShapeDtypeStructs": valid(_shaped("float32")), "bfloat16 leaves": valid(_shaped("bfloat16")),
               "float16 leaves": valid(_shaped("float16")),
               "a zero-size leaf": valid(lambda: {**base_params(), "z": jnp.zeros((0, 3))})},
    "mesh": {"jax.devices()": lambda: jax.devices(), "Mesh(('batch',))": lambda: data_mesh(DEVICES, "batch"),
             "1-device mesh": valid(lambda: data_mesh(1)), "3-device mesh": valid(lambda: data_mesh(3))},
    "axis": {"'model'": _const("model"), "('data',)": valid(_const(("data",))),
             "('data', 'data')": _const(("data", "data")), "['data']": _const(["data"])},
    "bucket_size": {"1": valid(_const(1)), "7": valid(_const(7)), "None": valid(_const(None))},
    "reduce": {**{repr(m): valid(_const(m)) for m in REDUCE}, "'fp16'": _const("fp16")},
    "drain": {"False": valid(_const(False))},
    "average": {"False": valid(_const(False))},
    "order": {"[0, 1]": valid(_const([0, 1])), "[1, 0]": valid(_const([1, 0])), "[0, 0]": _const([0, 0]),
              "[0]": _const([0]), "[0, 1, 2]": _const([0, 1, 2]), "[0, 5]": _const([0, 5]),
              "[0.0, 1.0]": _const([0.0, 1.0]), "'01'": _const("01"), "np.array([1, 0])": valid(lambda: np.array([1, 0])),
              "[-1, 0]": _const([-1, 0])},
    "max_in_flight": {"1": valid(_const(1)), "2": valid(_const(2)), "100": valid(_const(100))},
    "param_specs": {"{'w': P(), 'b': None}": valid(lambda: {"w": P(), "b": None}),
                    "{'w': P('data'), 'b': None}": lambda: {"w": P("data"), "b": None},
                    "P('model')": lambda: P("model"), "{'w': P(None, 'model')}": lambda: {"w": P(None, "model")}},
    "outer_axis": {"'data'": _const("data"), "'replica'": _const("replica"), "()": valid(_const(()))},
    "expert": {"lambda path: True": lambda: (lambda path: True), "{'w': True, 'b': False}": lambda: {"w": True, "b": False},
               "lambda path: False": valid(lambda: (lambda path: False))},
    "expert_axis": {"'data'": _const("data"), "()": _const(())},
    "split_leaves": {"True": valid(_const(True))},
    "wire_dtype": {"bfloat16": valid(dtype("bfloat16")), "float16": valid(dtype("float16")), "int8": dtype("int8"),
                   "float32": valid(dtype("float32")), "float8_e4m3fn": dtype("float8_e4m3fn")},
    "tensor_parallel": {"'gspmd'": valid(_const("gspmd")), "'auto'": _const("auto")},
}

SCAN_EDGES = {
    "params": {"{}": _const({}), "ShapeDtypeStructs": valid(lambda: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), scan_params()))},
    "mesh": {"1-device mesh": valid(lambda: data_mesh(1)), "3-device mesh": valid(lambda: data_mesh(3))},
    "axis": {"('data',)": _const(("data",)), "'model'": _const("model")},
    "stacked": {"lambda path: False": lambda: (lambda path: False), "lambda path: True": lambda: (lambda path: True),
                "{'blocks': True, 'head': False}": valid(lambda: {"blocks": True, "head": False}),
                "{'blocks': True}": lambda: {"blocks": True}, "a predicate that raises": lambda: user_raising_predicate},
    "num_layers": {"3": valid(_const(3)), "2": _const(2), "None": valid(_const(None))},
    "bucket_size": {"1": valid(_const(1)), "None": valid(_const(None))},
    "reduce": {repr(m): valid(_const(m)) for m in REDUCE},
    "drain": {"False": valid(_const(False))},
    "average": {"False": valid(_const(False))},
    "order": {"[2, 1, 0]": valid(_const([2, 1, 0])), "[0, 0, 1]": _const([0, 0, 1]), "[0]": _const([0])},
    "max_in_flight": {"2": valid(_const(2))},
    "outer_axis": {"'data'": _const("data"), "()": valid(_const(()))},
    "split_leaves": {"True": valid(_const(True))},
    "wire_dtype": {"bfloat16": valid(dtype("bfloat16")), "int8": dtype("int8")},
    "param_specs": {"{'blocks': P(), 'head': P()}": lambda: {"blocks": P(), "head": P()}},
    "tensor_parallel": {"'gspmd'": valid(_const("gspmd")), "'auto'": _const("auto")},
}


def user_raising_predicate(path):
    raise ValueError("the user's predicate has a bug")


def sync_case(kind: str, arg: str, make) -> tuple[str, str]:
    kwargs = sync_base(kind)
    kwargs[arg] = make()
    with acting(arg):
        sync = build_sync(kind, **kwargs)
    return sync_check(sync)


def grads_case(mode: str, fault: str) -> tuple[str, str]:
    """reduce_scatter of per-device gradients with a fault in them, against float64."""
    dtype_name = "float16" if fault.startswith("f16") else "float32"
    params = base_params(dtype_name)
    with acting():
        sync = jd.GradSync(params, data_mesh(), bucket_size=8, reduce=mode)
    grads = stacked_grads(sync.abstract_params, DEVICES)
    leaves, treedef = jax.tree.flatten(grads)
    big = {"float32": 1e38, "float16": 2e4}[dtype_name]
    if fault == "nan on one device":
        leaves[0] = leaves[0].at[(1,) + (0,) * (leaves[0].ndim - 1)].set(jnp.nan)
    elif fault == "inf on one device":
        leaves[0] = leaves[0].at[(1,) + (0,) * (leaves[0].ndim - 1)].set(jnp.inf)
    elif fault.endswith("on every device (the sum overflows, the mean does not)"):
        leaves = [jnp.full_like(x, big) for x in leaves]
    return sync_check(sync, grads=jax.tree.unflatten(treedef, leaves))


def grads_misuse_case(fault: str) -> tuple[str, str]:
    sync = jd.GradSync(base_params(), data_mesh(), bucket_size=8)
    grads = stacked_grads(sync.abstract_params, DEVICES)
    if fault == "outside shard_map":
        with acting("shard_map"):
            out = sync.reduce_scatter(base_params())
        return "silent", f"reduce_scatter outside shard_map returned {type(out).__name__}"
    if fault == "replicated (already reduced) grads":
        fn = jax.shard_map(lambda g: sync.reduce_scatter(jax.tree.map(lambda x: x[0], g)), mesh=sync.mesh,
                           in_specs=(P(),), out_specs=sync.shard_specs())
        with acting("vary", "all-reduced"):
            jax.jit(fn)(grads)
        return "silent", "replicated gradients were reduced again"
    changed = {
        "a missing leaf": lambda g: {"w": g["w"]},
        "wrong shape": lambda g: {"w": g["w"][:, :, :2], "b": g["b"]},
        "bfloat16 grads for float32 params": lambda g: jax.tree.map(lambda x: x.astype(jnp.bfloat16), g),
        "int32 grads": lambda g: jax.tree.map(lambda x: x.astype(jnp.int32), g),
        "an extra leaf": lambda g: {**g, "c": g["b"]},
    }[fault](grads)
    return sync_check(sync, grads=changed)


def grad_check(sync, params, loss, *, microbatches=1, accum_dtype="float32", batch=None, has_aux=False):
    """``sync.value_and_grad(loss)`` inside ``shard_map`` against one device's float32 gradient of
    the whole batch, within ``rounding_bound`` of its rounding chain."""
    batch = make_batches(2 * sync.data_size * 4, 1)[0] if batch is None else batch
    spec = P(sync.data_axes[0] if len(sync.data_axes) == 1 else sync.data_axes)
    with acting():
        fn = sync.value_and_grad(loss, has_aux, microbatches=microbatches, accum_dtype=accum_dtype)
        run = jax.shard_map(lambda p, b: fn(p, b)[1], mesh=sync.mesh, in_specs=(sync.param_specs, spec),
                            out_specs=sync.shard_specs())
        got = sync.unflatten(jax.jit(run)(params, batch))
    shares = sync.data_size * _int_or(microbatches, 1)
    grad_at, scales_at, additions = loss_source(params, loss, [batch], shares)
    master = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    want = [np.asarray(g, np.float64) for g in jax.tree.leaves(grad_at(master, 0))]
    eps = max(EPS32, sync_eps(sync), eps_of(accum_dtype) if accum_dtype is not None and _int_or(microbatches, 1) > 1
              else 0.0)
    bounds = [rounding_bound(additions, s, eps) for s in scales_at(master, 0)]
    return compare(jax.tree.leaves(got), want, bounds, leaf_names(params), what="grads")


def value_and_grad_case(arg: str, make) -> tuple[str, str]:
    sync = jd.GradSync(base_params(), data_mesh(), bucket_size=8)
    kwargs = {arg: make(), **({"microbatches": 2} if arg == "accum_dtype" else {})}
    return grad_check(sync, base_params(), user_loss, **kwargs)


def scan_grad_case(mode: str, microbatches: int) -> tuple[str, str]:
    params = scan_params()
    with acting():
        sync = jd.ScanGradSync(params, data_mesh(), stacked=lambda path: path.startswith("blocks/"), bucket_size=8,
                               reduce=mode)
    return grad_check(sync, params, user_scan_loss, microbatches=microbatches)


def unflatten_case(make) -> tuple[str, str]:
    sync = jd.GradSync(base_params(), data_mesh(), bucket_size=8)
    value = make()
    with acting("buckets", "unflatten"):
        got = sync.unflatten(sync.flatten(base_params()) if isinstance(value, str) and value == "flatten" else value)
    same = all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(jax.tree.leaves(got),
                                                                            jax.tree.leaves(base_params())))
    return ("correct", "round trip bit for bit") if same else ("silent", "unflatten(flatten(params)) != params")


GRAD_FAULTS = ("nan on one device", "inf on one device", "1e38 on every device (the sum overflows, the mean does not)",
               "f16 2e4 on every device (the sum overflows, the mean does not)")


def sync_cases() -> list[Case]:
    cases = []
    for kind, edges, generic in (("GradSync", SYNC_EDGES, GENERIC), ("ScanGradSync", SCAN_EDGES, SHORT)):
        for arg, own in edges.items():
            for label, make in {**generic, **own}.items():
                cases.append(Case("sync", f"{kind}({arg}={label})", sync_case, (kind, arg, make), (arg,),
                                  "works" if getattr(make, "valid", False) else "either",
                                  f"jd.{kind}(toy params, 8-device data mesh, bucket_size=8, {arg}={label}) "
                                  "+ reduce_scatter of random per-device grads vs float64"))
    for mode in REDUCE:
        for fault in GRAD_FAULTS:
            cases.append(Case("sync", f"reduce_scatter(reduce={mode!r}, grads: {fault})", grads_case, (mode, fault),
                              ("grad",), "works",
                              f"jd.GradSync(params, mesh, reduce={mode!r}).reduce_scatter(grads with {fault})"))
    for fault in ("outside shard_map", "replicated (already reduced) grads", "a missing leaf", "wrong shape",
                  "bfloat16 grads for float32 params", "int32 grads", "an extra leaf"):
        cases.append(Case("sync", f"reduce_scatter(grads: {fault})", grads_misuse_case, (fault,), ("grads",),
                          "refuse", f"sync.reduce_scatter(grads with {fault})"))
    vag = {"microbatches": {**SHORT, "2": valid(_const(2)), "3": _const(3), "4": valid(_const(4))},
           "accum_dtype": {**SHORT, "bfloat16": valid(dtype("bfloat16")), "int32": dtype("int32"),
                           "'float32'": valid(_const("float32"))},
           "has_aux": {"True (the loss returns no aux)": _const(True)}}
    for arg, own in vag.items():
        for label, make in own.items():
            cases.append(Case("sync", f"GradSync.value_and_grad({arg}={label})", value_and_grad_case, (arg, make),
                              (arg,), "works" if getattr(make, "valid", False) else "either",
                              f"sync.value_and_grad(user_loss, {arg}={label}) in shard_map vs one-device grad"))
    for mode in REDUCE:
        for micro in (1, 2):
            cases.append(Case("sync", f"ScanGradSync.value_and_grad(reduce={mode!r}, microbatches={micro})",
                              scan_grad_case, (mode, micro), (), "works",
                              f"jd.ScanGradSync(scan params, reduce={mode!r}).value_and_grad(scan loss, "
                              f"microbatches={micro}) vs one-device grad"))
    for label, make in {**SHORT, "flatten(params)": valid(_const("flatten"))}.items():
        cases.append(Case("sync", f"GradSync.unflatten({label})", unflatten_case, (make,), ("buckets",),
                          "works" if getattr(make, "valid", False) else "either", f"sync.unflatten({label})"))
    return cases


# -- area: optimizer (optax transforms, DistributedOptimizer, the flat-aware transforms) ---------


def decay_mask(p):
    return jax.tree.map(lambda x: x.ndim > 1, p)


def user_elementwise(updates, params=None):
    return jax.tree.map(lambda g: -0.05 * jnp.tanh(g), updates)


def user_per_leaf_scale():
    """A transform that scales each leaf by its index in the tree: it needs the tree."""
    def update(updates, state, params=None):
        leaves, treedef = jax.tree.flatten(updates)
        return jax.tree.unflatten(treedef, [-0.05 * (i + 1) * g for i, g in enumerate(leaves)]), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def _sched():
    return optax.warmup_cosine_decay_schedule(0.0, 0.05, 1, 10)


# label -> (factory, expect): element-wise transforms must train like one-device optax ("works"),
# the others must be refused ("refuse"); "either" where the maths allows both.
TRANSFORMS: dict[str, tuple[Callable[[], Any], str]] = {
    "sgd": (lambda: optax.sgd(0.1), "works"),
    "sgd(momentum=0.9)": (lambda: optax.sgd(0.1, momentum=0.9), "works"),
    "sgd(nesterov)": (lambda: optax.sgd(0.1, momentum=0.9, nesterov=True), "works"),
    "adam": (lambda: optax.adam(0.05), "works"),
    "adamw": (lambda: optax.adamw(0.05, weight_decay=0.1), "works"),
    "nadam": (lambda: optax.nadam(0.05), "works"),
    "nadamw": (lambda: optax.nadamw(0.05), "works"),
    "radam": (lambda: optax.radam(0.05), "works"),
    "adamax": (lambda: optax.adamax(0.05), "works"),
    "adamaxw": (lambda: optax.adamaxw(0.05), "works"),
    "adabelief": (lambda: optax.adabelief(0.05), "works"),
    "adagrad": (lambda: optax.adagrad(0.05), "works"),
    "adadelta": (lambda: optax.adadelta(0.5), "works"),
    "amsgrad": (lambda: optax.amsgrad(0.05), "works"),
    "lion": (lambda: optax.lion(0.01), "works"),
    "rmsprop": (lambda: optax.rmsprop(0.01), "works"),
    "rmsprop(centered)": (lambda: optax.rmsprop(0.01, centered=True), "works"),
    "rmsprop(momentum)": (lambda: optax.rmsprop(0.01, momentum=0.9), "works"),
    "yogi": (lambda: optax.yogi(0.05), "works"),
    "sign_sgd": (lambda: optax.sign_sgd(0.01), "works"),
    "optimistic_gradient_descent": (lambda: optax.optimistic_gradient_descent(0.05), "works"),
    "optimistic_adam": (lambda: optax.optimistic_adam(0.05), "works"),
    "rprop": (lambda: optax.rprop(0.01), "works"),
    "adan": (lambda: optax.adan(0.05), "works"),
    "contrib.adopt": (lambda: optax.contrib.adopt(0.05), "works"),
    "contrib.ademamix": (lambda: optax.contrib.ademamix(0.05), "works"),
    "contrib.simplified_ademamix": (lambda: optax.contrib.simplified_ademamix(0.05), "works"),
    "contrib.schedule_free_adamw": (lambda: optax.contrib.schedule_free_adamw(0.05), "works"),
    "contrib.schedule_free_sgd": (lambda: optax.contrib.schedule_free_sgd(0.05), "works"),
    "contrib.cocob": (lambda: optax.contrib.cocob(), "works"),
    "contrib.acprop": (lambda: optax.contrib.acprop(0.05), "either"),
    "jd.adamw(mask, max_norm)": (lambda: jd.adamw(0.05, weight_decay=0.1, mask=decay_mask, max_norm=1.0), "works"),
    "chain(jd.clip_by_global_norm, adam)": (lambda: optax.chain(jd.clip_by_global_norm(0.5), optax.adam(0.05)), "works"),
    "chain(clip(0.01), sgd)": (lambda: optax.chain(optax.clip(0.01), optax.sgd(0.1)), "works"),
    "chain(adam, jd.masked(decay))": (lambda: optax.chain(optax.scale_by_adam(), jd.masked(
        optax.add_decayed_weights(0.1), decay_mask), optax.scale(-0.05)), "works"),
    "MultiSteps(adam, 2)": (lambda: optax.MultiSteps(optax.adam(0.05), 2), "works"),
    "chain(apply_every(2), sgd)": (lambda: optax.chain(optax.apply_every(2), optax.sgd(0.1)), "works"),
    "inject_hyperparams(adam)": (lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.05), "works"),
    "adamw(warmup_cosine schedule)": (lambda: optax.adamw(_sched()), "works"),
    "sgd(exponential_decay)": (lambda: optax.sgd(optax.exponential_decay(0.1, 1, 0.5)), "works"),
    "chain(ema, sgd)": (lambda: optax.chain(optax.ema(0.9), optax.sgd(0.1)), "works"),
    "chain(trace, sgd)": (lambda: optax.chain(optax.trace(0.9), optax.sgd(0.1)), "works"),
    "chain(scale_by_rss, sgd)": (lambda: optax.chain(optax.scale_by_rss(), optax.sgd(0.1)), "works"),
    "chain(scale_by_stddev, sgd)": (lambda: optax.chain(optax.scale_by_stddev(), optax.sgd(0.01)), "works"),
    "chain(sgd, keep_params_nonnegative)": (lambda: optax.chain(optax.sgd(0.1), optax.keep_params_nonnegative()),
                                            "works"),
    "set_to_zero": (lambda: optax.set_to_zero(), "works"),
    "identity (lr 1)": (lambda: optax.chain(optax.identity(), optax.scale(-0.05)), "works"),
    "stateless(user element-wise)": (lambda: optax.stateless(user_elementwise), "works"),
    "stateless_with_tree_map": (lambda: optax.stateless_with_tree_map(lambda g, p: -0.05 * g), "works"),
    "flatten(adam)": (lambda: optax.flatten(optax.adam(0.05)), "either"),
    "chain(scale_by_sign, sgd)": (lambda: optax.chain(optax.scale_by_sign(), optax.sgd(0.01)), "works"),
    # Not element-wise: they see flat shards instead of the tree, and must be refused.
    "adamw(mask=...)": (lambda: optax.adamw(0.05, weight_decay=0.1, mask=decay_mask), "refuse"),
    "optax.masked": (lambda: optax.masked(optax.adam(0.05), decay_mask), "refuse"),
    "multi_transform": (lambda: optax.multi_transform({"a": optax.adam(0.05), "s": optax.sgd(0.1)},
                                                      lambda p: jax.tree.map(lambda x: "a" if x.ndim > 1 else "s", p)),
                        "refuse"),
    "chain(optax.clip_by_global_norm, adam)": (lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.05)),
                                               "refuse"),
    "chain(clip_by_block_rms, sgd)": (lambda: optax.chain(optax.clip_by_block_rms(0.01), optax.sgd(0.1)), "refuse"),
    "chain(adaptive_grad_clip, sgd)": (lambda: optax.chain(optax.adaptive_grad_clip(0.01), optax.sgd(0.1)), "refuse"),
    "chain(centralize, sgd)": (lambda: optax.chain(optax.centralize(), optax.sgd(0.1)), "refuse"),
    "chain(normalize_by_update_norm, sgd)": (lambda: optax.chain(optax.normalize_by_update_norm(), optax.sgd(0.1)),
                                             "refuse"),
    "chain(scale_by_trust_ratio, sgd)": (lambda: optax.chain(optax.scale_by_trust_ratio(), optax.sgd(0.1)), "refuse"),
    "lamb": (lambda: optax.lamb(0.05), "refuse"),
    "lars": (lambda: optax.lars(0.05), "refuse"),
    "fromage": (lambda: optax.fromage(0.05), "refuse"),
    "novograd": (lambda: optax.novograd(0.05), "refuse"),
    "sm3": (lambda: optax.sm3(0.05), "refuse"),
    "adafactor": (lambda: optax.adafactor(0.05), "refuse"),
    "adafactor(factored=False)": (lambda: optax.adafactor(0.05, factored=False), "refuse"),
    "noisy_sgd": (lambda: optax.noisy_sgd(0.05), "refuse"),
    "chain(add_noise, sgd)": (lambda: optax.chain(optax.add_noise(0.01, 0.55, 0), optax.sgd(0.1)), "refuse"),
    "chain(zero_nans, adam)": (lambda: optax.chain(optax.zero_nans(), optax.adam(0.05)), "refuse"),
    "apply_if_finite(adam)": (lambda: optax.apply_if_finite(optax.adam(0.05), 3), "refuse"),
    "polyak_sgd": (lambda: optax.polyak_sgd(), "refuse"),
    "lbfgs": (lambda: optax.lbfgs(), "refuse"),
    "contrib.prodigy": (lambda: optax.contrib.prodigy(), "refuse"),
    "contrib.dog": (lambda: optax.contrib.dog(), "refuse"),
    "contrib.dowg": (lambda: optax.contrib.dowg(), "refuse"),
    "contrib.mechanize(adam)": (lambda: optax.contrib.mechanize(optax.adam(0.05)), "refuse"),
    "contrib.momo": (lambda: optax.contrib.momo(), "refuse"),
    "contrib.muon": (lambda: optax.contrib.muon(0.05), "refuse"),
    "chain(adam, contrib.reduce_on_plateau)": (lambda: optax.chain(optax.adam(0.05), optax.contrib.reduce_on_plateau()),
                                               "refuse"),
    "contrib.dpsgd": (lambda: optax.contrib.dpsgd(0.05, 1.0, 0.1, 0), "refuse"),
    "chain(scale_by_param_block_norm, sgd)": (lambda: optax.chain(optax.scale_by_param_block_norm(), optax.sgd(0.1)),
                                              "refuse"),
    "chain(scale_by_param_block_rms, sgd)": (lambda: optax.chain(optax.scale_by_param_block_rms(), optax.sgd(0.1)),
                                             "refuse"),
    "chain(scale_by_factored_rms, sgd)": (lambda: optax.chain(optax.scale_by_factored_rms(), optax.sgd(0.1)), "either"),
    "user per-leaf scale": (lambda: user_per_leaf_scale(), "refuse"),
    "contrib.sophia": (lambda: optax.contrib.sophia(0.05), "either"),
    "contrib.sam(sgd, sgd)": (lambda: optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05)), "either"),
}

# Transforms also run with ZeRO-3 and a scanned stack.
ALSO = ("sgd(momentum=0.9)", "adam", "lion", "jd.adamw(mask, max_norm)", "MultiSteps(adam, 2)",
        "inject_hyperparams(adam)", "contrib.schedule_free_adamw", "chain(optax.clip_by_global_norm, adam)",
        "adamw(mask=...)", "lamb", "chain(zero_nans, adam)", "contrib.prodigy")


def transform_case(label: str, variant: str) -> tuple[str, str]:
    tx = TRANSFORMS[label][0]()
    if variant == "scan":
        return train_check(scan_params(), tx, base_config(scan_layers=True), loss=user_scan_loss)
    return train_check(base_params(), tx, base_config(shard_params=variant == "zero3"))


def optimizer_direct_check(opt, tx=None) -> tuple[str, str]:
    """One ``DistributedOptimizer.update`` on reduce-scattered random gradients against one step
    of ``tx`` on their float64 mean, on the tree."""
    sync = opt.sync
    n, axes = sync.data_size, sync.data_axes
    params = jax.tree.map(lambda g: g[0], stacked_grads(sync.abstract_params, 1, seed=11))
    grads = stacked_grads(sync.abstract_params, n, seed=12)
    spec = P(axes[0] if len(axes) == 1 else axes)
    with acting():
        state = opt.init_sharded(params)
        fn = jax.shard_map(lambda g, s: opt.update(sync.reduce_scatter(jax.tree.map(lambda x: x[0], g)), s)[1],
                           mesh=sync.mesh, in_specs=(spec, opt.state_specs()), out_specs=opt.state_specs())
        new = jax.jit(fn)(grads, state)
        got = opt.unflatten_master(new.master)
    mean = jax.tree.map(lambda g: jnp.asarray(np.asarray(g, np.float64).mean(axis=0), jnp.float32), grads)
    scales = [float(np.max(np.abs(np.asarray(g, np.float64)).reshape(n, -1), axis=1).mean()) for g in jax.tree.leaves(grads)]
    ref = reference_train(params, tx or opt.tx, 1, lambda m, t: mean, lambda m, t: scales, eps=sync_eps(sync),
                          additions=n + 2)
    return compare(jax.tree.leaves(got), ref.params, ref.bound, leaf_names(params))


OPT_EDGES = {
    "tx": {"optax.adam (uncalled)": lambda: optax.adam, "jd.adamw(0.05)": valid(lambda: jd.adamw(0.05))},
    "sync": {"a ScanGradSync": valid(lambda: jd.ScanGradSync(scan_params(), data_mesh(), bucket_size=8,
                                                             stacked=lambda path: path.startswith("blocks/"))),
             "a GradSync with reduce='bf16'": valid(lambda: jd.GradSync(base_params(), data_mesh(), bucket_size=8,
                                                                        reduce="bf16")),
             "a BucketLayout": lambda: jd.BucketLayout.build(base_params(), 8)},
    "gather_max_in_flight": {"'sync'": valid(_const("sync")), "1": valid(_const(1)), "2": valid(_const(2)),
                             "None": valid(_const(None)), "'all'": _const("all")},
    "check_tx": {"False": valid(_const(False))},
}


def dist_opt_case(arg: str, make) -> tuple[str, str]:
    kwargs = {"tx": optax.adam(0.05), "sync": jd.GradSync(base_params(), data_mesh(), bucket_size=8)}
    kwargs[arg] = make()
    with acting(arg):
        opt = jd.DistributedOptimizer(kwargs.pop("tx"), kwargs.pop("sync"), **kwargs)
    return optimizer_direct_check(opt)


FLAT_AWARE = {
    "masked(inner=...)": ("inner", {**SHORT, "add_decayed_weights(0.1)": valid(lambda: optax.add_decayed_weights(0.1))}),
    "masked(mask=...)": ("mask", {
        **SHORT, "decay_mask": valid(lambda: decay_mask), "{'w': True, 'b': False}": valid(_const({"w": True, "b": False})),
        "jnp bool leaves": lambda: (lambda p: jax.tree.map(lambda x: jnp.ones((), bool), p)),
        "{'w': True}": _const({"w": True}), "{'w': True, 'b': False, 'c': True}": _const({"w": True, "b": False, "c": True}),
        "a mask that raises": lambda: user_raising_predicate}),
    "clip_by_global_norm(max_norm=...)": ("max_norm", {**SHORT, "1e-3": valid(_const(1e-3)), "1e6": valid(_const(1e6)),
                                                       "np.float32(0.5)": valid(lambda: np.float32(0.5))}),
}

ADAMW_ARGS = {"learning_rate": {"a schedule": valid(_sched)}, "b1": {"0.5": valid(_const(0.5))}, "b2": {},
              "eps": {"1e-3": valid(_const(1e-3))}, "weight_decay": {"0.0": valid(_const(0.0))},
              "mask": {"decay_mask": valid(lambda: decay_mask), "{'w': True}": _const({"w": True})},
              "max_norm": {"1.0": valid(_const(1.0))}}


def flat_aware_case(which: str, make) -> tuple[str, str]:
    value = make()
    with acting(FLAT_AWARE[which][0] if which in FLAT_AWARE else which):
        if which == "masked(inner=...)":
            part = jd.masked(value, decay_mask)
        elif which == "masked(mask=...)":
            part = jd.masked(optax.add_decayed_weights(0.1), value)
        else:
            part = jd.clip_by_global_norm(value)
        tx = optax.chain(optax.scale_by_adam(), part, optax.scale(-0.05))
    return train_check(base_params(), tx, base_config())


def adamw_case(arg: str, make) -> tuple[str, str]:
    kwargs = {"learning_rate": 0.05, arg: make()}
    with acting(arg):
        tx = jd.adamw(**kwargs)
    return train_check(base_params(), tx, base_config())


def optimizer_cases() -> list[Case]:
    cases = []
    for label, (_, expect) in TRANSFORMS.items():
        for variant in ("zero1",) + (("zero3", "scan") if label in ALSO else ()):
            cases.append(Case("optimizer", f"{label} [{variant}]", transform_case, (label, variant), ("tx",), expect,
                              f"make_train_step(toy, tx={label}, TrainConfig(bucket_size=8"
                              f"{', shard_params=True' if variant == 'zero3' else ''}"
                              f"{', scan_layers=True' if variant == 'scan' else ''})) vs optax on one device"))
    for arg, own in OPT_EDGES.items():
        for label, make in {**SHORT, **own}.items():
            cases.append(Case("optimizer", f"DistributedOptimizer({arg}={label})", dist_opt_case, (arg, make), (arg,),
                              "works" if getattr(make, "valid", False) else "either",
                              f"jd.DistributedOptimizer(adam, GradSync(toy), {arg}={label}).update vs optax"))
    for which, (arg, own) in FLAT_AWARE.items():
        for label, make in own.items():
            cases.append(Case("optimizer", f"jd.{which.replace('...', label)}", flat_aware_case, (which, make), (arg,),
                              "works" if getattr(make, "valid", False) else "either",
                              f"chain(scale_by_adam, jd.{which.replace('...', label)}, scale(-0.05)) in a toy step"))
    for arg, own in ADAMW_ARGS.items():
        for label, make in {**SHORT, **own}.items():
            cases.append(Case("optimizer", f"jd.adamw({arg}={label})", adamw_case, (arg, make), (arg,),
                              "works" if getattr(make, "valid", False) else "either",
                              f"jd.adamw(0.05, {arg}={label}) in a toy step"))
    return cases


# -- area: NaN, inf and overflow -----------------------------------------------------------------

NONFINITE_FAULTS = (
    "NaN in one device's batch", "inf in one device's batch", "NaN in every example", "NaN only in step 2",
    "gradient overflows the dtype", "device sum overflows, mean finite", "NaN parameter", "inf parameter",
    "huge parameter (half the dtype max)", "subnormal gradients", "inf loss, finite gradient",
)
NONFINITE_VARIANTS = {
    "ZeRO-1": {}, "ZeRO-3": {"shard_params": True}, "microbatches=2": {"microbatches": 2},
    "microbatches=2, accum_dtype=None": {"microbatches": 2, "accum_dtype": None},
}
NONFINITE_F32_ONLY = {
    "skip_nonfinite=False": {"skip_nonfinite": False}, "reduce='bf16'": {"reduce": "bf16"},
    "reduce='fp32'": {"reduce": "fp32"}, "reduce='int8_accum'": {"reduce": "int8_accum"},
    "scan_layers": {"scan_layers": True},
}


def nonfinite_case(dtype_name: str, fault: str, overrides: dict) -> tuple[str, str]:
    config = base_config(**overrides)
    scanned = bool(overrides.get("scan_layers"))
    params = scan_params() if scanned else base_params(dtype_name)
    loss = user_scan_loss if scanned else user_loss
    micro = int(config.microbatches)
    batches = make_batches(2 * DEVICES * micro, same=fault == "device sum overflows, mean finite")
    info = jnp.finfo(jnp.dtype(dtype_name))
    factor = {"gradient overflows the dtype": 4.0, "device sum overflows, mean finite": 0.6,
              "subnormal gradients": float(info.tiny) / 4 / float(info.max)}.get(fault)
    if factor is not None:
        grad_at, scales_at, _ = loss_source(params, loss, batches, DEVICES * micro)
        master = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
        loss = functools.partial(loss, scale=factor * float(info.max) / max(scales_at(master, 0)))
    leaves, treedef = jax.tree.flatten(params)
    first = leaves[-1] if scanned else params["w"]
    if fault == "NaN parameter":
        first = first.at[(0,) * first.ndim].set(jnp.nan)
    elif fault == "inf parameter":
        first = first.at[(0,) * first.ndim].set(jnp.inf)
    elif fault == "huge parameter (half the dtype max)":
        first = first.at[(0,) * first.ndim].set(float(info.max) / 2)
    params = jax.tree.unflatten(treedef, leaves[:-1] + [first]) if scanned else {**params, "w": first}
    if fault == "NaN in one device's batch":
        batches[0]["x"][3, 0] = np.nan
    elif fault == "inf in one device's batch":
        batches[0]["y"][3, 0] = np.inf
    elif fault == "NaN in every example":
        batches[0]["x"][:] = np.nan
    elif fault == "NaN only in step 2":
        batches[1]["x"][5, 0] = np.nan
    elif fault == "inf loss, finite gradient":
        loss = functools.partial(loss, constant=jnp.inf)
    return train_check(params, optax.adam(0.05), config, loss=loss, batches=batches)


def nonfinite_cases() -> list[Case]:
    cases = []
    for dtype_name in ("float32", "bfloat16", "float16"):
        variants = {**NONFINITE_VARIANTS, **(NONFINITE_F32_ONLY if dtype_name == "float32" else {})}
        for fault in NONFINITE_FAULTS:
            for label, overrides in variants.items():
                cases.append(Case("nonfinite", f"{dtype_name}: {fault} [{label}]", nonfinite_case,
                                  (dtype_name, fault, overrides), (), "works",
                                  f"toy {dtype_name} step, TrainConfig(bucket_size=8, {label}), {fault}; "
                                  "vs one-device optax skipping exactly the non-finite gradients"))
    return cases


# -- area: odd trees -----------------------------------------------------------------------------

NT = collections.namedtuple("NT", "a b")


def _leaf(shape, dtype_name: str = "float32", seed: int = 0):
    rng = np.random.default_rng([seed, len(shape), int(np.prod(shape, dtype=np.int64))])
    return jnp.asarray(rng.normal(size=shape), dtype_name)


def _np_leaf(shape, seed: int = 0):
    return np.asarray(np.random.default_rng(seed).normal(size=shape), np.float32)


def _deep(depth: int):
    tree = {"w": _leaf((3,))}
    for i in range(depth):
        tree = {f"d{i}": tree, "b": _leaf((2,), seed=i)} if i % 5 == 0 else {f"d{i}": tree}
    return tree


def _struct_tree():
    from flax import struct

    @struct.dataclass
    class Pair:
        a: Any
        b: Any

    return Pair(_leaf((3,)), _leaf((2, 2)))


def _read_only():
    w = _np_leaf((4, 3))
    w.setflags(write=False)
    return {"w": w, "b": _np_leaf((3,), 1)}


TREES: dict[str, Callable[[], Any]] = {
    "empty dict": lambda: {},
    "nested empty containers": lambda: {"a": {}, "b": [], "c": ()},
    "one scalar leaf": lambda: {"s": _leaf(())},
    "a bare array (no container)": lambda: _leaf((5,)),
    "a bare scalar": lambda: _leaf(()),
    "one element": lambda: {"x": _leaf((1,))},
    "nested lists and tuples": lambda: [[_leaf((3,)), _leaf((2, 2))], (_leaf((4,)), [_leaf(())])],
    "None leaves": lambda: {"a": _leaf((3,)), "b": None, "c": [None, _leaf((2,))]},
    "a namedtuple": lambda: NT(_leaf((3,)), _leaf((2,))),
    "an OrderedDict (z before a)": lambda: collections.OrderedDict(z=_leaf((3,)), a=_leaf((2,))),
    "int keys": lambda: {0: _leaf((3,)), 1: _leaf((2,))},
    "colliding paths ('a/b' and a.b)": lambda: {"a/b": _leaf((3,)), "a": {"b": _leaf((3,), seed=1)}},
    "keys that sanitize alike ('a.b', 'a_b', 'a b')": lambda: {"a.b": _leaf((3,)), "a_b": _leaf((3,), seed=1),
                                                               "a b": _leaf((3,), seed=2)},
    "unicode keys": lambda: {"\u00fc": _leaf((3,)), "\u7a7a": _leaf((2,))},
    "a huge leaf (2**20 elements)": lambda: {"big": _leaf((1024, 1024)) * 1e-3, "small": _leaf((3,))},
    "300 tiny leaves": lambda: {f"l{i:03d}": _leaf((1,), seed=i) for i in range(300)},
    "a zero-size leaf": lambda: {"z": jnp.zeros((0,)), "w": _leaf((4,))},
    "only zero-size leaves": lambda: {"z": jnp.zeros((0,)), "y": jnp.zeros((3, 0))},
    "a zero-size 2-D leaf": lambda: {"z": jnp.zeros((3, 0)), "w": _leaf((4,))},
    "transposed numpy (non-contiguous)": lambda: {"w": _np_leaf((3, 4)).T, "b": _np_leaf((3,), 1)},
    "strided numpy view": lambda: {"w": np.arange(40, dtype=np.float32)[::3] / 40, "b": _np_leaf((3,), 1)},
    "Fortran-order numpy": lambda: {"w": np.asfortranarray(_np_leaf((4, 3))), "b": _np_leaf((3,), 1)},
    "broadcast (stride-0) numpy view": lambda: {"w": np.broadcast_to(_np_leaf((3,)), (4, 3)), "b": _np_leaf((3,), 1)},
    "read-only numpy": _read_only,
    "float64 numpy leaves": lambda: {"w": _np_leaf((4, 3)).astype(np.float64), "b": _np_leaf((3,), 1).astype(np.float64)},
    "bfloat16 leaves": lambda: {"w": _leaf((4, 3), "bfloat16"), "b": _leaf((3,), "bfloat16")},
    "float16 leaves": lambda: {"w": _leaf((4, 3), "float16"), "b": _leaf((3,), "float16")},
    "mixed dtypes": lambda: {"a": _leaf((4, 3)), "b": _leaf((3,), "bfloat16"), "c": _leaf((2,), "float16")},
    "deep nesting (40 levels)": lambda: _deep(40),
    "a flax struct dataclass": _struct_tree,
    "a leaf committed to device 3": lambda: {"w": jax.device_put(_leaf((4, 3)), jax.devices()[3]), "b": _leaf((3,))},
    "a leaf sharded over data": lambda: {"w": jax.device_put(_leaf((8, 3)), jax.sharding.NamedSharding(
        data_mesh(), P("data"))), "b": _leaf((3,))},
}


def tree_case(label: str, entry: str) -> tuple[str, str]:
    tree = TREES[label]()
    if entry == "train (ZeRO-1)":
        return train_check(tree, optax.adam(0.05), base_config(), loss=user_tree_loss)
    if entry == "train (ZeRO-3)":
        return train_check(tree, optax.adam(0.05), base_config(shard_params=True), loss=user_tree_loss)
    if entry == "GradSync values":
        with acting():
            sync = jd.GradSync(tree, data_mesh(), bucket_size=8)
        return sync_check(sync)
    if entry == "checkpoint moved to bucket_size=5":
        return checkpoint_relaid(tree)
    return checkpoint_round_trip(tree)


def checkpoint_relaid(tree) -> tuple[str, str]:
    """A trained state saved from a step with bucket_size=8 and restored into one with 5: the
    optimizer's master weights, unflattened by leaf order, the same bit for bit."""
    batch, directory = make_batches(16, 1)[0], new_dir("relaid")
    with acting():
        first = jd.make_train_step(tree, user_tree_loss, optax.adam(0.05), data_mesh(), base_config(donate=False),
                                   example_batch=batch)
        state, _ = first(first.init(), batch)
        jd.save_checkpoint(directory, state)
        second = jd.make_train_step(tree, user_tree_loss, optax.adam(0.05), data_mesh(), base_config(bucket_size=5),
                                    example_batch=batch)
        restored, _ = jd.restore_checkpoint(directory, second.abstract_state())
        got = second.optimizer.unflatten_master(restored.opt_state.master)
    return bitwise(got, first.optimizer.unflatten_master(state.opt_state.master), "master weights")


def checkpoint_round_trip(tree) -> tuple[str, str]:
    """Saves ``tree`` as step 1 and restores it into its own shapes (replicated): bit for bit."""
    directory = new_dir("tree")
    whole = jax.sharding.NamedSharding(data_mesh(), P())
    with acting():
        jd.save_checkpoint(directory, tree, step=1)
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=whole), tree)
        restored, _ = jd.restore_checkpoint(directory, target)
    return bitwise(restored, tree)


def bitwise(got, want, what: str = "restored") -> tuple[str, str]:
    """``correct`` iff the trees have one structure and every leaf the same dtype, shape, bytes."""
    got_leaves, got_def = jax.tree.flatten(got)
    want_leaves, want_def = jax.tree.flatten(want)
    if got_def != want_def:
        return "silent", f"{what}: another tree structure ({str(got_def)[:80]} vs {str(want_def)[:80]})"
    for path, g, w in zip(leaf_names(want), got_leaves, want_leaves):
        g, w = _raw(g), _raw(w)
        if g.dtype != w.dtype or g.shape != w.shape or g.tobytes() != w.tobytes():
            return "silent", f"{what} {path}: {g.dtype}{list(g.shape)} differs from the saved {w.dtype}{list(w.shape)}"
    return "correct", f"{what}: bit for bit"


def _raw(x) -> np.ndarray:
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.ascontiguousarray(np.asarray(jax.device_get(x)))


TREE_ENTRIES = ("train (ZeRO-1)", "train (ZeRO-3)", "GradSync values", "checkpoint round trip",
                "checkpoint moved to bucket_size=5")


def tree_cases() -> list[Case]:
    return [Case("trees", f"{label} [{entry}]", tree_case, (label, entry), (), "either",
                 f"{entry} of a params tree: {label}") for label in TREES for entry in TREE_ENTRIES]


# -- area: odd meshes ----------------------------------------------------------------------------


def _grid(shape, names, reverse: bool = False):
    devices = np.array(jax.devices()[: math.prod(shape)])
    return Mesh((devices[::-1] if reverse else devices).reshape(shape), names)


def _explicit():
    return jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


MESHES: dict[str, tuple[Callable[[], Any], dict | Callable[[], dict]]] = {
    "1 device": (lambda: data_mesh(1), {}),
    "2 devices": (lambda: data_mesh(2), {}),
    "3 devices": (lambda: data_mesh(3), {}),
    "5 devices": (lambda: data_mesh(5), {}),
    "6 devices": (lambda: data_mesh(6), {}),
    "7 devices": (lambda: data_mesh(7), {}),
    "8 devices in reverse order": (lambda: _grid((8,), ("data",), reverse=True), {}),
    "(data=4, model=2), params replicated": (lambda: _grid((4, 2), ("data", "model")), {}),
    "(model=2, data=4)": (lambda: _grid((2, 4), ("model", "data")), {}),
    "(replica=2, data=4), outer_axis='replica'": (lambda: _grid((2, 4), ("replica", "data")), {"outer_axis": "replica"}),
    "(replica=2, data=4), no outer_axis": (lambda: _grid((2, 4), ("replica", "data")), {}),
    "(data=4, model=2), gspmd, w split over model": (lambda: _grid((4, 2), ("data", "model")), lambda: {
        "tensor_parallel": "gspmd", "param_specs": {"w": P("model", None), "b": P()}}),
    "(data=8, model=1)": (lambda: _grid((8, 1), ("data", "model")), {}),
    "(data=1, model=8)": (lambda: _grid((1, 8), ("data", "model")), {}),
    "(data=3, model=2)": (lambda: _grid((3, 2), ("data", "model")), {}),
    "axis 'batch' only (config axis='data')": (lambda: data_mesh(DEVICES, "batch"), {}),
    "axis 'batch', TrainConfig(axis='batch')": (lambda: data_mesh(DEVICES, "batch"), {"axis": "batch"}),
    "Explicit axis types": (_explicit, {}),
    "a list of devices": (lambda: jax.devices(), {}),
    "an AbstractMesh": (lambda: data_mesh().abstract_mesh, {}),
}
MESH_ENTRIES = ("train (ZeRO-1)", "train (ZeRO-3)", "GradSync values", "scanned stack", "checkpoint moved here")


def mesh_case(label: str, entry: str) -> tuple[str, str]:
    make, overrides = MESHES[label]
    mesh, overrides = make(), overrides() if callable(overrides) else overrides
    if entry == "GradSync values":
        kwargs = {k: v for k, v in overrides.items() if k in ("outer_axis", "tensor_parallel", "param_specs")}
        if "param_specs" in kwargs:
            kwargs.pop("param_specs")
        with acting():
            sync = jd.GradSync(base_params(), mesh, axis=overrides.get("axis", "data"), bucket_size=8, **kwargs)
        return sync_check(sync)
    if entry == "scanned stack":
        specs = {k: v for k, v in overrides.items() if k != "param_specs"}
        return train_check(scan_params(), optax.adam(0.05), base_config(scan_layers=True, **specs), mesh=mesh,
                           loss=user_scan_loss)
    if entry == "checkpoint moved here":
        return checkpoint_moved(mesh, overrides)
    config = base_config(shard_params=entry == "train (ZeRO-3)", **overrides)
    return train_check(base_params(), optax.adam(0.05), config, mesh=mesh)


def checkpoint_moved(mesh, overrides: dict) -> tuple[str, str]:
    """The fixture checkpoint (8 devices) restored into a step on ``mesh``: the same master weights."""
    directory, fixture, saved = ckpt_fixture()
    with acting():
        step = jd.make_train_step(base_params(), user_loss, optax.adam(0.05), mesh, base_config(**overrides),
                                  example_batch=make_batches(2 * data_size(mesh, base_config(**overrides)), 1)[0])
        state, _ = jd.restore_checkpoint(directory, step.abstract_state())
        got = step.master_params(state)
    want = fixture.master_params(saved[2])
    return bitwise(got, want, "master weights")


def mesh_cases() -> list[Case]:
    return [Case("meshes", f"{label} [{entry}]", mesh_case, (label, entry), (), "either",
                 f"{entry} on a mesh of {label}") for label in MESHES for entry in MESH_ENTRIES]


# -- area: ZeRO-3 --------------------------------------------------------------------------------

ZERO3_CONFIGS = {
    "reshard_after_forward=False": {"reshard_after_forward": False},
    "microbatches=2": {"microbatches": 2},
    "gather_max_in_flight=None": {"gather_max_in_flight": None},
    "gather_max_in_flight=1": {"gather_max_in_flight": 1},
    "gather_max_in_flight=2": {"gather_max_in_flight": 2},
    "gather_max_in_flight=100": {"gather_max_in_flight": 100},
    "param_dtype=bfloat16": {"param_dtype": "bfloat16"},
    "split_leaves": {"split_leaves": True},
    "bucket_size=1": {"bucket_size": 1},
    "bucket_size=None": {"bucket_size": None},
    "reduce='bf16'": {"reduce": "bf16"},
    "reduce='int8_accum'": {"reduce": "int8_accum"},
    "reduce='fp32_accum_streamed'": {"reduce": "fp32_accum_streamed"},
    "drain=False": {"drain": False},
    "donate=False": {"donate": False},
    "skip_grad_norm_above=1e-6": {"skip_grad_norm_above": 1e-6},
}


def zero3_config_case(label: str) -> tuple[str, str]:
    overrides = ZERO3_CONFIGS[label]
    return train_check(base_params(), optax.adam(0.05), base_config(shard_params=True, **overrides))


def zero3_special_case(label: str) -> tuple[str, str]:
    if label == "scanned stack":
        return train_check(scan_params(), optax.adam(0.05), base_config(shard_params=True, scan_layers=True),
                           loss=user_scan_loss)
    if label == "nnx model":
        swap = nnx_swap()
        return train_check(swap.value, optax.adam(0.05), base_config(shard_params=True), loss=user_nnx_loss,
                           ref_params=swap.ref_params, ref_loss=swap.ref_loss)
    if label == "a ZeRO-1 state into a ZeRO-3 step":
        step = other_step(shard_params=True)
        with acting("shard_params", "state"):
            result = step(other_step().init(), make_batches(16, 1)[0])
        return _one_step(result, make_batches(16, 1)[0])
    if label.startswith("checkpoint"):
        source, target = ({"shard_params": True}, {}) if "ZeRO-3 -> ZeRO-1" in label else ({}, {"shard_params": True})
        first = other_step(donate=False, **source)
        state, _ = first(first.init(), make_batches(16, 1)[0])
        directory = new_dir("zero3")
        with acting():
            jd.save_checkpoint(directory, state)
            second = other_step(**target)
            restored, _ = jd.restore_checkpoint(directory, second.abstract_state())
            got = second.master_params(restored)
        return bitwise(got, first.master_params(state), "master weights")
    if label == "update_model from a ZeRO-3 state":
        model = UserMLP.make()
        step = jd.make_train_step(model, user_nnx_loss, optax.adam(0.05), data_mesh(), base_config(shard_params=True),
                                  example_batch=make_batches(16, 1)[0])
        with acting():
            state, _ = step(step.init(), make_batches(16, 1)[0])
            fresh = UserMLP.make(3)
            step.update_model(fresh, state)
            want = step.master_params(state)
        return bitwise(nnx.to_pure_dict(nnx.state(fresh, nnx.Param)), want, "model parameters")
    raise ValueError(label)


ZERO3_SPECIAL = ("scanned stack", "nnx model", "a ZeRO-1 state into a ZeRO-3 step", "checkpoint ZeRO-3 -> ZeRO-1",
                 "checkpoint ZeRO-1 -> ZeRO-3", "update_model from a ZeRO-3 state")


def zero3_cases() -> list[Case]:
    cases = [Case("zero3", f"shard_params + {label}", zero3_config_case, (label,), (), "works",
                  f"TrainConfig(bucket_size=8, shard_params=True, {label}) on the toy problem vs one-device optax")
             for label in ZERO3_CONFIGS]
    cases += [Case("zero3", label, zero3_special_case, (label,), ("shard_params",), "either",
                   f"ZeRO-3: {label}") for label in ZERO3_SPECIAL]
    return cases


# -- area: checkpoints ---------------------------------------------------------------------------

WORK = pathlib.Path(tempfile.gettempdir())  # a worker's own scratch directory (set in worker_main)
_dirs = itertools.count()


def new_dir(label: str = "ckpt") -> pathlib.Path:
    """A fresh path under the worker's scratch directory (not created)."""
    return WORK / f"{label}{next(_dirs)}"


@functools.cache
def ckpt_fixture():
    """Steps 1 and 2 of the toy step saved in one directory; the host values of both states."""
    step = other_step(donate=False)
    directory = WORK / "fixture"
    state, saved = step.init(), {}
    for i, batch in enumerate(make_batches(16, 2), 1):
        state, _ = step(state, batch)
        jd.save_checkpoint(directory, state, extra={"i": i})
        saved[i] = host(state)
    return directory, step, saved


@functools.cache
def live_state():
    """Step 2 of the fixture as device arrays (a state to save)."""
    directory, step, _ = ckpt_fixture()
    return jd.restore_checkpoint(directory, step.abstract_state(), step=2)[0]


def fresh_copy() -> pathlib.Path:
    target = new_dir("copy")
    shutil.copytree(ckpt_fixture()[0], target)
    return target


def _call(make, ctx):
    """Edge values of checkpoint arguments may need the case's directory (``ctx``)."""
    import inspect

    return make(ctx) if inspect.signature(make).parameters else make()


def _file_in(ctx) -> pathlib.Path:
    path = ctx["dir"].parent / f"{ctx['dir'].name}.txt"
    path.write_text("not a checkpoint")
    return path


def _other_model_dir(ctx) -> pathlib.Path:
    ctx["dir"].mkdir(parents=True, exist_ok=True)
    jd.save_checkpoint(ctx["dir"], {"other": jnp.ones(3)}, step=1)
    return ctx["dir"]


SAVE_EDGES = {
    "directory": {"an existing file": _file_in, "a new nested path": valid(lambda ctx: ctx["dir"] / "a" / "b"),
                  "a relative path": valid(lambda ctx: os.path.relpath(ctx["dir"])),
                  "bytes": lambda ctx: str(ctx["dir"]).encode(), "pathlib.Path": valid(lambda ctx: ctx["dir"]),
                  "another model's directory": _other_model_dir},
    "state": {"a consumed state": consumed_state, "an abstract state": lambda: base_step().abstract_state(),
              "host numpy state": valid(lambda: jax.device_get(live_state())),
              "NaN and inf values": valid(lambda: {"w": jnp.asarray([np.nan, np.inf, -np.inf, 1.0])}),
              "a dict of numpy arrays": valid(lambda: {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}),
              "a PRNG key leaf": lambda: {"key": jax.random.key(0), "w": jnp.ones(3)},
              "a Python float leaf": lambda: {"w": 1.5}, "a zero-size leaf": valid(lambda: {"z": jnp.zeros((0, 3))}),
              "bfloat16 leaves": valid(lambda: {"w": jnp.ones(4, jnp.bfloat16)}),
              "int8 and bool leaves": valid(lambda: {"i": jnp.arange(4, dtype=jnp.int8), "m": jnp.ones(2, bool)})},
    "step": {"np.int64(7)": valid(lambda: np.int64(7)), "7.0": _const(7.0), "'7'": _const("7"), "-5": _const(-5),
             "10**12": valid(_const(10**12)), "an existing step (2)": _const(2)},
    "extra": {"{1: 2}": _const({1: 2}), "{'a': nan}": _const({"a": float("nan")}), "{'t': (1, 2)}": _const({"t": (1, 2)}),
              "{'big': 'x' * 10**7}": valid(lambda: {"big": "x" * 10**7}),
              "{'np': np.float32(1)}": lambda: {"np": np.float32(1)}, "{'arr': np.ones(2)}": lambda: {"arr": np.ones(2)},
              "[1, 2]": _const([1, 2]), "{'a': {'b': [1, {'c': None}]}}": valid(_const({"a": {"b": [1, {"c": None}]}}))},
    "max_to_keep": {"1": valid(_const(1)), "2": valid(_const(2))},
}


def save_case(fn_name: str, arg: str, make) -> tuple[str, str]:
    ctx = {"dir": new_dir("save")}
    kwargs = {"directory": ctx["dir"], "state": live_state(), "step": None, "extra": {"note": 1}, "max_to_keep": None}
    if arg in ("state", "max_to_keep"):
        kwargs["step"] = 5
    if arg == "max_to_keep":
        jd.save_checkpoint(ctx["dir"], live_state(), step=1)
    kwargs[arg] = _call(make, ctx)
    directory, state = kwargs.pop("directory"), kwargs.pop("state")
    with acting():
        if fn_name == "save_checkpoint":
            out = jd.save_checkpoint(directory, state, **kwargs)
        else:
            pending = jd.save_checkpoint_async(directory, state, **kwargs)
            out = pending.wait()
            pending.done()
    return verify_saved(directory, state, kwargs["step"], kwargs["extra"], out)


def verify_saved(directory, state, step, extra, out) -> tuple[str, str]:
    """A save that returned must be on disk, as asked: its step number, values bit for bit, extra."""
    try:
        saved_as = int(pathlib.Path(out).name)
        wanted = state.step if step is None else step
        if float(wanted) != saved_as:
            return "silent", f"saved as step {saved_as} for step={step!r}"
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(
            x, "sharding", None) or jax.sharding.NamedSharding(data_mesh(1), P())), state)
        restored, got_extra = jd.restore_checkpoint(directory, target, step=saved_as)
    except Exception as error:  # noqa: BLE001 - the save returned: not restoring it is the fault
        return "silent", f"the save returned, but restoring it fails: {type(error).__name__}: {str(error)[:200]}"
    if not same_json(got_extra, {} if extra is None else extra):
        return "silent", f"extra comes back as {str(got_extra)[:80]} for {str(extra)[:80]}"
    return bitwise(restored, state)


def same_json(a, b) -> bool:
    """Equal, types included (a tuple is not a list, 1 is not '1'); NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


@dataclasses.dataclass
class Target:
    """A restore target and the step it belongs to (its master weights are compared)."""

    value: Any
    step: Any


def _target(**config):
    step = other_step(**config)
    return Target(step.abstract_state(), step)


def _target_on(n: int):
    step = jd.make_train_step(base_params(), user_loss, optax.adam(0.05), data_mesh(n), base_config(),
                              example_batch=make_batches(2 * n, 1)[0])
    return Target(step.abstract_state(), step)


def _other_model_target():
    params = {"w": jnp.zeros((D_IN + 1, D_OUT)), "b": jnp.zeros(D_OUT)}
    step = jd.make_train_step(params, user_loss, optax.adam(0.05), data_mesh(), base_config(),
                              example_batch=make_batches(16, 1, features=D_IN + 1)[0])
    return Target(step.abstract_state(), step)


def _renamed_step(ctx, name: str = "007"):
    """Step 2's directory renamed: ``007`` is still step 2's data (orbax can name steps zero-padded),
    a ``.orbax-checkpoint-tmp`` name is a save in progress (the newest finished step is then 1)."""
    (ctx["dir"] / "2").rename(ctx["dir"] / name)
    ctx["newest"] = 1 if "tmp" in name else 2
    return ctx["dir"]


RESTORE_EDGES = {
    "directory": {"a missing directory": lambda ctx: ctx["dir"] / "missing", "a file": _file_in,
                  "an empty directory": lambda ctx: (ctx["dir"] / "empty").mkdir() or ctx["dir"] / "empty",
                  "the step directory (dir/2)": lambda ctx: ctx["dir"] / "2",
                  "a relative path": valid(lambda ctx: os.path.relpath(ctx["dir"])),
                  "bytes": lambda ctx: str(ctx["dir"]).encode(),
                  "step 2 renamed '007'": _renamed_step,
                  "step 2 renamed '2.orbax-checkpoint-tmp-1'": lambda ctx: _renamed_step(
                      ctx, "2.orbax-checkpoint-tmp-1")},
    "target": {"a concrete state": valid(lambda: Target(base_step().init(), base_step())),
               "a ZeRO-3 step's abstract_state": valid(lambda: _target(shard_params=True)),
               "bucket_size=4's abstract_state": valid(lambda: _target(bucket_size=4)),
               "a 4-device step's abstract_state": valid(lambda: _target_on(4)),
               "another model's abstract_state": _other_model_target,
               "another tx's abstract_state (sgd)": lambda: Target(other_step("sgd").abstract_state(), None),
               "params only": lambda: base_step().abstract_state().params,
               "no shardings": lambda: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype),
                                                    base_step().abstract_state()),
               "param_dtype=bf16 step's abstract_state": lambda: _target(param_dtype="bfloat16"),
               "abstract_state with bfloat16 params": lambda: Target(base_step().abstract_state()._replace(
                   params=jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16, sharding=s.sharding),
                                       base_step().abstract_state().params)), None)},
    "step": {"1": valid(_const(1)), "2": valid(_const(2)), "np.int64(1)": valid(lambda: np.int64(1)), "'1'": _const("1"),
             "1.0": _const(1.0), "3 (not saved)": _const(3), "-1": _const(-1)},
}


def restore_case(arg: str, make) -> tuple[str, str]:
    directory, fixture, saved = ckpt_fixture()
    ctx = {"dir": fresh_copy()}
    kwargs = {"directory": ctx["dir"], "target": fixture.abstract_state(), "step": None}
    value = _call(make, ctx)
    kwargs[arg] = value.value if isinstance(value, Target) else value
    owner = value.step if isinstance(value, Target) else fixture
    with acting():
        state, extra = jd.restore_checkpoint(kwargs["directory"], kwargs["target"], step=kwargs["step"])
        got = owner.master_params(state) if owner is not None and isinstance(state, jd.TrainState) else None
    k = extra.get("i") if isinstance(extra, dict) else None
    if kwargs["step"] is not None and (k is None or float(kwargs["step"]) != k):
        return "silent", f"restored step {k} for step={kwargs['step']!r}"
    if k not in saved:
        return "silent", f"restored something that is no saved step (extra {extra!r})"
    newest = ctx.get("newest", 2)
    if kwargs["step"] is None and k != newest:
        latest = _outcome(lambda _: jd.latest_step(kwargs["directory"]), 0)
        return "silent", (f"restored step {k} (with a warning that the newer one is damaged), not the newest intact "
                          f"step {newest}'s data; latest_step() says {latest!r}")
    if jax.tree.structure(state) == jax.tree.structure(saved[k]):
        return bitwise(state, saved[k])
    if got is None:
        return "silent", f"restored into another structure: {str(jax.tree.structure(state))[:100]}"
    return bitwise(got, fixture.master_params(saved[k]), "master weights")


LATEST_EDGES = {"the fixture": valid(lambda ctx: ctx["dir"]), "a missing directory": valid(lambda ctx: ctx["dir"] / "no"),
                "a file": _file_in,
                "a step being written": valid(lambda ctx: (ctx["dir"] / "3.orbax-checkpoint-tmp-9").mkdir() or ctx["dir"]),
                "a step directory without metadata": valid(lambda ctx: (ctx["dir"] / "4").mkdir() or ctx["dir"])}


def latest_case(make) -> tuple[str, str]:
    ctx = {"dir": fresh_copy()}
    value = _call(make, ctx)
    with acting():
        got = jd.latest_step(value)
    want = 2 if isinstance(value, (str, os.PathLike)) and pathlib.Path(value) == ctx["dir"] else None
    return ("correct", f"latest_step = {got}") if got == want else ("silent", f"latest_step = {got!r}, want {want!r}")


# -- damaged files ---

DAMAGES = ("truncated to half", "deleted", "16 bytes flipped", "emptied", "replaced by step 1's file")
DAMAGE_MODES = ("restore latest", "restore step=2", "save step 3, restore latest")


def damage_file(path: pathlib.Path, damage: str, other: pathlib.Path) -> None:
    data = path.read_bytes()
    if damage == "truncated to half":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "deleted":
        path.unlink()
    elif damage == "16 bytes flipped":
        flipped = bytearray(data)
        for i in range(16):
            if flipped:
                flipped[(len(flipped) // 2 + 7 * i) % len(flipped)] ^= 0xFF
        path.write_bytes(bytes(flipped))
    elif damage == "emptied":
        path.write_bytes(b"")
    else:
        shutil.copyfile(other, path)


def damage_case(relpath: str, damage: str, mode: str) -> tuple[str, str]:
    _, fixture, saved = ckpt_fixture()
    directory = fresh_copy()
    damage_file(directory / "2" / relpath, damage, directory / "1" / relpath)
    with acting("damaged", "corrupt", "checksum"):
        if mode == "restore latest":
            state, extra = jd.restore_checkpoint(directory, fixture.abstract_state())
        elif mode == "restore step=2":
            state, extra = jd.restore_checkpoint(directory, fixture.abstract_state(), step=2)
        else:
            jd.save_checkpoint(directory, live_state(), step=3, extra={"i": 3})
            state, extra = jd.restore_checkpoint(directory, fixture.abstract_state())
    k = extra.get("i") if isinstance(extra, dict) else None
    allowed = {"restore latest": (1, 2), "restore step=2": (2,), "save step 3, restore latest": (3,)}[mode]
    if k not in allowed:
        return "silent", f"restored extra {extra!r}: not step {' or '.join(map(str, allowed))}"
    return bitwise(state, saved[2 if k == 3 else k])


def file_kinds(step_dir: pathlib.Path) -> list[tuple[str, str]]:
    """One file of each type in a saved step directory: ``(kind, path relative to it)``."""
    kinds: dict[str, str] = {}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(step_dir).as_posix()
        parts = rel.split("/")
        kind = rel
        if parts[0] == "state" and len(parts) == 3 and parts[1] != "array_metadatas":
            key = parts[1]
            role = ("params" if key.startswith("params") else "step" if key == "step" else
                    "master shard" if ".master." in key else "tx shards" if ".shards." in key else "tx scalar")
            chunk = ".zarray" if parts[2] == ".zarray" else (
                "chunk 0" if set(parts[2].split(".")) == {"0"} else "chunk k>0")
            kind = f"state/<{role}>/{chunk}"
        kinds.setdefault(kind, rel)
    return sorted(kinds.items())


# -- concurrent saves ---

CONCURRENT = (("distinct steps", 2), ("distinct steps", 4), ("distinct steps", 8), ("the same step", 2),
              ("the same step", 4), ("the same step", 8), ("async saves without wait", 2),
              ("async saves without wait", 4), ("async then sync without wait", 1),
              ("restore while saving", 4), ("async save, then the step donates the state", 1),
              ("async save of numpy arrays changed after", 1), ("max_to_keep=2", 4),
              ("two directories at once", 4), ("saves from a thread while training", 3))


def concurrent_case(kind: str, n: int) -> tuple[str, str]:
    live, directory = live_state(), new_dir("conc")
    want = host(live)
    outcomes: dict[int, Any] = {}

    def run_threads(fn, count):
        threads = [threading.Thread(target=lambda i=i: outcomes.__setitem__(i, _outcome(fn, i))) for i in range(count)]
        for t in threads:
            t.start()
        deadline = time.time() + 30  # a save of this state takes well under a second
        for t in threads:
            t.join(max(0.0, deadline - time.time()))
        if any(t.is_alive() for t in threads):
            raise Verdict("hang", f"{sum(t.is_alive() for t in threads)} of {count} thread(s) still running after 30 s")

    if kind == "distinct steps":
        run_threads(lambda i: jd.save_checkpoint(directory, live, step=10 + i, extra={"i": i}), n)
        return judge_saves(outcomes, lambda i: (directory, 10 + i, want, {"i": i}))
    if kind == "the same step":
        run_threads(lambda i: jd.save_checkpoint(directory, live, step=7, extra={"i": i}), n)
        done = [i for i, o in outcomes.items() if not isinstance(o, BaseException)]
        if len(done) > 1:
            return "silent", f"{len(done)} saves of step 7 returned without an error; one is on disk"
        return judge_saves(outcomes, lambda i: (directory, 7, want, {"i": i}))
    if kind in ("async saves without wait", "async then sync without wait"):
        pendings = {}
        for i in range(n):
            pendings[i] = _outcome(lambda i: jd.save_checkpoint_async(directory, live, step=20 + i, extra={"i": i}), i)
        if kind == "async then sync without wait":
            outcomes[n] = _outcome(lambda i: jd.save_checkpoint(directory, live, step=20 + i, extra={"i": i}), n)
        for i, pending in pendings.items():
            outcomes[i] = pending if isinstance(pending, BaseException) else _outcome(lambda i: pending.wait(), i)
        return judge_saves(outcomes, lambda i: (directory, 20 + i, want, {"i": i}))
    if kind == "restore while saving":
        copy = fresh_copy()
        _, fixture, saved = ckpt_fixture()
        run_threads(lambda i: jd.save_checkpoint(copy, live, step=30, extra={"i": 30}) if i == 0 else
                    jd.restore_checkpoint(copy, fixture.abstract_state()), n)
        for i, out in outcomes.items():
            if isinstance(out, BaseException):
                return classify(out, ())
            if i and not (out[1].get("i") in (2, 30) and bitwise(out[0], saved[2])[0] == "correct"):
                return "silent", f"a restore during a save returned extra {out[1]!r} or other values"
        return judge_saves({0: outcomes[0]}, lambda i: (copy, 30, want, {"i": 30}))
    if kind == "async save, then the step donates the state":
        step = base_step()
        state, _ = step(step.init(), make_batches(16, 1)[0])
        before = host(state)
        with acting():
            pending = jd.save_checkpoint_async(directory, state, step=1)
            step(state, make_batches(16, 1)[0])
            pending.wait()
        return judge_saves({0: directory / "1"}, lambda i: (directory, 1, before, None))
    if kind == "async save of numpy arrays changed after":
        array = np.ones(1000, np.float32)
        with acting():
            pending = jd.save_checkpoint_async(directory, {"w": array}, step=1)
            array[:] = 7
            pending.wait()
        return judge_saves({0: directory / "1"}, lambda i: (directory, 1, {"w": np.ones(1000, np.float32)}, None))
    if kind == "max_to_keep=2":
        run_threads(lambda i: jd.save_checkpoint(directory, live, step=40 + i, extra={"i": i}, max_to_keep=2), n)
        newest = sorted(i for i, o in outcomes.items() if not isinstance(o, BaseException))[-2:]
        return judge_saves({i: outcomes[i] for i in outcomes if i in newest or isinstance(outcomes[i], BaseException)},
                           lambda i: (directory, 40 + i, want, {"i": i}))
    if kind == "two directories at once":
        run_threads(lambda i: jd.save_checkpoint(f"{directory}_{i % 2}", live, step=50 + i, extra={"i": i}), n)
        return judge_saves(outcomes, lambda i: (pathlib.Path(f"{directory}_{i % 2}"), 50 + i, want, {"i": i}))
    if kind == "saves from a thread while training":
        step = base_step()
        thread = threading.Thread(target=lambda: [outcomes.__setitem__(i, _outcome(
            lambda i: jd.save_checkpoint(directory, live, step=60 + i, extra={"i": i}), i)) for i in range(n)])
        thread.start()
        state = step.init()
        with acting():
            for batch in make_batches(16, n):
                state, _ = step(state, batch)
        thread.join(30)
        if thread.is_alive():
            raise Verdict("hang", "the saving thread still runs 30 s after training ended")
        return judge_saves(outcomes, lambda i: (directory, 60 + i, want, {"i": i}))
    raise ValueError(kind)


def _outcome(fn, i):
    try:
        return fn(i)
    except Exception as error:  # noqa: BLE001 - judged by judge_saves
        return error


def judge_saves(outcomes: dict, expected: Callable[[int], tuple]) -> tuple[str, str]:
    """Every save that returned is restorable as saved; errors classified; the worst wins."""
    verdicts = []
    for i, out in sorted(outcomes.items()):
        if isinstance(out, BaseException):
            verdicts.append(classify(out, ()))
            continue
        directory, step, want, extra = expected(i)
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=jax.sharding.NamedSharding(
            data_mesh(1), P())), want)
        try:
            restored, got_extra = jd.restore_checkpoint(directory, target, step=step)
        except Exception as error:  # noqa: BLE001
            verdicts.append(("silent", f"save {i} returned, but step {step} does not restore: "
                                       f"{type(error).__name__}: {str(error)[:160]}"))
            continue
        if extra is not None and got_extra != extra:
            verdicts.append(("silent", f"step {step} holds extra {got_extra!r}, saved {extra!r}"))
            continue
        verdicts.append(bitwise(restored, want, f"step {step}"))
    order = ("silent", "obscure_error", "clear_error", "correct")
    worst = min(verdicts, key=lambda v: order.index(v[0]) if v[0] in order else -1)
    if worst[0] == "correct":
        return "correct", f"each of the {len(verdicts)} saves restores bit for bit"
    return worst


# -- interrupted saves ---

KILLED_SIZE = 4_000_000
CHILD = r"""
import os, sys, time
import jax_drain as jd
import jax.numpy as jnp
directory, mode, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
state = lambda k: {"w": jnp.arange(size, dtype=jnp.float32) * k, "b": jnp.ones(3) * k, "n": jnp.asarray(k, jnp.int32)}
jd.save_checkpoint(directory, state(1), step=1, extra={"n": 1})
print("saving", flush=True)
if mode == "save":
    jd.save_checkpoint(directory, state(2), step=2, extra={"n": 2})
elif mode == "async+wait":
    jd.save_checkpoint_async(directory, state(2), step=2, extra={"n": 2}).wait()
elif mode == "async, then os._exit":
    jd.save_checkpoint_async(directory, state(2), step=2, extra={"n": 2})
    os._exit(3)
elif mode == "max_to_keep=1":
    jd.save_checkpoint(directory, state(2), step=2, extra={"n": 2}, max_to_keep=1)
elif mode == "two saves in a row":
    jd.save_checkpoint(directory, state(2), step=2, extra={"n": 2})
    jd.save_checkpoint(directory, state(3), step=3, extra={"n": 3})
print("saved", flush=True)
time.sleep(10)
"""
INTERRUPTS = ([("save", d, "SIGKILL") for d in (0.0, 0.05, 0.1, 0.2, 0.4, 0.8)]
              + [("save", 0.1, "SIGTERM"), ("save", 0.1, "SIGINT")]
              + [("async+wait", d, "SIGKILL") for d in (0.0, 0.1, 0.4)]
              + [("async, then os._exit", 0.0, "none")]
              + [("max_to_keep=1", d, "SIGKILL") for d in (0.05, 0.2, 0.5)]
              + [("two saves in a row", d, "SIGKILL") for d in (0.2, 0.6)])


def _killed_values(k: int) -> dict:
    return {"w": np.arange(KILLED_SIZE, dtype=np.float32) * k, "b": np.ones(3, np.float32) * k,
            "n": np.asarray(k, np.int32)}


def interrupt_case(mode: str, delay: float, signame: str) -> tuple[str, str]:
    directory = new_dir("killed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), mode, str(KILLED_SIZE)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                             start_new_session=True)
    try:
        line = child.stdout.readline()
        if line.strip() != "saving":
            return "sweep_error", f"the saving child did not start (said {line!r})"
        time.sleep(delay)
        if signame != "none":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, getattr(signal, signame))
        child.wait(120)
        ignored = signame != "none" and child.returncode == 0
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    whole = jax.sharding.NamedSharding(data_mesh(1), P())
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole), _killed_values(1))
    with acting():
        restored, extra = jd.restore_checkpoint(directory, target)
    k = extra.get("n")
    if k not in (1, 2, 3):
        return "silent", f"after the kill the newest step restores extra {extra!r}"
    verdict = bitwise(restored, _killed_values(k), f"step {k} after the kill")
    if verdict[0] != "correct":
        return verdict
    with acting():
        if k < 2:
            jd.save_checkpoint(directory, jax.tree.map(jnp.asarray, _killed_values(2)), step=2, extra={"n": 2})
        restored, extra = jd.restore_checkpoint(directory, target)
    k2 = extra.get("n")
    if k2 != max(k, 2):
        return "silent", f"after the kill and a new save of step 2, the newest step is {k2}"
    category, message = bitwise(restored, _killed_values(k2), f"step {k2} saved after the kill")
    return category, message + (f" (the process ignored {signame} and finished the save)" if ignored else "")


def checkpoint_cases(files: list[tuple[str, str]]) -> list[Case]:
    cases = []
    for fn_name in ("save_checkpoint", "save_checkpoint_async"):
        for arg, own in SAVE_EDGES.items():
            for label, make in values(own).items():
                cases.append(Case("checkpoint", f"{fn_name}({arg}={label})", save_case, (fn_name, arg, make),
                                  (arg,), "works" if getattr(make, "valid", False) else "either",
                                  f"jd.{fn_name}(new dir, live TrainState, {arg}={label}) then restore it"))
    for arg, own in RESTORE_EDGES.items():
        for label, make in values(own).items():
            cases.append(Case("checkpoint", f"restore_checkpoint({arg}={label})", restore_case, (arg, make), (arg,),
                              "works" if getattr(make, "valid", False) else "either",
                              f"jd.restore_checkpoint(copy of steps 1, 2, {arg}={label})"))
    for label, make in values(LATEST_EDGES).items():
        cases.append(Case("checkpoint", f"latest_step({label})", latest_case, (make,), ("directory",),
                          "works" if getattr(make, "valid", False) else "either", f"jd.latest_step({label})"))
    for kind, rel in files:
        for damage in DAMAGES:
            for mode in DAMAGE_MODES:
                cases.append(Case("checkpoint", f"{kind} {damage}: {mode}", damage_case, (rel, damage, mode),
                                  (), "either", f"steps 1, 2 saved; 2/{rel} {damage}; {mode}"))
    for kind, n in CONCURRENT:
        cases.append(Case("checkpoint", f"concurrent: {kind} (x{n})", concurrent_case, (kind, n), (), "works",
                          f"{n} thread(s): {kind}; every save that returned must restore", timeout=300, isolated=True))
    for mode, delay, signame in INTERRUPTS:
        name = f"interrupted: {mode}" + ("" if signame == "none" else f", {signame} after {delay} s")
        cases.append(Case("checkpoint", name, interrupt_case, (mode, delay, signame), (), "works",
                          f"a process saving step 2 ({mode}) killed ({signame}) {delay} s in; restore, save again",
                          timeout=300))
    return cases


# -- the sweep: every case, workers, reports -----------------------------------------------------

AREAS = ("config", "make_train_step", "train_step", "sync", "optimizer", "nonfinite", "trees", "meshes", "zero3",
         "checkpoint")


def all_cases(files: list[tuple[str, str]]) -> list[Case]:
    cases = (config_cases() + make_step_cases() + step_call_cases() + sync_cases() + optimizer_cases()
             + nonfinite_cases() + tree_cases() + mesh_cases() + zero3_cases() + checkpoint_cases(files))
    ids = [c.id for c in cases]
    duplicates = {i for i in ids if ids.count(i) > 1}
    assert not duplicates, f"duplicate case names: {sorted(duplicates)[:5]}"
    return cases


def run_case(case: Case) -> tuple[str, str]:
    global _current_keywords
    _current_keywords = case.keywords
    try:
        category, message = case.fn(*case.args)
    except Verdict as verdict:
        category, message = verdict.category, verdict.message
    except Exception as error:  # noqa: BLE001 - this file's own failure
        where = traceback.extract_tb(error.__traceback__)[-1]
        category, message = "sweep_error", f"{type(error).__name__}: {error} [at line {where.lineno} in {where.name}]"
    return category, " ".join(str(message).split())[:700]


def worker_main(spec_path: str) -> None:
    """Runs the listed cases, one JSON line per start and end on the original stdout."""
    global WORK
    spec = json.loads(pathlib.Path(spec_path).read_text())
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the libraries print goes to stderr
    WORK = pathlib.Path(tempfile.mkdtemp(prefix="fault_sweep_"))
    os.chdir(WORK)
    load_jax()
    import warnings

    warnings.simplefilter("ignore")
    if spec.get("discover"):
        directory = ckpt_fixture()[0]
        protocol.write(json.dumps({"event": "files", "files": file_kinds(directory / "2")}) + "\n")
    cases = {c.id: c for c in all_cases([tuple(f) for f in spec["files"]])}
    for n, case_id in enumerate(spec["ids"]):
        protocol.write(json.dumps({"event": "start", "id": case_id}) + "\n")
        # Each case in its own working directory: a relative path one case saves into ('bogus')
        # is not there for the next to find.
        os.chdir(WORK)
        (WORK / f"case{n}").mkdir()
        os.chdir(WORK / f"case{n}")
        start = time.time()
        category, message = run_case(cases[case_id])
        protocol.write(json.dumps({"event": "done", "id": case_id, "category": category, "message": message,
                                   "seconds": round(time.time() - start, 2)}) + "\n")
        if category == "hang":  # threads of it may still run (and hold locks): the next cases get a new worker
            protocol.flush()
            os._exit(0)
    protocol.close()
    shutil.rmtree(WORK, ignore_errors=True)


class Worker:
    """A worker process on a list of case ids; its protocol lines arrive on a queue."""

    def __init__(self, ids: list[str], files, logs: pathlib.Path, discover: bool = False):
        self.ids, self.done, self.current, self.started = list(ids), set(), None, time.time()
        spec = logs / f"spec{next(_dirs)}.json"
        spec.write_text(json.dumps({"ids": self.ids, "files": files, "discover": discover}))
        self.log = open(logs / f"{spec.stem}.stderr", "w+")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", str(spec)],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                     start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stderr_tail(self, limit: int = 400) -> str:
        self.log.flush()
        self.log.seek(0)
        lines = [line for line in self.log.read().splitlines() if line.strip() and "cuda" not in line.lower()]
        return " | ".join(lines[-4:])[-limit:]

    def remaining(self) -> list[str]:
        return [i for i in self.ids if i not in self.done and i != self.current]


def sweep(cases: list[Case], files, *, jobs: int, timeout: float, chunk: int, verbose: bool) -> dict[str, dict]:
    """Runs every case in workers; returns the results by case id."""
    by_id = {c.id: c for c in cases}
    pending = collections.deque(_chunks([c.id for c in cases], by_id, chunk))
    results: dict[str, dict] = {}
    logs = pathlib.Path(tempfile.mkdtemp(prefix="fault_sweep_logs_"))
    running: list[Worker] = []
    total, begun = len(cases), time.time()

    def record(case_id: str, category: str, message: str, seconds: float) -> None:
        case = by_id[case_id]
        results[case_id] = {"area": case.area, "name": case.name, "category": category, "expect": case.expect,
                            "message": message, "seconds": seconds, "repro": case.repro}
        if verbose or category in BAD:
            print(f"[{len(results)}/{total} {time.time() - begun:5.0f}s] {category:13s} {case_id}: {message[:160]}",
                  flush=True)
        elif len(results) % 50 == 0:
            print(f"[{len(results)}/{total} {time.time() - begun:5.0f}s] ...", flush=True)

    while pending or running:
        while pending and len(running) < jobs:
            running.append(Worker(pending.popleft(), files, logs))
        time.sleep(0.2)
        for worker in list(running):
            finished = _drain(worker, record)
            case = by_id.get(worker.current) if worker.current else None
            limit = (case.timeout if case and case.timeout else timeout)
            if worker.current and time.time() - worker.started > limit:
                worker.kill()
                record(worker.current, "hang", f"no result within {limit:.0f} s (killed)", limit)
                finished = True
            elif finished and worker.current:
                worker.proc.wait()
                code = worker.proc.returncode
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                record(worker.current, "crash", f"the process {how}; stderr: {worker.stderr_tail()}",
                       round(time.time() - worker.started, 2))
            elif finished and worker.remaining():
                worker.proc.wait()
                if not worker.done:  # died before its first case: not this list's fault, but do not loop
                    first = worker.remaining()[0]
                    record(first, "crash", f"the worker died before its first case: {worker.stderr_tail()}", 0.0)
            if finished:
                worker.current = None if worker.current in results else worker.current
                rest = [i for i in worker.remaining() if i not in results]
                if rest:
                    pending.appendleft(rest)
                running.remove(worker)
                worker.log.close()
    shutil.rmtree(logs, ignore_errors=True)
    return results


def _drain(worker: Worker, record) -> bool:
    """Reads a worker's protocol lines; True once its output has ended."""
    while True:
        try:
            line = worker.lines.get_nowait()
        except queue.Empty:
            return False
        if line is None:
            return True
        with contextlib.suppress(json.JSONDecodeError):
            event = json.loads(line)
            if event["event"] == "start":
                worker.current, worker.started = event["id"], time.time()
            elif event["event"] == "done":
                record(event["id"], event["category"], event["message"], event["seconds"])
                worker.done.add(event["id"])
                worker.current = None


def _chunks(ids: list[str], by_id: dict[str, Case], size: int) -> list[list[str]]:
    """Consecutive cases of one area, at most ``size`` per worker (its fixtures are reused)."""
    out: list[list[str]] = []
    for case_id in ids:
        alone = by_id[case_id].isolated or (out and by_id[out[-1][0]].isolated)
        if out and not alone and len(out[-1]) < size and by_id[out[-1][0]].area == by_id[case_id].area:
            out[-1].append(case_id)
        else:
            out.append([case_id])
    return out


def discover_files() -> list[list[str]]:
    """The file types of a saved step (a worker saves the fixture and lists them)."""
    logs = pathlib.Path(tempfile.mkdtemp(prefix="fault_sweep_logs_"))
    worker = Worker([], [], logs, discover=True)
    files = None
    for line in iter(worker.lines.get, None):
        event = json.loads(line)
        if event["event"] == "files":
            files = event["files"]
    worker.proc.wait()
    if files is None:
        raise SystemExit(f"could not save a checkpoint to list its files: {worker.stderr_tail(2000)}")
    shutil.rmtree(logs, ignore_errors=True)
    return files


# -- reports -------------------------------------------------------------------------------------


def counts_table(results: dict[str, dict]) -> list[list[str]]:
    areas = [a for a in AREAS if any(r["area"] == a for r in results.values())]
    rows = [["area", *CATEGORIES, "total"]]
    for area in areas + ["all"]:
        mine = [r for r in results.values() if area in ("all", r["area"])]
        counts = collections.Counter(r["category"] for r in mine)
        rows.append([area, *(str(counts.get(c, 0)) for c in CATEGORIES), str(len(mine))])
    return rows


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))))


def write_reports(results: dict[str, dict], out: pathlib.Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cases = [{"area": r["area"], "name": r["name"], "category": r["category"], "expect": r["expect"],
              "message": r["message"][:400], "seconds": r["seconds"]} for r in results.values()]
    counts = {row[0]: dict(zip(CATEGORIES + ("total",), map(int, row[1:]))) for row in counts_table(results)[1:]}
    (out / "fault_sweep.json").write_text(json.dumps({**meta, "counts": counts, "cases": cases}, indent=1) + "\n")
    rows = counts_table(results)
    lines = ["# Fault sweep", "",
             f"`benchmarks/fault_sweep.py{' ' + meta['options'] if meta['options'] else ''}` on {meta['commit']} "
             f"({meta['date']}, {meta['wall_s']:.0f} s wall, {meta['jobs']} job(s), {DEVICES} virtual CPU devices). "
             "Categories and bounds: the script's docstring. Rerun one case: "
             "`python benchmarks/fault_sweep.py --case 'AREA/NAME'`.", "",
             "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(f"**{c}**" if row[0] == "all" else c for c in row) + " |" for row in rows[1:]]
    for category in BAD:
        bad = [r for r in results.values() if r["category"] == category]
        if not bad:
            continue
        lines += ["", f"## {category} ({len(bad)})", ""]
        for r in sorted(bad, key=lambda r: (AREAS.index(r["area"]), r["name"])):
            lines.append(f"- `{r['area']}/{r['name']}`: {_md(r['message'][:300])}  ")
            lines.append(f"  repro: {_md(r['repro'])}")
    refused = [r for r in results.values() if r["category"] == "clear_error" and r["expect"] == "works"]
    if refused:
        lines += ["", f"## valid inputs refused with a clear error ({len(refused)})", "",
                  "Not counted as faults; listed because each is a valid input that does not train.", ""]
        lines += [f"- `{r['area']}/{r['name']}`: {_md(r['message'][:200])}" for r in
                  sorted(refused, key=lambda r: (AREAS.index(r["area"]), r["name"]))]
    (out / "fault_sweep.md").write_text("\n".join(lines) + "\n")


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--area", action="append", choices=AREAS, help="run only this area (repeatable)")
    parser.add_argument("--case", action="append", help="run only this case id, AREA/NAME (repeatable)")
    parser.add_argument("--quick", action="store_true", help="every 10th case of each area")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes at once (default 1)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a case may take before it is a hang")
    parser.add_argument("--chunk", type=int, default=250, help="cases per worker process")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--verbose", action="store_true", help="print every case as it ends")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker)
    areas = args.area or ([c.split("/")[0] for c in args.case] if args.case else AREAS)
    files = discover_files() if "checkpoint" in areas else []
    cases = [c for c in all_cases([tuple(f) for f in files]) if c.area in areas]
    if args.case:
        cases = [c for c in cases if c.id in args.case]
    if args.quick:
        cases = [c for area in AREAS for c in [c for c in cases if c.area == area][::10]]
    if args.list:
        for case in cases:
            print(f"{case.id}  [{case.expect}]")
        print(f"{len(cases)} cases")
        return None
    print(f"{len(cases)} cases in {len(set(c.area for c in cases))} areas, {args.jobs} job(s)", flush=True)
    begun = time.time()
    results = sweep(cases, files, jobs=args.jobs, timeout=args.timeout, chunk=args.chunk, verbose=args.verbose)
    rows = counts_table(results)
    print()
    print_table(rows)
    if args.case:
        for r in results.values():
            print(f"\n{r['area']}/{r['name']}: {r['category']}\n  {r['message']}")
        return None
    options = " ".join(([f"--area {a}" for a in args.area] if args.area else []) + (["--quick"] if args.quick else []))
    meta = {"commit": _commit(), "date": time.strftime("%Y-%m-%d"), "wall_s": round(time.time() - begun, 1),
            "jobs": args.jobs, "options": options}
    write_reports(results, args.out, meta)
    print(f"\nwrote {args.out / 'fault_sweep.json'} and {args.out / 'fault_sweep.md'}")


if __name__ == "__main__":
    main()
