"""Bucket layout: which gradient leaf lives where in which flat bucket.

The layout follows Megatron-LM's ``_ParamAndGradBuffer``: leaves are taken in the order their
gradients become ready in backward, a leaf is never split across buckets, a bucket closes as
soon as it holds at least ``bucket_size`` elements, and each bucket is padded so that it splits
evenly over the data-parallel axis (to a multiple of ``lcm(axis_size, 128)`` elements). Leaves
of different dtypes never share a bucket.

Buckets are numbered in *dispatch order*: the order in which they become complete during
backward, which is the order their collectives are issued and chained.

Example:
    >>> import jax.numpy as jnp
    >>> params = {"w": jnp.zeros((95, 95)), "b": jnp.zeros((95,))}
    >>> layout = BucketLayout.build(params, bucket_size=9000, shard_multiple=128)
    >>> layout.bucket_sizes  # "w" (9025 >= 9000) closes bucket 0; "b" is left over
    (9088, 128)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


@dataclasses.dataclass(frozen=True)
class LeafSlot:
    """Where one leaf lives: ``bucket``'s elements ``[offset, offset + size)``. With split
    leaves, where the leaf's *first* piece lives: ``Bucket.pieces`` has every piece."""

    index: int  # position in ``jax.tree.leaves`` order
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    bucket: int
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Piece:
    """A run of one leaf in a bucket: the leaf's flat elements ``[start, start + size)`` at the
    bucket's elements ``[offset, offset + size)``. A whole leaf is one piece with ``start`` 0."""

    leaf: int
    start: int
    size: int
    offset: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One flat bucket: its pieces (layout order), the leaves they belong to, used elements and
    padded size; ``group``: its leaves' group label where the layout was built with ``groups``."""

    index: int
    dtype: np.dtype
    leaves: tuple[int, ...]
    num_elements: int
    padded_size: int
    pieces: tuple[Piece, ...] = ()
    group: Hashable = None

    @property
    def padding(self) -> int:
        return self.padded_size - self.num_elements


def leaf_paths(tree: PyTree) -> list[str]:
    """Readable ``a/b/0/kernel`` paths of a pytree's leaves, in ``jax.tree.leaves`` order."""
    with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [path_str(path) for path, _ in with_paths]


def unique_leaf_paths(tree: PyTree) -> list[str]:
    """:func:`leaf_paths`, refused where two leaves share one: layouts, checkpoints and
    ``master_params`` name leaves by path, so such leaves would be mixed up."""
    paths = leaf_paths(tree)
    if len(set(paths)) != len(paths):
        twice = sorted({p for p in paths if paths.count(p) > 1})
        raise ValueError(
            f"leaves {twice} have the same path name (the key 'a/b' and a['b'] are both 'a/b', the key 'x/0' and "
            "x[0] both 'x/0'): the bucket layout, checkpoints and master_params name leaves by path, "
            "so they would be mixed up. Rename the keys")
    return paths


def path_str(path: Sequence[Any]) -> str:
    """A ``jax.tree_util`` key path as ``leaf_paths`` writes it: ``a/b/0/kernel``."""
    return "/".join(_key_str(k) for k in path) or "<root>"


def _key_str(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def check_leaves(
    tree: PyTree,
    treedef: Any,
    expected: Sequence[tuple[str, tuple[int, ...], np.dtype]],
    what: str,
    reference: str,
    check_dtypes: bool = True,
) -> list:
    """Returns ``tree``'s leaves after checking its structure is ``treedef`` and each leaf has the
    ``(path, shape, dtype)`` expected of it; ``reference`` names what the tree must match."""
    leaves, got = jax.tree.flatten(tree)
    if got != treedef:
        raise ValueError(f"{what} structure differs from {reference}:\n  expected {treedef}\n  got      {got}")
    for (path, shape, dtype), leaf in zip(expected, leaves):
        if tuple(leaf.shape) != shape:
            raise ValueError(
                f"{what} leaf {path!r} has shape {tuple(leaf.shape)}, expected {shape} (the per-device "
                "shape inside shard_map)"
            )
        if check_dtypes and np.dtype(leaf.dtype) != dtype:
            raise TypeError(
                f"{what} leaf {path!r} has dtype {np.dtype(leaf.dtype)}, expected {dtype}; cast the tree "
                "or build the sync from matching parameters"
            )
    return leaves


def check_order(order: Sequence[int], num_leaves: int) -> tuple[int, ...]:
    if isinstance(order, (str, bytes)) or not isinstance(order, (Sequence, np.ndarray)) or not all(
            isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in order):
        raise TypeError(f"order must be a sequence of leaf indices (jax.tree.leaves order), e.g. from "
                        f"jax_drain.grad_ready_order(...); got {order!r:.80}")
    order = tuple(int(i) for i in order)
    if sorted(order) != list(range(num_leaves)):
        raise ValueError(
            f"order must be a permutation of the {num_leaves} leaf indices (jax.tree.leaves "
            f"order), e.g. from jax_drain.grad_ready_order(...); got {list(order)[:16]}"
            f"{'...' if len(order) > 16 else ''}"
        )
    return order


_BUCKET_SIZE_ACCEPTS = "a positive int element count (e.g. 40_000_000) or None (one bucket per dtype)"


def check_bucket_size(bucket_size: Any) -> int | None:
    """``bucket_size`` as an ``int`` (or ``None``), after checking it is a positive whole element
    count: the one check of ``bucket_size`` for layouts, syncs and train configs. Numpy integers
    are accepted; strings, floats (even whole ones), bools and counts below 1 are refused with
    an error naming the value.

    Example::

        >>> check_bucket_size(40_000_000), check_bucket_size(np.int64(512)), check_bucket_size(None)
        (40000000, 512, None)
    """
    if bucket_size is None:
        return None
    if isinstance(bucket_size, (bool, np.bool_)) or not isinstance(bucket_size, (int, np.integer)):
        hint = ""
        if isinstance(bucket_size, str):
            digits = bucket_size.strip().replace("_", "")
            hint = (f": write {int(digits)}, an int, not a string" if digits.isdigit() else
                    ": a count of elements as an int, not a string with units")
        elif isinstance(bucket_size, float) and math.isfinite(bucket_size) and bucket_size.is_integer():
            hint = f": write {int(bucket_size)}, an int"
        raise TypeError(
            f"bucket_size must be {_BUCKET_SIZE_ACCEPTS}, got {bucket_size!r} "
            f"({type(bucket_size).__name__}){hint}"
        )
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be {_BUCKET_SIZE_ACCEPTS}, got {bucket_size!r}")
    return int(bucket_size)


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """An immutable map from a pytree's leaves to padded flat buckets (dispatch order)."""

    treedef: Any
    slots: tuple[LeafSlot, ...]  # indexed by leaf index
    buckets: tuple[Bucket, ...]  # dispatch order
    shard_multiple: int
    owners: int | None = None  # whole-parameter ownership over this many devices (see build)

    @classmethod
    def build(
        cls,
        tree: PyTree,
        bucket_size: int | None,
        shard_multiple: int = 128,
        order: Sequence[int] | None = None,
        *,
        split_leaves: bool = False,
        owners: int | None = None,
        groups: Sequence[Hashable] | None = None,
    ) -> "BucketLayout":
        """Lays out the leaves of ``tree`` (arrays or ``jax.ShapeDtypeStruct``s).

        Args:
            tree: the parameter (or gradient) pytree; only shapes and dtypes are read.
            bucket_size: a bucket closes once it holds at least this many elements;
                ``None`` puts each dtype's leaves in a single bucket.
            shard_multiple: each bucket's padded size is a multiple of this.
            order: the leaf indices in the order their gradients become ready
                (``grad_ready_order``); ``None`` means reverse ``jax.tree.leaves`` order.
            split_leaves: below Megatron's rule: every bucket (but each dtype's last) holds
                exactly ``bucket_size`` elements, a leaf split at bucket boundaries into
                :class:`Piece` s, so one large leaf (a tied embedding) no longer makes one large
                bucket. ``False``: whole leaves, Megatron's rule.
            owners: whole-parameter ownership over this many devices (Megatron's layer-wise
                distributed optimizer): each bucket is ``owners`` equal slots and each leaf
                lies whole in one of them, the bucket's leaves spread over the slots largest
                first, each to the least filled one; a reduce-scatter over ``owners`` devices then
                delivers whole parameters to their owner. Gaps are zero padding, which travels
                and is stored like the rest, so a bucket also waits to close until its fullest
                slot holds at most :data:`OWNER_BALANCE` times the mean (a transformer block's
                few large matrices over 8 devices would pad a bucket 2.7x). ``None``: each
                device gets a contiguous ``1 / axis_size`` of every bucket.
            groups: one label per leaf (``jax.tree.leaves`` order), e.g. the remat block that
                reads it (:func:`~jax_drain.order.remat_groups`): a bucket also closes before a
                leaf of another group, so no bucket spans two blocks. ``None``: sizes alone.
        """
        bucket_size = check_bucket_size(bucket_size)
        if shard_multiple < 1:
            raise ValueError(f"shard_multiple must be >= 1, got {shard_multiple}")
        if owners is not None and (isinstance(owners, bool) or not isinstance(owners, int) or owners < 1):
            raise ValueError(f"owners must be an int >= 1 (the devices a bucket is scattered over), got {owners!r}")
        if owners is not None and split_leaves:
            raise ValueError("whole-parameter ownership keeps every leaf whole: it cannot split leaves over buckets "
                             "(split_leaves=True)")
        leaves, treedef = jax.tree.flatten(tree)
        if not leaves:
            raise ValueError("the parameter tree has no leaves; nothing to synchronise")
        paths = unique_leaf_paths(tree)
        if all(math.prod(np.shape(leaf)) == 0 for leaf in leaves):
            raise ValueError(f"every parameter leaf has no elements ({paths[:4]} ...); nothing to synchronise: train "
                             "at least one non-empty parameter")
        for path, leaf in zip(paths, leaves):
            dtype = np.dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)
            if not jnp.issubdtype(dtype, jnp.floating):
                raise TypeError(
                    f"leaf {path!r} has dtype {dtype}; only floating-point leaves have gradients "
                    "to synchronise. Split integer/boolean state out of the tree you pass in."
                )
        order = tuple(reversed(range(len(leaves)))) if order is None else check_order(order, len(leaves))
        if groups is not None and len(groups) != len(leaves):
            raise ValueError(f"groups must give one label per leaf ({len(leaves)}), got {len(groups)}")

        # One open bucket per dtype (its pieces: leaf, start, size); buckets are numbered when
        # they close, which is dispatch order.
        open_buckets: dict[np.dtype, list[tuple[int, int, int]]] = {}
        closed: list[tuple[np.dtype, list[tuple[int, int, int]]]] = []
        for i in order:
            dtype = np.dtype(leaves[i].dtype)
            start, remaining = 0, _size(leaves[i])
            if groups is not None and open_buckets.get(dtype) and groups[open_buckets[dtype][-1][0]] != groups[i]:
                closed.append((dtype, open_buckets.pop(dtype)))  # the block ends: its bucket closes
            while True:
                members = open_buckets.setdefault(dtype, [])
                held = sum(size for _, _, size in members)
                take = remaining if not split_leaves or bucket_size is None else min(remaining, bucket_size - held)
                members.append((i, start, take))
                start, remaining = start + take, remaining - take
                if bucket_size is not None and held + take >= bucket_size and (
                        owners is None or _balanced([m[2] for m in members], owners)):
                    closed.append((dtype, open_buckets.pop(dtype)))
                if remaining == 0:
                    break
        # Remaining partial buckets close when their last leaf is ready.
        position = {leaf: k for k, leaf in enumerate(order)}
        for dtype, members in sorted(open_buckets.items(), key=lambda kv: position[kv[1][-1][0]]):
            closed.append((dtype, members))

        slots: list[LeafSlot | None] = [None] * len(leaves)
        buckets = []
        for b, (dtype, members) in enumerate(closed):
            if owners is None:
                offset, pieces = 0, []
                for i, start, size in members:
                    pieces.append(Piece(i, start, size, offset))
                    offset += size
                used, padded = offset, max(shard_multiple, -(-offset // shard_multiple) * shard_multiple)
            else:
                pieces, used, padded = _owned_pieces(members, owners, shard_multiple)
            for p in pieces:
                if p.start == 0:
                    slots[p.leaf] = LeafSlot(p.leaf, paths[p.leaf], tuple(leaves[p.leaf].shape), dtype, b, p.offset)
            members_in_order = tuple(dict.fromkeys(i for i, _, _ in members))
            group = None if groups is None else groups[members[0][0]]
            buckets.append(Bucket(b, dtype, members_in_order, used, padded, tuple(pieces), group))
        return cls(treedef, tuple(slots), tuple(buckets), shard_multiple, owners)

    @property
    def split(self) -> bool:
        """Whether some leaf is split over several buckets."""
        return any(p.start or p.size != self.slots[p.leaf].size for b in self.buckets for p in b.pieces)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        """Padded element count of each bucket, dispatch order."""
        return tuple(b.padded_size for b in self.buckets)

    def check_tree(self, tree: PyTree, what: str = "tree", check_dtypes: bool = True) -> list:
        """Returns ``tree``'s leaves after checking structure, shapes (and dtypes) match."""
        expected = [(s.path, s.shape, s.dtype) for s in self.slots]
        return check_leaves(tree, self.treedef, expected, what, "the layout's parameter tree", check_dtypes)

    def flatten(self, tree: PyTree, dtype: Any = None) -> tuple[jax.Array, ...]:
        """Packs ``tree`` into 1-D zero-padded buckets (dispatch order).

        With ``dtype=None`` leaf dtypes must match the layout; otherwise every bucket is cast
        to ``dtype`` (e.g. float32 master copies of bf16 parameters).
        """
        leaves = self.check_tree(tree, check_dtypes=dtype is None)
        return tuple(self.bucket(k, leaves, dtype) for k in range(self.num_buckets))

    def bucket(self, k: int, leaves: Sequence[Any], dtype: Any = None) -> jax.Array:
        """Bucket ``k`` (1-D, zero-padded) from the leaves (``jax.tree.leaves`` order; only
        bucket ``k``'s own leaves, ``Bucket.leaves``, are read)."""
        bucket = self.buckets[k]
        bucket_dtype = bucket.dtype if dtype is None else dtype
        return self.assemble(k, [_piece_of(leaves[p.leaf], p, self.slots[p.leaf].size) for p in bucket.pieces],
                             bucket_dtype)

    def assemble(self, k: int, parts: Sequence[jax.Array], dtype: Any = None) -> jax.Array:
        """Bucket ``k`` (1-D) from its pieces' flat values (``parts[j]`` for ``pieces[j]``), cast
        to ``dtype`` (default the bucket's), zeros wherever no piece lies."""
        bucket = self.buckets[k]
        dtype = bucket.dtype if dtype is None else dtype
        out, cursor = [], 0
        for p, part in zip(bucket.pieces, parts):
            if p.offset > cursor:
                out.append(jnp.zeros((p.offset - cursor,), dtype))
            out.append(jnp.reshape(part, (-1,)).astype(dtype))
            cursor = p.offset + p.size
        if bucket.padded_size > cursor:
            out.append(jnp.zeros((bucket.padded_size - cursor,), dtype))
        return jnp.concatenate(out) if len(out) > 1 else out[0]

    def owned_pieces(self, k: int, owner: int) -> tuple[Piece, ...]:
        """The pieces of bucket ``k`` that lie in ``owner``'s slot (whole-parameter ownership)."""
        if self.owners is None:
            raise ValueError("owned_pieces needs a layout built with owners= (whole-parameter ownership)")
        slot = self.buckets[k].padded_size // self.owners
        return tuple(p for p in self.buckets[k].pieces if owner * slot <= p.offset < (owner + 1) * slot)

    def unflatten(self, buckets: Sequence[jax.Array]) -> PyTree:
        """Inverse of :meth:`flatten`: leaves take their bucket's dtype."""
        buckets = tuple(buckets)
        if len(buckets) != self.num_buckets:
            raise ValueError(f"expected {self.num_buckets} buckets, got {len(buckets)}")
        for bucket, array in zip(self.buckets, buckets):
            if tuple(array.shape) != (bucket.padded_size,):
                raise ValueError(
                    f"bucket {bucket.index} has shape {tuple(array.shape)}, expected "
                    f"({bucket.padded_size},); pass whole buckets, not per-device shards"
                )
        parts: list[list[tuple[int, jax.Array]]] = [[] for _ in self.slots]
        for bucket, array in zip(self.buckets, buckets):
            for p in bucket.pieces:
                parts[p.leaf].append((p.start, array[p.offset : p.offset + p.size]))
        leaves = []
        for slot, pieces in zip(self.slots, parts):
            pieces.sort(key=lambda item: item[0])
            flat = pieces[0][1] if len(pieces) == 1 else jnp.concatenate([x for _, x in pieces])
            leaves.append(flat.reshape(slot.shape))
        return jax.tree.unflatten(self.treedef, leaves)

    def table(self) -> str:
        """A readable table: one row per leaf, one padding row per bucket."""
        rows = [("bucket", "dtype", "offset", "size", "leaf")]
        for bucket in self.buckets:
            for p in bucket.pieces:
                slot = self.slots[p.leaf]
                whole = p.start == 0 and p.size == slot.size
                rows.append((str(bucket.index), str(bucket.dtype), str(p.offset), str(p.size),
                             slot.path if whole else f"{slot.path}[{p.start}:{p.start + p.size}]"))
            group = "" if bucket.group is None else f", group {bucket.group}"
            rows.append(
                (str(bucket.index), str(bucket.dtype), str(bucket.num_elements), str(bucket.padding),
                 f"<padding>  (bucket total {bucket.padded_size}{group})")
            )
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        lines = [
            "  ".join(r[c].rjust(widths[c]) if c in (2, 3) else r[c].ljust(widths[c]) for c in range(4))
            + "  " + r[4]
            for r in rows
        ]
        return "\n".join(lines)


def _size(leaf: Any) -> int:
    return math.prod(leaf.shape)


#: Whole-parameter ownership: a bucket closes once its fullest owner slot holds at most this
#: many times the mean (largest-first fill), so padding stays below a quarter of the bucket.
OWNER_BALANCE = 1.25


def _placement(sizes: Sequence[int], owners: int) -> tuple[list[tuple[int, int]], list[int]]:
    """``sizes`` placed largest first (stable: ready order among equals), each on the least
    filled owner (the lowest on a tie): each size's ``(owner, offset in its slot)``, in the
    order given, and every owner's fill."""
    fill, at = [0] * owners, [(0, 0)] * len(sizes)
    for j in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        owner = min(range(owners), key=lambda r: (fill[r], r))
        at[j] = (owner, fill[owner])
        fill[owner] += sizes[j]
    return at, fill


def _balanced(sizes: Sequence[int], owners: int) -> bool:
    _, fill = _placement(sizes, owners)
    return max(fill) * owners <= OWNER_BALANCE * sum(fill)


def _owned_pieces(members: Sequence[tuple[int, int, int]], owners: int,
                  shard_multiple: int) -> tuple[tuple[Piece, ...], int, int]:
    """One bucket's whole leaves spread over ``owners`` equal slots, largest first, each to the
    least filled slot (the lowest on a tie): ``(pieces by offset, used elements, padded size)``."""
    at, fill = _placement([size for _, _, size in members], owners)
    step = shard_multiple // math.gcd(shard_multiple, owners)  # so that owners * slot splits evenly
    slot = max(step, -(-max(fill) // step) * step)
    pieces = sorted((Piece(i, 0, size, owner * slot + offset) for (i, _, size), (owner, offset) in zip(members, at)),
                    key=lambda p: p.offset)
    return tuple(pieces), sum(fill), owners * slot


def _piece_of(leaf: Any, piece: Piece, leaf_size: int) -> jax.Array:
    flat = jnp.ravel(leaf)
    return flat if piece.start == 0 and piece.size == leaf_size else flat[piece.start : piece.start + piece.size]
