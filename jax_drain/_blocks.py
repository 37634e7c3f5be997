"""A list of identical blocks made a layer stack: the blocks' parameters stacked along a new
leading (layer) axis, and the loss's unrolled blocks rerolled into one ``jax.lax.scan`` over them.

A model written as ``for block in self.blocks: x = block(x)`` traces to the same run of
equations once per block. :func:`rerolled` finds that run in the traced loss: a window of
equations that repeats once per block, each copy reading its own block's parameters, the values
the copy before it computed (the carry), and values computed before the first copy (constants),
and nothing else. The loss is then evaluated with the copies replaced by one scan of the first,
which is what the stage axis splits (:func:`jax_drain.pipeline.pipelined`). Where the copies
are not such a run (a block reads another's parameters, a later block reads an earlier block's
values other than through the block between them, blocks differ), nothing is rerolled and the
caller is told why.

Where a block begins is not visible in a jaxpr (a layer norm's statistics may be the end of one
block or the start of the next): every window start that gives identical copies is tried, and
the one with the fewest carried bytes is kept. Any of them computes the same loss.

Example::

    stack = find_block_stack(loss, params, batch)        # None: no list of identical blocks
    stacked = stack.stack(params)                        # {"blocks": {"[0..3]": {...[4, ...]}}, ...}
    loss_of_stacked = rerolled(loss, stack)              # loss_of_stacked(stacked, batch) == loss(params, batch)
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_drain import _compat
from jax_drain._jaxpr import PLAIN_CALLS, call_body, is_literal

PyTree = Any
Key = Any


class BlockStack(NamedTuple):
    """Identical sibling subtrees of a params tree (dict keys or list positions under
    ``parent``), ``members`` in the order the loss runs them; stacked, they become one subtree
    under ``key`` (a list parent: the subtree in place of the list)."""

    parent: tuple[Key, ...]
    members: tuple[Key, ...]
    in_list: bool = False  # the members are a whole list (or tuple), not dict entries

    @property
    def key(self) -> str:
        """The stacked subtree's key under ``parent``, naming the members in run order (what
        :func:`members_of_key` reads back): ``"[0..7]"`` or ``"[block_0..block_7]"`` for a
        numbered run, else ``"[a,b,c]"``."""
        names = [str(m) for m in self.members]
        if _members_of_range(names[0], names[-1]) == names:
            return f"[{names[0]}..{names[-1]}]"
        return "[" + ",".join(names) + "]"

    def describe(self) -> str:
        """``"blocks/{0, 1, 2}"``-style: the parent's path and the members."""
        return "/".join(map(str, self.parent)) + "/{" + ", ".join(map(str, self.members)) + "}"

    @property
    def num_layers(self) -> int:
        return len(self.members)

    def stack(self, tree: PyTree, *, combine: Callable[..., Any] | None = None) -> PyTree:
        """``tree`` with the members stacked (``jax.ShapeDtypeStruct``s stay abstract, numpy
        arrays stay on the host); ``combine(*members' leaves)`` makes a stacked leaf otherwise."""
        parent = _get(tree, self.parent)
        blocks = [parent[k] for k in self.members]
        stacked = jax.tree.map(combine or _stack_leaves, *blocks)
        if self.in_list:
            return _set(tree, self.parent, stacked)
        rest = {k: v for k, v in parent.items() if k not in self.members}
        return _set(tree, self.parent, {**rest, self.key: stacked})

    def unstack(self, tree: PyTree, *, row: Callable[[Any, int], Any] | None = None) -> PyTree:
        """:meth:`stack`'s inverse, for a tree of arrays, ``jax.ShapeDtypeStruct``s or avals;
        ``row(stacked_leaf, i)`` gives block ``i``'s leaf (default: its row)."""
        parent = _get(tree, self.parent)
        row = _row if row is None else row
        blocks = [jax.tree.map(lambda x, i=i: row(x, i), self.stacked(tree)) for i in range(self.num_layers)]
        if self.in_list:
            order = sorted(range(len(self.members)), key=lambda i: self.members[i])
            return _set(tree, self.parent, [blocks[i] for i in order])
        rest = {k: v for k, v in parent.items() if k != self.key}
        return _set(tree, self.parent, {**rest, **dict(zip(self.members, blocks))})

    def stacked(self, tree: PyTree) -> PyTree:
        """The stacked subtree of a stacked ``tree``."""
        parent = _get(tree, self.parent)
        return parent if self.in_list else parent[self.key]


def members_of_key(segment: str) -> list[str] | None:
    """The members (as path segments, in run order) a stacked key (:attr:`BlockStack.key`)
    names; ``None`` for a segment that is not one."""
    if len(segment) < 3 or segment[0] != "[" or segment[-1] != "]":
        return None
    inner = segment[1:-1]
    if ".." in inner and "," not in inner:
        first, last = inner.split("..", 1)
        return _members_of_range(first, last)
    names = inner.split(",")
    return names if len(names) > 1 and all(names) else None


def _numbered(name: str) -> re.Match | None:
    return re.fullmatch(r"(.*?)(\d+)", name)


def _members_of_range(first: str, last: str) -> list[str] | None:
    a, b = _numbered(first), _numbered(last)
    if not a or not b or a.group(1) != b.group(1) or int(b.group(2)) <= int(a.group(2)):
        return None
    return [f"{a.group(1)}{n}" for n in range(int(a.group(2)), int(b.group(2)) + 1)]


class BlockPaths:
    """Leaf paths of one tree in the terms of another (``"/"``-joined), where one holds a list
    of blocks stacked (``a/[0..3]/b``) and the other the blocks one by one (``a/0/b`` ...
    ``a/3/b``): how a checkpoint moves between a stage axis's stacked blocks and the model's.

    ``have``: the paths that exist. :meth:`source` says where a wanted path's values are."""

    def __init__(self, have: Sequence[str]):
        self.have = set(have)
        self._stacked: dict[tuple[str, str], tuple[str, list[str]]] = {}
        for path in have:
            parts = path.split("/")
            for k, segment in enumerate(parts):
                members = members_of_key(segment)
                if members:
                    self._stacked["/".join(parts[:k]), "/".join(parts[k + 1:])] = (path, members)

    def source(self, path: str) -> tuple | None:
        """``("same", path)``; ``("row", stacked path, i)``: row ``i`` of a stacked leaf;
        ``("stack", member paths)``: the members' leaves stacked; ``None``: not there."""
        if path in self.have:
            return ("same", path)
        parts = path.split("/")
        for k, segment in enumerate(parts):
            prefix, suffix = "/".join(parts[:k]), "/".join(parts[k + 1:])
            stacked = self._stacked.get((prefix, suffix))
            if stacked is not None and segment in stacked[1]:
                return ("row", stacked[0], stacked[1].index(segment))
            members = members_of_key(segment)
            if members:
                paths = ["/".join([*parts[:k], m, *parts[k + 1:]]) for m in members]
                if all(p in self.have for p in paths):
                    return ("stack", paths)
        return None

    @staticmethod
    def expanded(shapes: dict[str, Any]) -> dict[str, Any]:
        """``{path: (shape, *rest)}`` with each stacked leaf given as its members' rows."""
        out = {}
        for path, (shape, *rest) in shapes.items():
            parts = path.split("/")
            stacked = [(k, members) for k, members in enumerate(map(members_of_key, parts)) if members]
            if not stacked or not shape or len(stacked[0][1]) != shape[0]:
                out[path] = (tuple(shape), *rest)
                continue
            k, members = stacked[0]
            for m in members:
                out["/".join([*parts[:k], m, *parts[k + 1:]])] = (tuple(shape[1:]), *rest)
        return out


class NotRerolled(ValueError):
    """The loss's blocks are not one run of identical copies (the message says where).
    ``reached``: how far the check got (equations of a block found alike; past the period: the
    copies are alike, and what they read is not a chain)."""

    def __init__(self, message: str, reached: int = 0):
        super().__init__(message)
        self.reached = reached


def block_candidates(params: PyTree) -> list[BlockStack]:
    """Every group of two or more sibling subtrees of ``params`` (dicts and lists) with the
    same structure, shapes and dtypes, largest first (members in tree order, not yet run
    order)."""
    found: list[tuple[int, BlockStack]] = []

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, dict):
            children = list(node.items())
        elif isinstance(node, (list, tuple)):
            children = list(enumerate(node))
        else:
            return
        groups: dict[Any, list[Key]] = {}
        for key, child in children:
            leaves, treedef = jax.tree.flatten(child)
            if leaves:
                signature = (treedef, tuple((tuple(np.shape(x)), str(np.dtype(x.dtype))) for x in leaves))
                groups.setdefault(signature, []).append(key)
            walk(child, path + (key,))
        for signature, keys in groups.items():
            # Stacked, a dict's members become one string key beside the others: keys of one type.
            fits = len(keys) == len(children) or (
                isinstance(node, dict) and all(isinstance(k, str) for k in node if k not in keys))
            if len(keys) > 1 and fits:
                size = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in signature[1]) * len(keys)
                found.append((size, BlockStack(path, tuple(keys), in_list=not isinstance(node, dict))))

    walk(params, ())
    return [stack for _, stack in sorted(found, key=lambda item: -item[0])]


def find_block_stack(loss: Callable[[PyTree, Any], Any], params: PyTree, *args: Any) -> BlockStack | None:
    """The largest group of identical blocks in ``params`` (:func:`block_candidates`), members
    in the order ``loss(params, *args)`` runs them; ``None`` when ``params`` has no such group.
    ``params`` and ``args`` may be ``jax.ShapeDtypeStruct``s.

    Only the largest group is tried (a smaller one is a part of a block, not the stack): where
    the loss does not run it as a chain of copies of one block, :class:`NotRerolled` says why."""
    candidates = block_candidates(params)
    if not candidates:
        return None
    candidate = candidates[0]
    closed = jax.make_jaxpr(loss)(params, *args)  # inputs: params' leaves, then the args'
    try:
        plan = _plan(closed.jaxpr, closed.consts, _groups(candidate, _leaf_keys(params), closed.jaxpr.invars))
    except NotRerolled as e:
        raise NotRerolled(f"{candidate.describe()}: {e}", e.reached) from None
    return candidate._replace(members=tuple(candidate.members[i] for i in plan.order))


def rerolled(loss: Callable[..., Any], stack: BlockStack) -> Callable[..., Any]:
    """``loss`` on the tree with ``stack`` stacked (:meth:`BlockStack.stack`): ``loss`` traced
    on the blocks as the model has them, its copies of the block run as one ``jax.lax.scan``
    over the stacked parameters. Traced anew at each call's shapes.

    Raises :class:`NotRerolled` where the blocks at these shapes are not one rerollable run in
    ``stack``'s order."""

    def wrapped(stacked_params: PyTree, *args: Any) -> Any:
        # Traced on the blocks' avals (no slice of a stacked leaf outside the scan: the stage
        # axis's rewriter refuses one), evaluated with the other leaves' values.
        params = stack.unstack(jax.tree.map(_abstract, stacked_params))
        values = jax.tree.leaves(stack.unstack(stacked_params, row=lambda x, i: _NO_VALUE))
        closed, out_shape = jax.make_jaxpr(loss, return_shape=True)(params, *args)
        groups = _groups(stack, _leaf_keys(params), closed.jaxpr.invars)
        outs = _Replay(groups, jax.tree.leaves(stack.stacked(stacked_params))).eval(
            closed.jaxpr, closed.consts, [*values, *jax.tree.leaves(args)])
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped


# -- the plan: where the copies are, and what each operand of the first copy stands for -------


class _Plan(NamedTuple):
    """The run of copies in one jaxpr: copy ``i`` is ``eqns[start + i * period:][:period]``."""

    order: list[int]  # the groups (as given) in run order
    start: int
    period: int
    count: int
    # Per equation of the first copy, per operand: ("local", j, k) an output of its equation j,
    # ("leaf", m) the block's leaf m, ("carry", slot), ("const", var) or ("literal", value).
    operands: list[list[tuple]]
    slots: list[tuple[int, int]]  # carried values: (equation, output) in a copy
    init: list[Any]  # each slot's value entering the first copy: a var or literal, or None (zeros: never read there)


def _groups(stack: BlockStack, paths: list[tuple], invars: Sequence[Any]) -> list[list[Any]]:
    """Each member's leaf vars among ``invars`` (the loss's flat params first), leaf by leaf."""
    depth = len(stack.parent)
    by_member: dict[Key, list[Any]] = {m: [] for m in stack.members}
    for path, var in zip(paths, invars):
        if path[:depth] == stack.parent and len(path) > depth and path[depth] in by_member:
            by_member[path[depth]].append(var)
    return [by_member[m] for m in stack.members]


def _plan(jaxpr: Any, consts: Sequence[Any], groups: list[list[Any]]) -> _Plan:
    """The rerolling plan of ``groups`` in ``jaxpr`` (through plain calls holding every copy);
    ``consts``: the values of its constvars."""
    eqns = jaxpr.eqns
    first = _first_reads(jaxpr, groups)
    holder = _holder(jaxpr, first)
    if holder is not None:
        eqn = eqns[holder]
        inner, inner_consts = call_body(eqn, PLAIN_CALLS)
        where = {v: k for k, v in enumerate(eqn.invars) if not is_literal(v)}
        return _plan(inner, inner_consts, [[inner.invars[where[v]] for v in vars_] for vars_ in groups])
    if len(set(first.values())) == 1:
        raise NotRerolled(f"one {eqns[first[0]].primitive.name!r} reads every block's parameters")
    order = sorted(range(len(groups)), key=lambda g: first[g])
    starts = [first[g] for g in order]
    period = starts[1] - starts[0]
    if any(b - a != period for a, b in zip(starts, starts[1:])):
        raise NotRerolled(f"the blocks start {period} and {next(b - a for a, b in zip(starts, starts[1:]) if b - a != period)} "
                          "equations apart: they are not copies of one block")
    ordered = [groups[g] for g in order]
    leaf_of = {v: (i, m) for i, vars_ in enumerate(ordered) for m, v in enumerate(vars_)}
    memo: dict[int, tuple] = {}  # inner jaxprs' keys by id (one jit'd function's jaxpr is often shared)
    signatures = [_signature(e, memo) for e in eqns]
    # Constants alike in value are one: each block may hold its own copy (a rotary table).
    values = {v: _const_key(c) for v, c in zip(jaxpr.constvars, consts)}
    best, refusal = None, NotRerolled("no window of equations repeats once per block")
    for offset in range(period):
        start = starts[0] - offset
        if start < 0 or start + period * len(groups) > len(eqns):
            continue
        try:
            plan = _check(jaxpr, start, period, len(groups), signatures, leaf_of, order, values)
        except NotRerolled as e:  # the window that got furthest says why
            refusal = e if e.reached >= refusal.reached else refusal
            continue
        cost = sum(_bytes(eqns[start + j].outvars[k].aval) for j, k in plan.slots)
        if best is None or cost < best[0]:
            best = (cost, plan)
    if best is None:
        raise refusal
    return best[1]


def _first_reads(jaxpr: Any, groups: list[list[Any]]) -> dict[int, int]:
    """Each group's first reading equation; raises where a group is not read."""
    leaf_of = {v: g for g, vars_ in enumerate(groups) for v in vars_}
    first: dict[int, int] = {}
    for n, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not is_literal(v) and v in leaf_of:
                first.setdefault(leaf_of[v], n)
    if len(first) < len(groups):
        raise NotRerolled("some blocks' parameters are not read by the loss")
    return first


def _holder(jaxpr: Any, first: dict[int, int]) -> int | None:
    """The plain call (``jit``) that first reads every group (``first``: :func:`_first_reads`),
    if one does."""
    reads = set(first.values())
    if len(reads) == 1:
        (n,) = reads
        if call_body(jaxpr.eqns[n], PLAIN_CALLS) is not None:
            return n
    return None


def _check(jaxpr: Any, start: int, period: int, count: int, signatures: list, leaf_of: dict,
           order: list[int], values: dict) -> _Plan:
    eqns = jaxpr.eqns
    at: dict[Any, tuple[int, int, int]] = {}  # var -> (copy, equation, output)
    for j in range(period):
        for i in range(count):
            n = start + i * period + j
            if signatures[n] != signatures[start + j]:
                raise NotRerolled(f"block {i} differs from block 0 at its equation {j} "
                                  f"({eqns[n].primitive.name} against {eqns[start + j].primitive.name})", j)
            for k, v in enumerate(eqns[n].outvars):
                at[v] = (i, j, k)

    try:
        operands, slots, init = _chain(jaxpr, start, period, count, at, leaf_of, values)
    except NotRerolled as e:  # the copies are alike: how they are chained is the reason
        raise NotRerolled(str(e), period + 1) from None
    return _Plan(order, start, period, count, operands, slots, [init.get(s) for s in slots])


def _chain(jaxpr: Any, start: int, period: int, count: int, at: dict, leaf_of: dict,
           values: dict) -> tuple[list, list, dict]:
    """What each operand of the first copy stands for, the carried slots and their values
    entering the first copy; raises where the copies are not a chain."""
    eqns = jaxpr.eqns
    end = start + period * count

    def classify(v: Any, i: int) -> tuple:
        """What operand ``v`` of copy ``i`` is, relative to that copy."""
        if is_literal(v):
            return ("literal", v.val)
        if v in at:
            c, j, k = at[v]
            if c == i:
                return ("local", j, k)
            if c == i - 1:
                return ("carry", j, k)
            raise NotRerolled(f"block {i} reads a value of block {c}, not of the block before it")
        if v in leaf_of:
            c, m = leaf_of[v]
            if c != i:
                raise NotRerolled(f"block {i} reads block {c}'s parameters (tied weights?)")
            return ("leaf", m)
        return ("const", v)

    operands: list[list[tuple]] = []
    slots: list[tuple[int, int]] = []
    init: dict[tuple[int, int], Any] = {}
    for j in range(period):
        first = [classify(v, 0) for v in eqns[start + j].invars]
        row = []
        for p, kind in enumerate(first):
            later = {_kind_key(classify(eqns[start + i * period + j].invars[p], i), values) for i in range(1, count)}
            if len(later) != 1:
                raise NotRerolled(f"blocks read different values at equation {j} of a block "
                                  f"({eqns[start + j].primitive.name}): per-block model state (each block's own "
                                  "dropout RNG stream or batch statistics) or a per-block constant; the stages run "
                                  "one block's program for every block, so blocks may differ in parameters only")
            (other,) = later
            if other == _kind_key(kind, values) and kind[0] != "carry":
                row.append(kind)
            elif other[0] == "carry" and kind[0] in ("const", "literal"):  # a literal: a sum's 0 to start
                slot, given = other[1:], eqns[start + j].invars[p]
                if not _same_input(init.setdefault(slot, given), given):
                    raise NotRerolled("two values enter block 0 where the blocks after it read one")
                if slot not in slots:
                    slots.append(slot)
                row.append(("carry", slot))
            else:
                raise NotRerolled(f"block 0 reads {kind[0]} where the blocks after it read {other[0]}, at equation {j}")
        operands.append(row)
    # What follows the blocks reads the last block's values only: carried out of the scan.
    for n in [*range(end, len(eqns))]:
        for v in eqns[n].invars:
            _read_after(v, at, leaf_of, count, slots)
    for v in jaxpr.outvars:
        _read_after(v, at, leaf_of, count, slots)
    for n in range(start):
        if any(not is_literal(v) and v in leaf_of for v in eqns[n].invars):
            raise NotRerolled("the loss reads a block's parameters before the blocks run")
    return operands, slots, init


def _same_input(a: Any, b: Any) -> bool:
    if is_literal(a) and is_literal(b):
        return repr(a.val) == repr(b.val) and _aval_key(a.aval) == _aval_key(b.aval)
    return a is b


def _kind_key(kind: tuple, values: dict) -> tuple:
    if kind[0] == "literal":
        return ("literal", repr(kind[1]))
    if kind[0] == "const" and kind[1] in values:
        return ("constant", values[kind[1]])
    return kind


def _read_after(v: Any, at: dict, leaf_of: dict, count: int, slots: list) -> None:
    if is_literal(v):
        return
    if v in leaf_of:
        raise NotRerolled("the loss reads a block's parameters after the blocks run (tied weights?)")
    if v in at:
        c, j, k = at[v]
        if c != count - 1:
            raise NotRerolled(f"what follows the blocks reads a value of block {c}, not only of the last")
        if (j, k) not in slots:
            slots.append((j, k))


def _signature(eqn: Any, memo: dict) -> tuple:
    params = tuple(sorted((name, _param_key(value, memo)) for name, value in eqn.params.items()))
    # Operands by shape and dtype alone: a literal may stand where the other copies read a value
    # (the 0 a sum starts from; what each operand is, the chain check decides).
    ins = tuple(_aval_key(v.aval)[:2] for v in eqn.invars)
    return (eqn.primitive.name, params, ins, tuple(_aval_key(v.aval) for v in eqn.outvars), frozenset(eqn.effects))


def _param_key(value: Any, memo: dict) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(_param_key(x, memo) for x in value)
    if hasattr(value, "eqns") or hasattr(value, "jaxpr"):  # a (closed) jaxpr: by its structure and constants
        return ("jaxpr", _jaxpr_key(getattr(value, "jaxpr", value), memo),
                tuple(_const_key(c) for c in getattr(value, "consts", ())))
    if (callable(value) and not isinstance(value, type)) or hasattr(value, "transforms"):  # lu.WrappedFun too
        return _code_key(value)
    try:
        hash(value)
        return value
    except TypeError:
        return ("repr", repr(value))


def _jaxpr_key(jaxpr: Any, memo: dict) -> tuple:
    """A jaxpr's structure: each equation's signature and where each operand comes from (an
    input, a constant, an earlier output, by position; a literal by value)."""
    if id(jaxpr) in memo:
        return memo[id(jaxpr)][1]
    where: dict[Any, tuple] = {v: ("in", k) for k, v in enumerate(jaxpr.invars)}
    where.update((v, ("const", k)) for k, v in enumerate(jaxpr.constvars))
    eqns = []
    for n, eqn in enumerate(jaxpr.eqns):
        sources = tuple(("literal", repr(v.val)) if is_literal(v) else where.get(v, ("free",)) for v in eqn.invars)
        eqns.append((_signature(eqn, memo), sources))
        where.update((v, ("eqn", n, k)) for k, v in enumerate(eqn.outvars))
    outs = tuple(("literal", repr(v.val)) if is_literal(v) else where.get(v, ("free",)) for v in jaxpr.outvars)
    key = (tuple(_aval_key(v.aval) for v in jaxpr.invars), tuple(eqns), outs)
    memo[id(jaxpr)] = (jaxpr, key)  # the jaxpr kept alive with its key: its id stays its own
    return key


def _const_key(value: Any) -> tuple:
    try:
        array = np.asarray(value)
    except Exception:  # noqa: BLE001 - a traced constant: only itself is equal to itself
        return ("object", id(value))
    return (array.shape, str(array.dtype), hashlib.sha256(array.tobytes()).hexdigest())


def _code_key(fn: Any, depth: int = 4) -> tuple:
    """A function parameter (a custom derivative rule, traced lazily: a new object for every
    copy of a block) by the code it runs: its own, and that of the functions it wraps or
    closes over."""
    while hasattr(fn, "f") and hasattr(fn, "transforms") or hasattr(fn, "func"):  # lu.WrappedFun, partial
        fn = getattr(fn, "f", None) or fn.func
    code = getattr(fn, "__code__", None)
    inner = ()
    if depth and getattr(fn, "__closure__", None):
        inner = tuple(_code_key(cell.cell_contents, depth - 1) for cell in fn.__closure__
                      if _filled(cell) and callable(cell.cell_contents) and not isinstance(cell.cell_contents, type))
    return ("code", getattr(fn, "__module__", None), getattr(fn, "__qualname__", type(fn).__qualname__),
            None if code is None else (code.co_filename, code.co_firstlineno), inner)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _aval_key(aval: Any) -> tuple:
    return (tuple(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)),
            tuple(sorted(map(str, getattr(aval, "vma", ())))))


def _bytes(aval: Any) -> int:
    return int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


# -- the replay -----------------------------------------------------------------------------


class _Replay:
    """Evaluates a traced loss with its copies of the block replaced by one scan."""

    def __init__(self, groups: list[list[Any]], stacked: list[Any]):
        self.groups, self.stacked = groups, stacked

    def eval(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        read = lambda v: v.val if is_literal(v) else env[v]  # noqa: E731
        holder = _holder(jaxpr, _first_reads(jaxpr, self.groups))
        if holder is not None:  # the call holding every block: its body replayed in line
            for n, eqn in enumerate(jaxpr.eqns):
                if n == holder:
                    inner, inner_consts = call_body(eqn, PLAIN_CALLS)
                    where = {v: k for k, v in enumerate(eqn.invars) if not is_literal(v)}
                    replay = _Replay([[inner.invars[where[v]] for v in g] for g in self.groups], self.stacked)
                    outs = replay.eval(inner, inner_consts, [read(v) for v in eqn.invars])
                else:
                    outs = self._bind(eqn, [read(v) for v in eqn.invars])
                env.update(zip(eqn.outvars, outs))
            return [read(v) for v in jaxpr.outvars]
        plan = _plan(jaxpr, consts, self.groups)
        if plan.order != list(range(len(self.groups))):
            raise NotRerolled("the loss runs the blocks in another order than when the step was built")
        end = plan.start + plan.period * plan.count
        for n, eqn in enumerate(jaxpr.eqns):
            if n == plan.start:
                self._scan(plan, jaxpr.eqns, env, read)
            if not plan.start <= n < end:
                env.update(zip(eqn.outvars, self._bind(eqn, [read(v) for v in eqn.invars])))
        return [read(v) for v in jaxpr.outvars]

    @staticmethod
    def _bind(eqn: Any, invals: list) -> list:
        with _compat.eqn_context(eqn):
            return _compat.bind_eqn(eqn, invals)

    def _scan(self, plan: _Plan, eqns: list, env: dict, read: Callable[[Any], Any]) -> None:
        first = eqns[plan.start:plan.start + plan.period]  # the first copy: the scan's body
        slot_index = {s: n for n, s in enumerate(plan.slots)}

        def body(carry: list, layer: list) -> tuple[list, None]:
            local: dict[tuple[int, int], Any] = {}
            for j, eqn in enumerate(first):
                invals = []
                for kind in plan.operands[j]:
                    if kind[0] == "local":
                        invals.append(local[kind[1:]])
                    elif kind[0] == "leaf":
                        invals.append(layer[kind[1]])
                    elif kind[0] == "carry":
                        invals.append(carry[slot_index[kind[1]]])
                    elif kind[0] == "const":
                        invals.append(read(kind[1]))
                    else:
                        invals.append(kind[1])
                for k, x in enumerate(self._bind(eqn, invals)):
                    local[(j, k)] = x
            return [local[s] for s in plan.slots], None

        # A slot enters as its window's output is typed (a literal 0 is weakly typed).
        init = [jnp.zeros(first[j].outvars[k].aval.shape, first[j].outvars[k].aval.dtype) if v is None
                else _typed(read(v), first[j].outvars[k].aval) for v, (j, k) in zip(plan.init, plan.slots)]
        init = _compat.settle_carry(body, init, [_row(_abstract(x), 0) for x in self.stacked])
        final, _ = jax.lax.scan(body, init, list(self.stacked))
        last = plan.start + plan.period * (plan.count - 1)
        for (j, k), x in zip(plan.slots, final):
            env[eqns[last + j].outvars[k]] = x


def _typed(x: Any, aval: Any) -> Any:
    if getattr(jax.typeof(x), "weak_type", False) != getattr(aval, "weak_type", False) or jnp.dtype(x.dtype) != aval.dtype:
        return jax.lax.convert_element_type(x, aval.dtype)
    return x


# -- trees ----------------------------------------------------------------------------------


def _leaf_keys(tree: PyTree) -> list[tuple]:
    """Each leaf's path as a tuple of plain keys (dict keys, list positions)."""
    out = []
    for path, _ in jax.tree_util.tree_leaves_with_path(tree):
        out.append(tuple(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p))) for p in path))
    return out


def _get(tree: PyTree, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: PyTree, path: tuple, value: Any) -> PyTree:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        return {**tree, head: _set(tree[head], rest, value)}
    items = list(tree)
    items[head] = _set(items[head], rest, value)
    return type(tree)(items) if isinstance(tree, tuple) else items


def _stack_leaves(*xs: Any) -> Any:
    if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
    if all(isinstance(x, np.ndarray) for x in xs):
        return np.stack(xs)
    return jnp.stack(xs)


#: Stands for a block leaf's value in the replay's inputs: the scan reads the stacked leaf instead.
_NO_VALUE = object()


def _abstract(x: Any) -> Any:
    return x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)


def _row(x: Any, i: int) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    if isinstance(x, jax.core.ShapedArray):
        return x.update(shape=x.shape[1:])
    return x[i]
