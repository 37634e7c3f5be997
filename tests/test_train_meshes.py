"""The whole train step on every mesh kind, against plain optax on one device.

Each mesh kind (tensor parallel with the loss on local blocks and, ``"gspmd"``, on global shapes;
``("replica", "data", "model")``; expert parallel, with hand-written or GSPMD tensor parallelism;
split leaves; a scanned stack with an outer axis, and one written for GSPMD on a tensor-parallel mesh, synced inside its backward scan or
after it) trains a small float32 model for several steps with AdamW + global-norm
clipping + a decay mask through ``jd.make_train_step``; a single-device reference runs the same
model on the whole batch with plain optax (``optax.clip_by_global_norm`` + ``optax.adamw(mask=)``).
The clip threshold is below the gradient norm, so a norm that counts a tensor-parallel replica
twice (or misses a shard) changes the result. Each run is then resumed from a checkpoint and
must give the same losses bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_drain as jd
from helpers import adam_rounding_bounds, assert_within, reference_run, rounding_bound, rounding_chain

D, H, C, E, L = 8, 16, 4, 4, 3  # model width, hidden, outputs, experts, scanned layers
BATCH, STEPS, LR, WD, MAX_NORM = 16, 4, 2e-2, 0.1, 0.05


def _decay(params):
    """No decay on 1-D leaves (biases, norm scales) nor on the scanned stack's norm rows."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.ndim > 1 and "norm" not in jax.tree_util.keystr(path), params)


def _reference_tx():
    return optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, weight_decay=WD, mask=_decay))


def _tx():
    return jd.adamw(LR, weight_decay=WD, mask=_decay, max_norm=MAX_NORM)


def _mse(out, y):
    return jnp.mean(jnp.sum((out - y) ** 2, axis=-1))


# -- models: each a sharded loss (local blocks, collectives) and its single-device twin ----------


def _dense_params(rng):
    n = lambda *s, scale=0.3: jnp.asarray(rng.normal(size=s) * scale, jnp.float32)
    return {"w_in": n(D, H), "b_in": n(H, scale=0.1), "w_out": n(H, D), "b_out": n(D, scale=0.1),
            "norm": 1.0 + n(D, scale=0.1), "head": n(D, C)}


TP_SPECS = {"w_in": P(None, "model"), "b_in": P("model"), "w_out": P("model", None), "b_out": None,
            "norm": None, "head": None}


def _mlp(p, x, model_axis):
    h = jax.nn.relu((x * p["norm"]) @ p["w_in"] + p["b_in"])
    z = h @ p["w_out"]
    z = jax.lax.psum(z, model_axis) if model_axis else z
    return jnp.tanh(z + p["b_out"]) @ p["head"]


def tp_loss(p, batch):
    return _mse(_mlp(p, batch["x"], "model"), batch["y"])


def dense_reference_loss(p, batch):
    return _mse(_mlp(p, batch["x"], None), batch["y"])


def _expert_params(rng):
    p = _dense_params(rng)
    p["experts"] = jnp.asarray(rng.normal(size=(E, D, D)) * 0.3, jnp.float32)
    return p


def _moe(p, x, expert_axis):
    h = jnp.tanh((x * p["norm"]) @ p["w_in"][:, :D])
    if expert_axis:
        # Expert parallel: every token meets every expert; each rank holds E / n of them.
        tokens = jax.lax.all_gather(h, expert_axis, axis=0, tiled=True)
        out = jnp.sum(jnp.tanh(jnp.einsum("td,edf->etf", tokens, p["experts"])), axis=0)
        out = jax.lax.psum_scatter(out, expert_axis, scatter_dimension=0, tiled=True)
    else:
        out = jnp.sum(jnp.tanh(jnp.einsum("td,edf->etf", h, p["experts"])), axis=0)
    return (out + p["b_out"]) @ p["head"]


def moe_loss(p, batch):
    return _mse(_moe(p, batch["x"], "expert"), batch["y"])


def moe_reference_loss(p, batch):
    return _mse(_moe(p, batch["x"], None), batch["y"])


def _scan_params(rng):
    n = lambda *s, scale=0.3: jnp.asarray(rng.normal(size=s) * scale, jnp.float32)
    return {"embed": n(D, D), "blocks": {"w": n(L, D, D), "norm": 1.0 + n(L, D, scale=0.1)}, "head": n(D, C)}


def scan_loss(p, batch):
    def layer(h, block):
        return jnp.tanh((h * block["norm"]) @ block["w"]) + h, None

    h, _ = jax.lax.scan(layer, batch["x"] @ p["embed"], p["blocks"])
    return _mse(h @ p["head"], batch["y"])


def _scan_mlp(p, batch, model_axis):
    """A scanned stack of Megatron MLPs with a tied weight: ``w`` column-parallel in, its
    transpose row-parallel out (one ``psum`` over ``model_axis`` per layer on local blocks)."""
    def layer(h, block):
        y = jnp.tanh((h * block["norm"]) @ block["w"]) @ block["w"].T
        return h + (jax.lax.psum(y, model_axis) if model_axis else y), None

    h, _ = jax.lax.scan(layer, batch["x"] @ p["embed"], p["blocks"])
    return _mse(h @ p["head"], batch["y"])


def tp_scan_loss(p, batch):
    return _scan_mlp(p, batch, "model")


def scan_mlp_reference_loss(p, batch):
    return _scan_mlp(p, batch, None)


SCAN_SPECS = {"embed": None, "head": None, "blocks": {"w": P(None, None, "model"), "norm": None}}


@dataclasses.dataclass(frozen=True)
class Case:
    params: Callable[[np.random.Generator], Any]
    loss: Callable
    reference_loss: Callable
    mesh: tuple[tuple[int, ...], tuple[str, ...]]
    config: dict

    @property
    def additions(self) -> int:
        """Roundings on the longest chain of one gradient element of the one-device loss, then
        the devices' and micro-batches' sums."""
        params, batch = self.params(np.random.default_rng(0)), _batches(0, 1)[0]
        return rounding_chain(jax.grad(self.reference_loss), params, batch) + 8 + self.config.get("microbatches", 1)


CASES = {
    "tensor_parallel": Case(_dense_params, tp_loss, dense_reference_loss, ((4, 2), ("data", "model")),
                            dict(param_specs=TP_SPECS)),
    "replica_data_model": Case(_dense_params, tp_loss, dense_reference_loss,
                               ((2, 2, 2), ("replica", "data", "model")),
                               dict(outer_axis="replica", param_specs=TP_SPECS, microbatches=2)),
    "expert_parallel": Case(_expert_params, moe_loss, moe_reference_loss, ((2, 2, 2), ("data", "expert", "model")),
                            dict(axis=("data", "expert"), expert_axis="data",
                                 expert=lambda path: path.startswith("experts"),
                                 param_specs={**TP_SPECS, "w_in": None, "b_in": None, "w_out": None,
                                              "experts": P("expert")})),
    "expert_parallel_zero3": Case(_expert_params, moe_loss, moe_reference_loss,
                                  ((2, 2, 2), ("data", "expert", "model")),
                                  dict(axis=("data", "expert"), expert_axis="data", shard_params=True,
                                       expert=lambda path: path.startswith("experts"),
                                       param_specs={**TP_SPECS, "w_in": None, "b_in": None, "w_out": None,
                                                    "experts": P("expert")})),
    # Expert parallel with the rest on global shapes: the loss's own collectives over "expert" (a
    # data axis, manual), XLA's over "model", which splits the experts too.
    "gspmd_expert": Case(_expert_params, moe_loss, moe_reference_loss, ((2, 2, 2), ("data", "expert", "model")),
                         dict(axis=("data", "expert"), expert_axis="data", tensor_parallel="gspmd",
                              expert=lambda path: path.startswith("experts"),
                              param_specs={**TP_SPECS, "experts": P("expert", None, "model")})),
    "gspmd_expert_zero3": Case(_expert_params, moe_loss, moe_reference_loss, ((2, 2, 2), ("data", "expert", "model")),
                               dict(axis=("data", "expert"), expert_axis="data", tensor_parallel="gspmd",
                                    shard_params=True, microbatches=2, expert=lambda path: path.startswith("experts"),
                                    param_specs={**TP_SPECS, "experts": P("expert", None, "model")})),
    "gspmd": Case(_dense_params, dense_reference_loss, dense_reference_loss, ((4, 2), ("data", "model")),
                  dict(param_specs=TP_SPECS, tensor_parallel="gspmd")),
    "gspmd_split_leaves": Case(_dense_params, dense_reference_loss, dense_reference_loss,
                               ((2, 2, 2), ("replica", "data", "model")),
                               dict(outer_axis="replica", param_specs=TP_SPECS, tensor_parallel="gspmd",
                                    split_leaves=True, microbatches=2)),
    # ZeRO-3 with hand-written tensor parallel: each device holds its shard of its model rank's blocks.
    "tensor_parallel_zero3": Case(_dense_params, tp_loss, dense_reference_loss, ((4, 2), ("data", "model")),
                                  dict(param_specs=TP_SPECS, shard_params=True, split_leaves=True)),
    "replica_data_model_zero3": Case(_dense_params, tp_loss, dense_reference_loss,
                                     ((2, 2, 2), ("replica", "data", "model")),
                                     dict(outer_axis="replica", param_specs=TP_SPECS, microbatches=2,
                                          shard_params=True)),
    "tensor_parallel_split_leaves": Case(_dense_params, tp_loss, dense_reference_loss, ((4, 2), ("data", "model")),
                                         dict(param_specs=TP_SPECS, split_leaves=True)),
    # A scanned stack written for GSPMD, each layer's weight split over "model": every layer's
    # buckets reduced inside the backward scan, on local blocks (the default scan detection).
    "gspmd_scanned": Case(_scan_params, scan_loss, scan_loss, ((4, 2), ("data", "model")),
                          dict(tensor_parallel="gspmd", scan_layers=None, bucket_size=30, param_specs=SCAN_SPECS)),
    # The same stack's gradients reduced after the backward instead, split into several buckets.
    "gspmd_scanned_whole_leaves": Case(_scan_params, scan_loss, scan_loss, ((4, 2), ("data", "model")),
                                       dict(tensor_parallel="gspmd", scan_layers=False, split_leaves=True,
                                            param_specs=SCAN_SPECS)),
    # In the backward scan with an outer axis, micro-batches and a split leaf on the layer chain.
    "gspmd_scanned_outer": Case(_scan_params, scan_loss, scan_loss, ((2, 2, 2), ("replica", "data", "model")),
                                dict(tensor_parallel="gspmd", scan_layers=True, outer_axis="replica",
                                     microbatches=2, split_leaves=True, param_specs=SCAN_SPECS)),
    # A scanned stack with hand-written tensor parallel: each layer's buckets reduced in the backward scan.
    "tensor_parallel_scanned": Case(_scan_params, tp_scan_loss, scan_mlp_reference_loss,
                                    ((2, 2, 2), ("replica", "data", "model")),
                                    dict(scan_layers=True, outer_axis="replica", microbatches=2, split_leaves=True,
                                         param_specs=SCAN_SPECS)),
    "tensor_parallel_scanned_zero3": Case(_scan_params, tp_scan_loss, scan_mlp_reference_loss,
                                          ((4, 2), ("data", "model")),
                                          dict(scan_layers=True, shard_params=True, bucket_size=30,
                                               param_specs=SCAN_SPECS)),
    "scanned_outer": Case(_scan_params, scan_loss, scan_loss, ((2, 4), ("replica", "data")),
                          dict(outer_axis="replica", scan_layers=True, microbatches=2)),
}


def _batches(seed: int, n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(BATCH, D)).astype(np.float32),
             "y": rng.normal(size=(BATCH, C)).astype(np.float32)} for _ in range(n)]


def _reference(case: Case, params, batches, tx=None):
    """Plain optax on one device over the whole batches: the final params, each step's loss and
    gradient."""
    return reference_run(case.reference_loss, params, tx or _reference_tx(), batches)


def trajectory_bounds(case: Case, params, gradients) -> list:
    """Per step, how far a run of ``_tx()`` may be from the reference by rounding alone."""
    return adam_rounding_bounds(gradients, additions=case.additions, learning_rate=LR, params=params,
                                max_norm=MAX_NORM, weight_decay=WD)


def _step(case: Case, params, batch, cpu_devices, tx=None) -> jd.TrainStep:
    shape, names = case.mesh
    mesh = Mesh(np.array(cpu_devices).reshape(shape), names)
    config = jd.TrainConfig(**{"bucket_size": 60, **case.config})
    return jd.make_train_step(params, case.loss, tx or _tx(), mesh, config, example_batch=batch)


def _trained(step: jd.TrainStep, state: jd.TrainState) -> Any:
    """The trained parameter tree on the host (ZeRO-3: gathered from the shards)."""
    return step.master_params(state) if step.config.shard_params else jax.device_get(state.params)


@pytest.mark.parametrize("kind", list(CASES))
def test_trains_like_optax_on_one_device_and_resumes_bit_for_bit(kind, cpu_devices, tmp_path):
    case = CASES[kind]
    params = case.params(np.random.default_rng(0))
    batches = _batches(1, STEPS + 2)
    step = _step(case, params, batches[0], cpu_devices)
    assert sum(chain.num_buckets for chain in step.sync.chains) > 2  # several buckets, drained
    # A scanned stack (found, or named) syncs each layer inside the backward scan.
    assert step.scan_layers == (case.config.get("scan_layers", False) is not False)

    state = step.init(params)
    losses = []
    for batch in batches[:STEPS]:
        state, metrics = step(state, batch)
        losses.append(float(metrics.loss))
    want, _, gradients = _reference(case, params, batches[:STEPS])
    assert_within(_trained(step, state), want, trajectory_bounds(case, params, gradients)[-1],
                  what=f"{kind} after {STEPS} AdamW steps")
    assert losses[-1] < losses[0]

    assert_resumes_bit_for_bit(case, params, step, state, batches, cpu_devices, tmp_path)


def assert_resumes_bit_for_bit(case, params, step, state, batches, cpu_devices, tmp_path):
    """Saved after STEPS and run on: a fresh step restored from disk gives the same losses."""
    jd.save_checkpoint(tmp_path / "ckpt", state)
    continued = []
    for batch in batches[STEPS:]:
        state, metrics = step(state, batch)
        continued.append(float(metrics.loss))
    fresh = _step(case, params, batches[0], cpu_devices)
    restored, _ = jd.restore_checkpoint(tmp_path / "ckpt", fresh.abstract_state())
    resumed = []
    for batch in batches[STEPS:]:
        restored, metrics = fresh(restored, batch)
        resumed.append(float(metrics.loss))
    assert resumed == continued


@pytest.mark.parametrize("kind", list(CASES))
def test_global_norm_counts_every_element_once(kind, cpu_devices):
    """Clipped SGD moves the params by exactly ``lr * max_norm * g / |g|``: the global norm
    over shards (tensor-parallel replicas once, outer replicas once, experts summed) is |g|."""
    case = CASES[kind]
    params = case.params(np.random.default_rng(2))
    (batch,) = _batches(3, 1)
    step = _step(case, params, batch, cpu_devices, tx=optax.chain(jd.clip_by_global_norm(1e-3), optax.sgd(1.0)))
    state, _ = step(step.init(params), batch)
    want, _, _ = _reference(case, params, [batch], tx=optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0)))
    moved = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), _trained(step, state),
                         params)
    expected = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), want, params)
    norm = lambda t: np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(t)))
    # One clipped SGD step moves by 1e-3 g / |g|: the gradient's roundings relative to the move,
    # and the float32 parameter's own rounding when the move is added to it; a norm of moves
    # each within its bound is within the bounds' norm (triangle inequality).
    bound = jax.tree.map(lambda p: rounding_bound(case.additions, 1e-3) + rounding_bound(1, np.abs(p)), params)
    assert abs(norm(expected) - 1e-3) <= norm(bound) and abs(norm(moved) - 1e-3) <= norm(bound)
    assert_within(moved, expected, bound, what="clipped SGD move")


@pytest.mark.parametrize("kind", ["tensor_parallel_zero3", "replica_data_model_zero3"])
def test_shard_params_with_hand_written_tensor_parallel_holds_its_blocks_shard(kind, cpu_devices):
    """ZeRO-3 with the loss on local blocks: parameter, master and optimizer shards are split
    over the data axes and the model axis (replicated over the outer axis), so a device holds
    1/(data x model) of the tensor-parallel weights and 1/data of the model-replicated leaves
    (each model rank's buckets hold its own copy)."""
    case = CASES[kind]
    params = case.params(np.random.default_rng(0))
    step = _step(case, params, _batches(0, 1)[0], cpu_devices)
    state = step.init(params)
    shape, names = case.mesh
    data = int(np.prod([n for n, a in zip(shape, names) if a == "data"]))
    model = dict(zip(names, shape))["model"]
    for x in (*state.params.shards, *state.opt_state.master,
              *[leaf for leaf in jax.tree.leaves(state.opt_state.inner) if leaf.ndim]):
        assert {s.data.shape for s in x.addressable_shards} == {(x.shape[0] // (data * model),)}, x.sharding
    held = sum(x.addressable_shards[0].data.size for x in state.params.shards)
    split = sum(int(np.prod(x.shape)) for x, spec in zip(jax.tree.leaves(params), jax.tree.leaves(
        TP_SPECS, is_leaf=lambda s: s is None or isinstance(s, P))) if spec is not None)
    replicated = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) - split
    padding = sum(size - sum(p.size for p in b.pieces)
                  for b, size in zip(step.sync.chains[0].layout.buckets, step.sync.bucket_sizes))
    assert held * data * model == split + replicated * model + padding * model


def test_scan_layers_on_a_tensor_parallel_mesh(cpu_devices):
    """With hand-written tensor parallel, scan_layers=None finds a scanned stack on the loss's
    local blocks (the tensor_parallel_scanned cases) and keeps whole-leaf buckets without one;
    expert params are refused for a scanned stack."""
    with pytest.raises(ValueError, match="does not support expert params"):
        jd.TrainConfig(scan_layers=True, param_specs=TP_SPECS, expert=lambda path: False)
    case = CASES["tensor_parallel_scanned"]
    params = case.params(np.random.default_rng(0))
    mesh = Mesh(np.array(cpu_devices).reshape(2, 2, 2), ("replica", "data", "model"))
    config = jd.TrainConfig(**{**case.config, "scan_layers": None})
    step = jd.make_train_step(params, case.loss, _tx(), mesh, config, example_batch=_batches(0, 1)[0])
    assert step.scan_layers and isinstance(step.sync, jd.ScanGradSync)
    case = CASES["tensor_parallel"]
    params = case.params(np.random.default_rng(0))
    mesh = Mesh(np.array(cpu_devices).reshape(4, 2), ("data", "model"))
    step = jd.make_train_step(params, case.loss, _tx(), mesh, jd.TrainConfig(scan_layers=None, param_specs=TP_SPECS),
                              example_batch=_batches(0, 1)[0])
    assert not step.scan_layers and isinstance(step.sync, jd.GradSync)
