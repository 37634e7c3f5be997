"""What a loss function may return to a sync: a mean, or a weighted sum (per-token losses).

A data-parallel mean of per-device means is the global mean only when every device (and every
micro-batch) holds the same number of examples that count. With padding or masked tokens it is
not: return ``WeightedLoss(total, count)`` (the sum of the per-token losses and how many tokens
count) and the gradient becomes that of the global sum divided by the global count, over all
devices and micro-batches, the reported loss the global per-token mean.

Example::

    def loss_fn(params, batch):
        nll = per_token_nll(params, batch)             # [batch, seq]
        mask = batch["mask"]                           # 1 where the token counts
        return jd.WeightedLoss(jnp.sum(nll * mask), jnp.sum(mask))
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_drain import _compat


class WeightedLoss(NamedTuple):
    """A loss as ``total`` (a sum over what counts) and ``count`` (how much counts); a pytree."""

    total: jax.Array
    count: jax.Array


class LocalStep(NamedTuple):
    """One device's loss on one micro-batch, split into what the syncs need."""

    total: jax.Array  # float32: the mean loss, or a WeightedLoss's total
    count: jax.Array | None  # float32 count of a WeightedLoss, else None
    aux: Any
    state: Any  # the loss function's new state (has_state), else None


def local_value_and_grad(
    loss_fn: Callable[..., Any], has_aux: bool, has_state: bool
) -> Callable[..., tuple[LocalStep, Any]]:
    """``fn(params, state, args, kwargs) -> (LocalStep, grads)``: ``jax.value_and_grad`` of
    ``loss_fn`` w.r.t. ``params``, whatever its output form.

    ``loss_fn(params, *args)`` (or ``loss_fn(params, state, *args)`` with ``has_state``, then
    returning ``(output, new_state)``) returns a scalar or a :class:`WeightedLoss`, or with
    ``has_aux`` ``(that, aux)``.
    """

    def scalar(params: Any, state: Any, args: tuple, kwargs: dict):
        out = loss_fn(params, state, *args, **kwargs) if has_state else loss_fn(params, *args, **kwargs)
        step = split_output(out, has_aux, has_state)
        return step.total, (step.count, step.aux, step.state)

    grad = jax.value_and_grad(scalar, has_aux=True)

    def fn(params: Any, state: Any, args: tuple, kwargs: dict) -> tuple[LocalStep, Any]:
        (total, (count, aux, new_state)), grads = grad(params, state, args, kwargs)
        return LocalStep(total, count, aux, new_state), grads

    return fn


def _pair(out: Any, rule: str) -> tuple[Any, Any]:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(f"{rule}, a pair; got {type(out).__name__} {out!r:.60}")
    return out[0], out[1]


def split_output(out: Any, has_aux: bool, has_state: bool) -> LocalStep:
    """A loss function's output as a :class:`LocalStep` (see :func:`local_value_and_grad`)."""
    new_state = None
    if has_state:
        out, new_state = _pair(out, "has_state=True: loss_fn returns (output, new_state)")
    value, aux = _pair(out, "has_aux=True: loss_fn returns (loss, aux)") if has_aux else (out, None)
    if isinstance(value, WeightedLoss):
        total, count = value.total, jnp.asarray(value.count, jnp.float32)
    else:
        check_loss_value(value)
        total, count = value, None
    if jnp.ndim(total) != 0:
        raise ValueError(
            f"loss_fn must return a scalar loss (or jax_drain.WeightedLoss of scalars), got shape {jnp.shape(total)}")
    if not jnp.issubdtype(jnp.result_type(total), jnp.floating):
        # An integer or boolean loss has no gradient: cast to float it would train on zeros.
        raise ValueError(
            f"loss_fn returned a loss of dtype {jnp.result_type(total)}, which has no gradient (every update would "
            "be zero); compute the loss in floating point (e.g. from the logits, not from argmax or counts)")
    return LocalStep(jnp.asarray(total, jnp.float32), count, aux, new_state)


def check_loss_varies(total: jax.Array, data_axes: tuple[str, ...]) -> None:
    """Refuses a loss that is the same on every device along a data-parallel axis.

    Inside ``shard_map`` each device's loss varies along the data axes (it reads its own
    examples), unless the loss itself already reduced over them (a ``jax.lax.pmean`` of the
    loss). The sync then averages an average: the value is right but every device's gradient
    is that of the global loss, and their mean is off. Collectives over the data axes inside
    the model (``BatchNorm(axis_name=...)``) leave the loss varying and are fine.
    """
    if not _compat.vma_checked():  # nothing is tracked: every value looks invariant (refused elsewhere)
        return
    invariant = [a for a in data_axes if a not in _compat.varying_axes(total)]
    if invariant:
        raise ValueError(
            f"loss_fn's loss is the same on every device along the data-parallel axes {invariant}: the loss "
            "already reduced over them (a jax.lax.pmean or psum of it over a data axis?), and the step averages "
            "the devices' losses and gradients itself, so the gradient would be wrong. Return this device's own "
            "loss (the mean over its examples), or jax_drain.WeightedLoss(total, count) for a mean over the "
            "tokens of all devices; collectives over the data axes inside the model (BatchNorm(axis_name=...)) "
            "stay allowed")


#: What a loss may return, for error messages.
LOSS_FORMS = ("a scalar mean loss (a jax array or Python float), or jax_drain.WeightedLoss(total, count) for a "
              "per-token loss")


def check_loss_value(value: Any) -> None:
    """Raises a ``ValueError`` saying what a loss may return unless ``value`` is a scalar-like
    array or number (its shape is checked afterwards).

    A tuple is the usual mistake: Flax linen's ``module.apply(..., mutable=[...])`` returns
    ``(output, updates)``, and a loss passing that on returns ``(loss, updates)``, which
    :func:`jax_drain.make_train_step` takes only when told which collections are mutable.
    """
    if isinstance(value, (jax.Array, np.ndarray, np.generic, int, float)) and not isinstance(value, bool):
        return
    if isinstance(value, (tuple, list)):
        raise ValueError(
            f"loss_fn returned a {type(value).__name__} of {len(value)}; a loss returns {LOSS_FORMS}. "
            "Flax linen's mutable collections (batch statistics) are returned as (loss, updates), "
            "updates being what module.apply(variables, x, mutable=['batch_stats']) returns, by a "
            "loss_fn(variables, batch) given to jd.make_train_step(variables, loss_fn, tx, mesh, "
            "mutable=['batch_stats']); an nnx model updates its state in place and returns the loss only"
        )
    raise ValueError(f"loss_fn returned a {type(value).__name__}; a loss returns {LOSS_FORMS}")


def pack_value(loss: jax.Array, aux: Any, state: Any, has_aux: bool, has_state: bool) -> Any:
    """The ``value`` a sync's ``value_and_grad`` returns: ``loss``, ``(loss, aux)``, and with
    ``has_state`` ``(that, new_state)``."""
    value = (loss, aux) if has_aux else loss
    return (value, state) if has_state else value
