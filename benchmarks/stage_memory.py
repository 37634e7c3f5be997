"""A stage axis on XLA's GPU compiler: a scanned GPT's whole train step, pipelined or not.

Compiles ``jd.make_train_step`` (gradient, sync and AdamW update) of ``gpt-blocks-scan`` (8
blocks, d_model 2048, bf16, 4 sequences of 512 tokens per device) for 8 compile-only H100s, data
parallel (the in-scan sync and whole-leaf buckets) and with ``TrainConfig(stage_axis="stage")``
on ``(data, stage)`` = (4, 2) and (2, 4), and prints XLA's temp and argument bytes per device
and how many stage-to-stage sends (collective-permutes) the program holds, with the schedule's
bubble.

    python benchmarks/stage_memory.py --out benchmarks/results     # stage_memory.{md,json}, about 1 min
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPU devices need the CPU platform

import jax_drain as jd  # noqa: E402
import optax  # noqa: E402

from jax_drain import models, pipeline  # noqa: E402
from jax_drain.planner.targets import gpu_mesh  # noqa: E402

PRESET = "gpt-blocks-scan"
SEQUENCES = 4  # per device
BUCKET_SIZE = 10_000_000
#: (label, mesh shape, axis names, TrainConfig fields)
LAYOUTS = (
    ("data 8, in-scan sync (scan_layers=True)", (8,), ("data",), dict(scan_layers=True)),
    ("data 8, whole-leaf buckets", (8,), ("data",), {}),
    ("data 4 x stage 2, 8 micro-batches", (4, 2), ("data", "stage"), dict(stage_axis="stage", pipeline_microbatches=8)),
    ("data 2 x stage 4, 8 micro-batches", (2, 4), ("data", "stage"), dict(stage_axis="stage", pipeline_microbatches=8)),
    ("data 2 x stage 4, 16 micro-batches", (2, 4), ("data", "stage"),
     dict(stage_axis="stage", pipeline_microbatches=16)),
)


def measure(label: str, shape: tuple[int, ...], axes: tuple[str, ...], fields: dict, target: str) -> dict:
    config = models.preset(PRESET)
    params, loss = models.abstract_params(config), models.make_loss(config)
    batch = models.example_batch(config, 8 * SEQUENCES)
    start = time.perf_counter()
    step = jd.make_train_step(params, loss, optax.adamw(1e-4), gpu_mesh(shape, axes, target=target),
                              jd.TrainConfig(bucket_size=BUCKET_SIZE, **fields), example_batch=batch)
    compiled = step.lower(step.abstract_state(), batch).compile()
    memory, text = compiled.memory_analysis(), compiled.as_text()
    stages = shape[1] if len(shape) > 1 else 1
    micro = fields.get("pipeline_microbatches")
    return {"layout": label, "mesh": dict(zip(axes, shape)), "config": fields,
            "temp_bytes": int(memory.temp_size_in_bytes), "argument_bytes": int(memory.argument_size_in_bytes),
            "collective_permutes": text.count("collective-permute-start") + text.count("collective-permute("),
            "bubble": None if micro is None else pipeline.bubble_fraction(micro, stages),
            "compile_s": round(time.perf_counter() - start, 1)}


def table(rows: list[dict]) -> str:
    lines = ["| layout | temp MiB | arguments MiB | stage sends | bubble |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        bubble = "-" if r["bubble"] is None else f"{100 * r['bubble']:.0f}%"
        lines.append(f"| {r['layout']} | {r['temp_bytes'] / 2**20:,.0f} | {r['argument_bytes'] / 2**20:,.0f} | "
                     f"{r['collective_permutes']} | {bubble} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="h100")
    parser.add_argument("--out", help="a directory for stage_memory.md and stage_memory.json")
    args = parser.parse_args(argv)
    rows = []
    for label, shape, axes, fields in LAYOUTS:
        rows.append(measure(label, shape, axes, fields, args.target))
        print(f"{label}: {rows[-1]['temp_bytes'] / 2**20:,.0f} MiB temp ({rows[-1]['compile_s']} s)", flush=True)
    text = (f"# A stage axis: the train step's memory (`python benchmarks/stage_memory.py`)\n\n"
            f"Compile-only 8x{args.target.upper()}, `{PRESET}`, {SEQUENCES} sequences per device, AdamW; "
            "bytes per device from XLA's buffer assignment\n\n" + table(rows) + "\n")
    print(text)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "stage_memory.md").write_text(text)
        (out / "stage_memory.json").write_text(json.dumps({"rows": rows, "preset": PRESET}, indent=1))
        print(f"wrote {out / 'stage_memory.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
