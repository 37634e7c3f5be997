"""The one place that knows which jax version is installed.

jax moved several shard_map-related APIs between 0.6 and 0.12 (``jax.lax.pvary`` became
``jax.lax.pcast(x, axis, to="varying")``; ``aval.vma`` became ``aval.mat.varying``;
``shard_map`` left ``jax.experimental``). Everything else in jax_drain calls these helpers
instead of checking versions itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Hashable, Iterator

import jax
import jax.numpy as jnp

AxisName = Hashable

from jax.extend.core import Literal  # noqa: E402,F401  (re-exported)
shard_map = jax.shard_map


class MissingJaxInternal(RuntimeError):
    """A jax internal that a jax_drain check relies on is not where this jax_drain expects it.

    Raised instead of silently switching the check off: install a jax version from
    jax_drain's supported range (pyproject.toml).
    """


def _missing(what: str, needed_for: str = "check that gradients are per-device") -> MissingJaxInternal:
    return MissingJaxInternal(
        f"jax {jax.__version__} has no {what}, which jax_drain needs to {needed_for}; install a jax "
        "version jax_drain supports (see its pyproject.toml)"
    )


def mark_varying(x: Any, axes: tuple[AxisName, ...]) -> Any:
    """Casts an axis-invariant value to one that varies along ``axes`` (no communication).

    Differentiating with respect to the varying copy gives per-device gradients; with respect
    to the invariant original, jax's transpose of the implicit cast is a ``psum``.
    """
    axes = tuple(a for a in axes if a not in varying_axes(x))
    if not axes:
        return x
    return jax.lax.pcast(x, axes, to="varying")


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes along which ``x`` varies (jax's varying-manual-axes type).

    Inside ``shard_map(..., check_vma=False)`` nothing is tracked and every value looks
    invariant; callers that need certainty also check :func:`vma_checked`.
    """
    return aval_varying_axes(jax.typeof(x))


def aval_varying_axes(aval: Any) -> frozenset:
    """:func:`varying_axes` of an abstract value: a traced jaxpr variable's ``aval``, or a
    ``jax.eval_shape`` result."""
    vma = getattr(aval, "vma", None)
    if vma is None:
        # jax >= 0.10 keeps it in the manual-axis type: ``mat`` on an aval, ``manual_axis_type``
        # on a ``jax.ShapeDtypeStruct`` (a ``jax.eval_shape`` result).
        mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
        vma = getattr(mat, "varying", None)
    if vma is None and isinstance(aval, jax.ShapeDtypeStruct):
        return frozenset()  # a struct made outside shard_map carries no manual-axis type
    if vma is None:
        raise _missing("varying-axis type on abstract values (aval.vma / aval.mat.varying)")
    return frozenset(vma)


def zeros_of(struct: Any) -> jax.Array:
    """Zeros of a ``jax.eval_shape`` result inside ``shard_map``, varying along the manual axes
    it varies along (so that, e.g., a ``lax.cond`` branch of zeros types like the other)."""
    return mark_varying(jnp.zeros(struct.shape, struct.dtype), tuple(aval_varying_axes(struct)))


def settle_carry(body: Callable[[Any, Any], tuple[Any, Any]], init: Any, x: Any) -> Any:
    """``init`` made to vary along every manual axis that ``body(init, x)[0]`` (a ``lax.scan``
    body's new carry) varies along, so that the loop's carry keeps one type."""
    for _ in range(8):
        out = jax.eval_shape(body, init, x)[0]
        settled = jax.tree.map(lambda a, s: mark_varying(a, tuple(aval_varying_axes(s))), init, out)
        if all(varying_axes(a) == varying_axes(b) for a, b in zip(jax.tree.leaves(settled), jax.tree.leaves(init))):
            return settled
        init = settled
    raise RuntimeError("settle_carry: the carry's varying axes did not settle")  # pragma: no cover


def vma_checked() -> bool:
    """Whether the enclosing ``shard_map`` tracks varying manual axes (``check_vma=True``)."""
    from jax._src import config  # private, but the only source of this fact

    flag = getattr(config, "_check_vma", None)
    if flag is None:
        raise _missing("jax._src.config._check_vma flag")
    return bool(flag.value)


def axis_size(axis: AxisName) -> int:
    """Size of a bound mesh axis; raises ``NameError`` outside ``shard_map``."""
    return jax.lax.axis_size(axis)


def bound_axis_sizes() -> dict:
    """Mesh axes bound by the enclosing ``shard_map``s, with their sizes ({} outside)."""
    from jax._src import core

    get_env = getattr(core, "get_axis_env", None)
    if get_env is None:
        raise _missing("jax._src.core.get_axis_env")
    return dict(get_env().axis_sizes)


def bind_eqn(eqn: Any, invals: list) -> list:
    """Re-binds a jaxpr equation's primitive to new inputs, as ``jax.core.eval_jaxpr`` does, and
    returns its outputs as a list; a ``pvary`` of an input that already varies along some of its
    axes casts along the others."""
    if eqn.primitive.name == "pvary" and len(invals) == 1:
        return [mark_varying(invals[0], tuple(eqn.params["axes"]))]
    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


@contextlib.contextmanager
def eqn_context(eqn: Any) -> Iterator[None]:
    """Re-binds under an equation's own name stack and context (as ``eval_jaxpr`` does), so op
    names -- and the ``named_scope``s the planner reads -- survive a jaxpr replay."""
    from jax._src import source_info_util  # private; only the op names the planner reads
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


#: ``rewrite(sharding, context_mesh) -> sharding`` for the ``with_sharding_constraint`` calls
#: traced inside :func:`rewritten_constraints`; ``None`` everywhere else.
_constraint_rewrite: contextvars.ContextVar[Callable[[Any, Any], Any] | None] = contextvars.ContextVar(
    "jax_drain_constraint_rewrite", default=None)


@contextlib.contextmanager
def rewritten_constraints(rewrite: Callable[[Any, Any], Any]) -> Iterator[None]:
    """Passes the sharding of every ``jax.lax.with_sharding_constraint`` traced in this context
    through ``rewrite(sharding, context_mesh)``, where ``sharding`` is the constraint's own,
    already made a ``Sharding`` (a bare ``PartitionSpec`` on the context mesh), and
    ``context_mesh`` the mesh the constraint is traced under.

    A model's constraints name mesh axes that the step has made manual; jax refuses those inside
    ``shard_map``, and its public API gives no other place to see the sharding before the check.
    Outside this context, and in other threads, constraints are untouched.
    """
    _install_constraint_hook()
    token = _constraint_rewrite.set(rewrite)
    try:
        yield
    finally:
        _constraint_rewrite.reset(token)


@functools.cache
def _install_constraint_hook() -> None:
    from jax._src import pjit  # private: where with_sharding_constraint turns specs into shardings

    original = getattr(pjit, "_create_sharding_for_array", None)
    if original is None:
        raise _missing("jax._src.pjit._create_sharding_for_array",
                       "apply a model's activation constraints inside the step")

    @functools.wraps(original)
    def create_sharding(mesh: Any, x: Any, name: str, api_name: str) -> Any:
        sharding = original(mesh, x, name, api_name)
        rewrite = _constraint_rewrite.get()
        if rewrite is None or api_name != "with_sharding_constraint":
            return sharding
        return rewrite(sharding, mesh)

    pjit._create_sharding_for_array = create_sharding


def distributed_client() -> Any | None:
    """The process's client of JAX's coordination service (its key-value store), or ``None``
    before ``jax.distributed.initialize``; jax's public API does not expose it."""
    from jax._src import distributed  # private: the client jax.distributed.initialize made

    state = getattr(distributed, "global_state", None)
    if state is None or not hasattr(state, "client"):
        raise _missing("jax._src.distributed.global_state.client", "watch the other processes")
    return state.client
