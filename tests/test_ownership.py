"""Whole-parameter ownership: each device updates whole parameters, so transforms that need them
(Muon, Adafactor, LAMB, LARS, Muon + AdamW by label) run sharded and equal optax on one device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_drain as jd
from helpers import assert_within, rounding_bound, rounding_chain
from jax_drain.layout import BucketLayout

# Leaves of like sizes (at most 96 elements), so that 12 of them fill two buckets of 8 owner
# slots (a slot holds the largest leaf): several buckets of whole leaves at the compile time of
# 12 leaves (a Newton-Schulz loop per matrix); every matrix dimension >= 8 but w3's.
SHAPES = {"w1": (8, 12), "b1": (12,), "w2": (12, 8), "scale": (), "w3": (8, 4), "embed": (12, 8),
          **{f"extra/m{i}": (8 + i % 3, 8) for i in range(6)}}
STEPS = 5


def _params(seed: int = 0):
    rng = np.random.default_rng(seed)
    flat = {k: jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for k, s in SHAPES.items()}
    return {**{k: v for k, v in flat.items() if "/" not in k},
            "extra": {k.split("/")[1]: v for k, v in flat.items() if "/" in k}}


def _muon():
    # Two Newton-Schulz iterations, not five: each still multiplies whole matrices, which is what
    # ownership must give it, and optax unrolls the loop into every program this file compiles.
    return optax.contrib.muon(0.02, ns_steps=2)


def _muon_and_adamw():
    label = lambda p: jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adamw", p)  # noqa: E731
    return optax.multi_transform({"muon": _muon(), "adamw": optax.adamw(1e-2, weight_decay=0.1)},
                                 label)


TRANSFORMS = {
    "muon": _muon,
    # Factored second moments for every matrix here (dimensions >= 8).
    "adafactor": lambda: optax.adafactor(0.01, min_dim_size_to_factor=8),
    "lamb": lambda: optax.lamb(0.01, weight_decay=0.01),
    "lars": lambda: optax.lars(0.1),
    "muon+adamw": _muon_and_adamw,
}


# -- the layout ----------------------------------------------------------------------------------


def test_each_leaf_lies_whole_in_one_owner_slot_largest_first():
    tree = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    layout = BucketLayout.build(tree, bucket_size=None, shard_multiple=128, owners=4)
    (bucket,) = layout.buckets
    slot = bucket.padded_size // 4
    assert bucket.padded_size % 128 == 0
    fill = [0] * 4
    for p in bucket.pieces:
        owner = p.offset // slot
        assert p.start == 0 and p.size == layout.slots[p.leaf].size  # whole
        assert p.offset + p.size <= (owner + 1) * slot  # inside its owner's slot
        fill[owner] += p.size
    # Largest first to the least filled, as greedy places them.
    sizes = sorted((int(np.prod(s)) for s in SHAPES.values()), reverse=True)
    want = [0] * 4
    for size in sizes:
        want[min(range(4), key=lambda r: (want[r], r))] += size
    assert sorted(fill) == sorted(want) and max(fill) <= slot
    values = {k: jnp.arange(int(np.prod(s)), dtype=jnp.float32).reshape(s) + 1 for k, s in SHAPES.items()}
    (whole,) = layout.flatten(values)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), layout.unflatten((whole,)), values))
    used = np.zeros(bucket.padded_size, bool)
    for p in bucket.pieces:
        used[p.offset:p.offset + p.size] = True
    assert not np.any(np.asarray(whole)[~used])  # the gaps are zero padding


def test_layout_and_sync_refuse_what_ownership_cannot_do(cpu_devices):
    tree = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    with pytest.raises(ValueError, match="cannot split leaves"):
        BucketLayout.build(tree, bucket_size=16, owners=2, split_leaves=True)
    with pytest.raises(ValueError, match="owners must be an int"):
        BucketLayout.build(tree, bucket_size=16, owners=0)
    mesh = Mesh(np.array(cpu_devices).reshape(4, 2), ("data", "model"))
    with pytest.raises(ValueError, match=r"\['w'\] are split over other mesh axes"):
        jd.GradSync(tree, mesh, param_specs={"w": P(None, "model")}, ownership="param")
    with pytest.raises(ValueError, match="ownership must be 'element'"):
        jd.GradSync(tree, mesh, ownership="whole")


# -- the optimizer: equal to optax on one device -------------------------------------------------


def _mesh(kind: str, cpu_devices) -> Mesh:
    if kind == "data":
        return Mesh(np.array(cpu_devices), ("data",))
    return Mesh(np.array(cpu_devices).reshape(2, 4), ("replica", "data"))


def _owned_step(tx, mesh, params, **options):
    """``(optimizer, step)``: one update from every device's gradient (stacked on axis 0)."""
    outer = {"outer_axis": "replica"} if "replica" in mesh.axis_names else {}
    sync = jd.GradSync(params, mesh, bucket_size=500, ownership="param", **outer)
    assert sync.num_buckets >= 2 and sync.layout.owners == mesh.shape["data"]
    opt = jd.DistributedOptimizer(tx, sync, **options)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(tuple(mesh.axis_names)), opt.state_specs()),
                       out_specs=(sync.param_specs, opt.state_specs()))
    def step(grads, state):
        return opt.update(sync.reduce_scatter(jax.tree.map(lambda g: g[0], grads)), state)

    return opt, step


class _OneDeviceOptax:
    """``tx`` on one device fed the same exact gradients (dyadic values, whose device and
    micro-batch means are exact): what remains is ``tx``'s own arithmetic, compiled in another
    program than the reference's, so the parameters after each step agree to the rounding of the
    longest chain of the reference's ``update``'s operations over the steps so far."""

    def __init__(self, tx, params):
        self.params, self.want, self.state = params, params, tx.init(params)
        self.update, self.t = jax.jit(tx.update), 0
        self.chain = rounding_chain(lambda g, s, p: tx.update(g, s, p)[0], params, self.state, params)
        self.moves = jax.tree.map(lambda _: 0.0, params)

    def check(self, grads, got, what: str) -> None:
        """One reference step on ``grads``; ``got`` (the parameters after it) must keep to it."""
        self.t += 1
        updates, self.state = self.update(grads, self.state, self.want)
        self.want = optax.apply_updates(self.want, updates)
        self.moves = jax.tree.map(lambda m, u: max(m, float(np.max(np.abs(np.asarray(u)), initial=0.0))),
                                  self.moves, updates)
        # Each element's update: t steps of tx's chain of roundings, at the largest update so far.
        bound = jax.tree.map(lambda m, w: rounding_bound(self.t * self.chain, m)
                             + rounding_bound(self.t, np.abs(np.asarray(w))), self.moves, self.want)
        assert_within(got, self.want, bound, what=f"{what}, step {self.t}")

    def check_trained(self) -> None:
        moved = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), self.want,
                             self.params)
        assert all(m > 1e-4 for m in jax.tree.leaves(moved)), moved  # it trained every leaf


def _dyadic(rng, params):
    return jax.tree.map(lambda x: jnp.asarray(rng.integers(-512, 512, size=x.shape) / 1024.0, jnp.float32), params)


def _against_optax(tx, reference_tx, mesh, what: str, *, move_to: Mesh | None = None,
                   directory=None, **options) -> None:
    """Every device sends the same gradient (:class:`_OneDeviceOptax`). With ``move_to`` the
    state is saved after step 2 and restored onto that mesh's owners (through ``directory``) for
    the other steps."""
    params = _params()
    opt, step = _owned_step(tx, mesh, params, **options)
    state = opt.init_sharded(params)
    rng = np.random.default_rng(1)
    reference = _OneDeviceOptax(reference_tx, params)
    for t in range(1, STEPS + 1):
        grads = _dyadic(rng, params)
        if move_to is not None and t == 3:
            jd.save_checkpoint(directory, state, step=2)
            opt, step = _owned_step(tx, move_to, params, **options)
            state, _ = jd.restore_checkpoint(directory, opt.abstract_state())
        got, state = step(jax.tree.map(lambda g: jnp.broadcast_to(g, (8, *g.shape)), grads), state)
        reference.check(grads, got, what)
    reference.check_trained()


@pytest.mark.parametrize("name", TRANSFORMS)
def test_whole_parameter_transforms_equal_optax_on_one_device_across_a_checkpoint_move(name, cpu_devices, tmp_path):
    """Two steps on 8 owners, saved, restored onto ``replica=2 x data=4`` (4 owners, each with
    parameters and ``tx`` state that other owners held), three more steps: every step equals
    optax on one device. Adafactor's factored moments, LAMB's and LARS's per-parameter norms,
    Muon's whole matrices and a ``multi_transform``'s per-label state move with their
    parameters; the step counts shared by all parameters stay."""
    tx = TRANSFORMS[name]()
    _against_optax(tx, tx, _mesh("data", cpu_devices), f"{name} moved from 8 to 4 owners",
                   move_to=_mesh("replica_data", cpu_devices), directory=tmp_path / "ckpt")


def test_micro_batches_with_whole_parameters_equal_optax_on_one_device(cpu_devices):
    """The train step with 2 micro-batches per device and Muon + AdamW per owner. The loss is
    linear in the parameters, each example weighting three fixed directions by its own dyadic
    weights, so the gradient (the mean over 16 examples of 8 devices x 2 micro-batches) is
    exact, and a micro-batch left out or counted twice turns it, which the scale-free updates
    of Muon and Adam would not hide."""
    params = _params()
    directions = [_dyadic(np.random.default_rng(4 + k), params) for k in range(3)]

    def along(p, d):
        return sum(jnp.sum(a * b) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(d)))

    def loss(p, batch):
        return sum(jnp.mean(batch["w"][:, k]) * along(p, d) for k, d in enumerate(directions))

    rng = np.random.default_rng(7)
    batches = [{"w": (rng.integers(-15, 16, size=(16, 3)) / 8.0).astype(np.float32)} for _ in range(STEPS)]
    tx = TRANSFORMS["muon+adamw"]()
    step = jd.make_train_step(params, loss, tx, Mesh(np.array(cpu_devices), ("data",)),
                              jd.TrainConfig(bucket_size=500, microbatches=2), example_batch=batches[0])
    assert step.ownership == "param"
    state, reference = step.init(params), _OneDeviceOptax(tx, params)
    for batch in batches:
        state, _ = step(state, batch)
        means = batch["w"].astype(np.float64).mean(axis=0)
        grads = jax.tree.map(lambda *d: jnp.asarray(sum(m * np.asarray(x, np.float64) for m, x in zip(means, d)),
                                                    jnp.float32), *directions)
        reference.check(grads, step.master_params(state), "muon+adamw, 2 micro-batches")
    reference.check_trained()


def test_max_grad_norm_clips_over_every_owner(cpu_devices):
    """``max_grad_norm`` with Muon per owner equals ``optax.chain(clip_by_global_norm, muon)`` on
    one device; the threshold is below every step's gradient norm, so every step is clipped."""
    tx = _muon()
    _against_optax(tx, optax.chain(optax.clip_by_global_norm(1.0), tx), _mesh("data", cpu_devices),
                   "muon clipped to norm 1", max_grad_norm=1.0)


def test_state_per_device_is_one_owner_share():
    """Optimizer state per device: the largest owner's ``tx`` state (packed per dtype into arrays
    of the first shard's size), about 1/8 of one-device optax's times the assignment's imbalance."""
    mesh = Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
    tree = {f"w{i}": jax.ShapeDtypeStruct((64, 64 + 8 * i), jnp.float32) for i in range(12)}
    sync = jd.GradSync(tree, mesh, bucket_size=None, ownership="param")
    opt = jd.DistributedOptimizer(optax.adafactor(0.01), sync, check_tx=False)
    per_owner = [sum(np.prod(tree[sync.placements[p.leaf].path].shape) for p in opt._owned.pieces[r]) for r in range(8)]
    imbalance = max(per_owner) / np.mean(per_owner)
    summary = opt.memory_summary()
    one_device_state = summary["replicated"] - 4 * sum(np.prod(x.shape) for x in tree.values())
    state_bytes = summary["distributed"] - 4 * sum(sync.layout.bucket_sizes) // 8
    # Adafactor's factored state is far below the parameters'; a slack of one packed array per dtype.
    assert state_bytes <= imbalance * one_device_state / 8 + 2 * 4 * sync.layout.bucket_sizes[0] // 8
    assert 1.0 <= imbalance < 1.2


# -- the train step -----------------------------------------------------------------------------


def _loss(p, batch):
    h = jnp.tanh(batch["x"] @ p["embed"][:8].T @ p["w1"] + p["b1"]) @ p["w2"] * p["scale"]
    extra = sum(jnp.sum(jnp.tanh(m[:, :4] * h[:, :1].mean())) for m in p["extra"].values())
    return jnp.mean((h @ p["w3"] - batch["y"]) ** 2) + 1e-2 * extra


def _batches(n: int):
    rng = np.random.default_rng(2)
    return [{"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=(16, 4)).astype(np.float32)}
            for _ in range(n)]


@pytest.mark.parametrize("name, want", [(name, "param") for name in TRANSFORMS] + [("adamw", "element")])
def test_train_step_chooses_its_ownership_trains_checkpoints_and_moves(name, want, cpu_devices, tmp_path):
    """The step chooses whole parameters for the transforms that need them and flat shards for
    AdamW; what it chose trains and resumes bit for bit. Per-owner state moves onto 4 owners
    (each transform's numbers on owners: the tests above against optax); flat-shard state does
    not become per-owner state."""
    tx = TRANSFORMS[name]() if name in TRANSFORMS else jd.adamw(1e-2, weight_decay=0.1, max_norm=1.0)
    mesh = Mesh(np.array(cpu_devices), ("data",))
    params, batches = _params(), _batches(4)
    config = jd.TrainConfig(bucket_size=500)
    step = jd.make_train_step(params, _loss, tx, mesh, config, example_batch=batches[0])
    assert step.ownership == want and step.sync.layout.owners == (8 if want == "param" else None)
    state = step.init(params)
    for batch in batches[:2]:
        state, _ = step(state, batch)
    jd.save_checkpoint(tmp_path / "ckpt", state)
    continued = [float(step(state, b)[1].loss) for b in batches[2:3]]
    restored, _ = jd.restore_checkpoint(tmp_path / "ckpt", step.abstract_state())
    assert [float(step(restored, b)[1].loss) for b in batches[2:3]] == continued
    if want == "param":
        # On 4 owners: the parameters move exactly, so the loss differs by its own rounding (the
        # examples split over 4 devices instead of 8).
        other = jd.make_train_step(params, _loss, tx, Mesh(np.array(cpu_devices[:4]), ("data",)), config,
                                   example_batch=batches[0])
        moved, _ = jd.restore_checkpoint(tmp_path / "ckpt", other.abstract_state())
        got = float(other(moved, batches[2])[1].loss)
        assert abs(got - continued[0]) <= rounding_bound(rounding_chain(_loss, params, batches[2]), abs(got))
    else:
        owned = jd.make_train_step(params, _loss, tx, mesh, jd.TrainConfig(bucket_size=500, ownership="param"),
                                   example_batch=batches[0])
        with pytest.raises(jd.CheckpointMismatchError, match="saved on flat shards .* does not convert"):
            jd.restore_checkpoint(tmp_path / "ckpt", owned.abstract_state())


def test_train_step_refusals_say_what_to_use(cpu_devices):
    mesh = Mesh(np.array(cpu_devices).reshape(4, 2), ("data", "model"))
    params = _params()
    specs = {k: (P(None, "model") if k == "w1" else None) for k in params}
    with pytest.raises(ValueError, match="not with tensor-parallel or expert params"):
        jd.make_train_step(params, _loss, _muon(), mesh,
                           jd.TrainConfig(param_specs=specs, ownership="param"))
    with pytest.raises(ValueError, match="split_leaves"):
        jd.TrainConfig(ownership="param", split_leaves=True)
    data = Mesh(np.array(cpu_devices), ("data",))
    # A global norm clip inside a whole-parameter tx would see one owner's parameters only.
    clipped = optax.chain(optax.clip_by_global_norm(1e-3), optax.lamb(0.01))
    step = jd.make_train_step(params, _loss, clipped, data, jd.TrainConfig(bucket_size=500, ownership="param"),
                              example_batch=_batches(1)[0])
    with pytest.raises(ValueError, match=r"computes something over several parameters.*max_grad_norm"):
        step(step.init(params), _batches(1)[0])


def test_shard_params_with_whole_parameter_ownership_equals_zero1(cpu_devices):
    """ZeRO-3 gathers the same buckets (its gradient is ZeRO-1's): Muon per owner gives the same
    losses bit for bit."""
    mesh = Mesh(np.array(cpu_devices), ("data",))
    batches = _batches(3)
    losses = {}
    for shard_params in (False, True):
        step = jd.make_train_step(_params(), _loss, _muon(), mesh,
                                  jd.TrainConfig(bucket_size=500, shard_params=shard_params), example_batch=batches[0])
        assert step.ownership == "param"
        state, losses[shard_params] = step.init(_params()), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses[shard_params].append(float(metrics.loss))
    assert losses[True] == losses[False] and losses[True][-1] < losses[True][0]


def test_the_whole_parameter_check_runs_once_per_tx_and_shapes_and_refuses_every_time():
    """A step built again with the same ``tx`` (a restore, another mesh, a planner's search)
    does not trace the check again; a refusal is raised again each time, and another tx object
    or other shapes are checked anew."""
    from jax_drain.ownership import check_per_parameter

    calls = []

    def counted(tx):
        def update(*args):
            calls.append(1)
            return tx.update(*args)
        return optax.GradientTransformation(tx.init, update)

    tree = {"w": jax.ShapeDtypeStruct((5, 4), jnp.float32), "v": jax.ShapeDtypeStruct((6,), jnp.float32)}
    tx = counted(_muon())
    check_per_parameter(tx, tree)
    assert calls
    calls.clear()
    check_per_parameter(tx, tree)
    assert not calls  # passed before: not run again
    check_per_parameter(tx, {**tree, "u": jax.ShapeDtypeStruct((2, 3), jnp.float32)})
    assert calls  # other shapes
    calls.clear()
    check_per_parameter(counted(_muon()), tree)
    assert calls  # another tx
    clipped = optax.chain(optax.clip_by_global_norm(1e-3), optax.lamb(0.01))
    for _ in range(2):
        with pytest.raises(ValueError, match="computes something over several parameters"):
            check_per_parameter(clipped, tree)


@pytest.mark.parametrize("name, want", [(name, True) for name in TRANSFORMS]
                         + [("adamw", False), ("clipped_adamw", False)])
def test_the_ownership_probe_answers_once_per_tx_and_shapes(name, want):
    """Whole parameters for the transforms that need them, not for element-wise ones nor a
    global-norm clip; the same tx object on the same shapes is not traced again (a step built
    again), other shapes are."""
    from jax_drain.optimizer import needs_whole_parameters

    inner = {"adamw": lambda: optax.adamw(1e-2),
             "clipped_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
             **TRANSFORMS}[name]()
    calls = []

    def update(*args):
        calls.append(1)
        return inner.update(*args)

    tx = optax.GradientTransformation(inner.init, update)
    tree = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    assert needs_whole_parameters(tx, tree) is want
    assert calls
    calls.clear()
    assert needs_whole_parameters(tx, tree) is want
    assert not calls
    assert needs_whole_parameters(tx, {**tree, "u": jax.ShapeDtypeStruct((9, 8), jnp.float32)}) is want
    assert calls
