"""make_train_step on 8 virtual CPU devices: accumulation, parity with single-device optax, one
sync per step, drain invariance, nnx and pytree (linen) models, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx

import jax_drain as jd
from conftest import data_mesh
from jax_drain.models import GPT, GPTConfig

CONFIG = GPTConfig(num_layers=1, d_model=32, num_heads=2, seq_len=8, vocab_size=48,
                   param_dtype=jnp.float32, remat=False)
BATCH = 32  # 8 devices x 4 examples


def _tx():
    return optax.chain(
        jd.clip_by_global_norm(1.0),
        optax.scale_by_adam(),
        jd.masked(optax.add_decayed_weights(0.1), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
        optax.scale_by_learning_rate(1e-2),
    )


def _batches(n, seed=0, batch=BATCH, config=CONFIG):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, config.vocab_size, size=(batch, config.seq_len + 1)).astype(np.int32)}
            for _ in range(n)]


def _loss(model, batch):
    return model.loss(batch)


def _train(config, batches, **train_config):
    model = GPT(config, rngs=nnx.Rngs(0))
    step = jd.make_train_step(model, _loss, _tx(), data_mesh(8),
                              jd.TrainConfig(bucket_size=3000, **train_config), example_batch=batches[0])
    state = step.init()
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics.loss))
    return step, state, losses


@pytest.fixture(scope="module")
def fp32_runs():
    batches = _batches(3)
    return batches, {k: _train(CONFIG, batches, microbatches=k) for k in (1, 4)}


def test_microbatches_match_one_batch_and_single_device_optax(fp32_runs):
    batches, runs = fp32_runs
    (_, one, losses1), (step4, four, losses4) = runs[1], runs[4]
    assert step4.sync.num_buckets >= 3

    # Single-device reference: plain optax on the whole batch, no mesh.
    model = GPT(CONFIG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    loss_fn = lambda p, b: nnx.merge(graphdef, p).loss(b)
    tx = _tx()
    opt_state = tx.init(params)

    @jax.jit
    def reference_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    ref_losses = []
    for batch in batches:
        params, opt_state, loss = reference_step(params, opt_state, batch)
        ref_losses.append(float(loss))

    np.testing.assert_allclose(losses1, ref_losses, rtol=2e-6)
    np.testing.assert_allclose(losses4, ref_losses, rtol=2e-6)
    # Gradients agree to float32 rounding (another summation order); Adam's g / sqrt(v) turns
    # that into up to ~1e-3 of the learning rate (1e-2) for elements whose gradient is ~0.
    for a, b, ref in zip(jax.tree.leaves(one.params), jax.tree.leaves(four.params), jax.tree.leaves(params)):
        np.testing.assert_allclose(a, ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b, ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert int(four.step) == len(batches)


_COLLECTIVES = ("all_to_all", "psum_scatter", "reduce_scatter", "all_gather", "ppermute", "psum")


def _collectives(jaxpr, inside_loop=False, found=None):
    """(primitive, inside a loop body?) for every collective in a jaxpr, recursively."""
    found = [] if found is None else found
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if any(name.startswith(c) for c in _COLLECTIVES):
            found.append((name, inside_loop))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _collectives(sub, inside_loop or name in ("scan", "while"), found)
    return found


def test_sync_runs_once_per_step_not_per_microbatch(fp32_runs):
    batches, runs = fp32_runs
    step = runs[4][0]
    jaxpr = jax.make_jaxpr(step._jitted)(step.abstract_state(), batches[0]).jaxpr
    found = _collectives(jaxpr)
    assert found and not [name for name, in_loop in found if in_loop]  # nothing per micro-batch
    # fp32_accum: one all-to-all per bucket; one all-gather per bucket (the new params).
    assert sum(name == "all_to_all" for name, _ in found) == step.sync.num_buckets
    assert sum(name.startswith("all_gather") for name, _ in found) == step.sync.num_buckets


def test_drain_keeps_values_and_bf16_reduce_stays_close():
    config = dataclasses.replace(CONFIG, param_dtype=jnp.bfloat16)
    batches = _batches(3, seed=1)
    _, drained, a = _train(config, batches, reduce="fp32_accum", drain=True)
    _, undrained, b = _train(config, batches, reduce="fp32_accum", drain=False)
    _, rounded, c = _train(config, batches, reduce="bf16", drain=True)
    assert a == b  # bit-identical losses
    for x, y in zip(jax.tree.leaves(drained), jax.tree.leaves(undrained)):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_allclose(c, a, rtol=1e-2)
    assert any(np.any(np.asarray(x) != np.asarray(y))  # bf16 sums do round differently
               for x, y in zip(jax.tree.leaves(drained.opt_state), jax.tree.leaves(rounded.opt_state)))


class MLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        x = linen.gelu(linen.Dense(24)(x))
        return linen.Dense(3)(x)


def test_params_pytree_path_matches_single_device_optax():
    rng = np.random.default_rng(2)
    module = MLP()
    params = module.init(jax.random.key(0), jnp.zeros((1, 5)))["params"]
    loss = lambda p, b: jnp.mean((module.apply({"params": p}, b["x"]) - b["y"]) ** 2)
    batches = [{"x": rng.normal(size=(16, 5)).astype(np.float32), "y": rng.normal(size=(16, 3)).astype(np.float32)}
               for _ in range(3)]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))  # reference only
    step = jd.make_train_step(
        params, loss, optax.chain(jd.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9)), data_mesh(8),
        jd.TrainConfig(bucket_size=64, microbatches=2), example_batch=batches[0],
    )
    state = step.init()
    ref, opt_state = params, tx.init(params)
    for batch in batches:
        state, metrics = step(state, batch)
        want, grads = jax.value_and_grad(loss)(ref, batch)
        np.testing.assert_allclose(float(metrics.grad_norm), float(optax.tree.norm(grads)), rtol=1e-5)
        updates, opt_state = tx.update(grads, opt_state, ref)
        ref = optax.apply_updates(ref, updates)
        np.testing.assert_allclose(float(metrics.loss), float(want), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not an nnx model"):
        step.update_model(nnx.Linear(1, 1, rngs=nnx.Rngs(0)), state)


def test_update_model_writes_trained_params(fp32_runs):
    _, runs = fp32_runs
    step, state, _ = runs[1]
    model = GPT(CONFIG, rngs=nnx.Rngs(0))
    before = model.ln_f.scale[...]
    step.update_model(model, state)
    np.testing.assert_array_equal(model.ln_f.scale[...], state.params["ln_f"]["scale"])
    assert np.any(np.asarray(before) != np.asarray(model.ln_f.scale[...]))


def test_bad_input_is_refused_before_running(fp32_runs):
    batches, runs = fp32_runs
    step = runs[4][0]
    state = step.init()
    with pytest.raises(ValueError, match="multiple of 32"):  # 8 devices x 4 micro-batches
        step(state, {"tokens": batches[0]["tokens"][:16]})
    with pytest.raises(ValueError, match="multiple of 32"):
        step(state, {"tokens": batches[0]["tokens"][:, 0]} | {"extra": np.zeros(())})
    with pytest.raises(ValueError, match="disagree on the batch size"):
        step(state, {"tokens": batches[0]["tokens"], "mask": np.ones((64, 3))})
    other = runs[1][0]
    foreign = jd.make_train_step(GPT(CONFIG, rngs=nnx.Rngs(0)), _loss, _tx(), data_mesh(8),
                                 jd.TrainConfig(bucket_size=5000), example_batch=batches[0]).init()
    with pytest.raises(ValueError, match="different bucket layout"):
        other(foreign, batches[0])
    with pytest.raises(TypeError, match="TrainState"):
        other(foreign.opt_state, batches[0])
    state, _ = step(state, batches[0])  # nothing was donated or consumed by the refused calls
    assert int(state.step) == 1

    with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
        jd.TrainConfig(microbatches=0)
    with pytest.raises(ValueError, match="accum_dtype must be a floating dtype"):
        jd.TrainConfig(accum_dtype=jnp.int32)
    with pytest.raises(ValueError, match="mesh has no axis 'dp'"):
        jd.make_train_step(GPT(CONFIG, rngs=nnx.Rngs(0)), _loss, _tx(), data_mesh(8), jd.TrainConfig(axis="dp"))


def test_bucket_order_is_traced_from_the_first_batch_without_example_batch(fp32_runs):
    """No example_batch: the first call traces the gradient-ready order, the same order (and
    layout) as with example_batch, never reverse pytree order."""
    batches, _ = fp32_runs
    make = lambda **kw: jd.make_train_step(GPT(CONFIG, rngs=nnx.Rngs(0)), _loss, _tx(), data_mesh(8),
                                           jd.TrainConfig(bucket_size=5000), **kw)
    eager, lazy = make(example_batch=batches[0]), make()
    assert lazy.sync is None
    state = lazy.init()
    assert state.opt_state is None
    state, metrics = lazy(state, batches[0])
    assert lazy.sync.fingerprint == eager.sync.fingerprint
    reverse = jd.GradSync(lazy.sync.abstract_params, data_mesh(8), bucket_size=5000)
    assert reverse.fingerprint != eager.sync.fingerprint  # the traced order differs from it here
    _, eager_metrics = eager(eager.init(), batches[0])
    assert float(metrics.loss) == float(eager_metrics.loss)


# -- scanned layer stacks: TrainConfig(scan_layers=...) builds a ScanGradSync -------------------

SCAN_CONFIG = dataclasses.replace(CONFIG, num_layers=2, scan_layers=True)


def _stack_blocks(params):
    blocks = [params["blocks"][i] for i in range(len(params["blocks"]))]
    return dict(params, blocks=jax.tree.map(lambda *xs: jnp.stack(xs), *blocks))


def test_scanned_step_matches_unrolled_step_and_checkpoints(tmp_path):
    """Same weights, 2 micro-batches: the scanned model's step (per-layer reduce-scatter inside
    the backward scan, fp32 shards accumulated) follows the unrolled model's (GradSync, local
    fp32 accumulation, one sync), and its state survives a checkpoint round trip."""
    from jax_drain import models

    unrolled_config = dataclasses.replace(SCAN_CONFIG, scan_layers=False)
    params = models.init_params(unrolled_config, jax.random.key(0))
    batches = _batches(3, seed=3)

    # Decay by path, not ndim: the scanned LayerNorm scales are [num_layers, d].
    no_norms = lambda p: jax.tree_util.tree_map_with_path(lambda k, _: "ln" not in jax.tree_util.keystr(k), p)
    tx = lambda: optax.chain(
        jd.clip_by_global_norm(1.0),
        optax.scale_by_adam(),
        jd.masked(optax.add_decayed_weights(0.1), no_norms),
        optax.scale_by_learning_rate(1e-2),
    )

    def train(config, params, scan_layers):
        step = jd.make_train_step(params, models.make_loss(config), tx(), data_mesh(8),
                                  jd.TrainConfig(bucket_size=3000, microbatches=2, scan_layers=scan_layers),
                                  example_batch=batches[0])
        state, losses = step.init(), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics.loss))
        return step, state, losses

    _, flat_state, flat_losses = train(unrolled_config, params, False)
    step, state, losses = train(SCAN_CONFIG, _stack_blocks(params), None)  # None: detected
    assert isinstance(step.sync, jd.ScanGradSync) and step.scan_layers
    assert step.sync.stacked_paths[0].startswith("blocks/") and len(step.sync.layer_bucket_sizes) >= 2
    # Same float32 gradients up to summation order (reduce per micro-batch, then accumulate):
    # losses agree to float32 rounding; Adam's g / sqrt(v) turns that rounding into up to ~1e-3
    # of the learning rate (1e-2) for elements whose gradient is ~0 (as in the test above).
    np.testing.assert_allclose(losses, flat_losses, rtol=2e-6)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(_stack_blocks(flat_state.params))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert losses[-1] < losses[0]

    saved = jax.device_get(state)
    jd.save_checkpoint(tmp_path, state)
    restored, _ = jd.restore_checkpoint(tmp_path, step.abstract_state())
    assert restored.opt_state.master[0].ndim == 2  # a [num_layers, bucket] layer bucket
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert restored.opt_state.master[0].sharding.spec == jax.sharding.PartitionSpec(None, "data")
    next_state, _ = step(restored, batches[0])  # the restored state trains on
    assert int(next_state.step) == 4


def test_scan_layers_needs_a_scanned_loss():
    from jax_drain import models

    unrolled = dataclasses.replace(SCAN_CONFIG, scan_layers=False)
    with pytest.raises(ValueError, match="runs no jax.lax.scan"):
        jd.make_train_step(models.abstract_params(unrolled), models.make_loss(unrolled), _tx(), data_mesh(8),
                           jd.TrainConfig(scan_layers=True), example_batch=_batches(1)[0])
    # Without example_batch the stacked leaves are found from the first batch.
    lazy = jd.make_train_step(models.abstract_params(SCAN_CONFIG), models.make_loss(SCAN_CONFIG), _tx(),
                              data_mesh(8), jd.TrainConfig(scan_layers=True))
    with pytest.raises(ValueError, match="layout is not known yet"):
        lazy.abstract_state()
    with pytest.raises(ValueError, match="init needs concrete parameters"):
        lazy.init()
    with pytest.raises(ValueError, match="scan_layers must be True, False or None"):
        jd.TrainConfig(scan_layers="auto")
