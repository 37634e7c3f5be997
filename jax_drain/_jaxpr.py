"""Reading traced jaxprs: the primitive tables and walkers that jax_drain uses, in one place.

Three readers of traced programs share these tables: the gradient-ready order
(:mod:`jax_drain.order`), the search for the layer scan (:mod:`jax_drain.scan`) and the check
that each bucket chain really sequences its collectives (:func:`collective_dependencies`, used
by the tests on the lowered program of every chain kind).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator, Sequence

from jax.extend.core import Literal

#: Calls that only group code (``jit`` is ``pjit`` in jaxprs): replaying their body in line
#: changes nothing.
PLAIN_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})

#: Primitives that only change a value's varying-axes type (``jax.lax.pvary``/``pcast``): the
#: same value, typed as varying over more axes.
TYPE_CASTS = frozenset({"pvary", "pcast", "pbroadcast"})

#: Primitives that act on a stacked value layer by layer, keeping its leading (layer) axis
#: (:func:`layerwise_outputs`). They carry per-layer state to a layer scan: random keys kept as
#: raw data in ``TrainState.model_state`` made keys again, nnx folding a count into each layer's
#: key, a type cast.
LAYERWISE = TYPE_CASTS | frozenset({"random_wrap", "random_unwrap", "random_fold_in"})


def layerwise_outputs(eqn: Any, operands: Sequence[tuple[int, Any]]) -> list[tuple[Any, Any]]:
    """For a :data:`LAYERWISE` equation and its tracked ``(operand position, label)`` pairs, the
    ``(output var, label)`` pairs: output ``k`` from operand ``k``, the last output where there
    are fewer (``random_fold_in(keys, count)`` has one)."""
    last = len(eqn.outvars) - 1
    return [(eqn.outvars[min(k, last)], label) for k, label in operands]

#: jax.checkpoint / remat's primitive, by the names jax versions have given it.
REMAT = frozenset({"checkpoint", "remat", "remat2"})

#: Call primitives whose body runs once, in line: positions and data flow inside them are those
#: of the caller.
INLINE_CALLS = PLAIN_CALLS | REMAT | frozenset({
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin", "shard_map",
})

#: Primitives that move data between devices.
COLLECTIVES = frozenset({
    "all_to_all", "psum_scatter", "reduce_scatter", "ppermute", "all_gather", "all_gather_invariant",
    "psum", "psum2", "psum_invariant", "pmax", "pmin",
})

_BUCKET = re.compile(r"(jax_drain(?:/[A-Za-z_]+)*/bucket\d+)")


def is_literal(v: Any) -> bool:
    return isinstance(v, Literal)


def call_body(eqn: Any, calls: frozenset = INLINE_CALLS) -> tuple[Any, tuple] | None:
    """``(jaxpr, consts)`` of a call in ``calls`` whose inputs and outputs map one to one to its
    body's, else ``None``."""
    if eqn.primitive.name not in calls:
        return None
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr")))
    if inner is None:
        return None
    jaxpr, consts = (inner.jaxpr, tuple(inner.consts)) if hasattr(inner, "consts") else (inner, ())
    if len(jaxpr.invars) != len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars):
        return None
    return jaxpr, consts


def used_inputs(jaxpr: Any) -> list[bool]:
    """Which of ``jaxpr``'s inputs its outputs depend on: a backward walk from the outputs,
    through plain calls; any other equation reads all its inputs for any output it gives."""
    live = {v for v in jaxpr.outvars if not is_literal(v)}
    for eqn in reversed(jaxpr.eqns):
        wanted = [v in live for v in eqn.outvars]
        if not any(wanted):
            continue
        body = call_body(eqn, PLAIN_CALLS)
        if body is not None:
            inner = body[0]
            sub = used_inputs(inner.replace(outvars=[v for v, w in zip(inner.outvars, wanted) if w]))
            live.update(v for v, u in zip(eqn.invars, sub) if u and not is_literal(v))
        else:
            live.update(v for v in eqn.invars if not is_literal(v))
    return [v in live for v in jaxpr.invars]


def sub_jaxprs(eqn: Any) -> Iterator[Any]:
    """Every jaxpr in an equation's parameters (loop bodies, branches, call bodies)."""
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            item = getattr(item, "jaxpr", item)  # ClosedJaxpr -> Jaxpr
            if hasattr(item, "eqns") and hasattr(item, "outvars"):
                yield item


def bucket_scope(eqn: Any) -> str | None:
    """The ``jax_drain/.../bucket{k}`` scope an equation was traced under, if any."""
    match = _BUCKET.search(str(eqn.source_info.name_stack))
    return match.group(1) if match else None


def collective_dependencies(
    jaxpr: Any, label: Callable[[Any], str | None] = bucket_scope
) -> dict[str, frozenset[str]]:
    """For each label with collectives: the other labels whose collective results its
    collectives consume, directly or through any computation (an optimization barrier included:
    that is how a chain fences a bucket behind its predecessor).

    ``label(eqn)`` names a collective equation's group, by default its bucket scope
    (``jax_drain/bucket3``, ``jax_drain/layers/bucket0``...); ``None`` leaves it out. Data flow
    is followed exactly through inline calls; a loop or branch is one operation whose every
    output depends on every input and on the collectives its body's outputs consume (the body is
    also read, on its own, for the collectives inside it). Pass ``jax.make_jaxpr(step)(...).jaxpr``.
    """
    deps: dict[str, set[str]] = {}
    _walk(jaxpr, [frozenset()] * len(jaxpr.invars), deps, label)
    return {name: frozenset(d - {name}) for name, d in deps.items()}


def _walk(jaxpr: Any, inputs: list[frozenset], deps: dict[str, set[str]], label: Callable) -> list[frozenset]:
    tags: dict[Any, frozenset] = dict(zip(jaxpr.invars, inputs))
    of = lambda v: frozenset() if is_literal(v) else tags.get(v, frozenset())
    for eqn in jaxpr.eqns:
        ins = [of(v) for v in eqn.invars]
        body = call_body(eqn)
        if body is not None:
            outs = _walk(body[0], ins, deps, label)
        else:
            union = frozenset().union(*ins)
            for sub in sub_jaxprs(eqn):  # loop bodies and branches: their own chains
                # ... whose collectives' results reach the loop's outputs.
                union = union.union(*_walk(sub, [frozenset()] * len(sub.invars), deps, label))
            scope = label(eqn) if eqn.primitive.name in COLLECTIVES else None
            if scope is not None:
                deps.setdefault(scope, set()).update(union)
                union = union | {scope}
            outs = [union] * len(eqn.outvars)
        for v, t in zip(eqn.outvars, outs):
            tags[v] = t
    return [of(v) for v in jaxpr.outvars]
