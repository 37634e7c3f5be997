"""benchmarks/stage_memory.py: the GSPMD circular pipeline it measures jax_drain's stage axis
against computes the model's own loss and update (else the comparison would mean nothing)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jax_drain import models

from helpers import assert_within, assert_within_rounding, load_benchmark, rounding_chain, sgd_rounding_bounds


def test_the_gspmd_circular_pipeline_gives_the_model_s_loss_and_update():
    """On 8 CPU devices as (data, stage) = (2, 4), 8 micro-batches, a float32 scanned GPT of 8
    blocks: the baseline's loss and SGD update equal the model's own on one device within the
    float32 rounding of the loss's and gradient's computation."""
    bench = load_benchmark("stage_memory")
    config = models.GPTConfig(num_layers=8, d_model=32, num_heads=2, seq_len=8, scan_layers=True,
                              param_dtype=jnp.float32)
    params = models.init_params(config, jax.random.key(0))
    batch = models.example_batch(config, 16, jax.random.key(1))
    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("data", "stage"))
    step, _ = bench.circular_step(config, mesh, 8, optax.sgd(1.0))
    donated = jax.tree.map(jnp.copy, params)  # the step donates its parameters
    new_params, _, loss = step(donated, optax.sgd(1.0).init(params), batch)
    loss_fn = models.make_loss(config)
    want_loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    additions = rounding_chain(jax.grad(loss_fn), params, batch)
    assert_within_rounding(np.asarray(loss), np.asarray(want_loss), additions=additions, what="loss")
    want = jax.tree.map(lambda p, g: np.asarray(p) - np.asarray(g), params, grads)
    bounds = sgd_rounding_bounds([grads], additions=additions, learning_rate=1.0, params=params)
    assert_within(jax.device_get(new_params), want, bounds[-1], what="the updated parameters")
