"""Multi-process: 2 processes x 4 CPU devices under jax.distributed (gloo) == 1 process x 8.

The test starts and stops its processes itself (localhost, a free port, a timeout) and fails
with the failing process's stderr instead of hanging. ``pytest -k multiprocess`` selects it.
"""

import re
import time

import jax
import numpy as np
import pytest

import jax_drain as jd
from jax_drain.testing import multiprocess as worker

# Generous for 2 shared cores: the run itself takes ~15 s.
TIMEOUT_S = 240


def test_multiprocess_two_processes_match_one_process(tmp_path, cpu_devices):
    """The syncs and the optimizer bit for bit one process's; and checkpoints of states whose
    arrays span both processes (ZeRO-1 and ZeRO-3 on data=8): saved (sync and async), restored
    there (ZeRO-3 into ZeRO-1 with another bucket size too), a damaged array refused there by
    every process with the fall back to the step before, also one that only one process reads,
    and restored again in this one process."""
    start = time.monotonic()
    checkpoints = tmp_path / "ckpt"
    stdouts = worker.launch_local(2, 4, tmp_path, timeout=TIMEOUT_S, checkpoint=checkpoints)
    assert all("8 devices" in out for out in stdouts), stdouts
    reference = worker.run(cpu_devices)  # this process's 8 devices, the same meshes and data
    assert {k.split("/")[0] for k in reference} == {"sync", "opt"}
    assert sum(k.startswith("sync/shard") for k in reference) >= 2
    for i in range(2):
        got = dict(np.load(tmp_path / f"process{i}.npz"))
        saved = {k: got.pop(k) for k in list(got) if k.startswith(("ckpt/", "model/"))}
        inputs = {k: got.pop(k) for k in list(got) if k.startswith("input/")}
        assert worker.compare(got, reference) == [], f"process {i}"
        assert saved["ckpt/zero1/restored_equal"] == 1 and saved["ckpt/zero3/restored_equal"] == 1, f"process {i}"
        # Moved in the same run: ZeRO-3's checkpoint into a ZeRO-1 step with another bucket size.
        for name in ("w1", "b1", "w2"):
            np.testing.assert_array_equal(saved[f"ckpt/moved/master_params/{name}"],
                                          saved[f"ckpt/zero3/master_params/{name}"])
        # A byte flipped by process 0: every process refused the step, naming the array's file,
        # and fell back to the one before together.
        assert saved["ckpt/fallback_step"] == 2 and saved["ckpt/resaved_step"] == 3, f"process {i}"
        assert re.search(r"zero1/3: array 'params/.*' \(file .*\) .*Trying the previous step",
                         str(saved["ckpt/fallback_warning"])), saved["ckpt/fallback_warning"]
        # An nnx model trained with ZeRO-3 over both processes, written back: every weight whole
        # on each process, the step's master weights bit for bit, not the initial ones.
        written = {k[len("model/written/"):]: v for k, v in saved.items() if k.startswith("model/written/")}
        assert sorted(written) == sorted(k[len("model/master/"):] for k in saved if k.startswith("model/master/"))
        assert len(written) == 4, sorted(written)
        for name, value in written.items():
            np.testing.assert_array_equal(value, saved[f"model/master/{name}"])
            assert value.shape == saved[f"model/before/{name}"].shape
            assert not np.array_equal(value, saved[f"model/before/{name}"]), name
        # A chunk only process 1 reads cut short: refused by both, naming the array; process 1
        # says why (its file), process 0 that another process could not read it.
        one_sided = str(saved["ckpt/one_sided"])
        assert "one_sided/2: array 'opt_state/master/0' (file " in one_sided, one_sided
        assert ("opt_state.master.0/7" if i == 1 else "is unreadable (on another process)") in one_sided, one_sided
        # A global numpy batch and the processes' own rows are one batch: the same step.
        assert inputs["input/global_loss"] == inputs["input/local_loss"], inputs
        assert "process 1 passed [15] rows (per leaf), process 0 [16]" in str(inputs["input/refused"]), inputs
    # Shards, parameters and master weights bit for bit (compare's rule); the optimizer moved them.
    first, last = reference["opt/loss0"], reference["opt/loss2"]
    assert last < first and np.all(np.isfinite(reference["opt/params/w1"]))
    _restore_in_one_process(checkpoints, saved, cpu_devices)
    print(f"multiprocess run + reference: {time.monotonic() - start:.1f} s")


def _restore_in_one_process(checkpoints, saved, cpu_devices):
    """The two processes' checkpoints restored by this one: ZeRO-3's on 8 devices (the master
    weights they held, bit for bit) and into a 4-device ZeRO-1 step; ZeRO-1's step 3, damaged
    in the two-process run and moved to ``damaged/``, refused there naming its file, and the
    step 3 saved again after the fall back restored in its place."""
    import optax
    from jax.sharding import Mesh

    import jax_drain as jd

    host = {"w1": np.zeros((worker.D, worker.H), np.float32), "b1": np.zeros((worker.H,), np.float32),
            "w2": np.zeros((worker.H, worker.D), np.float32)}
    batch = np.zeros((32, worker.D), np.float32)

    def step_on(n, shard_params):
        mesh = Mesh(np.array(cpu_devices[:n]), ("data",))
        return jd.make_train_step(host, worker._mlp_loss, optax.adam(1e-2), mesh,
                                  jd.TrainConfig(bucket_size=1024, shard_params=shard_params), example_batch=batch)

    step = step_on(8, True)
    state, extra = jd.restore_checkpoint(checkpoints / "zero3", step.abstract_state())
    assert extra == {"kind": "zero3"}
    for k, m in enumerate(state.opt_state.master):
        np.testing.assert_array_equal(np.asarray(m), saved[f"ckpt/zero3/master{k}"])
    want = step.master_params(state)
    for name, value in want.items():  # as the two processes read them
        np.testing.assert_array_equal(value, saved[f"ckpt/zero3/master_params/{name}"])
    moved = step_on(4, False)
    state, _ = jd.restore_checkpoint(checkpoints / "zero3", moved.abstract_state())
    for name, value in moved.master_params(state).items():
        np.testing.assert_array_equal(value, want[name])

    step = step_on(8, False)
    with pytest.raises(jd.CheckpointCorruptError, match=r"damaged/3: array 'params/.*' \(file .*\)"):
        jd.restore_checkpoint(checkpoints / "zero1" / "damaged", step.abstract_state(), step=3)
    state, extra = jd.restore_checkpoint(checkpoints / "zero1", step.abstract_state())
    assert int(state.step) == 3 and extra == {"kind": "zero1"}


def test_a_process_dying_during_a_save_leaves_the_previous_step_restorable(tmp_path, cpu_devices):
    """The last of two processes exits while the async save of step 3 is under way: the run
    stops, step 3 is never finished, and step 2 restores (here, in one process). The launcher
    reports whichever process ends first: the one that exited, or the survivor, whose save ends
    in a CheckpointSaveError that says a peer stopped and what to do."""
    import optax
    from jax.sharding import Mesh

    import jax_drain as jd

    checkpoints = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match=r"(?s)process 1 of 2 exited with status 3.*exiting during the save|"
                                           r"process 0 of 2 exited with status 1.*CheckpointSaveError: saving step 3 "
                                           r"into .* a peer that stopped .* restart every process"):
        worker.launch_local(2, 4, tmp_path, timeout=TIMEOUT_S, checkpoint=checkpoints, die_while_saving=True)
    assert jd.latest_step(checkpoints / "zero1") == 2
    assert [p.name for p in (checkpoints / "zero1").glob("3.orbax-checkpoint-tmp*")]  # begun, never finished
    host = {"w1": np.zeros((worker.D, worker.H), np.float32), "b1": np.zeros((worker.H,), np.float32),
            "w2": np.zeros((worker.H, worker.D), np.float32)}
    step = jd.make_train_step(host, worker._mlp_loss, optax.adam(1e-2), Mesh(np.array(cpu_devices), ("data",)),
                              jd.TrainConfig(bucket_size=1024), example_batch=np.zeros((32, worker.D), np.float32))
    state, extra = jd.restore_checkpoint(checkpoints / "zero1", step.abstract_state())
    assert int(state.step) == 2 and extra == {"kind": "zero1"}
    state, _ = step(state, np.ones((32, worker.D), np.float32))  # and the run goes on, saving step 3 again
    jd.save_checkpoint(checkpoints / "zero1", state)
    assert jd.latest_step(checkpoints / "zero1") == 3


def test_multiprocess_launcher_fails_fast_when_a_process_dies_or_hangs(tmp_path):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)process 1 of 2 exited with status 3.*exiting on purpose \(--crash\)"):
        worker.launch_local(2, 4, tmp_path, timeout=TIMEOUT_S, crash=(1,))
    # Process 0 was waiting for process 1 at jax.distributed.initialize; it was killed, not awaited.
    assert time.monotonic() - start < 60

    # A process that never finishes (here: too short a timeout) is killed, with its stderr shown.
    with pytest.raises(RuntimeError, match=r"processes \[0, 1\] still running after 1 s; killed them"):
        worker.launch_local(2, 4, tmp_path / "slow", timeout=1)


def test_multiprocess_compare_reports_differences():
    a = {"sync/shard0": np.arange(4, dtype=np.float32), "sync/loss": np.float32(2.0)}
    b = {"sync/shard0": np.nextafter(a["sync/shard0"], 9), "sync/loss": np.float32(2.0) * (1 + 5e-7)}
    assert worker.compare(a, a) == []
    assert worker.compare(a, b) == ["sync/shard0: 4 of 4 elements differ (max |diff| 2.38e-07)"]
    assert worker.compare(a, b, rtol=1e-6) == []
    assert worker.compare(a, {"x": a["sync/loss"]})[0].startswith("different keys")


DYING_TRAINER = """
import contextlib, os, signal, sys, time
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_cpu_collectives_implementation", "gloo")
process, port, dying, how, heartbeat, watch = (int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4],
                                              int(sys.argv[5]), float(sys.argv[6]))
jax.distributed.initialize(f"localhost:{port}", 2, process, heartbeat_timeout_seconds=heartbeat)
import numpy as np, optax
import jax.numpy as jnp
from jax.sharding import Mesh
import jax_drain as jd

rng = np.random.default_rng(0)
params = {"w": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32)}
step = jd.make_train_step(params, lambda p, b: jnp.mean(jnp.tanh(b @ p["w"]) ** 2), optax.adam(1e-3),
                          Mesh(np.array(jax.devices()), ("data",)), jd.TrainConfig(),
                          example_batch=np.zeros((16, 16), np.float32))
state = step.init(params)
with jd.watch_peers(timeout_seconds=watch) if watch else contextlib.nullcontext():
    if how == "kill_in_save":  # dies right after its async save began, while the save is being written
        state, _ = step(state, step.local_batch(rng.normal(size=(8, 16)).astype(np.float32)))
        pending = jd.save_checkpoint_async(sys.argv[7], state)
        if process == dying:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            pending.wait()
        except jd.CheckpointSaveError as e:
            print(f"CheckpointSaveError: {e}", flush=True)
            sys.exit(7)
    for i in range(5 if how == "finish" else 10_000):
        if process == dying and i == 3 and how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9, between two steps
        if process == dying and i == 3 and how == "raise":
            raise ValueError("a bad batch 3")
        state, metrics = step(state, step.local_batch(rng.normal(size=(8, 16)).astype(np.float32)))
        float(metrics.loss)
    if how == "finish" and process != dying:
        time.sleep(2 * watch)  # in Python, after the loop: the peer has finished, not died
print("never reached: the peer died" if how != "finish" else f"process {process} finished", flush=True)
"""


def _run_dying_pair(dying: int, how: str, *, heartbeat: int, watch: float, tmp_path) -> tuple[list, float, str, str]:
    """Runs DYING_TRAINER on two processes; returns both processes (ended), the time the dying one
    ended, and the survivor's stdout and stderr."""
    import subprocess
    import sys

    port = str(worker.free_port())
    extra = [str(tmp_path / "ckpt")] if how == "kill_in_save" else []
    procs = [subprocess.Popen([sys.executable, "-c", DYING_TRAINER, str(i), port, str(dying), how, str(heartbeat),
                               str(watch), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        procs[dying].communicate(timeout=TIMEOUT_S)
        ended = time.monotonic()
        out, err = procs[1 - dying].communicate(timeout=heartbeat + 60)
    finally:
        for p in procs:
            p.kill()
    return procs, ended, out, err


def test_a_peer_killed_in_a_step_without_watch_peers_ends_the_survivor_by_jax_s_heartbeat(tmp_path):
    """Without :func:`jd.watch_peers`, a survivor waits in a collective of the loop (the step's
    or ``local_batch``'s; Gloo does not fail them all) until JAX's coordination service misses
    the dead process's heartbeats (``heartbeat_timeout_seconds``), then JAX aborts it, naming the
    process but not what to do: the behaviour ``watch_peers`` improves on, as documented."""
    import signal

    heartbeat = 10
    procs, died, out, err = _run_dying_pair(1, "kill", heartbeat=heartbeat, watch=0, tmp_path=tmp_path)
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode == -signal.SIGABRT, err[-3000:]
    assert re.search(r"The following tasks are unhealthy \(stopped sending heartbeats\):\s*1\b", err), err[-3000:]
    assert time.monotonic() - died < heartbeat + 20, "the survivor outlived the heartbeat timeout"


@pytest.mark.parametrize("dying, how", [(1, "kill"), (0, "kill"), (1, "kill_in_save"), (1, "raise")],
                         ids=["a_peer_killed_in_a_step", "the_coordinator_killed_in_a_step",
                              "a_peer_killed_in_an_async_save", "a_peer_raising_in_a_step"])
def test_watch_peers_ends_the_survivor_naming_the_dead_peer_and_what_to_do(dying, how, tmp_path):
    """With ``jd.watch_peers(timeout_seconds=3)`` and JAX's heartbeat at 100 s: a peer killed with
    ``kill -9`` ends the survivor within the watch's bound (timeout + 2 polls), well before the
    heartbeat, with jax_drain's line naming the process and saying to restart every process, and
    exit status ``jd.PEER_FAILURE_EXIT``. A peer that raises inside the ``with`` block ends it at
    once, naming the error, and itself exits 1 instead of waiting at JAX's shutdown for peers it
    ended. The coordinator's death ends the survivor at once (JAX's runtime may be first). A death
    while a save's own collectives run may end the survivor's save first: ``CheckpointSaveError``."""
    import signal

    watch, heartbeat = 3.0, 100
    procs, died, out, err = _run_dying_pair(dying, how, heartbeat=heartbeat, watch=watch, tmp_path=tmp_path)
    took = time.monotonic() - died
    survivor = procs[1 - dying]
    if how == "raise":
        assert procs[dying].returncode == 1, "the failed process waited at JAX's shutdown for the peers it ended"
        assert survivor.returncode == jd.PEER_FAILURE_EXIT, err[-3000:]
        assert "jax_drain.watch_peers: process 1 of 2 failed with ValueError: a bad batch 3" in err, err[-3000:]
        assert took < watch, f"the survivor took {took:.1f} s to end for a published failure"
        return
    assert procs[dying].returncode == -signal.SIGKILL
    if survivor.returncode == 7:
        assert how == "kill_in_save" and re.search(r"CheckpointSaveError: .*a peer that stopped", out), out + err[-3000:]
    elif dying == 0 and survivor.returncode == -signal.SIGABRT:  # JAX's runtime saw the service go first
        assert "Terminating process because the JAX distributed service detected fatal errors" in err, err[-3000:]
    else:
        assert survivor.returncode == jd.PEER_FAILURE_EXIT, err[-3000:]
        named = "the coordination service (process 0) stopped answering" if dying == 0 else \
            "process 1 of 2 stopped answering: no sign of life"
        assert f"jax_drain.watch_peers: {named}" in err, err[-3000:]
        assert "Restart every process; jax_drain.restore_checkpoint restores the newest complete step" in err
    # the bound: timeout + 2 polls, and a margin for a loaded machine; JAX's heartbeat is 100 s
    assert took < watch + 2 * watch / 10 + 10, f"the survivor took {took:.1f} s to end"


def test_watch_peers_does_not_report_a_peer_that_finished(tmp_path):
    """A peer that leaves the ``with`` block normally publishes ``finished``: a survivor still
    working (here twice the timeout, after its loop) is not ended, and both exit 0."""
    procs, _, out, err = _run_dying_pair(1, "finish", heartbeat=100, watch=2.0, tmp_path=tmp_path)
    assert [p.returncode for p in procs] == [0, 0], err[-3000:]
    assert "process 0 finished" in out and "watch_peers" not in err
