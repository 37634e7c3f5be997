"""Gradient-sync precision: wire bytes, memory and numeric error per reduce mode and wire dtype.

For every reduce mode of :class:`jax_drain.GradSync` (drained, ~24 buckets) and, for float32
params, with and without ``wire_dtype=jnp.bfloat16``, this reports:

* **wire bytes**: the gradient-sync collectives (those under the ``jax_drain/`` named scopes,
  ``jax_drain/gather`` excluded) of one training step of a GPT block stack compiled for a
  virtual 8xH100 host (compile-only devices, XLA's real GPU pipeline; no GPU needed), read from
  the compiled schedule, with the element dtype they carry. The schedule gives each
  collective's *result* bytes (``payload_bytes``); since a reduce-scatter's result is one
  shard but an all-to-all's is the whole bucket, ``wire_bytes`` converts them to the bytes one
  device *sends* (see :func:`sent_bytes`), the number that compares across kinds.
* **XLA temp and argument bytes** of that step (``memory_analysis()``).
* **numeric error**: random per-device gradients at several scales are reduce-scattered by
  ``GradSync.reduce_scatter`` inside ``jax.shard_map`` on 8 virtual CPU devices and compared
  with the float64 mean of the very inputs (bf16 params: the bf16 values); the worst per-leaf
  ``||got - exact|| / ||exact||``. This runs a smaller tree of the same architecture (XLA:CPU's
  collectives, not NCCL's: the ``bf16`` mode's in-collective rounding may differ on GPUs).

Run ``python benchmarks/precision.py --out benchmarks/results`` (a few minutes on 2 cores) for
``precision.{md,json}``; ``--quick`` is a tiny smoke run.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

# Both before jax is imported: compile-only GPU devices need the CPU platform (and no CUDA
# libraries), and the numeric check needs 8 CPU devices next to them.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_drain as jd  # noqa: E402
from jax_drain import models, plan  # noqa: E402
from jax_drain.collectives import QUANTIZED_MODES, REDUCE_MODES  # noqa: E402
from jax_drain.planner.schedule import Collective  # noqa: E402

MODES = ("bf16", "fp32", "fp32_accum", "fp32_accum_streamed", "int8_accum", "fp8_accum", "fp16_accum",
         "int8_accum_streamed")
#: (param dtype, wire dtype): a bf16 wire for bf16 params is the default already, so it is
#: only crossed with float32 params.
CASES = (("bfloat16", None), ("float32", None), ("float32", "bfloat16"))
#: Gradient scales of the numeric check; "mixed" gives each leaf its own log-uniform scale in
#: [1e-8, 1e3], so small leaves share buckets with large ones.
SCALES = ("1e-8", "1e-3", "1", "1e3", "mixed")
#: --quick: the rows and scales the smoke test checks, (param dtype, wire dtype, reduce); each
#: GPU compile takes seconds even for a tiny model.
QUICK_RUNS = (("bfloat16", None, "fp32_accum"), ("bfloat16", None, "int8_accum"),
              ("float32", None, "fp32_accum"), ("float32", "bfloat16", "fp32_accum"))
QUICK_SCALES = ("1", "mixed")
NUM_DEVICES = 8
#: Parameter all-gathers also run under ``jax_drain/``; they are not gradient sync.
GATHER_SCOPE = "jax_drain/gather"
#: The bytes every other row is compared with: fp32_accum on a bf16 wire.
REFERENCE_MODE = "fp32_accum"


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one run measures: the compiled model and the (smaller) numeric-check model."""

    preset: str
    compiled: models.GPTConfig  # bf16 params; float32 cases replace param_dtype
    numeric: models.GPTConfig
    num_buckets: int
    scales: tuple[str, ...]
    target: str = "h100"


def with_dtype(config: models.GPTConfig, dtype: str) -> models.GPTConfig:
    """``config`` with ``param_dtype`` (the whole model then computes in it)."""
    return dataclasses.replace(config, param_dtype=jnp.dtype(dtype))


@functools.lru_cache(maxsize=None)
def layout_inputs(config: models.GPTConfig, num_buckets: int) -> tuple[Any, Any, tuple[int, ...], int]:
    """(abstract params, abstract global batch, gradient-ready order, bucket size) of a config.

    Cached: the float32 and bf16 cases of one config share the order and, since bucket sizes
    are in elements, the bucket size too.
    """
    params = models.abstract_params(config)
    batch = models.example_batch(config, NUM_DEVICES)
    order = tuple(jd.grad_ready_order(models.make_loss(config), params, batch))
    return params, batch, order, plan.bucket_size_for(params, num_buckets, NUM_DEVICES, order)


def make_sync(config: models.GPTConfig, mesh: Mesh, reduce: str, wire: str | None, num_buckets: int) -> jd.GradSync:
    """The drained GradSync every measurement uses."""
    params, _, order, bucket_size = layout_inputs(config, num_buckets)
    return jd.GradSync(params, mesh, axis="data", bucket_size=bucket_size, reduce=reduce, drain=True,
                       order=order, wire_dtype=None if wire is None else jnp.dtype(wire))


# -- wire bytes from the compiled GPU schedule -----------------------------------------------

def sent_bytes(c: Collective, group: int) -> int:
    """Bytes one device sends for ``c`` over a group of ``group`` devices.

    The schedule records each collective's result bytes ``r``. Per device, the standard
    algorithms (NCCL's ring, pairwise all-to-all) send: reduce-scatter ``(g-1) r`` (the input is
    ``g r``), all-to-all and all-gather ``(g-1)/g r``, all-reduce ``2 (g-1)/g r``,
    collective-permute ``r``. Without this a bf16 reduce-scatter would look 8x cheaper than the
    all-to-all that moves the same data.
    """
    g = c.group_size or group
    factor = {"reduce-scatter": g - 1, "all-to-all": (g - 1) / g, "all-gather": (g - 1) / g,
              "all-reduce": 2 * (g - 1) / g, "collective-permute": 1}[c.kind]
    return round(c.bytes * factor)


def collectives_summary(cs: list[Collective]) -> str:
    """``"25x all-to-all bf16"``: the collectives by kind and dtype."""
    counts = collections.Counter((c.kind, c.dtype) for c in cs)
    return ", ".join(f"{n}x {kind} {dtype}" for (kind, dtype), n in sorted(counts.items()))


def compile_row(setup: Setup, param_dtype: str, reduce: str, wire: str | None) -> dict[str, Any]:
    """Compiles one step (forward, backward, sync) for 8 compile-only GPUs; returns its row."""
    config = with_dtype(setup.compiled, param_dtype)
    mesh = plan.gpu_mesh((NUM_DEVICES,), ("data",), target=setup.target)
    params, batch, _, bucket_size = layout_inputs(config, setup.num_buckets)
    sync = make_sync(config, mesh, reduce, wire, setup.num_buckets)
    step = jax.jit(jax.shard_map(sync.value_and_grad(models.make_loss(config)), mesh=mesh,
                                 in_specs=(P(), P("data")), out_specs=(P(), sync.shard_specs())))
    report = plan.plan(step, params, batch, target=setup.target, topology=f"1x1x{NUM_DEVICES}",
                       strategy=f"{reduce}+drain", num_buckets=sync.num_buckets, bucket_size=bucket_size)
    # The planner's sync collectives: named by a jax_drain/ scope, or combined by XLA from
    # buckets (unnamed, attributed by what feeds them); a step has no gathers, but be sure.
    mine = [c for c in report.collectives if not c.in_scope(GATHER_SCOPE)]
    return dict(
        preset=setup.preset, param_dtype=param_dtype, reduce=reduce, wire_dtype=wire,
        wire_bytes=sum(sent_bytes(c, NUM_DEVICES) for c in mine),
        payload_bytes=sum(c.bytes for c in mine),
        wire_dtypes=sorted({c.dtype for c in mine}),
        collectives=collectives_summary(mine),
        temp_bytes=report.temp_bytes, argument_bytes=report.argument_bytes,
        num_buckets=sync.num_buckets, bucket_size=bucket_size, compile_s=round(report.compile_s, 1),
        params=config.num_params(), layers=config.num_layers, d_model=config.d_model, seq=config.seq_len,
        target=setup.target, num_devices=NUM_DEVICES,
    )


# -- numeric error on 8 CPU devices ----------------------------------------------------------

def cpu_mesh() -> Mesh:
    """A ("data",) mesh of the 8 virtual CPU devices."""
    devices = jax.devices("cpu")
    if len(devices) < NUM_DEVICES:
        raise RuntimeError(f"the numeric check needs {NUM_DEVICES} CPU devices, got {len(devices)}: set "
                           f"XLA_FLAGS=--xla_force_host_platform_device_count={NUM_DEVICES} before jax is imported")
    return Mesh(np.array(devices[:NUM_DEVICES]), ("data",))


def reducer(sync: jd.GradSync) -> Callable[[Any], Any]:
    """Jitted: stacked per-device gradients ``[8, *shape]`` -> the synced mean gradient tree."""
    fn = jax.jit(jax.shard_map(lambda g: sync.reduce_scatter(jax.tree.map(lambda x: x[0], g)), mesh=sync.mesh,
                               in_specs=P("data"), out_specs=sync.shard_specs()))
    # Shards to the host first: unflattening the 8-device arrays eagerly runs small all-gather
    # programs, and those deadlocked XLA:CPU's in-process collectives here (2 cores, "only 7 of
    # 8 threads arrived"). On host arrays unflatten needs no collective.
    return lambda stacked: sync.unflatten(jax.device_get(fn(stacked)))


def leaf_scales(num_leaves: int, scale: str, rng: np.random.Generator) -> list[float]:
    """Each leaf's gradient scale: ``scale`` for all, or log-uniform in [1e-8, 1e3] per leaf."""
    if scale == "mixed":
        return list(10.0 ** rng.uniform(-8, 3, size=num_leaves))
    return [float(scale)] * num_leaves


def random_gradients(params: Any, dtype: str, scale: str, seed: int) -> tuple[list[jax.Array], list[np.ndarray]]:
    """Independent normal gradients per device (leaves ``[8, *shape]`` in ``dtype``) and their
    exact float64 mean over devices, of the values as sent (bf16 params: the bf16 values)."""
    rng = np.random.default_rng(seed)
    leaves = jax.tree.leaves(params)
    stacked, exact = [], []
    for leaf, s in zip(leaves, leaf_scales(len(leaves), scale, rng)):
        g = jnp.asarray(rng.standard_normal((NUM_DEVICES, *leaf.shape), np.float32) * np.float32(s), dtype)
        stacked.append(g)
        exact.append(np.asarray(g, np.float64).mean(axis=0))
    return stacked, exact


def rel_error(got: Any, exact: np.ndarray) -> float:
    """``||got - exact|| / ||exact||`` in float64."""
    return float(np.linalg.norm(np.asarray(got, np.float64) - exact) / np.linalg.norm(exact))


def numeric_errors(setup: Setup, param_dtype: str, runs: list[tuple[str, str | None]],
                   seed: int = 0) -> dict[tuple[str, str | None], dict[str, Any]]:
    """For each (reduce, wire) of ``runs``: the worst per-leaf relative error per scale, the
    worst leaf overall and the bucket count, on ``setup.numeric`` with ``param_dtype`` params."""
    config = with_dtype(setup.numeric, param_dtype)
    params = layout_inputs(config, setup.num_buckets)[0]
    paths = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    mesh = cpu_mesh()
    syncs = {run: make_sync(config, mesh, run[0], run[1], setup.num_buckets) for run in runs}
    fns = {run: reducer(sync) for run, sync in syncs.items()}
    out: dict[tuple[str, str | None], dict[str, Any]] = {
        run: {"by_scale": {}, "worst": (0.0, "", ""), "num_buckets": sync.num_buckets} for run, sync in syncs.items()}
    treedef = jax.tree.structure(params)
    for scale in setup.scales:
        stacked, exact = random_gradients(params, param_dtype, scale, seed)
        tree = jax.tree.unflatten(treedef, stacked)
        for run, fn in fns.items():
            errors = [rel_error(g, e) for g, e in zip(jax.tree.leaves(fn(tree)), exact)]
            k = int(np.argmax(errors))
            out[run]["by_scale"][scale] = errors[k]
            if errors[k] >= out[run]["worst"][0]:
                out[run]["worst"] = (errors[k], paths[k], scale)
        del stacked, tree  # one scale's gradients at a time
    return out


# -- the run -----------------------------------------------------------------------------------

def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``wire_ratio``: wire bytes over fp32_accum's on a bf16 wire, for the same param dtype
    where it has that row (bf16 params: default wire; float32: ``wire_dtype=bfloat16``)."""
    refs = {r["param_dtype"]: r["wire_bytes"] for r in rows
            if r["reduce"] == REFERENCE_MODE and r["wire_dtypes"] == ["bf16"]}
    fallback = next(iter(refs.values()), None)
    for r in rows:
        ref = refs.get(r["param_dtype"], fallback)
        r["wire_ratio"] = None if not ref else round(r["wire_bytes"] / ref, 4)


Run = tuple[str, str | None, str]  # (param dtype, wire dtype, reduce mode)


def all_runs(modes: tuple[str, ...]) -> list[Run]:
    """Every case of :data:`CASES` with every mode, in table order, less the combinations the
    sync refuses (a ``wire_dtype`` that only rounds: ``fp32`` and the quantized modes)."""
    return [(param_dtype, wire, reduce) for param_dtype, wire in CASES for reduce in modes
            if wire is None or not (reduce == "fp32" or reduce in QUANTIZED_MODES)]


def run(setup: Setup, runs: list[Run], log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row per run: compiled bytes and memory, then the numeric error."""
    rows = []
    for param_dtype, wire, reduce in runs:
        start = time.perf_counter()
        rows.append(compile_row(setup, param_dtype, reduce, wire))
        r = rows[-1]
        log(f"compiled {param_dtype:8s} {reduce:20s} wire {wire or '-':8s} {r['collectives']:32s} "
            f"sent {r['wire_bytes'] / 2**20:8.1f} MiB temp {r['temp_bytes'] / 2**20:7.1f} MiB "
            f"({time.perf_counter() - start:.1f} s)")
    for param_dtype in dict.fromkeys(r["param_dtype"] for r in rows):
        start = time.perf_counter()
        mine = [r for r in rows if r["param_dtype"] == param_dtype]
        errors = numeric_errors(setup, param_dtype, [(r["reduce"], r["wire_dtype"]) for r in mine])
        for r in mine:
            e = errors[r["reduce"], r["wire_dtype"]]
            worst, path, scale = e["worst"]
            r.update(worst_leaf_rel_error=worst, worst_leaf=path, worst_scale=scale,
                     rel_error_by_scale=e["by_scale"],
                     numeric_config=dict(layers=setup.numeric.num_layers, d_model=setup.numeric.d_model,
                                         params=setup.numeric.num_params(),
                                         num_buckets=e["num_buckets"]))
        log(f"numeric check {param_dtype}: {len(mine)} syncs x {len(setup.scales)} scales "
            f"({time.perf_counter() - start:.1f} s)")
    add_ratios(rows)
    return rows


# -- report ------------------------------------------------------------------------------------

def mib(b: int) -> str:
    return f"{b / 2**20:,.1f}"


def header(setup: Setup, rows: list[dict[str, Any]]) -> str:
    """What was compiled and what was checked, in words."""
    c, n = setup.compiled, setup.numeric
    smaller = c != models.preset(setup.preset)
    return (
        f"### {setup.preset}{' (reduced)' if smaller else ''}: {c.num_params() / 1e6:.0f}M params, {c.num_layers} "
        f"blocks, d_model {c.d_model}, seq {c.seq_len}, micro-batch 1, {NUM_DEVICES}x {setup.target} (compile-only)\n\n"
        f"One step (forward, backward, drained GradSync, ~{setup.num_buckets} buckets requested; "
        f"{rows[0]['num_buckets']} real) per row. float32 rows compile the model with "
        "`GPTConfig(param_dtype=float32)`: params, activations and gradients all float32; bf16 rows use the "
        "preset's bf16. `wire_dtype=bfloat16` casts each float32 bucket to bf16 before the mode's collective "
        "(the quantized modes then quantize the bf16 values). The `bf16` mode reduce-scatters in the gradients' "
        "own dtype, float32 for a float32 model; the quantized modes send payload and float32 block scales "
        "packed in one int8 array (fp8 and fp16 payloads as their bytes), hence `s8`.\n\n"
        "* sent MiB: bytes one device sends per step in the sync's collectives (`jax_drain/` scopes, "
        "`jax_drain/gather` excluded), from the schedule's result bytes (payload MiB) by ring/pairwise "
        "algorithm: reduce-scatter (g-1)x result, all-to-all (g-1)/g x, collective-permute 1x.\n"
        "* x ref: sent bytes over fp32_accum's on a bf16 wire (bf16 params: default wire; float32: "
        "wire_dtype=bfloat16).\n"
        f"* worst rel err: the worst per-leaf ||got - exact|| / ||exact|| over scales {', '.join(setup.scales)} "
        f"(mixed: a log-uniform scale in [1e-8, 1e3] per leaf), exact = float64 mean of the 8 devices' inputs "
        f"as sent. Measured with `GradSync.reduce_scatter` in `jax.shard_map` on 8 CPU devices, on "
        f"{n.num_layers} blocks of d_model {n.d_model} ({n.num_params() / 1e6:.1f}M params, "
        f"{rows[0].get('numeric_config', {}).get('num_buckets', '?')} buckets): independent N(0, scale^2) "
        "gradients per device. XLA:CPU runs the collectives: the `bf16` mode's in-collective bf16 rounding "
        "follows its reduction order, not NCCL's ring."
    )


def markdown(setup: Setup, rows: list[dict[str, Any]]) -> str:
    """The bytes/memory/error table, the per-scale error table and the comparisons."""
    out = [header(setup, rows), "",
           "| params | reduce | wire_dtype | sync collectives | sent MiB | x ref | payload MiB | temp MiB | "
           "args MiB | worst rel err (leaf, scale) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r.get("wire_ratio") is None else f"{r['wire_ratio']:.3f}"
        err = r.get("worst_leaf_rel_error")
        err_cell = "-" if err is None else f"{err:.2e} ({r['worst_leaf']}, {r['worst_scale']})"
        out.append(f"| {r['param_dtype']} | {r['reduce']} | {r['wire_dtype'] or '-'} | {r['collectives']} | "
                   f"{mib(r['wire_bytes'])} | {ratio} | {mib(r['payload_bytes'])} | {mib(r['temp_bytes'])} | "
                   f"{mib(r['argument_bytes'])} | {err_cell} |")
    out += ["", "Worst per-leaf relative error by gradient scale:", "",
            "| params | reduce | wire_dtype | " + " | ".join(setup.scales) + " |",
            "|---|---|---" + "|---" * len(setup.scales) + "|"]
    for r in rows:
        by = r.get("rel_error_by_scale", {})
        out.append(f"| {r['param_dtype']} | {r['reduce']} | {r['wire_dtype'] or '-'} | "
                   + " | ".join(f"{by[s]:.2e}" if s in by else "-" for s in setup.scales) + " |")
    out += ["", "Comparisons:", ""] + [f"* {line}" for line in findings(rows)]
    return "\n".join(out) + "\n"


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """The comparisons the table is for, in words (those whose rows this run has)."""
    row = {(r["param_dtype"], r["wire_dtype"], r["reduce"]): r for r in rows}
    lines = []
    ref = row.get(("bfloat16", None, REFERENCE_MODE))
    for mode in ("int8_accum", "fp8_accum", "fp16_accum", "int8_accum_streamed"):
        r = row.get(("bfloat16", None, mode))
        if r and ref:
            lines.append(f"bf16 params: {mode} sends {r['wire_bytes'] / ref['wire_bytes']:.3f}x fp32_accum's bytes "
                         f"at a worst leaf error of {r['worst_leaf_rel_error']:.1e} (fp32_accum "
                         f"{ref['worst_leaf_rel_error']:.1e}); temp {mib(r['temp_bytes'])} vs {mib(ref['temp_bytes'])} MiB")
    for mode in dict.fromkeys(r["reduce"] for r in rows):
        full, half = row.get(("float32", None, mode)), row.get(("float32", "bfloat16", mode))
        if full and half:
            lines.append(f"float32 params, {mode}: wire_dtype=bfloat16 sends {half['wire_bytes'] / full['wire_bytes']:.2f}x "
                         f"the bytes, worst leaf error {full['worst_leaf_rel_error']:.1e} -> "
                         f"{half['worst_leaf_rel_error']:.1e}, temp {mib(full['temp_bytes'])} -> "
                         f"{mib(half['temp_bytes'])} MiB")
    return lines


def make_setup(args: argparse.Namespace) -> Setup:
    """The run's configs: the preset (with overrides) compiled, a smaller tree checked."""
    if args.quick:  # a tiny stack for a smoke test: both parts on the same small tree
        tiny = plan.preset_config(args.preset, 2, 256, 4, 64)
        return Setup(args.preset, tiny, tiny, 6, QUICK_SCALES, args.target)
    compiled = plan.preset_config(args.preset, args.layers, args.d_model, args.heads, args.seq)
    d = min(args.numeric_d_model, compiled.d_model)
    numeric = dataclasses.replace(compiled, num_layers=min(args.numeric_layers, compiled.num_layers), d_model=d,
                                  num_heads=math.gcd(compiled.num_heads, d))
    return Setup(args.preset, compiled, numeric, args.num_buckets, SCALES, args.target)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt-blocks", help="a block-stack preset of jax_drain.models")
    p.add_argument("--layers", type=int), p.add_argument("--d-model", type=int)
    p.add_argument("--heads", type=int), p.add_argument("--seq", type=int)
    p.add_argument("--num-buckets", type=int, default=24, help="requested buckets (default 24)")
    p.add_argument("--numeric-layers", type=int, default=4, help="blocks of the numeric check's tree (default 4)")
    p.add_argument("--numeric-d-model", type=int, default=512, help="its width (default 512)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated reduce modes (not with --quick)")
    p.add_argument("--target", default="h100", help="GPU target: h100, h200, a100")
    p.add_argument("--quick", action="store_true", help="a tiny config, 4 rows, two scales: a smoke test")
    p.add_argument("--out", metavar="DIR", help="write DIR/precision.json and DIR/precision.md")
    args = p.parse_args(argv)
    modes = tuple(args.modes.split(","))
    unknown = [m for m in modes if m not in REDUCE_MODES]
    if unknown:
        p.error(f"unknown reduce modes {unknown}; choose from {', '.join(REDUCE_MODES)}")

    setup = make_setup(args)
    start = time.perf_counter()
    runs = list(QUICK_RUNS) if args.quick else all_runs(modes)
    rows = run(setup, runs, log=lambda line: print(line, file=sys.stderr, flush=True))
    table = markdown(setup, rows)
    print(table)
    print(f"{len(rows)} rows in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "precision.json").write_text(json.dumps(rows, indent=1))
        (out / "precision.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
