"""grad_ready_order: backward order from the traced loss, not pytree order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_drain as jd


def tied_model_params(vocab=64, d=16):
    # Keys deliberately out of forward order: forward is embed -> z0 -> a1 -> m2 -> embed.T.
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    return {"a1": shape(d, d), "embed": shape(vocab, d), "m2": shape(d, d), "z0": shape(d, d)}


def tied_loss(p, tokens, remat=False, jit_layers=False):
    layer = lambda h, w: jnp.tanh(h @ w)
    if remat:
        layer = jax.checkpoint(layer)
    if jit_layers:
        layer = jax.jit(layer)
    h = p["embed"][tokens]
    for name in ("z0", "a1", "m2"):
        h = layer(h, p[name])
    logits = h @ p["embed"].T
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("jit_layers", [False, True])
def test_tied_embedding_is_ready_last(remat, jit_layers):
    params = tied_model_params()
    tokens = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    order = jd.grad_ready_order(lambda p, t: tied_loss(p, t, remat, jit_layers), params, tokens)
    names = sorted(params)  # jax.tree.leaves order of a dict
    assert [names[i] for i in order] == ["m2", "a1", "z0", "embed"]


def test_concrete_arrays_and_unused_leaves():
    rng = np.random.default_rng(0)
    params = {"used": jnp.asarray(rng.normal(size=(3, 3)), jnp.float32), "unused": jnp.asarray(rng.normal(size=(2,)))}
    order = jd.grad_ready_order(lambda p, x: jnp.sum(x @ p["used"]), params, jnp.asarray(rng.normal(size=(2, 3))))
    # "unused" gets a constant zero gradient, ready before anything is computed.
    assert order == (0, 1)  # leaves: [unused, used]


def test_has_aux_and_default_layout_differs():
    params = tied_model_params()
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    order = jd.grad_ready_order(lambda p, t: (tied_loss(p, t), {"n": 1}), params, tokens, has_aux=True)
    assert order != tuple(reversed(range(4)))  # reverse pytree order would be wrong here
    assert sorted(order) == [0, 1, 2, 3]


def test_flax_gpt_backward_order():
    from jax_drain import models

    config = models.preset("tiny-tied")
    params = models.abstract_params(config)
    order = jd.grad_ready_order(models.make_loss(config), params, models.example_batch(config, 2))
    paths = [models.leaf_paths(params)[i] for i in order]
    assert paths[-1] == "embed/embedding"  # tied: first use in forward, so complete last
    assert paths[:2] == ["ln_f/bias", "ln_f/scale"] or paths[:2] == ["ln_f/scale", "ln_f/bias"]
    block_of = [int(p.split("/")[1]) for p in paths if p.startswith("blocks/")]
    assert block_of == sorted(block_of, reverse=True)  # the last block's gradients come first
    assert paths.index("blocks/1/mlp/fc_out/kernel") < paths.index("blocks/1/attn/qkv/kernel")


# -- remat_groups: which remat block reads each leaf ---------------------------------------------


@pytest.mark.parametrize("jit_layers", [False, True])
def test_remat_groups_number_the_blocks_in_forward_order(jit_layers):
    """Each layer's weight in its own remat block, numbered as forward reaches them (not in pytree
    order); the embedding, read outside every block, has none. Under a ``jit`` around the
    blocks the groups are read through the call."""
    params = tied_model_params()
    tokens = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    loss = lambda p, t: tied_loss(p, t, remat=True)  # noqa: E731
    if jit_layers:
        loss = jax.jit(loss)
    groups = dict(zip(sorted(params), jd.remat_groups(loss, params, tokens)))
    assert groups == {"embed": None, "z0": 0, "a1": 1, "m2": 2}
    # Without remat there are no blocks.
    assert jd.remat_groups(lambda p, t: tied_loss(p, t), params, tokens) == (None,) * 4


def test_remat_groups_of_the_flax_gpt_follow_its_blocks():
    from jax_drain import models

    config = models.preset("tiny-tied")
    params = models.abstract_params(config)
    groups = jd.remat_groups(models.make_loss(config), params, models.example_batch(config, 2))
    for path, group in zip(models.leaf_paths(params), groups):
        want = int(path.split("/")[1]) if path.startswith("blocks/") else None
        assert group == want, (path, group)
