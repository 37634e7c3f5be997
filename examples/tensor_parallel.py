"""A tensor-parallel training step with the distributed optimizer on a ("replica", "data", "model") mesh.

A two-layer MLP block, column/row parallel over "model" (Megatron's layout), data parallel over
"data" within a host and "replica" across hosts; trained with AdamW (no decay on biases and the
norm scale) and global-norm clipping. Runs on 8 virtual CPU devices:

    python examples/tensor_parallel.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax_drain as jd  # noqa: E402  (before jax: no CUDA-plugin start-up lines without a GPU)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

D, H, STEPS = 32, 128, 20

rng = np.random.default_rng(0)
params = {
    "norm": np.ones(D, np.float32),
    "w_in": rng.normal(size=(D, H)).astype(np.float32) * D**-0.5,
    "b_in": np.zeros(H, np.float32),
    "w_out": rng.normal(size=(H, D)).astype(np.float32) * H**-0.5,
    "b_out": np.zeros(D, np.float32),
}
specs = {"norm": None, "w_in": P(None, "model"), "b_in": P("model"), "w_out": P("model", None), "b_out": None}


def loss_fn(p, batch):
    """Runs on local blocks: w_in is [D, H / 2] on each model rank; the row-parallel matmul is
    summed over "model" here, as in any tensor-parallel model."""
    h = jax.nn.gelu((batch["x"] * p["norm"]) @ p["w_in"] + p["b_in"])
    y = jax.lax.psum(h @ p["w_out"], "model") + p["b_out"]
    return jnp.mean((y - batch["y"]) ** 2)


def batches(n, seed=1):
    data = np.random.default_rng(seed)
    target = data.normal(size=(D, D)).astype(np.float32) * D**-0.5
    for _ in range(n):
        x = data.normal(size=(32, D)).astype(np.float32)
        yield {"x": x, "y": np.tanh(x @ target)}


mesh = jax.make_mesh((2, 2, 2), ("replica", "data", "model"))
decay = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # kernels only
step = jd.make_train_step(
    params, loss_fn, jd.adamw(3e-3, weight_decay=0.1, mask=decay, max_norm=1.0), mesh,
    jd.TrainConfig(axis="data", outer_axis="replica", param_specs=specs, bucket_size=2048),
)
state = step.init()
losses = []
for batch in batches(STEPS):
    state, metrics = step(state, batch)
    losses.append(float(metrics.loss))
print(step.sync.table())
print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {STEPS} steps; w_in is {state.params['w_in'].sharding.spec}")
