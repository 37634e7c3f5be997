"""Error feedback: each device's wire rounding error is added to its next gradient, so a
quantized wire's error does not accumulate over steps; residuals survive skips and checkpoints."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import data_mesh
from helpers import adam_rounding_bounds, assert_within, assert_within_rounding
from jax.sharding import PartitionSpec as P

import jax_drain as jd
from jax_drain import _compat, models
from jax_drain.collectives import QUANTIZED_MODES, reduce_scatter_bucket, wire_values
from jax_drain.feedback import abstract_error_feedback, error_feedback_specs, init_error_feedback

SDS = jax.ShapeDtypeStruct
# Leaves of very different scales sharing buckets.
TREE = {"w": SDS((37, 29), jnp.float32), "norm": SDS((29,), jnp.float32), "head": SDS((29, 13), jnp.float32)}
SCALE = {"w": 1.0, "norm": 1e-3, "head": 30.0}


def _grads(seed=0):
    """Per-device gradients ``[8, ...]``: device ``d``'s local gradient is row ``d``."""
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.normal(size=(8, *s.shape)) * SCALE[k], jnp.float32) for k, s in TREE.items()}


def _reducer(sync, feedback: bool):
    specs = error_feedback_specs(sync).residuals
    if feedback:
        fn = lambda g, r: sync.reduce_scatter(jax.tree.map(lambda x: x[0], g), residuals=r)
        return jax.jit(_compat.shard_map(fn, mesh=sync.mesh, in_specs=(P("data"), specs),
                                         out_specs=(sync.shard_specs(), specs)))
    fn = lambda g: sync.reduce_scatter(jax.tree.map(lambda x: x[0], g))
    return jax.jit(_compat.shard_map(fn, mesh=sync.mesh, in_specs=P("data"), out_specs=sync.shard_specs()))


def _trajectory(case, params, batches):
    """The one-device reference's parameters before each step."""
    from test_train_meshes import _reference

    return [params] + [_reference(case, params, batches[:t])[0] for t in range(1, len(batches))]


def _largest_local_gradients(case, params, batch, sends: int = 1):
    """Per leaf, the largest gradient element any data-parallel device sends for its share of
    ``batch``, in ``sends`` parts (ZeRO-3 sends each micro-batch's) (times ``1 + 1/127``: the
    residual it adds is at most half an int8 step)."""
    shape, names = case.mesh
    devices = int(np.prod([n for n, name in zip(shape, names) if name in ("replica", "data", "expert")])) * sends
    split = jax.tree.map(lambda x: x.reshape(devices, -1, *x.shape[1:]), batch)
    local = jax.vmap(jax.grad(case.reference_loss), in_axes=(None, 0))(params, split)
    return jax.tree.map(lambda g: float(np.max(np.abs(np.asarray(g, np.float64)))) * (1 + 1 / 127), local)


@pytest.mark.parametrize("mode", ["int8_accum", "fp8_accum", "fp16_accum"])
def test_wire_values_are_what_the_receivers_sum(mode):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, 8 * 300)).astype(np.float32)
    x[:, :300] *= 1e-3  # a small leaf beside a large one
    starts = (0, 300, 1000)
    fn = lambda b: (reduce_scatter_bucket(b[0], "data", mode=mode, average=False, block_starts=starts),
                    wire_values(b[0], 8, mode=mode, block_starts=starts)[None])
    shard, sent = jax.jit(_compat.shard_map(fn, mesh=data_mesh(8), in_specs=P("data"),
                                            out_specs=(P("data"), P("data"))))(x)
    sent = np.asarray(sent, np.float64)
    # A float32 sum of the 8 devices' wire values, in another order.
    assert_within_rounding(shard, sent.sum(axis=0), additions=8, scale=np.abs(sent).sum(axis=0), what=mode)
    assert 0 < np.abs(sent - x).max()  # the wire does round ...
    # ... each leaf on its own scale: within fp8's 1/16 (int8's 1/254, fp16's 2**-11) of the small leaf's absmax.
    assert np.abs(sent[:, :300] - x[:, :300]).max() < np.abs(x[:, :300]).max() / 16


@pytest.mark.parametrize("mode", QUANTIZED_MODES)
def test_feedback_keeps_the_summed_error_to_one_step(mode):
    """The same gradients sent ``T`` times: without feedback the same rounding error is added
    ``T`` times; with it the sum of what arrived is off by one step's rounding at most."""
    sync = jd.GradSync(TREE, data_mesh(8), bucket_size=500, reduce=mode)
    grads, steps = _grads(), 40
    with_feedback, without = _reducer(sync, True), _reducer(sync, False)
    residuals = init_error_feedback(sync).residuals
    total = {k: np.zeros(s.shape) for k, s in TREE.items()}
    plain = sync.unflatten(without(grads))
    for _ in range(steps):
        shards, residuals = with_feedback(grads, residuals)
        for k, v in sync.unflatten(shards).items():
            total[k] += np.asarray(v, np.float64)
    for k in TREE:
        exact = np.asarray(grads[k], np.float64).mean(axis=0)
        one_step = np.linalg.norm(np.asarray(plain[k], np.float64) - exact)
        assert one_step > 0
        # Without feedback the summed error is steps * one_step; with it, about one step's.
        assert np.linalg.norm(total[k] - steps * exact) < 3 * one_step, k


def test_feedback_is_bit_identical_drained_and_undrained():
    grads = _grads(1)
    outs = []
    for drain in (True, False):
        sync = jd.GradSync(TREE, data_mesh(8), bucket_size=500, reduce="int8_accum", drain=drain)
        residuals = init_error_feedback(sync).residuals
        reduce = _reducer(sync, True)
        for _ in range(3):
            shards, residuals = reduce(grads, residuals)
        outs.append((shards, residuals))
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_array_equal(a, b)


def test_feedback_through_the_backward_scan_equals_after_backward():
    config = models.GPTConfig(num_layers=3, d_model=32, num_heads=2, seq_len=8, vocab_size=50, scan_layers=True)
    params, loss_fn = models.init_params(config, jax.random.key(0)), models.make_loss(config)
    rng = np.random.default_rng(4)
    batch = jax.tree.map(lambda x: jnp.asarray(rng.integers(0, 50, size=x.shape), x.dtype),
                         models.example_batch(config, 16))
    mask = jd.stacked_leaves(loss_fn, params, jax.tree.map(lambda x: x[:2], batch))
    sync = jd.ScanGradSync(params, data_mesh(8), stacked=mask, bucket_size=3000, reduce="int8_accum")
    specs = error_feedback_specs(sync).residuals
    in_loop = jax.jit(_compat.shard_map(
        lambda p, r, b: sync.value_and_grad(loss_fn, error_feedback=True)(p, r, b)[1:],
        mesh=sync.mesh, in_specs=(P(), specs, P("data")), out_specs=(sync.shard_specs(), specs)))
    after = jax.jit(_compat.shard_map(
        lambda p, r, b: sync.reduce_scatter(jax.grad(lambda q: loss_fn(q, b))(sync.local_params(p)), residuals=r),
        mesh=sync.mesh, in_specs=(P(), specs, P("data")), out_specs=(sync.shard_specs(), specs)))
    residuals = init_error_feedback(sync).residuals
    for _ in range(2):  # the second step starts from non-zero residuals
        got, want = in_loop(params, residuals, batch), after(params, residuals, batch)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b)
        residuals = got[1]
    assert any(np.abs(np.asarray(r, np.float32)).max() > 0 for r in jax.tree.leaves(residuals))


def test_feedback_without_a_lossy_wire_is_refused():
    with pytest.raises(ValueError, match="error feedback needs a wire"):
        jd.GradSync(TREE, data_mesh(8), reduce="bf16").value_and_grad(lambda p, x: 0.0, error_feedback=True)
    with pytest.raises(ValueError, match="no error"):
        jd.GradSync(TREE, data_mesh(8), reduce="fp32_accum").value_and_grad(lambda p, x: 0.0, error_feedback=True)
    # A narrower wire is lossy: accepted.
    jd.GradSync(TREE, data_mesh(8), wire_dtype=jnp.bfloat16).value_and_grad(lambda p, x: 0.0, error_feedback=True)
    with pytest.raises(ValueError, match="error_feedback=True needs a wire"):
        jd.TrainConfig(reduce="fp32", error_feedback=True)


# -- in the train step ---------------------------------------------------------------------------

D, O, B = 12, 5, 16


def _params():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(D, O)) * 0.3, jnp.float32),
            "b": jnp.asarray(rng.normal(size=(O,)) * 0.1, jnp.float32)}


def _loss(p, batch):
    return jnp.mean(jnp.sum((jnp.tanh(batch["x"] @ p["w"]) + p["b"] - batch["y"]) ** 2, axis=-1))


def _batch(seed):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(B, D)).astype(np.float32), "y": rng.normal(size=(B, O)).astype(np.float32)}


def _step(mesh=None, **config):
    options = dict(bucket_size=O, reduce="int8_accum", error_feedback=True, donate=False) | config
    return jd.make_train_step(_params(), _loss, optax.sgd(0.1), mesh or data_mesh(8), jd.TrainConfig(**options),
                              example_batch=_batch(0))


def _trained(batches, **config):
    """``_step(**config)`` and its state after a step on each of ``batches``."""
    step = _step(**config)
    state = step.init()
    for batch in batches:
        state, _ = step(state, batch)
    return step, state


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_train_step_carries_residuals_and_keeps_them_on_a_skipped_step():
    step = _step()
    state = step.init()
    assert all(not x.any() for x in _leaves(state.error_feedback))
    state, metrics = step(state, _batch(1))
    assert not bool(metrics.skipped)
    assert any(x.any() for x in _leaves(state.error_feedback))
    bad = _batch(2)
    bad["x"][3] = np.nan
    after, metrics = step(state, bad)
    assert bool(metrics.skipped)
    for a, b in zip(_leaves(state), _leaves(after)):
        np.testing.assert_array_equal(a, b)


def test_train_step_with_feedback_tracks_fp32_accum_closer_than_without():
    """Plain SGD sums the gradients into the parameters, so the wire's error shows up there:
    after 30 steps, int8 with feedback is closer to fp32_accum's parameters than int8 without."""
    batches = [_batch(10 + i) for i in range(30)]

    def final(**config):
        _, state = _trained(batches, **config)
        return {k: np.asarray(v, np.float64) for k, v in state.params.items()}

    exact = final(reduce="fp32_accum", error_feedback=False)
    plain, fed = final(error_feedback=False), final()
    distance = lambda p: np.sqrt(sum(np.sum((p[k] - exact[k]) ** 2) for k in exact))
    assert distance(fed) < 0.5 * distance(plain), (distance(fed), distance(plain))


def test_shard_params_feeds_back_what_zero1_does():
    """ZeRO-3 sends every bucket with the same residual added as ZeRO-1 (the gradient is the
    same, gathered from the shards): parameters and residuals bit for bit after 6 steps, the
    residuals non-zero; without feedback, ZeRO-3 lands elsewhere (the test can fail)."""
    batches = [_batch(20 + i) for i in range(6)]

    def run(**config):
        step, state = _trained(batches, **config)
        residuals = None if state.error_feedback is None else _leaves(state.error_feedback)
        return step.master_params(state), residuals

    (zero1, fed1), (zero3, fed3) = run(), run(shard_params=True)
    assert len(fed3) == len(fed1) == 2 and all(r.any() for r in fed3)  # w and b, one bucket each
    for a, b in zip(fed3, fed1):
        np.testing.assert_array_equal(a, b)
    for k in zero1:
        np.testing.assert_array_equal(zero3[k], zero1[k])
    unfed, _ = run(shard_params=True, error_feedback=False)
    assert any(not np.array_equal(unfed[k], zero1[k]) for k in zero1)


def test_shard_params_feeds_a_layer_bucket_read_by_two_remat_regions_once():
    """In a scanned stack, a layer bucket whose leaves two remat regions of the layer body read
    is gathered in each; its two gradients are summed and sent once, with its residual added
    once: ZeRO-3's parameters and residuals equal the in-scan ZeRO-1 step's bit for bit after 4
    steps (a residual added per region would double it)."""
    rng = np.random.default_rng(1)
    params = {"a": jnp.asarray(rng.normal(size=(3, D)) * 0.3, jnp.float32),
              "b": jnp.asarray(rng.normal(size=(3, D)) * 0.3, jnp.float32)}

    def loss(p, batch):
        def layer(h, q):
            h = jax.checkpoint(lambda h, a: jnp.tanh(h * a))(h, q["a"])
            return jax.checkpoint(lambda h, b: h + jnp.sin(h * b))(h, q["b"]), None

        h, _ = jax.lax.scan(layer, batch["x"], p)
        return jnp.mean(h ** 2)

    def run(**config):
        options = dict(bucket_size=10_000, reduce="int8_accum", scan_layers=True, error_feedback=True) | config
        step = jd.make_train_step(params, loss, optax.sgd(0.1), data_mesh(8), jd.TrainConfig(**options),
                                  example_batch=_batch(0))
        assert step.sync.chains[0].num_buckets == 1  # a and b in one layer bucket
        state = step.init()
        for t in range(4):
            state, _ = step(state, _batch(30 + t))
        return step.master_params(state), _leaves(state.error_feedback)

    (zero1, fed1), (zero3, fed3) = run(), run(shard_params=True)
    assert all(r.any() for r in fed3)
    for a, b in zip(fed3, fed1):
        np.testing.assert_array_equal(a, b)
    for k in zero1:
        np.testing.assert_array_equal(zero3[k], zero1[k])


def test_checkpoint_keeps_residuals_on_the_same_layout_and_restarts_them_elsewhere(tmp_path):
    step = _step()
    state, _ = step(step.init(), _batch(1))
    jd.save_checkpoint(tmp_path / "ckpt", state)
    restored, _ = jd.restore_checkpoint(tmp_path / "ckpt", step.abstract_state())
    for a, b in zip(_leaves(state), _leaves(restored)):
        np.testing.assert_array_equal(a, b)
    # Another mesh: the optimizer state moves, the residuals start from zero.
    other = _step(mesh=data_mesh(4))
    with pytest.warns(UserWarning, match="start from zero"):
        moved, _ = jd.restore_checkpoint(tmp_path / "ckpt", other.abstract_state())
    assert all(not x.any() for x in _leaves(moved.error_feedback))
    np.testing.assert_array_equal(other.master_params(moved)["w"], step.master_params(state)["w"])
    other(moved, _batch(2))
    # A checkpoint without feedback restores into a step with it (zeros), and back.
    plain = _step(error_feedback=False)
    jd.save_checkpoint(tmp_path / "plain", plain(plain.init(), _batch(1))[0])
    with pytest.warns(UserWarning, match="start from zero"):
        fed, _ = jd.restore_checkpoint(tmp_path / "plain", step.abstract_state())
    assert all(not x.any() for x in _leaves(fed.error_feedback))
    unfed, _ = jd.restore_checkpoint(tmp_path / "ckpt", plain.abstract_state())
    assert unfed.error_feedback is None
    with pytest.raises(ValueError, match="error-feedback residuals"):
        step(unfed, _batch(2))


@pytest.mark.gpu_compile
def test_feedback_sends_the_same_bytes_on_the_gpu_compiler():
    """Compile-only 8xH100: with feedback each bucket is still one int8 all-to-all of the same
    bytes; the residual arithmetic is local."""
    from jax_drain.planner.schedule import parse_schedule
    from jax_drain.planner.targets import gpu_mesh

    mesh = gpu_mesh((8,), ("data",))
    params = {f"w{i}": SDS((512, 512), jnp.bfloat16) for i in range(4)}
    batch = SDS((8 * 64, 512), jnp.bfloat16)
    loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w0"] @ p["w1"] @ p["w2"] @ p["w3"]).astype(jnp.float32) ** 2)

    def all_to_alls(feedback):
        sync = jd.GradSync(params, mesh, bucket_size=512 * 512, reduce="int8_accum")
        residuals = abstract_error_feedback(sync).residuals
        specs = error_feedback_specs(sync).residuals
        fn = sync.value_and_grad(loss, error_feedback=feedback)
        if feedback:
            in_specs, out_specs, args = (P(), specs, P("data")), (P(), sync.shard_specs(), specs), (params, residuals, batch)
        else:
            in_specs, out_specs, args = (P(), P("data")), (P(), sync.shard_specs()), (params, batch)
        step = jax.jit(_compat.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
        sched = parse_schedule(step.lower(*args).compile().as_text())
        return sorted((c.dtype, c.bytes) for c in sched.collectives
                      if c.kind == "all-to-all" and c.in_scope("jax_drain/bucket"))

    plain, fed = all_to_alls(False), all_to_alls(True)
    assert len(plain) == 4 and {d for d, _ in plain} == {"s8"}
    assert fed == plain



# -- every mesh kind -----------------------------------------------------------------------------


ZERO3_KINDS = ["gspmd", "gspmd_scanned", "scanned_outer", "tensor_parallel", "replica_data_model", "expert_parallel",
               "tensor_parallel_scanned", "gspmd_expert"]


@pytest.mark.parametrize("kind", ["tensor_parallel", "gspmd", "replica_data_model", "expert_parallel", "scanned_outer",
                                  "gspmd_scanned_outer", "tensor_parallel_scanned", "gspmd_expert"]
                         + [f"zero3:{k}" for k in ZERO3_KINDS])
def test_feedback_on_every_mesh_kind_trains_like_optax_and_resumes_bit_for_bit(kind, cpu_devices, tmp_path):
    """int8 wire + error feedback on tensor-parallel, replica x data x model (micro-batches),
    expert-parallel and scanned (outer axis, micro-batches; and a GSPMD one synced in its
    backward scan) meshes, and with ZeRO-3 (``zero3:``; a scanned stack's layer buckets fed in
    the backward rule of their gathers): the params stay within the int8 wire's error of
    one-device optax, every chain carries residuals laid out over the axes its buckets differ
    along, and a checkpoint resumes the residuals bit for bit."""
    import dataclasses

    from test_train_meshes import CASES, LR, MAX_NORM, STEPS, WD, _batches, _reference, _step, assert_resumes_bit_for_bit

    zero3 = kind.startswith("zero3:")
    kind = kind.removeprefix("zero3:")
    case = dataclasses.replace(CASES[kind], config={**CASES[kind].config, "reduce": "int8_accum",
                                                    "error_feedback": True, "shard_params": zero3})
    params = case.params(np.random.default_rng(0))
    batches = _batches(1, STEPS + 2)
    step = _step(case, params, batches[0], cpu_devices)
    state = step.init(params)
    for batch in batches[:STEPS]:
        state, _ = step(state, batch)
    held = step.master_params(state) if zero3 else jax.device_get(state.params)
    want, _, gradients = _reference(case, params, batches[:STEPS])
    # Each device sends its local gradient plus its residual, rounded to int8 steps of 1 / 127 of
    # its block's largest value (a block never spans two leaves, so at most the leaf's largest
    # local value, and the residual's half step more). What arrives is the gradient plus last
    # step's residual minus this one's: off by at most two half steps, one step, of the largest
    # local gradient any device holds; the mean over devices keeps that bound. ZeRO-3 sends each
    # micro-batch's gradient with the residual the previous one left: the same telescoping sum,
    # over the micro-batches' own largest gradients.
    sends = case.config.get("microbatches", 1) if zero3 else 1
    local = [_largest_local_gradients(case, p, batch, sends)
             for p, batch in zip(_trajectory(case, params, batches[:STEPS]), batches[:STEPS])]
    int8 = adam_rounding_bounds(gradients, additions=1, rounding=1 / 127, gradient_scales=local, learning_rate=LR,
                                params=params, max_norm=MAX_NORM, weight_decay=WD)
    assert_within(held, want, int8[-1], what=f"{kind}, int8 wire with feedback")
    residuals = jax.tree.leaves(state.error_feedback)
    assert len(residuals) == sum(chain.num_buckets for chain in step.sync.chains)
    assert any(np.abs(np.asarray(r, np.float32)).max() > 0 for r in residuals)
    for r, (chain, k) in zip(residuals, step.sync.flat_chains):
        assert r.shape == chain.global_bucket_shape(k, step.mesh)
    assert_resumes_bit_for_bit(case, params, step, state, batches, cpu_devices, tmp_path)
