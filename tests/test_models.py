"""Tests for jax_drain.models: parameter counts, pytree shape, loss correctness."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import data_mesh
from helpers import assert_within_rounding, rounding_bound, rounding_chain, typical_rounding
from jax_drain import _compat
from jax_drain.models import (
    PRESETS,
    GPTConfig,
    abstract_params,
    example_batch,
    init_params,
    leaf_paths,
    make_forward,
    make_loss,
    preset,
)

TINY_F32 = dataclasses.replace(preset("tiny"), param_dtype=jnp.float32)
TINY_TIED_F32 = dataclasses.replace(preset("tiny-tied"), param_dtype=jnp.float32)


@functools.cache
def _value_and_grad(config: GPTConfig):
    """One compiled value-and-grad per config, shared by the tests (compiling dominates their time)."""
    return jax.jit(jax.value_and_grad(make_loss(config)))


@functools.cache
def _params(config: GPTConfig):
    return init_params(config, jax.random.key(0))


def _size(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def _norm(arrays: list[np.ndarray]) -> float:
    return math.sqrt(sum(float(np.vdot(x, x)) for x in arrays))


def _chain(config: GPTConfig, params, batch, gradient: bool = True) -> int:
    """Roundings on the longest chain of the model's loss (or its gradient) on ``batch``."""
    loss = make_loss(config)
    return rounding_chain(jax.grad(loss) if gradient else loss, params, batch)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_num_params_matches_abstract_leaves(name):
    config = preset(name)
    assert _size(abstract_params(config)) == config.num_params()


def test_preset_param_counts():
    assert preset("gpt-blocks").num_params() == 402_722_816
    assert preset("gpt-tied").num_params() == 402_722_816 + 32768 * 2048


@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_init_matches_abstract(name):
    config = preset(name)
    params = init_params(config, jax.random.key(0))
    shapes = abstract_params(config)
    assert _size(params) == config.num_params()
    assert jax.tree.structure(params) == jax.tree.structure(shapes)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params))
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(shapes))
    for leaf, spec in zip(jax.tree.leaves(params), jax.tree.leaves(shapes)):
        assert (leaf.shape, leaf.dtype) == (spec.shape, spec.dtype)
        assert leaf.dtype == jnp.bfloat16


def test_tiny_tied_leaf_paths_and_single_embedding():
    params = abstract_params(preset("tiny-tied"))
    block = [
        "attn/out/kernel", "attn/qkv/kernel", "ln_attn/bias", "ln_attn/scale",
        "ln_mlp/bias", "ln_mlp/scale", "mlp/fc_in/kernel", "mlp/fc_out/kernel",
    ]  # fmt: skip
    expected = [f"blocks/{i}/{p}" for i in range(2) for p in block]
    expected += ["embed/embedding", "ln_f/bias", "ln_f/scale"]
    assert leaf_paths(params) == expected
    assert params["embed"]["embedding"].shape == (512, 256)
    assert params["blocks"][0]["attn"]["qkv"]["kernel"].shape == (256, 768)


def test_scan_layers_stacks_blocks():
    config = dataclasses.replace(preset("tiny"), scan_layers=True)
    params = abstract_params(config)
    assert _size(params) == config.num_params()
    assert params["blocks"]["attn"]["qkv"]["kernel"].shape == (2, 256, 768)


def test_unknown_preset_lists_names():
    with pytest.raises(ValueError, match="tiny-tied"):
        preset("nope")


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=100, num_heads=3)
    with pytest.raises(ValueError, match="vocab_size"):
        GPTConfig(vocab_size=1)
    with pytest.raises(ValueError, match="floating"):
        GPTConfig(param_dtype=jnp.int32)
    assert GPTConfig(param_dtype=np.float32) == GPTConfig(param_dtype=jnp.float32)


def test_example_batch_specs():
    assert example_batch(preset("tiny-tied"), 3)["tokens"] == jax.ShapeDtypeStruct((3, 65), jnp.int32)
    spec = example_batch(preset("tiny"), 3)
    assert spec["x"] == spec["y"] == jax.ShapeDtypeStruct((3, 64, 256), jnp.bfloat16)
    tokens = example_batch(preset("tiny-tied"), 3, jax.random.key(0))["tokens"]
    assert tokens.dtype == jnp.int32 and 0 <= int(tokens.min()) and int(tokens.max()) < 512


def test_loss_rejects_params_of_another_config():
    tiny, tied = preset("tiny"), preset("tiny-tied")
    with pytest.raises(ValueError, match="init_params"):
        jax.eval_shape(make_loss(tiny), abstract_params(tied), example_batch(tiny, 2))


@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_loss_is_finite_float32_scalar(name):
    config = preset(name)
    loss = make_loss(config)
    out = jax.eval_shape(loss, abstract_params(config), example_batch(config, 2))
    assert out == jax.ShapeDtypeStruct((), jnp.float32)
    batch = example_batch(config, 2, jax.random.key(1))
    value = jax.jit(loss)(init_params(config, jax.random.key(0)), batch)
    assert value.dtype == jnp.float32 and np.isfinite(value)
    if config.tied:  # small-init logits: close to a uniform guess
        assert abs(float(value) - math.log(config.vocab_size)) < 0.5


@pytest.mark.parametrize("name", ["gpt-blocks", "gpt-tied"])
def test_full_size_grad_traces_abstractly(name):
    config = preset(name)
    params = abstract_params(config)
    value, grads = jax.eval_shape(jax.value_and_grad(make_loss(config)), params, example_batch(config, 2))
    assert value == jax.ShapeDtypeStruct((), jnp.float32)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    for grad, param in zip(jax.tree.leaves(grads), jax.tree.leaves(params)):
        assert (grad.shape, grad.dtype) == (param.shape, param.dtype)


@pytest.mark.parametrize("config", [TINY_F32, TINY_TIED_F32], ids=["stack", "tied"])
def test_gradient_matches_finite_difference(config):
    params = _params(config)
    batch = example_batch(config, 2, jax.random.key(1))
    _, grads = _value_and_grad(config)(params, batch)
    # Along the gradient, so the derivative is large enough to check, plus a
    # random part, as a gradient can be wrong off its own direction. NumPy
    # keeps this from compiling an eager op per leaf shape.
    rng = np.random.default_rng(0)
    grads = [np.asarray(g) for g in jax.tree.leaves(grads)]
    noise = [rng.standard_normal(g.shape).astype(np.float32) for g in grads]
    direction = [g / _norm(grads) + r / _norm(noise) for g, r in zip(grads, noise)]

    treedef = jax.tree.structure(params)
    moved = lambda h: treedef.unflatten(  # noqa: E731
        [np.asarray(p) + h * d for p, d in zip(jax.tree.leaves(params), direction)]
    )
    loss = lambda p: float(_value_and_grad(config)(p, batch)[0])  # noqa: E731
    central = lambda h: (loss(moved(h)) - loss(moved(-h))) / (2 * h)  # noqa: E731
    h = 1e-2
    numeric, halved = central(h), central(h / 2)
    analytic = sum(float(np.vdot(g, d)) for g, d in zip(grads, direction))
    # The central difference is off by its truncation c * h**2 (Richardson: 4/3 of how far it
    # moves when h halves) and by the loss's rounding over 2h (at h and h / 2, both in that
    # estimate; typical, as the worst case over tens of thousands of roundings exceeds the
    # derivative), the analytic side by the gradient's own rounding (worst case).
    loss_rounding = float(typical_rounding(rounding_chain(make_loss(config), params, batch), abs(loss(params))))
    grad_rounding = float(rounding_bound(rounding_chain(jax.grad(make_loss(config)), params, batch),
                                         sum(float(np.abs(g * d).sum()) for g, d in zip(grads, direction))))
    bound = 4 / 3 * (abs(numeric - halved) + 3 * loss_rounding / h) + loss_rounding / h + grad_rounding
    assert abs(numeric - analytic) <= bound, (numeric, analytic, bound)


@pytest.mark.parametrize("config", [TINY_F32, TINY_TIED_F32], ids=["stack", "tied"])
def test_causal_masking(config):
    forward = jax.jit(make_forward(config))
    params = _params(config)
    pos = 40
    if config.tied:
        inputs = example_batch(config, 2, jax.random.key(1))["tokens"][:, :-1]
        changed = inputs.at[:, pos].set((inputs[:, pos] + 1) % config.vocab_size)
    else:
        inputs = example_batch(config, 2, jax.random.key(1))["x"]
        # Random, not constant: LayerNorm would erase a constant shift.
        changed = inputs.at[:, pos].add(jax.random.normal(jax.random.key(2), inputs[:, pos].shape))
    before, after = forward(params, inputs), forward(params, changed)
    additions = rounding_chain(forward, params, inputs)
    assert_within_rounding(before[:, :pos], after[:, :pos], additions=additions, what="positions before the change")
    assert not np.allclose(before[:, pos:], after[:, pos:], atol=1e-4)


def test_tied_embedding_gradient_sums_both_uses():
    """The tied loss equals an untied one (embed -> block stack -> head with its
    own table) and the embedding gradient is the sum of both tables' gradients."""
    config = TINY_TIED_F32
    params = _params(config)
    tokens = example_batch(config, 2, jax.random.key(1))["tokens"]
    table = params["embed"]["embedding"]
    stack_params = {k: v for k, v in params.items() if k != "embed"}
    stack = make_forward(dataclasses.replace(config, vocab_size=None))

    def untied_loss(table_in, table_out):
        h = stack(stack_params, jnp.take(table_in, tokens[:, :-1], axis=0))
        logits = jnp.einsum("bsd,vd->bsv", h, table_out, preferred_element_type=jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    tied_value, tied_grads = _value_and_grad(config)(params, {"tokens": tokens})
    untied = jax.jit(jax.value_and_grad(untied_loss, argnums=(0, 1)))
    untied_value, (grad_in, grad_out) = untied(table, table)
    batch = {"tokens": tokens}
    assert_within_rounding(tied_value, untied_value, additions=_chain(config, params, batch, False), what="loss")
    grad_tied = tied_grads["embed"]["embedding"]
    assert_within_rounding(grad_tied, grad_in + grad_out, additions=_chain(config, params, batch) + 1,
                           what="tied embedding gradient")
    # Both uses contribute materially; neither alone is the gradient.
    for part in (grad_in, grad_out):
        assert float(jnp.linalg.norm(part)) > 0.05 * float(jnp.linalg.norm(grad_tied))


@pytest.mark.parametrize("config", [TINY_F32, TINY_TIED_F32], ids=["stack", "tied"])
def test_remat_matches_no_remat(config):
    no_remat = dataclasses.replace(config, remat=False)
    params = _params(config)
    batch = example_batch(config, 2, jax.random.key(1))
    value, grads = _value_and_grad(config)(params, batch)
    value_ref, grads_ref = _value_and_grad(no_remat)(params, batch)
    assert_within_rounding(value, value_ref, additions=_chain(config, params, batch, False), what="loss")
    assert_within_rounding(grads, grads_ref, additions=_chain(config, params, batch), what="gradients")

    # Named "checkpoint" or "remat2" depending on the JAX version.
    remat_primitive = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).eqns[0].primitive

    def checkpoints(cfg):
        jaxpr = jax.make_jaxpr(make_loss(cfg))(abstract_params(cfg), example_batch(cfg, 2))
        return sum(eqn.primitive is remat_primitive for eqn in jaxpr.jaxpr.eqns)

    assert checkpoints(config) == config.num_layers
    assert checkpoints(no_remat) == 0


def test_scan_layers_matches_unrolled_blocks():
    config = TINY_F32
    scanned = dataclasses.replace(config, scan_layers=True)
    params = _params(config)
    blocks = [params["blocks"][i] for i in range(config.num_layers)]
    stacked = dict(params, blocks=jax.tree.map(lambda *xs: jnp.stack(xs), *blocks))
    batch = example_batch(config, 2, jax.random.key(1))
    value, grads = _value_and_grad(config)(params, batch)
    value_scan, grads_scan = _value_and_grad(scanned)(stacked, batch)
    assert_within_rounding(value, value_scan, additions=_chain(config, params, batch, False), what="loss")
    grad_blocks = [grads["blocks"][i] for i in range(config.num_layers)]
    assert_within_rounding(dict(grads, blocks=jax.tree.map(lambda *xs: jnp.stack(xs), *grad_blocks)), grads_scan,
                           additions=_chain(config, params, batch), what="gradients")


def test_loss_inside_shard_map(cpu_devices):
    """Per-device loss on a local batch, gradients averaged with pmean, equals the global gradient.

    The params are cast to device-varying first: differentiating w.r.t. a
    replicated (unvarying) input inside shard_map psums its cotangent implicitly.
    """
    config = TINY_TIED_F32
    mesh = data_mesh(8)
    params = _params(config)
    batch = example_batch(config, 8, jax.random.key(1))
    grad = jax.grad(make_loss(config))

    def data_parallel_grad(params, batch):
        assert batch["tokens"].shape[0] == 1  # traced on the local shard
        local = grad(jax.tree.map(lambda x: _compat.mark_varying(x, ("data",)), params), batch)
        return jax.lax.pmean(local, "data")

    sharded = jax.jit(
        _compat.shard_map(data_parallel_grad, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    )
    expected = _value_and_grad(config)(params, batch)[1]
    local = jax.tree.map(lambda x: x[:1], batch)
    assert_within_rounding(sharded(params, batch), expected, additions=_chain(config, params, local) + 9,
                           what="pmean of local gradients")

