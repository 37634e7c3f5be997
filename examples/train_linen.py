"""A ``flax.linen`` model with jax_drain: pass the params pytree and a ``loss(params, batch)``.

Fits an MLP to a fixed random "teacher" MLP on 8 virtual CPU devices, with a sharded AdamW
(no decay on biases) and global-norm clipping. Takes a few seconds.

    python examples/train_linen.py --steps 300
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train_gpt import setup_devices  # noqa: E402


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=2)
    args = p.parse_args(argv)
    setup_devices(args.devices)

    import jax_drain as jd  # before jax: no CUDA-plugin start-up lines without a GPU

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import linen as nn
    from jax.sharding import Mesh

    class MLP(nn.Module):
        width: int = 128

        @nn.compact
        def __call__(self, x):
            x = nn.gelu(nn.Dense(self.width)(x))
            x = nn.gelu(nn.Dense(self.width)(x))
            return nn.Dense(4)(x)

    teacher, student = MLP(width=32), MLP()
    key_t, key_s = jax.random.split(jax.random.key(0))
    teacher_params = teacher.init(key_t, jnp.zeros((1, 16)))["params"]
    params = student.init(key_s, jnp.zeros((1, 16)))["params"]

    label = jax.jit(lambda x: teacher.apply({"params": teacher_params}, x))

    def batch_at(step: int) -> dict:
        x = np.random.default_rng([1, step]).normal(size=(256, 16)).astype(np.float32)
        return {"x": x, "y": np.asarray(label(x))}

    def loss_fn(params, batch):
        return jnp.mean((student.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    tx = optax.chain(
        jd.clip_by_global_norm(1.0),
        optax.scale_by_adam(),
        jd.masked(optax.add_decayed_weights(1e-4), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
        optax.scale_by_learning_rate(optax.cosine_decay_schedule(3e-3, args.steps)),
    )
    mesh = Mesh(np.array(jax.devices()[: args.devices]), ("data",))
    step = jd.make_train_step(params, loss_fn, tx, mesh,
                              jd.TrainConfig(bucket_size=8192, microbatches=args.microbatches),
                              example_batch=batch_at(0))
    state = step.init()
    losses = []
    for i in range(args.steps):
        state, metrics = step(state, batch_at(i))
        losses.append(float(metrics.loss))
        if (i + 1) % max(1, args.steps // 5) == 0:
            print(f"step {i + 1:4d}  loss {losses[-1]:.5f}")
    print(f"{step.sync.num_buckets} buckets; loss {losses[0]:.5f} -> {losses[-1]:.5f}")
    return losses


if __name__ == "__main__":
    main()
