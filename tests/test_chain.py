"""Bucket chains: every chain kind really sequences its collectives, read from the traced program.

The drain is a data dependency: bucket ``k``'s collective consumes a value fenced behind bucket
``k - depth``'s result (``jax.lax.optimization_barrier``). These tests trace each chain kind on
the CPU (no GPU plugin needed) and read the jaxpr with :func:`jax_drain._jaxpr.collective_dependencies`:
with depth ``d`` bucket ``k`` depends on exactly buckets ``k - d, k - 2d, ...``; undrained, on none.
Making ``optimization_barrier`` the identity (``PYTHONPATH=tests python -m pytest -p
mutation_no_barrier``, see BUILD.md) makes them fail.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_drain as jd
from jax_drain import _compat
from jax_drain._jaxpr import collective_dependencies
from jax_drain.chain import GATHER_SCOPE, SCOPE_PREFIX

SDS = jax.ShapeDtypeStruct

DENSE = {"a": SDS((33, 20), jnp.float32), "b": SDS((7,), jnp.float32), "c": SDS((40, 13), jnp.float32),
         "d": SDS((3, 5, 7), jnp.float32), "e": SDS((29, 11), jnp.float32)}
EXPERT = {**DENSE, "experts_b": SDS((4, 9), jnp.float32), "experts_in": SDS((4, 19, 9), jnp.float32),
          "experts_out": SDS((4, 9, 19), jnp.float32), "router": SDS((19, 4), jnp.float32)}
# Whole-parameter buckets close only once balanced over the owners, so they need many leaves.
MANY = {f"w{i:02d}": SDS((3 + i % 5, 7), jnp.float32) for i in range(48)}
SCANNED = {"embed": SDS((13, 11), jnp.float32),
           "blocks": {"w": SDS((3, 11, 11), jnp.float32), "g": SDS((3, 11), jnp.float32), "v": SDS((3, 11, 17), jnp.float32)},
           "head": SDS((11, 5), jnp.float32)}


def _touch_all(p, x):
    """A loss in which every leaf gets a gradient that varies with the batch."""
    s = jnp.mean(x)
    return sum(jnp.sum(jnp.tanh(leaf) * s) for leaf in jax.tree.leaves(p))


def _scan_loss(p, x):
    def layer(h, block):
        return jnp.tanh((h * block["g"]) @ block["w"]) + jnp.sum(block["v"]) * 0.01, None

    h, _ = jax.lax.scan(layer, x @ p["embed"], p["blocks"])
    return jnp.mean(h @ p["head"])


def _traced(sync: jd.GradSync | jd.ScanGradSync, loss, optimizer: jd.DistributedOptimizer | None = None, *,
            shard_params: bool = False):
    """The jaxpr of one sync (and optimizer update) inside shard_map, on abstract inputs; with
    ``shard_params``, of ZeRO-3's gradient step instead (:mod:`jax_drain.zero3`)."""
    params = sync.abstract_params
    n = sync.data_size
    batch = SDS((2 * n, params["embed"].shape[0] if "embed" in params else 3), jnp.float32)
    if shard_params:
        from jax_drain import zero3

        shards = sync.pack_shards([SDS(c.global_shard_shape(k), c.layout.buckets[k].dtype) for c, k in sync.flat_chains])
        fn = _compat.shard_map(zero3.value_and_grad(sync, loss), mesh=sync.mesh,
                               in_specs=(sync.shard_specs(), sync.batch_spec), out_specs=(P(), sync.shard_specs()))
        return jax.make_jaxpr(fn)(shards, batch).jaxpr

    def step(p, *rest):
        if optimizer is None:
            return sync.value_and_grad(loss)(p, *rest)
        state, x = rest
        _, shards = sync.value_and_grad(loss)(p, x)
        return optimizer.update(shards, state)

    if optimizer is None:
        fn = _compat.shard_map(step, mesh=sync.mesh, in_specs=(sync.param_specs, sync.batch_spec),
                               out_specs=(P(), sync.shard_specs()))
        return jax.make_jaxpr(fn)(params, batch).jaxpr
    specs = optimizer.state_specs()
    fn = _compat.shard_map(step, mesh=sync.mesh, in_specs=(sync.param_specs, specs, sync.batch_spec),
                           out_specs=(sync.param_specs, specs))
    return jax.make_jaxpr(fn)(params, optimizer.abstract_state(), batch).jaxpr


def assert_chained(deps: dict, labels: list[str], depth: int | None) -> None:
    """``labels`` in chain order: with ``depth`` d, link ``i`` depends on exactly ``i - d, i - 2d, ...``."""
    assert set(labels) <= set(deps), f"collectives of {sorted(set(labels) - set(deps))} not found"
    for i, label in enumerate(labels):
        want = {labels[j] for j in range(i) if depth is not None and (i - j) % depth == 0}
        got = deps[label] & set(labels)
        assert got == want, f"{label} depends on {sorted(got)}, expected {sorted(want)} (depth {depth})"


def _bucket_labels(chain: jd.BucketChain) -> list[str]:
    return [chain.bucket_scope(k) for k in range(chain.num_buckets)]


def _mesh(shape, names, cpu_devices):
    return Mesh(np.array(cpu_devices[: int(np.prod(shape))]).reshape(shape), names)


@pytest.mark.parametrize("reduce", jd.REDUCE_MODES)
@pytest.mark.parametrize("depth", [1, 2, None])
def test_dense_chain_links_bucket_k_to_k_minus_depth(reduce, depth, cpu_devices):
    sync = jd.GradSync(DENSE, _mesh((8,), ("data",), cpu_devices), bucket_size=100, reduce=reduce,
                       drain=depth is not None, max_in_flight=depth)
    (chain,) = sync.chains
    assert chain.num_buckets >= 4
    assert_chained(collective_dependencies(_traced(sync, _touch_all)), _bucket_labels(chain), depth)


@pytest.mark.parametrize("depth", [1, 2, None])
def test_whole_parameter_layout_keeps_the_chain(depth, cpu_devices):
    """ownership="param" changes where a bucket's elements lie, not how its buckets are sent."""
    sync = jd.GradSync(MANY, _mesh((8,), ("data",), cpu_devices), bucket_size=100, ownership="param",
                       drain=depth is not None, max_in_flight=depth)
    (chain,) = sync.chains
    assert chain.num_buckets >= 4 and chain.layout.owners == 8
    assert_chained(collective_dependencies(_traced(sync, _touch_all)), _bucket_labels(chain), depth)


@pytest.mark.parametrize("depth", [1, 2, None])
def test_hierarchical_chain_links_the_outer_all_reduce_too(depth, cpu_devices):
    sync = jd.GradSync(DENSE, _mesh((2, 4), ("replica", "data"), cpu_devices), bucket_size=100,
                       outer_axis="replica", drain=depth is not None, max_in_flight=depth)
    jaxpr = _traced(sync, _touch_all)
    assert_chained(collective_dependencies(jaxpr), _bucket_labels(sync.chains[0]), depth)
    # Each link holds the bucket's reduce-scatter and its outer all-reduce.
    kinds = collective_dependencies(jaxpr, label=lambda e: f"{e.primitive.name}" if "bucket1" in str(
        e.source_info.name_stack) else None)
    assert "all_to_all" in kinds and any(name.startswith("psum") for name in kinds)


def test_streamed_steps_are_fenced_two_deep(cpu_devices):
    """Inside one bucket the point-to-point step ``s`` waits for the sum of step ``s - 2``."""
    sync = jd.GradSync(DENSE, _mesh((8,), ("data",), cpu_devices), bucket_size=None, reduce="fp32_accum_streamed")
    step_of = lambda e: (m.group(1) if (m := re.search(r"bucket0/step(\d+)", str(e.source_info.name_stack)))
                         else None)
    deps = collective_dependencies(_traced(sync, _touch_all), label=step_of)
    assert set(deps) == {str(s) for s in range(1, 8)}
    for s in range(3, 8):  # the accumulator carries every earlier step; never the one just before
        assert deps[str(s)] == {str(t) for t in range(1, s - 1)}, (s, deps[str(s)])


@pytest.mark.parametrize("depth", [1, 2, None])
def test_expert_and_dense_chains_are_each_drained_and_independent(depth, cpu_devices):
    sync = jd.GradSync(EXPERT, _mesh((4, 2), ("data", "expert"), cpu_devices), bucket_size=100,
                       axis=("data", "expert"), expert=lambda path: path.startswith("experts"),
                       expert_axis="data", param_specs={k: P("expert") if k.startswith("experts") else None for k in EXPERT},
                       drain=depth is not None, max_in_flight=depth)
    dense, expert = sync.chains
    assert expert.scope == f"{SCOPE_PREFIX}/expert" and dense.num_buckets >= 4 and expert.num_buckets >= 3
    deps = collective_dependencies(_traced(sync, _touch_all))
    assert_chained(deps, _bucket_labels(dense), depth)
    assert_chained(deps, _bucket_labels(expert), depth)
    assert not any(deps[label] & set(_bucket_labels(dense)) for label in _bucket_labels(expert))


@pytest.mark.parametrize("shard_params", [False, True], ids=["zero1", "zero3"])
@pytest.mark.parametrize("depth", [1, 2, None])
def test_layer_chain_inside_the_backward_scan(depth, shard_params, cpu_devices):
    """One layer's buckets are chained inside the backward scan in the chain's loop order
    (smallest first, not the layout's), by the in-scan sync and by ZeRO-3, whose gathers'
    backward rules hand the layer's buckets to the same chain."""
    sync = jd.ScanGradSync(SCANNED, _mesh((8,), ("data",), cpu_devices), stacked=lambda path: path.startswith("blocks/"),
                           bucket_size=100, drain=depth is not None, max_in_flight=depth)
    layers, rest = sync.chains
    assert layers.num_buckets >= 3 and layers.num_layers == 3
    assert list(layers.loop_dispatch) != list(range(layers.num_buckets))
    deps = collective_dependencies(_traced(sync, _scan_loss, shard_params=shard_params))
    assert_chained(deps, [layers.bucket_scope(k) for k in layers.loop_dispatch], depth)
    assert_chained(deps, _bucket_labels(rest), depth)


def test_loop_dispatch_sends_the_fewest_bytes_first_ties_in_layout_order(cpu_devices):
    tree = {"blocks": {"a": SDS((3, 40, 13), jnp.float32), "b": SDS((3, 40, 13), jnp.bfloat16),
                       "c": SDS((3, 7), jnp.float32), "d": SDS((3, 2, 40), jnp.float32)}}
    sync = jd.ScanGradSync(tree, _mesh((8,), ("data",), cpu_devices), stacked=lambda path: True, bucket_size=1,
                           order=(0, 1, 2, 3))
    (layers,) = sync.chains
    assert [layers.layout.slots[b.leaves[0]].path for b in layers.layout.buckets] == [
        "blocks/a", "blocks/b", "blocks/c", "blocks/d"]
    # c and d: 128 float32 elements each once padded; b: a's elements in half the bytes.
    assert layers.loop_dispatch == (2, 3, 1, 0)


@pytest.mark.parametrize("depth", [1, 2])
def test_reduce_scatter_sends_in_dispatch_order_and_returns_in_bucket_order(depth, cpu_devices):
    sync = jd.GradSync(DENSE, _mesh((8,), ("data",), cpu_devices), bucket_size=100, max_in_flight=depth)
    (chain,) = sync.chains
    dispatch = tuple(reversed(range(chain.num_buckets)))
    rng = np.random.default_rng(3)
    buckets = [jnp.asarray(rng.normal(size=(8, n)), jnp.float32) for n in chain.layout.bucket_sizes]

    def reduce(order):
        fn = lambda b: chain.reduce_scatter([x[0] for x in b], mode="fp32_accum", divisor=1,  # noqa: E731
                                            max_in_flight=depth, dispatch=order)
        return _compat.shard_map(fn, mesh=sync.mesh, in_specs=(P("data"),), out_specs=P("data"))

    for got, want in zip(jax.jit(reduce(dispatch))(buckets), jax.jit(reduce(None))(buckets)):
        np.testing.assert_array_equal(got, want)
    deps = collective_dependencies(jax.make_jaxpr(reduce(dispatch))(buckets).jaxpr)
    assert_chained(deps, [chain.bucket_scope(k) for k in dispatch], depth)
    with pytest.raises(ValueError, match="dispatch must be a permutation"):
        jax.make_jaxpr(reduce((0,) * chain.num_buckets))(buckets)


@pytest.mark.parametrize("depth", [1, None])
def test_other_buckets_wait_for_the_layer_loop_on_a_hand_written_tensor_parallel_mesh(depth, cpu_devices):
    """Drained, the non-stacked buckets start only once the layer loop's shards exist, also
    where those shards vary along the model axis and the other gradients do not."""
    tree = {"embed": SDS((13, 11), jnp.float32), "head": SDS((11, 5), jnp.float32),
            "blocks": {"w": SDS((3, 11, 12), jnp.float32), "g": SDS((3, 11), jnp.float32)}}

    def loss(p, x):
        def layer(h, block):  # Megatron's MLP on local blocks: w column-parallel, w.T row-parallel
            return h + jax.lax.psum(jnp.tanh((h * block["g"]) @ block["w"]) @ block["w"].T, "model"), None

        h, _ = jax.lax.scan(layer, x @ p["embed"], p["blocks"])
        return jnp.mean(h @ p["head"])

    specs = {"embed": None, "head": None, "blocks": {"w": P(None, None, "model"), "g": None}}
    sync = jd.ScanGradSync(tree, _mesh((4, 2), ("data", "model"), cpu_devices),
                           stacked=lambda path: path.startswith("blocks/"), bucket_size=20, drain=depth is not None, max_in_flight=depth, param_specs=specs)
    layers, rest = sync.chains
    assert layers.spec_axes == ("model",) and rest.spec_axes == () and rest.num_buckets >= 2
    batch = SDS((8, 13), jnp.float32)
    fn = _compat.shard_map(lambda p, x: sync.value_and_grad(loss)(p, x), mesh=sync.mesh,
                           in_specs=(sync.param_specs, sync.batch_spec), out_specs=(P(), sync.shard_specs()))
    deps = collective_dependencies(jax.make_jaxpr(fn)(tree, batch).jaxpr)
    assert_chained(deps, _bucket_labels(rest), depth)
    waits = deps[rest.bucket_scope(0)] & set(_bucket_labels(layers))
    assert waits == (set(_bucket_labels(layers)) if depth else set()), waits


@pytest.mark.parametrize("x", [
    np.array([0.0, -0.0, 1.5, -np.inf, np.inf, np.nan, 3e38], np.float32),
    np.array([-0.0, 1.5, np.nan, 65504.0], jnp.bfloat16),
    np.array([-7, 0, 2**31 - 1], np.int32),
    np.array([True, False]),
], ids=["float32", "bfloat16", "int32", "bool"])
@pytest.mark.parametrize("value", [np.float32(np.nan), np.float32(-np.inf), np.uint8(255), jnp.bfloat16(-0.0)],
                         ids=["nan", "-inf", "uint8", "bf16"])
@pytest.mark.parametrize("whole", [False, True], ids=["first", "whole"])
def test_after_returns_x_bit_for_bit_computed_from_value(x, value, whole):
    """``drain.after``: every bit of ``x`` kept, whatever ``value`` holds, and ``value`` still read
    by the program XLA compiles (the data dependency a barrier would lose)."""
    from jax_drain.drain import after

    fn = jax.jit(lambda v, x: after(v, x, whole=whole))
    out = fn(jnp.asarray([value, value]), jnp.asarray(x))
    assert out.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), np.asarray(x).view(np.uint8))
    hlo = fn.lower(jnp.asarray([value, value]), jnp.asarray(x)).compile().as_text()
    assert re.search(r"compare\(", hlo), hlo


def test_after_keeps_the_type_of_x_inside_shard_map(cpu_devices):
    """A ``value`` varying along an axis ``x`` does not vary along leaves ``x`` typed as it was
    (its flag is made equal along that axis), so ``x`` can still leave ``shard_map`` replicated."""
    from jax_drain.drain import after

    mesh = _mesh((8,), ("data",), cpu_devices)
    x = jnp.arange(5.0)
    fn = _compat.shard_map(lambda v, x: after(v, x), mesh=mesh, in_specs=(P("data"), P()), out_specs=P())
    np.testing.assert_array_equal(jax.jit(fn)(jnp.arange(16.0), x), x)


@pytest.mark.parametrize("depth", [1, 2, None])
def test_optimizer_gathers_in_forward_order(depth, cpu_devices):
    sync = jd.GradSync(DENSE, _mesh((8,), ("data",), cpu_devices), bucket_size=100)
    opt = jd.DistributedOptimizer(optax.adam(1e-3), sync, gather_max_in_flight=depth)
    (chain,) = sync.chains
    forward = [f"{GATHER_SCOPE}/bucket{k}" for k in reversed(range(chain.num_buckets))]
    assert_chained(collective_dependencies(_traced(sync, _touch_all, opt)), forward, depth)


def test_check_vma_false_is_refused(cpu_devices):
    """Inside shard_map(check_vma=False) per-device and already all-reduced gradients look alike:
    reducing psum'd gradients again would multiply them by the data-parallel size."""
    mesh = _mesh((8,), ("data",), cpu_devices)
    sync = jd.GradSync(DENSE, mesh, bucket_size=100)
    fn = _compat.shard_map(sync.value_and_grad(_touch_all), mesh=mesh, in_specs=(P(), P("data")),
                           out_specs=(P(), sync.shard_specs()), check_vma=False)
    with pytest.raises(ValueError, match="check_vma=False"):
        jax.make_jaxpr(fn)(DENSE, SDS((16, 3), jnp.float32))


def test_fingerprint_names_every_placement(cpu_devices):
    """Equal layouts give equal fingerprints; another bucket size, mesh or order does not."""
    mesh = _mesh((8,), ("data",), cpu_devices)
    base = jd.GradSync(DENSE, mesh, bucket_size=100).fingerprint
    assert jd.GradSync(DENSE, mesh, bucket_size=100).fingerprint == base
    assert jd.GradSync(DENSE, mesh, bucket_size=200).fingerprint != base
    assert jd.GradSync(DENSE, _mesh((4,), ("data",), cpu_devices), bucket_size=100).fingerprint != base
    assert jd.GradSync(DENSE, mesh, bucket_size=100, order=range(5)).fingerprint != base


def test_sequenced_map_returns_each_fenced_predecessor_through_its_barrier_where_its_type_allows():
    """XLA drops a barrier operand whose output nothing reads (once nothing else reads the
    operand either), and the fence with it: so each predecessor is returned through the
    barrier, unless the barrier would make it vary along an axis it does not."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))

    def traced(x):
        outs = jd.sequenced_map(lambda k, v: v * (k + 2), [x, x + 1, x + 2], 1)
        return jax.lax.psum(jnp.concatenate(outs), "data")

    jaxpr = jax.make_jaxpr(_compat.shard_map(traced, mesh=mesh, in_specs=P("data"), out_specs=P()))(jnp.arange(24.0))
    (inner,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    body = inner.params["jaxpr"]
    barriers = [e for e in body.eqns if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == 2
    # Each barrier's first output (the fenced predecessor) is read: by the concatenate.
    read = {v for e in body.eqns for v in e.invars if not isinstance(v, jax.extend.core.Literal)}
    assert all(b.outvars[0] in read for b in barriers)

    # An invariant predecessor fencing a varying input keeps its own value (and type).
    def gathered(x):
        outs = jd.sequenced_map(lambda k, v: jax.lax.psum(v, "data"), [x, x + 1], 1)  # invariant results
        return outs[0] + outs[1]

    jaxpr = jax.make_jaxpr(_compat.shard_map(gathered, mesh=mesh, in_specs=P("data"), out_specs=P()))(jnp.arange(24.0))
    (inner,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    (barrier,) = [e for e in inner.params["jaxpr"].eqns if e.primitive.name == "optimization_barrier"]
    read = {v for e in inner.params["jaxpr"].eqns for v in e.invars if not isinstance(v, jax.extend.core.Literal)}
    assert barrier.outvars[0] not in read


# -- outside the step: one program, not one per leaf ---------------------------------------------


@pytest.mark.parametrize("tree", [MANY, DENSE], ids=["many", "dense"])
def test_unflatten_of_sharded_buckets_is_one_program(tree, cpu_devices):
    """Cut eagerly, every leaf of a sharded bucket was a program of its own with an all-gather of
    the bucket. XLA:CPU deadlocks (and aborts at its rendezvous timeout) once more than 32 such
    programs per device wait behind a running one, which a loop of step-then-unflatten reaches
    under load (BUILD.md, "The abort"): ``unflatten`` must dispatch one program, whatever the tree."""
    mesh = Mesh(np.array(cpu_devices), ("data",))
    sync = jd.GradSync(tree, mesh, bucket_size=256)
    rng = np.random.default_rng(0)
    leaves = [rng.normal(size=x.shape).astype(np.float32) for x in jax.tree.leaves(tree)]
    want = jax.tree.unflatten(jax.tree.structure(tree), leaves)
    shards = jax.device_put(sync.flatten(want), jax.NamedSharding(mesh, P("data")))
    assert sync.num_buckets > 1
    programs = [e.primitive.name for e in jax.make_jaxpr(sync.unflatten)(shards).jaxpr.eqns]
    assert programs in (["pjit"], ["jit"]), programs
    got = sync.unflatten(shards)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), got, want))
