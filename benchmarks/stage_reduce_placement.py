"""Where a pipeline stage's bucket reduces can go in one SPMD program, priced by XLA's GPU scheduler.

Megatron starts a stage's gradient reduce once that stage's last backward micro-batch is done,
while the other stages are still in the flush. In one SPMD program every stage runs the same
loop, so each placement has to be written so that every member of a data group issues the same
collectives. This benchmark builds three placements of the same GPipe backward and compiles each
for compile-only H100s, reading XLA's predicted step, the communication it leaves exposed and
the temp memory:

* ``after the flush`` (what ``TrainConfig(stage_axis=...)`` does): the stage's gradients are
  summed over the micro-batches in float32 through the backward loop and reduce-scattered
  bucket by bucket (``fp32_accum``, drained: one bucket in flight) after it, overlapping
  what follows the stack's backward (here an embedding-sized gradient matmul on stage 0's input
  cotangents);
* ``per-stage condition``: in the backward loop, the tick in which a stage finishes its last
  micro-batch reduces its buckets under ``lax.cond(tick == that tick)``. Every device of a data
  group is on the same stage, so all take the branch alike;
* ``per tick, masked``: every tick every stage reduce-scatters that tick's gradient (zeros on a
  tick without a micro-batch) and sums the shards: no float32 sum of the whole stage gradient,
  one reduce per tick, unconditional, which XLA's scheduler can overlap with the loop body.

The stack is ``gpt-blocks-scan``'s MLP blocks (d_model 2048, 4x, bf16) split over
``(data, stage, model) = (2, 2, 2)``, hand-written tensor parallel (an all-reduce over ``model``
per block: it makes XLA schedule, and so price, the loops), 4 sequences of 512 tokens per device,
4 micro-batches.

    python benchmarks/stage_reduce_placement.py --out benchmarks/results   # about 1 min
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPU devices need the CPU platform

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_drain.collectives import reduce_scatter_bucket  # noqa: E402
from jax_drain.drain import sequenced_map  # noqa: E402
from jax_drain.planner.plan import plan  # noqa: E402
from jax_drain.planner.targets import gpu_mesh  # noqa: E402

D_MODEL, LAYERS, VOCAB = 2048, 8, 32768
ROWS = 4 * 512  # per device
SHAPE, AXES = (2, 2, 2), ("data", "stage", "model")
MICROBATCHES = 4
BUCKETS = 4
PLACEMENTS = ("after the flush", "per-stage condition", "per tick, masked")


def _stage(w: dict, x: jax.Array) -> jax.Array:
    """This stage's blocks: a residual MLP each, split over ``model`` (Megatron's split)."""
    def block(h, wl):
        y = jax.nn.gelu(h @ wl["up"]) @ wl["down"]
        return h + jax.lax.psum(y, "model"), None
    return jax.lax.scan(block, x, w)[0]


def _buckets(grads: dict) -> list[jax.Array]:
    flat = jnp.concatenate([g.reshape(-1) for g in jax.tree.leaves(grads)])
    return jnp.split(flat, BUCKETS)


def _reduce(grads: dict) -> jax.Array:
    """The stage's buckets reduce-scattered over ``data``, one in flight: this device's shards."""
    shards = sequenced_map(lambda _, b: reduce_scatter_bucket(b, "data", mode="fp32_accum", average=True),
                           _buckets(grads), 1)
    return jnp.concatenate(shards)


def step_of(placement: str, mesh: Mesh | None = None, *, d_model: int = D_MODEL, layers: int = LAYERS,
            rows: int = ROWS, vocab: int = VOCAB, microbatches: int = MICROBATCHES) -> tuple:
    """``(jitted step, abstract arguments)``: the stack's GPipe forward and backward with the
    stage's buckets reduced at ``placement``, on ``mesh`` (``(data, stage, model)``; default
    compile-only H100s). The step returns each device's reduced shards and the tail's result."""
    mesh = gpu_mesh(SHAPE, AXES) if mesh is None else mesh
    data, stages = mesh.shape["data"], mesh.shape["stage"]
    ticks = microbatches + stages - 1

    def body(w, x, embed):
        stage = jax.lax.axis_index("stage")
        gathered = jax.lax.all_gather(x, "stage", tiled=True)
        micro = gathered.reshape(microbatches, -1, d_model)
        first, last = stage == 0, stage == stages - 1
        forward = [(s, s + 1) for s in range(stages - 1)]
        backward = [(s + 1, s) for s in range(stages - 1)]

        def fwd_tick(carry, t):
            received, stash = carry
            m = jnp.clip(t - stage, 0, microbatches - 1)
            h = jnp.where(first, micro[m], received)
            stash = stash.at[t].set(h)
            return (jax.lax.ppermute(_stage(w, h), "stage", forward), stash), None

        zeros = jnp.zeros_like(micro[0])
        (_, stash), _ = jax.lax.scan(fwd_tick, (zeros, jnp.zeros((ticks, *micro.shape[1:]), micro.dtype)),
                                     jnp.arange(ticks))
        shard_size = sum(a.size for a in jax.tree.leaves(w)) // data
        sums = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), w)

        def bwd_tick(carry, t):
            cot_in, sums, shards, input_cots = carry
            m = t - stage
            valid = (m >= 0) & (m < microbatches)
            cot = jnp.where(last, jnp.ones_like(cot_in), cot_in)  # d(sum of outputs)
            _, pull = jax.vjp(_stage, w, stash[t])
            dw, dx = pull(cot)
            dw = jax.tree.map(lambda g: jnp.where(valid, g, 0).astype(jnp.float32), dw)
            if placement == "per tick, masked":
                shards = shards + _reduce(dw)
            else:
                sums = jax.tree.map(jnp.add, sums, dw)
            if placement == "per-stage condition":
                # Stage s's last micro-batch (m = 0) runs at tick s of the reverse loop.
                shards = jax.lax.cond(t == stage, _reduce, lambda g: jnp.zeros_like(shards), sums) + shards
            at = jnp.clip(m, 0, microbatches - 1)
            input_cots = input_cots.at[at].set(jnp.where(valid & first, dx, input_cots[at]))
            return (jax.lax.ppermute(dx, "stage", backward), sums, shards, input_cots), None

        init = (zeros, sums, jnp.zeros((shard_size,), jnp.float32), jnp.zeros_like(micro))
        (_, sums, shards, input_cots), _ = jax.lax.scan(bwd_tick, init, jnp.arange(ticks)[::-1])
        if placement == "after the flush":
            shards = _reduce(sums)
        # What follows the stack's backward: each device's rows' input cotangents back from
        # stage 0, and an embedding-sized gradient matmul on them.
        mine = jax.lax.psum_scatter(input_cots.reshape(-1, d_model), "stage", scatter_dimension=0, tiled=True)
        return shards[None], jnp.einsum("rd,rv->dv", mine, embed)[None]

    specs = {"up": P("stage", None, "model"), "down": P("stage", "model", None)}
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(("data", "stage")), P(("data", "stage"), "model")),
                           out_specs=(P(AXES), P(("data", "stage"), None, "model")), check_vma=False)
    width = 4 * d_model
    w = {"up": jax.ShapeDtypeStruct((layers, d_model, width), jnp.bfloat16,
                                    sharding=NamedSharding(mesh, specs["up"])),
         "down": jax.ShapeDtypeStruct((layers, width, d_model), jnp.bfloat16,
                                      sharding=NamedSharding(mesh, specs["down"]))}
    total = data * stages * rows
    x = jax.ShapeDtypeStruct((total, d_model), jnp.bfloat16, sharding=NamedSharding(mesh, P(("data", "stage"))))
    embed = jax.ShapeDtypeStruct((total, vocab), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, P(("data", "stage"), "model")))
    return jax.jit(mapped), (w, x, embed)


def measure(placement: str) -> dict:
    start = time.perf_counter()
    step, args = step_of(placement)
    report = plan(step, *args, scope=None)
    timing = report.step_time
    kinds = {} if timing is None else {k: v for k, v in timing.exposed_comm_by_kind.items() if v}
    return {"placement": placement, "temp_bytes": report.temp_bytes,
            "predicted_step_s": None if timing is None else timing.step_s,
            "exposed_comm_s": None if timing is None else timing.exposed_comm_s,
            "exposed_comm_by_kind_s": kinds, "unpriced": [] if timing is None else list(timing.unpriced),
            "reduce_collectives": sum(c.kind in ("all-to-all", "reduce-scatter") for c in report.all_collectives),
            "compile_s": round(time.perf_counter() - start, 1)}


def table(rows: list[dict]) -> str:
    lines = ["| placement | temp MiB | predicted step | exposed communication | of it, the reduces' all-to-alls |",
             "|---|---:|---:|---:|---:|"]
    ms = lambda s: "-" if s is None else f"{1e3 * s:.2f} ms"  # noqa: E731
    for r in rows:
        priced = r["predicted_step_s"] is not None
        reduces = r["exposed_comm_by_kind_s"].get("all-to-all", 0.0) if priced else None
        lines.append(f"| {r['placement']} | {r['temp_bytes'] / 2**20:,.0f} | {ms(r['predicted_step_s'])} | "
                     f"{ms(r['exposed_comm_s'])} | {ms(reduces)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="a directory for stage_reduce_placement.{md,json}")
    args = parser.parse_args(argv)
    rows = []
    for placement in PLACEMENTS:
        rows.append(measure(placement))
        print(f"{placement}: {rows[-1]}", flush=True)
    text = ("# A stage's bucket reduces: three placements (`python benchmarks/stage_reduce_placement.py`)\n\n"
            f"Compile-only H100s, (data, stage, model) = {SHAPE}, {LAYERS} MLP blocks of d_model {D_MODEL} (bf16, "
            f"split over model), {ROWS} tokens per device, {MICROBATCHES} micro-batches, GPipe, {BUCKETS} fp32_accum "
            "buckets per stage, one in flight; XLA's predicted step and exposed communication (estimates), `-` "
            "where XLA's scheduler prices no schedule (" + "; ".join(sorted({u for r in rows for u in r["unpriced"]}))
            + ")\n\n" + table(rows) + "\n")
    print(text)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "stage_reduce_placement.md").write_text(text)
        (out / "stage_reduce_placement.json").write_text(json.dumps({"rows": rows}, indent=1))
        print(f"wrote {out / 'stage_reduce_placement.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
