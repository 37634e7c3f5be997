"""Wall time of the gradient sync on 8 virtual CPU devices, reduce modes side by side.

Times (1) the bucket reduce-scatter alone on random bf16 gradients of a tiny GPT and (2) the
whole ``value_and_grad`` step, for each reduce mode, interleaving the modes round by round so
that machine noise hits them alike, and reports medians and ratios to ``fp32_accum``. CPU
times say nothing about GPU speed; they check that no mode is pathologically slow.

    python benchmarks/cpu_speed.py --json speed.json
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_drain as jd  # noqa: E402
from jax_drain import _compat, models  # noqa: E402

MODES = ("bf16", "fp32", "fp32_accum", "fp32_accum_streamed")


def build(mode: str, config, mesh, params, batch, bucket_size: int):
    loss_fn = models.make_loss(config)
    sync = jd.GradSync(params, mesh, bucket_size=bucket_size, reduce=mode,
                       order=jd.grad_ready_order(loss_fn, params, batch))
    step = jax.jit(_compat.shard_map(sync.value_and_grad(loss_fn), mesh=mesh,
                                     in_specs=(P(), P("data")), out_specs=(P(), P("data"))))
    reduce_only = jax.jit(_compat.shard_map(lambda g: sync.reduce_scatter(jax.tree.map(lambda x: x[0], g)),
                                            mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    return step, reduce_only


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--num-buckets", type=int, default=8)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    config = models.preset(args.preset)
    params = models.init_params(config, jax.random.key(0))
    batch = models.example_batch(config, 8 * 2, jax.random.key(1))
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda x: np.asarray(rng.normal(size=(8, *x.shape)), x.dtype), params)
    from jax_drain.plan import bucket_size_for

    bucket_size = bucket_size_for(params, args.num_buckets)
    fns = {m: build(m, config, mesh, params, batch, bucket_size) for m in MODES}
    for step, reduce_only in fns.values():  # compile and warm up
        jax.block_until_ready(step(params, batch))
        jax.block_until_ready(reduce_only(grads))

    times = {(m, what): [] for m in MODES for what in ("step", "reduce")}
    for _ in range(args.rounds):
        for m, (step, reduce_only) in fns.items():
            for what, call in (("step", lambda: step(params, batch)), ("reduce", lambda: reduce_only(grads))):
                t0 = time.perf_counter()
                jax.block_until_ready(call())
                times[m, what].append(time.perf_counter() - t0)
    rows = []
    base = {what: statistics.median(times["fp32_accum", what]) for what in ("step", "reduce")}
    print(f"{args.preset}, {args.num_buckets} requested buckets, 8 CPU devices, median of {args.rounds} rounds")
    print(f"{'mode':22s} {'reduce ms':>10s} {'ratio':>6s} {'step ms':>9s} {'ratio':>6s}")
    for m in MODES:
        red, stp = (statistics.median(times[m, w]) for w in ("reduce", "step"))
        rows.append({"mode": m, "reduce_ms": red * 1e3, "step_ms": stp * 1e3,
                     "reduce_vs_fp32_accum": red / base["reduce"], "step_vs_fp32_accum": stp / base["step"]})
        print(f"{m:22s} {red * 1e3:10.2f} {red / base['reduce']:6.2f} {stp * 1e3:9.2f} {stp / base['step']:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
