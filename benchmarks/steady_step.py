"""The steady train step against plain ``jax.jit``, side by side on 8 virtual CPU devices.

Builds, in one process, a plain ``jax.jit`` optax AdamW step (parameters replicated over a
``("data",)`` mesh, batch split over it: what a user writes without this library; and the same
step on one device with the whole batch, the same arithmetic with no distribution at all) and
``jd.make_train_step`` with ``TrainConfig()`` defaults and the main alternatives. After one
warm-up step each, the variants run round by round, interleaved, so that machine noise hits them
alike; the table gives each one's median step and its ratio to ``jit``.

A regression of the default step shows here as a ratio that grows. CPU times say nothing about
GPU speed (XLA:CPU runs the 8 devices' programs on the host's cores): they check that nothing
the library adds costs more than it should.

    taskset -c 0,1 python benchmarks/steady_step.py --out benchmarks/results
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding  # noqa: E402

import jax_drain as jd  # noqa: E402
from jax_drain.models import GPT, GPTConfig  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from first_step import CPU_MODELS as MODELS  # noqa: E402  (one definition of the CPU models)

#: jax_drain variants: name -> TrainConfig fields (``default`` is ``TrainConfig()``).
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "bf16": dict(reduce="bf16"),
    "fp32": dict(reduce="fp32"),
    "fp32_accum_streamed": dict(reduce="fp32_accum_streamed"),
    "zero3": dict(shard_params=True),
}

Step = Callable[[Any, Any], tuple[Any, jax.Array]]


def _jit_step(model: nnx.Module, tx, sharding, batch_sharding) -> tuple[Step, Any]:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(params, sharding)
    opt_state = jax.jit(tx.init, out_shardings=sharding)(params)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: nnx.merge(graphdef, p, rest).loss(batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(train_step, in_shardings=(sharding, sharding, batch_sharding),
                     out_shardings=(sharding, sharding, sharding), donate_argnums=(0, 1))

    def run(state, batch):
        params, opt_state, loss = jitted(*state, batch)
        return (params, opt_state), loss

    return run, (params, opt_state)


def _jd_step(model: nnx.Module, tx, mesh: Mesh, fields: dict[str, Any], batch) -> tuple[Step, Any]:
    step = jd.make_train_step(model, lambda m, b: m.loss(b), tx, mesh, jd.TrainConfig(**fields),
                              example_batch=batch)

    def run(state, batch):
        state, metrics = step(state, batch)
        return state, metrics.loss

    return run, step.init()


def measure(model_name: str, variants: list[str], rounds: int) -> list[dict[str, Any]]:
    """One row per variant: the median and minimum steady step (s) over ``rounds``, interleaved."""
    fields, batch_size = MODELS[model_name]
    config = GPTConfig(**fields, param_dtype=jnp.float32)
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("data",))
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, config.vocab_size, (batch_size, config.seq_len + 1)).astype(np.int32)}
               for _ in range(4)]
    tx = optax.adamw(1e-3)
    steps: dict[str, tuple[Step, Any, Any]] = {}  # name -> (run, state, batch placement)
    for name in variants:
        model = GPT(config, rngs=nnx.Rngs(0))
        if name == "jit":
            run, state = _jit_step(model, tx, NamedSharding(mesh, P()), NamedSharding(mesh, P("data")))
            place = NamedSharding(mesh, P("data"))
        elif name == "jit_1device":
            one = SingleDeviceSharding(devices.flat[0])
            run, state = _jit_step(model, tx, one, one)
            place = one
        else:
            run, state = _jd_step(model, tx, mesh, VARIANTS[name], batches[0])
            place = NamedSharding(mesh, P("data"))
        steps[name] = (run, state, place)
    placed = {name: [jax.device_put(b, place) for b in batches] for name, (_, _, place) in steps.items()}
    states = {}
    for name, (run, state, _) in steps.items():  # compile and warm up
        states[name], loss = run(state, placed[name][0])
        jax.block_until_ready((states[name], loss))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name, (run, _, _) in steps.items():
            start = time.perf_counter()
            states[name], loss = run(states[name], placed[name][(r + 1) % len(batches)])
            jax.block_until_ready((states[name], loss))
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["jit"]) if "jit" in times else None
    return [{"model": model_name, "variant": name, "median_s": statistics.median(t), "min_s": min(t),
             "rounds": rounds, "vs_jit": statistics.median(t) / base if base else None}
            for name, t in times.items()]


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| model | variant | steady step (ms, median) | min (ms) | vs jit |", "|---|---|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['vs_jit']:.2f}x" if r["vs_jit"] is not None else ""
        out.append(f"| {r['model']} | {r['variant']} | {r['median_s'] * 1e3:.0f} | {r['min_s'] * 1e3:.0f} | {ratio} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-8m", choices=sorted(MODELS))
    p.add_argument("--variants", default="jit,jit_1device," + ",".join(VARIANTS),
                   help="comma-separated: jit, jit_1device and jax_drain's " + ", ".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--out", metavar="DIR", help="write steady_step.json and steady_step.md there")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - {"jit", "jit_1device", *VARIANTS}
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}")
    rows = measure(args.model, variants, args.rounds)
    text = (f"Steady train step on {jax.device_count()} CPU devices, {args.model}, optax.adamw, "
            f"median of {args.rounds} interleaved rounds\n\n{table(rows)}")
    print(text)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "steady_step.json").write_text(json.dumps(rows, indent=1))
        (out / "steady_step.md").write_text(f"# {text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
