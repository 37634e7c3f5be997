"""jax_drain in a few lines: a Flax model's gradients, bucketed, drained, fp32-accumulated.

Runs on 8 virtual CPU devices: python examples/quickstart.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax_drain as jd  # noqa: E402  (before jax: no CUDA-plugin start-up lines without a GPU)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

model = nnx.Sequential(nnx.Linear(64, 256, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(256, 64, rngs=nnx.Rngs(1)))
graphdef, params = nnx.split(model, nnx.Param)
loss_fn = lambda params, batch: jnp.mean((nnx.merge(graphdef, params)(batch["x"]) - batch["y"]) ** 2)

mesh = Mesh(np.array(jax.devices()), ("data",))
batch = {"x": jax.random.normal(jax.random.key(0), (64, 64)), "y": jax.random.normal(jax.random.key(1), (64, 64))}
sync = jd.GradSync(params, mesh, axis="data", bucket_size=10_000, reduce="fp32_accum", drain=True,
                   order=jd.grad_ready_order(loss_fn, params, batch))


@jax.jit
@jax.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data")))
def grad_step(params, batch):
    return sync.value_and_grad(loss_fn)(params, batch)  # (mean loss, this device's fp32 shards)


loss, shards = grad_step(params, batch)
print(sync.table())
print(f"loss {float(loss):.4f}; {sync.num_buckets} buckets; shard shapes {[s.shape for s in shards]}")
mean_grads = sync.unflatten(shards)  # whole buckets (gathered over devices) back to the params' tree
