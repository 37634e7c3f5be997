"""The seed's setting planned on XLA's GPU compiler: an 8B model on 64 H100s at TP=4 and TP=2.

Megatron-LM's PR #4940 measured its drain on an 8B model, 8 nodes / 64 H100s, TP=4 and TP=2, 7
gradient buckets. This compiles the gradient step of an 8B stack of Megatron MLP blocks
(:func:`jax_drain.plan.build_mesh_step`: 60 blocks, d_model 4096, column-parallel ``w_in``,
row-parallel ``w_out``, bf16 weights; 8.05B parameters) for 64 compile-only H100s (topology
``1x8x8``) as a ``(data, model)`` mesh, with the local parameters in 7 buckets, both ways of
writing tensor parallelism:

* ``manual``: the loss on local blocks with its own ``psum`` over ``"model"``;
* ``gspmd``: the loss on global shapes, no collectives, partitioned by XLA; jax_drain reduces
  the buckets on local blocks in a nested region manual over ``"model"``.

Strategies: ``no_comm`` (each bucket summed over its own chunks on the device, drained: the
sync's work minus the wire, the floor), ``fp32_accum`` undrained, ``fp32_accum+drain`` and
``fp32_accum_streamed+drain`` (the same wire bytes as ``axis_size - 1`` point-to-point steps,
so the landing buffer is a chunk, not a bucket). Each row's verdict is its temp memory above
the floor, in buckets: the largest bucket the sync really forms (whole leaves, so larger than
``--bucket-size`` asks), in float32 bytes, the dtype its shard accumulates in. Every setting is
compiled twice: with XLA's default of one asynchronous collective in flight, and with its
parallel collective overlap limit at 4, so that only the drain bounds the buckets in flight.

    python benchmarks/seed_tp.py --out benchmarks/results     # seed_tp.{md,json}, about 2 min (40M buckets: 5)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPU devices need the CPU platform

from jax_drain import plan  # noqa: E402
from jax_drain.planner.targets import gpu_mesh  # noqa: E402

LAYERS, D_MODEL, BUCKETS, TOKENS = 60, 4096, 7, 4096
TOPOLOGY = "1x8x8"
STRATEGIES = (("no_comm", True), ("fp32_accum", False), ("fp32_accum", True), ("fp32_accum_streamed", True))
OVERLAP_LIMITS = (1, 4)  # XLA's default, and room for 4 collectives in flight


def overlap_options(limit: int) -> dict[str, Any] | None:
    """XLA compile options for at most ``limit`` asynchronous collectives in flight."""
    return None if limit == 1 else {"xla_gpu_experimental_parallel_collective_overlap_limit": limit}


def run_one(tp: int, tensor_parallel: str, reduce: str, drain: bool, target: str,
            bucket_size: int | None = None, overlap: int = 1) -> dict[str, Any]:
    """Compiles one (TP degree, tensor-parallel mode, strategy, overlap limit) and returns a
    JSON-ready row; ``bucket_size`` (elements) defaults to the local parameters in
    :data:`BUCKETS` buckets."""
    mesh = gpu_mesh((64 // tp, tp), ("data", "model"), target=target, topology=TOPOLOGY)
    local = LAYERS * 2 * D_MODEL * 4 * D_MODEL // tp
    bucket_size = bucket_size or -(-local // BUCKETS)
    step, args, sync = plan.build_mesh_step(mesh, layers=LAYERS, d_model=D_MODEL, reduce=reduce, drain=drain,
                                            bucket_size=bucket_size, tokens_per_device=TOKENS, outer_axis=None,
                                            tensor_parallel=tensor_parallel)
    strategy = reduce + ("+drain" if drain and reduce != "no_comm" else "")
    report = plan.plan(step, *args, target=target, topology=TOPOLOGY, compiler_options=overlap_options(overlap),
                       strategy=strategy, num_buckets=sync.num_buckets, bucket_size=bucket_size)
    return dict(tp=tp, tensor_parallel=tensor_parallel, strategy=strategy, overlap_limit=overlap,
                buckets=sync.num_buckets, bucket_size=bucket_size, largest_bucket=max(sync.bucket_sizes),
                bucket_bytes=4 * max(sync.bucket_sizes), temp_bytes=report.temp_bytes,
                argument_bytes=report.argument_bytes, buckets_in_flight=report.buckets_in_flight,
                predicted_step_s=report.predicted_step_s, exposed_comm_s=report.exposed_comm_s)


def with_verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's temp above its (TP, mode, overlap limit)'s ``no_comm`` floor, in float32
    bytes of the largest bucket."""
    key = lambda r: (r["tp"], r["tensor_parallel"], r["overlap_limit"])  # noqa: E731
    for r in rows:
        floor = next(f for f in rows if key(f) == key(r) and f["strategy"] == "no_comm")
        r["above_floor_buckets"] = (r["temp_bytes"] - floor["temp_bytes"]) / r["bucket_bytes"]
    return rows


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def markdown(rows: list[dict[str, Any]], buckets: str) -> str:
    out = [f"### 8B MLP-block stack ({LAYERS} blocks, d_model {D_MODEL}), 64 compile-only H100s ({TOPOLOGY}), "
           f"{buckets}, {TOKENS} tokens per data-parallel device", "",
           "Above the floor: temp memory above `no_comm`'s, in float32 bytes of the largest bucket. "
           "Overlap: XLA's limit on asynchronous collectives in flight (1 is its default). Step and exposed: "
           "XLA's predicted step time and the communication it leaves exposed, in ms (estimates of the "
           "latency-hiding scheduler, not measured on a GPU).", "",
           "| TP | tensor parallel | overlap | strategy | buckets | largest bucket (fp32) MiB | temp GiB "
           "| above the floor (buckets) | buckets in flight | step ms | exposed ms |",
           "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['tp']} | {r['tensor_parallel']} | {r['overlap_limit']} | {r['strategy']} | {r['buckets']} | "
                   f"{r['bucket_bytes'] / 2**20:,.0f} | {r['temp_bytes'] / 2**30:.2f} | "
                   f"{r['above_floor_buckets']:+.2f} | {r['buckets_in_flight']} | {_ms(r.get('predicted_step_s'))} | "
                   f"{_ms(r.get('exposed_comm_s'))} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", default="4,2", help="tensor-parallel degrees (default 4,2)")
    p.add_argument("--modes", default="manual,gspmd", help="tensor-parallel modes (default manual,gspmd)")
    p.add_argument("--target", default="h100", help="GPU target: h100, h200, a100")
    p.add_argument("--bucket-size", type=int, help="elements per bucket (default: the local parameters in 7 "
                   "buckets, as in the PR; Megatron's default is max(40M, 1M x data-parallel size))")
    p.add_argument("--out", metavar="DIR", help="write DIR/seed_tp.md and DIR/seed_tp.json (DIR/seed_tp_<size>.* "
                   "with --bucket-size)")
    args = p.parse_args(argv)

    rows = []
    for tp in (int(t) for t in args.tp.split(",")):
        for mode in args.modes.split(","):
            for overlap in OVERLAP_LIMITS:
                for reduce, drain in STRATEGIES:
                    start = time.perf_counter()
                    rows.append(run_one(tp, mode, reduce, drain, args.target, args.bucket_size, overlap))
                    print(f"  TP={tp} {mode} overlap {overlap} {rows[-1]['strategy']}: "
                          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    text = markdown(with_verdicts(rows), f"{args.bucket_size:,}-element buckets" if args.bucket_size
                    else f"the local parameters in {BUCKETS} buckets")
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"seed_tp_{args.bucket_size}" if args.bucket_size else "seed_tp"
        (out / f"{name}.md").write_text(text)
        (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
