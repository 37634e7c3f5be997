"""The one place that knows which jax version is installed.

jax moved several shard_map-related APIs between 0.6 and 0.12 (``jax.lax.pvary`` became
``jax.lax.pcast(x, axis, to="varying")``; ``aval.vma`` became ``aval.mat.varying``;
``shard_map`` left ``jax.experimental``). Everything else in jax_drain calls these helpers
instead of checking versions itself.
"""

from __future__ import annotations

import contextlib
from typing import Any, Hashable, Iterator

import jax

AxisName = Hashable

try:  # jax >= 0.4.36
    from jax.extend.core import Literal
except ImportError:  # pragma: no cover - older jax
    from jax.core import Literal  # type: ignore[no-redef]

try:  # jax >= 0.7
    shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map  # type: ignore[no-redef]


def mark_varying(x: Any, axes: tuple[AxisName, ...]) -> Any:
    """Casts an axis-invariant value to one that varies along ``axes`` (no communication).

    Differentiating with respect to the varying copy gives per-device gradients; with respect
    to the invariant original, jax's transpose of the implicit cast is a ``psum``.
    """
    axes = tuple(a for a in axes if a not in varying_axes(x, default=frozenset()))
    if not axes:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    if hasattr(jax.lax, "pvary"):  # pragma: no cover - jax < 0.10
        return jax.lax.pvary(x, axes)
    return x  # pragma: no cover - jax without varying-type tracking


def varying_axes(x: Any, default: frozenset | None = None) -> frozenset | None:
    """The manual mesh axes along which ``x`` varies, or ``default`` when jax does not track it.

    Inside ``shard_map(..., check_vma=False)`` nothing is tracked and every value looks
    invariant; callers that need certainty also check :func:`vma_checked`.
    """
    aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
    vma = getattr(aval, "vma", None)  # jax 0.6 - 0.9
    if vma is None:
        mat = getattr(aval, "mat", None)  # jax >= 0.10
        vma = getattr(mat, "varying", None)
    return frozenset(vma) if vma is not None else default


def vma_checked() -> bool:
    """Whether the enclosing ``shard_map`` tracks varying manual axes (``check_vma=True``)."""
    from jax._src import config  # private, but the only source of this fact

    flag = getattr(config, "_check_vma", None)
    return bool(flag.value) if flag is not None else False


def axis_size(axis: AxisName) -> int:
    """Size of a bound mesh axis; raises ``NameError`` outside ``shard_map``."""
    return jax.lax.axis_size(axis) if hasattr(jax.lax, "axis_size") else jax.lax.psum(1, axis)


def bound_axis_sizes() -> dict:
    """Mesh axes bound by the enclosing ``shard_map``s, with their sizes ({} outside)."""
    from jax._src import core

    get_env = getattr(core, "get_axis_env", None)
    if get_env is None:  # pragma: no cover - older jax
        return {}
    return dict(get_env().axis_sizes)


def bind_eqn(eqn: Any, invals: list) -> Any:
    """Re-binds a jaxpr equation's primitive to new inputs, as ``jax.core.eval_jaxpr`` does."""
    return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))


@contextlib.contextmanager
def eqn_context(eqn: Any) -> Iterator[None]:
    """Re-binds under an equation's own name stack and context (as ``eval_jaxpr`` does), so op
    names -- and the ``named_scope``s the planner reads -- survive a jaxpr replay."""
    try:
        from jax._src import source_info_util  # private; only for names, so optional
    except ImportError:  # pragma: no cover - a jax without it
        yield
        return
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    ctx = getattr(eqn, "ctx", None)
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
        with (ctx.manager if ctx is not None else contextlib.nullcontext()):
            yield


def scan_counts(params: dict) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's flat inputs (consts, carry, xs).

    jax <= 0.11 stores the counts; jax 0.12 stores ``ft_in``, a flat tree of
    ``(consts, carry, xs)`` whose parts have one leaf per flat input.
    """
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)
