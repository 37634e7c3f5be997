"""Whole-parameter optimizers on XLA's GPU compiler: Muon per owner against AdamW on flat shards.

Compiles the whole train step (forward, backward, drained ``fp32_accum`` sync, optimizer,
parameter all-gathers) of a built-in GPT preset for 8 compile-only H100s with ``jd.make_train_step``:

* ``adamw`` on flat shards (``ownership="element"``, every device a contiguous 1/8 of each bucket);
* ``muon+adamw`` (``optax.multi_transform``: Muon for the blocks' matrices, AdamW for the rest)
  with whole-parameter ownership (``ownership="param"``, chosen by the step).

Per row: XLA's temp and argument bytes per device, the optimizer state per device (master
shards and ``tx`` state, :meth:`DistributedOptimizer.memory_summary`) against one-device optax's,
the bytes the gradient collectives and the parameter all-gathers carry per device (read from
the scheduled program), and for ownership the assignment's imbalance: the largest owner's
parameter elements over the mean.

    python benchmarks/whole_params.py --out benchmarks/results     # whole_params.{md,json}
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPU devices need the CPU platform

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax_drain as jd  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jax_drain import models  # noqa: E402
from jax_drain.planner.schedule import parse_schedule  # noqa: E402
from jax_drain.planner.targets import gpu_mesh  # noqa: E402


def _muon_and_adamw() -> optax.GradientTransformation:
    # Muon for the blocks' 2-D kernels; embeddings, head, norms and biases with AdamW.
    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, x: "muon" if x.ndim == 2 and "blocks" in jax.tree_util.keystr(path) else "adamw", params)

    return optax.multi_transform({"muon": optax.contrib.muon(0.02), "adamw": optax.adamw(3e-4)}, labels)


TRANSFORMS = {"adamw": lambda: optax.adamw(3e-4), "muon+adamw": _muon_and_adamw}


def run_one(preset: str, name: str, bucket_size: int | None) -> dict[str, Any]:
    config = models.preset(preset)
    mesh = gpu_mesh((8,), ("data",))
    params, batch = models.abstract_params(config), models.example_batch(config, 8)
    step = jd.make_train_step(params, models.make_loss(config), TRANSFORMS[name](), mesh,
                              jd.TrainConfig(bucket_size=bucket_size), example_batch=batch)
    compiled = step.lower(step.abstract_state(), batch).compile()
    memory, sched = compiled.memory_analysis(), parse_schedule(compiled.as_text())
    wire = {kind: sum(c.bytes for c in sched.collectives if c.kind == kind)
            for kind in ("all-to-all", "reduce-scatter", "all-gather", "all-reduce")}
    summary = step.optimizer.memory_summary()
    row = dict(preset=preset, tx=name, ownership=step.ownership, buckets=step.sync.num_buckets,
               bucket_size=bucket_size, temp_bytes=int(memory.temp_size_in_bytes),
               argument_bytes=int(memory.argument_size_in_bytes), optimizer_bytes=summary["distributed"],
               one_device_optimizer_bytes=summary["replicated"], gradient_wire_bytes=wire["all-to-all"]
               + wire["reduce-scatter"], gather_wire_bytes=wire["all-gather"])
    owned = step.optimizer._owned
    if owned is not None:
        sizes = [sum(p.size for p in pieces) for pieces in owned.pieces]
        row["imbalance"] = max(sizes) / float(np.mean(sizes))
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    out = ["### Whole-parameter optimizers, compile-only 8xH100, data parallel (MiB per device)", "",
           "| preset | tx | ownership | buckets | temp | arguments | optimizer state | vs one device | gradient wire "
           "| gather wire | imbalance |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['preset']} | {r['tx']} | {r['ownership']} | {r['buckets']} | {mib(r['temp_bytes'])} | "
                   f"{mib(r['argument_bytes'])} | {mib(r['optimizer_bytes'])} | "
                   f"{r['optimizer_bytes'] / r['one_device_optimizer_bytes']:.3f}x | {mib(r['gradient_wire_bytes'])} | "
                   f"{mib(r['gather_wire_bytes'])} | {r.get('imbalance', 1.0):.2f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="gpt-blocks", help="comma-separated jax_drain.models presets")
    p.add_argument("--bucket-size", type=int, default=None,
                   help="elements per bucket (default: Megatron's 40M, the TrainConfig default)")
    p.add_argument("--out", metavar="DIR", help="write DIR/whole_params.md and DIR/whole_params.json")
    args = p.parse_args(argv)
    bucket_size = args.bucket_size or jd.TrainConfig().bucket_size
    rows = []
    for preset in args.presets.split(","):
        for name in TRANSFORMS:
            start = time.perf_counter()
            rows.append(run_one(preset, name, bucket_size))
            print(f"  {preset} {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    text = markdown(rows)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "whole_params.md").write_text(text)
        (out / "whole_params.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
