"""ScanGradSync on 8 virtual CPU devices: scanned vs unrolled against float64, remat, micro-batches,
the scan rewrite's refusals. Schedules and memory are checked in test_scan_gpu.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_drain as jd
from conftest import data_mesh
from jax_drain import _compat, models
from jax_drain.scan import ScanGradSync, ScanShards, stacked_leaves

from helpers import adam_rounding_bounds, assert_within, assert_within_rounding, rounding_chain

N = 8
# Tied vocabulary: the embedding is a non-stacked leaf used twice (input and output head).
# Odd sizes: width 26 (two heads of 13), 7 positions, a vocabulary of 97.
GPT = models.GPTConfig(num_layers=3, d_model=26, num_heads=2, seq_len=7, vocab_size=97,
                       param_dtype=jnp.float32)
IS_BLOCK = lambda path: path.startswith("blocks/")


def _stack_blocks(params):
    blocks = [params["blocks"][i] for i in range(len(params["blocks"]))]
    return dict(params, blocks=jax.tree.map(lambda *xs: jnp.stack(xs), *blocks))


def _step(sync, loss_fn, **kwargs):
    fn = sync.value_and_grad(loss_fn, **kwargs)
    return jax.jit(_compat.shard_map(fn, mesh=sync.mesh, in_specs=(P(), P("data")),
                                     out_specs=(P(), sync.shard_specs())))


def _mean_over_devices_f64(loss_fn, params, batch):
    """float64 mean over devices of each device's float32 local gradient (and loss)."""
    split = jax.tree.map(lambda x: x.reshape(N, x.shape[0] // N, *x.shape[1:]), batch)
    losses, grads = jax.jit(jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0)))(params, split)
    mean = lambda g: np.asarray(g, np.float64).mean(axis=0)
    return mean(losses), jax.tree.map(mean, grads)


def _assert_padding_zero(sync, shards):
    """The padding of every bucket is zero: whole buckets survive unflatten + flatten unchanged."""
    again = sync.flatten(sync.unflatten(shards), jnp.float32)
    for k, (a, b) in enumerate(zip(jax.tree.leaves(shards), jax.tree.leaves(again))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"bucket array {k}")


def _per_layer(tree) -> dict:
    """Stacked leaves split into their layers (``blocks/w[2]``): each layer of a stacked
    gradient is held to its own scale, not to the largest layer's."""
    out = {}
    for path, x in zip(jd.layout.leaf_paths(tree), jax.tree.leaves(tree)):
        x = np.asarray(x, np.float64)
        out.update({f"{path}[{i}]": x[i] for i in range(x.shape[0])} if IS_BLOCK(path) else {path: x})
    return out


def _assert_close(got, ref, additions, what="gradients"):
    """Per leaf and per layer, within ``additions`` float32 roundings of the layer's own largest
    value (``helpers.assert_within_rounding``)."""
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    assert_within_rounding(_per_layer(got), _per_layer(ref), additions=additions, what=what)


def _additions(fn, params, batch, microbatches=1) -> int:
    """Roundings on the longest chain of ``fn`` on one device's share of ``batch``, then the 8
    devices' sum, the mean and the micro-batches."""
    local = jax.tree.map(lambda x: x[: x.shape[0] // N], batch)
    return rounding_chain(fn, params, local) + 9 + microbatches


@pytest.fixture(scope="module")
def gpt_case():
    params = models.init_params(GPT, jax.random.key(0))
    batch = models.example_batch(GPT, 2 * N, jax.random.key(1))
    loss, grads = _mean_over_devices_f64(models.make_loss(GPT), params, batch)
    return _stack_blocks(params), batch, loss, _stack_blocks(grads)


@pytest.mark.parametrize("reduce, remat, drain", [("fp32_accum", True, True), ("fp32", False, False)])
def test_scanned_gpt_matches_unrolled_float64_reference(gpt_case, reduce, remat, drain):
    stacked, batch, ref_loss, ref_grads = gpt_case
    scanned = dataclasses.replace(GPT, scan_layers=True, remat=remat)
    sync = ScanGradSync(stacked, data_mesh(N), stacked=IS_BLOCK, bucket_size=3000, reduce=reduce, drain=drain)
    assert sync.num_layers == 3 and len(sync.layer_bucket_sizes) >= 2  # several buckets per layer
    loss, shards = _step(sync, models.make_loss(scanned))(stacked, batch)
    assert [s.shape for s in shards.layers] == [(3, b) for b in sync.layer_bucket_sizes]
    assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(shards))
    loss_fn = models.make_loss(GPT)
    unrolled = models.init_params(GPT, jax.random.key(0))
    assert_within_rounding(loss, ref_loss, additions=_additions(loss_fn, unrolled, batch), what="loss")
    _assert_padding_zero(sync, shards)
    _assert_close(sync.unflatten(shards), ref_grads, _additions(jax.grad(loss_fn), unrolled, batch))


# -- a plain jax.lax.scan model: jit around the scan, remat in the body, an unread stacked leaf --

L, D = 4, 16
PLAIN = {
    "embed": jax.ShapeDtypeStruct((D, D), jnp.float32),
    "blocks": {"w": jax.ShapeDtypeStruct((L, D, D), jnp.float32),
               "g": jax.ShapeDtypeStruct((L, D), jnp.float32),
               "unused": jax.ShapeDtypeStruct((L, 3), jnp.float32)},
    "head": jax.ShapeDtypeStruct((D, 5), jnp.float32),
}


def _plain_loss(p, x, reverse=False):
    @jax.jit
    def stack(h, blocks):
        def body(h, blk):
            h = jax.checkpoint(lambda h, blk: h + jnp.tanh(h @ blk["w"]) * blk["g"])(h, blk)
            return h, jnp.mean(h)
        return jax.lax.scan(body, h, blocks, reverse=reverse)

    h, per_layer = stack(x @ p["embed"], p["blocks"])
    return jnp.mean((h @ p["head"]) ** 2) + 1e-3 * jnp.sum(per_layer)


def _plain_unrolled(p, x, reverse=False):
    h = x @ p["embed"]
    extra = 0.0
    for i in (reversed(range(L)) if reverse else range(L)):
        h = h + jnp.tanh(h @ p["blocks"]["w"][i]) * p["blocks"]["g"][i]
        extra = extra + jnp.mean(h)
    return jnp.mean((h @ p["head"]) ** 2) + 1e-3 * extra


@pytest.fixture(scope="module")
def plain_case():
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape) * 0.3, s.dtype), PLAIN)
    x = jnp.asarray(rng.normal(size=(4 * N, D)), jnp.float32)
    return params, x


@pytest.mark.parametrize("reverse", [False, True])
def test_plain_scan_with_remat_matches_float64_reference(plain_case, reverse):
    params, x = plain_case
    # Layer gates of 1 down to 1e-3: layer l's w gradient is ~10^-l of layer 0's, in one leaf.
    gates = jnp.asarray([1.0, 1e-1, 1e-2, 1e-3], jnp.float32)[:, None]
    params = {**params, "blocks": {**params["blocks"], "g": params["blocks"]["g"] * gates}}
    sync = ScanGradSync(PLAIN, data_mesh(N), stacked={"blocks": True, "embed": False, "head": False},
                        bucket_size=200, reduce="fp32_accum")
    loss, shards = _step(sync, lambda p, x: _plain_loss(p, x, reverse))(params, x)
    ref_loss, ref = _mean_over_devices_f64(lambda p, x: _plain_unrolled(p, x, reverse), params, x)
    unrolled = lambda p, x: _plain_unrolled(p, x, reverse)
    assert_within_rounding(loss, ref_loss, additions=_additions(unrolled, params, x), what="loss")
    _assert_padding_zero(sync, shards)
    got = sync.unflatten(shards)
    _assert_close(got, ref, _additions(jax.grad(unrolled), params, x))
    assert not np.any(np.asarray(got["blocks"]["unused"]))  # read by no one: zero, but bucketed


def test_in_scan_equals_reduce_after_scan_and_no_hidden_all_reduce(plain_case):
    """bf16 parameters: the in-loop reduce-scatter and the one after backward agree."""
    params, x = plain_case
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    loss_fn = lambda p, x: _plain_loss(p, x.astype(jnp.bfloat16))
    sync = ScanGradSync(params, data_mesh(N), stacked=IS_BLOCK, bucket_size=200)
    compiled = _step(sync, loss_fn).lower(params, x).compile()

    def after(p, x):
        grads = jax.grad(loss_fn)(jd.local_params(p, "data"), x)
        return sync.reduce_scatter(grads)

    after = jax.jit(_compat.shard_map(after, mesh=sync.mesh, in_specs=(P(), P("data")), out_specs=sync.shard_specs()))
    _, shards = compiled(params, x)
    reference = after(params, x)
    _assert_padding_zero(sync, shards)
    # The same bf16 local gradients; only the float32 sum over the devices adds in another order.
    _assert_close(sync.unflatten(shards), sync.unflatten(reference), 9, what="in-scan vs after")
    all_reduces = [line.split("=")[1].split()[0] for line in compiled.as_text().splitlines()
                   if " all-reduce(" in line or " all-reduce-start(" in line]
    assert all_reduces == ["f32[]"]  # the loss mean only: no gradient is all-reduced


def test_remat_stays_inside_the_scan_body(plain_case):
    """The rewritten loss keeps the body's jax.checkpoint, next to the per-layer collective."""
    params, x = plain_case
    sync = ScanGradSync(PLAIN, data_mesh(N), stacked=IS_BLOCK, bucket_size=200)
    jaxpr = _step(sync, _plain_loss).trace(params, x).jaxpr
    bodies = [_primitives(body) for body in _scan_bodies(jaxpr.jaxpr)]
    remat = {"checkpoint", "remat", "remat2"}  # jax.checkpoint's primitive, by version
    assert any("all_to_all" in names and names & remat for names in bodies), bodies
    # The collective runs in the backward loop only; no loop holds a stacked gradient.
    assert sum("all_to_all" in names for names in bodies) == 1


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns") or hasattr(v, "jaxpr"):
                yield getattr(v, "jaxpr", v)


def _scan_bodies(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn.params["jaxpr"].jaxpr
        for sub in _sub_jaxprs(eqn):
            yield from _scan_bodies(sub)


def _primitives(jaxpr) -> set:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name != "scan":  # nested loops are listed on their own
            for sub in _sub_jaxprs(eqn):
                names |= _primitives(sub)
    return names


def test_microbatches_accumulate_fp32_shards(plain_case):
    params, x = plain_case
    sync = ScanGradSync(PLAIN, data_mesh(N), stacked=IS_BLOCK, bucket_size=200)
    loss1, one = _step(sync, _plain_loss)(params, x)
    loss2, two = _step(sync, _plain_loss, microbatches=2)(params, x)
    assert_within_rounding(loss2, loss1, additions=_additions(_plain_loss, params, x, 2), what="loss")
    _assert_padding_zero(sync, two)
    _assert_close(sync.unflatten(two), sync.unflatten(one), _additions(jax.grad(_plain_loss), params, x, 2),
                  what="2 micro-batches vs 1")
    # has_aux: the aux outputs of the micro-batches come back stacked.
    aux_loss = lambda p, x: (_plain_loss(p, x), x.shape[0])
    fn = sync.value_and_grad(aux_loss, has_aux=True, microbatches=2)
    step = jax.jit(_compat.shard_map(fn, mesh=sync.mesh, in_specs=(P(), P("data")),
                                     out_specs=((P(), P()), sync.shard_specs())))
    (loss3, aux), _ = step(params, x)
    assert_within_rounding(loss3, loss1, additions=_additions(_plain_loss, params, x, 2), what="has_aux loss")
    assert np.asarray(aux).tolist() == [2, 2]  # 4 local rows -> 2 micro-batches of 2
    with pytest.raises(ValueError, match="does not split into 3 equal parts"):
        _step(sync, _plain_loss, microbatches=3).lower(params, x)


def test_layout_helpers(plain_case):
    params, _ = plain_case
    sync = ScanGradSync(PLAIN, data_mesh(N), stacked=IS_BLOCK, bucket_size=200)
    assert sync.stacked_paths == ("blocks/g", "blocks/unused", "blocks/w")
    assert sync.layer_shard_sizes == tuple(b // N for b in sync.layer_bucket_sizes)
    assert all(b % 128 == 0 for b in sync.layer_bucket_sizes + sync.rest_bucket_sizes)
    buckets = sync.flatten(params)
    assert isinstance(buckets, ScanShards)
    assert [b.shape for b in buckets.layers] == [(L, b) for b in sync.layer_bucket_sizes]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(sync.unflatten(buckets))):
        np.testing.assert_array_equal(a, b)
    assert sync.flatten(params, jnp.bfloat16).layers[0].dtype == jnp.bfloat16
    specs = sync.shard_specs()
    assert specs.layers == (P(None, "data"),) * len(sync.layer_bucket_sizes)
    assert "blocks/w" in sync.table() and "head" in sync.table() and "ScanGradSync(" in repr(sync)
    everything = ScanGradSync({"blocks": PLAIN["blocks"]}, data_mesh(N), stacked=IS_BLOCK)
    assert everything.rest_layout is None and everything.shard_specs().rest == ()


def test_stacked_leaves_are_detected_from_the_scan():
    config = dataclasses.replace(GPT, scan_layers=True)
    mask = stacked_leaves(models.make_loss(config), models.abstract_params(config),
                          models.example_batch(config, 2))
    paths = jd.layout.leaf_paths(mask)
    assert [p for p, m in zip(paths, jax.tree.leaves(mask)) if m] == [p for p in paths if IS_BLOCK(p)]
    assert stacked_leaves(_plain_loss, PLAIN, jax.ShapeDtypeStruct((4, D), jnp.float32))["blocks"]["w"]


# -- refusals -----------------------------------------------------------------------------------


def test_stacked_leaf_with_wrong_leading_dim_is_named():
    bad = {**PLAIN, "blocks": {**PLAIN["blocks"], "g": jax.ShapeDtypeStruct((L + 1, D), jnp.float32)}}
    with pytest.raises(ValueError, match=r"stacked leaf 'blocks/g' has shape \(5, 16\): its leading "
                                         r"dimension 5 is not the number of layers \(the scan length\) 4"):
        ScanGradSync(bad, data_mesh(N), stacked=IS_BLOCK)
    with pytest.raises(ValueError, match="'blocks/g' .* leading dimension 4 is not the number of layers .* 3"):
        ScanGradSync(PLAIN, data_mesh(N), stacked=IS_BLOCK, num_layers=3)
    with pytest.raises(ValueError, match="'head' .* leading dimension 16 is not the number of layers"):
        ScanGradSync(PLAIN, data_mesh(N), stacked=lambda p: IS_BLOCK(p) or p == "head")
    scalar = {**PLAIN, "blocks": {**PLAIN["blocks"], "s": jax.ShapeDtypeStruct((), jnp.float32)}}
    with pytest.raises(ValueError, match="stacked leaf 'blocks/s' is a scalar"):
        ScanGradSync(scalar, data_mesh(N), stacked=IS_BLOCK)


def test_bad_arguments():
    mesh = data_mesh(N)
    with pytest.raises(ValueError, match="no leaf is marked as stacked"):
        ScanGradSync(PLAIN, mesh, stacked=lambda p: False)
    with pytest.raises(ValueError, match="stacked must be a predicate .* does not match params"):
        ScanGradSync(PLAIN, mesh, stacked={"nope": True})
    with pytest.raises(ValueError, match="mesh has no axis 'dp'"):
        ScanGradSync(PLAIN, mesh, axis="dp", stacked=IS_BLOCK)
    with pytest.raises(ValueError, match="unknown reduce mode"):
        ScanGradSync(PLAIN, mesh, stacked=IS_BLOCK, reduce="fp8")
    with pytest.raises(ValueError, match="order must be a permutation"):
        ScanGradSync(PLAIN, mesh, stacked=IS_BLOCK, order=[0, 1])
    sync = ScanGradSync(PLAIN, mesh, stacked=IS_BLOCK)
    with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
        sync.value_and_grad(_plain_loss, microbatches=0)
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        sync.value_and_grad(_plain_loss)(PLAIN, jnp.zeros((4, D)))


def _lower(loss_fn, stacked=IS_BLOCK):
    sync = ScanGradSync(PLAIN, data_mesh(N), stacked=stacked, bucket_size=200)
    return _step(sync, loss_fn).lower(PLAIN, jax.ShapeDtypeStruct((4 * N, D), jnp.float32))


def test_stacked_leaf_used_outside_the_scan_is_refused():
    regularised = lambda p, x: _plain_loss(p, x) + jnp.sum(p["blocks"]["w"] ** 2)
    with pytest.raises(ValueError, match="stacked leaf 'blocks/w' is used by 'integer_pow' outside the layer scan"):
        _lower(regularised)


def test_remat_around_the_whole_scan_is_refused():
    with pytest.raises(ValueError, match="'blocks/g' is used by jax.checkpoint .* outside the layer scan; put the remat inside the scan body"):
        _lower(jax.checkpoint(_plain_loss))


def test_stacked_leaf_as_scan_constant_is_refused():
    def indexed(p, x):  # the body indexes the stack itself: it is a loop constant, not xs
        def body(h, i):
            return jnp.tanh(h @ p["blocks"]["w"][i]) * p["blocks"]["g"][i] + 0 * p["blocks"]["unused"][i, 0], None
        h, _ = jax.lax.scan(body, x @ p["embed"], jnp.arange(L))
        return jnp.mean((h @ p["head"]) ** 2)

    with pytest.raises(ValueError, match="passed to a scan as a loop-invariant constant or carry"):
        _lower(indexed)


def test_loss_without_the_layer_scan_is_refused():
    with pytest.raises(ValueError, match="loss_fn has no jax.lax.scan over the stacked leaves"):
        _lower(lambda p, x: jnp.mean((x @ p["embed"] @ p["head"]) ** 2))


def test_invariant_gradients_are_refused_by_reduce_scatter():
    sync = ScanGradSync(PLAIN, data_mesh(N), stacked=IS_BLOCK, bucket_size=200)
    trap = lambda p, x: sync.reduce_scatter(jax.grad(_plain_loss)(p, x))  # replicated params: psum'd
    trap = _compat.shard_map(trap, mesh=sync.mesh, in_specs=(P(), P("data")), out_specs=sync.shard_specs())
    with pytest.raises(ValueError, match="do not vary along 'data'"):
        jax.jit(trap).lower(PLAIN, jax.ShapeDtypeStruct((4 * N, D), jnp.float32))


def test_zero1_step_on_scan_shards_matches_replicated_adam(plain_case):
    """init_master / gather_params: optax on the shards equals optax on the replicated tree."""
    optax = pytest.importorskip("optax")
    params, x = plain_case
    sync = ScanGradSync(PLAIN, data_mesh(N), stacked=IS_BLOCK, bucket_size=200)
    tx = optax.adam(0.1, eps=1e-2)  # eps keeps the first step away from sign(g) for tiny g

    def step(p, x):
        master = sync.init_master(p)
        opt_state = tx.init(master)
        loss, grads = sync.value_and_grad(_plain_loss)(p, x)
        updates, _ = tx.update(grads, opt_state, master)
        return sync.gather_params(optax.apply_updates(master, updates))

    step = jax.jit(_compat.shard_map(step, mesh=sync.mesh, in_specs=(P(), P("data")), out_specs=P()))
    _, ref_grads = _mean_over_devices_f64(_plain_unrolled, params, x)
    ref_grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), ref_grads)
    updates, _ = tx.update(ref_grads, tx.init(params), params)
    expected = optax.apply_updates(params, updates)
    got = step(params, x)
    changed = expected["blocks"]["w"] - params["blocks"]["w"]
    assert np.max(np.abs(changed)) > 0.05  # the step moved the weights
    # One Adam step from gradients that differ by their chain's roundings (the reference's are
    # float64 means of float32 local gradients).
    bound = adam_rounding_bounds([ref_grads], additions=_additions(jax.grad(_plain_unrolled), params, x),
                                 learning_rate=0.1, eps=1e-2, params=params)[-1]
    assert_within(_per_layer(got), _per_layer(expected), _per_layer(bound), what="params")
