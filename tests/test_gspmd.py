"""``tensor_parallel="gspmd"``: tensor parallelism by XLA, data parallelism by jax_drain.

The model here is written the GSPMD way: global shapes, no collectives in the loss, shardings
declared on the parameters (``param_specs``, the arrays' ``NamedSharding``, nnx ``Param``
metadata, linen logical partitioning with rules). The step's ``shard_map`` makes only the data
axes manual; the buckets are laid out over each device's local blocks and reduced in a nested
region manual over the model axis. Checked against float64 and one-device optax on
``("data", "model")`` and ``("replica", "data", "model")`` meshes; each device holds 1/model of
every model-sharded weight; on XLA's GPU compiler no weight is all-gathered over the model axis.
"""

from __future__ import annotations

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_drain as jd
from helpers import (
    adam_rounding_bounds, assert_within, assert_within_rounding, loss_rounding_bounds, reference_run, rounding_chain,
)
from jax_drain import zero3
from jax_drain._host_layout import host_to_params
from jax_drain.layout import leaf_paths
from jax_drain.shardings import declared_specs

D, H, C, L = 8, 16, 4, 2  # width, hidden (split over model), outputs, blocks
BATCH, STEPS, LR, WD, MAX_NORM = 16, 5, 2e-2, 0.1, 0.05

BLOCK_SPECS = {"norm": None, "w_in": P(None, "model"), "b_in": P("model"), "w_out": P("model", None), "b_out": None}
SPECS = {"blocks": [BLOCK_SPECS] * L, "head": None}

MESHES = {
    "data_model": ((4, 2), ("data", "model"), {}),
    "replica_data_model": ((2, 2, 2), ("replica", "data", "model"), {"outer_axis": "replica", "microbatches": 2}),
}


def _params(rng):
    n = lambda *s, scale=0.3: jnp.asarray(rng.normal(size=s) * scale, jnp.float32)
    block = lambda: {"norm": 1.0 + n(D, scale=0.1), "w_in": n(D, H), "b_in": n(H, scale=0.1), "w_out": n(H, D),
                     "b_out": n(D, scale=0.1)}
    return {"blocks": [block() for _ in range(L)], "head": n(D, C)}


def gspmd_loss(p, batch):
    """Global shapes, no collectives: what XLA partitions over the model axis."""
    h = batch["x"]
    for q in p["blocks"]:
        h = h + jnp.tanh(jax.nn.gelu((h * q["norm"]) @ q["w_in"] + q["b_in"]) @ q["w_out"] + q["b_out"])
    return jnp.mean(jnp.sum((h @ p["head"] - batch["y"]) ** 2, axis=-1))


def _batches(seed, n):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(BATCH, D)).astype(np.float32), "y": rng.normal(size=(BATCH, C)).astype(np.float32)}
            for _ in range(n)]


def _decay(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


def _mesh(kind, cpu_devices):
    shape, names, _ = MESHES[kind]
    return jax.make_mesh(shape, names, devices=cpu_devices)  # Explicit axes: jax's default, used as Auto


def _placed(params, mesh, specs=SPECS):
    return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s or P()), specs,
                                               is_leaf=lambda x: x is None or isinstance(x, P)))


def _additions(loss, params, batch, microbatches=1):
    """Roundings on the longest chain of one gradient element, then the devices' and micro-batches' sums."""
    return rounding_chain(jax.grad(loss), params, batch) + 8 + microbatches


def _float64_grad(loss, params, batch):
    with jax.enable_x64(True):
        to64 = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), t)
        value, grads = jax.value_and_grad(loss)(to64(params), to64(batch))
        return float(value), jax.tree.map(np.asarray, grads)


def _assert_model_blocks(tree, specs, mesh, what):
    """Every leaf's NamedSharding is its spec and each device holds its block: 1/model of every
    model-sharded dimension."""
    for path, x, spec in zip(leaf_paths(tree), jax.tree.leaves(tree),
                             jax.tree.leaves(specs, is_leaf=lambda s: s is None or isinstance(s, P))):
        spec = spec or P()
        want = tuple(d // (mesh.shape["model"] if i < len(spec) and spec[i] == "model" else 1)
                     for i, d in enumerate(x.shape))
        assert x.sharding.is_equivalent_to(NamedSharding(x.sharding.mesh, spec), x.ndim), f"{what} {path}: {x.sharding}"
        assert all(s.data.shape == want for s in x.addressable_shards), f"{what} {path}: blocks of {want}"


# -- the gradient: GradSync in a step that leaves the model axis to XLA ---------------------------


@pytest.mark.parametrize("kind", list(MESHES))
def test_value_and_grad_equals_the_float64_gradient(kind, cpu_devices):
    mesh = _mesh(kind, cpu_devices)
    params, (batch,) = _params(np.random.default_rng(0)), _batches(1, 1)
    outer = MESHES[kind][2].get("outer_axis")
    sync = jd.GradSync(params, mesh, axis="data", outer_axis=outer, param_specs=SPECS, bucket_size=64,
                       tensor_parallel="gspmd")
    assert sync.auto_axes == ("model",) and sync.num_buckets > 2
    assert all(chain.shard_spec == P(("data", "model")) for chain in sync.chains)  # data axes first
    step = jax.jit(sync.shard_map(lambda p, b: sync.value_and_grad(gspmd_loss)(p, b),
                                  in_specs=(sync.param_specs, sync.batch_spec), out_specs=(P(), sync.shard_specs())))
    loss, shards = step(_placed(params, sync.mesh), batch)

    ref_loss, ref = _float64_grad(gspmd_loss, params, batch)
    additions = _additions(gspmd_loss, params, batch)
    assert_within_rounding(float(loss), ref_loss, additions=additions, what="loss")
    by_path = host_to_params(sync.description, [np.asarray(s) for s in shards])
    got = jax.tree.unflatten(jax.tree.structure(params), [by_path[p] for p in leaf_paths(params)])
    assert_within_rounding(got, ref, additions=additions, what=f"{kind} gradient")
    # Every device holds its own piece of every bucket: split over the data and model axes.
    devices = sync.axis_size * mesh.shape["model"]
    for s, size in zip(shards, sync.bucket_sizes):
        assert s.shape == (size * mesh.shape["model"],)
        assert {sh.data.shape for sh in s.addressable_shards} == {(size * mesh.shape["model"] // devices,)}


# -- the whole step against one-device optax --------------------------------------------------------


def _reference_tx():
    return optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, weight_decay=WD, mask=_decay))


def _tx():
    return jd.adamw(LR, weight_decay=WD, mask=_decay, max_norm=MAX_NORM)


def _train_and_compare(step, init_params, reference_params, reference_loss, batches, what, to_tree=lambda p: p):
    """STEPS steps of ``step`` against one-device optax on ``reference_loss``: parameters and
    losses within the AdamW trajectory's rounding bounds."""
    state, losses = step.init(init_params), []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics.loss))
    want, want_losses, gradients = reference_run(reference_loss, reference_params, _reference_tx(), batches)
    additions = _additions(reference_loss, reference_params, batches[0], step.config.microbatches)
    bounds = adam_rounding_bounds(gradients, additions=additions, learning_rate=LR, params=reference_params,
                                  max_norm=MAX_NORM, weight_decay=WD)
    assert_within(to_tree(jax.device_get(state.params)), want, bounds[-1], what=f"{what} after {STEPS} AdamW steps")
    loss_bounds = loss_rounding_bounds(want_losses, gradients, bounds, additions=additions)
    assert np.all(np.abs(np.asarray(losses) - want_losses) <= loss_bounds), (losses, want_losses, loss_bounds)
    assert losses[-1] < losses[0]
    return state


@pytest.mark.parametrize("kind", list(MESHES))
def test_named_sharding_params_train_tensor_parallel_like_optax(kind, cpu_devices):
    """Params placed with NamedSharding, no param_specs: the step reads the shardings, runs the
    loss on global shapes (gspmd), holds every model-sharded weight as its blocks and its master
    shards and optimizer state over data and model."""
    mesh = _mesh(kind, cpu_devices)
    _, _, options = MESHES[kind]
    params, batches = _params(np.random.default_rng(0)), _batches(1, STEPS)
    step = jd.make_train_step(_placed(params, mesh), gspmd_loss, _tx(), mesh,
                              jd.TrainConfig(axis="data", bucket_size=60, **options), example_batch=batches[0])
    assert step.tensor_parallel == "gspmd" and step.sync.tensor_parallel == "gspmd"
    assert sum(chain.num_buckets for chain in step.sync.chains) > 2  # several buckets, drained
    state = _train_and_compare(step, None, params, gspmd_loss, batches, kind)

    _assert_model_blocks(state.params, SPECS, mesh, "params")
    data = step.sync.axis_size  # the shards are replicated over "replica"
    for m in state.opt_state.master:  # float32 master shards: split over data and model
        assert m.sharding.spec == P(("data", "model"))
        assert {s.data.shape for s in m.addressable_shards} == {(m.shape[0] // (data * mesh.shape["model"]),)}
    for leaf in jax.tree.leaves(state.opt_state.inner):
        if leaf.ndim:
            assert {s.data.shape for s in leaf.addressable_shards} == {(leaf.shape[0] // (data * mesh.shape["model"]),)}


def manual_loss(p, batch):
    """:func:`gspmd_loss` written for local blocks: the psum over the model axis by hand."""
    h = batch["x"]
    for q in p["blocks"]:
        z = jax.lax.psum(jax.nn.gelu((h * q["norm"]) @ q["w_in"] + q["b_in"]) @ q["w_out"], "model")
        h = h + jnp.tanh(z + q["b_out"])
    return jnp.mean(jnp.sum((h @ p["head"] - batch["y"]) ** 2, axis=-1))


def test_checkpoints_resume_bit_for_bit_and_move_to_the_manual_layout(cpu_devices, tmp_path):
    """A gspmd state (shards data axes first) resumes bit for bit, and restores into a manual
    step (model axis first) and back with every master element where it belongs."""
    mesh = _mesh("data_model", cpu_devices)
    params, batches = _params(np.random.default_rng(0)), _batches(3, 5)
    build = lambda config, loss=gspmd_loss, p=_placed(params, mesh): jd.make_train_step(
        p, loss, _tx(), mesh, config, example_batch=batches[0])
    step = build(jd.TrainConfig(bucket_size=60))
    state = step.init()
    for batch in batches[:2]:
        state, _ = step(state, batch)
    jd.save_checkpoint(tmp_path / "gspmd", state)
    continued = []
    for batch in batches[2:]:
        state, metrics = step(state, batch)
        continued.append(float(metrics.loss))
    fresh = build(jd.TrainConfig(bucket_size=60))
    restored, _ = jd.restore_checkpoint(tmp_path / "gspmd", fresh.abstract_state())
    saved = fresh.master_params(restored)
    resumed = []
    for batch in batches[2:]:
        restored, metrics = fresh(restored, batch)
        resumed.append(float(metrics.loss))
    assert resumed == continued

    manual = build(jd.TrainConfig(bucket_size=60, param_specs=SPECS), manual_loss, params)
    assert manual.tensor_parallel == "manual" and manual.optimizer.fingerprint != fresh.optimizer.fingerprint
    moved, _ = jd.restore_checkpoint(tmp_path / "gspmd", manual.abstract_state())
    jax.tree.map(np.testing.assert_array_equal, manual.master_params(moved), saved)
    moved, _ = manual(moved, batches[2])
    jd.save_checkpoint(tmp_path / "manual", moved)
    back, _ = jd.restore_checkpoint(tmp_path / "manual", fresh.abstract_state())
    jax.tree.map(np.testing.assert_array_equal, fresh.master_params(back), manual.master_params(moved))


def test_the_mode_follows_where_the_shardings_come_from(cpu_devices):
    """param_specs keep the manual (local blocks + psum) path; shardings declared on the params
    mean gspmd; either can be chosen explicitly; a collective over the model axis in a gspmd loss
    is explained."""
    mesh = _mesh("data_model", cpu_devices)
    params, (batch,) = _params(np.random.default_rng(0)), _batches(1, 1)
    build = lambda p, config, loss=gspmd_loss: jd.make_train_step(p, loss, _tx(), mesh, config)
    assert build(params, jd.TrainConfig(param_specs=SPECS)).tensor_parallel == "manual"
    assert build(params, jd.TrainConfig()).tensor_parallel == "manual"  # nothing sharded: data parallel
    assert build(_placed(params, mesh), jd.TrainConfig()).tensor_parallel == "gspmd"
    assert build(params, jd.TrainConfig(param_specs=SPECS, tensor_parallel="gspmd")).tensor_parallel == "gspmd"
    assert build(_placed(params, mesh), jd.TrainConfig(tensor_parallel="manual")).tensor_parallel == "manual"

    with pytest.raises(ValueError, match="collective over 'model', which tensor_parallel='gspmd' leaves to XLA"):
        jd.make_train_step(_placed(params, mesh), manual_loss, _tx(), mesh, jd.TrainConfig(), example_batch=batch)
    with pytest.raises(ValueError, match="tensor_parallel must be 'manual'"):
        jd.TrainConfig(tensor_parallel="xla")


def test_declared_shardings_over_a_missing_or_data_axis_are_refused_with_their_path(cpu_devices):
    mesh = _mesh("data_model", cpu_devices)
    params = _params(np.random.default_rng(0))
    other = jax.make_mesh((4, 2), ("data", "tensor"), devices=cpu_devices)
    bad = _placed(params, mesh)
    bad["head"] = jax.device_put(params["head"], NamedSharding(other, P(None, "tensor")))
    bad["blocks"][1]["w_in"] = jax.device_put(params["blocks"][1]["w_in"], NamedSharding(mesh, P("data", "model")))
    with pytest.raises(ValueError) as error:  # refused at once, before any tracing
        jd.make_train_step(bad, gspmd_loss, _tx(), mesh, jd.TrainConfig())
    message = str(error.value)
    assert "'head': NamedSharding P(None, 'tensor') names ['tensor'], which the mesh lacks" in message
    assert "'blocks/1/w_in': NamedSharding P('data', 'model') shards it over the data-parallel axis ['data']" in message
    replica_model = jax.make_mesh((2, 4), ("replica", "model"), devices=cpu_devices)
    abstract = {"blocks": [{"w_in": jax.ShapeDtypeStruct((D, H), jnp.float32,
                                                         sharding=NamedSharding(replica_model, P("replica", "model")))}]}
    with pytest.raises(ValueError, match="'blocks/0/w_in': .* over the data-parallel axis \\['replica'\\]"):
        declared_specs(abstract, replica_model, data_axes=("replica",))



#: Logical rules as MaxText writes them: the batch over the data axis, the hidden over the model.
ACTIVATION_RULES = (("activation_batch", "data"), ("activation_hidden", "model"))


def _constrained_loss(constrain):
    """:func:`gspmd_loss` with each block's hidden activation (batch, H) constrained by ``constrain``."""
    def loss(p, batch):
        h = batch["x"]
        for q in p["blocks"]:
            hidden = constrain(jax.nn.gelu((h * q["norm"]) @ q["w_in"] + q["b_in"]))
            h = h + jnp.tanh(hidden @ q["w_out"] + q["b_out"])
        return jnp.mean(jnp.sum((h @ p["head"] - batch["y"]) ** 2, axis=-1))
    return loss


def _constraint_ways(mesh):
    """``name -> (constrain, context to build and run the step in, TrainConfig options)``: every way
    a model writes "batch over data, hidden over model"."""
    spec = P("data", "model")
    wsc = lambda s: (lambda h: jax.lax.with_sharding_constraint(h, s))
    step_rules = {"logical_axis_rules": ACTIVATION_RULES}
    callers_rules = (("activation_batch", "data"), ("activation_hidden", None))  # the step's rules must win
    return {
        "partition_spec": (wsc(spec), contextlib.nullcontext, {}),
        "partition_spec_under_with_mesh": (wsc(spec), lambda: mesh, {}),
        "partition_spec_under_set_mesh": (wsc(spec), lambda: jax.set_mesh(mesh), {}),
        "named_sharding": (wsc(NamedSharding(mesh, spec)), contextlib.nullcontext, {}),
        "flax_logical_rules": (lambda h: nn.with_logical_constraint(h, ("activation_batch", "activation_hidden")),
                               lambda: nn.logical_axis_rules(callers_rules), step_rules),
    }


@pytest.mark.filterwarnings("ignore:.*mesh.. context manager has been deprecated:DeprecationWarning")
@pytest.mark.parametrize("way", ["partition_spec", "partition_spec_under_with_mesh", "partition_spec_under_set_mesh",
                                 "named_sharding", "flax_logical_rules"])
def test_activation_constraints_over_the_data_axes_keep_their_model_axes(way, cpu_devices):
    """A model constrains its hidden activations to (batch over "data", hidden over "model"), as
    MaxText, t5x and EasyLM-style helpers do. Inside the step "data" is manual: the constraint
    keeps its model axis (the lowered program constrains each device's (4, 16) block to
    ``[{}, {"model"}]`` and names no data axis), and the step trains like one-device optax."""
    mesh = _mesh("data_model", cpu_devices)
    constrain, context, options = _constraint_ways(mesh)[way]
    params, batches = _params(np.random.default_rng(0)), _batches(1, STEPS)
    loss = _constrained_loss(constrain)
    with context():
        step = jd.make_train_step(_placed(params, mesh), loss, _tx(), mesh,
                                  jd.TrainConfig(axis="data", bucket_size=60, **options), example_batch=batches[0])
        assert step.tensor_parallel == "gspmd"
        program = step.lower(step.abstract_state(), batches[0]).as_text()
        # The hidden activation's constraints: the step's own leave every dimension open ({?}).
        constraints = [line for line in program.splitlines() if "sdy.sharding_constraint" in line
                       and "tensor<4x16xf32>" in line and "[{?}, {?}]" not in line]
        assert len(constraints) == 2 * L, constraints  # each block's, and its cotangent's in the backward
        for line in constraints:
            assert re.search(r'<@\w+, \[\{\}, \{"model"\}\]> : tensor<4x16xf32>', line), line
        _train_and_compare(step, None, params, gspmd_loss, batches, way)


def test_activation_constraints_keep_their_model_axes_with_an_outer_axis_and_micro_batches(cpu_devices):
    """HSDP (``outer_axis="replica"``) and 2 micro-batches: the batch is split over both data axes
    and then into micro-batches, so each hidden block is (2, 16); a constraint over
    ``("replica", "data")`` keeps only its model axis there, and the step trains like optax."""
    kind = "replica_data_model"
    mesh = _mesh(kind, cpu_devices)
    _, _, options = MESHES[kind]
    params, batches = _params(np.random.default_rng(0)), _batches(1, STEPS)
    loss = _constrained_loss(lambda h: jax.lax.with_sharding_constraint(h, P(("replica", "data"), "model")))
    step = jd.make_train_step(_placed(params, mesh), loss, _tx(), mesh,
                              jd.TrainConfig(axis="data", bucket_size=60, **options), example_batch=batches[0])
    rows = BATCH // (mesh.shape["replica"] * mesh.shape["data"] * options["microbatches"])
    program = step.lower(step.abstract_state(), batches[0]).as_text()
    constraints = [line for line in program.splitlines() if "sdy.sharding_constraint" in line
                   and f"tensor<{rows}x{H}xf32>" in line and "[{?}, {?}]" not in line]
    assert constraints, f"no constraint on the ({rows}, {H}) hidden blocks"
    for line in constraints:
        assert re.search(r'<@\w+, \[\{\}, \{"model"\}\]> : tensor<' + f"{rows}x{H}" + r"xf32>", line), line
    _train_and_compare(step, None, params, gspmd_loss, batches, kind)


def test_a_constraint_that_splits_a_dimension_over_a_data_axis_is_refused(cpu_devices):
    """A data axis on a dimension other than the batch's asks for a layout the step cannot give:
    refused, naming the constraint, the axis and what to write."""
    mesh = _mesh("data_model", cpu_devices)
    params, batch = _placed(_params(np.random.default_rng(0)), mesh), _batches(1, 1)[0]
    loss = _constrained_loss(lambda h: jax.lax.with_sharding_constraint(h, P("model", "data")))
    for config in (jd.TrainConfig(), jd.TrainConfig(tensor_parallel="gspmd", param_specs=SPECS)):
        with pytest.raises(ValueError, match=r"constrains an activation to P\('model', 'data'\), which splits "
                                             r"its dimension 1 over the data axis 'data'.*Put the data axes on the "
                                             r"batch dimension only, or leave them out of the constraint: "
                                             r"P\('model', None\)"):
            jd.make_train_step(params, loss, _tx(), mesh, config, example_batch=batch)


def test_steps_built_and_run_under_the_callers_explicit_context_mesh(cpu_devices):
    """Code on jax's Explicit meshes runs everything under ``jax.set_mesh``; the step runs an Auto
    copy of that mesh and trains there as it does outside any context, bit for bit."""
    mesh = _mesh("data_model", cpu_devices)
    params, batches = _placed(_params(np.random.default_rng(0)), mesh), _batches(1, 2)

    def run():
        step = jd.make_train_step(params, gspmd_loss, _tx(), mesh, jd.TrainConfig(), example_batch=batches[0])
        state = step.init()
        for batch in batches:
            state, metrics = step(state, batch)
        return step, jax.device_get(state.params), float(metrics.loss)

    _, want, want_loss = run()
    with jax.set_mesh(mesh):
        step, got, loss = run()
        assert step.lower(step.abstract_state(), batches[0]) is not None
    assert step.tensor_parallel == "gspmd" and loss == want_loss
    jax.tree.map(np.testing.assert_array_equal, got, want)

# -- nnx metadata, linen logical rules --------------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d: int = D, h: int = H):
        part = lambda init, names: nnx.with_partitioning(init, names)
        self.up = nnx.Linear(d, h, kernel_init=part(nnx.initializers.normal(0.3), (None, "model")),
                             bias_init=part(nnx.initializers.normal(0.1), ("model",)), rngs=rngs)
        self.down = nnx.Linear(h, d, kernel_init=part(nnx.initializers.normal(0.3), ("model", None)),
                               bias_init=nnx.initializers.normal(0.1), rngs=rngs)

    def __call__(self, h):
        return h + jnp.tanh(self.down(jax.nn.gelu(self.up(h))))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d: int = D, h: int = H):
        self.block0, self.block1 = Block(rngs, d, h), Block(rngs, d, h)
        self.head = nnx.Linear(d, C, rngs=rngs)

    def __call__(self, x):
        return self.head(self.block1(self.block0(x)))


def nnx_loss(model, batch):
    return jnp.mean(jnp.sum((model(batch["x"]) - batch["y"]) ** 2, axis=-1))


def test_nnx_model_with_partitioning_metadata_trains_tensor_parallel(cpu_devices):
    """nnx.with_partitioning metadata only (the arrays unplaced): read without param_specs."""
    mesh = _mesh("data_model", cpu_devices)
    with nnx.use_eager_sharding(False):
        model = Model(nnx.Rngs(0))
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    specs = declared_specs(model, mesh, data_axes=("data",))
    assert specs["block0"]["up"]["kernel"] == P(None, "model") and specs["head"]["kernel"] == P()

    def reference_loss(p, batch):
        copy = jax.tree.map(lambda x: x, state)
        nnx.replace_by_pure_dict(copy, p)
        return nnx_loss(nnx.merge(graphdef, copy), batch)

    batches = _batches(1, STEPS)
    step = jd.make_train_step(model, nnx_loss, _tx(), mesh, jd.TrainConfig(bucket_size=60), example_batch=batches[0])
    assert step.tensor_parallel == "gspmd"
    state_after = _train_and_compare(step, None, params, reference_loss, batches, "nnx")
    _assert_model_blocks(state_after.params, specs, mesh, "nnx params")
    step.update_model(model, state_after)
    assert model.block0.up.kernel[...].shape == (D, H)


class LinenBlocks(nn.Module):
    d: int = D
    h: int = H

    @nn.compact
    def __call__(self, x):
        logical = lambda names, scale: nn.with_logical_partitioning(nn.initializers.normal(scale), names)
        for _ in range(L):
            h = nn.Dense(self.h, kernel_init=logical(("embed", "mlp"), 0.3), bias_init=logical(("mlp",), 0.1))(x)
            x = x + jnp.tanh(nn.Dense(self.d, kernel_init=logical(("mlp", "embed"), 0.3))(jax.nn.gelu(h)))
        return nn.Dense(C, kernel_init=logical(("embed", "vocab"), 0.3))(x)


def test_linen_logical_partitioning_with_rules_trains_tensor_parallel(cpu_devices):
    mesh = _mesh("replica_data_model", cpu_devices)
    module = LinenBlocks()
    boxed = module.init(jax.random.key(0), jnp.zeros((1, D)))["params"]
    rules = LINEN_RULES
    specs = declared_specs(boxed, mesh, rules)
    assert specs["Dense_0"]["kernel"] == P(None, "model") and specs["Dense_1"]["kernel"] == P("model")
    params = nn.meta.unbox(boxed)

    def loss(p, batch):
        return jnp.mean(jnp.sum((module.apply({"params": p}, batch["x"]) - batch["y"]) ** 2, axis=-1))

    batches = _batches(2, STEPS)
    config = jd.TrainConfig(axis="data", outer_axis="replica", bucket_size=60, logical_axis_rules=rules)
    step = jd.make_train_step(boxed, loss, _tx(), mesh, config, example_batch=batches[0])
    assert step.tensor_parallel == "gspmd"
    state = _train_and_compare(step, params, params, loss, batches, "linen")
    _assert_model_blocks(state.params, specs, mesh, "linen params")
    with pytest.raises(ValueError, match="'Dense_0/kernel': logical partitioning P\\('embed', 'mlp'\\) names"):
        jd.make_train_step(boxed, loss, _tx(), mesh, jd.TrainConfig(axis="data", outer_axis="replica"))


# -- ZeRO-3: each device holds its shard of its own model blocks ------------------------------------

TT, HEADS, HEAD_DIM, TF = 4, 4, 2, 16  # sequence, attention heads (split over model), head width, MLP hidden
TBLOCK_SPECS = {"norm1": None, "wqkv": P(None, None, "model", None), "wo": P("model", None, None), "norm2": None,
                "w_in": P(None, "model"), "w_out": P("model", None), "b_out": None}
TSPECS = {"pos": None, "blocks": [TBLOCK_SPECS] * L, "head": None}


def _transformer_params(rng):
    n = lambda *s, scale=0.3: jnp.asarray(rng.normal(size=s) * scale, jnp.float32)
    block = lambda: {"norm1": 1.0 + n(D, scale=0.1), "wqkv": n(D, 3, HEADS, HEAD_DIM), "wo": n(HEADS, HEAD_DIM, D),
                     "norm2": 1.0 + n(D, scale=0.1), "w_in": n(D, TF), "w_out": n(TF, D), "b_out": n(D, scale=0.1)}
    return {"pos": n(TT, D, scale=0.1), "blocks": [block() for _ in range(L)], "head": n(D, C)}


def _rms_norm(h, scale):
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * scale


def _transformer_block(q, h):
    """Causal attention with its heads split over "model", then a column/row-parallel MLP;
    global shapes, no collectives."""
    qkv = jnp.einsum("btd,dshk->sbthk", _rms_norm(h, q["norm1"]), q["wqkv"])
    causal = jnp.tril(jnp.ones((TT, TT), bool))
    scores = jnp.where(causal, jnp.einsum("bthk,bshk->bhts", qkv[0], qkv[1]) / np.sqrt(HEAD_DIM), -1e9)
    heads = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores, axis=-1), qkv[2])
    h = h + jnp.einsum("bthk,hkd->btd", heads, q["wo"])
    return h + jax.nn.gelu(_rms_norm(h, q["norm2"]) @ q["w_in"]) @ q["w_out"] + q["b_out"]


def transformer_loss(p, batch):
    """A block stack as large models write it: each block under jax.checkpoint (remat)."""
    h = batch["x"] + p["pos"]
    for q in p["blocks"]:
        h = jax.checkpoint(_transformer_block)(q, h)
    return jnp.mean(jnp.sum((h @ p["head"] - batch["y"]) ** 2, axis=-1))


def _sequence_batches(seed, n):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(BATCH, TT, D)).astype(np.float32),
             "y": rng.normal(size=(BATCH, TT, C)).astype(np.float32)} for _ in range(n)]


def _shards_to_tree(step, params):
    """A ZeRO-3 state's parameter shards (global arrays) as the parameter tree, on the host."""
    by_path = host_to_params(step.sync.description, [np.asarray(s) for s in step.sync.flat_shards(params.shards)])
    return jax.tree.unflatten(step.sync.treedef, [by_path[p] for p in leaf_paths(step.sync.abstract_params)])


@pytest.fixture(scope="module")
def zero3_runs(cpu_devices):
    """The transformer stack trained on (data=4, model=2) with shard_params=True and False: the
    steps, their final states and losses. Both lay buckets out along the remat blocks (ZeRO-1's
    default; ZeRO-3 asks for it), so they hold the same buckets."""
    mesh = _mesh("data_model", cpu_devices)
    params, batches = _transformer_params(np.random.default_rng(0)), _sequence_batches(1, STEPS)
    runs = {}
    for shard_params in (True, False):
        step = jd.make_train_step(_placed(params, mesh, TSPECS), transformer_loss, _tx(), mesh,
                                  jd.TrainConfig(bucket_size=100, shard_params=shard_params, bucket_boundaries="remat"),
                                  example_batch=batches[0])
        state, losses = step.init(), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics.loss))
        runs[shard_params] = (step, state, losses)
    return params, batches, runs


def _zero3_bounds(params, batches):
    """The AdamW trajectory's rounding bounds for the transformer run: parameters per step, losses."""
    _, want_losses, gradients = reference_run(transformer_loss, params, _reference_tx(), batches)
    additions = _additions(transformer_loss, params, batches[0])
    bounds = adam_rounding_bounds(gradients, additions=additions, learning_rate=LR, params=params,
                                  max_norm=MAX_NORM, weight_decay=WD)
    return bounds, loss_rounding_bounds(want_losses, gradients, bounds, additions=additions)


def test_shard_params_trains_a_gspmd_transformer_like_optax(zero3_runs):
    """ZeRO-3 on (data=4, model=2), a loss on global shapes with remat blocks: each bucket is
    gathered over the data axes in the nested region and leaves it as model-sharded parameters;
    the parameters it holds and the losses are one-device AdamW's (clipping, decay mask) to
    the trajectory's rounding."""
    params, batches, runs = zero3_runs
    step, state, losses = runs[True]
    assert step.tensor_parallel == "gspmd" and isinstance(state.params, zero3.ParamShards)
    assert step.sync.num_buckets > 4  # several buckets, some spanning two remat blocks
    want, want_losses, _ = reference_run(transformer_loss, params, _reference_tx(), batches)
    bounds, loss_bounds = _zero3_bounds(params, batches)
    assert_within(_shards_to_tree(step, jax.device_get(state.params)), want, bounds[-1],
                  what=f"ZeRO-3 gspmd params after {STEPS} AdamW steps")
    assert_within(step.master_params(state), want, bounds[-1], what="ZeRO-3 gspmd master params")
    assert np.all(np.abs(np.asarray(losses) - want_losses) <= loss_bounds), (losses, want_losses, loss_bounds)
    assert losses[-1] < losses[0]


def test_shard_params_state_is_one_over_data_times_model_per_device(zero3_runs):
    """Parameter, master and optimizer shards: every device holds 1/(data x model) of them (its
    slice of its own model rank's buckets), never a weight whole along the model axis."""
    params, _, runs = zero3_runs
    step, state, _ = runs[True]
    devices = step.sync.axis_size * step.mesh.shape["model"]
    assert devices == 8
    for x in (*state.params.shards, *state.opt_state.master,
              *[leaf for leaf in jax.tree.leaves(state.opt_state.inner) if leaf.ndim]):
        assert x.sharding.spec == P(("data", "model")), x.sharding
        assert {s.data.shape for s in x.addressable_shards} == {(x.shape[0] // devices,)}
    # All of them together: the parameters' local blocks once, over the data axis, plus padding.
    held = sum(x.addressable_shards[0].data.size for x in state.params.shards)
    whole = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    padding = sum(size - sum(p.size for p in b.pieces) for b, size in
                  zip(step.sync.chains[0].layout.buckets, step.sync.bucket_sizes))
    replicated = sum(int(np.prod(x.shape)) for x, spec in zip(jax.tree.leaves(params), _spec_leaves(TSPECS))
                     if spec is None)
    # Each model rank's buckets hold the replicated leaves too: (whole + replicated) / 8 with 2 ranks.
    assert held * devices == (whole + replicated) + padding * step.mesh.shape["model"]


def _spec_leaves(specs):
    return jax.tree.leaves(specs, is_leaf=lambda s: s is None or isinstance(s, P))


def test_shard_params_equals_the_gspmd_zero1_step(zero3_runs):
    """ZeRO-3 and ZeRO-1 run the same float operations per bucket, the loss partitioned by XLA
    in each: losses and master weights equal to the trajectory's rounding."""
    params, batches, runs = zero3_runs
    (step3, state3, losses3), (step1, state1, losses1) = runs[True], runs[False]
    assert step3.optimizer.fingerprint == step1.optimizer.fingerprint  # the same buckets, the same shards
    bounds, loss_bounds = _zero3_bounds(params, batches)
    assert_within(np.asarray(losses3), np.asarray(losses1), loss_bounds, what="losses")
    assert_within(step3.master_params(state3), step1.master_params(state1), bounds[-1], what="master params")


# -- on XLA's GPU compiler: no weight gathered over the model axis ----------------------------------

GD, GH, GL = 512, 2048, 2  # a bf16 stack big enough for XLA to treat like a real one


@functools.lru_cache(maxsize=None)
def _gpu_step(tensor_parallel, shard_params=False, remat=False):
    from jax_drain.planner.targets import gpu_mesh
    from jax_drain.planner.schedule import parse_schedule

    mesh = gpu_mesh((4, 2), ("data", "model"))
    spec_of = {"norm": P(), "w_in": P(None, "model"), "b_in": P("model"), "w_out": P("model", None), "b_out": P()}
    shape_of = {"norm": (GD,), "w_in": (GD, GH), "b_in": (GH,), "w_out": (GH, GD), "b_out": (GD,)}
    block = {k: jax.ShapeDtypeStruct(shape_of[k], jnp.bfloat16, sharding=NamedSharding(mesh, spec_of[k]))
             for k in shape_of}
    params = {"blocks": [block] * GL, "head": jax.ShapeDtypeStruct((GD, GD), jnp.bfloat16)}
    batch = {"x": jax.ShapeDtypeStruct((8 * 256, GD), jnp.bfloat16), "y": jax.ShapeDtypeStruct((8 * 256, GD), jnp.float32)}

    def block(q, h):  # gspmd: global shapes; manual: local blocks and the psum it then needs
        z = jax.nn.gelu((h * q["norm"]) @ q["w_in"] + q["b_in"]) @ q["w_out"]
        return h + jnp.tanh((jax.lax.psum(z, "model") if tensor_parallel == "manual" else z) + q["b_out"])

    def loss(p, b):
        h = b["x"]
        for q in p["blocks"]:
            h = (jax.checkpoint(block) if remat else block)(q, h)
        return jnp.mean(((h @ p["head"]).astype(jnp.float32) - b["y"]) ** 2)

    config = jd.TrainConfig(axis="data", bucket_size=GD * GH // 2, tensor_parallel=tensor_parallel,
                            shard_params=shard_params,
                            param_specs=jax.tree.map(lambda x: x.sharding.spec if x.sharding else P(), params,
                                                     is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)))
    step = jd.make_train_step(params, loss, jd.adamw(1e-3, max_norm=1.0), mesh, config, example_batch=batch)
    compiled = step.lower(step.abstract_state(), batch).compile()
    return step, compiled, parse_schedule(compiled.as_text())


@pytest.mark.gpu_compile
def test_no_weight_is_gathered_over_the_model_axis_on_the_gpu_compiler():
    step, compiled, sched = _gpu_step("gspmd")
    data, model = 4, 2
    gathers = [c for c in sched.collectives if c.kind == "all-gather"]
    # The only all-gathers are the optimizer's parameter gathers over the data axis, one per bucket.
    assert gathers and all(c.group_size == data and c.in_scope("jax_drain/gather/bucket") for c in gathers)
    assert len(gathers) == step.sync.num_buckets
    # Over the model axis only all-reduces: XLA's activation sums and the replicated leaves' pmax.
    assert {c.kind for c in sched.collectives if c.group_size == model} == {"all-reduce"}
    # Each bucket one bf16 all-to-all over data, on its local blocks, drained: one in flight.
    for k, size in enumerate(step.sync.bucket_sizes):
        (c,) = [c for c in sched.collectives if c.in_scope(f"jax_drain/bucket{k}/")]
        assert (c.kind, c.dtype, c.group_size, c.bytes) == ("all-to-all", "bf16", data, 2 * size)
    assert sched.max_in_flight(lambda c: c.in_scope("jax_drain/bucket")) == 1

    # The same collectives, bytes and temp memory as the hand-written tensor-parallel program.
    _, manual, manual_sched = _gpu_step("manual")
    summary = lambda s: sorted((c.kind, c.dtype, c.bytes, c.group_size) for c in s.collectives)
    assert summary(sched) == summary(manual_sched)
    assert compiled.memory_analysis().temp_size_in_bytes <= manual.memory_analysis().temp_size_in_bytes


LINEN_RULES = (("embed", None), ("mlp", "model"), ("vocab", None))


@pytest.mark.gpu_compile
@pytest.mark.parametrize("kind", ["nnx_metadata", "linen_rules_replica_data_model"])
def test_declared_shardings_gather_no_weight_over_the_model_axis_on_the_gpu_compiler(kind):
    """The nnx model's ``with_partitioning`` metadata on ``(data, model)`` and the linen model's
    logical rules on ``(replica, data, model)``, at GPU sizes on compile-only 8xH100 devices:
    every all-gather is the optimizer's parameter gather of a bucket over data, each bucket one
    all-to-all over data; XLA gathers no weight."""
    from jax_drain.planner.schedule import parse_schedule
    from jax_drain.planner.targets import gpu_mesh

    d, h = 512, 2048
    if kind == "nnx_metadata":
        mesh, data = gpu_mesh((4, 2), ("data", "model")), 4
        with nnx.use_eager_sharding(False):
            model, loss, config = Model(nnx.Rngs(0), d, h), nnx_loss, jd.TrainConfig(bucket_size=d * h // 2)
    else:
        mesh, data = gpu_mesh((2, 2, 2), ("replica", "data", "model")), 2
        module = LinenBlocks(d, h)
        model = module.init(jax.random.key(0), jnp.zeros((1, d)))["params"]
        config = jd.TrainConfig(axis="data", outer_axis="replica", bucket_size=d * h // 2,
                                logical_axis_rules=LINEN_RULES)

        def loss(p, batch):
            return jnp.mean(jnp.sum((module.apply({"params": p}, batch["x"]) - batch["y"]) ** 2, axis=-1))

    batch = {"x": jax.ShapeDtypeStruct((8 * 256, d), jnp.float32), "y": jax.ShapeDtypeStruct((8 * 256, C), jnp.float32)}
    step = jd.make_train_step(model, loss, jd.adamw(1e-3, max_norm=1.0), mesh, config, example_batch=batch)
    assert step.tensor_parallel == "gspmd" and step.sync.num_buckets >= 2
    sched = parse_schedule(step.lower(step.abstract_state(), batch).compile().as_text())
    gathers = [c for c in sched.collectives if c.kind == "all-gather"]
    assert len(gathers) == step.sync.num_buckets
    assert all(c.group_size == data and c.in_scope("jax_drain/gather/bucket") for c in gathers), gathers
    for k in range(step.sync.num_buckets):
        (c,) = [c for c in sched.collectives if c.in_scope(f"jax_drain/bucket{k}/") and c.kind == "all-to-all"]
        assert c.group_size == data


def test_shard_params_refuses_what_it_cannot_shard(cpu_devices):
    """A model-sharded leaf split over buckets (it could not leave the nested region as its
    parameter) is refused, saying what to use."""
    mesh = _mesh("data_model", cpu_devices)
    params, (batch,) = _params(np.random.default_rng(0)), _batches(1, 1)
    with pytest.raises(ValueError, match=r"\['blocks/0/w_in'.* split over buckets .* use split_leaves=False"):
        jd.make_train_step(_placed(params, mesh), gspmd_loss, _tx(), mesh,
                           jd.TrainConfig(bucket_size=60, shard_params=True, split_leaves=True), example_batch=batch)


@pytest.mark.gpu_compile
@pytest.mark.parametrize("tensor_parallel", ["gspmd", "manual"])
def test_shard_params_gathers_no_weight_over_the_model_axis_on_the_gpu_compiler(tensor_parallel):
    """ZeRO-3 with gspmd (and with the loss on local blocks) on compile-only 8xH100 (data=4,
    model=2), remat blocks: every parameter all-gather is over the data axis, of one model rank's
    local bucket, in forward and again in each block's backward; over the model axis only
    all-reduces (activations, the replicated leaves' pmax); each bucket's gradient is one bf16
    all-to-all of its local blocks over data, drained; the parameters are arguments at
    1/(data x model)."""
    step, compiled, sched = _gpu_step(tensor_parallel, shard_params=True, remat=True)
    data, model = 4, 2
    sizes = step.sync.bucket_sizes
    gathers = [c for c in sched.collectives if c.kind == "all-gather"]
    assert gathers and all(c.group_size == data and c.in_scope("jax_drain/gather/bucket") for c in gathers)
    # Each gather (XLA may combine two buckets' into one) brings this model rank's local buckets:
    # one gathered over the model axis too would be `model` times larger.
    count = [0] * len(sizes)
    for c in gathers:
        named = [k for k in range(len(sizes))  # the scope closes with "/", or ")" inside a jvp(...)
                 if any(re.search(rf"jax_drain/gather/bucket{k}[/)]", name) for name in c.op_names)]
        assert c.bytes == 2 * sum(sizes[k] for k in named), (c.op_names, c.bytes)
        for k in named:
            count[k] += 1
    # In forward and again in its block's backward; the last block's backward may reuse its forward gather.
    assert min(count) >= 1 and sum(c < 2 for c in count) <= 1, count
    assert {c.kind for c in sched.collectives if c.group_size == model} == {"all-reduce"}
    assert not [c for c in sched.collectives if c.group_size == data * model and c.kind != "all-reduce"]
    for k, size in enumerate(sizes):
        (c,) = [c for c in sched.collectives if c.in_scope(f"jax_drain/bucket{k}/")]
        assert (c.kind, c.dtype, c.group_size, c.bytes) == ("all-to-all", "bf16", data, 2 * size)
    assert sched.max_in_flight(lambda c: c.in_scope("jax_drain/bucket")) == 1

    # Against ZeRO-1 with gspmd: the arguments are smaller by the parameters' local blocks less
    # this device's 1/data of them (bf16; the optimizer state and batch are the same).
    _, zero1, _ = _gpu_step(tensor_parallel, shard_params=False, remat=True)
    blocks = 2 * sum(sum(p.size for p in b.pieces) for b in step.sync.chains[0].layout.buckets)
    saved = zero1.memory_analysis().argument_size_in_bytes - compiled.memory_analysis().argument_size_in_bytes
    assert saved == blocks - 2 * sum(sizes) // data


# -- a scanned stack: each layer's buckets reduced inside the backward scan, on local blocks ------

SCAN_BLOCK_SPECS = {"norm": None, "w_in": P(None, None, "model"), "b_in": P(None, "model"),
                    "w_out": P(None, "model", None), "b_out": None}
SCAN_SPECS = {"blocks": SCAN_BLOCK_SPECS, "head": None}


def _scan_params(rng):
    """:func:`_params`' blocks stacked over layers: ``[L, ...]`` leaves."""
    params = _params(rng)
    return {"blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *params["blocks"]), "head": params["head"]}


def scanned_gspmd_loss(p, batch):
    """:func:`gspmd_loss` under ``jax.lax.scan`` over the stacked blocks: global shapes."""
    def block(h, q):
        return h + jnp.tanh(jax.nn.gelu((h * q["norm"]) @ q["w_in"] + q["b_in"]) @ q["w_out"] + q["b_out"]), None

    h, _ = jax.lax.scan(block, batch["x"], p["blocks"])
    return jnp.mean(jnp.sum((h @ p["head"] - batch["y"]) ** 2, axis=-1))


def _layer_collectives(jaxpr, in_scan=False, manual=frozenset(), prefix="jax_drain/layers/"):
    """Every collective of the layer buckets (``jax_drain/layers/bucket{k}``, or their ZeRO-3
    gathers with ``prefix="jax_drain/gather/layers/"``): ``(bucket scope, primitive, inside a
    scan body, the mesh axes manual there)``."""
    from jax_drain._jaxpr import COLLECTIVES, bucket_scope, sub_jaxprs

    out = []
    for eqn in jaxpr.eqns:
        scope = bucket_scope(eqn)
        if eqn.primitive.name in COLLECTIVES and scope and scope.startswith(prefix):
            out.append((scope, eqn.primitive.name, in_scan, manual))
        # The axes a shard_map makes manual: "newly_manual_axes" (jax >= 0.7), else "axis_names".
        names = eqn.params.get("newly_manual_axes", eqn.params.get("axis_names")) if eqn.primitive.name == "shard_map" else None
        inner = manual | frozenset(names or ())
        for sub in sub_jaxprs(eqn):
            out += _layer_collectives(sub, in_scan or eqn.primitive.name == "scan", inner, prefix)
    return out


def test_scanned_stack_reduces_each_layer_inside_the_backward_scan_on_local_blocks(cpu_devices):
    """A GSPMD scanned stack (declared shardings, the default scan detection) trains with the
    per-layer sync: every layer bucket's reduce-scatter is in a scan body, in the nested region
    manual over data and model, and only there; it trains like one-device optax."""
    mesh = _mesh("data_model", cpu_devices)
    params, batches = _scan_params(np.random.default_rng(0)), _batches(1, STEPS)
    step = jd.make_train_step(_placed(params, mesh, SCAN_SPECS), scanned_gspmd_loss, _tx(), mesh,
                              jd.TrainConfig(axis="data", bucket_size=40, scan_layers=None), example_batch=batches[0])
    assert step.tensor_parallel == "gspmd" and step.scan_layers and isinstance(step.sync, jd.ScanGradSync)
    layers = step.sync.chains[0]
    assert layers.num_layers == L and layers.num_buckets >= 2 and layers.spec_axes == ("model",)

    jaxpr = jax.make_jaxpr(step._jitted)(step.abstract_state(), batches[0]).jaxpr
    found = _layer_collectives(jaxpr)
    assert sorted({scope for scope, *_ in found}) == [f"jax_drain/layers/bucket{k}" for k in range(layers.num_buckets)]
    reduces = [f for f in found if f[1] in ("all_to_all", "psum_scatter", "reduce_scatter")]
    assert len(reduces) == layers.num_buckets, found  # one per bucket, in the one backward body
    assert all(in_scan and manual == {"data", "model"} for _, _, in_scan, manual in found), found

    state = _train_and_compare(step, None, _scan_params(np.random.default_rng(0)), scanned_gspmd_loss, batches,
                               "scanned gspmd")
    _assert_model_blocks(state.params, SCAN_SPECS, mesh, "params")


@pytest.mark.parametrize("shard_params", [False, True], ids=["zero1", "zero3"])
def test_scanned_stack_keeps_the_model_axis_of_its_activation_constraints(shard_params, cpu_devices):
    """A constraint over ("data", "model") inside the scanned block (the per-layer sync's scan,
    ZeRO-1 and ZeRO-3) keeps its model axis on each device's (4, 16) block, and trains like optax."""
    def loss(p, batch):
        def block(h, q):
            hidden = jax.nn.gelu((h * q["norm"]) @ q["w_in"] + q["b_in"])
            hidden = jax.lax.with_sharding_constraint(hidden, P("data", "model"))
            return h + jnp.tanh(hidden @ q["w_out"] + q["b_out"]), None

        h, _ = jax.lax.scan(block, batch["x"], p["blocks"])
        return jnp.mean(jnp.sum((h @ p["head"] - batch["y"]) ** 2, axis=-1))

    mesh = _mesh("data_model", cpu_devices)
    params, batches = _scan_params(np.random.default_rng(0)), _batches(1, STEPS)
    step = jd.make_train_step(_placed(params, mesh, SCAN_SPECS), loss, _tx(), mesh,
                              jd.TrainConfig(axis="data", bucket_size=40, scan_layers=None, shard_params=shard_params),
                              example_batch=batches[0])
    assert step.scan_layers and isinstance(step.sync, jd.ScanGradSync)
    program = step.lower(step.abstract_state(), batches[0]).as_text()
    constraints = [line for line in program.splitlines() if "sdy.sharding_constraint" in line
                   and "tensor<4x16xf32>" in line and "[{?}, {?}]" not in line]
    assert constraints, "no constraint on the (4, 16) hidden blocks"
    for line in constraints:
        assert re.search(r'<@\w+, \[\{\}, \{"model"\}\]> : tensor<4x16xf32>', line), line
    to_tree = (lambda p: _shards_to_tree(step, p)) if shard_params else (lambda p: p)
    _train_and_compare(step, None, _scan_params(np.random.default_rng(0)), scanned_gspmd_loss, batches,
                       f"scanned {'zero3' if shard_params else 'zero1'}", to_tree=to_tree)


def test_scanned_stack_with_shard_params_gathers_and_reduces_each_layer_in_the_scan(cpu_devices):
    """ZeRO-3 on a GSPMD scanned stack (found by scan detection): each layer bucket is gathered
    from its row and reduce-scattered inside the scan bodies, in the nested region manual over
    data and model; the parameters are 1/(data x model) per device and train like one-device optax."""
    mesh = _mesh("data_model", cpu_devices)
    params, batches = _scan_params(np.random.default_rng(0)), _batches(1, STEPS)
    step = jd.make_train_step(_placed(params, mesh, SCAN_SPECS), scanned_gspmd_loss, _tx(), mesh,
                              jd.TrainConfig(bucket_size=40, scan_layers=None, shard_params=True),
                              example_batch=batches[0])
    assert step.tensor_parallel == "gspmd" and step.scan_layers and isinstance(step.sync, jd.ScanGradSync)
    layers = step.sync.chains[0]
    assert layers.num_layers == L and layers.num_buckets >= 2

    jaxpr = jax.make_jaxpr(step._jitted)(step.abstract_state(), batches[0]).jaxpr
    found = _layer_collectives(jaxpr)
    reduces = [f for f in found if f[1] in ("all_to_all", "psum_scatter", "reduce_scatter")]
    assert len(reduces) == layers.num_buckets, found  # one per bucket, in the backward body
    gathers = _layer_collectives(jaxpr, prefix="jax_drain/gather/layers/")
    assert {scope for scope, *_ in gathers} == {f"jax_drain/gather/layers/bucket{k}" for k in range(layers.num_buckets)}
    assert all(in_scan and manual == {"data", "model"} for _, _, in_scan, manual in found + gathers), found + gathers

    state = _train_and_compare(step, None, _scan_params(np.random.default_rng(0)), scanned_gspmd_loss, batches,
                               "scanned gspmd ZeRO-3", to_tree=lambda p: _shards_to_tree(step, p))
    # Layer rows [L, shard] split over data and model; the rest (the replicated head) over data.
    assert [c.spec_size for c in step.sync.chains] == [mesh.shape["model"], 1]
    for (chain, _), x in zip(step.sync.flat_chains, step.sync.flat_shards(state.params.shards)):
        devices = step.sync.axis_size * chain.spec_size
        assert {s.data.shape for s in x.addressable_shards} == {(*x.shape[:-1], x.shape[-1] // devices)}, x.sharding


def test_scanned_stack_refusals_with_gspmd(cpu_devices):
    """A layer dimension split over a model axis is refused, naming the leaf."""
    mesh = _mesh("data_model", cpu_devices)
    params = _scan_params(np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"'blocks/norm' .* layer \(leading\) dimension"):
        jd.ScanGradSync(params, mesh, stacked={"blocks": True, "head": False}, tensor_parallel="gspmd",
                        param_specs={**SCAN_SPECS, "blocks": {**SCAN_BLOCK_SPECS, "norm": P("model")}})


GS = 4  # scanned layers of the compile-only stack


@functools.lru_cache(maxsize=None)
def _gpu_scan_step(scan_layers, shard_params=False):
    """A bf16 GSPMD scanned stack on compile-only 8xH100 (data=4, model=2), its weights split over model."""
    from jax_drain.planner.targets import gpu_mesh
    from jax_drain.planner.schedule import parse_schedule

    mesh = gpu_mesh((4, 2), ("data", "model"))
    shape_of = {"norm": (GS, GD), "w_in": (GS, GD, GH), "b_in": (GS, GH), "w_out": (GS, GH, GD), "b_out": (GS, GD)}
    blocks = {k: jax.ShapeDtypeStruct(shape_of[k], jnp.bfloat16, sharding=NamedSharding(mesh, SCAN_BLOCK_SPECS[k] or P()))
              for k in shape_of}
    params = {"blocks": blocks, "head": jax.ShapeDtypeStruct((GD, GD), jnp.bfloat16, sharding=NamedSharding(mesh, P()))}
    batch = {"x": jax.ShapeDtypeStruct((8 * 256, GD), jnp.bfloat16), "y": jax.ShapeDtypeStruct((8 * 256, GD), jnp.float32)}

    def loss(p, b):
        def block(h, q):
            z = jax.nn.gelu((h * q["norm"]) @ q["w_in"] + q["b_in"]) @ q["w_out"]
            return h + jnp.tanh(z + q["b_out"]), None

        h, _ = jax.lax.scan(block, b["x"], p["blocks"])
        return jnp.mean(((h @ p["head"]).astype(jnp.float32) - b["y"]) ** 2)

    config = jd.TrainConfig(axis="data", bucket_size=GD * GH // 2, scan_layers=scan_layers, shard_params=shard_params)
    step = jd.make_train_step(params, loss, jd.adamw(1e-3, max_norm=1.0), mesh, config, example_batch=batch)
    compiled = step.lower(step.abstract_state(), batch).compile()
    return step, compiled, parse_schedule(compiled.as_text())


@pytest.mark.gpu_compile
def test_scanned_stack_reduces_each_layer_in_the_while_body_on_the_gpu_compiler():
    """The GSPMD scanned stack on compile-only 8xH100: each layer bucket's gradient is one bf16
    all-to-all over data of its local blocks (one model rank's bucket), inside the backward while
    body, drained; no weight or gradient is all-gathered over the model axis; less temp memory
    than reducing the stacked gradient after the backward."""
    from jax_drain.scan import LAYER_SCOPE

    step, compiled, sched = _gpu_scan_step(True)
    data, model = 4, 2
    assert step.scan_layers and step.tensor_parallel == "gspmd"
    layers = step.sync.chains[0]
    assert layers.num_buckets >= 2
    found = [c for c in sched.collectives if c.in_scope(LAYER_SCOPE)]
    assert found and all(c.computation != sched.entry for c in found)  # in a loop body
    assert len({c.computation for c in found}) == 1  # the backward one
    for k, size in enumerate(layers.layout.bucket_sizes):
        (c,) = [c for c in found if c.in_scope(f"{LAYER_SCOPE}/bucket{k}/")]
        assert (c.kind, c.dtype, c.group_size, c.bytes) == ("all-to-all", "bf16", data, 2 * size)
        assert sched.feeds_f32_reduce(c)
    assert sched.max_in_flight(lambda c: c.in_scope(LAYER_SCOPE)) == 1
    # Over the model axis only all-reduces (XLA's activation sums, the replicated leaves' pmax);
    # the only all-gathers are the optimizer's over data.
    assert {c.kind for c in sched.collectives if c.group_size == model} == {"all-reduce"}
    gathers = [c for c in sched.collectives if c.kind == "all-gather"]
    assert all(c.group_size == data and c.in_scope("jax_drain/gather/") for c in gathers), gathers

    _, after, after_sched = _gpu_scan_step(False)  # whole-leaf buckets after the backward
    assert not [c for c in after_sched.collectives if c.in_scope(LAYER_SCOPE)]
    assert compiled.memory_analysis().temp_size_in_bytes < after.memory_analysis().temp_size_in_bytes


@pytest.mark.gpu_compile
def test_scanned_stack_with_shard_params_gathers_each_layer_over_data_in_the_while_bodies():
    """ZeRO-3 on the GSPMD scanned stack, compile-only 8xH100: every layer bucket is gathered over
    data (one model rank's bucket: XLA may combine a small bucket's gather with the next one's)
    inside the loop body, and reduced in the backward loop body as one bf16 all-to-all; nothing
    is all-gathered over the model axis."""
    from jax_drain.scan import LAYER_SCOPE

    step, compiled, sched = _gpu_scan_step(True, True)
    data, model = 4, 2
    assert step.scan_layers and step.tensor_parallel == "gspmd" and step.config.shard_params
    layers = step.sync.chains[0]
    sizes = layers.layout.bucket_sizes
    for k, size in enumerate(sizes):
        gathers = [c for c in sched.collectives if c.in_scope(f"jax_drain/gather/layers/bucket{k}/")]
        combined = lambda c: sum(2 * sizes[j] for j in range(len(sizes))  # noqa: E731
                                 if c.in_scope(f"jax_drain/gather/layers/bucket{j}/"))
        assert gathers and all(c.kind == "all-gather" and c.group_size == data and c.bytes == combined(c)
                               and c.computation != sched.entry for c in gathers), gathers
        (reduce,) = [c for c in sched.collectives if c.in_scope(f"{LAYER_SCOPE}/bucket{k}/")]
        assert (reduce.kind, reduce.dtype, reduce.group_size) == ("all-to-all", "bf16", data)
        assert reduce.computation != sched.entry
    assert not [c for c in sched.collectives if c.kind == "all-gather" and c.group_size == model]

