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
from helpers import (
    EPS32, adam_rounding_bounds, assert_within, assert_within_rounding, loss_rounding_bounds, reference_run,
    rounding_chain, sgd_rounding_bounds,
)
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


def _reference(config, batches, tx=None):
    """One-device optax on the whole batches (``reference_run``), the pure loss, its initial
    params, and the roundings on one gradient element's longest chain plus the 8 devices' and
    up to 4 micro-batches' sums."""
    graphdef, params = nnx.split(GPT(config, rngs=nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(params)
    loss_fn = lambda p, b: nnx.merge(graphdef, p).loss(b)
    additions = rounding_chain(jax.grad(loss_fn), params, batches[0]) + 8 + 4
    return reference_run(loss_fn, params, tx or _tx(), batches), params, additions


def _adam_bounds(params, gradients, additions, rounding=EPS32):
    """``_tx()``'s trajectory bounds (clip 1, Adam, decay 0.1, learning rate 1e-2)."""
    return adam_rounding_bounds(gradients, additions=additions, learning_rate=1e-2, params=params, max_norm=1.0,
                                weight_decay=0.1, rounding=rounding)


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

    (ref, ref_losses, gradients), params, additions = _reference(CONFIG, batches)
    bounds = _adam_bounds(params, gradients, additions)
    loss_bounds = loss_rounding_bounds(ref_losses, gradients, bounds, additions=additions)
    for losses in (losses1, losses4):
        assert_within(np.asarray(losses), np.asarray(ref_losses), loss_bounds, what="losses")
    # Another summation order of the same gradients; Adam's g / sqrt(v) amplifies it for
    # elements whose gradient is near zero, which the bound follows.
    assert_within(one.params, ref, bounds[-1], what="1 micro-batch vs optax")
    assert_within(four.params, ref, bounds[-1], what="4 micro-batches vs optax")
    assert_within(four.params, one.params, bounds[-1], what="4 vs 1 micro-batches")
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
    # bf16 sums round each of the 8 devices' additions to bf16's epsilon.
    (_, ref_losses, gradients), params, _ = _reference(config, batches)
    bf16 = _adam_bounds(params, gradients, 8, rounding=float(jnp.finfo(jnp.bfloat16).eps))
    assert_within(np.asarray(c), np.asarray(a), loss_rounding_bounds(ref_losses, gradients, bf16, additions=8),
                  what="bf16 reduce losses")
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
    state, losses, norms = step.init(), [], []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics.loss))
        norms.append(float(metrics.grad_norm))
    ref, ref_losses, gradients = reference_run(loss, params, tx, batches)
    additions = rounding_chain(jax.grad(loss), params, batches[0]) + 8 + 2
    bounds = sgd_rounding_bounds(gradients, additions=additions, learning_rate=0.1, momentum=0.9, params=params,
                                 max_norm=1.0)
    assert_within(np.asarray(losses), np.asarray(ref_losses),
                  loss_rounding_bounds(ref_losses, gradients, bounds, additions=additions), what="losses")
    # The norm's own sum of squares adds one rounding per element.
    ref_norms = np.asarray([float(optax.tree.norm(g)) for g in gradients])
    size = sum(x.size for x in jax.tree.leaves(params))
    assert_within(np.asarray(norms), ref_norms,
                  loss_rounding_bounds(ref_norms, gradients, bounds, additions=additions + size), what="grad norms")
    assert_within(state.params, ref, bounds[-1], what="params")
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


def test_local_batch_in_one_process_is_the_batch_and_checks_it(fp32_runs):
    """One process's rows are the whole batch: the same step as passing it; rows that do not
    split over the devices and micro-batches are refused (multi-process: test_multiprocess.py)."""
    batches, runs = fp32_runs
    step = runs[4][0]
    state = step.init()
    placed = step.local_batch(batches[0])
    assert placed["tokens"].sharding.spec == step.shard_batch(batches[0])["tokens"].sharding.spec
    _, via_local = step(state, placed)
    _, direct = step(step.init(), batches[0])
    assert float(via_local.loss) == float(direct.loss)
    with pytest.raises(ValueError, match="multiple of 32"):
        step.local_batch({"tokens": batches[0]["tokens"][:16]})


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
    # Same float32 gradients up to summation order (reduce per micro-batch, then accumulate).
    loss_fn = models.make_loss(unrolled_config)
    _, ref_losses, gradients = reference_run(loss_fn, params, tx(), batches)
    additions = rounding_chain(jax.grad(loss_fn), params, batches[0]) + 8 + 2
    bounds = _adam_bounds(params, gradients, additions)
    assert_within(np.asarray(losses), np.asarray(flat_losses),
                  loss_rounding_bounds(ref_losses, gradients, bounds, additions=additions), what="losses")
    assert_within(state.params, _stack_blocks(flat_state.params), _stack_blocks(bounds[-1]), what="params")
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


def test_buckets_follow_the_remat_blocks_by_default():
    """A remat model's buckets each hold one block's parameters (or only those outside every
    block), so each block's buckets are complete when its backward ends, with ZeRO-3 too; asked
    for, they are used with whole-parameter ownership too, and an unknown setting is refused."""
    config = dataclasses.replace(CONFIG, num_layers=3, remat=True)
    model = GPT(config, rngs=nnx.Rngs(0))
    batch = _batches(1, config=config)[0]
    paths = jd.GradSync(nnx.to_pure_dict(nnx.state(model, nnx.Param)), data_mesh()).placements

    def groups(**options):
        step = jd.make_train_step(model, _loss, optax.adam(1e-3), data_mesh(), jd.TrainConfig(bucket_size=3000, **options),
                                  example_batch=batch)
        layout = step.sync.layout
        return [{paths[i].path.split("/")[1] if paths[i].path.startswith("blocks/") else None for i in b.leaves}
                for b in layout.buckets]

    by_default = groups()
    assert all(len(g) == 1 for g in by_default) and set().union(*by_default) == {"0", "1", "2", None}
    assert any(len(g) > 1 for g in groups(bucket_boundaries=None))  # sizes alone mix blocks here
    assert all(len(g) == 1 for g in groups(shard_params=True))
    assert any(len(g) > 1 for g in groups(shard_params=True, bucket_boundaries=None))
    # Asked for, it is used with whole-parameter ownership too.
    assert all(len(g) == 1 for g in groups(ownership="param", bucket_boundaries="remat"))
    with pytest.raises(ValueError, match="bucket_boundaries must be"):
        jd.TrainConfig(bucket_boundaries="layers")
