"""A stage axis on XLA's GPU compiler: a scanned GPT's whole train step, pipelined or not, against
a GSPMD circular pipeline written MaxText's way.

Compiles the whole AdamW train step of ``gpt-blocks-scan`` (8 blocks, d_model 2048, bf16, 4
sequences of 512 tokens per device) for compile-only H100s:

* ``jd.make_train_step``, data parallel (the in-scan sync, and whole-leaf buckets) and with
  ``TrainConfig(stage_axis="stage")`` (GPipe and 1F1B, also in lock step, ZeRO-1 and ZeRO-3);
* the GSPMD baseline: ``jax.jit`` of a loss whose stack runs as MaxText's pipeline runs it (the
  layers reshaped ``[stages, layers per stage, ...]`` and sharded over ``stage``, each tick a
  ``vmap`` of the stage over the stages and a shift of the stage inputs, XLA placing the
  communication) and optax's AdamW on the parameters sharded so (its moments in the parameters'
  bf16, no fp32 master copy: jax_drain keeps both in float32, sharded over the data axis);

on one host (8 GPUs) and two (``1x2x8``, the stage axis between the hosts), and prints XLA's
temp and argument bytes per device, the micro-batches' stage inputs each stage holds for
backward at most (the schedule's), the stage-to-stage sends (collective-permutes) in the program,
the schedule's bubble and time (:func:`jax_drain.pipeline.schedule_time`), how many of the
gradient sync's collectives overlap compute, and XLA's predicted step where its estimator prices
one.

    python benchmarks/stage_memory.py --out benchmarks/results     # stage_memory.{md,json}, about 3 min
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPU devices need the CPU platform

import jax_drain as jd  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_drain import models, pipeline  # noqa: E402
from jax_drain.planner.plan import plan  # noqa: E402
from jax_drain.planner.targets import gpu_mesh  # noqa: E402

PRESET = "gpt-blocks-scan"
SEQUENCES = 4  # per device
BUCKET_SIZE = 10_000_000
ONE_HOST, TWO_HOSTS = "1x1x8", "1x2x8"
#: (label, topology, mesh shape, axis names, how: "jax_drain" TrainConfig fields or "gspmd_circular")
LAYOUTS = (
    ("data 8, in-scan sync (scan_layers=True)", ONE_HOST, (8,), ("data",), dict(scan_layers=True)),
    ("data 8, whole-leaf buckets", ONE_HOST, (8,), ("data",), {}),
    ("data 4 x stage 2, 8 micro-batches", ONE_HOST, (4, 2), ("data", "stage"), dict(pipeline_microbatches=8)),
    ("data 4 x stage 2, 8 micro-batches, bf16 sums", ONE_HOST, (4, 2), ("data", "stage"),
     dict(pipeline_microbatches=8, accum_dtype=None)),
    ("data 4 x stage 2, 8 micro-batches, 1F1B", ONE_HOST, (4, 2), ("data", "stage"),
     dict(pipeline_microbatches=8, pipeline_schedule="1f1b")),
    ("data 4 x stage 2, 8 micro-batches, 1F1B, bf16 sums", ONE_HOST, (4, 2), ("data", "stage"),
     dict(pipeline_microbatches=8, pipeline_schedule="1f1b", accum_dtype=None)),
    ("data 4 x stage 2, 8 micro-batches, 1F1B in lock step", ONE_HOST, (4, 2), ("data", "stage"),
     dict(pipeline_microbatches=8, pipeline_schedule="1f1b_lockstep")),
    ("data 4 x stage 2, GSPMD circular", ONE_HOST, (4, 2), ("data", "stage"), "gspmd_circular"),
    ("data 2 x stage 4, 8 micro-batches", ONE_HOST, (2, 4), ("data", "stage"), dict(pipeline_microbatches=8)),
    ("data 2 x stage 4, 8 micro-batches, ZeRO-3", ONE_HOST, (2, 4), ("data", "stage"),
     dict(pipeline_microbatches=8, shard_params=True)),
    ("data 2 x stage 4, 8 micro-batches, 1F1B", ONE_HOST, (2, 4), ("data", "stage"),
     dict(pipeline_microbatches=8, pipeline_schedule="1f1b")),
    ("data 2 x stage 4, 8 micro-batches, 1F1B, ZeRO-3", ONE_HOST, (2, 4), ("data", "stage"),
     dict(pipeline_microbatches=8, pipeline_schedule="1f1b", shard_params=True)),
    ("data 2 x stage 4, 16 micro-batches", ONE_HOST, (2, 4), ("data", "stage"), dict(pipeline_microbatches=16)),
    ("data 2 x stage 4, 16 micro-batches, bf16 sums", ONE_HOST, (2, 4), ("data", "stage"),
     dict(pipeline_microbatches=16, accum_dtype=None)),
    ("data 2 x stage 4, 16 micro-batches, 1F1B", ONE_HOST, (2, 4), ("data", "stage"),
     dict(pipeline_microbatches=16, pipeline_schedule="1f1b")),
    ("data 2 x stage 4, 16 micro-batches, 1F1B, bf16 sums", ONE_HOST, (2, 4), ("data", "stage"),
     dict(pipeline_microbatches=16, pipeline_schedule="1f1b", accum_dtype=None)),
    ("data 2 x stage 4, 16 micro-batches, 1F1B in lock step", ONE_HOST, (2, 4), ("data", "stage"),
     dict(pipeline_microbatches=16, pipeline_schedule="1f1b_lockstep")),
    ("data 2 x stage 4, GSPMD circular", ONE_HOST, (2, 4), ("data", "stage"), "gspmd_circular"),
    ("2 hosts: data 16, in-scan sync", TWO_HOSTS, (16,), ("data",), dict(scan_layers=True)),
    ("2 hosts: stage 2 (the hosts) x data 8", TWO_HOSTS, (2, 8), ("stage", "data"), dict(pipeline_microbatches=8)),
    ("2 hosts: stage 2 (the hosts) x data 8, 1F1B", TWO_HOSTS, (2, 8), ("stage", "data"),
     dict(pipeline_microbatches=8, pipeline_schedule="1f1b")),
    ("2 hosts: stage 2 (the hosts) x data 8, GSPMD circular", TWO_HOSTS, (2, 8), ("stage", "data"),
     "gspmd_circular"),
)
CIRCULAR_MICROBATCHES = 8


def circular_step(config: models.GPTConfig, mesh: Mesh, microbatches: int,
                  tx: optax.GradientTransformation) -> tuple:
    """MaxText's pipeline, written for XLA to partition: ``(jitted train step, its abstract
    params and optimizer state)``. Every tick feeds the next micro-batch to stage 0, shifts each
    stage's output to the next stage and runs every stage at once (a ``vmap`` over the stage
    dimension, which the ``stage`` sharding splits over the devices)."""
    stages = mesh.shape["stage"]
    block_def = nnx.graphdef(nnx.eval_shape(lambda: models.Block(config, rngs=nnx.Rngs(0))))
    block = jax.checkpoint(lambda p, h: nnx.merge(block_def, p)(h))  # the preset's remat: block inputs kept

    def constrained(x, *spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    def stage_fn(layers, h):
        return jax.lax.scan(lambda h, p: (block(p, h), None), h, layers)[0]

    def loss(params, batch):
        x = batch["x"].astype(config.param_dtype)
        rows = x.shape[0] // microbatches
        xs = constrained(x.reshape(microbatches, rows, *x.shape[1:]), None, "data")
        staged = jax.tree.map(lambda p: constrained(p.reshape(stages, p.shape[0] // stages, *p.shape[1:]), "stage"),
                              params["blocks"])

        def tick(carry, t):
            state, outputs = carry
            fed = jnp.where(t < microbatches, xs[jnp.minimum(t, microbatches - 1)], 0)
            shifted = constrained(jnp.concatenate([fed[None], state[:-1]]), "stage", "data")  # stage s takes s-1's
            state = constrained(jax.vmap(stage_fn)(staged, shifted), "stage", "data")
            done = t - (stages - 1)
            at = jnp.maximum(done, 0)
            last = jnp.where(done >= 0, state[-1], outputs[at])
            return (state, jax.lax.dynamic_update_index_in_dim(outputs, last, at, 0)), None

        start = constrained(jnp.zeros((stages, rows, *x.shape[1:]), x.dtype), "stage", "data")
        (_, outputs), _ = jax.lax.scan(tick, (start, jnp.zeros_like(xs)), jnp.arange(microbatches + stages - 1))
        h = outputs.reshape(x.shape).astype(jnp.float32)
        norm = params["ln_f"]
        h = (h - jnp.mean(h, -1, keepdims=True)) * jax.lax.rsqrt(jnp.var(h, -1, keepdims=True) + 1e-6)
        h = h * norm["scale"].astype(jnp.float32) + norm["bias"].astype(jnp.float32)
        return jnp.mean(jnp.square(h - batch["y"].astype(jnp.float32)))

    def train(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = models.abstract_params(config)
    placed = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    param_shardings = {k: jax.tree.map(lambda _, k=k: placed(P("stage") if k == "blocks" else P()), v)
                       for k, v in params.items()}
    opt_state = jax.eval_shape(tx.init, params)
    opt_shardings = optax.tree_map_params(tx, lambda _, s: s, opt_state, param_shardings,
                                          transform_non_params=lambda _: placed(P()))
    step = jax.jit(train, in_shardings=(param_shardings, opt_shardings, placed(P("data"))),
                   out_shardings=(param_shardings, opt_shardings, placed(P())), donate_argnums=(0, 1))
    return step, (params, opt_state)


def measure(label: str, topology: str, shape: tuple[int, ...], axes: tuple[str, ...], how: dict | str,
            target: str) -> dict:
    config = models.preset(PRESET)
    batch = models.example_batch(config, math.prod(shape) * SEQUENCES)
    mesh = gpu_mesh(shape, axes, target=target, topology=topology)
    tx = optax.adamw(1e-4)
    start = time.perf_counter()
    if how == "gspmd_circular":
        step, (params, opt_state) = circular_step(config, mesh, CIRCULAR_MICROBATCHES, tx)
        report = plan(step, params, opt_state, batch, target=target, topology=topology, scope=None)
        micro = CIRCULAR_MICROBATCHES
        fields = {"gspmd_circular": True, "pipeline_microbatches": micro}
    else:
        fields = dict(how, stage_axis="stage") if "stage" in axes else dict(how)
        step = jd.make_train_step(models.abstract_params(config), models.make_loss(config), tx, mesh,
                                  jd.TrainConfig(bucket_size=BUCKET_SIZE, **fields), example_batch=batch)
        report = plan(step, step.abstract_state(), batch, target=target, topology=topology)
        micro = fields.get("pipeline_microbatches")
    stages = mesh.shape["stage"] if "stage" in axes else 1
    timing = report.step_time
    return {"layout": label, "topology": topology, "mesh": dict(zip(axes, shape)), "config": fields,
            "temp_bytes": report.temp_bytes, "argument_bytes": report.argument_bytes,
            "collective_permutes": sum(c.kind == "collective-permute" for c in report.all_collectives),
            "sync_overlapped_by_chain": None if how == "gspmd_circular" else overlapped_by_chain(report),
            "bubble": None if micro is None else pipeline.bubble_fraction(micro, stages),
            "stage_inputs_held": None if micro is None or how == "gspmd_circular" else pipeline.stage_inputs_held(
                micro, stages, fields.get("pipeline_schedule", "gpipe")),
            # The circular pipeline's ticks are GPipe's: its stack takes GPipe's time.
            "stack_time_forwards": None if micro is None else pipeline.schedule_time(
                micro, stages, fields.get("pipeline_schedule", "gpipe")),
            "predicted_step_s": None if timing is None else timing.step_s,
            "exposed_comm_s": None if timing is None else timing.exposed_comm_s,
            "unpriced": [] if timing is None else list(timing.unpriced),
            "compile_s": round(time.perf_counter() - start, 1)}


#: The planner's bucket chains by what they hold: a stage axis runs each stage's layers in the
#: "expert" chain (reduced over the data axes alone).
CHAIN_NAMES = {"expert": "stage's layers", "layers": "layers (in the scan)", "dense": "the rest"}


def overlapped_by_chain(report) -> dict[str, list[int]]:
    """Per bucket chain: ``[reduces that overlap compute, reduces]`` on the compiled schedule."""
    counts: dict[str, list[int]] = {}
    for c in report.to_json()["collectives"]:
        if c["chain"] is not None:  # else not a bucket's reduce (the updated parameters' gather)
            done_total = counts.setdefault(CHAIN_NAMES.get(c["chain"], c["chain"]), [0, 0])
            done_total[0] += bool(c["overlapped"])
            done_total[1] += 1
    return counts


def table(rows: list[dict]) -> str:
    lines = ["| layout | temp MiB | arguments MiB | stage inputs held | stage sends | bubble | stack time "
             "(forwards) | buckets' reduces overlapped | predicted step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        bubble = "-" if r["bubble"] is None else f"{100 * r['bubble']:.0f}%"
        held = "-" if r["stage_inputs_held"] is None else str(r["stage_inputs_held"])
        overlap = "-" if r["sync_overlapped_by_chain"] is None else ", ".join(
            f"{name} {done}/{total}" for name, (done, total) in sorted(r["sync_overlapped_by_chain"].items()))
        step = "-" if r["predicted_step_s"] is None else f"{1e3 * r['predicted_step_s']:.1f} ms"
        stack = "-" if r["stack_time_forwards"] is None else f"{r['stack_time_forwards']:.0f}"
        lines.append(f"| {r['layout']} | {r['temp_bytes'] / 2**20:,.0f} | {r['argument_bytes'] / 2**20:,.0f} | "
                     f"{held} | {r['collective_permutes']} | {bubble} | {stack} | {overlap} | {step} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="h100")
    parser.add_argument("--out", help="a directory for stage_memory.md and stage_memory.json")
    args = parser.parse_args(argv)
    rows = []
    for layout in LAYOUTS:
        rows.append(measure(*layout, args.target))
        print(f"{layout[0]}: {rows[-1]['temp_bytes'] / 2**20:,.0f} MiB temp ({rows[-1]['compile_s']} s)", flush=True)
    text = (f"# A stage axis: the train step's memory (`python benchmarks/stage_memory.py`)\n\n"
            f"Compile-only {args.target.upper()}s (one host of 8, or two), `{PRESET}`, {SEQUENCES} sequences per "
            "device, AdamW; bytes per device from XLA's buffer assignment; buckets' reduces overlapped: per bucket "
            "chain, the reduces that overlap compute on the schedule; stack time: the schedule's ticks, each as long "
            "as its slowest stage, in one stage's forwards on a micro-batch (`jax_drain.pipeline.schedule_time`: a "
            "backward 2, plus 1 to recompute); predicted step: XLA's estimator, `-` where it prices no loop of the "
            "step\n\n" + table(rows) + "\n")
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
