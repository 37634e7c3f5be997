"""Orbax checkpoints of a TrainState: round trip, bit-identical resume, mismatches refused with
nothing written."""

import dataclasses
import hashlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_drain as jd
from conftest import data_mesh
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
