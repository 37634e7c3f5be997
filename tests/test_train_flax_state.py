"""Real Flax state through the train step: nnx and linen BatchNorm statistics equal a
one-device full-batch reference (linen with micro-batches too), and survive a checkpoint;
dropout masks differ per device and resume reproducibly; a model written by ``update_model``
stays usable while training goes on; axis names and loss outputs the step cannot take are
refused with what to do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import data_mesh
from flax import nnx
from flax_models import B, C, CLASSES, CNN, F, HW, LinenResNet, cnn_loss, image_batches, linen_loss, linen_variables
from helpers import assert_within_rounding

import jax_drain as jd

DEVICES = 8


def _roundings(*, forward: int, backward: int, steps: int, optimizer: int = 2) -> int:
    """K for ``assert_within_rounding`` after ``steps`` steps: each step's chain is its forward
    and backward roundings, the sum over the devices and the optimizer's update of the
    parameters that the next step starts from."""
    return steps * (forward + backward + DEVICES + optimizer)


# The nnx CNN: conv 3x3 over C channels (9 C), the batch statistics over the global batch's
# B * HW * HW positions, the head's F * HW * HW contraction, log-softmax over the classes and
# the mean over B examples.
CNN_FORWARD = 9 * C + B * HW * HW + F * HW * HW + CLASSES + B
# Backward to the conv kernel: the head's input gradient (over the classes), BatchNorm's two
# sums over the positions, the kernel gradient's sum over them.
CNN_BACKWARD = CLASSES + 2 * B * HW * HW + B * HW * HW


def test_batchnorm_statistics_equal_a_full_batch_reference():
    batches = image_batches(3)
    model = CNN(axis_name="data", dropout=0.0, rngs=nnx.Rngs(0, dropout=1))
    reference = CNN(axis_name=None, dropout=0.0, rngs=nnx.Rngs(0, dropout=1))
    step = jd.make_train_step(model, cnn_loss, optax.sgd(0.1), data_mesh(DEVICES), jd.TrainConfig(bucket_size=500),
                              example_batch=batches[0])
    state = step.init()
    tx = optax.sgd(0.1)
    opt_state = tx.init(nnx.state(reference, nnx.Param))
    for i, batch in enumerate(batches):
        state, metrics = step(state, batch)
        loss, grads = nnx.value_and_grad(cnn_loss)(reference, batch)
        params = nnx.state(reference, nnx.Param)
        updates, opt_state = tx.update(grads, opt_state, params)
        nnx.update(reference, optax.apply_updates(params, updates))
        assert_within_rounding(float(metrics.loss), float(loss), what=f"loss {i}",
                               additions=_roundings(forward=CNN_FORWARD, backward=CNN_BACKWARD, steps=i) + CNN_FORWARD)
    step.update_model(model, state)
    additions = _roundings(forward=CNN_FORWARD, backward=CNN_BACKWARD, steps=len(batches))
    for name in ("mean", "var"):
        got, want = getattr(model.norm, name)[...], getattr(reference.norm, name)[...]
        assert not np.allclose(want, 0.0 if name == "mean" else 1.0)  # the statistics moved
        assert_within_rounding(got, want, additions=additions, what=f"BatchNorm {name}")
    assert_within_rounding(nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                           nnx.to_pure_dict(nnx.state(reference, nnx.Param)), additions=additions, what="params")


def test_batchnorm_without_axis_name_is_refused():
    model = CNN(axis_name=None, dropout=0.0, rngs=nnx.Rngs(0, dropout=1))
    with pytest.raises(ValueError, match="differs across the data-parallel devices.*axis_name='data'"):
        step = jd.make_train_step(model, cnn_loss, optax.sgd(0.1), data_mesh(DEVICES), jd.TrainConfig(bucket_size=500))
        step(step.init(), image_batches(1)[0])


# -- linen -------------------------------------------------------------------------------------

# LinenResNet: conv 3x3 over C channels, batch statistics over B * HW * HW positions, conv 3x3
# over F features, the second statistics, the mean pool over HW * HW, the head over F,
# log-softmax over the classes, the mean over B examples.
LINEN_FORWARD = 9 * C + B * HW * HW + 9 * F + B * HW * HW + HW * HW + F + CLASSES + B
# Backward to the first conv kernel: the head's input gradient (over the classes), the second
# BatchNorm's two sums over the positions, the second conv's input gradient (9 F), the first
# BatchNorm's two sums, the kernel gradient's sum over the positions.
LINEN_BACKWARD = CLASSES + 2 * B * HW * HW + 9 * F + 2 * B * HW * HW + B * HW * HW


def _global_micro(batch: dict, k: int, microbatches: int) -> dict:
    """The examples of micro-batch ``k`` on every device: each device splits its contiguous
    share of the batch into ``microbatches`` consecutive parts."""
    local, m = B // DEVICES, B // DEVICES // microbatches
    take = np.concatenate([np.arange(d * local + k * m, d * local + (k + 1) * m) for d in range(DEVICES)])
    return jax.tree.map(lambda x: x[take], batch)


def _linen_reference(variables: dict, batches: list, tx: optax.GradientTransformation, microbatches: int):
    """One device, ``BatchNorm(axis_name=None)``: the statistics of each global micro-batch in
    turn (the running statistics follow every micro-batch, as in the step), the gradient the
    mean over the micro-batches. Returns the variables and the losses after each batch."""
    loss_fn = linen_loss(LinenResNet(axis_name=None))
    grad = jax.jit(jax.value_and_grad(lambda p, stats, b: loss_fn({"params": p, "batch_stats": stats}, b),
                                      has_aux=True))
    params, stats = variables["params"], variables["batch_stats"]
    opt_state, losses = tx.init(params), []
    for batch in batches:
        total, grads = 0.0, None
        for k in range(microbatches):
            (loss, updates), g = grad(params, stats, _global_micro(batch, k, microbatches))
            stats, total = updates["batch_stats"], total + loss
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        grads = jax.tree.map(lambda g: g / microbatches, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(total) / microbatches)
    return {"params": params, "batch_stats": stats}, losses


@pytest.mark.parametrize("microbatches", [1, 2])
def test_linen_params_and_batch_stats_equal_a_full_batch_reference_and_survive_a_checkpoint(tmp_path, microbatches):
    batches = image_batches(4, seed=2)
    module = LinenResNet(axis_name="data")
    variables = linen_variables(module)
    tx = lambda: optax.sgd(0.05, momentum=0.9)
    step = jd.make_train_step(variables, linen_loss(module), tx(), data_mesh(DEVICES),
                              jd.TrainConfig(bucket_size=300, microbatches=microbatches),
                              example_batch=batches[0], mutable=["batch_stats"])
    assert step.sync.num_buckets > 1
    state = step.init()
    assert set(state.model_state) == {"batch_stats"}
    losses = []
    for batch in batches[:3]:
        state, metrics = step(state, batch)
        losses.append(float(metrics.loss))
    want, want_losses = _linen_reference(variables, batches[:3], tx(), microbatches)
    got = step.variables(state)
    # Micro-batches shorten the statistics' sums (B / microbatches examples each) and add one
    # addition per micro-batch to each gradient: the full batch's chain plus those bounds it.
    additions = _roundings(forward=LINEN_FORWARD, backward=LINEN_BACKWARD + microbatches, steps=3)
    for i, (loss, want_loss) in enumerate(zip(losses, want_losses)):
        assert_within_rounding(loss, want_loss, what=f"loss {i}",
                               additions=_roundings(forward=LINEN_FORWARD, backward=LINEN_BACKWARD, steps=i)
                               + LINEN_FORWARD)
    assert_within_rounding(got["params"], want["params"], additions=additions, what="params")
    assert_within_rounding(got["batch_stats"], want["batch_stats"], additions=additions, what="batch_stats")
    for path, moved, start in zip(jax.tree_util.tree_leaves_with_path(got["batch_stats"]),
                                  jax.tree.leaves(got["batch_stats"]), jax.tree.leaves(variables["batch_stats"])):
        assert not np.allclose(moved, start), f"{jax.tree_util.keystr(path[0])} did not move"
    # The trained variables evaluate with the module itself (no axis needed: running averages).
    logits = module.apply(got, batches[3]["x"], train=False)
    assert logits.shape == (B, CLASSES) and np.all(np.isfinite(logits))

    jd.save_checkpoint(tmp_path / "ckpt", state)
    restored, _ = jd.restore_checkpoint(tmp_path / "ckpt", step.abstract_state())
    for a, b in zip(jax.tree.leaves(jax.device_get(restored.model_state)), jax.tree.leaves(got["batch_stats"])):
        np.testing.assert_array_equal(a, b)
    straight, m1 = step(state, batches[3])
    resumed, m2 = step(restored, batches[3])
    assert float(m1.loss) == float(m2.loss)
    for a, b in zip(jax.tree.leaves(jax.device_get(straight.model_state)),
                    jax.tree.leaves(jax.device_get(resumed.model_state))):
        np.testing.assert_array_equal(a, b)


def test_linen_init_takes_other_variables():
    module = LinenResNet(axis_name="data")
    variables = linen_variables(module)
    step = jd.make_train_step(variables, linen_loss(module), optax.sgd(0.1), data_mesh(DEVICES),
                              jd.TrainConfig(bucket_size=None), mutable=["batch_stats"])
    other = linen_variables(module, seed=1)
    other["batch_stats"] = jax.tree.map(lambda x: x + 0.5, other["batch_stats"])
    state = step.init(other)
    for a, b in zip(jax.tree.leaves(jax.device_get((state.params, state.model_state))),
                    jax.tree.leaves((other["params"], {"batch_stats": other["batch_stats"]}))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="variables dict with the collections"):
        step.init(other["params"])


def test_linen_loss_returns_and_collections_are_checked():
    module = LinenResNet(axis_name="data")
    variables = linen_variables(module)
    batch = image_batches(1)[0]
    mesh = data_mesh(DEVICES)
    make = lambda loss_fn, **kw: jd.make_train_step(variables, loss_fn, optax.sgd(0.1), mesh,
                                                    jd.TrainConfig(bucket_size=None), example_batch=batch, **kw)
    # A new user's first try: the linen loss without mutable= (its variables trained as params).
    with pytest.raises(ValueError, match=r"returned a tuple of 2.*\(loss, updates\).*mutable=\['batch_stats'\]"):
        make(linen_loss(module))
    with pytest.raises(ValueError, match=r"must return \(loss, updates\).*got an array of shape \(\) alone"):
        make(lambda v, b: linen_loss(module)(v, b)[0], mutable=["batch_stats"])
    with pytest.raises(ValueError, match="no collection 'cache'"):
        make(linen_loss(module), mutable=["batch_stats", "cache"])
    with pytest.raises(ValueError, match="'params' are trained"):
        make(linen_loss(module), mutable=["params"])
    with pytest.raises(ValueError, match="nnx model's state"):
        jd.make_train_step(CNN(axis_name="data", dropout=0.0, rngs=nnx.Rngs(0)), cnn_loss, optax.sgd(0.1), mesh,
                           mutable=["batch_stats"])
    with pytest.raises(ValueError, match=r"returned a dict.*WeightedLoss"):
        jd.make_train_step(variables["params"], lambda p, b: {"loss": jnp.sum(p["Dense_0"]["bias"])},
                           optax.sgd(0.1), mesh, example_batch=batch)


# -- axis names the mesh does not have ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_an_axis_name_the_mesh_lacks_is_named_with_the_mesh_axes(kind):
    batch = image_batches(1)[0]
    mesh = data_mesh(DEVICES)  # data axis "data"; the models name theirs "batch"
    with pytest.raises(ValueError, match=r"axis name 'batch'.*axes are \('data',\).*TrainConfig\(axis='batch'\)") as e:
        if kind == "nnx":
            model = CNN(axis_name="batch", dropout=0.0, rngs=nnx.Rngs(0))
            jd.make_train_step(model, cnn_loss, optax.sgd(0.1), mesh, example_batch=batch)
        else:
            module = LinenResNet(axis_name="batch")
            jd.make_train_step(linen_variables(module), linen_loss(module), optax.sgd(0.1), mesh,
                               example_batch=batch, mutable=["batch_stats"])
    assert isinstance(e.value.__cause__, (AssertionError, NameError))  # JAX's own error, chained
    # Named to match, the same model trains.
    module = LinenResNet(axis_name="batch")
    step = jd.make_train_step(linen_variables(module), linen_loss(module), optax.sgd(0.1), data_mesh(DEVICES, "batch"),
                              jd.TrainConfig(axis="batch", bucket_size=None), mutable=["batch_stats"])
    _, metrics = step(step.init(), batch)
    assert np.isfinite(float(metrics.loss))


def test_other_assertion_and_name_errors_in_a_loss_pass_through_unchanged():
    mesh = data_mesh(DEVICES)
    batch = image_batches(1)[0]
    params = {"w": jnp.ones((C, F))}

    def asserts(p, b):
        assert b["x"].shape[0] == 1000, "a check of the user's own"
        return jnp.sum(p["w"])

    with pytest.raises(AssertionError, match="a check of the user's own"):
        jd.make_train_step(params, asserts, optax.sgd(0.1), mesh, example_batch=batch)

    def psum_asserts(p, b):  # fails inside a collective over an axis the mesh has
        total = jax.lax.psum(jnp.sum(p["w"]), "data")
        assert total is None, "after a valid psum"
        return total

    with pytest.raises(AssertionError, match="after a valid psum"):
        jd.make_train_step(params, psum_asserts, optax.sgd(0.1), mesh, example_batch=batch)

    def misspelt(p, b):
        return jnp.sum(p["w"]) * undefined_name  # noqa: F821

    with pytest.raises(NameError, match="undefined_name"):
        jd.make_train_step(params, misspelt, optax.sgd(0.1), mesh, example_batch=batch)


# -- update_model ------------------------------------------------------------------------------


def test_a_model_written_by_update_model_is_usable_after_more_steps():
    batches = image_batches(4, seed=3)
    model = CNN(axis_name="data", dropout=0.1, rngs=nnx.Rngs(0, dropout=1))
    step = jd.make_train_step(model, cnn_loss, optax.adam(1e-2), data_mesh(DEVICES),
                              jd.TrainConfig(bucket_size=500, donate=True), example_batch=batches[0])
    state, _ = step(step.init(), batches[0])
    step.update_model(model, state)
    everything = nnx.Not(nnx.RngKey)  # parameters, statistics, RNG counters
    written = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, everything)))
    for batch in batches[1:3]:  # each donates the state update_model read from
        state, _ = step(state, batch)
    model.eval()
    logits = model(batches[3]["x"])  # reads every parameter and the running statistics
    assert np.all(np.isfinite(logits))
    now = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, everything)))
    for a, b in zip(jax.tree.leaves(now), jax.tree.leaves(written)):
        np.testing.assert_array_equal(a, b)
    # update_model wrote the trained values, not the initial ones: a fresh model differs.
    fresh = nnx.to_pure_dict(nnx.state(CNN(axis_name="data", dropout=0.1, rngs=nnx.Rngs(0, dropout=1)), everything))
    assert not np.array_equal(written["norm"]["mean"], fresh["norm"]["mean"])
    assert not np.array_equal(written["head"]["kernel"], fresh["head"]["kernel"])


# -- dropout -----------------------------------------------------------------------------------


class Masked(nnx.Module):
    """loss = sum(dropout(ones) * w): w's gradient is the dropout mask, averaged over devices."""

    def __init__(self, rngs):
        self.w = nnx.Param(jnp.zeros((256,)))
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return jnp.sum(self.drop(jnp.ones((x.shape[0], 256))) * self.w) / x.shape[0]


def test_dropout_masks_differ_per_device():
    model = Masked(nnx.Rngs(dropout=3))
    step = jd.make_train_step(model, lambda m, b: m(b["x"]), optax.sgd(1.0), data_mesh(DEVICES),
                              jd.TrainConfig(bucket_size=None))
    state, _ = step(step.init(), {"x": np.zeros((8, 1), np.float32)})  # one example per device
    moved = -np.asarray(jax.device_get(state.params["w"]))  # the mean over 8 devices of mask / 0.5
    # Identical masks on every device would give only 0 and 2; independent ones, eighths of 2.
    assert len(np.unique(np.round(moved * 4))) > 4
    assert 0.7 < moved.mean() < 1.3


def test_dropout_resumes_reproducibly_from_a_checkpoint(tmp_path):
    batches = image_batches(4, seed=1)
    make = lambda: jd.make_train_step(CNN(axis_name="data", dropout=0.3, rngs=nnx.Rngs(0, dropout=1)), cnn_loss,
                                      optax.adam(1e-2), data_mesh(DEVICES),
                                      jd.TrainConfig(bucket_size=500, microbatches=2), example_batch=batches[0])
    step = make()
    state = step.init()
    straight = []
    for i, batch in enumerate(batches):
        state, metrics = step(state, batch)
        straight.append(float(metrics.loss))
        if i == 1:
            jd.save_checkpoint(tmp_path / "ckpt", state)
    fresh = make()
    state, _ = jd.restore_checkpoint(tmp_path / "ckpt", fresh.abstract_state())
    resumed = []
    for batch in batches[2:]:
        state, metrics = fresh(state, batch)
        resumed.append(float(metrics.loss))
    assert resumed == straight[2:]
    assert int(jax.device_get(state.model_state[1]["drop"]["rngs"]["count"])) > 0
