"""A list of identical blocks rerolled into a layer scan (``jax_drain._blocks``).

In float64 on random parameters and data: the rerolled loss and its gradients equal the loss as
written, within the rounding of the loss's own equations; the rerolled program runs the blocks
as one ``scan`` over the stacked parameters; the carry is what the blocks hand on (the residual
stream alone, for a pre-norm block); the stack keeps the blocks in the order the loss runs them;
and what is not a chain of copies of one block is refused, saying why.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_drain import _blocks

from helpers import assert_within, rounding_bound, rounding_chain

EPS64 = 2.0 ** -52
WIDTH, ROWS, LAYERS = 6, 5, 4


def _normed(x):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-6)


def _block(p, x):
    """A pre-norm residual block: a layer norm's statistics come before its first parameter."""
    return x + jnp.tanh((_normed(x) * p["norm"]) @ p["w1"]) @ p["w2"]


def _params(seed=0, keys=None):
    rng = np.random.default_rng(seed)
    keys = list(range(LAYERS)) if keys is None else keys
    block = lambda: {"norm": 1.0 + 0.1 * rng.normal(size=(WIDTH,)), "w1": rng.normal(size=(WIDTH, 2 * WIDTH)) / 3,
                     "w2": rng.normal(size=(2 * WIDTH, WIDTH)) / 4}
    return {"embed": rng.normal(size=(WIDTH, WIDTH)), "blocks": {k: block() for k in keys},
            "head": rng.normal(size=(WIDTH, 3))}


def _loss(params, x, order=None):
    """Ending in a norm like the blocks' own: a window may also start after a block's statistics
    (the last copy's then read the final norm's), carrying them too; the smaller carry is kept."""
    h = x @ params["embed"]
    for k in (order or params["blocks"]):
        h = _block(params["blocks"][k], h)
    return jnp.mean((_normed(h) @ params["head"]) ** 2)


def _x(seed=1):
    return np.random.default_rng(seed).normal(size=(ROWS, WIDTH))


def _bound(loss, params, x, value):
    """Two float64 evaluations of the loss and its gradient that sum in other orders (the scan
    changes where XLA fuses, not what is computed): the roundings on the gradient's longest chain,
    at ``value``'s own largest magnitude (a mean of squares; per leaf, its largest gradient)."""
    return rounding_bound(rounding_chain(jax.grad(loss), params, x), np.max(np.abs(np.asarray(value))), EPS64)


def test_the_rerolled_loss_and_its_gradient_equal_the_loss_as_written():
    with jax.enable_x64(True):
        params, x = _params(), _x()
        stack = _blocks.find_block_stack(_loss, params, x)
        assert stack == _blocks.BlockStack(("blocks",), (0, 1, 2, 3))
        stacked = stack.stack(params)
        assert set(stacked["blocks"]) == {"[0..3]"}
        assert stacked["blocks"]["[0..3]"]["w1"].shape == (LAYERS, WIDTH, 2 * WIDTH)
        rerolled = _blocks.rerolled(_loss, stack)

        # One scan over the stacked leaves, and no block written out beside it.
        jaxpr = jax.make_jaxpr(rerolled)(stacked, x).jaxpr
        scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
        assert len(scans) == 1 and scans[0].params["length"] == LAYERS
        assert sum(e.primitive.name == "dot_general" for e in jaxpr.eqns) == 2  # embed and head
        # The carry is the residual stream alone: the window starts at the block's norm statistics.
        (carry,) = [v.aval.shape for v in scans[0].outvars]
        assert carry == (ROWS, WIDTH)

        want, want_grads = jax.value_and_grad(_loss)(params, x)
        got, got_grads = jax.value_and_grad(rerolled)(stacked, x)
        assert_within(got, want, _bound(_loss, params, x, want), what="loss")
        for path, g in jax.tree_util.tree_leaves_with_path(stack.stack(want_grads)):
            got_leaf = got_grads
            for key in path:
                got_leaf = got_leaf[key.key]
            assert_within(got_leaf, g, _bound(_loss, params, x, g), what=jax.tree_util.keystr(path))
        assert jax.tree.structure(stack.unstack(stacked)) == jax.tree.structure(params)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(stack.unstack(stacked)),
                                                         jax.tree.leaves(params)))


def test_the_stack_follows_the_order_the_loss_runs_the_blocks():
    """Linen names blocks ``block_0`` ... ``block_10``, which sort out of order: the stack takes
    the loss's order, and the rerolled loss runs them in it."""
    keys = [f"block_{i}" for i in range(11)]
    order = keys[::-1][:4] + keys[:7]  # any order, as long as the loss runs them one after another
    with jax.enable_x64(True):
        params, x = _params(3, keys), _x()
        loss = lambda p, x: _loss(p, x, order)  # noqa: E731
        stack = _blocks.find_block_stack(loss, params, x)
        assert stack.members == tuple(order)
        assert stack.key == "[" + ",".join(order) + "]"  # not a numbered run: every member named
        assert _blocks.members_of_key(stack.key) == order
        assert _blocks.members_of_key("[block_0..block_3]") == ["block_0", "block_1", "block_2", "block_3"]
        assert _blocks.members_of_key("[0..3]") == ["0", "1", "2", "3"]
        assert _blocks.members_of_key("[x]") is None and _blocks.members_of_key("kernel") is None
        want = loss(params, x)
        assert_within(_blocks.rerolled(loss, stack)(stack.stack(params), x), want, _bound(loss, params, x, want))


def test_a_value_the_blocks_sum_from_a_literal_zero_is_carried():
    """``aux = 0.0; aux = aux + block_aux``: block 0 reads a literal where the others read the sum so far."""

    def loss(params, x):
        h, aux = x @ params["embed"], 0.0
        for k in params["blocks"]:
            h = _block(params["blocks"][k], h)
            aux = aux + jnp.mean(h ** 2)
        return jnp.mean((h @ params["head"]) ** 2) + aux

    with jax.enable_x64(True):
        params, x = _params(), _x()
        stack = _blocks.find_block_stack(loss, params, x)
        rerolled = _blocks.rerolled(loss, stack)
        (scan,) = [e for e in jax.make_jaxpr(rerolled)(stack.stack(params), x).jaxpr.eqns if e.primitive.name == "scan"]
        assert sorted(v.aval.shape for v in scan.outvars) == [(), (ROWS, WIDTH)]
        want = loss(params, x)
        assert_within(rerolled(stack.stack(params), x), want, _bound(loss, params, x, want))


def _with_table(params, x, per_block=False):
    """Each block builds its own copy of a table (EasyLM's rotary ``freqs_cis``): one constant per block."""
    h = x @ params["embed"]
    for i, k in enumerate(params["blocks"]):
        table = np.linspace(0.5, 1.5, WIDTH) * (i + 1 if per_block else 1)
        h = _block(params["blocks"][k], h) * table
    return jnp.mean((h @ params["head"]) ** 2)


def test_blocks_holding_equal_constants_reroll_and_unequal_ones_are_refused():
    with jax.enable_x64(True):
        params, x = _params(), _x()
        stack = _blocks.find_block_stack(_with_table, params, x)
        assert len(jax.make_jaxpr(_with_table)(params, x).consts) == LAYERS  # a copy per block
        want = _with_table(params, x)
        assert_within(_blocks.rerolled(_with_table, stack)(stack.stack(params), x), want,
                      _bound(_with_table, params, x, want))
        with pytest.raises(_blocks.NotRerolled, match="different values"):
            _blocks.find_block_stack(lambda p, x: _with_table(p, x, per_block=True), params, x)


def test_blocks_inside_a_jit_call_and_a_list_of_blocks_reroll():
    with jax.enable_x64(True):
        params, x = _params(), _x()
        params["blocks"] = [params["blocks"][k] for k in range(LAYERS)]
        loss = jax.jit(lambda p, x: _loss(p, x, range(LAYERS)))
        stack = _blocks.find_block_stack(lambda p, x: loss(p, x) * 2, params, x)
        assert stack == _blocks.BlockStack(("blocks",), (0, 1, 2, 3), in_list=True)
        stacked = stack.stack(params)
        assert stacked["blocks"]["w1"].shape == (LAYERS, WIDTH, 2 * WIDTH)  # the list becomes the stack
        want = loss(params, x) * 2
        got = _blocks.rerolled(lambda p, x: loss(p, x) * 2, stack)(stacked, x)
        assert_within(got, want, _bound(loss, params, x, want))
        assert isinstance(stack.unstack(stacked)["blocks"], list)


def _tied(params, x):  # every block also reads block 0's first weight
    h = x @ params["embed"]
    for k in params["blocks"]:
        p = dict(params["blocks"][k], w1=params["blocks"][k]["w1"] + params["blocks"][0]["w1"])
        h = _block(p, h)
    return jnp.mean((h @ params["head"]) ** 2)


def _two_back(params, x):  # each block adds the input of the block before it
    h, before = x @ params["embed"], x @ params["embed"]
    for k in params["blocks"]:
        h, before = _block(params["blocks"][k], h) + before, h
    return jnp.mean((h @ params["head"]) ** 2)


def _numbered(params, x):  # block i scales by i: the copies differ
    h = x @ params["embed"]
    for i, k in enumerate(params["blocks"]):
        h = _block(params["blocks"][k], h) * (i + 1.0)
    return jnp.mean((h @ params["head"]) ** 2)


def _every_output(params, x):  # what follows reads every block's output
    h, outs = x @ params["embed"], []
    for k in params["blocks"]:
        h = _block(params["blocks"][k], h)
        outs.append(h)
    return jnp.mean((sum(outs) @ params["head"]) ** 2)


@pytest.mark.parametrize("loss,match", [
    (_tied, "reads block 0's parameters"),
    (_two_back, "a value of block"),
    (_numbered, "differs from block 0|different values"),
    (_every_output, "not only of the last|a value of block"),
])
def test_what_is_not_a_chain_of_copies_is_refused_saying_why(loss, match):
    params, x = _params(), _x()
    with pytest.raises(_blocks.NotRerolled, match=match) as info:
        _blocks.find_block_stack(loss, params, x)
    assert "blocks/{0, 1, 2, 3}" in str(info.value)


def test_a_tree_without_alike_subtrees_has_no_block_stack():
    params = {"a": np.ones((2, 3)), "b": np.ones((3, 2))}
    assert _blocks.block_candidates(params) == []
    assert _blocks.find_block_stack(lambda p, x: jnp.sum(x @ p["a"] @ p["b"]), params, np.ones((4, 2))) is None


def test_block_paths_find_a_leaf_in_the_other_form():
    """How a checkpoint moves between stacked blocks and the blocks one by one."""
    stacked = _blocks.BlockPaths(["params/blocks/[0..2]/w", "params/head"])
    assert stacked.source("params/head") == ("same", "params/head")
    assert stacked.source("params/blocks/1/w") == ("row", "params/blocks/[0..2]/w", 1)
    assert stacked.source("params/blocks/3/w") is None
    one_by_one = _blocks.BlockPaths([f"params/blocks/{i}/w" for i in range(3)])
    assert one_by_one.source("params/blocks/[0..2]/w") == ("stack", [f"params/blocks/{i}/w" for i in range(3)])
    assert one_by_one.source("params/blocks/[0..3]/w") is None  # a block it does not have
    named = _blocks.BlockPaths(["d/[b_2,b_0,b_1]/k"])
    assert named.source("d/b_0/k") == ("row", "d/[b_2,b_0,b_1]/k", 1)  # the run order, not the names'
    assert _blocks.BlockPaths.expanded({"a/[0..1]/w": ((2, 3), "f32"), "h": ((4,), "f32")}) == {
        "a/0/w": ((3,), "f32"), "a/1/w": ((3,), "f32"), "h": ((4,), "f32")}
