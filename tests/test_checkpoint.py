"""Orbax checkpoints of a TrainState: round trip, bit-identical resume, mismatches refused with
nothing written, damaged arrays refused (the newest intact step restored), restores onto another
mesh or bucket size, asynchronous and atomic saves."""

import dataclasses
import functools
import hashlib
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import jax_drain as jd
from conftest import data_mesh
from helpers import adam_rounding_bounds, assert_within, loss_rounding_bounds, reference_run, rounding_chain
from jax_drain import checkpoint
from jax_drain._relayout import LocalBlocks, SavedArrays
from jax_drain.checkpoint import latest_step
from jax_drain.models import GPT, GPTConfig

CONFIG = GPTConfig(num_layers=1, d_model=32, num_heads=2, seq_len=8, vocab_size=40,
                   param_dtype=jnp.bfloat16, remat=False)


def _tx():
    return optax.chain(jd.clip_by_global_norm(1.0), optax.adamw(1e-2, b2=0.95))


def _fresh_step(config=CONFIG, bucket_size=2000):
    """What a new process does: build the model and the step from scratch."""
    model = GPT(config, rngs=nnx.Rngs(0))
    return jd.make_train_step(model, lambda m, b: m.loss(b), _tx(), data_mesh(8),
                              jd.TrainConfig(bucket_size=bucket_size, microbatches=2),
                              example_batch=_batch(0))


def _batch(i):
    rng = np.random.default_rng([7, i])  # a pure function of the step: resumable data
    return {"tokens": rng.integers(0, CONFIG.vocab_size, size=(16, CONFIG.seq_len + 1)).astype(np.int32)}


def _snapshot(directory: pathlib.Path) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """2 steps, a checkpoint, 3 more steps: the uninterrupted run's losses after the save."""
    directory = tmp_path_factory.mktemp("ckpt")
    step = _fresh_step()
    state = step.init()
    for i in range(2):
        state, _ = step(state, _batch(i))
    saved = jax.device_get(state)  # host copy, for the round-trip check (the step donates state)
    jd.save_checkpoint(directory, state, extra={"data_position": 2})
    losses = []
    for i in range(2, 5):
        state, metrics = step(state, _batch(i))
        losses.append(float(metrics.loss))
    return directory, step, saved, losses


def test_round_trip(run):
    directory, step, saved, _ = run
    assert latest_step(directory) == 2
    state, extra = jd.restore_checkpoint(directory, step.abstract_state())
    assert extra == {"data_position": 2}
    assert jax.tree.structure(state) == jax.tree.structure(saved)
    assert state.opt_state.fingerprint == step.optimizer.fingerprint
    for got, want, target in zip(jax.tree.leaves(state), jax.tree.leaves(saved), jax.tree.leaves(step.abstract_state())):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding.is_equivalent_to(target.sharding, got.ndim)
    assert state.opt_state.master[0].sharding.spec == jax.sharding.PartitionSpec("data")
    step.optimizer.check_state(state.opt_state)


def test_resume_gives_bit_identical_losses(run):
    directory, _, _, uninterrupted = run
    step = _fresh_step()
    state, extra = jd.restore_checkpoint(directory, step.abstract_state())
    losses = []
    for i in range(extra["data_position"], 5):
        state, metrics = step(state, _batch(i))
        losses.append(float(metrics.loss))
    assert losses == uninterrupted
    assert int(state.step) == 5


def test_mismatches_are_refused_and_nothing_is_written(run, tmp_path):
    directory, step, _, _ = run
    before = _snapshot(directory)

    wider = _fresh_step(dataclasses.replace(CONFIG, d_model=48))
    with pytest.raises(jd.CheckpointMismatchError, match=r"'params/blocks/0/attn/out/kernel' is bfloat16\[32, 32\] in the checkpoint, bfloat16\[48, 48\] here"):
        jd.restore_checkpoint(directory, wider.abstract_state())
    deeper = _fresh_step(dataclasses.replace(CONFIG, num_layers=2))
    with pytest.raises(jd.CheckpointMismatchError, match="leaves missing from the checkpoint"):
        jd.restore_checkpoint(directory, deeper.abstract_state())

    with pytest.raises(jd.CheckpointMismatchError, match="different model.*Nothing was written"):
        jd.save_checkpoint(directory, wider.init())
    state, _ = jd.restore_checkpoint(directory, step.abstract_state())
    with pytest.raises(FileExistsError, match="already has step 2; nothing was overwritten"):
        jd.save_checkpoint(directory, state)
    with pytest.raises(TypeError):
        jd.save_checkpoint(directory, state, step=9, extra={"bad": object()})
    assert _snapshot(directory) == before

    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        jd.restore_checkpoint(tmp_path, step.abstract_state())
    with pytest.raises(FileNotFoundError, match="has no step 3"):
        jd.restore_checkpoint(directory, step.abstract_state(), step=3)
    no_shardings = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), step.abstract_state())
    with pytest.raises(ValueError, match="has no sharding"):
        jd.restore_checkpoint(directory, no_shardings)
    assert _snapshot(directory) == before


# -- integrity: checksums, the newest intact step -------------------------------------------------


def _flip_bytes(path, count=16):
    data = bytearray(path.read_bytes())
    for i in range(count):
        data[(len(data) // 2 + 7 * i) % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_array_file_is_refused_and_the_previous_step_restored(run, tmp_path):
    directory, step, saved, _ = run
    copy = tmp_path / "ckpt"
    shutil.copytree(directory, copy)
    state, _ = jd.restore_checkpoint(copy, step.abstract_state())
    jd.save_checkpoint(copy, state, step=3)
    moments = [p for p in (copy / "3" / "state").iterdir() if "mu" in p.name and p.is_dir()]
    chunk = next(f for f in sorted(moments[0].iterdir()) if not f.name.startswith("."))
    _flip_bytes(chunk)
    with pytest.raises(jd.CheckpointCorruptError, match=rf"array 'opt_state/inner/.*mu.*' \(file {re.escape(str(moments[0]))}\)"):
        jd.restore_checkpoint(copy, step.abstract_state(), step=3)
    with pytest.warns(UserWarning, match="Trying the previous step"):
        restored, extra = jd.restore_checkpoint(copy, step.abstract_state())
    assert extra == {"data_position": 2} and int(restored.step) == 2
    for a, b in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(a, b)


# -- moving: another data-axis size, bucket size or mesh ------------------------------------------

D, H = 8, 16
TP_SPECS = {"w_in": P(None, "model"), "w_out": P("model", None), "norm": None}


def _tp_loss(p, batch, model_axis="model"):
    h = jnp.tanh((batch["x"] * p["norm"]) @ p["w_in"])
    y = h @ p["w_out"]
    y = jax.lax.psum(y, model_axis) if model_axis else y
    return jnp.mean((y - batch["y"]) ** 2)


def _tp_batch(i):
    rng = np.random.default_rng([11, i])
    return {"x": rng.normal(size=(16, D)).astype(np.float32), "y": rng.normal(size=(16, D)).astype(np.float32)}


def _tp_step(shape, names, bucket_size, **config):
    rng = np.random.default_rng(0)
    params = {"w_in": rng.normal(size=(D, H)).astype(np.float32) * 0.3,
              "w_out": rng.normal(size=(H, D)).astype(np.float32) * 0.3, "norm": np.ones(D, np.float32)}
    mesh = Mesh(np.array(jax.devices("cpu")[: int(np.prod(shape))]).reshape(shape), names)
    loss = _tp_loss if "model" in names else functools.partial(_tp_loss, model_axis=None)
    step = jd.make_train_step(params, loss, jd.adamw(1e-2, weight_decay=0.1, max_norm=1.0), mesh,
                              jd.TrainConfig(bucket_size=bucket_size, **config), example_batch=_tp_batch(0))
    return step, params


MOVES = {
    "8_devices_to_4_other_bucket_size": (((8,), ("data",), 60, {}), ((4,), ("data",), 200, {})),
    "tp_data_model_to_replica_data_model": (
        ((4, 2), ("data", "model"), 60, {"param_specs": TP_SPECS}),
        ((2, 2, 2), ("replica", "data", "model"), 100, {"param_specs": TP_SPECS, "outer_axis": "replica"})),
    "tp_to_plain_data_parallel": (((4, 2), ("data", "model"), 60, {"param_specs": TP_SPECS}),
                                  ((8,), ("data",), 40, {})),
}


@pytest.mark.parametrize("move", list(MOVES))
def test_restores_onto_another_mesh_and_bucket_size_and_trains_on(move, tmp_path):
    (shape_a, names_a, size_a, extra_a), (shape_b, names_b, size_b, extra_b) = MOVES[move]
    step_a, params = _tp_step(shape_a, names_a, size_a, **extra_a)
    step_b, _ = _tp_step(shape_b, names_b, size_b, **extra_b)
    assert step_a.optimizer.fingerprint != step_b.optimizer.fingerprint
    state = step_a.init(params)
    for i in range(2):
        state, _ = step_a(state, _tp_batch(i))
    jd.save_checkpoint(tmp_path / "ckpt", state)
    continued = []
    for i in range(2, 5):
        state, metrics = step_a(state, _tp_batch(i))
        continued.append(float(metrics.loss))
    moved, _ = jd.restore_checkpoint(tmp_path / "ckpt", step_b.abstract_state())
    resumed = []
    for i in range(2, 5):
        moved, metrics = step_b(moved, _tp_batch(i))
        resumed.append(float(metrics.loss))
    # From the restored step on, the other mesh adds the gradients in another order: bounded by
    # the one-device run's own gradients (a bound over all 5 steps covers the last 3).
    reference_loss = functools.partial(_tp_loss, model_axis=None)
    batches = [_tp_batch(i) for i in range(5)]
    _, ref_losses, gradients = reference_run(reference_loss, params, jd.adamw(1e-2, weight_decay=0.1, max_norm=1.0),
                                             batches)
    additions = rounding_chain(jax.grad(reference_loss), params, batches[0]) + 8
    bounds = adam_rounding_bounds(gradients, additions=additions, learning_rate=1e-2, params=params, max_norm=1.0,
                                  weight_decay=0.1)
    assert_within(np.asarray(resumed), np.asarray(continued),
                  loss_rounding_bounds(ref_losses, gradients, bounds, additions=additions)[2:], what="losses")
    assert_within(jax.device_get(moved.params), jax.device_get(state.params), bounds[-1], what="params")
    # The moved run saves into the same directory: one model, two layouts.
    jd.save_checkpoint(tmp_path / "ckpt", moved)


class _CountingReads(SavedArrays):
    """Saved arrays that count the elements read from the files."""

    read_elements = 0

    def read(self, path, index=()):
        values = super().read(path, index)
        self.read_elements += values.size
        return values


def test_a_moved_restore_reads_only_the_parameters_a_process_holds(tmp_path):
    """Re-laid onto another bucket size by a process holding 2 of the 8 devices, the optimizer's
    shard sets (master, Adam's mu and nu) are built from reading only the parameters with an
    element in that process's quarter of some target bucket, each once per set, and its blocks
    equal those of a whole restore."""
    rng = np.random.default_rng(3)
    params = {f"w{i:02d}": rng.normal(size=(6, 5)).astype(np.float32) for i in range(12)}

    def loss(p, x):
        return sum(jnp.mean((x @ w) ** 2) for w in p.values())

    def step_with(bucket_size):
        return jd.make_train_step(params, loss, optax.adam(1e-2), data_mesh(8),
                                  jd.TrainConfig(bucket_size=bucket_size), example_batch=np.zeros((16, 6), np.float32))

    saved_step, target_step = step_with(64), step_with(160)
    state, _ = saved_step(saved_step.init(params), rng.normal(size=(16, 6)).astype(np.float32))
    jd.save_checkpoint(tmp_path, state, step=1)
    saved = checkpoint._read_description(tmp_path, 1)
    target = target_step.abstract_state()
    wanted = checkpoint.state_description(target)
    process = target_step.mesh.devices.ravel()[:2]
    blocks = {path: LocalBlocks(shape, leaf.dtype, leaf.sharding, devices=process)
              for (_, path, shape, _), leaf in zip(wanted["leaves"], jax.tree.leaves(target))}
    source = _CountingReads(tmp_path / "1" / "state", saved["leaves"])
    built = {path for paths in checkpoint._relaid(saved, wanted, source, blocks) for path in paths}

    # The process's quarter of each target bucket, and the parameters with a piece there.
    (chain,) = target_step.sync.description
    needed = {piece[0] for _, padded, pieces in chain["buckets"] for piece in pieces
              if piece[3] < 2 * padded // 8}
    assert 0 < len(needed) < len(params)
    sets = checkpoint._shard_sets(wanted)
    assert len(sets) == 3 and built == {p for paths in sets.values() for p in paths}
    assert source.read_elements == len(sets) * sum(params[p].size for p in needed)
    whole, _ = jd.restore_checkpoint(tmp_path, target)
    by_path = {path: leaf for (_, path, *_), leaf in zip(wanted["leaves"], jax.tree.leaves(whole))}
    for path in built:
        for shard in by_path[path].addressable_shards:
            if shard.device in process:
                np.testing.assert_array_equal(blocks[path].block(shard.index), np.asarray(shard.data))


# -- asynchronous, atomic saves -------------------------------------------------------------------


def test_async_save_does_not_hold_the_next_steps_back(tmp_path):
    step, params = _tp_step((8,), ("data",), 60)
    state, _ = step(step.init(params), _tp_batch(0))
    snapshot = jax.device_get(state)
    pending = jd.save_checkpoint_async(tmp_path / "ckpt", state)
    for i in range(1, 3):  # the step donates the state being written
        state, _ = step(state, _tp_batch(i))
    assert pending.wait() == (tmp_path / "ckpt" / "1").absolute() and pending.done()
    restored, _ = jd.restore_checkpoint(tmp_path / "ckpt", step.abstract_state())
    for a, b in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(snapshot)):
        np.testing.assert_array_equal(a, b)


KILLED_SAVER = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import jax.numpy as jnp, jax_drain as jd
state = {"w": jnp.arange(200_000, dtype=jnp.float32), "b": jnp.ones(3)}
jd.save_checkpoint(sys.argv[1], state, step=1)
jd.save_checkpoint_async(sys.argv[1], {"w": state["w"] * 2, "b": state["b"]}, step=2)
os._exit(9)  # killed while step 2 is being written
"""


def test_a_kill_during_a_save_leaves_the_previous_step_restorable(tmp_path):
    result = subprocess.run([sys.executable, "-c", KILLED_SAVER, str(tmp_path / "ckpt")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 9, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Unable to load CUDA" not in result.stderr  # no noise on CPU
    whole = jax.sharding.NamedSharding(Mesh(np.array(jax.devices("cpu")[:1]), ("x",)), P())
    target = {"w": jax.ShapeDtypeStruct((200_000,), jnp.float32, sharding=whole),
              "b": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=whole)}
    state, _ = jd.restore_checkpoint(tmp_path / "ckpt", target)  # step 1, or step 2 if it finished
    w = np.asarray(state["w"])
    assert np.array_equal(w, np.arange(200_000)) or np.array_equal(w, 2 * np.arange(200_000))


# -- checksums any process layout can check ----------------------------------------------------------


def test_array_checksums_do_not_depend_on_the_layout_and_see_every_element():
    """The checksum of an array is the same however it is sharded (so a restore on another mesh
    or process count checks it shard by shard), and a changed or moved element changes it."""
    from jax_drain.checkpoint import _checksums

    rng = np.random.default_rng(0)
    value = rng.normal(size=(16, 6)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    layouts = [value, jnp.asarray(value)] + [jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))
                                             for spec in (P(), P("data"), P("data", "model"), P(None, "model"))]
    sums = {_checksums({"x": x})["x"] for x in layouts}
    assert len(sums) == 1 and sums.pop().startswith("sum64:float32[16, 6]:")
    changed = value.copy()
    changed.view(np.uint32)[7, 3] ^= 1  # one bit of one element
    swapped = value.copy()
    swapped[[2, 9]] = swapped[[9, 2]]  # two rows moved
    base = _checksums({"x": value})["x"]
    assert _checksums({"x": changed})["x"] != base and _checksums({"x": swapped})["x"] != base
    as_bf16 = _checksums({"x": value.astype(jnp.bfloat16)})["x"]
    assert as_bf16.startswith("sum64:bfloat16") and _checksums({"s": np.float32(2.5)})["s"].startswith("sum64:float32[]")
