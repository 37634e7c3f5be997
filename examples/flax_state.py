"""Flax models with state besides their parameters: an nnx CNN and a linen CNN, each with
BatchNorm statistics computed across the data-parallel devices, trained side by side.

The nnx model's statistics (and RNG counters) ride in ``state.model_state``; the linen model
names its mutable collections (``mutable=["batch_stats"]``), as ``module.apply`` does. Either
way they are updated every step, kept bit for bit on a skipped step and saved in checkpoints.
8 virtual CPU devices, random images, a few seconds:

    python examples/flax_state.py --steps 20
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train_gpt import setup_devices  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--devices", type=int, default=8)
    args = p.parse_args(argv)
    setup_devices(args.devices)

    import jax_drain as jd  # before jax: no CUDA-plugin start-up lines without a GPU

    import jax
    import numpy as np
    import optax
    from flax import linen as nn
    from flax import nnx

    def batch_at(step: int) -> dict:
        rng = np.random.default_rng([2, step])
        return {"x": rng.normal(size=(32, 8, 8, 3)).astype(np.float32),
                "y": rng.integers(0, 10, size=32).astype(np.int32)}

    class CNN(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.conv = nnx.Conv(3, 16, kernel_size=(3, 3), use_bias=False, rngs=rngs)
            self.norm = nnx.BatchNorm(16, axis_name="data", rngs=rngs)  # statistics over all devices
            self.head = nnx.Linear(16, 10, rngs=rngs)

        def __call__(self, x):
            return self.head(jax.nn.relu(self.norm(self.conv(x))).mean(axis=(1, 2)))

    def nnx_loss(model, batch):  # a scalar mean (or jd.WeightedLoss)
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    class LinenCNN(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Conv(16, (3, 3), use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=not train, axis_name="data")(x)
            return nn.Dense(10)(nn.relu(x).mean(axis=(1, 2)))

    module = LinenCNN()
    variables = module.init(jax.random.key(0), batch_at(0)["x"][:1], train=False)  # params, batch_stats

    def linen_loss(variables, batch):  # returns (loss, updates), as apply gives them
        logits, updates = module.apply(variables, batch["x"], train=True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), updates

    mesh = jax.make_mesh((args.devices,), ("data",))
    model = CNN(nnx.Rngs(0))
    nnx_step = jd.make_train_step(model, nnx_loss, optax.adam(1e-2), mesh)
    linen_step = jd.make_train_step(variables, linen_loss, optax.adam(1e-2), mesh, mutable=["batch_stats"])

    losses = {"nnx": [], "linen": []}
    nnx_state, linen_state = nnx_step.init(), linen_step.init()
    for i in range(args.steps):
        nnx_state, metrics = nnx_step(nnx_state, batch_at(i))
        losses["nnx"].append(float(metrics.loss))
        linen_state, metrics = linen_step(linen_state, batch_at(i))
        losses["linen"].append(float(metrics.loss))

    nnx_step.update_model(model, nnx_state)  # copies: training can go on from nnx_state
    model.eval()
    nnx_logits = model(batch_at(0)["x"])
    linen_logits = module.apply(linen_step.variables(linen_state), batch_at(0)["x"], train=False)

    for name, curve in losses.items():
        print(f"{name:5s} loss {curve[0]:.4f} -> {curve[-1]:.4f}")
    print(f"eval logits finite: nnx {bool(np.isfinite(nnx_logits).all())}, "
          f"linen {bool(np.isfinite(linen_logits).all())}")
    return losses


if __name__ == "__main__":
    main()
