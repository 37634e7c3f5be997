"""XLA's predicted compute time against one real GPU: the planner's times, calibrated.

The planner's step times are XLA's estimates (its latency-hiding scheduler's prices on the
compile-only target), never checked against a GPU. This script checks the part that needs no
second GPU: one device's forward and (rematerialised) backward of a preset, with no
communication.

* **Predicted**: the ``no_comm`` plan of the preset at this micro-batch, compiled for the
  compile-only target (the gradient step without the gradient wire; its only collective is the
  loss's scalar mean): XLA's predicted step and the compute inside it.
* **Measured**: ``jax.jit(jax.value_and_grad(loss))`` of the same preset on one micro-batch, on
  the first local GPU, the median of ``--repeats`` timed calls after ``--warmup`` untimed ones.

The ratio measured / predicted says how far XLA's prices are from this GPU; the README quotes it
when a GPU run was made. ``--dry`` runs everything on CPU at a one-block preset (the measurement
on the host's CPU): it checks the script, never the estimator.

    python benchmarks/calibrate.py --preset gpt-blocks --out benchmarks/results   # on one GPU
    python benchmarks/calibrate.py --dry                                           # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

#: The preset ``--dry`` uses unless told: one block, d_model 128.
DRY_PRESET = dict(preset="tiny", layers=1, d_model=128)


def predict(config: Any, micro_batch: int, target: str) -> dict[str, Any]:
    """XLA's prices of the ``no_comm`` step of ``config`` on the compile-only ``target``."""
    from jax_drain import plan

    report = plan.plan_preset(config, "no_comm", target=target, micro_batch=micro_batch, num_buckets=1)
    time_ = report.step_time
    if time_ is None or time_.step_s is None:
        why = "; ".join(time_.unpriced) if time_ is not None else "no schedule was dumped"
        raise SystemExit(f"calibrate.py: XLA gave no predicted time for the no_comm step ({why})")
    return {"predicted_step_s": time_.step_s, "predicted_compute_s": time_.compute_s,
            "predicted_exposed_comm_s": time_.exposed_comm_s}


def measure(config: Any, micro_batch: int, device: Any, *, repeats: int, warmup: int) -> dict[str, Any]:
    """Times ``value_and_grad`` of ``config``'s loss on ``micro_batch`` sequences on ``device``."""
    import jax

    from jax_drain import models

    params = jax.device_put(models.init_params(config, jax.random.key(0)), device)
    batch = jax.device_put(models.example_batch(config, micro_batch, jax.random.key(1)), device)
    step = jax.jit(jax.value_and_grad(models.make_loss(config)))
    for _ in range(warmup):  # the first call compiles
        jax.block_until_ready(step(params, batch))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(params, batch))
        times.append(time.perf_counter() - start)
    return {"measured_s": statistics.median(times), "measured_min_s": min(times), "repeats": repeats,
            "device": f"{device.platform}: {device.device_kind}"}


def calibrate(preset: str, *, layers: int | None = None, d_model: int | None = None, micro_batch: int = 1,
              target: str = "h100", repeats: int = 20, warmup: int = 3, dry: bool = False) -> dict[str, Any]:
    """One calibration row: the preset's predicted and measured times and their ratio.

    Without ``dry`` the measurement runs on the first GPU and refuses to run without one; with
    ``dry``, on the first CPU device (the ratio then calibrates nothing).

    Example::

        row = calibrate("tiny", layers=1, d_model=128, repeats=3, dry=True)
        row["measured_s"], row["predicted_step_s"], row["ratio"]
    """
    import jax

    if dry:
        device = jax.devices("cpu")[0]
    else:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if not gpus:
            raise SystemExit("calibrate.py: no GPU here (jax sees " + ", ".join(sorted({d.platform for d in jax.devices()}))
                             + "); run it on a GPU machine, or add --dry to check the script on CPU")
        device = gpus[0]
    from jax_drain.plan import preset_config

    config = preset_config(preset, layers=layers, d_model=d_model)
    row = {"preset": preset, "num_layers": config.num_layers, "d_model": config.d_model,
           "params": int(config.num_params()), "micro_batch": micro_batch, "target": target, "dry": dry}
    row.update(predict(config, micro_batch, target))
    row.update(measure(config, micro_batch, device, repeats=repeats, warmup=warmup))
    row["ratio"] = row["measured_s"] / row["predicted_step_s"]
    return row


def markdown(row: dict[str, Any], command: str) -> str:
    ms = lambda s: "-" if s is None else f"{s * 1e3:.3f}"  # noqa: E731
    lines = [f"# XLA's predicted time against one device (`{command}`)", ""]
    if row["dry"]:
        lines += ["**Dry run on CPU: the measured time is the host CPU's, so the ratio calibrates nothing.**", ""]
    lines += ["| preset | layers | d_model | micro-batch | device | measured ms (min) | predicted step ms | "
              "predicted compute ms | measured / predicted |",
              "|---|---:|---:|---:|---|---:|---:|---:|---:|",
              f"| {row['preset']} | {row['num_layers']} | {row['d_model']} | {row['micro_batch']} | {row['device']} | "
              f"{ms(row['measured_s'])} ({ms(row['measured_min_s'])}) | {ms(row['predicted_step_s'])} | "
              f"{ms(row['predicted_compute_s'])} | {row['ratio']:.2f} |", "",
              f"Predicted: XLA's latency-hiding scheduler on the compile-only `{row['target']}` target, the "
              "`no_comm` gradient step (no gradient wire) on 8 devices, one device's program. Measured: "
              f"`jax.jit(jax.value_and_grad(loss))` on one device, median of {row['repeats']} calls."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", help="a jax_drain.models preset (default gpt-blocks; --dry: a one-block tiny)")
    p.add_argument("--layers", type=int, help="override the preset's number of blocks")
    p.add_argument("--d-model", type=int, help="override the preset's width")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per device")
    p.add_argument("--target", default="h100", help="the compile-only target XLA prices for")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dry", action="store_true", help="measure on CPU: checks the script, not the estimator")
    p.add_argument("--out", metavar="DIR", help="write calibrate.json and calibrate.md there")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 1:
        p.error("--repeats and --warmup must be at least 1 (the first call compiles)")
    preset, layers, d_model = args.preset, args.layers, args.d_model
    if preset is None:
        preset, layers, d_model = (DRY_PRESET["preset"], layers or DRY_PRESET["layers"],
                                   d_model or DRY_PRESET["d_model"]) if args.dry else ("gpt-blocks", layers, d_model)
    row = calibrate(preset, layers=layers, d_model=d_model, micro_batch=args.micro_batch, target=args.target,
                    repeats=args.repeats, warmup=args.warmup, dry=args.dry)
    command = "python benchmarks/calibrate.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = markdown(row, command)
    print(text, end="")
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "calibrate.json").write_text(json.dumps({"command": command, **row}, indent=1))
        (out / "calibrate.md").write_text(text)
    return 0


if __name__ == "__main__":
    if "--dry" in sys.argv:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPU devices need the CPU platform
    raise SystemExit(main())
