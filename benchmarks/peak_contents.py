"""What sits at the memory peak of a training step, read from XLA's own liveness (compile-only 8xH100).

For each preset, strategy and bucket size, compiles the gradient step (forward, backward, gradient
sync) and reads the buffers live at XLA's peak (:func:`jax_drain.planner.peak.peak_contents`):
how many MiB of it are the gradient sync's (``sync``: bucket scratch in flight), ZeRO-3's parameter
gathers (``gather``), the model's backward and forward, and XLA's own copies (``other``); which
buckets' scratch is live there; and how far XLA's temp allocation lies above the live bytes (the
heap's packing). Rows with ``+blocks`` lay buckets out along the remat blocks
(``TrainConfig(bucket_boundaries="remat")``): the same bucket size, no bucket spanning two blocks.

    python benchmarks/peak_contents.py --out benchmarks/results     # peak_contents.{md,json}
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

import jax_drain  # noqa: E402, F401  (registers the CUDA plugin without a GPU)
from jax_drain import models  # noqa: E402
from jax_drain.planner import plan  # noqa: E402
from jax_drain.planner.peak import peak_contents  # noqa: E402
from jax_drain.planner.targets import gpu_mesh  # noqa: E402

STRATEGIES = ("no_comm", "fp32_accum+drain", "fp32_accum+drain+blocks", "fp32_accum+drain+split",
              "zero3+drain", "zero3+drain+blocks")
BUCKET_SIZES = (10_000_000, 40_000_000)


def run_one(preset: str, strategy: str, bucket_size: int) -> dict[str, Any]:
    config = models.preset(preset)
    mesh = gpu_mesh((8,), ("data",))
    step, args, sync = plan.build_step(strategy, config, mesh, bucket_size=bucket_size)
    compiled, peak = peak_contents(step.lower(*args))
    memory = compiled.memory_analysis()
    return {"preset": preset, "strategy": strategy, "bucket_size": bucket_size,
            "buckets": None if sync is None else sync.num_buckets,
            "temp_mib": round(memory.temp_size_in_bytes / 2**20, 1),
            "arguments_mib": round(memory.argument_size_in_bytes / 2**20, 1),
            "peak": peak.summary()}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| preset | strategy | bucket size | buckets | XLA temp | live at peak | sync | gather | backward | "
             "forward | other | buckets in flight | largest |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        p = r["peak"]
        largest = "; ".join(f"{b['mib']} {b['op'].split('/')[-1]}" for b in p["largest"][:2])
        lines.append(f"| {r['preset']} | {r['strategy']} | {r['bucket_size'] / 1e6:g}M | {r['buckets'] or '-'} | "
                     f"{r['temp_mib']:,.1f} | {p['temp_mib']:,.1f} | {p['sync_mib']:,.1f} | {p['gather_mib']:,.1f} | "
                     f"{p['backward_mib']:,.1f} | {p['forward_mib']:,.1f} | {p['other_mib']:,.1f} | "
                     f"{p['sync_buckets'] or '-'} | {largest} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="gpt-blocks,gpt-tied")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--bucket-sizes", default=",".join(str(s) for s in BUCKET_SIZES))
    parser.add_argument("--out", help="directory for peak_contents.md and peak_contents.json")
    args = parser.parse_args(argv)
    rows = []
    for preset in args.presets.split(","):
        for size in (int(s) for s in args.bucket_sizes.split(",")):
            for strategy in args.strategies.split(","):
                start = time.perf_counter()
                rows.append(run_one(preset, strategy, size))
                print(f"  {preset} {strategy} {size:,}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    text = ("### What is live at the peak, compile-only 8xH100 (MiB per device)\n\n"
            "XLA temp: `memory_analysis()`; live at peak: the temp buffers XLA's liveness has live at its "
            "peak (the rest of XLA temp is the heap's packing); then those bytes by kind.\n\n" + table(rows))
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "peak_contents.md").write_text(text + "\n")
        (out / "peak_contents.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
