"""Whole-parameter ownership: each device runs ``tx`` on the whole parameters it owns.

With ``GradSync(..., ownership="param")`` every bucket is laid out as one slot per device along
the data axes, each parameter whole in one slot (:meth:`BucketLayout.build
<jax_drain.BucketLayout.build>`'s ``owners``), so the drained reduce-scatter hands each device
the summed gradients of whole parameters. A transform that needs a parameter whole (Muon's
Newton-Schulz orthogonalisation, Adafactor's factored moments, LAMB and LARS trust ratios) then
runs on its owner exactly as on one device: :class:`OwnedParams` gives each device the
parameter tree with its own parameters in place and every other leaf a one-element zero of the
same rank, runs ``tx`` there, and writes the owned updates back into the device's shards.

Devices own different parameters, so ``tx`` traces differently per device: the update is a
``jax.lax.switch`` on the device's index along the data axes, one branch per owner, and each
branch holds only its owner's state. The state is packed into flat arrays shaped like the
device's first gradient shard (per dtype, as many as the largest owner's state needs), so the
optimizer keeps it sharded over the data axes like any element-wise state.

``tx`` must treat parameters independently (everything per parameter, nothing summed over
several): :func:`check_per_parameter` runs it on two simulated owners against the whole tree
and refuses it otherwise (a global norm clip inside ``tx`` is the usual case).

Example::

    sync = jd.GradSync(params, mesh, ownership="param")
    opt = jd.DistributedOptimizer(optax.contrib.muon(0.02), sync)   # Muon on whole matrices
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_drain import _compat
from jax_drain._tx_check import Verdict, first_difference, host_unflatten, once_per_tx, random_steps, stepped, updates_on_tree
from jax_drain.chain import BucketChain
from jax_drain.layout import BucketLayout, leaf_paths

PyTree = Any


@dataclasses.dataclass(frozen=True)
class OwnedPiece:
    """Parameter ``leaf`` (full-tree index) lies whole in this device's shard ``shard`` at
    elements ``[offset, offset + size)``."""

    leaf: int
    shard: int
    offset: int
    size: int


@dataclasses.dataclass(frozen=True, eq=False)
class OwnedParams:
    """Which parameters each owner holds, and how its ``tx`` state is packed.

    ``pieces[r]``: owner ``r``'s parameters in its shards; ``params``: the parameter tree as
    ``jax.ShapeDtypeStruct``s (float32); ``axes``: the mesh axes the owners are numbered along
    (major first, as the shards are split); ``width``: the elements of one packed state array
    (the first shard's size); ``manual``: whether ``axes`` are ``shard_map`` axes.
    """

    pieces: tuple[tuple[OwnedPiece, ...], ...]
    params: PyTree
    axes: tuple[str, ...]
    width: int
    manual: bool = True  # the axes are shard_map's (values carry varying-axis types), not a vmap's

    @classmethod
    def of(cls, refs: Sequence[tuple[BucketChain, int]], params: PyTree, *, manual: bool = True) -> "OwnedParams":
        """From a sync's flat ``(chain, bucket)`` references (every chain laid out with owners)."""
        chains = {id(chain): chain for chain, _ in refs}
        owners = {chain.layout.owners for chain in chains.values()}
        if None in owners or len(owners) != 1 or any(chain.num_layers is not None for chain in chains.values()):
            raise ValueError("whole-parameter ownership needs every chain laid out with one owner per data-parallel "
                             "device (GradSync(ownership='param')); a scanned stack's layer chain has none")
        (n,) = owners
        pieces: list[list[OwnedPiece]] = [[] for _ in range(n)]
        for i, (chain, k) in enumerate(refs):
            slot = chain.layout.buckets[k].padded_size // n
            for r in range(n):
                for p in chain.layout.owned_pieces(k, r):
                    pieces[r].append(OwnedPiece(chain.leaves[p.leaf], i, p.offset - r * slot, p.size))
        axes = refs[0][0].axes
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params)
        return cls(tuple(tuple(p) for p in pieces), params, axes, refs[0][0].shard_shape(refs[0][1])[-1], manual)

    @property
    def num_owners(self) -> int:
        return len(self.pieces)

    def owned_tree(self, r: int, shards: Sequence[jax.Array]) -> PyTree:
        """The parameter tree as owner ``r`` sees it: its parameters from ``shards`` (this
        device's), every other leaf a single zero of the same rank (what ``tx`` computes on it is
        dropped)."""
        leaves, treedef = jax.tree.flatten(self.params)
        out = [jnp.zeros((1,) * len(x.shape), jnp.float32) for x in leaves]
        for p in self.pieces[r]:
            out[p.leaf] = shards[p.shard][p.offset:p.offset + p.size].astype(jnp.float32).reshape(leaves[p.leaf].shape)
        return jax.tree.unflatten(treedef, out)

    def write(self, r: int, tree: PyTree, like: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """Owner ``r``'s leaves of ``tree`` written into zero arrays shaped like ``like``."""
        leaves = jax.tree.leaves(tree)
        out = [jnp.zeros_like(x) for x in like]
        for p in self.pieces[r]:
            out[p.shard] = jax.lax.dynamic_update_slice(out[p.shard], jnp.ravel(leaves[p.leaf]).astype(out[p.shard].dtype),
                                                        (p.offset,))
        return tuple(out)

    def state_layout(self, tx: optax.GradientTransformation) -> "PackedStates":
        """How every owner's ``tx`` state is packed into the shared arrays."""
        shards = self._abstract_shards()
        return PackedStates.of([jax.eval_shape(lambda m, r=r: tx.init(self.owned_tree(r, m)), shards)
                                for r in range(self.num_owners)], self.width)

    def packing(self, tx: optax.GradientTransformation, packed: "PackedStates") -> dict[str, Any]:
        """How every owner's ``tx`` state sits in the packed arrays, as JSON: each state leaf's
        path, the parameter it belongs to (``None`` for state shared by all, like a step count),
        its shape and dtype per owner, and each parameter's owner. A checkpoint moves the state to
        other owners with it, one owner's row at a time (:func:`unpack_owner_on_host`,
        :func:`pack_owner_on_host`); ``unmovable`` says
        why it cannot, when ``tx``'s state does not map onto parameters by path."""
        full = jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, self.params))
        state_keys = [tuple(path) for path, _ in full[0]]
        param_keys = [tuple(path) for path, _ in jax.tree_util.tree_flatten_with_path(self.params)[0]]
        belongs = [_param_of(key, param_keys) for key in state_keys]
        owner_of = {p.leaf: r for r, pieces in enumerate(self.pieces) for p in pieces}
        shapes = [[[list(shape), dtype] for shape, dtype in specs] for _, specs in packed.structures]
        unmovable = ""
        for r, (treedef, specs) in enumerate(packed.structures):
            if treedef != full[1]:
                unmovable = f"owner {r}'s tx state has another structure than tx.init of the whole tree"
                break
            for key, leaf, (shape, _), whole in zip(state_keys, belongs, specs, full[0]):
                if (leaf is None or owner_of.get(leaf) == r) and tuple(shape) != tuple(whole[1].shape):
                    what = "shared by all parameters" if leaf is None else f"of parameter {leaf_paths(self.params)[leaf]!r}"
                    unmovable = (f"tx state leaf {jax.tree_util.keystr(key)!r} (taken as {what}) is {list(shape)} on "
                                 f"owner {r} but {list(whole[1].shape)} on the whole tree")
                    break
            if unmovable:
                break
        names = leaf_paths(self.params)
        return {"owners": self.num_owners, "width": packed.width, "dtypes": list(packed.dtypes),
                "counts": list(packed.counts), "unmovable": unmovable,
                "leaves": [[jax.tree_util.keystr(key), None if leaf is None else names[leaf]]
                           for key, leaf in zip(state_keys, belongs)],
                "shapes": shapes, "owner_of": {names[leaf]: r for leaf, r in sorted(owner_of.items())}}

    def _abstract_shards(self) -> list[jax.ShapeDtypeStruct]:
        sizes: dict[int, int] = {}
        for owner in self.pieces:
            for p in owner:
                sizes[p.shard] = max(sizes.get(p.shard, 0), p.offset + p.size)
        return [jax.ShapeDtypeStruct((sizes.get(i, 0),), jnp.float32) for i in range(max(sizes, default=-1) + 1)]

    def _per_device(self, values: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        # Every branch's outputs typed alike: each device's own, varying along the owners' axes.
        return tuple(_compat.mark_varying(v, self.axes) for v in values) if self.manual else tuple(values)

    def owner_index(self) -> jax.Array:
        """This device's owner number (inside ``shard_map``, or the check's ``vmap``)."""
        return jax.lax.axis_index(self.axes if len(self.axes) > 1 else self.axes[0])

    def init(self, tx: optax.GradientTransformation, packed: "PackedStates", master: Sequence[jax.Array],
             owner: int | None = None) -> tuple[jax.Array, ...]:
        """This device's packed ``tx`` state (``packed``: :meth:`state_layout`): ``tx.init`` of
        the parameters it owns; ``owner``: as that owner, outside ``shard_map`` (every owner's
        packed state has the same shapes)."""
        def state(r: int, m: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            return packed.pack(r, tx.init(self.owned_tree(r, m)), m[0])

        if owner is not None:
            return state(owner, tuple(master))
        branches = [functools.partial(lambda r, m: self._per_device(state(r, m)), r) for r in range(self.num_owners)]
        return jax.lax.switch(self.owner_index(), branches, tuple(master))

    def update(self, tx: optax.GradientTransformation, packed: "PackedStates", grads: Sequence[jax.Array],
               state: Sequence[jax.Array], master: Sequence[jax.Array],
               **extra_args: Any) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """``(update shards, new packed state)``: ``tx.update`` on the parameters this device owns."""
        tx = optax.with_extra_args_support(tx)

        def branch(r: int, g, s, m):
            updates, new = tx.update(self.owned_tree(r, g), packed.unpack(r, s), self.owned_tree(r, m), **extra_args)
            return self._per_device(self.write(r, updates, g)), self._per_device(packed.pack(r, new, g[0]))

        branches = [functools.partial(branch, r) for r in range(self.num_owners)]
        return jax.lax.switch(self.owner_index(), branches, tuple(grads), tuple(state), tuple(master))


@dataclasses.dataclass(frozen=True)
class PackedStates:
    """Every owner's ``tx`` state, leaves raveled and concatenated per dtype into ``counts[d]``
    arrays of ``width`` elements each (the largest owner's need; the rest zeros). The arrays
    are shaped like the device's first shard (``like`` in :meth:`pack`), so the optimizer shards
    them as it shards the gradient."""

    structures: tuple[Any, ...]  # per owner: the state's treedef and leaf (shape, dtype)s
    dtypes: tuple[str, ...]
    counts: tuple[int, ...]
    width: int

    @classmethod
    def of(cls, states: Sequence[PyTree], width: int) -> "PackedStates":
        structures, need = [], {}
        for state in states:
            leaves, treedef = jax.tree.flatten(state)
            specs = tuple((tuple(x.shape), np.dtype(x.dtype).name) for x in leaves)
            structures.append((treedef, specs))
            used: dict[str, int] = {}
            for shape, dtype in specs:
                used[dtype] = used.get(dtype, 0) + math.prod(shape)
            for dtype, n in used.items():
                need[dtype] = max(need.get(dtype, 0), n)
        dtypes = tuple(sorted(need))
        width = max(width, 1)
        return cls(tuple(structures), dtypes, tuple(-(-need[d] // width) for d in dtypes), width)

    def pack(self, r: int, state: PyTree, like: jax.Array) -> tuple[jax.Array, ...]:
        """Owner ``r``'s state as the packed arrays (shaped and typed like ``like``'s last axis)."""
        # like's width >= self.width: each owner's state fits in counts arrays of it.
        return tuple(_pack(jax.tree.leaves(state), self.dtypes, self.counts, like.shape[-1], jnp))

    def unpack(self, r: int, arrays: Sequence[jax.Array]) -> PyTree:
        """Owner ``r``'s state from the packed arrays."""
        treedef, specs = self.structures[r]
        return jax.tree.unflatten(treedef, _unpack(arrays, specs, self.dtypes, self.counts, jnp))


def _pack(leaves: Sequence[Any], dtypes: Sequence[str], counts: Sequence[int], width: int, xp: Any) -> list:
    """``leaves`` raveled and concatenated per dtype, zero-padded to ``count`` rows of ``width``:
    the rows, dtype by dtype (``xp``: ``jax.numpy`` on devices, ``numpy`` on the host)."""
    rows = []
    for dtype, count in zip(dtypes, counts):
        flat = [xp.ravel(x).astype(dtype) for x in leaves if np.dtype(x.dtype).name == dtype]
        flat.append(xp.zeros((count * width - sum(x.size for x in flat),), dtype))
        whole = xp.concatenate(flat) if len(flat) > 1 else flat[0]
        rows.extend(xp.reshape(whole, (count, width))[j] for j in range(count))
    return rows


def _unpack(rows: Sequence[Any], specs: Sequence[tuple[Sequence[int], str]], dtypes: Sequence[str],
            counts: Sequence[int], xp: Any) -> list:
    """Inverse of :func:`_pack`: the leaves of ``specs`` (shape, dtype) from the rows."""
    flat, at = {}, 0
    for dtype, count in zip(dtypes, counts):
        flat[dtype] = xp.concatenate(list(rows[at:at + count])) if count > 1 else rows[at]
        at += count
    cursor = dict.fromkeys(dtypes, 0)
    leaves = []
    for shape, dtype in specs:
        n = math.prod(shape)
        leaves.append(flat[dtype][cursor[dtype]:cursor[dtype] + n].reshape(tuple(shape)))
        cursor[dtype] += n
    return leaves


def _param_of(key: tuple, param_keys: Sequence[tuple]) -> int | None:
    """The parameter a state leaf at ``key`` belongs to: the one whose path ends ``key`` (the
    longest such: optax states hold trees shaped like the parameters), else ``None``."""
    best = None
    for i, param in enumerate(param_keys):
        if param and len(param) <= len(key) and key[len(key) - len(param):] == param:
            if best is None or len(param) > len(param_keys[best]):
                best = i
    return best


def row_span(packing: dict[str, Any], length: int, r: int) -> tuple[int, int]:
    """Where owner ``r``'s packed row lies in an owner-packed global array of ``length``."""
    stride = length // packing["owners"]
    return r * stride, r * stride + packing["width"]


def owned_leaves(packing: dict[str, Any], r: int, *, shared: bool | None = None) -> list[str]:
    """The state leaf paths owner ``r``'s row carries values of: its parameters' state, and the
    state shared by all parameters (step counts), which every owner carries (``shared=True``)
    and owner 0's copy is read of (the default: ``shared`` for owner 0 only)."""
    shared = r == 0 if shared is None else shared
    return [path for path, param in packing["leaves"]
            if (param is None and shared) or (param is not None and packing["owner_of"].get(param) == r)]


def unpack_owner_on_host(packing: dict[str, Any], rows: Sequence[np.ndarray], r: int) -> dict[str, np.ndarray]:
    """The state leaves owner ``r`` holds the values of (:func:`owned_leaves`), from its packed
    rows (one per packed array)."""
    leaves = _unpack(rows, packing["shapes"][r], packing["dtypes"], packing["counts"], np)
    mine = set(owned_leaves(packing, r))
    return {path: value for (path, _), value in zip(packing["leaves"], leaves) if path in mine}


def pack_owner_on_host(packing: dict[str, Any], values: dict[str, np.ndarray], r: int) -> list[np.ndarray]:
    """Owner ``r``'s packed rows from the state leaves it carries (``values`` by path: its
    parameters' and the shared state; the state of parameters it does not own is zero, what
    ``tx`` computes from it is dropped)."""
    mine = set(owned_leaves(packing, r, shared=True))
    leaves = [values[path] if path in mine else np.zeros(shape, dtype)
              for (path, _), (shape, dtype) in zip(packing["leaves"], packing["shapes"][r])]
    return _pack(leaves, packing["dtypes"], packing["counts"], packing["width"], np)


def packing_mismatch(saved: dict[str, Any], wanted: dict[str, Any]) -> str:
    """Why owner-packed state saved with ``saved`` cannot be packed for ``wanted`` ('' if it can)."""
    for side, packing in (("saved", saved), ("target", wanted)):
        if packing["unmovable"]:
            return f"the {side} layout's tx state cannot be moved to other owners: {packing['unmovable']}"
    if saved["leaves"] != wanted["leaves"]:
        return "the tx state has other leaves than the checkpoint's (another optimizer)"
    shape = lambda p: [tuple(s) for s, _ in p["shapes"][0]]  # noqa: E731 - shared leaves' shapes
    for (path, param), a, b in zip(saved["leaves"], shape(saved), shape(wanted)):
        if param is None and a != b:
            return f"the tx state leaf {path!r} shared by all parameters is {list(a)}, the target's {list(b)}"
    return ""


def check_per_parameter(tx: optax.GradientTransformation, params: PyTree, *, rtol: float = 1e-4) -> None:
    """Raises ``ValueError`` unless ``tx`` run per owner on whole parameters gives what it gives
    on the whole tree: a few steps on a shrunken copy of ``params`` (every dimension at most 3),
    the leaves spread over two simulated owners. The same ``tx`` object, passed on the same
    shapes, is not checked again."""
    per_parameter_check(tx, params, rtol=rtol)()


def per_parameter_check(tx: optax.GradientTransformation, params: PyTree, *,
                        rtol: float = 1e-4) -> Callable[[], None]:
    """:func:`check_per_parameter` prepared: traced and lowered, on any thread, with nothing run
    on a device. Calling the result compiles and runs the check on the calling thread, raising
    ``ValueError`` if ``tx`` is refused (a pass is remembered). A ``tx`` that cannot even be
    traced is refused here."""
    shrunk = jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(min(int(d), 3) for d in np.shape(x)), jnp.float32),
                          params)
    leaves, treedef = jax.tree.flatten(shrunk)
    return _owners_check(tx, treedef, tuple(x.shape for x in leaves), rtol)


@once_per_tx
def _owners_check(tx: optax.GradientTransformation, treedef: Any, shapes: tuple, rtol: float) -> Verdict:
    """:func:`per_parameter_check` on the shrunken tree, its leaves spread over two owners."""
    owners = 2
    shrunk = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
    start, grads = random_steps(shrunk)
    try:
        on_tree = updates_on_tree(tx, start, grads)
    except Exception as e:  # noqa: BLE001 - tx must first work on the tree it is written for
        raise ValueError(f"tx fails on the parameter tree ({type(e).__name__}: {e})") from e

    layout = BucketLayout.build(shrunk, bucket_size=None, shard_multiple=owners, owners=owners)
    num_leaves = len(layout.slots)
    chain = BucketChain("dense", "check", layout, tuple(range(num_leaves)), ("owner",), (), owners, (),
                        (1,) * num_leaves)
    owned = OwnedParams.of(tuple((chain, k) for k in range(layout.num_buckets)), shrunk, manual=False)
    rows = lambda tree, r: tuple(jnp.reshape(b, (owners, -1))[r] for b in layout.flatten(tree))  # noqa: E731

    def on_owner(r: int) -> Callable[[], list]:
        # Owner r on its own, as the runtime's switch branch for it does.
        def init(start: PyTree) -> tuple[Any, tuple]:
            master = rows(start, r)
            return tx.init(owned.owned_tree(r, master)), master

        def step(carry: tuple[Any, tuple], g: PyTree) -> tuple[tuple, tuple[Any, tuple]]:
            state, master = carry
            updates, state = tx.update(owned.owned_tree(r, rows(g, r)), state, owned.owned_tree(r, master))
            written = owned.write(r, updates, master)
            return written, (state, tuple(m + u for m, u in zip(master, written)))

        return stepped(init, step, start, list(grads))

    try:
        owner_runs = [on_owner(r) for r in range(owners)]
    except Exception as e:  # noqa: BLE001 - any failure per owner means tx cannot run there
        raise ValueError(f"tx fails on the parameters each device owns ({type(e).__name__}: {e})") from e

    def run() -> None:
        by_owner = [owner_run() for owner_run in owner_runs]
        per_owner = [[np.stack([np.asarray(steps[t][i]) for steps in by_owner]) for i in range(layout.num_buckets)]
                     for t in range(len(grads))]
        for step, (want_tree, got_shards) in enumerate(zip(on_tree(), per_owner)):
            if differs := first_difference(leaf_paths(shrunk), want_tree, host_unflatten(layout, got_shards), rtol):
                path, w, g = differs
                raise ValueError(
                    "tx gives a different result on the parameters each device owns than on the whole tree "
                    f"(leaf {path!r}, step {step + 1} of a check on a shrunken copy: update {g.ravel()[:4]} "
                    f"instead of {w.ravel()[:4]}): it computes something over several parameters. A global "
                    "norm clip (optax.clip_by_global_norm) must be the optimizer's, over every owner: leave it "
                    "out of tx and give TrainConfig(max_grad_norm=...) or DistributedOptimizer(..., "
                    "max_grad_norm=...)")

    return Verdict(run)
