"""The stage axis's benchmarks compare like with like (else their tables would mean nothing):
benchmarks/stage_memory.py's GSPMD circular pipeline computes the model's own loss and update,
and benchmarks/stage_reduce_placement.py's placements reduce the same gradient."""

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


def test_the_reduce_placements_reduce_the_same_gradient():
    """benchmarks/stage_reduce_placement.py prices three placements of one computation. On 8 CPU
    devices as (data, stage, model) = (2, 2, 2), on random bf16 weights and rows: reducing under
    the per-stage condition sends the same float32 sums as after the flush, so its shards are
    equal bit for bit; with one micro-batch, reducing every tick's gradient sends that one
    micro-batch's gradient (the other ticks' zeros add nothing), equal bit for bit too. The
    tail (stage 0's input cotangents through a matmul) does not depend on the placement."""
    bench = load_benchmark("stage_reduce_placement")
    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 2, 2), ("data", "stage", "model"))
    dims = dict(d_model=16, layers=4, rows=8, vocab=32)

    def run(placement, microbatches):  # the same random inputs for every placement
        step, args = bench.step_of(placement, mesh, microbatches=microbatches, **dims)
        leaves, tree = jax.tree.flatten(args)
        values = [jax.device_put(jnp.asarray(np.random.default_rng(k).normal(size=a.shape) / 4, jnp.bfloat16),
                                 a.sharding) for k, a in enumerate(leaves)]
        return jax.tree.map(np.asarray, step(*jax.tree.unflatten(tree, values)))

    for microbatches in (4, 1):
        flushed, tail = run("after the flush", microbatches)
        assert np.abs(flushed).max() > 0 and np.isfinite(flushed).all()
        conditioned, tail_c = run("per-stage condition", microbatches)
        np.testing.assert_array_equal(conditioned, flushed)
        np.testing.assert_array_equal(tail_c, tail)
    ticked, tail_t = run("per tick, masked", 1)
    np.testing.assert_array_equal(ticked, flushed)
    np.testing.assert_array_equal(tail_t, tail)
