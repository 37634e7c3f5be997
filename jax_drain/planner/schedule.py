"""Read XLA's scheduled HLO text (``compiled.as_text()``): collectives, overlap, live bytes.

Pure text parsing; nothing is compiled here. In a scheduled module (``is_scheduled=true``) every
computation is printed in its schedule order, so an instruction's position in its computation is
its schedule index.

The XLA:GPU forms understood (as printed by jaxlib 0.10):

* dedicated async pairs ``all-reduce-start/done``, ``all-gather-start/done``,
  ``reduce-scatter-start/done``, ``all-to-all-start/done``, ``collective-permute-start/done``;
* generic ``async-start``/``async-update``/``async-done`` whose ``calls=`` computation has a
  collective as its root;
* plain synchronous collectives (``all-reduce(...)`` etc.).

Example::

    sched = parse_schedule(compiled.as_text())
    rs = [c for c in sched.collectives if c.kind == "reduce-scatter"]
    sched.max_in_flight(lambda c: c.in_scope("jax_drain/bucket"))
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "COLLECTIVE_KINDS",
    "COMPUTE_OPCODES",
    "Collective",
    "Instruction",
    "Schedule",
    "expand_op_name",
    "parse_schedule",
    "replica_group_size",
    "shape_bytes",
    "shape_dtypes",
]

#: The collective opcodes the parser reads, in the order reports list them.
COLLECTIVE_KINDS = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "collective-permute",
)

COMPUTE_OPCODES = frozenset(
    {
        "fusion",
        "custom-call",  # cuBLAS/cuDNN GEMMs and convolutions
        "dot",
        "convolution",
        "reduce",
        "reduce-window",
        "select-and-scatter",
        "scatter",
        "gather",
        "sort",
        "while",  # loops, calls and conditionals run their bodies' kernels
        "call",
        "conditional",
    }
)
"""Opcodes counted as compute when deciding whether a collective is overlapped."""

# Results that allocate nothing: views, tuple plumbing, and argument/constant memory.
_NON_ALLOCATING = frozenset(
    {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "opt-barrier"}
)

_ELEMENT_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMMENT_RE = re.compile(r"/\*.*?\*/")
# " = " with spaces: attribute lines of wrapped instructions ("calls=x, ...") have none.
_INSTRUCTION_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*)$")
_HEADER_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*(->.*)?\{\s*$")
_OPCODE_RE = re.compile(r"([a-z][\w\-]*)\(")
_CALLED_RE = re.compile(
    r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)|\bbranch_computations=\{([^}]*)\}"
)
_OP_NAME_RE = re.compile(r'\bop_name="((?:[^"\\]|\\.)*)"')
_IS_SYNC_RE = re.compile(r'"is_sync"\s*:\s*(true|false)')
_MESH_GROUPS_RE = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_IOTA_GROUPS_RE = re.compile(r"\breplica_groups=\[(\d+),(\d+)\]<=")
_LIST_GROUPS_RE = re.compile(r"\breplica_groups=\{\{([\d,\s]+)\}")


def _element_bits(dtype: str) -> int:
    if dtype in _ELEMENT_BITS:
        return _ELEMENT_BITS[dtype]
    # fp8/fp6/fp4 variants (f8e4m3fn, f4e2m1fn, ...) carry their width after the 'f'.
    m = re.fullmatch(r"f(\d+)e\d+m\d+\w*", dtype)
    if m:
        return int(m.group(1))
    raise ValueError(f"unknown HLO element type {dtype!r}; add its width to _ELEMENT_BITS")


def _arrays(shape: str) -> list[tuple[str, int]]:
    """(dtype, element count) of each array in a shape; layouts ``{1,0}`` are skipped."""
    # Layouts and tiling live inside {...}; drop them so "T(8,128)" is not read as an array.
    depth, kept = 0, []
    for ch in shape:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            kept.append(ch)
    out = []
    for dtype, dims in _ARRAY_RE.findall("".join(kept)):
        sizes = [int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip()]
        out.append((dtype, math.prod(sizes)))
    return out


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (tuples summed, dynamic dims at their bound).

    Example::

        >>> shape_bytes("(bf16[128,1024]{1,0}, f32[])")
        262148
    """
    return sum(math.ceil(n * _element_bits(dt) / 8) for dt, n in _arrays(shape))


def shape_dtypes(shape: str) -> tuple[str, ...]:
    """Distinct element types of a shape in order of appearance.

    Example::

        >>> shape_dtypes("(f32[8]{0}, bf16[4]{0}, f32[])")
        ('f32', 'bf16')
    """
    return tuple(dict.fromkeys(dt for dt, _ in _arrays(shape)))


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``text[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        ch = text[i]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i
    raise ValueError(f"unbalanced brackets in HLO text: {text[start:start + 80]!r}")


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split at ``sep`` outside any brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape; ``[shape]`` for an array."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    return _split_top(shape[1 : _matching(shape, 0)])


def expand_op_name(op_name: str) -> tuple[str, ...]:
    """Op names that XLA's combiners merged into one, e.g. by the reduce-scatter combiner.

    Example::

        >>> expand_op_name("jit(f)/jax_drain/(bucket0/reduce_scatter:bucket1/reduce_scatter)")
        ('jit(f)/jax_drain/bucket0/reduce_scatter', 'jit(f)/jax_drain/bucket1/reduce_scatter')

    The common prefix is cut by characters, so it may open a scope the parts close::

        >>> expand_op_name("jvp(gather/(bucket4)/ag:bucket3)/ag)")
        ('jvp(gather/bucket4)/ag', 'jvp(gather/bucket3)/ag')
    """
    if not op_name.endswith(")"):
        return (op_name,)
    # Find the "(" that closes at the end; "jit(f)" inside the prefix must not match.
    depth = 0
    for i in range(len(op_name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(op_name[i], 0)
        if depth == 0:
            break
    prefix, group = op_name[:i], op_name[i + 1 : -1]
    parts = _split_top(group, ":")
    if (prefix and not prefix.endswith("/")) or len(parts) < 2:
        # The prefix ends inside an open scope: the group is the last "/(" ... ")" whose parts
        # (split at every ":") are at least two.
        for j in range(len(op_name) - 2, -1, -1):
            if op_name.startswith("/(", j) and len(parts := op_name[j + 2 : -1].split(":")) >= 2:
                return tuple(op_name[: j + 1] + part for part in parts)
        return (op_name,)
    return tuple(name for part in parts for name in expand_op_name(prefix + part))


def replica_group_size(attributes: str) -> int | None:
    """Devices per replica group of a collective, from its attributes: the list form
    ``replica_groups={{0,1},{2,3}}``, the iota form ``replica_groups=[G,S]<=[...]`` or the mesh
    form of newer XLA ``replica_groups=mesh['data'=4,'model'=2] {'data'}``; ``None`` when the
    groups are empty (every device) or absent.

    Example::

        >>> replica_group_size("channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}")
        2
        >>> replica_group_size("replica_groups={{0,1,2,3},{4,5,6,7}}")
        4
        >>> replica_group_size("replica_groups=mesh['replica'=2,'data'=4] {'data'}, dimensions={0}")
        4
    """
    if m := _MESH_GROUPS_RE.search(attributes):
        sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        return math.prod(sizes[name] for name in re.findall(r"'([^']+)'", m.group(2)) if name in sizes)
    if m := _IOTA_GROUPS_RE.search(attributes):
        return int(m.group(2))
    if m := _LIST_GROUPS_RE.search(attributes):
        return len([d for d in m.group(1).split(",") if d.strip()])
    return None


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction as printed: ``[ROOT] %name = shape opcode(operands), attributes``."""

    name: str
    opcode: str
    shape: str  # as printed, layouts included
    operands: tuple[str, ...]
    op_name: str  # metadata op_name, "" if none
    called: tuple[str, ...]  # computations named by calls=/to_apply=/body=/condition=/branches
    attributes: str  # the raw text after the operand list
    is_root: bool = False

    @property
    def bytes(self) -> int:
        return shape_bytes(self.shape)

    @property
    def dtype(self) -> str:
        """Element type, or comma-joined types for a mixed tuple ("" for a token/empty tuple)."""
        return ",".join(shape_dtypes(self.shape))


def _parse_instruction(text: str) -> Instruction:
    m = _INSTRUCTION_RE.match(text)
    if m is None:
        raise ValueError(f"not an HLO instruction: {text[:120]!r}")
    is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3).strip()
    if rest.startswith("("):
        end = _matching(rest, 0) + 1
    else:
        end = rest.find(" ")
        end = len(rest) if end < 0 else end
    shape, rest = rest[:end], rest[end:].lstrip()
    om = _OPCODE_RE.match(rest)
    if om is None:
        raise ValueError(f"cannot find the opcode of HLO instruction {name!r}: {text[:160]!r}")
    opcode = om.group(1)
    close = _matching(rest, om.end() - 1)
    operands = tuple(
        # Operands print as "%x" or, in long form, "f32[8]{0} %x"; the name is the last token.
        part.split()[-1].lstrip("%")
        for part in _split_top(rest[om.end() : close])
    )
    attributes = rest[close + 1 :].lstrip(", ").strip()
    called: list[str] = []
    for single, branches in _CALLED_RE.findall(attributes):
        called.extend([single] if single else [b.strip().lstrip("%") for b in branches.split(",")])
    op = _OP_NAME_RE.search(attributes)
    return Instruction(
        name=name,
        opcode=opcode,
        shape=shape,
        operands=operands,
        op_name=op.group(1) if op else "",
        called=tuple(c for c in called if c),
        attributes=attributes,
        is_root=is_root,
    )


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective as scheduled. ``start == done`` for a plain synchronous op."""

    name: str  # HLO name of the start op (or of the sync op)
    kind: str  # one of COLLECTIVE_KINDS
    dtype: str  # payload element type, e.g. "bf16"; comma-joined if a combined op mixes types
    bytes: int  # payload bytes: the collective's result (all results if combined)
    start: int  # schedule index in `computation`
    done: int  # schedule index of the matching done
    computation: str  # computation it is scheduled in (ENTRY, a while body, ...)
    op_name: str  # metadata op_name; combined ops carry "prefix/(a:b:c)", see op_names
    overlapped: bool  # compute scheduled strictly between start and done (never for is_sync)
    is_sync: bool  # XLA runs it synchronously on the compute stream
    group_size: int | None = None  # devices per replica group (None: every device / unknown)

    @property
    def op_names(self) -> tuple[str, ...]:
        """The op names of the collectives combined into this one (see :func:`expand_op_name`)."""
        return expand_op_name(self.op_name) if self.op_name else ()

    def in_scope(self, scope: str) -> bool:
        """Whether any combined op name contains ``scope``, e.g. ``"jax_drain/bucket"``."""
        return any(scope in name for name in self.op_names)


Selector = Callable[[Collective], bool] | str | None


def _selector(select: Selector) -> Callable[[Collective], bool]:
    if select is None:
        return lambda c: True
    if isinstance(select, str):
        if select not in COLLECTIVE_KINDS:
            raise ValueError(f"unknown collective kind {select!r}; use one of {COLLECTIVE_KINDS}")
        return lambda c: c.kind == select
    return select


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Scheduled computations of an HLO module and the collectives found in them."""

    computations: Mapping[str, Sequence[Instruction]]  # name -> instructions in schedule order
    entry: str
    collectives: tuple[Collective, ...]

    def max_in_flight(self, select: Selector = None) -> int:
        """Most selected collectives in flight at once within any one computation.

        A collective is in flight from its start to its done, both inclusive; a synchronous one
        (``is_sync``) only at its start, because XLA runs it there on the compute stream.
        ``select`` is a predicate on :class:`Collective` or a kind such as ``"reduce-scatter"``.

        Example::

            >>> sched.max_in_flight(lambda c: c.in_scope("jax_drain/bucket"))  # doctest: +SKIP
            2
        """
        keep = _selector(select)
        best = 0
        for comp in self.computations:
            events: list[tuple[int, int]] = []
            for c in self.collectives:
                if c.computation == comp and keep(c):
                    events.append((c.start, 1))
                    # Ends sort after starts at the same index, so both-inclusive holds.
                    events.append((c.start if c.is_sync else c.done, 2))
            live = 0
            for _, kind in sorted(events):
                live += 1 if kind == 1 else -1
                best = max(best, live)
        return best

    def feeding_op_names(self, c: Collective, depth: int = 8) -> tuple[str, ...]:
        """Op names of the nearest named producers of collective ``c``'s operands.

        XLA's all-reduce combiner may concatenate independent all-reduces (e.g. one chain's last
        bucket and another chain's first, both over the same axis) into one op *without* an op
        name; its operands still tell which ops it carries. Unnamed producers (bitcasts,
        tuples, ...) are walked through, up to ``depth`` steps back, within ``c``'s computation.

        Example::

            >>> sched.feeding_op_names(merged)  # doctest: +SKIP
            ('jit(step)/jax_drain/bucket5/reduce_scatter', 'jit(step)/jax_drain/expert/bucket0/...')
        """
        instrs = {i.name: i for i in self.computations[c.computation]}
        names: list[str] = []
        frontier, seen = list(instrs[c.name].operands), set()
        for _ in range(depth):
            upstream = []
            for n in frontier:
                if n in seen or n not in instrs:
                    continue
                seen.add(n)
                if instrs[n].op_name:
                    names.extend(expand_op_name(instrs[n].op_name))
                else:
                    upstream.extend(instrs[n].operands)
            frontier = upstream
        return tuple(names)

    def op_names_of(self, c: Collective) -> tuple[str, ...]:
        """``c``'s own op names, or, for a combined collective XLA left unnamed, the op names
        that feed it (:meth:`feeding_op_names`): what to attribute ``c`` by.

        Example::

            >>> [n for c in sched.collectives for n in sched.op_names_of(c)]  # doctest: +SKIP
        """
        return c.op_names or self.feeding_op_names(c)

    def feeds_f32_reduce(self, collective: Collective) -> bool:
        """Whether the collective's result feeds a float32 sum in its own computation.

        Follows views of the result (bitcast, get-tuple-element, copy, reshape) to the first
        instruction that computes a float32 value with a float32 ``reduce`` or ``add`` (itself or
        fused inside): the local fp32 sum of the rows an all-to-all received, for example, which
        the library writes as one add per sender.
        """
        instrs = self.computations[collective.computation]
        derived = {instrs[collective.done].name}
        for ins in instrs[collective.done + 1 :]:
            if not derived.intersection(ins.operands):
                continue
            if ins.opcode in ("bitcast", "get-tuple-element", "copy", "reshape"):
                derived.add(ins.name)
                continue
            fused = [i for c in ins.called for i in self.computations.get(c, ())]
            if "f32" in ins.dtype and any(i.opcode in ("reduce", "add") and i.dtype == "f32" for i in [ins, *fused]):
                return True
        return False

    def live_bytes(self) -> list[int]:
        """Approximate bytes live after each ENTRY instruction (one entry per instruction).

        A liveness simulation, not XLA's buffer assignment: every allocating instruction's result
        is live from its schedule index through the last use of it or of anything aliasing it.
        Parameters (argument memory), constants, bitcasts, get-tuple-element, tuple and
        ``*-done`` ops (they return the start's buffer) allocate nothing; a ``*-start`` allocates
        its result part only and keeps its operands live until the done; a while loop reuses its
        operand's buffers. Outputs stay live to the end. Not modelled: temporaries inside called
        computations (while bodies), in-place fusions, buffer reuse and alignment, so compare its
        peak with ``memory_analysis()`` only loosely.

        Example::

            >>> max(parse_schedule(compiled.as_text()).live_bytes())  # doctest: +SKIP
            25165824
        """
        instrs = list(self.computations[self.entry])
        owners: dict[str, frozenset[str]] = {}  # name -> allocating instructions it refers to
        size: dict[str, int] = {}
        born: dict[str, int] = {}
        last: dict[str, int] = {}
        for i, ins in enumerate(instrs):
            operand_owners = frozenset().union(*(owners.get(o, frozenset()) for o in ins.operands))
            for o in operand_owners:
                last[o] = i
            if ins.opcode in ("parameter", "constant"):
                owners[ins.name] = frozenset()
            elif ins.opcode in _NON_ALLOCATING or ins.opcode == "while":
                owners[ins.name] = operand_owners
            elif _is_done(ins.opcode):
                start = ins.operands[0] if ins.operands else ""
                mine = frozenset({start}) & frozenset(size)
                owners[ins.name] = mine or operand_owners
            else:
                size[ins.name] = _allocated_bytes(ins)
                born[ins.name] = last[ins.name] = i
                extra = operand_owners if _is_start(ins.opcode) else frozenset()
                owners[ins.name] = frozenset({ins.name}) | extra
            if ins.is_root:
                for o in owners[ins.name]:
                    last[o] = len(instrs) - 1
        curve = [0] * (len(instrs) + 1)
        for name, nbytes in size.items():
            curve[born[name]] += nbytes
            curve[last[name] + 1] -= nbytes
        out, live = [], 0
        for delta in curve[:-1]:
            live += delta
            out.append(live)
        return out


def _is_start(opcode: str) -> bool:
    return opcode.endswith("-start")


def _is_done(opcode: str) -> bool:
    return opcode.endswith("-done") or opcode == "async-update"


def _allocated_bytes(ins: Instruction) -> int:
    # "*-start" tuples lead with (aliases of) their operands; the rest is result and context.
    # all-reduce-start is the exception: its shape is the result alone.
    if _is_start(ins.opcode) and ins.opcode != "all-reduce-start" and ins.shape.startswith("("):
        return sum(shape_bytes(e) for e in _tuple_elements(ins.shape)[1:])
    return ins.bytes


def _split_computations(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
    computations: dict[str, list[Instruction]] = {}
    entry = name = ""
    inside = False
    statements: list[str] = []
    for raw in hlo_text.splitlines():
        line = _COMMENT_RE.sub("", raw).strip()
        if not line:
            continue
        if not inside:
            m = _HEADER_RE.match(line)
            if m and not _INSTRUCTION_RE.match(line):
                name, statements, inside = m.group(2), [], True
                if m.group(1):
                    entry = name
            continue
        if _INSTRUCTION_RE.match(line):
            statements.append(line)
        elif line.startswith("}"):
            computations[name] = [_parse_instruction(s) for s in statements]
            inside = False
        elif statements:
            # Hand-written HLO may wrap an instruction's attributes over several lines.
            statements[-1] += " " + line
    if inside:
        raise ValueError(f"HLO computation {name!r} is not closed with '}}'")
    return computations, entry


def _root_collective(
    computations: Mapping[str, Sequence[Instruction]], names: Sequence[str]
) -> Instruction | None:
    for comp in names:
        for ins in computations.get(comp, ()):
            if ins.is_root and ins.opcode in COLLECTIVE_KINDS:
                return ins
    return None


def _find_done(instrs: Sequence[Instruction], start: int) -> int:
    """Index of the done closing the async op started at ``start`` (through async-updates)."""
    handle = instrs[start].name
    for j in range(start + 1, len(instrs)):
        ins = instrs[j]
        if ins.operands[:1] == (handle,):
            if ins.opcode == "async-update":
                handle = ins.name
            elif ins.opcode.endswith("-done"):
                return j
    raise ValueError(
        f"no done op for {instrs[start].name!r} in its computation; pass a complete scheduled "
        "module (compiled.as_text())"
    )


def _is_sync(ins: Instruction) -> bool:
    m = _IS_SYNC_RE.search(ins.attributes)
    return bool(m) and m.group(1) == "true"


def _collectives(computations: Mapping[str, Sequence[Instruction]]) -> list[Collective]:
    # Computations wrapped by async-start hold the collective they run; count it at the start.
    wrapped = {
        c
        for instrs in computations.values()
        for ins in instrs
        if ins.opcode.startswith("async-")
        for c in ins.called
    }
    found = []
    for comp, instrs in computations.items():
        if comp in wrapped:
            continue
        for i, ins in enumerate(instrs):
            if ins.opcode in COLLECTIVE_KINDS:
                kind, done, sync = ins.opcode, i, True
                payload = grouped = ins
            elif _is_start(ins.opcode) and ins.opcode.removesuffix("-start") in COLLECTIVE_KINDS:
                kind = ins.opcode.removesuffix("-start")
                done, sync = _find_done(instrs, i), _is_sync(ins)
                payload, grouped = instrs[done], ins
            elif ins.opcode == "async-start":
                inner = _root_collective(computations, ins.called)
                if inner is None:
                    continue
                kind, done, sync = inner.opcode, _find_done(instrs, i), _is_sync(ins)
                payload, grouped = instrs[done], inner  # the wrapped op carries the groups
            else:
                continue
            between = instrs[i + 1 : done]
            found.append(
                Collective(
                    name=ins.name,
                    kind=kind,
                    dtype=payload.dtype,
                    bytes=payload.bytes,
                    start=i,
                    done=done,
                    computation=comp,
                    op_name=ins.op_name,
                    overlapped=not sync and any(b.opcode in COMPUTE_OPCODES for b in between),
                    is_sync=sync,
                    group_size=replica_group_size(grouped.attributes),
                )
            )
    return found


def parse_schedule(hlo_text: str) -> Schedule:
    """Parse scheduled HLO text, e.g. ``jax.jit(f).lower(...).compile().as_text()``.

    Example::

        >>> sched = parse_schedule(compiled.as_text())  # doctest: +SKIP
        >>> [(c.kind, c.dtype, c.bytes) for c in sched.collectives]  # doctest: +SKIP
        [('reduce-scatter', 'f32', 524288)]
    """
    text = hlo_text.lstrip()
    if text.startswith("module") or "func.func" in text[:2000]:
        raise ValueError(
            "this is StableHLO (lowered.as_text()); pass the compiled module's text: "
            "jax.jit(f).lower(...).compile().as_text()"
        )
    first = text.split("\n", 1)[0]
    if not first.startswith("HloModule") or "is_scheduled=true" not in first:
        raise ValueError(
            "expected scheduled HLO text starting with 'HloModule ..., is_scheduled=true'; pass "
            "compiled.as_text() (after .compile()), not lowered or unscheduled HLO"
        )
    computations, entry = _split_computations(hlo_text)
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text; pass a whole module")
    return Schedule(
        computations=computations,
        entry=entry,
        collectives=tuple(_collectives(computations)),
    )
