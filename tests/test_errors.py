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
    # The newest intact step is what a restore without step= falls back to, with a warning.
    with pytest.warns(UserWarning, match=expected):
        state, _ = jd.restore_checkpoint(directory, saved[1])
    np.testing.assert_array_equal(state["w"], saved[1]["w"])
    # Saving next to it is refused the same way, before anything is written.
    before = sorted(p.name for p in directory.iterdir())
    with pytest.raises(CheckpointCorruptError, match=re.escape(str(metadata))):
        jd.save_checkpoint(directory, saved[1], step=3)
    assert sorted(p.name for p in directory.iterdir()) == before
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
