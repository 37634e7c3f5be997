"""Bucket layout: Megatron's bucketing rules, dtype separation, flatten/unflatten, the table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_drain.layout import BucketLayout, leaf_paths
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


# Odd sizes, both dtypes: leaves a, b, c/0, c/1, c/2, d, e in jax.tree.leaves order.
PLACED = {
    "a": jax.ShapeDtypeStruct((3, 5, 7), jnp.float32),
    "b": jax.ShapeDtypeStruct((13,), jnp.bfloat16),
    "c": [jax.ShapeDtypeStruct((7,), jnp.float32), jax.ShapeDtypeStruct((97,), jnp.bfloat16),
          jax.ShapeDtypeStruct((11, 13), jnp.float32)],
    "d": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16),
    "e": jax.ShapeDtypeStruct((29,), jnp.float32),
}


def _documented_placement(sizes, dtypes, bucket_size, multiple, order):
    """The module docstring's rule, computed here: leaves in ready order, one open bucket per
    dtype, a bucket closes once it holds >= bucket_size elements, leftover buckets close in the
    order of their last leaf, each padded to a multiple. Returns (members per bucket, leaf ->
    (bucket, offset), padded sizes)."""
    open_buckets, closed = {}, []
    for i in order:
        members = open_buckets.setdefault(dtypes[i], [])
        members.append(i)
        if bucket_size is not None and sum(sizes[j] for j in members) >= bucket_size:
            closed.append(open_buckets.pop(dtypes[i]))
    rank = {leaf: k for k, leaf in enumerate(order)}
    closed += sorted(open_buckets.values(), key=lambda members: rank[members[-1]])
    place, padded = {}, []
    for b, members in enumerate(closed):
        offset = 0
        for i in members:
            place[i] = (b, offset)
            offset += sizes[i]
        padded.append(max(multiple, -(-offset // multiple) * multiple))
    return closed, place, padded


def _pattern(k: int, shape, dtype) -> np.ndarray:
    """Leaf k's recognisable values, exact in its dtype and distinct across leaves and positions:
    (k + 1) * 1000 + position in float32; in bf16 (<= 128 elements) the mantissa holds the
    position and the exponent the leaf."""
    size = int(np.prod(shape))
    if dtype == jnp.float32:
        values = (k + 1) * 1000.0 + np.arange(size)
    else:
        assert size <= 128, "bf16 patterns hold up to 128 positions"
        values = (128.0 + np.arange(size)) * 2.0 ** (k - 20)
    return values.reshape(shape)


def test_hand_derived_placement_of_odd_mixed_leaves():
    # Default order (reverse leaves): e, d, c/2, c/1, c/0, b, a. bucket_size=100:
    # f32 e(29) + c/2(143) = 172 closes bucket 0; bf16 d(6) + c/1(97) = 103 closes bucket 1;
    # f32 c/0(7) + a(105) = 112 closes bucket 2; bf16 b(13) is left over: bucket 3.
    layout = BucketLayout.build(PLACED, bucket_size=100, shard_multiple=128)
    got = {s.path: (s.bucket, s.offset) for s in layout.slots}
    assert got == {"e": (0, 0), "c/2": (0, 29), "d": (1, 0), "c/1": (1, 6), "c/0": (2, 0), "a": (2, 7),
                   "b": (3, 0)}
    assert [b.num_elements for b in layout.buckets] == [172, 103, 112, 13]
    assert list(layout.bucket_sizes) == [256, 128, 128, 128]
    assert [str(b.dtype) for b in layout.buckets] == ["float32", "bfloat16", "float32", "bfloat16"]


@pytest.mark.parametrize("bucket_size", [None, 1, 50, 100, 1000])
@pytest.mark.parametrize("multiple", [128, 384])
@pytest.mark.parametrize("order", [None, "forward", "shuffled"])
def test_flatten_puts_each_leaf_where_the_table_says(bucket_size, multiple, order):
    """flatten/unflatten against an independent placement: a wrong but consistent slot in
    both (a round trip cannot see it) fails here."""
    templates = jax.tree.leaves(PLACED)
    n = len(templates)
    ready = {None: list(reversed(range(n))), "forward": list(range(n)),
             "shuffled": [int(i) for i in np.random.default_rng(7).permutation(n)]}[order]
    layout = BucketLayout.build(PLACED, bucket_size, shard_multiple=multiple,
                                order=None if order is None else ready)
    sizes = [int(np.prod(t.shape)) for t in templates]
    dtypes = [np.dtype(t.dtype) for t in templates]
    members, place, padded = _documented_placement(sizes, dtypes, bucket_size, multiple, ready)
    paths = leaf_paths(PLACED)

    # The public description: LeafSlot and every row of the table.
    assert [(s.bucket, s.offset, s.size, s.path) for s in layout.slots] == [
        (*place[i], sizes[i], paths[i]) for i in range(n)]
    rows = [line.split(maxsplit=4) for line in layout.table().splitlines()[1:]]
    expected_rows = []
    for b, leaves in enumerate(members):
        dtype = str(dtypes[leaves[0]])
        expected_rows += [[str(b), dtype, str(place[i][1]), str(sizes[i]), paths[i]] for i in leaves]
        used = sum(sizes[i] for i in leaves)
        expected_rows.append([str(b), dtype, str(used), str(padded[b] - used),
                              f"<padding>  (bucket total {padded[b]})"])
    assert rows == expected_rows

    # flatten puts leaf k's pattern at its documented offset, zeros in the padding.
    tree = jax.tree.unflatten(jax.tree.structure(PLACED), [
        jnp.asarray(_pattern(k, t.shape, t.dtype), t.dtype) for k, t in enumerate(templates)])
    expected = [np.zeros(size) for size in padded]
    for i in range(n):
        b, offset = place[i]
        expected[b][offset:offset + sizes[i]] = _pattern(i, templates[i].shape, templates[i].dtype).ravel()
    buckets = layout.flatten(tree)
    assert len(buckets) == len(expected)
    for b, (got, want) in enumerate(zip(buckets, expected)):
        assert got.dtype == dtypes[members[b][0]]
        np.testing.assert_array_equal(np.asarray(got, np.float64), want, err_msg=f"bucket {b}")

    # unflatten reads each leaf from its documented place (buckets built here, not by flatten).
    back = layout.unflatten([jnp.asarray(want, dtypes[members[b][0]]) for b, want in enumerate(expected)])
    for k, (path, leaf) in enumerate(zip(paths, jax.tree.leaves(back))):
        assert leaf.shape == templates[k].shape and leaf.dtype == templates[k].dtype, path
        np.testing.assert_array_equal(np.asarray(leaf, np.float64), _pattern(k, templates[k].shape, templates[k].dtype),
                                      err_msg=path)


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


def test_whole_parameter_buckets_close_only_once_balanced_over_the_owners():
    """Leaves of random sizes over 8 owners: every bucket but the last remainder has its fullest
    owner slot within OWNER_BALANCE of the mean, though each reached bucket_size much earlier."""
    from jax_drain.layout import OWNER_BALANCE

    rng = np.random.default_rng(3)
    tree = {f"w{i:02d}": jax.ShapeDtypeStruct((int(rng.integers(20, 60)), 7), jnp.float32) for i in range(60)}
    layout = BucketLayout.build(tree, bucket_size=300, shard_multiple=1, owners=8)
    assert layout.num_buckets >= 3
    for bucket in layout.buckets[:-1]:
        fill = [0] * 8
        for p in bucket.pieces:
            fill[p.offset // (bucket.padded_size // 8)] += p.size
        assert max(fill) * 8 <= OWNER_BALANCE * sum(fill), (bucket.index, fill)


def test_groups_close_a_bucket_at_each_block_end():
    """With ``groups`` no bucket holds two groups' leaves; every bucket but a group's last still
    reaches ``bucket_size``, and without groups the layout is what it was."""
    rng = np.random.default_rng(3)
    sizes = [int(s) for s in rng.integers(50, 400, size=24)]
    tree = [jax.ShapeDtypeStruct((s,), jnp.float32) for s in sizes]
    groups = [i // 6 for i in range(24)]  # four blocks of six leaves, ready in reverse
    plain = BucketLayout.build(tree, bucket_size=700, shard_multiple=8)
    grouped = BucketLayout.build(tree, bucket_size=700, shard_multiple=8, groups=groups)
    one_group = BucketLayout.build(tree, bucket_size=700, shard_multiple=8, groups=[0] * 24)
    assert [(b.pieces, b.padded_size) for b in one_group.buckets] == [(b.pieces, b.padded_size) for b in plain.buckets]
    assert any(len({groups[i] for i in b.leaves}) > 1 for b in plain.buckets)  # the case the option is for
    for b in grouped.buckets:
        assert {groups[i] for i in b.leaves} == {b.group}
    closed_early = [b for b in grouped.buckets if b.num_elements < 700]
    assert len(closed_early) <= 4  # at most each group's last
    assert "group 3" in grouped.table()
    with pytest.raises(ValueError, match="one label per leaf"):
        BucketLayout.build(tree, bucket_size=700, groups=[0])
