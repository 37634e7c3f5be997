"""Split leaves: buckets of exactly bucket_size elements, a leaf split at bucket boundaries.

Values against float64 references from the leaves themselves, the round trip, the same drained
result as whole-leaf buckets (bit for bit in fp32 mode), the optimizer (masks and clipping over
split leaves) and a checkpoint that moves between a split and a whole-leaf layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import data_mesh
from helpers import adam_rounding_bounds, assert_within, assert_within_rounding, reference_run, rounding_chain
from jax.sharding import PartitionSpec as P

import jax_drain as jd
from jax_drain import _compat

SDS = jax.ShapeDtypeStruct
# A 37x29 "embedding" (1073 elements) spans several 256-element buckets; small leaves around it.
TREE = {"embed": SDS((37, 29), jnp.float32), "norm": SDS((29,), jnp.float32), "w": SDS((29, 13), jnp.float32),
        "b": SDS((13,), jnp.float32)}


def test_layout_splits_leaves_into_buckets_of_exactly_bucket_size():
    layout = jd.BucketLayout.build(TREE, 256, shard_multiple=8, split_leaves=True)
    sizes = [b.num_elements for b in layout.buckets]
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(TREE))
    assert sizes[:-1] == [256] * (len(sizes) - 1) and sum(sizes) == total
    assert layout.split
    embed_pieces = [p for b in layout.buckets for p in b.pieces if layout.slots[p.leaf].path == "embed"]
    assert len(embed_pieces) >= 4 and sum(p.size for p in embed_pieces) == 37 * 29
    assert "embed[" in layout.table()  # the table shows the slices
    whole = jd.BucketLayout.build(TREE, 256, shard_multiple=8)
    assert not whole.split and max(b.num_elements for b in whole.buckets) >= 37 * 29
    rng = np.random.default_rng(0)
    tree = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), TREE)
    for a, b in zip(jax.tree.leaves(layout.unflatten(layout.flatten(tree))), jax.tree.leaves(tree)):
        np.testing.assert_array_equal(a, b)
    # The pieces hold the leaf's flat elements in order, at their offsets.
    buckets = layout.flatten(tree)
    for bucket, array in zip(layout.buckets, buckets):
        for p in bucket.pieces:
            leaf = np.ravel(jax.tree.leaves(tree)[p.leaf])
            np.testing.assert_array_equal(array[p.offset:p.offset + p.size], leaf[p.start:p.start + p.size])


def _reduce(sync, stacked):
    fn = _compat.shard_map(lambda g: sync.reduce_scatter(jax.tree.map(lambda x: x[0], g)), mesh=sync.mesh,
                           in_specs=P("data"), out_specs=sync.shard_specs())
    return sync.unflatten(jax.jit(fn)(stacked))


@pytest.mark.parametrize("reduce", ["fp32", "fp32_accum", "fp32_accum_streamed"])
def test_split_sync_equals_float64_and_whole_leaf_buckets(reduce):
    rng = np.random.default_rng(1)
    scale = {"embed": 1.0, "norm": 1e-3, "w": 30.0, "b": 1e-2}
    stacked = {k: jnp.asarray(rng.normal(size=(8, *s.shape)) * scale[k], jnp.float32) for k, s in TREE.items()}
    split = jd.GradSync(TREE, data_mesh(8), bucket_size=256, reduce=reduce, split_leaves=True)
    whole = jd.GradSync(TREE, data_mesh(8), bucket_size=256, reduce=reduce)
    assert split.num_buckets > whole.num_buckets
    got, same = _reduce(split, stacked), _reduce(whole, stacked)
    for k in TREE:
        want = np.asarray(stacked[k], np.float64).mean(axis=0)
        magnitude = np.abs(np.asarray(stacked[k], np.float64)).mean(axis=0)  # the 8-term sum's scale
        assert_within_rounding(got[k], want, additions=8, scale=magnitude, what=f"{k} vs float64")
        if reduce == "fp32":
            np.testing.assert_array_equal(got[k], same[k])  # the same sums, bucketed differently
        else:
            assert_within_rounding(got[k], same[k], additions=8, scale=magnitude, what=f"{k}, split vs whole")


def test_optimizer_masks_and_clip_over_split_leaves_match_optax():
    rng = np.random.default_rng(2)
    params = {k: jnp.asarray(rng.normal(size=s.shape), jnp.float32) for k, s in TREE.items()}
    batches = [{"x": rng.normal(size=(16, 37)).astype(np.float32), "y": rng.normal(size=(16, 13)).astype(np.float32)}
               for _ in range(3)]

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["embed"] * p["norm"])
        return jnp.mean((h @ p["w"] + p["b"] - b["y"]) ** 2)

    decay = lambda p: {"embed": True, "norm": False, "w": True, "b": False}
    tx = lambda: jd.adamw(1e-2, weight_decay=0.1, mask=decay, max_norm=0.1)
    ref_tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2, weight_decay=0.1, mask=decay))
    step = jd.make_train_step(params, loss, tx(), data_mesh(8), jd.TrainConfig(bucket_size=256, split_leaves=True),
                              example_batch=batches[0])
    assert step.sync.layout.split
    state = step.init()
    for b in batches:
        state, _ = step(state, b)
    ref, _, gradients = reference_run(loss, params, ref_tx, batches)
    bounds = adam_rounding_bounds(gradients, additions=rounding_chain(jax.grad(loss), params, batches[0]) + 8,
                                  learning_rate=1e-2, params=params, max_norm=0.1, weight_decay=0.1)
    assert_within(jax.device_get(state.params), ref, bounds[-1], what="params")


def test_checkpoint_moves_between_split_and_whole_leaf_layouts(tmp_path):
    rng = np.random.default_rng(3)
    params = {k: jnp.asarray(rng.normal(size=s.shape), jnp.float32) for k, s in TREE.items()}
    batch = {"x": rng.normal(size=(16, 37)).astype(np.float32), "y": rng.normal(size=(16, 13)).astype(np.float32)}
    loss = lambda p, b: jnp.mean((jnp.tanh(b["x"] @ p["embed"] * p["norm"]) @ p["w"] + p["b"] - b["y"]) ** 2)
    make = lambda split: jd.make_train_step(params, loss, optax.adam(1e-2), data_mesh(8),
                                            jd.TrainConfig(bucket_size=256, split_leaves=split), example_batch=batch)
    split, whole = make(True), make(False)
    state, _ = split(split.init(), batch)
    jd.save_checkpoint(tmp_path / "ckpt", state)
    a, _ = split(state, batch)
    moved, _ = jd.restore_checkpoint(tmp_path / "ckpt", whole.abstract_state())
    b, _ = whole(moved, batch)
    # The second step's gradient is summed in other buckets: Adam's bound for two steps.
    _, _, gradients = reference_run(loss, params, optax.adam(1e-2), [batch, batch])
    bounds = adam_rounding_bounds(gradients, additions=rounding_chain(jax.grad(loss), params, batch) + 8,
                                  learning_rate=1e-2, params=params)
    assert_within(jax.device_get(a.params), jax.device_get(b.params), bounds[-1], what="params")


def test_scanned_layers_split_per_layer():
    """ScanGradSync(split_leaves=True): one layer's slice of a large stacked leaf spans several
    buckets inside the backward scan; the mean gradient equals the whole-leaf sync's."""
    rng = np.random.default_rng(4)
    L, D = 3, 24
    params = {"blocks": {"w": jnp.asarray(rng.normal(size=(L, D, D)) * 0.3, jnp.float32),
                         "g": jnp.asarray(1 + rng.normal(size=(L, D)) * 0.1, jnp.float32)},
              "head": jnp.asarray(rng.normal(size=(D, 5)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(16, D)), jnp.float32)

    def loss(p, x):
        h, _ = jax.lax.scan(lambda h, b: (jnp.tanh((h * b["g"]) @ b["w"]) + h, None), x, p["blocks"])
        return jnp.mean((h @ p["head"]) ** 2)

    def grads(split):
        sync = jd.ScanGradSync(params, data_mesh(8), stacked=lambda path: path.startswith("blocks/"),
                               bucket_size=256, reduce="fp32", split_leaves=split)
        fn = _compat.shard_map(sync.value_and_grad(loss), mesh=sync.mesh, in_specs=(P(), P("data")),
                               out_specs=(P(), sync.shard_specs()))
        return sync, sync.unflatten(jax.jit(fn)(params, x)[1])

    split_sync, split = grads(True)
    whole_sync, whole = grads(False)
    assert split_sync.layer_layout.split and len(split_sync.layer_bucket_sizes) > len(whole_sync.layer_bucket_sizes)
    want = jax.grad(loss)(params, x)
    for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(whole)):
        np.testing.assert_array_equal(a, b)  # fp32 sums, bucketed differently
    assert_within_rounding(split, want, additions=rounding_chain(jax.grad(loss), params, x) + 8, what="vs one device")
