"""DistributedOptimizer on 8 virtual CPU devices: parity with replicated optax, masks, clipping,
padding, memory, the parameter all-gather chain (CPU and compile-only GPU), bad input."""

import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jax_drain as jd
from conftest import data_mesh
from helpers import assert_within, random_tree, rounding_bound
from jax_drain import _compat
from jax_drain.optimizer import GATHER_SCOPE
from jax_drain.planner.schedule import parse_schedule
from jax_drain.planner.targets import gpu_mesh

TEMPLATE = {
    "embed": jax.ShapeDtypeStruct((50, 24), jnp.float32),
    "blocks": [
        {
            "w": jax.ShapeDtypeStruct((24, 40), jnp.float32),
            "b": jax.ShapeDtypeStruct((40,), jnp.float32),
            "scale": jax.ShapeDtypeStruct((40,), jnp.float32),
        }
        for _ in range(3)
    ],
    "head": jax.ShapeDtypeStruct((24, 7), jnp.float32),
}
BUCKET_SIZE = 1500  # several buckets, each padded, some holding matrices and vectors together

MATRICES = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # weight decay: no biases/scales
PREFIX_MASK = {"embed": False, "blocks": True, "head": True}  # optax allows mask prefixes


class AddConstant(optax.GradientTransformation):
    """Not element-wise-safe for padding: adds 0.5 everywhere (padding must still stay 0)."""

    def __new__(cls):
        return super().__new__(cls, lambda p: optax.EmptyState(),
                               lambda u, s, p=None: (jax.tree.map(lambda x: x + 0.5, u), s))


TRANSFORMS = {
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9, nesterov=True),
    "adamw_masked_clipped": lambda: optax.chain(
        jd.clip_by_global_norm(1.0),  # the mean gradients' norm is ~10: clipping is active
        optax.scale_by_adam(b1=0.9, b2=0.95),
        jd.masked(optax.add_decayed_weights(0.1), MATRICES),
        optax.scale_by_learning_rate(optax.linear_schedule(0.01, 0.001, 3)),
    ),
    "lion_prefix_mask": lambda: optax.chain(
        optax.scale_by_lion(),
        jd.masked(optax.add_decayed_weights(0.5), PREFIX_MASK),
        optax.scale(-0.01),
    ),
    "rmsprop_clip_inactive": lambda: optax.chain(jd.clip_by_global_norm(1e6), optax.rmsprop(0.01)),
    "padding_polluter": lambda: optax.chain(optax.adam(0.01), AddConstant()),
}


def _step_fn(opt, mesh, grad_spec=P("data")):
    """A jitted step on per-device gradients stacked along a leading axis of size 8."""
    specs = opt.state_specs()

    def step(params, state, stacked_grads):
        shards = opt.sync.reduce_scatter(jax.tree.map(lambda g: g[0], stacked_grads))
        return opt.update(shards, state)

    return jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(), specs, grad_spec), out_specs=(P(), specs)))


def _run(tx, params, grads, bucket_size=BUCKET_SIZE, reduce="fp32_accum", mesh=None, sync_kwargs=None, **opt_kwargs):
    mesh = mesh or data_mesh(8)
    sync = jd.GradSync(params, mesh, bucket_size=bucket_size, reduce=reduce, **(sync_kwargs or {}))
    opt = jd.DistributedOptimizer(tx, sync, **opt_kwargs)
    state = opt.init_sharded(params)
    step = _step_fn(opt, mesh, getattr(sync, "batch_spec", P("data")))
    history = []
    for g in grads:
        params, state = step(params, state, g)
        history.append((params, state))
    return opt, history


def _reference(tx, params, grads):
    """Plain optax on the replicated float32 tree with the mean gradient."""
    params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    state = tx.init(params)
    update = jax.jit(tx.update)
    history = []
    for g in grads:
        updates, state = update(_mean(g), state, params)
        params = optax.apply_updates(params, updates)
        history.append(params)
    return history


def _dyadic(tree):
    """Random values on a grid of 2**-10 below 2**4: any sum of 8 of them, and its mean, is exact
    in float32 and bfloat16-rounded values stay on the grid, so the optimizer and optax receive
    the same mean gradient bit for bit whatever the order of the devices' additions."""
    return jax.tree.map(lambda g: jnp.asarray(np.round(np.clip(np.asarray(g), -15, 15) * 1024) / 1024, g.dtype), tree)


def assert_optimizer_close(got, want, steps: int, what: str = "params") -> None:
    """The same inputs, the same element-wise arithmetic: after ``steps`` steps each element is
    within a few roundings per step of its value (the moments, the root, the division, the
    update), plus one per element of the tree for a global norm's sum (a clip factor's error
    moves an update of at most the learning rate, 0.05 here, by that relative amount)."""
    size = sum(np.size(x) for x in jax.tree.leaves(want))
    bound = jax.tree.map(lambda w: rounding_bound(8 * steps, np.abs(np.asarray(w, np.float64)))
                         + rounding_bound(size * steps, 0.05), want)
    assert_within(got, want, bound, what=what)


def _mean(stacked_grads):
    return jax.tree.map(lambda x: jnp.mean(x.astype(jnp.float32), axis=0), stacked_grads)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    params = random_tree(rng, TEMPLATE)
    grads = [_dyadic(random_tree(rng, TEMPLATE, leading=(8,))) for _ in range(3)]
    return params, grads


@pytest.fixture(scope="module")
def runs(data):
    """Each transform's distributed run (3 steps), computed once for the tests that read it."""
    params, grads = data
    return {name: _run(make(), params, grads) for name, make in TRANSFORMS.items()}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_matches_replicated_optax(name, data, runs):
    params, grads = data
    opt, history = runs[name]
    reference = _reference(TRANSFORMS[name](), params, grads)
    assert opt.sync.num_buckets >= 3
    for t, ((got, _), want) in enumerate(zip(history, reference), 1):
        moved = max(float(jnp.max(jnp.abs(w - p))) for w, p in zip(jax.tree.leaves(want), jax.tree.leaves(params)))
        assert moved > 1e-3  # the step did something worth comparing
        assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(got))
        assert_optimizer_close(got, want, t, what=f"{name}, step {t}")


# Every optax transform that reads the parameter tree or a norm: equal to optax, or refused.
TREE_TRANSFORMS = {
    "optax.adamw(mask=fn)": (lambda: optax.adamw(0.01, weight_decay=0.1, mask=MATRICES), "refused"),
    "optax.adamw(mask=tree)": (lambda: optax.adamw(0.01, weight_decay=0.1, mask=PREFIX_MASK), "refused"),
    "optax.masked(fn)": (lambda: optax.chain(optax.masked(optax.add_decayed_weights(0.5), MATRICES),
                                             optax.sgd(0.01)), "refused"),
    "optax.multi_transform": (lambda: optax.multi_transform(
        {"fast": optax.sgd(0.1), "slow": optax.sgd(0.001)},
        lambda p: jax.tree.map(lambda x: "fast" if x.ndim > 1 else "slow", p)), "refused"),
    "optax.clip_by_global_norm": (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.01)), "refused"),
    "optax.lars": (lambda: optax.lars(1e-3), "refused"),
    "optax.clip_by_global_norm+adamw(small lr)": (
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), "refused"),
    "jd.adamw(mask=fn, max_norm)": (lambda: jd.adamw(0.01, weight_decay=0.1, mask=MATRICES, max_norm=1.0), "equal"),
    "jd.masked(prefix)": (lambda: optax.chain(jd.masked(optax.add_decayed_weights(0.5), PREFIX_MASK),
                                              optax.sgd(0.01)), "equal"),
    "optax.adamw (no mask)": (lambda: optax.adamw(0.01, weight_decay=0.1), "equal"),
    "optax.adafactor(factored=False) element-wise": (lambda: optax.adafactor(
        0.01, factored=False, multiply_by_parameter_scale=False, clipping_threshold=None), "equal"),
}


def _normalise_large_leaves(threshold: int) -> optax.GradientTransformation:
    """Divides each update leaf larger than ``threshold`` elements by its norm: no state, a
    branch on the leaf's size."""
    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u: u / jnp.sqrt(jnp.sum(u * u)) if u.size > threshold else u, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("make, reason, element_wise_when_small", [
    (lambda: optax.adafactor(1e-2), "v_row.*not shaped like the parameters.*adafactor\\(factored=False\\)", False),
    (lambda: optax.chain(optax.scale_by_factored_rms(), optax.scale(-1e-2)), "v_row.*not shaped like the parameters",
     True),
    (lambda: _normalise_large_leaves(10_000), "other operations.*reduce_sum", True),
], ids=["adafactor", "scale_by_factored_rms", "size_threshold"])
def test_transforms_that_depend_on_the_real_shapes_are_refused(make, reason, element_wise_when_small):
    """Factored moments (above 128 x 128 elements) and any branch on a leaf's size act at the
    real shapes only, never on the check's shrunken copy, whose every dimension is at most 2:
    they are seen on the real shapes, abstractly, and refused. On leaves too small to factor or
    normalise the same transforms are element-wise and accepted: the refusal is the shapes'."""
    params = {"kernel": jnp.ones((256, 192), jnp.float32) * 0.1, "bias": jnp.zeros((192,), jnp.float32)}
    sync = jd.GradSync(params, data_mesh(8), bucket_size=20_000)
    with pytest.raises(ValueError, match=f"(?s)real shapes.*{reason}"):
        jd.DistributedOptimizer(make(), sync)
    if element_wise_when_small:
        small = jax.tree.map(lambda x: x[:64, :64] if x.ndim == 2 else x[:64], params)
        jd.DistributedOptimizer(make(), jd.GradSync(small, data_mesh(8), bucket_size=2_000))


@pytest.mark.parametrize("ownership", ["element", "param"])
def test_a_train_step_prepares_its_tx_check_without_running_on_a_device(ownership, monkeypatch):
    """A train step prepares its tx check on a thread while the caller goes on. Programs run from
    that thread while a multi-device program waits in a collective can deadlock XLA:CPU (BUILD.md,
    "The abort, second cause"), so preparing (tracing, compiling) moves nothing to or from a
    device, under ``jax.transfer_guard("disallow")``: in the functions, and on the step's own
    thread; the verdict runs the check on the caller's thread, and refuses there what it should."""
    import jax_drain.train as train_module
    from jax_drain.optimizer import transform_check
    from jax_drain.ownership import per_parameter_check

    name, prepare = {"element": ("transform_check", transform_check),
                     "param": ("per_parameter_check", per_parameter_check)}[ownership]
    fresh = lambda: optax.chain(optax.scale_by_adam(b1=0.8), optax.scale(-1e-3))  # noqa: E731 - not cached
    params = {"w": jnp.ones((6, 4), jnp.float32), "b": jnp.ones((4,), jnp.float32)}
    with jax.transfer_guard("disallow"):
        verdict = prepare(fresh(), params)
    verdict()

    prepared_on = []

    def guarded(*args, **kwargs):
        prepared_on.append(threading.current_thread().name)
        with jax.transfer_guard("disallow"):  # thread-local: the step's check thread
            return prepare(*args, **kwargs)

    monkeypatch.setattr(train_module, name, guarded)
    step = jd.make_train_step(params, lambda p, b: jnp.sum((b @ p["w"] + p["b"]) ** 2), fresh(), data_mesh(8),
                              jd.TrainConfig(ownership=ownership), example_batch=np.ones((8, 6), np.float32))
    state, metrics = step(step.init(), np.ones((8, 6), np.float32))  # a transfer while preparing raises here
    assert np.isfinite(float(metrics.loss)) and int(state.step) == 1
    assert len(prepared_on) == 1 and prepared_on[0] != threading.current_thread().name
    if ownership == "param":
        refused = prepare(optax.chain(optax.clip_by_global_norm(1e-3), optax.scale(-1.0)), params)
        for _ in range(2):  # a refusal is raised at every run
            with pytest.raises(ValueError, match="computes something over several parameters"):
                refused()


@pytest.mark.parametrize("name", list(TREE_TRANSFORMS))
def test_tree_transforms_are_equal_to_optax_or_refused(name, data):
    make, expected = TREE_TRANSFORMS[name]
    params, grads = data
    if expected == "refused":
        with pytest.raises(ValueError, match="(?s)flat shards.*jax_drain"):
            jd.DistributedOptimizer(make(), jd.GradSync(params, data_mesh(8), bucket_size=BUCKET_SIZE))
        return
    _, history = _run(make(), params, grads)
    for t, ((got, _), want) in enumerate(zip(history, _reference(make(), params, grads)), 1):
        assert_optimizer_close(got, want, t, what=f"{name}, step {t}")


def test_masks_and_clipping_act(data):
    """The parity cases above exercise live masks and an active clip, not no-ops on both sides."""
    params, grads = data
    assert all(float(optax.tree.norm(_mean(g))) > 5.0 for g in grads)  # clip_by_global_norm(1.0) clips
    masked = _reference(TRANSFORMS["lion_prefix_mask"](), params, grads[:1])[0]
    unmasked = _reference(optax.chain(optax.scale_by_lion(), optax.add_decayed_weights(0.5), optax.scale(-0.01)),
                          params, grads[:1])[0]
    assert_optimizer_close(masked["blocks"][0]["b"], unmasked["blocks"][0]["b"], 1)  # decayed in both
    assert np.max(np.abs(masked["embed"] - unmasked["embed"])) > 1e-3  # decay masked out
    decoupled = _reference(TRANSFORMS["adamw_masked_clipped"](), params, grads[:1])[0]
    plain = _reference(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.01)), params, grads[:1])[0]
    assert np.max(np.abs(decoupled["head"] - plain["head"])) > 1e-5  # decay applied to matrices...
    assert_optimizer_close(decoupled["blocks"][1]["scale"], plain["blocks"][1]["scale"], 1)  # ...not scales


@pytest.mark.parametrize("sync_kwargs", [{"axis": ("replica", "data")}, {"axis": "data", "outer_axis": "replica"}],
                         ids=["two_data_axes", "hsdp_outer_axis"])
def test_matches_replicated_optax_on_2d_meshes(sync_kwargs, data):
    """Shards split over two axes, or split over one and replicated along an outer (HSDP) one."""
    params, grads = data
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("replica", "data"))
    tx = TRANSFORMS["adamw_masked_clipped"]
    opt, history = _run(tx(), params, grads, mesh=mesh, sync_kwargs=sync_kwargs)
    assert opt.state_specs().master[0] == P(sync_kwargs["axis"])
    for t, ((got, _), want) in enumerate(zip(history, _reference(tx(), params, grads)), 1):
        assert_optimizer_close(got, want, t, what=f"step {t}")


def test_bf16_params_keep_float32_master(data):
    params, grads = data
    params16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    grads16 = [jax.tree.map(lambda g: g.astype(jnp.bfloat16), g) for g in grads]
    opt, history = _run(optax.adam(1e-3), params16, grads16)
    reference = _reference(optax.adam(1e-3), params16, grads16)
    for t, ((got, state), want) in enumerate(zip(history, reference), 1):
        master = opt.sync.unflatten(state.master)
        for g, m in zip(jax.tree.leaves(got), jax.tree.leaves(master)):
            assert g.dtype == jnp.bfloat16 and m.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(g), np.asarray(m.astype(jnp.bfloat16)))
        assert_optimizer_close(master, want, t, what=f"master, step {t}")
    # The updates (1e-3) are below bf16 resolution for most weights: only the master keeps them.
    assert any(np.any(np.asarray(m) != np.asarray(p, np.float32))
               for m, p in zip(jax.tree.leaves(master), jax.tree.leaves(params16)))


def test_padding_stays_zero(runs):
    opt, history = runs["padding_polluter"]
    state = history[-1][1]
    for bucket, master in zip(opt.sync.layout.buckets, state.master):
        assert bucket.padding > 0
        np.testing.assert_array_equal(np.asarray(master)[bucket.num_elements:], 0.0)


def test_state_memory_is_one_eighth_per_device():
    from jax_drain.models import init_params, preset

    params = init_params(preset("tiny"), jax.random.key(0))  # 1.58M bf16 params
    sync = jd.GradSync(params, data_mesh(8), bucket_size=400_000)
    opt = jd.DistributedOptimizer(optax.adamw(1e-3), sync)
    state = opt.init_sharded(params)
    device = jax.devices("cpu")[0]
    measured = sum(
        shard.data.nbytes for leaf in jax.tree.leaves(state) for shard in leaf.addressable_shards
        if shard.device == device
    )
    summary = opt.memory_summary()
    params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)  # Megatron without ZeRO:
    replicated = sum(x.nbytes for x in jax.tree.leaves((params32, optax.adamw(1e-3).init(params32))))
    print(f"\noptimizer state per device: {measured:,} B distributed vs {replicated:,} B replicated "
          f"({measured / replicated:.4f}x; 1/8 = 0.125)")
    assert measured == summary["distributed"] and replicated == summary["replicated"]
    assert 1 / 8 <= measured / replicated < 1 / 8 * 1.01  # padding + the step count only


def test_state_specs_match_init(data):
    params, _ = data
    opt = jd.DistributedOptimizer(TRANSFORMS["adamw_masked_clipped"](), jd.GradSync(params, data_mesh(8), bucket_size=BUCKET_SIZE))
    state = opt.init_sharded(params)
    abstract = opt.abstract_state()
    assert jax.tree.structure(state) == jax.tree.structure(abstract)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(abstract)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    assert opt.check_state(state) is state
    master = opt.sync.unflatten(state.master)  # the master copy starts as the params
    for m, p in zip(jax.tree.leaves(master), jax.tree.leaves(params)):
        np.testing.assert_array_equal(m, p)


def test_flat_transforms_are_optax_on_ordinary_trees(data):
    params, grads = data
    g = jax.tree.map(lambda x: x[0], grads[0])
    pairs = [
        (jd.masked(optax.add_decayed_weights(0.1), MATRICES), optax.masked(optax.add_decayed_weights(0.1), MATRICES)),
        (jd.masked(optax.scale(3.0), PREFIX_MASK), optax.masked(optax.scale(3.0), PREFIX_MASK)),
        (jd.clip_by_global_norm(2.0), optax.clip_by_global_norm(2.0)),
    ]
    for ours, theirs in pairs:
        a, _ = ours.update(g, ours.init(params), params)
        b, _ = theirs.update(g, theirs.init(params), params)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(jd.global_norm(g), optax.tree.norm(g))


def _param_gathers(hlo_text: str):
    """The schedule and its parameter all-gathers, with the bucket indices each one carries."""
    sched = parse_schedule(hlo_text)
    gathers = [c for c in sched.collectives if c.kind == "all-gather" and c.in_scope(GATHER_SCOPE)]
    buckets = [[int(m) for n in c.op_names for m in re.findall(rf"{GATHER_SCOPE}/bucket(\d+)", n)] for c in gathers]
    return sched, gathers, buckets


def _max_buckets_in_flight(gathers, buckets) -> int:
    events = sorted([(c.start, 0, len(b)) for c, b in zip(gathers, buckets)]
                    + [(c.start if c.is_sync else c.done, 1, -len(b)) for c, b in zip(gathers, buckets)])
    live = best = 0
    for _, _, delta in events:
        live += delta
        best = max(best, live)
    return best


def test_gather_chain_in_cpu_hlo(data):
    params, _ = data
    mesh = data_mesh(8)
    opt = jd.DistributedOptimizer(optax.adam(0.1), jd.GradSync(params, mesh, bucket_size=BUCKET_SIZE))
    grads = jax.tree.map(lambda t: jax.ShapeDtypeStruct((8, *t.shape), t.dtype), TEMPLATE)
    hlo = _step_fn(opt, mesh).lower(params, opt.abstract_state(), grads).compile().as_text()
    _, gathers, buckets = _param_gathers(hlo)
    # One gather per bucket, forward order (last dispatched bucket first), nothing combined.
    assert buckets == [[k] for k in reversed(range(opt.sync.num_buckets))]


@pytest.mark.gpu_compile
@pytest.mark.parametrize("depth", [1, 2])
def test_gather_chain_in_gpu_schedule(depth):
    """The full train step (2 micro-batches, sync, optimizer, gathers) compiled for 8 H100s: no
    collective in the micro-batch loop, and every bucket gathered
    once, in forward order, at most ``depth`` buckets in flight; with depth 1, one all-gather per
    bucket (with depth k XLA's combiner may merge k independent neighbours into one)."""
    from jax_drain.models import GPTConfig, abstract_params, example_batch, make_loss

    config = GPTConfig(num_layers=3, d_model=128, num_heads=2, seq_len=32)
    params = abstract_params(config)
    step = jd.make_train_step(
        params, make_loss(config), optax.adamw(1e-3), gpu_mesh((8,), ("data",)),
        jd.TrainConfig(bucket_size=100_000, max_in_flight=depth, microbatches=2),
        example_batch=example_batch(config, 16),
    )
    compiled = step.lower(step.abstract_state(), example_batch(config, 16)).compile()
    sched, gathers, buckets = _param_gathers(compiled.as_text())
    assert all(c.computation == sched.entry for c in sched.collectives)  # none per micro-batch
    n = step.sync.num_buckets
    assert n >= 4
    assert [k for b in buckets for k in b] == list(reversed(range(n)))
    assert all(len(b) <= depth for b in buckets)
    assert _max_buckets_in_flight(gathers, buckets) <= depth
    if depth == 1:
        assert len(gathers) == n and sched.max_in_flight(lambda c: c in gathers) == 1
    assert {c.dtype for c in gathers} == {"bf16"}  # gathered in the params' dtype, not float32


def test_misuse_is_refused(data):
    params, grads = data
    mesh = data_mesh(8)
    sync = jd.GradSync(params, mesh, bucket_size=BUCKET_SIZE)

    # Transforms that read the tree or a per-device norm are refused when the optimizer is built.
    with pytest.raises(ValueError, match="different result on flat shards.*jax_drain.clip_by_global_norm"):
        jd.DistributedOptimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), sync)
    unchecked = jd.DistributedOptimizer(optax.clip_by_global_norm(1.0), sync, check_tx=False)
    _step_fn(unchecked, mesh)(params, unchecked.init_sharded(params), grads[0])  # opted out: runs
    with pytest.raises(ValueError, match="Use jax_drain.masked"):
        jd.DistributedOptimizer(optax.adamw(1e-3, mask=MATRICES(params)), sync)
    with pytest.raises(ValueError, match="tx fails on the parameter tree"):
        jd.DistributedOptimizer(jd.masked(optax.scale(2.0), {"embed": True}), sync)

    # A state built for another layout (bucket size) is refused, in and outside shard_map.
    other = jd.DistributedOptimizer(optax.adam(1e-3), jd.GradSync(params, mesh, bucket_size=700))
    mine = jd.DistributedOptimizer(optax.adam(1e-3), sync)
    foreign = other.init_sharded(params)
    with pytest.raises(ValueError, match="different bucket layout"):
        mine.check_state(foreign)
    inside = _compat.shard_map(lambda s, g: mine.update(g, s), mesh=mesh,
                               in_specs=(other.state_specs(), P("data")), out_specs=P())
    with pytest.raises(ValueError, match="different bucket layout"):
        jax.jit(inside).lower(foreign, tuple(jnp.zeros(s) for s in sync.bucket_sizes))
    with pytest.raises(ValueError, match="structure differs"):
        jd.DistributedOptimizer(optax.sgd(0.1, momentum=0.9), sync).check_state(mine.init_sharded(params))

    with pytest.raises(ValueError, match="inside jax.shard_map"):
        mine.init(params)
    with pytest.raises(TypeError, match="must be a jax_drain.GradSync"):
        jd.DistributedOptimizer(optax.adam(1e-3), mesh)
    with pytest.raises(TypeError, match="optax GradientTransformation"):
        jd.DistributedOptimizer(lambda g: g, sync)
    with pytest.raises(ValueError, match="max_in_flight must be an int >= 1"):
        jd.DistributedOptimizer(optax.adam(1e-3), sync, gather_max_in_flight=0)


# -- a ScanGradSync's shards: [num_layers, shard] layer buckets next to the 1-D rest buckets -----

SCAN_TEMPLATE = {
    "embed": jax.ShapeDtypeStruct((50, 24), jnp.float32),
    "blocks": {  # stacked over 3 layers: one layer slice is 24*40 + 40 + 40 elements
        "w": jax.ShapeDtypeStruct((3, 24, 40), jnp.float32),
        "b": jax.ShapeDtypeStruct((3, 40), jnp.float32),
        "scale": jax.ShapeDtypeStruct((3, 40), jnp.float32),
    },
    "head": jax.ShapeDtypeStruct((24, 7), jnp.float32),
}
# ndim > 1 would mark the stacked biases too: name the decayed leaves instead.
SCAN_DECAY = {"embed": False, "blocks": {"w": True, "b": False, "scale": False}, "head": True}
SCAN_TRANSFORMS = {
    "adamw_masked_clipped": lambda: optax.chain(
        jd.clip_by_global_norm(1.0),
        optax.scale_by_adam(b1=0.9, b2=0.95),
        jd.masked(optax.add_decayed_weights(0.1), SCAN_DECAY),
        optax.scale_by_learning_rate(optax.linear_schedule(0.01, 0.001, 3)),
    ),
    "padding_polluter": TRANSFORMS["padding_polluter"],
}


def _run_scan(tx, params, grads, bucket_size=1000):
    # 1000: one layer's w + scale share a bucket (decayed and not), b gets its own; embed + head
    # (decayed and not) share the one rest bucket.
    mesh = data_mesh(8)
    sync = jd.ScanGradSync(params, mesh, stacked=lambda path: path.startswith("blocks/"), bucket_size=bucket_size)
    opt = jd.DistributedOptimizer(tx, sync)
    specs = opt.state_specs()

    def step(params, state, stacked_grads):
        shards = sync.reduce_scatter(jd.local_params(jax.tree.map(lambda g: g[0], stacked_grads), "data"))
        return opt.update(shards, state)

    step = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)))
    state, history = opt.init_sharded(params), []
    for g in grads:
        params, state = step(params, state, g)
        history.append((params, state))
    return opt, history


@pytest.fixture(scope="module")
def scan_data():
    rng = np.random.default_rng(1)
    params = random_tree(rng, SCAN_TEMPLATE)
    return params, [_dyadic(random_tree(rng, SCAN_TEMPLATE, leading=(8,))) for _ in range(3)]


@pytest.mark.parametrize("name", sorted(SCAN_TRANSFORMS))
def test_scan_sync_matches_replicated_optax(name, scan_data):
    """Masks inside a layer bucket (w decayed, b/scale not), an active clip whose norm spans every
    layer's rows and the rest buckets, padding: all as plain optax on the replicated tree."""
    params, grads = scan_data
    opt, history = _run_scan(SCAN_TRANSFORMS[name](), params, grads)
    sync = opt.sync
    assert sync.layer_bucket_sizes == (1024, 128) and sync.rest_bucket_sizes == (1408,)
    assert [m.shape for m in history[0][1].master[:2]] == [(3, b) for b in sync.layer_bucket_sizes]
    reference = _reference(SCAN_TRANSFORMS[name](), params, grads)
    for t, ((got, state), want) in enumerate(zip(history, reference), 1):
        assert_optimizer_close(got, want, t, what=f"{name}, step {t}")
        for g, m in zip(jax.tree.leaves(got), jax.tree.leaves(opt.unflatten_master(state.master))):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(m))  # float32 params: the master
    # Padding of every shard (the layer buckets' in every row) stays zero.
    refs = sync.flat_chains
    for (chain, k), master in zip(refs, history[-1][1].master):
        bucket = chain.layout.buckets[k]
        np.testing.assert_array_equal(np.asarray(master)[..., bucket.num_elements:], 0.0)
    assert any(chain.layout.buckets[k].padding and chain.num_layers for chain, k in refs)


def test_scan_sync_masks_and_clip_act(scan_data):
    """The parity above compares live effects: clipping is active and the mask splits a layer bucket."""
    params, grads = scan_data
    assert all(float(optax.tree.norm(_mean(g))) > 5.0 for g in grads)
    masked = _reference(SCAN_TRANSFORMS["adamw_masked_clipped"](), params, grads[:1])[0]
    plain = _reference(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.01)), params, grads[:1])[0]
    assert np.max(np.abs(masked["blocks"]["w"] - plain["blocks"]["w"])) > 1e-5  # decayed
    assert_optimizer_close(masked["blocks"]["b"], plain["blocks"]["b"], 1)  # not decayed (1e-3 if it were)


def test_scan_sync_state_layout(scan_data):
    params, _ = scan_data
    sync = jd.ScanGradSync(params, data_mesh(8), stacked={"blocks": True, "embed": False, "head": False},
                           bucket_size=500)
    opt = jd.DistributedOptimizer(optax.adam(1e-3), sync)
    state = opt.init_sharded(params)
    specs = opt.state_specs()
    num_layer = len(sync.layer_bucket_sizes)
    assert specs.master == (P(None, "data"),) * num_layer + (P("data"),) * len(sync.rest_bucket_sizes)
    assert opt.check_state(state) is state
    for m, p in zip(jax.tree.leaves(opt.unflatten_master(state.master)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(m, p)
    summary = opt.memory_summary()
    assert 1 / 8 <= summary["ratio"] < 1 / 8 * 1.2  # padding + the step count only
    # Another layer count, or the same leaves under a GradSync, is another layout.
    flat = jd.DistributedOptimizer(optax.adam(1e-3), jd.GradSync(params, data_mesh(8), bucket_size=500))
    assert flat.fingerprint != opt.fingerprint
    with pytest.raises(ValueError, match="different bucket layout"):
        opt.check_state(flat.init_sharded(params))
