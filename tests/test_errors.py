"""Misuse found by users gets a clear error, raised early, that says what is wrong and what to do:
a bad ``bucket_size``, a Python number in the params tree, a list of devices for a mesh, a
damaged checkpoint description, a multi-process worker whose peer never comes or dies."""

import json
import re
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jax_drain as jd
from conftest import data_mesh
from jax_drain.checkpoint import FORMAT_VERSION, CheckpointCorruptError
from jax_drain.layout import BucketLayout, check_bucket_size
from jax_drain.mesh import place_leaves
from jax_drain.testing import multiprocess as worker

PARAMS = {"w": jnp.zeros((4, 8)), "b": jnp.zeros((8,))}
SCANNED = {"blocks": {"w": jnp.zeros((2, 4, 4))}, "head": jnp.zeros((4, 3))}
IS_BLOCK = lambda path: path.startswith("blocks/")

SYNCS = {
    "GradSync": lambda params, mesh, **kw: jd.GradSync(params, mesh, **kw),
    "ScanGradSync": lambda params, mesh, **kw: jd.ScanGradSync(
        {"blocks": SCANNED["blocks"], **params}, mesh, stacked=IS_BLOCK, **kw),
    "BucketLayout.build": lambda params, mesh, **kw: BucketLayout.build(params, kw.get("bucket_size", 100)),
}

# -- bucket_size ----------------------------------------------------------------------------------

BAD_BUCKET_SIZES = ["40M", "1000", float("inf"), float("nan"), 1.5, 4e7, 0, -3, True, np.int64(-1)]


def _bucket_size_error(value):
    return rf"bucket_size must be a positive int element count .* or None .*got {re.escape(repr(value))}"


@pytest.mark.parametrize("owner", list(SYNCS))
@pytest.mark.parametrize("value", BAD_BUCKET_SIZES, ids=repr)
def test_bad_bucket_size_is_refused_naming_it(owner, value):
    with pytest.raises((TypeError, ValueError), match=_bucket_size_error(value)):
        SYNCS[owner](PARAMS, data_mesh(8), bucket_size=value)


def test_bucket_size_errors_say_what_to_write():
    with pytest.raises(TypeError, match=r"got '1000' \(str\): write 1000, an int, not a string"):
        check_bucket_size("1000")
    with pytest.raises(TypeError, match=r"got '40M' \(str\): a count of elements as an int"):
        check_bucket_size("40M")
    with pytest.raises(TypeError, match=r"got 40000000.0 \(float\): write 40000000, an int"):
        check_bucket_size(4e7)
    with pytest.raises(ValueError, match=r"got 0$"):
        check_bucket_size(0)


def test_good_bucket_sizes_are_accepted():
    assert check_bucket_size(None) is None
    assert check_bucket_size(512) == 512
    value = check_bucket_size(np.int64(512))
    assert value == 512 and type(value) is int
    as_numpy = jd.GradSync(PARAMS, data_mesh(8), bucket_size=np.int32(8))
    assert as_numpy.bucket_sizes == jd.GradSync(PARAMS, data_mesh(8), bucket_size=8).bucket_sizes


def test_train_step_with_a_bad_bucket_size_names_it():
    loss_fn = lambda p, batch: jnp.mean((batch["x"] @ p["w"] + p["b"]) ** 2)
    batch = {"x": np.ones((16, 4), np.float32)}
    with pytest.raises(TypeError, match=_bucket_size_error(1.5)):
        jd.make_train_step(PARAMS, loss_fn, optax.sgd(0.1), data_mesh(8), jd.TrainConfig(bucket_size=1.5),
                           example_batch=batch)


@pytest.mark.parametrize("value", ["40M", 1.5, 0], ids=repr)
def test_train_config_refuses_a_bad_bucket_size_at_construction(value):
    try:
        jd.TrainConfig(bucket_size=value)
    except (TypeError, ValueError) as e:
        assert re.search(_bucket_size_error(value), str(e)), e
    else:
        raise AssertionError(f"TrainConfig(bucket_size={value!r}) was accepted")


# -- Python numbers in the params tree ------------------------------------------------------------


@pytest.mark.parametrize("owner", ["GradSync", "ScanGradSync"])
@pytest.mark.parametrize("leaf", [1.0, 3], ids=["float", "int"])
def test_a_python_number_leaf_is_refused_naming_its_path(owner, leaf):
    params = {**PARAMS, "norm": {"scale": leaf}}
    kind = type(leaf).__name__
    with pytest.raises(TypeError, match=rf"params leaf 'norm/scale' is a Python {kind} \({leaf!r}\), not an "
                                        rf"array: make it one \(jnp.asarray\({leaf!r}\)\) or take it out of "
                                        "the trained tree"):
        SYNCS[owner](params, data_mesh(8), bucket_size=100)


def test_array_and_abstract_leaves_are_accepted():
    params = {"a": np.zeros(3, np.float32), "b": jax.ShapeDtypeStruct((8,), jnp.float32),
              "c": jnp.asarray(1.0), "d": np.float32(2.0)}
    assert [p.local_shape for p in place_leaves(params, data_mesh(8), ("data",), ())] == [(3,), (8,), (), ()]


# -- a mesh that is not a Mesh ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["list", "tuple", "array", "array2d"])
def test_devices_instead_of_a_mesh_are_refused(kind, cpu_devices):
    mesh = {"list": list(cpu_devices), "tuple": tuple(cpu_devices), "array": np.array(cpu_devices),
            "array2d": np.array(cpu_devices).reshape(2, 4)}[kind]
    shape = "(2, 4)" if kind == "array2d" else "(8,)"
    with pytest.raises(TypeError, match=rf"mesh must be a jax.sharding.Mesh, got .*Build one with "
                                        rf"jax.make_mesh\({re.escape(shape)}, .*\) or jax.sharding.Mesh\("):
        place_leaves(PARAMS, mesh, ("data",), ())
    # A sync over several data axes reaches place_leaves before it reads the mesh itself.
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh"):
        jd.GradSync(PARAMS, mesh, axis=("replica", "data"))


@pytest.mark.parametrize("owner", ["GradSync", "ScanGradSync"])
def test_sync_with_one_data_axis_refuses_a_device_list(owner, cpu_devices):
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh"):
        SYNCS[owner](PARAMS, list(cpu_devices), bucket_size=100)


# -- damaged checkpoint descriptions ----------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 of a small state, saved once; each test damages a copy."""
    directory = tmp_path_factory.mktemp("saved")
    state = {"w": jnp.arange(6.0), "b": jnp.ones(3, jnp.bfloat16)}
    jd.save_checkpoint(directory, state, step=1)
    jd.save_checkpoint(directory, state, step=2)
    return directory, state


DAMAGE = {
    "truncated": lambda f: f.write_text(f.read_text()[: len(f.read_text()) // 2]),
    "empty": lambda f: f.write_text(""),
    "garbage": lambda f: f.write_bytes(b"\x00\xff\xfe not json"),
    "not_a_dict": lambda f: f.write_text("[1, 2]"),
    "fields_missing": lambda f: f.write_text(json.dumps({"format": FORMAT_VERSION, "step": 2})),
    "leaves_mangled": lambda f: f.write_text(json.dumps({**json.loads(f.read_text()), "leaves": [["w"]]})),
    "deleted": lambda f: f.unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_description_names_the_step_and_file(damage, saved, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    metadata = directory / "2" / "jax_drain" / "metadata"
    assert metadata.is_file()
    DAMAGE[damage](metadata)
    expected = (rf"checkpoint step directory {re.escape(str(directory / '2'))} is damaged: its description "
                rf"{re.escape(str(metadata))} is unreadable \(.+\); .*Restore another step \(step=\.\.\., "
                r"saved: \[1\]\)")
    with pytest.raises(jd.CheckpointMismatchError, match=expected) as info:
        jd.restore_checkpoint(directory, saved[1], step=2)
    assert isinstance(info.value, CheckpointCorruptError)
    # Saving next to it is refused the same way, before anything is written.
    before = sorted(p.name for p in directory.iterdir())
    with pytest.raises(CheckpointCorruptError, match=re.escape(str(metadata))):
        jd.save_checkpoint(directory, saved[1], step=3)
    assert sorted(p.name for p in directory.iterdir()) == before
    # The newest intact step is what a restore without step= falls back to, with a warning; the
    # damaged step is moved aside.
    with pytest.warns(UserWarning, match=expected):
        state, _ = jd.restore_checkpoint(directory, saved[1])
    np.testing.assert_array_equal(state["w"], saved[1]["w"])
    assert jd.latest_step(directory) == 1 and (directory / "damaged" / "2" / "state").is_dir()
    # The other step is intact.
    state, _ = jd.restore_checkpoint(directory, saved[1], step=1)
    np.testing.assert_array_equal(state["w"], saved[1]["w"])


def test_damaged_only_step_says_so(saved, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    shutil.rmtree(directory / "1")
    (directory / "2" / "jax_drain" / "metadata").write_text("{")
    with pytest.raises(CheckpointCorruptError, match=r"No other step is saved in .*; remove that step directory"):
        with pytest.warns(UserWarning, match="Trying the previous step"):
            jd.restore_checkpoint(directory, saved[1])


# -- a multi-process worker whose peer never comes or dies -------------------------------------------

PEER_TIMEOUT_S = 5


def _start_worker(process_id, port, out_dir, *extra):
    env, root = worker.worker_env(devices_per_process=4)
    cmd = [sys.executable, "-m", "jax_drain.testing.multiprocess", "--coordinator", f"127.0.0.1:{port}",
           "--num-processes", "2", "--process-id", str(process_id), "--timeout", str(PEER_TIMEOUT_S),
           "--out", str(out_dir), *extra]
    return subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc, limit=60):
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the worker still waited after {limit} s; its stderr ends with:\n{err[-2000:]}")
    return proc.returncode, err


def test_multiprocess_worker_says_which_peer_did_not_join(tmp_path):
    start = time.monotonic()
    port = worker.free_port()
    code, err = _finish(_start_worker(0, port, tmp_path))  # process 1 is never started
    assert code == worker.PEER_FAILURE_EXIT, err[-2000:]
    line = (f"worker 0: process 1 of 2 did not join within {PEER_TIMEOUT_S} s at coordinator 127.0.0.1:{port} "
            "(not started, crashed, or given another --coordinator or --num-processes); check the other hosts' logs")
    assert line in err.splitlines(), err[-2000:]
    assert "Check failure stack trace" not in err  # the line came instead of the runtime's abort
    assert time.monotonic() - start < 30


def test_multiprocess_worker_says_when_its_peer_died(tmp_path):
    start = time.monotonic()
    port = worker.free_port()
    first = _start_worker(0, port, tmp_path)
    second = _start_worker(1, port, tmp_path, "--crash-after-join")
    code1, err1 = _finish(second)
    code0, err0 = _finish(first)
    assert code1 == 3 and "exiting on purpose after joining" in err1, err1[-2000:]
    assert code0 == worker.PEER_FAILURE_EXIT, err0[-2000:]
    assert re.search(r"^worker 0: process 1 of 2 died (or hangs|or stopped answering): .*; check the other "
                     r"hosts' logs$", err0, re.M), err0[-2000:]
    assert time.monotonic() - start < 40


def test_a_refused_build_leaves_no_thread_running():
    """The tx check runs on a thread while the step builds; a build that raises waits for it, so
    the caller's next JAX work never runs beside a check left over."""
    import threading

    params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)}
    batch = {"x": np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32)}

    def loss(p, b):  # a collective over an axis the mesh lacks: refused while the order is traced
        return jax.lax.pmean(jnp.mean((b["x"] @ p["w"]) ** 2), "batch")

    with pytest.raises(ValueError, match="'batch'"):
        jd.make_train_step(params, loss, optax.sgd(0.1), data_mesh(8), jd.TrainConfig(), example_batch=batch)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("jax_drain ")]


# -- train step misuse ------------------------------------------------------------------------------

_RNG = np.random.default_rng(7)
_STEP_PARAMS = {"a": jnp.asarray(_RNG.normal(size=(16, 4)), jnp.float32),
                "b": jnp.asarray(_RNG.normal(size=(16, 4)), jnp.float32)}
_STEP_BATCH = {"x": _RNG.normal(size=(32, 16)).astype(np.float32)}


def _product_loss(p, b):
    return jnp.mean((b["x"] @ p["a"]) * (b["x"] @ p["b"]))


@pytest.mark.parametrize("config, message", [
    ({"bucket_size": 100}, "config must be a jax_drain.TrainConfig, got dict: use jd.TrainConfig\\(\\*\\*config\\)"),
    ("fp32_accum", "config must be a jax_drain.TrainConfig, got str"),
])
def test_a_config_that_is_not_a_train_config_is_refused(config, message):
    with pytest.raises(TypeError, match=message):
        jd.make_train_step(_STEP_PARAMS, _product_loss, optax.sgd(0.1), data_mesh(8), config)


@pytest.mark.parametrize("value", ["1", 0, -1.0, float("nan"), True])
def test_a_bad_skip_threshold_is_refused_at_construction(value):
    with pytest.raises(ValueError, match="skip_grad_norm_above must be a positive number or None"):
        jd.TrainConfig(skip_grad_norm_above=value)


@pytest.mark.parametrize("leaf", [jnp.arange(4), jnp.ones((4,), bool)], ids=["int", "bool"])
def test_integer_and_boolean_params_are_refused_naming_the_leaf(leaf):
    with pytest.raises(ValueError, match=r"(?s)params leaf \['n'\] has dtype (int32|bool).*no gradient"):
        jd.make_train_step({**_STEP_PARAMS, "n": leaf}, _product_loss, optax.sgd(0.1), data_mesh(8))


def test_a_state_made_by_another_optimizer_is_refused():
    """An Adam state given to an SGD step has the same buckets but another tx state: it would be
    read as SGD's (or crash in the runtime); refused before anything runs."""
    adam = jd.make_train_step(_STEP_PARAMS, _product_loss, optax.adam(0.1), data_mesh(8), example_batch=_STEP_BATCH)
    sgd = jd.make_train_step(_STEP_PARAMS, _product_loss, optax.sgd(0.1, momentum=0.9), data_mesh(8),
                             example_batch=_STEP_BATCH)
    state = adam.init()
    with pytest.raises(ValueError, match="(?s)opt_state was made by another optimizer.*same tx"):
        sgd(state, _STEP_BATCH)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # refused before donating
    adam(state, _STEP_BATCH)  # its own step takes it


_STATE_MISUSE = """
import sys, threading
import jax, jax.numpy as jnp, numpy as np, optax
import jax_drain as jd
rng = np.random.default_rng(0)
params = {"a": jnp.asarray(rng.normal(size=(16, 4)), jnp.float32), "b": jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)}
batch = {"x": rng.normal(size=(32, 16)).astype(np.float32)}
loss = lambda p, b: jnp.mean((b["x"] @ p["a"]) * (b["x"] @ p["b"]))
step = jd.make_train_step(params, loss, optax.adam(0.1), jax.make_mesh((8,), ("data",)), example_batch=batch)
state, _ = step(step.init(), batch)
if sys.argv[1] == "threads":
    out = []
    def run():
        try:
            out.append(float(step(state, batch)[1].loss))
        except ValueError as e:
            out.append(str(e))
    threads = [threading.Thread(target=run) for _ in range(4)]
    [t.start() for t in threads]; [t.join() for t in threads]
    ran = [x for x in out if isinstance(x, float)]
    refused = [x for x in out if isinstance(x, str) and "consumed by an earlier step call" in x]
    print("ran", len(ran), "refused", len(refused))
else:
    try:
        step(state._replace(params={"a": state.params["a"], "b": state.params["a"]}), batch)
    except ValueError as e:
        print("refused:", e)
    print("still usable:", np.isfinite(float(step(state, batch)[1].loss)))
"""


def _misuse(tmp_path, mode: str) -> str:
    """Runs ``_STATE_MISUSE`` in a subprocess: a crash must fail the test, not end the suite."""
    script = tmp_path / "state_misuse.py"
    script.write_text(_STATE_MISUSE)
    env = {**__import__("os").environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


def test_concurrent_calls_on_one_state_run_one_and_refuse_the_others(tmp_path):
    """Four threads stepping one donated state: one runs, three are told the state was consumed
    (without the step's lock the runtime is handed donated buffers and crashes)."""
    out = _misuse(tmp_path, "threads")
    assert "ran 1 refused 3" in out, out


def test_a_state_holding_one_array_twice_is_refused_before_donation(tmp_path):
    """One array in two leaves of a donated state would be donated twice (the runtime crashes):
    refused naming both leaves, before anything is donated."""
    out = _misuse(tmp_path, "alias")
    assert re.search(r"refused: the state holds one array twice \(\.params\['a'\] and \.params\['b'\]\).*jnp.copy",
                     out), out
    assert "still usable: True" in out, out
    # Without donation nothing is donated twice: an aliased state runs.
    step = jd.make_train_step(_STEP_PARAMS, _product_loss, optax.sgd(0.1), data_mesh(8),
                              jd.TrainConfig(donate=False), example_batch=_STEP_BATCH)
    state = step.init()
    step(state._replace(params={"a": state.params["a"], "b": state.params["a"]}), _STEP_BATCH)


@pytest.mark.parametrize("tx, leaf", [
    (lambda: optax.chain(optax.zero_nans(), optax.sgd(0.1)), "found_nan"),
    (lambda: optax.apply_if_finite(optax.sgd(0.1), 3), "notfinite_count"),
    (lambda: optax.contrib.prodigy(), "estim_lr"),
], ids=["zero_nans", "apply_if_finite", "prodigy"])
def test_tx_state_computed_from_one_devices_shards_is_refused_naming_it(tx, leaf):
    """Their flags, counts and estimates are one value for all devices, computed here from each
    device's own shards: refused naming the state and what the step does instead (prodigy's
    update also differs on the transform check's shards: whichever refusal comes first)."""
    step = jd.make_train_step(_STEP_PARAMS, _product_loss, tx(), data_mesh(8))
    alternative = "|different result on flat shards" if leaf == "estim_lr" else ""
    with pytest.raises(ValueError, match=f"(?s){leaf}.*one value for all devices.*skip_nonfinite=True{alternative}"):
        step(step.init(), _STEP_BATCH)


def test_reading_a_consumed_state_is_refused_and_the_model_left_as_it_was():
    from flax import nnx

    class Linear(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.asarray(np.random.default_rng(3).normal(size=(16, 4)), jnp.float32))

    model = Linear()
    step = jd.make_train_step(model, lambda m, b: jnp.mean((b["x"] @ m.w[...]) ** 2), optax.sgd(0.1), data_mesh(8),
                              example_batch=_STEP_BATCH)
    consumed = step.init()
    newer, _ = step(consumed, _STEP_BATCH)
    before = np.asarray(model.w[...])
    for read in (lambda: step.update_model(model, consumed), lambda: step.master_params(consumed)):
        with pytest.raises(ValueError, match="consumed by an earlier step call"):
            read()
    np.testing.assert_array_equal(np.asarray(model.w[...]), before)
    step.update_model(model, newer)
    assert not np.array_equal(np.asarray(model.w[...]), before)


def test_unflatten_takes_shards_from_a_mesh_with_explicit_axes():
    """``jax.make_mesh`` gives Explicit axes (this jax's default): the quick start's
    ``sync.unflatten(shards)`` gives the same mean gradient there as on an Auto mesh."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    results = []
    for mesh in (jax.make_mesh((8,), ("data",)), Mesh(np.array(jax.devices()[:8]), ("data",))):
        sync = jd.GradSync(_STEP_PARAMS, mesh, bucket_size=40)
        grad = jax.jit(jax.shard_map(lambda p, b: sync.value_and_grad(_product_loss)(p, b), mesh=mesh,
                                     in_specs=(P(), P("data")), out_specs=(P(), sync.shard_specs())))
        batch = jax.device_put(_STEP_BATCH, NamedSharding(mesh, P("data")))
        params = jax.device_put(_STEP_PARAMS, NamedSharding(mesh, P()))
        results.append(jax.device_get(sync.unflatten(grad(params, batch)[1])))
    explicit, auto = results
    jax.tree.map(np.testing.assert_array_equal, explicit, auto)
    assert all(np.any(x != 0) for x in jax.tree.leaves(explicit))


@pytest.mark.parametrize("field, value, error, message", [
    ("accum_dtype", "bogus", ValueError, "accum_dtype must be a floating dtype"),
    ("accum_dtype", jnp.int32, ValueError, "accum_dtype must be a floating dtype"),
    ("param_dtype", 1.5, ValueError, "param_dtype must be a floating dtype"),
    ("wire_dtype", "int8", ValueError, "wire_dtype must be a floating dtype"),
    ("donate", np.ones(3), TypeError, "donate must be True or False"),
    ("drain", 1, TypeError, "drain must be True or False"),
    ("shard_params", "yes", TypeError, "shard_params must be True or False"),
    ("outer_axis", "data", ValueError, "outer_axis 'data' repeats axis 'data'"),
])
def test_train_config_fields_are_checked_naming_them(field, value, error, message):
    with pytest.raises(error, match=message):
        jd.TrainConfig(**{field: value})


def test_a_sync_accumulating_in_integers_is_refused():
    """An integer accumulator would truncate every micro-batch's gradient."""
    sync = jd.GradSync(_STEP_PARAMS, data_mesh(8), bucket_size=40)
    with pytest.raises(ValueError, match="accum_dtype must be a floating dtype.*int32"):
        sync.value_and_grad(_product_loss, microbatches=2, accum_dtype=jnp.int32)


@pytest.mark.parametrize("params", [
    {"a/b": jnp.ones(3), "a": {"b": jnp.ones(3)}},
    {"x/0": jnp.ones(3), "x": [jnp.ones(3)]},
], ids=["slash_key", "key_and_list_index"])
def test_leaves_whose_paths_collide_are_refused(params):
    """Layouts, checkpoints and master_params name leaves by path: two leaves of one name would
    trade their values."""
    with pytest.raises(ValueError, match="have the same path name"):
        jd.GradSync(params, data_mesh(8))
    with pytest.raises(ValueError, match="have the same path name"):
        BucketLayout.build(params, 100)


@pytest.mark.parametrize("call, error, message", [
    (lambda: jd.GradSync(_STEP_PARAMS, data_mesh(8), wire_dtype="bogus"), ValueError, "wire_dtype must be a floating dtype"),
    (lambda: jd.GradSync(_STEP_PARAMS, data_mesh(8), order=1.5), TypeError, "order must be a sequence of leaf indices"),
    (lambda: jd.GradSync(_STEP_PARAMS, data_mesh(8)).unflatten(None), TypeError, "expected the shards this sync returned"),
    (lambda: jd.masked(-1, lambda p: p), TypeError, "inner must be an optax GradientTransformation"),
    (lambda: jd.save_checkpoint(123, {"a": jnp.ones(2)}, step=1), TypeError, "directory must be a non-empty path"),
    (lambda: jd.restore_checkpoint(None, {}), TypeError, "directory must be a non-empty path"),
    (lambda: jd.latest_step(1.5), TypeError, "directory must be a non-empty path"),
], ids=["wire_dtype", "order", "unflatten", "masked", "save_dir", "restore_dir", "latest_step_dir"])
def test_arguments_of_the_wrong_kind_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_update_model_names_what_it_was_given():
    from flax import nnx

    model = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
    step = jd.make_train_step(model, lambda m, b: jnp.mean(m(b["x"]) ** 2), jd.adamw(0.1), data_mesh(8),
                              example_batch=_STEP_BATCH)
    state = step.init()
    with pytest.raises(TypeError, match="expected a TrainState"):
        step.update_model(model, None)
    with pytest.raises(TypeError, match="update_model writes into the nnx model"):
        step.update_model("bogus", state)


# -- values of the wrong kind where the libraries underneath would fail in their own words -------------


@pytest.mark.parametrize("call, error, message", [
    (lambda: jd.GradSync(_STEP_PARAMS, data_mesh(8), drain=np.ones(3)), TypeError, "drain must be True or False"),
    (lambda: jd.GradSync(_STEP_PARAMS, data_mesh(8), average=np.ones(3)), TypeError, "average must be True or False"),
    (lambda: jd.GradSync(_STEP_PARAMS, data_mesh(8), split_leaves=np.ones(3)), TypeError,
     "split_leaves must be True or False"),
    (lambda: jd.GradSync(_STEP_PARAMS, data_mesh(8), reduce=np.ones(3)), ValueError, "unknown reduce mode"),
    (lambda: jd.GradSync(_STEP_PARAMS, data_mesh(8), tensor_parallel=np.ones(3)), ValueError,
     "tensor_parallel must be 'manual'"),
    (lambda: jd.GradSync({"z": jnp.zeros((0,)), "y": jnp.zeros((3, 0))}, data_mesh(8)), ValueError,
     "every parameter leaf has no elements"),
    (lambda: jd.make_train_step(_STEP_PARAMS, _product_loss, optax.sgd(0.1), data_mesh(8).abstract_mesh),
     TypeError, "mesh must be a jax.sharding.Mesh, got an AbstractMesh"),
    (lambda: jd.save_checkpoint("/tmp/never", {"k": jax.random.key(0)}, step=1), TypeError,
     "'k' is a typed PRNG key array .* jax.random.key_data"),
    (lambda: jd.save_checkpoint("/tmp/never", {"z": jnp.zeros((0,)), "w": jnp.ones(2)}, step=1), ValueError,
     "'z' has no elements"),
    (lambda: jd.save_checkpoint("/tmp/never", {"w": jnp.ones(2)}, step=1, extra={"x": np.float32(1)}), TypeError,
     "extra must hold JSON values .* .item\\(\\)"),
    (lambda: jd.restore_checkpoint("/tmp/never", {"a": 1}), TypeError,
     "target must be a pytree of arrays or jax.ShapeDtypeStructs .* leaf 'a' is a int"),
], ids=["drain", "average", "split_leaves", "reduce", "tensor_parallel", "only_empty_leaves", "abstract_mesh",
        "key_leaf", "empty_leaf", "extra_numpy", "restore_target"])
def test_values_the_libraries_underneath_would_reject_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_step_misuse_of_its_results_is_named(tmp_path):
    """master_params of something that is not a state; a loss declared with aux that returns
    none; saving a state a donating step consumed; a scalar parameter read back."""
    params = {**_STEP_PARAMS, "t": jnp.asarray(0.5, jnp.float32)}  # a scalar parameter too
    loss = lambda p, b: _product_loss(p, b) * p["t"]  # noqa: E731
    step = jd.make_train_step(params, loss, optax.sgd(0.1), data_mesh(8), example_batch=_STEP_BATCH)
    with pytest.raises(TypeError, match="master_params takes the TrainState .* got NoneType"):
        step.master_params(None)
    state = step.init()
    new, _ = step(state, _STEP_BATCH)
    assert step.master_params(new)["t"].shape == () and float(step.master_params(new)["t"]) != 0.5
    with pytest.raises(ValueError, match="'params/a' was deleted: the state was consumed by a train step"):
        jd.save_checkpoint(tmp_path / "ckpt", state, step=1)
    sync = jd.GradSync(_STEP_PARAMS, data_mesh(8))
    fn = jax.shard_map(sync.value_and_grad(_product_loss, has_aux=True), mesh=data_mesh(8),
                       in_specs=(jax.sharding.PartitionSpec(), sync.batch_spec), out_specs=jax.sharding.PartitionSpec())
    with pytest.raises(TypeError, match=r"has_aux=True: loss_fn returns \(loss, aux\), a pair; got"):
        jax.jit(fn)(_STEP_PARAMS, _STEP_BATCH)


@pytest.mark.parametrize("call, error, message", [
    (lambda: jd.make_train_step(_STEP_PARAMS, None, optax.sgd(0.1), data_mesh(8)), TypeError,
     "loss_fn must be a function of"),
    (lambda: jd.TrainConfig(scan_layers=np.ones(3)), ValueError, "scan_layers must be True, False or None"),
    (lambda: jd.DistributedOptimizer(optax.sgd(0.1), jd.GradSync(_STEP_PARAMS, data_mesh(8)),
                                     gather_max_in_flight=np.ones(3)), ValueError, "max_in_flight must be an int"),
    (lambda: jd.DistributedOptimizer(optax.sgd(0.1), jd.GradSync(_STEP_PARAMS, data_mesh(8)), check_tx=np.ones(3)),
     TypeError, "check_tx must be True or False"),
], ids=["loss_fn", "scan_layers", "gather_max_in_flight", "check_tx"])
def test_arguments_that_are_arrays_or_not_callable_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()
    assert jd.TrainConfig(scan_layers=np.True_).scan_layers is True  # numpy booleans are booleans


@pytest.mark.parametrize("specs, message", [
    ({"a": P(None, "model"), "b": None}, r"mesh has no axis 'model' \(in the PartitionSpec of param 'a'\)"),
    ({"a": P("data"), "b": None}, r"param 'a' is sharded along \['data'\]"),
], ids=["missing_axis", "data_axis"])
def test_explicit_param_specs_are_checked_by_parameter_before_placing(specs, message):
    with pytest.raises(ValueError, match=message):
        jd.make_train_step(_STEP_PARAMS, _product_loss, optax.sgd(0.1), data_mesh(8),
                           jd.TrainConfig(param_specs=specs), example_batch=_STEP_BATCH)


# -- inputs whose first error came from the libraries underneath ----------------------------------------

@pytest.mark.parametrize("shard_params", [False, True], ids=["replicated", "zero3"])
def test_partial_param_specs_name_the_parameters_without_an_entry(shard_params):
    with pytest.raises(ValueError, match=r"param_specs must have the params' structure .*no entry for the parameters "
                                         r"'b'; entries 'c' match no parameter\. Give every parameter an entry"):
        jd.make_train_step(_STEP_PARAMS, _product_loss, optax.sgd(0.1), data_mesh(8),
                           jd.TrainConfig(param_specs={"a": P(), "c": P()}, shard_params=shard_params),
                           example_batch=_STEP_BATCH)


def test_a_batch_of_python_lists_is_named_as_such():
    batch = {"x": _STEP_BATCH["x"].tolist()}
    with pytest.raises(ValueError, match=r"batch leaf 'x/0/0' is a Python number: JAX takes a list .* np\.asarray "
                                         r"of 'x' \(a list of rows"):
        jd.make_train_step(_STEP_PARAMS, _product_loss, optax.sgd(0.1), data_mesh(8), example_batch=batch)


def test_a_state_whose_params_have_another_shape_is_refused_naming_the_leaf():
    step = jd.make_train_step(_STEP_PARAMS, _product_loss, optax.sgd(0.1), data_mesh(8), example_batch=_STEP_BATCH)
    state = step.init()
    wrong = state._replace(params={**state.params, "b": jnp.zeros((8, 4), jnp.float32)})
    with pytest.raises(ValueError, match=r"state\.params leaf 'b' has shape \(8, 4\), but this step's model has "
                                         r"\(16, 4\).*step's init\(\)"):
        step(wrong, _STEP_BATCH)
    with pytest.raises(ValueError, match=r"state\.params has 1 leaves in another structure"):
        step(state._replace(params={"a": state.params["a"]}), _STEP_BATCH)
    state, metrics = step(state, _STEP_BATCH)  # the state itself is untouched by the refusals
    assert np.isfinite(float(metrics.loss))


@pytest.mark.parametrize("mask", [jnp.array([True, False]), {"a": True, "b": np.ones(3, bool)}], ids=["array", "entry"])
def test_masked_given_an_array_mask_says_masks_are_per_parameter(mask):
    with pytest.raises(TypeError, match=r"masked\(inner, mask\): (the mask|mask entry \"\['b'\]\") is an array of "
                                        r"shape \((2|3),\), not a Python bool.*selects whole parameters"):
        jd.masked(optax.add_decayed_weights(0.1), mask)
    jd.masked(optax.add_decayed_weights(0.1), {"a": True, "b": np.bool_(False)})  # numpy bools are bools


@pytest.mark.parametrize("removed", ["jax_drain", "_CHECKPOINT_METADATA"])
def test_a_step_directory_missing_its_metadata_is_named(saved, tmp_path, removed):
    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    for step in ("1", "2"):
        target = directory / step / removed
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    expected = r"Step directories 1 \(holds .*\), 2 \(holds .*\) lack the 'jax_drain' description"
    if removed == "jax_drain":
        with pytest.raises(FileNotFoundError, match=r"no checkpoint in .*" + expected):
            jd.restore_checkpoint(directory, saved[1])
    else:  # orbax's own marker: the steps stay readable
        state, _ = jd.restore_checkpoint(directory, saved[1])
        np.testing.assert_array_equal(state["w"], saved[1]["w"])


def test_param_specs_for_a_model_written_for_global_shapes_name_gspmd():
    """A linen model written for pjit (global shapes) given only param_specs: the default
    tensor_parallel='manual' hands its loss local blocks and Flax raises a shape error about a
    kernel; the step says to use tensor_parallel='gspmd', and that builds."""
    from flax import linen

    module = linen.Dense(8)
    params = module.init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    loss = lambda p, b: jnp.mean((module.apply({"params": p}, b["x"]) - b["y"]) ** 2)  # noqa: E731
    batch = {"x": _RNG.normal(size=(8, 16)).astype(np.float32), "y": _RNG.normal(size=(8, 8)).astype(np.float32)}
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    specs = {"kernel": P(None, "model"), "bias": P("model")}
    with pytest.raises(ValueError, match=r"(?s)fails on local blocks but runs on the parameters' global shapes.*"
                                         r"tensor_parallel='gspmd', param_specs=.*ScopeParamShapeError"):
        jd.make_train_step(params, loss, optax.sgd(0.1), mesh, jd.TrainConfig(param_specs=specs), example_batch=batch)
    step = jd.make_train_step(params, loss, optax.sgd(0.1), mesh,
                              jd.TrainConfig(param_specs=specs, tensor_parallel="gspmd"), example_batch=batch)
    assert step.tensor_parallel == "gspmd"


def test_global_batch_shape_is_the_rows_shapes_times_the_processes():
    rows = {"x": np.zeros((4, 3), np.float32), "ids": jnp.zeros((4,), jnp.int32)}
    got = jd.global_batch_shape(rows)
    assert got == {"x": jax.ShapeDtypeStruct((4 * jax.process_count(), 3), np.float32),
                   "ids": jax.ShapeDtypeStruct((4 * jax.process_count(),), jnp.int32)}
    with pytest.raises(ValueError, match="leading \\(example\\) dimension"):
        jd.global_batch_shape({"x": np.float32(1.0)})
