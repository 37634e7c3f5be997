"""Bucket layout: Megatron's bucketing rules, dtype separation, flatten/unflatten, the table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_drain.layout import BucketLayout
from helpers import random_tree

W, B = 95 * 95, 95


def megatron_test_model():
    """Megatron's test model: ten 95x95 Linear layers with biases (global shapes)."""
    params = [
        {"weight": jax.ShapeDtypeStruct((95, 95), jnp.float32), "bias": jax.ShapeDtypeStruct((95,), jnp.float32)}
        for _ in range(10)
    ]
    # Leaves are [bias0, weight0, bias1, ...] (sorted keys); PyTorch registers weight then
    # bias and Megatron takes the reverse: bias9, weight9, bias8, ..., weight0.
    index = {(layer, name): 2 * layer + (name == "weight") for layer in range(10) for name in ("bias", "weight")}
    order = [index[(layer, name)] for layer in reversed(range(10)) for name in ("bias", "weight")]
    return params, order


# Hand-derived from "a bucket closes once it holds >= bucket_size elements", the sequence
# B9 W9 B8 W8 ... B0 W0 (B=95, W=9025, total 91200), and padding to lcm(axis_size, 128).
EXPECTED = {
    # bucket_size: (unpadded bucket element counts, padded at multiple 128, padded at multiple 384)
    None: ([91200], [91264], [91392]),
    100_000: ([91200], [91264], [91392]),
    9000: ([B + W] * 10, [9216] * 10, [9216] * 10),
    9025: ([B + W] * 10, [9216] * 10, [9216] * 10),
    9121: ([2 * B + W, 2 * W + B] * 3 + [B + W], [9216, 18176] * 3 + [9216], [9216, 18432] * 3 + [9216]),
    18000: ([2 * (B + W)] * 5, [18304] * 5, [18432] * 5),
    1: ([B, W] * 10, [128, 9088] * 10, [384, 9216] * 10),
}


@pytest.mark.parametrize("bucket_size", list(EXPECTED))
@pytest.mark.parametrize("axis_size", [1, 2, 6, 8])
def test_megatron_bucket_sizes(bucket_size, axis_size):
    params, order = megatron_test_model()
    multiple = int(np.lcm(axis_size, 128))
    layout = BucketLayout.build(params, bucket_size, shard_multiple=multiple, order=order)
    unpadded, padded128, padded384 = EXPECTED[bucket_size]
    assert [b.num_elements for b in layout.buckets] == unpadded
    assert list(layout.bucket_sizes) == (padded384 if multiple == 384 else padded128)
    assert all(size % axis_size == 0 for size in layout.bucket_sizes)
    # A leaf is never split, every leaf is placed once, leaves are packed in ready order.
    placed = [i for b in layout.buckets for i in b.leaves]
    assert placed == order
    for b in layout.buckets:
        offsets = [layout.slots[i].offset for i in b.leaves]
        sizes = [layout.slots[i].size for i in b.leaves]
        assert offsets == list(np.cumsum([0] + sizes[:-1]))


def test_default_order_is_reverse_leaf_order():
    params, _ = megatron_test_model()
    layout = BucketLayout.build(params, bucket_size=1)
    assert [b.leaves[0] for b in layout.buckets] == list(reversed(range(20)))


def test_dtypes_never_share_a_bucket_and_buckets_are_in_dispatch_order():
    params = {
        "a": jax.ShapeDtypeStruct((300,), jnp.bfloat16),
        "b": jax.ShapeDtypeStruct((300,), jnp.float32),
        "c": jax.ShapeDtypeStruct((300,), jnp.bfloat16),
        "d": jax.ShapeDtypeStruct((50,), jnp.float32),
    }
    # Ready order: d, c, b, a. bf16 closes after c+a (600 >= 500) at a; f32 (d, b) = 350 stays open.
    layout = BucketLayout.build(params, bucket_size=500, order=[3, 2, 1, 0])
    assert [(str(b.dtype), b.leaves) for b in layout.buckets] == [("bfloat16", (2, 0)), ("float32", (3, 1))]
    # Leftover buckets close in the order of their last leaf: f32's last leaf (b) precedes a.
    layout = BucketLayout.build(params, bucket_size=10_000, order=[3, 2, 1, 0])
    assert [b.leaves for b in layout.buckets] == [(3, 1), (2, 0)]


def test_flatten_unflatten_round_trip_on_random_data():
    rng = np.random.default_rng(0)
    template = {
        "emb": jax.ShapeDtypeStruct((37, 11), jnp.bfloat16),
        "blocks": [{"w": jax.ShapeDtypeStruct((11, 13), jnp.bfloat16), "s": jax.ShapeDtypeStruct((13,), jnp.float32)}] * 3,
    }
    tree = random_tree(rng, template)
    layout = BucketLayout.build(tree, bucket_size=200, shard_multiple=8 * 128)
    buckets = layout.flatten(tree)
    assert [b.shape for b in buckets] == [(s,) for s in layout.bucket_sizes]
    assert [b.dtype for b in buckets] == [b.dtype for b in layout.buckets]
    for array, bucket in zip(buckets, layout.buckets):  # padding is zero
        np.testing.assert_array_equal(np.asarray(array[bucket.num_elements :], np.float32), 0)
    back = layout.unflatten(buckets)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    as_f32 = layout.flatten(tree, dtype=jnp.float32)
    assert all(b.dtype == jnp.float32 for b in as_f32)


def test_table_lists_every_leaf_and_padding():
    params, order = megatron_test_model()
    layout = BucketLayout.build(params, 18000, shard_multiple=128, order=order)
    table = layout.table()
    lines = table.splitlines()
    assert lines[0].split() == ["bucket", "dtype", "offset", "size", "leaf"]
    assert len(lines) == 1 + 20 + 5
    assert "9/bias" in lines[1] and lines[1].split()[:4] == ["0", "float32", "0", "95"]
    assert lines[5].split()[:4] == ["0", "float32", "18240", "64"] and "<padding>" in lines[5]


def test_bad_inputs():
    params = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    with pytest.raises(ValueError, match="bucket_size must be a positive"):
        BucketLayout.build(params, 0)
    with pytest.raises(TypeError, match="leaf 'step' has dtype int32"):
        BucketLayout.build({"step": jax.ShapeDtypeStruct((), jnp.int32), **params}, 10)
    with pytest.raises(ValueError, match="permutation of the 1 leaf"):
        BucketLayout.build(params, 10, order=[1])
    with pytest.raises(ValueError, match="no leaves"):
        BucketLayout.build({}, 10)
    layout = BucketLayout.build(params, 10)
    with pytest.raises(ValueError, match="structure differs"):
        layout.flatten({"v": jnp.ones((4, 4))})
    with pytest.raises(ValueError, match="has shape \\(4, 5\\)"):
        layout.flatten({"w": jnp.ones((4, 5))})
    with pytest.raises(TypeError, match="has dtype bfloat16"):
        layout.flatten({"w": jnp.ones((4, 4), jnp.bfloat16)})
    with pytest.raises(ValueError, match="pass whole buckets"):
        layout.unflatten([jnp.ones(16)])
