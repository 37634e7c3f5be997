"""ZeRO-3 (jax_drain.zero3): parameters held as shards, gathered bucket by bucket at first use;
gradients equal to GradSync's on the gathered parameters, the reduce-scatter chain unchanged."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import data_mesh
from helpers import assert_within, assert_within_rounding, loss_rounding_bounds, rounding_chain
from jax.sharding import Mesh, PartitionSpec as P

import jax_drain as jd
from jax_drain import _compat, zero3

D, H, C, LAYERS = 16, 48, 8, 4


def _params(seed=0):
    rng = np.random.default_rng(seed)
    n = lambda *s, scale=0.3: jnp.asarray(rng.normal(size=s) * scale, jnp.float32)
    p = {"embed": n(C, D), "head_norm": 1.0 + n(D, scale=0.1)}
    for i in range(LAYERS):
        p[f"block{i}"] = {"w_in": n(D, H), "b_in": n(H, scale=0.1), "w_out": n(H, D)}
    return p


def _block(p, h):
    return h + jnp.tanh(h @ p["w_in"] + p["b_in"]) @ p["w_out"]


def _forward(remat: bool):
    block = jax.checkpoint(_block) if remat else _block

    def forward(p, x):
        h = x @ p["embed"]
        for i in range(LAYERS):
            h = block(p[f"block{i}"], h)
        return (h * p["head_norm"]) @ p["embed"].T  # the embedding again: read in two places

    return forward


def _loss(remat: bool):
    forward = _forward(remat)
    return lambda p, batch: jnp.mean((forward(p, batch["x"]) - batch["y"]) ** 2)


def _additions(fn, params, batch, microbatches: int = 1) -> int:
    """Roundings on the longest chain of ``fn(params, batch)`` (a loss or its gradient), then
    the 8 devices' and the micro-batches' sums."""
    return rounding_chain(fn, params, batch) + 8 + microbatches


def _batch(seed=1, n=32):
    rng = np.random.default_rng(seed)
    return {"x": jnp.asarray(rng.normal(size=(n, C)), jnp.float32), "y": jnp.asarray(rng.normal(size=(n, C)), jnp.float32)}


def _mesh(kind):
    devices = np.array(jax.devices("cpu")[:8])
    return data_mesh(8) if kind == "data" else Mesh(devices.reshape(2, 4), ("replica", "data"))


def _both(sync, loss, **options):
    """GradSync.value_and_grad on replicated params, zero3.value_and_grad on their shards."""
    microbatches = options.get("microbatches", 1)

    def reference(p, b):
        return sync.value_and_grad(loss, microbatches=microbatches)(p, b)

    def sharded(p, b):
        return zero3.value_and_grad(sync, loss, **options)(zero3.shard_params(sync, p), b)

    run = lambda fn: jax.jit(_compat.shard_map(fn, mesh=sync.mesh, in_specs=(P(), sync.batch_spec),
                                               out_specs=(P(), sync.shard_specs())))
    return run(reference), run(sharded)


@pytest.mark.parametrize("mesh_kind", ["data", "replica_data"])
@pytest.mark.parametrize("remat", [True, False], ids=["remat", "plain"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
@pytest.mark.parametrize("drain", [True, False], ids=["drain", "nodrain"])
def test_gradients_equal_gradsync_bit_for_bit(mesh_kind, remat, reshard, drain):
    params, batch, loss = _params(), _batch(), _loss(remat)
    mesh = _mesh(mesh_kind)
    outer = {"outer_axis": "replica"} if mesh_kind == "replica_data" else {}
    # ~1.5 blocks per bucket: buckets span remat regions (gathered in both, gradients summed).
    sync = jd.GradSync(params, mesh, bucket_size=1200, drain=drain,
                       order=jd.grad_ready_order(loss, params, jax.tree.map(lambda x: x[:4], batch)), **outer)
    assert sync.num_buckets >= 4
    reference, sharded = _both(sync, loss, reshard_after_forward=reshard)
    (want_loss, want), (got_loss, got) = reference(params, batch), sharded(params, batch)
    assert float(got_loss) == float(want_loss)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    # And the mean gradient is the one-device gradient of the whole batch.
    assert_within_rounding(sync.unflatten(got), jax.grad(loss)(params, batch),
                           additions=_additions(jax.grad(loss), params, batch), what="mean gradient vs one device")


def test_microbatches_reduce_each_micro_batch_and_accumulate():
    params, batch, loss = _params(), _batch(n=64), _loss(True)
    sync = jd.GradSync(params, data_mesh(8), bucket_size=1200)
    reference, sharded = _both(sync, loss, microbatches=2)
    (want_loss, want), (got_loss, got) = reference(params, batch), sharded(params, batch)
    # Each micro-batch reduced on its own, then summed: another order of the same additions.
    assert_within_rounding(got_loss, want_loss, additions=_additions(loss, params, batch, 2), what="loss")
    assert_within_rounding(sync.unflatten(got), sync.unflatten(want), additions=_additions(jax.grad(loss), params, batch, 2))


def test_wrong_shards_are_refused():
    params = _params()
    sync = jd.GradSync(params, data_mesh(8), bucket_size=1200)
    bad = jax.jit(_compat.shard_map(lambda p, b: zero3.value_and_grad(sync, _loss(False))(p, b), mesh=sync.mesh,
                                    in_specs=(P(), sync.batch_spec), out_specs=(P(), sync.shard_specs())))
    with pytest.raises(ValueError, match="zero3.shard_params"):
        bad(sync.flatten(params), _batch())  # whole buckets, not this device's shards


def _most_in_flight(hlo: str, kind: str) -> int:
    """The most ``kind`` collectives started and not yet done at once in the scheduled ENTRY."""
    from jax_drain.planner.schedule import parse_schedule

    sched = parse_schedule(hlo)
    live, most = set(), 0
    for ins in sched.computations[sched.entry]:
        if ins.opcode == f"{kind}-start":
            live.add(ins.name)
        elif ins.opcode == f"{kind}-done":
            live -= set(ins.operands)
        most = max(most, len(live))
    return most


@pytest.mark.gpu_compile
def test_gpu_schedule_gathers_each_bucket_at_its_use_and_keeps_the_chain():
    """Compile-only 8xH100, a remat block stack: resharding, each bucket is gathered once in
    forward and again in backward inside its block; kept, once. Either way every bucket is one
    bf16 all-to-all with one bucket in flight (the drained chain), and the parameters are
    arguments at 1/8 of their size."""
    from jax_drain import plan
    from jax_drain.planner.schedule import parse_schedule

    mesh = plan.gpu_mesh((8,), ("data",))
    n, d = 6, 1024
    params = {f"w{i}": jax.ShapeDtypeStruct((d, d), jnp.bfloat16) for i in range(n)}
    block = jax.checkpoint(lambda w, x: jnp.tanh(x @ w))

    def loss(p, x):
        for i in range(n):
            x = block(p[f"w{i}"], x)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    batch = jax.ShapeDtypeStruct((8 * 256, d), jnp.bfloat16)
    sync = jd.GradSync(params, mesh, bucket_size=d * d,
                       order=jd.grad_ready_order(loss, params, jax.ShapeDtypeStruct((256, d), jnp.bfloat16)))
    shards = sync.pack_shards([jax.ShapeDtypeStruct(c.global_shard_shape(k), c.layout.buckets[k].dtype)
                               for c, k in sync.flat_chains])
    zero1 = jax.jit(_compat.shard_map(sync.value_and_grad(loss), mesh=mesh, in_specs=(P(), P("data")),
                                      out_specs=(P(), sync.shard_specs())))
    zero1_order = [c.op_names[0] for c in parse_schedule(zero1.lower(params, batch).compile().as_text()).collectives
                   if c.kind == "all-to-all" and c.in_scope("jax_drain/bucket")]
    found = {}
    for reshard in (True, False):
        fn = zero3.value_and_grad(sync, loss, reshard_after_forward=reshard)
        step = jax.jit(_compat.shard_map(fn, mesh=mesh, in_specs=(sync.shard_specs(), P("data")),
                                         out_specs=(P(), sync.shard_specs())))
        report = plan.plan(step, shards, batch)
        sched = parse_schedule(step.lower(shards, batch).compile().as_text())
        gathers = [c for c in sched.collectives if c.kind == "all-gather" and c.in_scope("jax_drain/gather/bucket")]
        a2a = [c for c in sched.collectives if c.kind == "all-to-all" and c.in_scope("jax_drain/bucket")]
        assert len(a2a) == n and {c.dtype for c in a2a} == {"bf16"}
        assert [c.op_names[0] for c in a2a] == zero1_order  # the reduce-scatter chain unchanged
        assert report.chains_in_flight == {"dense": 1}
        assert _most_in_flight(step.lower(shards, batch).compile().as_text(), "all-gather") == 1
        assert report.argument_bytes < n * d * d * 2 / 4  # 1/8 of the bf16 params, plus the batch
        found[reshard] = (len(gathers), report.temp_bytes)
    assert found[False][0] == n
    # Backward gathers again inside each block (the last block's may be reused from forward).
    assert found[True][0] >= 2 * n - 1
    assert found[True][1] < found[False][1]


@pytest.mark.parametrize("depth", [1, 2])
def test_gpu_each_forward_gather_waits_for_the_bucket_depth_before(depth):
    """Compile-only 8xH100, XLA's default flags, a small GPT of remat blocks: with
    ``gather_max_in_flight=depth`` no forward all-gather carries more than ``depth`` buckets and
    each starts no earlier than the one before it. A fence XLA dropped (a barrier whose fence
    output nothing reads) lets it combine the gathers of buckets read far apart into one."""
    from jax_drain import models, plan
    from jax_drain.planner.schedule import parse_schedule

    config = models.GPTConfig(num_layers=4, d_model=256, num_heads=4, seq_len=128)
    mesh = plan.gpu_mesh((8,), ("data",))
    params, loss = models.abstract_params(config), models.make_loss(config)
    batch = models.example_batch(config, 8)
    sync = jd.GradSync(params, mesh, bucket_size=40_000, order=jd.grad_ready_order(loss, params, batch))
    shards = sync.pack_shards([jax.ShapeDtypeStruct(c.global_shard_shape(k), c.layout.buckets[k].dtype)
                               for c, k in sync.flat_chains])
    step = jax.jit(_compat.shard_map(zero3.value_and_grad(sync, loss, gather_max_in_flight=depth), mesh=mesh,
                                     in_specs=(sync.shard_specs(), P("data")), out_specs=(P(), sync.shard_specs())))
    sched = parse_schedule(step.lower(shards, batch).compile().as_text())
    forward = sorted((c for c in sched.collectives if c.kind == "all-gather" and c.in_scope("jax_drain/gather")
                      and "transpose(" not in c.op_name), key=lambda c: c.start)
    buckets = [name for c in forward for name in c.op_names]
    assert len(buckets) == len(set(buckets)) == sync.num_buckets  # each bucket gathered once in forward
    assert max(len(c.op_names) for c in forward) <= depth, [c.op_names for c in forward]


# -- the train step ------------------------------------------------------------------------------


def _train(case, shard_params, cpu_devices, batches, **config):
    from test_train_meshes import _step

    case = dataclasses.replace(case, config={**case.config, **config, "shard_params": shard_params})
    params = case.params(np.random.default_rng(0))
    step = _step(case, params, batches[0], cpu_devices)
    state, losses = step.init(params), []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics.loss))
    return step, state, losses


@pytest.mark.parametrize("kind", ["dense", "replica_data", "scanned", "scanned_in_loop"])
def test_train_step_with_shard_params_equals_zero1(kind, cpu_devices):
    """AdamW + clip + decay mask: the losses and master weights of shard_params=True equal
    shard_params=False's bit for bit (dense; replica x data with micro-batches; a scanned stack
    with an outer axis, its stacked leaves in whole-leaf buckets), and the state holds each
    parameter bucket once over the data axes."""
    from test_train_meshes import (
        CASES, STEPS, Case, _batches, _dense_params, _reference, dense_reference_loss, trajectory_bounds,
    )

    cases = {
        "dense": Case(_dense_params, dense_reference_loss, dense_reference_loss, ((8,), ("data",)), {}),
        "replica_data": Case(_dense_params, dense_reference_loss, dense_reference_loss, ((2, 4), ("replica", "data")),
                             dict(outer_axis="replica", microbatches=2)),
        "scanned": dataclasses.replace(CASES["scanned_outer"], config={**CASES["scanned_outer"].config,
                                                                        "scan_layers": False}),
        "scanned_in_loop": CASES["scanned_outer"],  # ScanGradSync: each layer gathered in the body
    }
    batches = _batches(1, STEPS)
    step1, state1, losses1 = _train(cases[kind], False, cpu_devices, batches)
    step3, state3, losses3 = _train(cases[kind], True, cpu_devices, batches)
    assert isinstance(state3.params, zero3.ParamShards)
    if kind == "dense":
        assert losses3 == losses1
        masters = zip(jax.tree.leaves(step3.master_params(state3)), jax.tree.leaves(step1.master_params(state1)))
        for a, b in masters:
            np.testing.assert_array_equal(a, b)
    else:  # micro-batches: ZeRO-3 reduces each one and sums the shards, ZeRO-1 sums first
        params = cases[kind].params(np.random.default_rng(0))
        _, ref_losses, gradients = _reference(cases[kind], params, batches)
        bounds = trajectory_bounds(cases[kind], params, gradients)
        additions = cases[kind].additions
        assert_within(np.asarray(losses3), np.asarray(losses1),
                      loss_rounding_bounds(ref_losses, gradients, bounds, additions=additions), what="losses")
        assert_within(step3.master_params(state3), step1.master_params(state1), bounds[-1], what="master params")
    data = 8 if kind == "dense" else 4  # devices along the axis the shards are split over
    held = sum(x.addressable_shards[0].data.size for x in jax.tree.leaves(state3.params))
    replicated = sum(x.addressable_shards[0].data.size for x in jax.tree.leaves(state1.params))
    buckets = sum(chain.num_buckets * (chain.num_layers or 1) for chain in step3.sync.chains)
    assert held * data <= replicated + 128 * data * buckets  # padding only


@pytest.mark.parametrize("move", ["zero1_to_zero3", "zero3_to_zero1", "zero3_to_4_devices",
                                  "tensor_parallel_zero3_to_zero1", "tensor_parallel_zero1_to_zero3"])
def test_checkpoints_move_between_zero1_and_zero3(move, cpu_devices, tmp_path):
    """Data parallel, and hand-written tensor parallel on (data=4, model=2)."""
    from test_train_meshes import (CASES, Case, _batches, _dense_params, _reference, _step, dense_reference_loss,
                                   trajectory_bounds)

    case = Case(_dense_params, dense_reference_loss, dense_reference_loss, ((8,), ("data",)), {})
    if move.startswith("tensor_parallel"):
        case = CASES["tensor_parallel"]
    params = case.params(np.random.default_rng(0))
    batches = _batches(2, 5)
    src_sharded, dst_sharded, devices = {"zero1_to_zero3": (False, True, 8), "zero3_to_zero1": (True, False, 8),
                                         "zero3_to_4_devices": (True, True, 4)}[move.removeprefix("tensor_parallel_")]
    source = _step(dataclasses.replace(case, config={**case.config, "shard_params": src_sharded}), params, batches[0],
                   cpu_devices)
    state = source.init(params)
    for batch in batches[:3]:
        state, _ = source(state, batch)
    jd.save_checkpoint(tmp_path / "ckpt", state)
    continued = []
    for batch in batches[3:]:
        state, metrics = source(state, batch)
        continued.append(float(metrics.loss))
    target_case = dataclasses.replace(case, config={**case.config, "shard_params": dst_sharded})
    if devices != 8:
        target_case = dataclasses.replace(target_case, mesh=((devices,), ("data",)))
    target = _step(target_case, params, batches[0], cpu_devices[:devices])
    restored, _ = jd.restore_checkpoint(tmp_path / "ckpt", target.abstract_state())
    assert isinstance(restored.params, zero3.ParamShards) == dst_sharded
    resumed = []
    for batch in batches[3:]:
        restored, metrics = target(restored, batch)
        resumed.append(float(metrics.loss))
    if devices == 8:
        assert resumed == continued  # the same layout: bit for bit
    else:  # 4 devices add the gradients in another order from the restored step on
        _, ref_losses, gradients = _reference(case, params, batches)
        bounds = loss_rounding_bounds(ref_losses, gradients, trajectory_bounds(case, params, gradients),
                                      additions=case.additions)
        assert_within(np.asarray(resumed), np.asarray(continued), bounds[3:], what="resumed losses")
    if dst_sharded != src_sharded:  # a state of the other kind is refused, naming the switch
        with pytest.raises(ValueError, match="shard_params"):
            source(restored, batches[0])


def test_train_config_refuses_what_shard_params_does_not_support():
    # Supported: test_train_meshes.py *_zero3.
    jd.TrainConfig(shard_params=True, param_specs={"w": P(None, "model")}, expert=lambda path: False)
    jd.TrainConfig(shard_params=True, reduce="int8_accum", error_feedback=True)  # supported (test_feedback.py)


@pytest.mark.parametrize("mesh_kind", ["data", "replica_data"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_scanned_stack_gathers_each_layer_in_the_body_and_equals_scangradsync(mesh_kind, reshard):
    """nnx.scan over remat'ed blocks (models.GPT): each layer's buckets gathered from their rows
    inside the scan body and reduce-scattered by the layer chain in its backward iteration; the
    shards equal ScanGradSync's bit for bit."""
    from jax_drain import models

    config = models.GPTConfig(num_layers=3, d_model=32, num_heads=2, seq_len=8, vocab_size=50, scan_layers=True)
    params, loss = models.init_params(config, jax.random.key(0)), models.make_loss(config)
    rng = np.random.default_rng(4)
    batch = jax.tree.map(lambda x: jnp.asarray(rng.integers(0, 50, size=x.shape), x.dtype),
                         models.example_batch(config, 16))
    mesh = _mesh(mesh_kind)
    outer = {"outer_axis": "replica"} if mesh_kind == "replica_data" else {}
    sync = jd.ScanGradSync(params, mesh, stacked=jd.stacked_leaves(loss, params, jax.tree.map(lambda x: x[:2], batch)),
                           bucket_size=3000, **outer)
    assert sync.layer_layout.num_buckets >= 2
    reference, sharded = _both(sync, loss, reshard_after_forward=reshard)
    (want_loss, want), (got_loss, got) = reference(params, batch), sharded(params, batch)
    assert float(got_loss) == float(want_loss)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu_compile
def test_gpu_scanned_stack_gathers_one_layer_per_iteration():
    """Compile-only 8xH100, models.GPT under nnx.scan: the layer buckets' all-gathers run inside
    the loop (one layer at a time, forward and again in the remat backward), the parameters are
    arguments at 1/8, and temp stays at the replicated ZeRO-1 step's (no stacked layer kept)."""
    from jax_drain import models, plan

    config = models.GPTConfig(num_layers=4, d_model=256, num_heads=4, seq_len=64, vocab_size=None, scan_layers=True)
    replicated = plan.plan_preset(config, "fp32_accum+drain", num_buckets=8)
    sharded = plan.plan_preset(config, "zero3+drain", num_buckets=8)
    assert sharded.argument_bytes * 6 < replicated.argument_bytes  # 1/8 of the params, plus the batch
    assert sharded.temp_bytes <= 1.05 * replicated.temp_bytes  # one layer gathered at a time
    loops = [c for c in sharded.all_collectives if c.kind == "all-gather" and c.in_scope("jax_drain/gather/layers")]
    assert loops, "no layer gather in the compiled program"


@pytest.mark.gpu_compile
@pytest.mark.parametrize("strategy", ["zero3+drain", "fp32_accum_streamed+drain+zero3"])
def test_gpu_scanned_stack_sends_one_layer_bucket_at_a_time_in_loop_order(strategy):
    """Compile-only 8xH100, models.GPT under nnx.scan: in the backward loop body each layer
    bucket is sent on its own (no collective carries two buckets) in the layer chain's loop order,
    one bucket in flight. Reduced in each gather's own backward rule, unchained, the streamed
    steps of all four buckets were combined into one collective per step."""
    import re

    from jax_drain import models, plan
    from jax_drain.planner.schedule import parse_schedule

    config = models.GPTConfig(num_layers=4, d_model=256, num_heads=4, seq_len=64, vocab_size=None, scan_layers=True)
    step, args, sync = plan.build_step(strategy, config, plan.gpu_mesh((8,), ("data",)), bucket_size=40_000)
    layers = sync.chains[0]
    assert layers.num_layers == 4 and layers.num_buckets >= 3
    compiled = step.lower(*args).compile()
    sched = parse_schedule(compiled.as_text())
    body = sorted((c for c in sched.collectives if c.computation != sched.entry and c.in_scope("jax_drain/layers/bucket")),
                  key=lambda c: (c.computation, c.start))
    buckets = [{int(m.group(1)) for n in c.op_names if (m := re.search(r"jax_drain/layers/bucket(\d+)/", n))}
               for c in body]
    assert all(len(b) == 1 for b in buckets), [c.op_names for c in body]
    sent = [b for (b,) in buckets]
    assert [k for i, k in enumerate(sent) if i == 0 or sent[i - 1] != k] == list(layers.loop_dispatch)
    assert plan.plan(step, *args, scope="jax_drain/").chains_in_flight["layers"] == 1


def test_update_model_writes_the_trained_params_into_an_nnx_model():
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(C, H, rngs=rngs)
            self.b = nnx.Linear(H, C, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.gelu(self.a(x)))

    loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    batches = [jax.tree.map(np.asarray, _batch(seed)) for seed in range(3)]
    models = []
    for shard_params in (False, True):
        model = MLP(nnx.Rngs(0))
        step = jd.make_train_step(model, loss, optax.adam(1e-2), data_mesh(8),
                                  jd.TrainConfig(bucket_size=500, shard_params=shard_params), example_batch=batches[0])
        state = step.init()
        for batch in batches:
            state, _ = step(state, batch)
        step.update_model(model, state)
        models.append(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    for a, b in zip(jax.tree.leaves(models[1]), jax.tree.leaves(models[0])):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(models[1]["a"]["kernel"], nnx.to_pure_dict(nnx.state(MLP(nnx.Rngs(0)), nnx.Param))["a"]["kernel"])


def test_batch_statistics_that_differ_across_devices_are_refused():
    """BatchNorm without axis_name keeps per-device statistics: refused under ZeRO-3 as without it."""
    import optax
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(C, H, rngs=rngs)
            self.norm = nnx.BatchNorm(H, rngs=rngs)
            self.b = nnx.Linear(H, C, rngs=rngs)

        def __call__(self, x):
            return self.b(self.norm(self.a(x)))

    loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    batch = jax.tree.map(np.asarray, _batch())
    step = jd.make_train_step(Net(nnx.Rngs(0)), loss, optax.sgd(0.1), data_mesh(8),
                              jd.TrainConfig(shard_params=True), example_batch=batch)
    with pytest.raises(ValueError, match="axis_name"):
        step(step.init(), batch)


@pytest.mark.parametrize("reduce", ["int8_accum", "fp32_accum_streamed"])
def test_split_leaves_and_other_reduce_modes_equal_gradsync(reduce):
    """Leaves split across buckets (pieces of one leaf gathered from two buckets) and the
    quantized / streamed modes: the same shards as GradSync, bit for bit."""
    params, batch, loss = _params(), _batch(), _loss(True)
    sync = jd.GradSync(params, data_mesh(8), bucket_size=700, split_leaves=True, reduce=reduce)
    assert any(len({p.leaf for p in b.pieces}) < len(b.pieces) or b.pieces[0].start > 0 for b in sync.layout.buckets)
    reference, sharded = _both(sync, loss)
    (want_loss, want), (got_loss, got) = reference(params, batch), sharded(params, batch)
    assert float(got_loss) == float(want_loss)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


def _mlp_step(shard_params, lazy=False, **config):
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(C, H, rngs=rngs)
            self.b = nnx.Linear(H, C, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.gelu(self.a(x)))

    loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    batch = jax.tree.map(np.asarray, _batch())
    return jd.make_train_step(MLP(nnx.Rngs(0)), loss, jd.adamw(1e-2, max_norm=1.0), data_mesh(8),
                              jd.TrainConfig(bucket_size=500, shard_params=shard_params, donate=False, **config),
                              example_batch=None if lazy else batch)


@pytest.mark.parametrize("config", [{"param_dtype": jnp.bfloat16}, {"lazy": True}],
                         ids=["bf16_working_params", "built_from_first_batch"])
def test_train_step_combinations_equal_zero1(config):
    """bf16 working params (the shards are bf16, the masters float32) and a step built from its
    first batch: the same losses and masters as ZeRO-1."""
    batches = [jax.tree.map(np.asarray, _batch(seed)) for seed in range(3)]
    runs = []
    for shard_params in (False, True):
        step = _mlp_step(shard_params, **config)
        state, losses = step.init(), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics.loss))
        runs.append((losses, step.master_params(state), state))
    assert runs[1][0] == runs[0][0]
    for a, b in zip(jax.tree.leaves(runs[1][1]), jax.tree.leaves(runs[0][1])):
        np.testing.assert_array_equal(a, b)
    if "param_dtype" in config:
        assert {x.dtype for x in jax.tree.leaves(runs[1][2].params)} == {jnp.dtype(jnp.bfloat16)}


def test_a_nonfinite_step_is_skipped_bit_for_bit():
    step = _mlp_step(True)
    state, _ = step(step.init(), jax.tree.map(np.asarray, _batch(1)))
    bad = jax.tree.map(np.array, _batch(2))
    bad["x"][5] = np.nan
    after, metrics = step(state, bad)
    assert bool(metrics.skipped)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(state)):  # the step count too
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("depth", [None, 2])
def test_gather_depths_give_the_same_gradients(depth):
    params, batch, loss = _params(), _batch(), _loss(True)
    sync = jd.GradSync(params, data_mesh(8), bucket_size=1200)
    reference, sharded = _both(sync, loss, gather_max_in_flight=depth)
    for a, b in zip(jax.tree.leaves(sharded(params, batch)), jax.tree.leaves(reference(params, batch))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="max_in_flight"):
        zero3.value_and_grad(sync, loss, gather_max_in_flight=0)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_weighted_loss_with_uneven_counts_equals_gradsync(microbatches):
    """Per-token losses (WeightedLoss) with a different count on every device and micro-batch."""
    params, batch = _params(), _batch(n=64)
    batch["mask"] = jnp.asarray(np.random.default_rng(7).random((64,)) < 0.6, jnp.float32)

    forward = _forward(True)

    def loss(p, b):
        per_example = jnp.sum((forward(p, b["x"]) - b["y"]) ** 2, axis=-1)
        return jd.WeightedLoss(jnp.sum(per_example * b["mask"]), jnp.sum(b["mask"]))

    sync = jd.GradSync(params, data_mesh(8), bucket_size=1200)
    reference, sharded = _both(sync, loss, microbatches=microbatches)
    (want_loss, want), (got_loss, got) = reference(params, batch), sharded(params, batch)
    # Each micro-batch reduced on its own, then summed: another order of the same additions.
    total = lambda p, b: loss(p, b).total
    assert_within_rounding(got_loss, want_loss, additions=_additions(total, params, batch, 2), what="loss")
    assert_within_rounding(sync.unflatten(got), sync.unflatten(want), additions=_additions(jax.grad(total), params, batch, 2))
