"""Scanned GPT on XLA's GPU compiler: reduce-scatter inside the backward scan vs after it.

Compiles one gradient step of the ``nnx.scan`` GPT block stack (``models.GPTConfig(
scan_layers=True)``; by default the issue's model: 8 blocks, d=2048, seq 512, micro-batch 1,
bf16, remat) for a virtual 8xH100 host (compile-only devices; no GPU needed), three ways with
the same outputs (one float32 shard per layer bucket and layer, plus the final norm's):

* ``reduce_after_scan``: ``jax.grad`` materialises the stacked ``[L, ...]`` gradients, then
  each layer's slice is bucketed and reduce-scattered, all buckets in one drain chain
  (:meth:`jax_drain.ScanGradSync.reduce_scatter`);
* ``no_comm``: the same stacked gradients and drain chain, each bucket summed over its own
  chunks locally instead of over the wire: the floor of the stacked-gradient approach;
* ``in_scan``: :meth:`jax_drain.ScanGradSync.value_and_grad`: each layer's gradient is
  reduce-scattered inside the backward while loop; no stacked gradient exists.

For each it reads XLA's buffer assignment (temp bytes) and schedule: the sync's async pairs and
how many overlap compute, and, inside while bodies, one collective per layer bucket (not merged
by XLA's combiners, in the gradient dtype) followed by a float32 reduction in the same body.

    python benchmarks/scan_memory.py --json scan_memory.json
    python benchmarks/scan_memory.py --layers 4 --d-model 512 --seq 256   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPU devices need the CPU platform

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_drain import _compat, models  # noqa: E402
from jax_drain.drain import sequenced_map  # noqa: E402
from jax_drain.planner.schedule import Schedule, parse_schedule  # noqa: E402
from jax_drain.planner.targets import gpu_mesh  # noqa: E402
from jax_drain.scan import LAYER_SCOPE, ScanGradSync, ScanShards  # noqa: E402
from jax_drain.sync import SCOPE_PREFIX, local_params  # noqa: E402

STRATEGIES = ("reduce_after_scan", "no_comm", "in_scan")


def build_step(strategy: str, config: models.GPTConfig, sync: ScanGradSync, micro_batch: int = 1):
    """The jitted step of ``strategy`` and its abstract (params, batch)."""
    axis = sync.axis
    params = models.abstract_params(config)
    batch = models.example_batch(config, micro_batch * sync.axis_size)
    loss_fn = models.make_loss(config)

    def stacked_grads(p, b):
        loss, grads = jax.value_and_grad(loss_fn)(local_params(p, axis), b)
        return jax.lax.pmean(loss, axis), grads

    if strategy == "in_scan":
        fn = sync.value_and_grad(loss_fn)
    elif strategy == "reduce_after_scan":
        def fn(p, b):
            loss, grads = stacked_grads(p, b)
            return loss, sync.reduce_scatter(grads)
    elif strategy == "no_comm":
        def fn(p, b):
            loss, grads = stacked_grads(p, b)
            return loss, _local_sums(sync, grads)
    else:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    step = jax.jit(_compat.shard_map(fn, mesh=sync.mesh, in_specs=(P(), P(axis)),
                                     out_specs=(P(), sync.shard_specs())))
    return step, (params, batch)


def _local_sums(sync: ScanGradSync, grads: Any) -> ScanShards:
    """``sync.reduce_scatter(grads)`` with each bucket summed over its own chunks, no wire:
    one layer's buckets at a time, as the reduce-scatter after the scan sends them."""
    n, layout, num_layers = sync.axis_size, sync.layer_layout, sync.num_layers
    paths = models.leaf_paths(grads)
    stacked = [g for g, path in zip(jax.tree.leaves(grads), paths) if path in sync.stacked_paths]
    rest = [g for g, path in zip(jax.tree.leaves(grads), paths) if path not in sync.stacked_paths]
    buckets = [b for l in reversed(range(num_layers)) for b in layout.flatten([g[l] for g in stacked])]
    local = lambda k, bucket: jnp.sum(bucket.reshape(n, -1).astype(jnp.float32), axis=0)
    sums = sequenced_map(local, buckets, 1)
    per = len(layout.buckets)
    layers = tuple(jnp.stack([sums[(num_layers - 1 - l) * per + k] for l in range(num_layers)])
                   for k in range(per))
    rest_buckets = () if sync.rest_layout is None else sync.rest_layout.flatten(rest)
    return ScanShards(layers, tuple(jnp.sum(b.reshape(n, -1).astype(jnp.float32), axis=0) for b in rest_buckets))


def loop_body_check(sched: Schedule, num_layer_buckets: int) -> dict[str, Any]:
    """What the while bodies hold: the sync's layer-bucket collectives and their f32 sums."""
    in_loops = [c for c in sched.collectives if c.computation != sched.entry and c.in_scope(LAYER_SCOPE)]
    buckets = sorted({int(m.group(1)) for c in in_loops for name in c.op_names
                      if (m := re.search(re.escape(LAYER_SCOPE) + r"/bucket(\d+)", name))})
    return {
        "loop_bodies": sorted({c.computation for c in in_loops}),
        "loop_collectives": len(in_loops),
        "loop_collective_kinds": sorted({f"{c.kind}:{c.dtype}" for c in in_loops}),
        "loop_buckets": buckets,
        "expected_buckets": list(range(num_layer_buckets)),
        "merged": [c.name for c in in_loops if len(c.op_names) > 1],
        "f32_sums_in_body": sum(1 for c in in_loops if sched.feeds_f32_reduce(c)),
    }


def run(strategy: str, config: models.GPTConfig, bucket_size: int, reduce: str = "fp32_accum",
        target: str = "h100", devices: int = 8, micro_batch: int = 1) -> dict[str, Any]:
    """Compiles one strategy and returns its JSON row."""
    mesh = gpu_mesh((devices,), ("data",), target=target)
    params = models.abstract_params(config)
    sync = ScanGradSync(params, mesh, axis="data", stacked=lambda path: path.startswith("blocks/"),
                        bucket_size=bucket_size, reduce=reduce)
    step, args = build_step(strategy, config, sync, micro_batch)
    start = time.perf_counter()
    compiled = step.lower(*args).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    sched = parse_schedule(compiled.as_text())
    mine = [c for c in sched.collectives if c.in_scope(SCOPE_PREFIX)]
    pairs = [c for c in mine if c.done != c.start]
    row = {
        "strategy": strategy,
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "pairs": len(pairs),
        "overlapped": sum(1 for c in pairs if c.overlapped),
        "compile_s": round(compile_s, 2),
        "collectives": len(mine),
        "layers": config.num_layers, "d_model": config.d_model, "seq": config.seq_len,
        "micro_batch": micro_batch, "bucket_size": bucket_size, "reduce": reduce,
        "layer_buckets": len(sync.layer_bucket_sizes), "target": target, "devices": devices,
        "stacked_grad_bytes": sum(p.size * p.dtype.itemsize for p, path in
                                  zip(jax.tree.leaves(params), models.leaf_paths(params))
                                  if path in sync.stacked_paths),
    }
    if strategy == "in_scan":
        row.update(loop_body_check(sched, len(sync.layer_bucket_sizes)))
    return row


def table(rows: list[dict[str, Any]]) -> str:
    mib = lambda b: f"{b / 2**20:,.0f}"
    after = next((r["temp_bytes"] for r in rows if r["strategy"] == "reduce_after_scan"), None)
    lines = ["| strategy | temp MiB | x after-scan | pairs | overlapped | compile s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['temp_bytes'] / after:.2f}" if after else "-"
        lines.append(f"| {r['strategy']} | {mib(r['temp_bytes'])} | {ratio} | {r['pairs']} | "
                     f"{r['overlapped']} | {r['compile_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per device")
    p.add_argument("--no-remat", action="store_true")
    p.add_argument("--bucket-size", type=int, default=20_000_000,
                   help="elements per bucket of one layer (default: 2 buckets per d=2048 block)")
    p.add_argument("--reduce", default="fp32_accum")
    p.add_argument("--target", default="h100")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = p.parse_args(argv)
    config = models.GPTConfig(num_layers=args.layers, d_model=args.d_model, num_heads=args.heads,
                              seq_len=args.seq, remat=not args.no_remat, scan_layers=True)
    rows = []
    for strategy in args.strategies.split(","):
        row = run(strategy, config, args.bucket_size, args.reduce, args.target, micro_batch=args.micro_batch)
        rows.append(row)
        print(f"{strategy}: temp {row['temp_bytes'] / 2**20:,.1f} MiB, {row['pairs']} pairs "
              f"({row['overlapped']} overlapped), compile {row['compile_s']} s", file=sys.stderr)
    print(table(rows))
    for r in rows:
        if r["strategy"] == "in_scan":
            print(f"in_scan while body: {r['loop_collectives']} collectives {r['loop_collective_kinds']} "
                  f"for layer buckets {r['loop_buckets']} (expected {r['expected_buckets']}), "
                  f"merged: {r['merged'] or 'none'}, f32 sums in body: {r['f32_sums_in_body']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
