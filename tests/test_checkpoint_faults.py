"""Checkpoint faults a hostile user finds, each refused or reported, none silent, none hanging:
saves out of step order, a branch from an earlier step, concurrent saves from threads and
processes, an edited description, a damaged file reported under its own name, a process that
exits during or after a failed save, a state that is not arrays."""

import hashlib
import json
import os
import pathlib
import re
import select
import shutil
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_drain as jd
from conftest import data_mesh
from jax_drain.checkpoint import CheckpointBusyError, latest_step

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _state(value: float) -> dict:
    return {"a": jnp.arange(6.0) + value, "b": jnp.full(3, value, jnp.bfloat16), "c": jnp.zeros(4) + value}


def _target() -> dict:
    whole = NamedSharding(Mesh(np.array(jax.devices("cpu")[:1]), ("x",)), P())
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=whole) for k, v in _state(0).items()}


def _restored_value(directory, **kwargs) -> float:
    state, _ = jd.restore_checkpoint(directory, _target(), **kwargs)
    return float(state["c"][0])


def _snapshot(directory: pathlib.Path) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _env() -> dict:
    return {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": str(ROOT)}


def _script(tmp_path: pathlib.Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 2 and 4 of the small state (values 2 and 4), saved once; tests work on copies."""
    directory = tmp_path_factory.mktemp("saved")
    for value in (2, 4):
        jd.save_checkpoint(directory, _state(value), step=value, extra={"data_position": value})
    return directory


@pytest.fixture
def copy(saved, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(saved, directory)
    return directory


# -- steps in order: refused before anything is written ---------------------------------------------

# (arguments, error, message, refused in an empty directory too)
OUT_OF_ORDER = {
    "before_the_newest": (dict(step=3), ValueError, r"step=3 is before the newest step 4 in .*nothing was written"
                                                    r".*pass supersede_newer=True: steps \[4\] move to .*superseded", False),
    "the_newest": (dict(step=4), FileExistsError, r"already has step 4; nothing was overwritten.*supersede_newer=True",
                   False),
    "an_older_saved_one": (dict(step=2), ValueError, r"already has step 2; nothing was overwritten", False),
    "negative": (dict(step=-1), ValueError, r"step=-1 is negative", True),
    "not_an_integer": (dict(step=5.5), TypeError, r"step=5.5 is not an integer", True),
    "a_bool": (dict(step=True), TypeError, r"step=True is not an integer", True),
    "max_to_keep_0": (dict(step=5, max_to_keep=0), ValueError, r"max_to_keep=0 would delete every step", True),
    "max_to_keep_negative": (dict(step=5, max_to_keep=-2), ValueError, r"max_to_keep=-2 would delete every step", True),
}


@pytest.mark.parametrize("case", list(OUT_OF_ORDER))
def test_a_save_out_of_order_is_refused_and_nothing_is_written(case, copy, tmp_path):
    kwargs, error, message, anywhere = OUT_OF_ORDER[case]
    before = _snapshot(copy)
    with pytest.raises(error, match=message):
        jd.save_checkpoint(copy, _state(9), **kwargs)
    assert _snapshot(copy) == before
    assert latest_step(copy) == 4 and _restored_value(copy) == 4
    if anywhere:  # orbax would write step -1, or keep no step at all, in an empty directory
        with pytest.raises(error, match=message):
            jd.save_checkpoint(tmp_path / "fresh", _state(9), **kwargs)
        assert not (tmp_path / "fresh").exists()


def test_a_step_saved_already_is_both_file_exists_and_value_error(copy):
    with pytest.raises(jd.CheckpointStepExistsError) as info:
        jd.save_checkpoint(copy, _state(9), step=4)
    assert isinstance(info.value, FileExistsError) and isinstance(info.value, ValueError)


def test_a_save_that_fails_as_it_starts_is_a_checkpoint_save_error(tmp_path, monkeypatch):
    """What orbax (or a collective, when a peer stopped) raises while a save starts surfaces as
    CheckpointSaveError, its cause kept; nothing is written and the earlier steps stay."""
    import orbax.checkpoint as ocp

    jd.save_checkpoint(tmp_path, _state(1), step=1)

    def stopped(*args, **kwargs):
        raise TimeoutError("async_write_complete barrier timed out")

    monkeypatch.setattr(ocp.CheckpointManager, "save", stopped)
    with pytest.raises(jd.CheckpointSaveError, match=r"(?s)saving step 2 into .* failed before it was written: "
                                                     r"TimeoutError: async_write_complete.*restart every process") as info:
        jd.save_checkpoint(tmp_path, _state(2), step=2)
    assert isinstance(info.value.__cause__, TimeoutError)
    monkeypatch.undo()
    assert latest_step(tmp_path) == 1 and _restored_value(tmp_path) == 1


def test_the_resume_loop_goes_on_past_a_damaged_newest_step(copy, caplog):
    """The quick start's loop (restore the newest, train, save every 2 steps) over a byte flipped
    in step 4: the restore falls back to step 2, moves step 4 to damaged/ and says so through a
    warning and a logger record the caller can read; the loop then saves step 4 again, and the
    next restore returns it."""
    array_file = max((p for p in (copy / "4" / "state").rglob("*") if p.is_file() and p.name[0].isdigit()),
                     key=lambda p: p.stat().st_size)
    data = bytearray(array_file.read_bytes())
    data[len(data) // 2] ^= 0x40
    array_file.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="jax_drain.checkpoint"):
        with pytest.warns(UserWarning, match=r"(?s)4: array .* Trying the previous step"):
            state, extra = jd.restore_checkpoint(copy, _target())
    assert extra == {"data_position": 2} and float(state["c"][0]) == 2
    (record,) = [r for r in caplog.records if getattr(r, "damaged_steps", None)]
    assert (record.damaged_steps, record.restored_step, record.moved_to) == ([4], 2, copy / "damaged")
    assert sorted(p.name for p in (copy / "damaged").iterdir()) == ["4"] and latest_step(copy) == 2
    for _ in range(2):  # trained on; the save of step 4 is the loop's next one
        state = jax.tree.map(lambda x: x + 1, state)
    jd.save_checkpoint(copy, state, step=4, extra={"data_position": 4})
    assert _restored_value(copy) == 4 and latest_step(copy) == 4


def test_going_on_from_an_earlier_step_supersedes_the_newer_ones(copy):
    state, extra = jd.restore_checkpoint(copy, _target(), step=2)
    assert extra == {"data_position": 2}
    branched = jax.tree.map(lambda x: x + 1, state)  # trained on from step 2: value 3 at step 3
    with pytest.raises(ValueError, match="step=3 is before the newest step 4"):
        jd.save_checkpoint(copy, branched, step=3, extra={"data_position": 3})
    assert latest_step(copy) == 4
    jd.save_checkpoint(copy, branched, step=3, extra={"data_position": 3}, supersede_newer=True)
    assert latest_step(copy) == 3
    restored, extra = jd.restore_checkpoint(copy, _target())
    assert float(restored["c"][0]) == 3 and extra == {"data_position": 3}
    # Nothing lost: the superseded step is still there, and restorable from its new place.
    assert sorted(p.name for p in (copy / "superseded").iterdir()) == ["4"]
    assert _restored_value(copy / "superseded", step=4) == 4
    # Superseding the same step number again keeps both copies.
    jd.save_checkpoint(copy, _state(7), step=4)
    jd.save_checkpoint(copy, _state(8), step=3, supersede_newer=True)
    assert sorted(p.name for p in (copy / "superseded").iterdir()) == ["3", "4", "4.1"]
    assert [_restored_value(copy), _restored_value(copy, step=2)] == [8, 2]


@pytest.mark.parametrize("name", ["004", "9"])
def test_a_step_directory_renamed_by_hand_is_refused_not_skipped(name, copy):
    """``004`` is step 4's data under a name saves never write; ``9`` claims a step its description
    does not record. Neither is restored as the newest step, nor skipped for an older one."""
    (copy / "4").rename(copy / name)
    if name == "004":
        message = rf"{re.escape(str(copy / name))} is named like a step but not as saves name them \('4'\)"
        for call in (lambda: latest_step(copy), lambda: jd.restore_checkpoint(copy, _target()),
                     lambda: jd.save_checkpoint(copy, _state(5), step=5)):
            with pytest.raises(jd.CheckpointMismatchError, match=message):
                call()
    else:
        message = rf"{re.escape(str(copy / name))} holds step 4 \(its description records it\): it was renamed"
        for kwargs in ({}, {"step": 9}):
            with pytest.raises(jd.CheckpointMismatchError, match=message):
                jd.restore_checkpoint(copy, _target(), **kwargs)
    (copy / name).rename(copy / "4")
    assert _restored_value(copy) == 4


# -- concurrent saves into one directory --------------------------------------------------------------


def test_threads_saving_into_one_directory_take_turns(tmp_path):
    directory, start, outcomes = tmp_path / "ckpt", threading.Barrier(4), {}

    def save(step):
        start.wait()
        try:
            outcomes[step] = jd.save_checkpoint(directory, _state(step), step=step)
        except Exception as e:  # noqa: BLE001 - what each thread got, checked below
            outcomes[step] = e

    threads = [threading.Thread(target=save, args=(step,)) for step in (1, 2, 3, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a save blocked"
    saved = sorted(step for step, outcome in outcomes.items() if isinstance(outcome, pathlib.Path))
    for step, outcome in outcomes.items():  # refused only for coming after a higher step
        assert isinstance(outcome, pathlib.Path) or (
            isinstance(outcome, ValueError) and re.search(rf"step={step} is before the newest step", str(outcome))
        ), repr(outcome)
    assert 4 in saved and [int(p.name) for p in sorted(directory.iterdir()) if p.name.isdigit()] == saved
    assert _restored_value(directory) == 4


def test_an_async_save_waits_for_the_previous_one_into_its_directory(tmp_path):
    first = jd.save_checkpoint_async(tmp_path, _state(1), step=1)
    second = jd.save_checkpoint_async(tmp_path, _state(2), step=2)  # no wait() on the first
    assert first.done() and second.wait() == tmp_path.absolute() / "2"
    assert first.wait() == tmp_path.absolute() / "1"
    assert [_restored_value(tmp_path, step=1), _restored_value(tmp_path)] == [1, 2]


HOLDER = """
import sys
import jax.numpy as jnp, jax_drain as jd
pending = jd.save_checkpoint_async(sys.argv[1], {"a": jnp.arange(6.0) + 1, "b": jnp.ones(3, jnp.bfloat16),
                                                 "c": jnp.ones(4)}, step=1)
print("saving", flush=True)
sys.stdin.readline()  # holds the directory until told (or killed)
pending.wait()
"""


def test_a_second_process_saving_into_the_directory_is_refused_and_a_dead_one_blocks_nobody(tmp_path):
    directory = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, _script(tmp_path, "holder.py", HOLDER), str(directory)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env())
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 120)
        assert ready and holder.stdout.readline().strip() == "saving", holder.stderr.read()[-2000:]
        lock = directory / ".jax_drain-saving"
        held = lock.read_text()
        with pytest.raises(CheckpointBusyError, match=rf"another process \(pid {holder.pid} on .*\) is saving into "
                                                       rf"{re.escape(str(directory))}; nothing was written"):
            jd.save_checkpoint(directory, _state(2), step=2)
        # (the holder's step 1 may be on its way in; nothing of step 2, and the lock is still the holder's)
        assert not [p.name for p in directory.iterdir() if p.name.startswith("2")] and lock.read_text() == held
    finally:
        holder.kill()  # dies holding the lock: the kernel releases it
        holder.communicate(timeout=60)
    jd.save_checkpoint(directory, _state(2), step=2)
    assert latest_step(directory) == 2 and _restored_value(directory) == 2


# -- the description is checksummed -----------------------------------------------------------------

D, H = 8, 16


def _dist_step(bucket_size):
    rng = np.random.default_rng(0)
    params = {"w_in": rng.normal(size=(D, H)).astype(np.float32), "w_out": rng.normal(size=(H, D)).astype(np.float32),
              "norm": np.ones(D, np.float32)}
    loss = lambda p, b: jnp.mean((jnp.tanh((b["x"] * p["norm"]) @ p["w_in"]) @ p["w_out"] - b["y"]) ** 2)
    batch = {"x": np.ones((16, D), np.float32), "y": np.ones((16, D), np.float32)}
    step = jd.make_train_step(params, loss, jd.adamw(1e-2), data_mesh(8), jd.TrainConfig(bucket_size=bucket_size),
                              example_batch=batch)
    return step, params


def _edit_extra(meta):
    meta["extra"]["data_position"] = 99


def _edit_layout(meta):
    # Two buckets of the same size swapped: a re-lay would read one parameter's shard as the other's.
    layout = json.loads(meta["layouts"][0]["description"])
    buckets = layout[0]["buckets"]
    buckets[0], buckets[1] = buckets[1], buckets[0]
    meta["layouts"][0]["description"] = json.dumps(layout)


def _edit_checksum(meta):
    key = next(iter(meta["checksums"]))
    meta["checksums"][key] = "0" * 64


EDITS = {"extra": _edit_extra, "layout": _edit_layout, "array_checksum": _edit_checksum}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_description_is_refused_and_the_previous_step_restored(edit, tmp_path):
    saving, params = _dist_step(60)
    moved, _ = _dist_step(200)  # another layout: the saved layout description says where elements go
    state = saving.init(params)
    directory = tmp_path / "ckpt"
    for step in (1, 2):
        jd.save_checkpoint(directory, state, step=step, extra={"data_position": step})
    metadata = directory / "2" / "jax_drain" / "metadata"
    meta = json.loads(metadata.read_text())
    assert len(json.loads(meta["layouts"][0]["description"])[0]["buckets"]) == 3
    EDITS[edit](meta)
    metadata.write_text(json.dumps(meta))
    message = (rf"{re.escape(str(directory / '2'))} is damaged: its description {re.escape(str(metadata))} "
               r"is unreadable \(it does not match its checksum: it was edited or damaged after saving\)")
    with pytest.raises(jd.CheckpointCorruptError, match=message):
        jd.restore_checkpoint(directory, moved.abstract_state(), step=2)
    with pytest.raises(jd.CheckpointCorruptError, match=re.escape(str(metadata))):  # nor saved next to
        jd.save_checkpoint(directory, state, step=3)
    with pytest.warns(UserWarning, match=message):
        restored, extra = jd.restore_checkpoint(directory, moved.abstract_state())
    assert extra == {"data_position": 1} and (directory / "damaged" / "2").is_dir()
    np.testing.assert_array_equal(jax.device_get(restored.params["w_in"]), params["w_in"])


def test_a_description_written_before_it_was_checksummed_is_read(copy):
    metadata = copy / "4" / "jax_drain" / "metadata"
    meta = json.loads(metadata.read_text())
    del meta["digest"]
    metadata.write_text(json.dumps({**meta, "format": 3}))
    assert _restored_value(copy) == 4
    metadata.write_text(json.dumps(meta))  # the current format without its checksum is damage
    with pytest.warns(UserWarning, match="does not match its checksum"):
        assert _restored_value(copy) == 2


# -- a damaged file named as itself ------------------------------------------------------------------


def _truncate(path):
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


# (file to damage under the step, how, what the error must name): arrays a, b, c; b is damaged, a
# is intact and read first.
DAMAGE = {
    "chunk_truncated": ("state/b/0", _truncate, r"array 'b' \(file {step}/state/b\) is unreadable \(.*state/b/0"),
    "chunk_deleted": ("state/b/0", os.unlink, r"array 'b' \(file {step}/state/b\) is unreadable"),
    "zarray_truncated": ("state/b/.zarray", _truncate,
                         r"array 'b' \(file {step}/state/b/\.zarray\) is unreadable: its metadata is not JSON"),
    "zarray_deleted": ("state/b/.zarray", os.unlink,
                       r"array 'b' \(file {step}/state/b/\.zarray\) is unreadable: its metadata is missing"),
    "tree_metadata_truncated": ("state/_METADATA", _truncate, r"file {step}/state/_METADATA \(.*\) is not JSON"),
    "tree_metadata_deleted": ("state/_METADATA", os.unlink, r"file {step}/state/_METADATA \(.*\) is missing"),
    "array_metadata_truncated": ("state/array_metadatas/process_0", _truncate,
                                 r"file {step}/state/array_metadatas/process_0 \(.*\) is not JSON"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_file_is_reported_under_its_own_name(damage, copy):
    file, spoil, message = DAMAGE[damage]
    spoil(copy / "4" / file)
    message = message.format(step=re.escape(str(copy / "4")))
    with pytest.raises(jd.CheckpointCorruptError, match=message):
        jd.restore_checkpoint(copy, _target(), step=4)
    with pytest.warns(UserWarning, match=message):
        assert _restored_value(copy) == 2


# -- a process that saved in the background, or failed to save, exits promptly -----------------------

EXITS = """
import errno, os, sys
import jax.numpy as jnp, jax_drain as jd

read_only, no_step_dirs, good = sys.argv[1:4]
real_open, real_mkdir = os.open, os.mkdir


def write_open(path, flags, *args, **kwargs):  # a read-only file system, even for root
    if str(path).startswith(read_only + os.sep) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    return real_open(path, flags, *args, **kwargs)


def make_dir(path, *args, **kwargs):  # and a directory where orbax cannot make the step's directory
    path = str(path)
    if path.startswith(read_only + os.sep) or (path.startswith(no_step_dirs + os.sep) and "orbax-checkpoint-tmp" in path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    return real_mkdir(path, *args, **kwargs)


os.open, os.mkdir = write_open, make_dir
state = {"w": jnp.arange(1_000_000, dtype=jnp.float32), "b": jnp.ones(3)}
for directory in (read_only, no_step_dirs):
    try:
        jd.save_checkpoint(directory, state, step=1)
    except OSError as e:
        print("refused:", e, flush=True)
jd.save_checkpoint_async(good, {"w": state["w"] * 2, "b": state["b"]}, step=1)
print("exiting", flush=True)  # without waiting: the save finishes first
"""


def test_a_process_exits_promptly_after_a_failed_or_an_unwaited_save(tmp_path):
    read_only, no_step_dirs, good = tmp_path / "read_only", tmp_path / "no_step_dirs", tmp_path / "good"
    read_only.mkdir()
    read_only.chmod(0o555)
    result = subprocess.run([sys.executable, _script(tmp_path, "exits.py", EXITS), str(read_only), str(no_step_dirs),
                             str(good)], capture_output=True, text=True, timeout=90, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    refusals = [line for line in result.stdout.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 2, result.stdout
    for line, directory in zip(refusals, (read_only, no_step_dirs)):
        assert f"cannot save a checkpoint into {directory}: Read-only file system" in line
        assert "nothing was written" in line
    assert list(read_only.iterdir()) == [] and [p.name for p in no_step_dirs.iterdir()] == []
    whole = NamedSharding(Mesh(np.array(jax.devices("cpu")[:1]), ("x",)), P())
    target = {"w": jax.ShapeDtypeStruct((1_000_000,), jnp.float32, sharding=whole),
              "b": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=whole)}
    state, _ = jd.restore_checkpoint(good, target)
    np.testing.assert_array_equal(np.asarray(state["w"]), 2 * np.arange(1_000_000, dtype=np.float32))


# -- a state that is not arrays --------------------------------------------------------------------


def test_a_state_that_is_not_arrays_is_refused_naming_the_leaf(tmp_path):
    with pytest.raises(TypeError, match=r"state leaf 'a' is a jax.ShapeDtypeStruct: an abstract state has no values"
                                        r".*not step.abstract_state\(\); nothing was written"):
        jd.save_checkpoint(tmp_path / "abstract", _target(), step=1)
    with pytest.raises(TypeError, match=r"state leaf 'lr' is a float \(0.001\), not an array.*jnp.asarray\(x\).*"
                                        r"extra=\{...\}; nothing was written"):
        jd.save_checkpoint(tmp_path / "number", {**_state(1), "lr": 1e-3}, step=1)
    assert not (tmp_path / "abstract").exists() and not (tmp_path / "number").exists()


@pytest.mark.parametrize("extra, error, message", [
    ("", TypeError, "extra must be a dict"),
    (0, TypeError, "extra must be a dict"),
    ({"t": (1, 2)}, ValueError, r"would not read back as given.*\[1, 2\]"),
    ({1: 2}, ValueError, r"would not read back as given.*'1'"),
])
@pytest.mark.parametrize("save", [jd.save_checkpoint, lambda *a, **k: jd.save_checkpoint_async(*a, **k).wait()],
                         ids=["sync", "async"])
def test_extra_that_would_not_read_back_as_given_is_refused(save, extra, error, message, tmp_path):
    with pytest.raises(error, match=message):
        save(tmp_path / "ckpt", _state(1.0), step=1, extra=extra)
    assert latest_step(tmp_path / "ckpt") is None  # nothing was written
    save(tmp_path / "ckpt", _state(1.0), step=1, extra={"t": [1, 2], "1": 2})
    assert jd.restore_checkpoint(tmp_path / "ckpt", _target())[1] == {"t": [1, 2], "1": 2}


@pytest.mark.parametrize("step", [1.5, "1", True])
def test_restoring_a_step_that_is_not_an_int_is_refused(step, tmp_path):
    jd.save_checkpoint(tmp_path / "ckpt", _state(1.0), step=1)
    with pytest.raises(TypeError, match=r"step must be an int \(a saved step: \[1\]\)"):
        jd.restore_checkpoint(tmp_path / "ckpt", _target(), step=step)


def test_a_bare_array_state_and_an_empty_directory_name_are_refused(tmp_path):
    """A bare array has no path to restore it by (it saved, then failed to restore); ``''`` is
    no directory anyone means."""
    with pytest.raises(TypeError, match="state must be a pytree of arrays.*nothing was written"):
        jd.save_checkpoint(tmp_path / "ckpt", jnp.ones(3), step=1)
    assert latest_step(tmp_path / "ckpt") is None
    with pytest.raises(TypeError, match="directory must be a non-empty path"):
        jd.restore_checkpoint("", _target())
