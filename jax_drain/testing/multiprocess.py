"""Multi-process check: the same GradSync / DistributedOptimizer steps under ``jax.distributed``.

Each process runs :func:`run` on the *global* device list; the results must equal a single
process's over as many devices (bit for bit on CPU). Two computations, both drained and
fp32-accumulated, on a mesh whose outer ``replica`` axis is the process (host) axis:

* ``sync/*``: tensor parallel + hierarchical ``GradSync.value_and_grad`` on
  ``("replica", "data", "model") = (2, n/4, 2)``: the loss and every gradient shard;
* ``opt/*``: ``steps`` Adam steps of a :class:`~jax_drain.DistributedOptimizer` over a
  hierarchical sync on ``("replica", "data") = (2, n/2)``: losses, parameters, master shards.

Usage (``n`` = global device count, a multiple of 4)::

    # localhost, 2 processes x 4 CPU devices, started, watched and stopped for you:
    python -m jax_drain.testing.multiprocess --launch 2 --devices-per-process 4 --out /tmp/mp
    # the single-process reference over 8 CPU devices:
    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m jax_drain.testing.multiprocess --out /tmp/ref
    python -m jax_drain.testing.multiprocess --compare /tmp/mp/process0.npz /tmp/ref/process0.npz

    # several hosts (one process per host, all GPUs of the host), on every host:
    python -m jax_drain.testing.multiprocess --platform gpu --coordinator HOST0:12345 \\
        --num-processes 2 --process-id $RANK --out /shared/mp

A worker started by hand gives up when its peers do not join within ``--timeout`` seconds
(default 120) or the run does not finish as long after they joined (a peer died or hangs): it
prints one line saying which process did not come and exits with status 4, instead of waiting
for the runtime's own abort.

Programmatic: ``launch_local(2, 4, out_dir, timeout=240)`` (what tests/test_multiprocess.py
does) and ``run(jax.devices())``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jax_drain.peers import PEER_FAILURE_EXIT

D, H, LAYERS = 32, 64, 2

# A worker started with --coordinator waits at most this long (--timeout) for the other processes
# to join, then as long again for the run; it exits with PEER_FAILURE_EXIT when they do not come.
WORKER_TIMEOUT_S, LAUNCH_TIMEOUT_S = 120.0, 240.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sorted_devices(devices: Sequence[Any]) -> list:
    """Process-major device order, so a leading mesh axis of size ``process_count`` is the process."""
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def _global(mesh: Any, spec: Any, value: np.ndarray) -> Any:
    """A global ``jax.Array`` of ``value`` (the same on every process) with ``spec`` on ``mesh``."""
    import jax
    from jax.sharding import NamedSharding

    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda idx: value[idx])


def fetch(x: Any) -> np.ndarray:
    """The whole value of a global array on this process (gathered if it spans processes)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _tp_loss(p: dict, x: Any) -> Any:
    import jax
    import jax.numpy as jnp

    h = x
    for i in range(LAYERS):
        q = p[f"layer{i}"]
        z = jax.nn.gelu((h * q["norm"]).astype(jnp.bfloat16) @ q["w_in"])
        h = h + jax.lax.psum((z @ q["w_out"]).astype(jnp.float32), "model")  # row parallel
    return jnp.mean(h**2)


def _mlp_loss(p: dict, x: Any) -> Any:
    import jax.numpy as jnp

    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - x) ** 2)


def run(devices: Sequence[Any], steps: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    """Both computations on ``devices`` (global, a multiple of 4); returns named numpy results."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_drain as jd
    from jax_drain import _compat

    devices = sorted_devices(devices)
    n = len(devices)
    if n % 4:
        raise ValueError(f"needs a multiple of 4 devices (replica 2 x model 2), got {n}")
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}

    # 1. Tensor parallel + hierarchical gradient sync.
    mesh = Mesh(np.array(devices).reshape(2, n // 4, 2), ("replica", "data", "model"))
    host = {
        f"layer{i}": {
            "w_in": (rng.normal(size=(D, H)) / 4).astype(jnp.bfloat16),
            "w_out": (rng.normal(size=(H, D)) / 4).astype(jnp.bfloat16),
            "norm": rng.uniform(0.5, 2.0, size=(D,)).astype(np.float32),
        }
        for i in range(LAYERS)
    }
    specs = {k: {"w_in": P(None, "model"), "w_out": P("model", None), "norm": P()} for k in host}
    sync = jd.GradSync(host, mesh, bucket_size=1024, reduce="fp32_accum", outer_axis="replica", param_specs=specs)
    params = jax.tree.map(lambda v, s: _global(mesh, s, v), host, specs)
    batch = _global(mesh, sync.batch_spec, rng.normal(size=(2 * (n // 4) * 8, D)).astype(np.float32))
    step = jax.jit(_compat.shard_map(sync.value_and_grad(_tp_loss), mesh=mesh,
                                     in_specs=(sync.param_specs, sync.batch_spec), out_specs=(P(), sync.shard_spec)))
    loss, shards = step(params, batch)
    out["sync/loss"] = fetch(loss)
    for k, s in enumerate(shards):
        out[f"sync/shard{k}"] = fetch(s)

    # 2. DistributedOptimizer (Adam) over a hierarchical sync.
    mesh2 = Mesh(np.array(devices).reshape(2, n // 2), ("replica", "data"))
    host2 = {"w1": rng.normal(size=(D, H)).astype(np.float32) / 4, "b1": rng.normal(size=(H,)).astype(np.float32),
             "w2": rng.normal(size=(H, D)).astype(np.float32) / 4}
    sync2 = jd.GradSync(host2, mesh2, bucket_size=1024, reduce="fp32_accum", outer_axis="replica")
    opt = jd.DistributedOptimizer(optax.adam(1e-2), sync2)
    params2 = jax.tree.map(lambda v: _global(mesh2, P(), v), host2)
    state = opt.init_sharded(params2)

    def train_step(p: Any, s: Any, x: Any) -> Any:
        loss, grads = sync2.value_and_grad(_mlp_loss)(p, x)
        p, s = opt.update(grads, s)
        return p, s, loss

    train = jax.jit(_compat.shard_map(train_step, mesh=mesh2, in_specs=(P(), opt.state_specs(), sync2.batch_spec),
                                      out_specs=(P(), opt.state_specs(), P())))
    for i in range(steps):
        x = _global(mesh2, sync2.batch_spec, rng.normal(size=(n * 4, D)).astype(np.float32))
        params2, state, loss = train(params2, state, x)
        out[f"opt/loss{i}"] = fetch(loss)
    for name, value in params2.items():
        out[f"opt/params/{name}"] = fetch(value)
    for k, m in enumerate(state.master):
        out[f"opt/master{k}"] = fetch(m)
    return out


def run_checkpoint(devices: Sequence[Any], directory: str | os.PathLike, seed: int = 1,
                   die_while_saving: bool = False) -> dict[str, np.ndarray]:
    """Checkpoints of train states whose arrays span processes, on a plain data-parallel mesh
    over ``devices``: ZeRO-1 (parameters replicated, master shards over data) and ZeRO-3
    (parameters sharded too). Each trains 2 steps, saves step 2 (and ZeRO-1 an async step 3),
    restores the newest step into a fresh abstract state and checks every shard this process
    holds against the state it saved. Returns ``ckpt/*`` results: the master weights (whole)
    and ``ckpt/<kind>/restored_equal`` (1 where every held shard came back bit for bit).
    ``die_while_saving``: the last process exits (status 3) as soon as the async save of
    ZeRO-1's step 3 has started, leaving step 2 the newest finished one."""
    import jax
    import optax
    from jax.sharding import Mesh

    import jax_drain as jd

    devices = sorted_devices(devices)
    mesh = Mesh(np.array(devices), ("data",))
    rng = np.random.default_rng(seed)
    host = {"w1": rng.normal(size=(D, H)).astype(np.float32) / 4, "b1": rng.normal(size=(H,)).astype(np.float32),
            "w2": rng.normal(size=(H, D)).astype(np.float32) / 4}
    batches = [rng.normal(size=(len(devices) * 4, D)).astype(np.float32) for _ in range(3)]
    out: dict[str, np.ndarray] = {}
    for kind, shard_params in (("zero1", False), ("zero3", True)):
        where = Path(directory) / kind
        step = jd.make_train_step(host, _mlp_loss, optax.adam(1e-2), mesh,
                                  jd.TrainConfig(bucket_size=1024, shard_params=shard_params, donate=False),
                                  example_batch=batches[0])
        state = step.init()
        for x in batches[:2]:
            state, _ = step(state, x)
        jd.save_checkpoint(where, state, extra={"kind": kind})
        if not shard_params:
            state, _ = step(state, batches[2])
            dying = die_while_saving and jax.process_index() == jax.process_count() - 1
            if dying:
                _exit_in_the_save(where, int(state.step), jax.process_index())
            pending = jd.save_checkpoint_async(where, state, extra={"kind": kind})
            if dying:
                print(f"process {jax.process_index()}: the async save of step {int(state.step)} returned without "
                      "starting a thread once its directory existed; it cannot be interrupted", file=sys.stderr)
                os._exit(5)
            pending.wait()
        restored, extra = jd.restore_checkpoint(where, step.abstract_state())
        same = extra == {"kind": kind} and int(restored.step) == int(state.step)
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
            for sa, sb in zip(a.addressable_shards, b.addressable_shards):
                same = same and sa.index == sb.index and np.array_equal(np.asarray(sa.data), np.asarray(sb.data))
        out[f"ckpt/{kind}/restored_equal"] = np.array(int(same))
        if not shard_params:
            out.update(_input_rules(step, restored, batches[2]))
        for k, m in enumerate(state.opt_state.master):
            out[f"ckpt/{kind}/master{k}"] = fetch(m)
        for name, value in step.master_params(state).items():  # whole on every process
            out[f"ckpt/{kind}/master_params/{name}"] = value
        if shard_params:
            out.update(_moved_and_damaged(directory, host, mesh, batches[0]))
            out.update(_model_written(mesh, batches[0]))
    return out


def _exit_in_the_save(directory: Path, step: int, process: int) -> None:
    """Makes this process exit (status 3) in the first Python thread it starts once the temporary
    directory of ``step`` exists, before that thread runs any code.

    An async save finishes in a thread it starts after the directory exists: the step's files are
    begun, and this process can never reach the barrier before the commit, so the step is never
    finished. Exiting on the main thread after the save returned would race that thread."""

    def on_first_call(frame: Any, event: str, arg: Any) -> None:
        if list(directory.glob(f"{step}.orbax-checkpoint-tmp*")):
            print(f"process {process}: exiting during the save (--die-while-saving)", file=sys.stderr)
            sys.stderr.flush()
            os._exit(3)
        sys.setprofile(None)  # a thread started before the save: left alone

    threading.setprofile(on_first_call)


def run_host_memory(devices: Sequence[Any], directory: str | os.PathLike, d: int = 2048, h: int = 4096) -> dict:
    """This process's peak host memory while it saves and restores a ZeRO-3 train state (an MLP
    of ``2 d h`` float32 parameters, Adam) spanning the processes, beyond what it held before
    (``VmHWM`` after the call less ``VmRSS`` before it, the high-water mark reset with
    ``/proc/self/clear_refs``): a save, a restore onto the same layout, and one onto another
    bucket size (re-laid one parameter at a time). ``mem/*`` results, bytes, with
    ``mem/held``: the bytes of the state's shards this process holds. On CPU devices the
    restored state's own arrays are host memory too, so a restore costs at least ``held``."""
    import jax
    import optax
    from jax.sharding import Mesh

    import jax_drain as jd

    mesh = Mesh(np.array(sorted_devices(devices)), ("data",))
    rng = np.random.default_rng(2)
    host = {"w1": (rng.normal(size=(d, h)) / d**0.5).astype(np.float32), "b1": np.zeros((h,), np.float32),
            "w2": (rng.normal(size=(h, d)) / h**0.5).astype(np.float32)}
    batch = rng.normal(size=(len(devices) * 2, d)).astype(np.float32)

    def step_of(bucket_size: int) -> Any:
        return jd.make_train_step(host, _mlp_loss, optax.adam(1e-3), mesh, jd.TrainConfig(
            bucket_size=bucket_size, shard_params=True, donate=False), example_batch=batch)

    step, moved = step_of(d * h), step_of(3 * d * h)  # w1 | b1, w2 against one bucket
    if moved.optimizer.fingerprint == step.optimizer.fingerprint:
        raise AssertionError("the re-layout's target has the saved state's layout")
    state, _ = step(step.init(), batch)
    out = {"mem/held": np.array(sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards))}
    target, other = step.abstract_state(), moved.abstract_state()
    # The process's first save also starts orbax's and tensorstore's pools, which stay: measured
    # on its own (with what it leaves held), then a warm-up restore before the steady figures.
    out["mem/first_save"], out["mem/first_save_retained"] = map(
        np.array, _extra_peak(lambda: jd.save_checkpoint(Path(directory) / "warm_up", state), retained=True))
    jd.restore_checkpoint(Path(directory) / "warm_up", target)
    where = Path(directory) / "host_memory"
    out["mem/save"] = np.array(_extra_peak(lambda: jd.save_checkpoint(where, state)))
    out["mem/restore"] = np.array(_extra_peak(lambda: jd.restore_checkpoint(where, target)))
    out["mem/relayout"] = np.array(_extra_peak(lambda: jd.restore_checkpoint(where, other)))
    return out


def _extra_peak(call: Any, *, retained: bool = False) -> int | tuple[int, int]:
    """Bytes of host memory ``call()`` used at its peak beyond what the process held before
    (with ``retained``, also the bytes it still holds after, its result dropped)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap memory back to the OS: RSS is what is held
    before = _proc_status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")
    result = call()
    peak = _proc_status("VmHWM")
    del result
    gc.collect()
    if not retained:
        return max(0, peak - before)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return max(0, peak - before), _proc_status("VmRSS") - before


def _proc_status(field: str) -> int:
    """A ``/proc/self/status`` memory field, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _moved_and_damaged(directory: str | os.PathLike, host: dict, mesh: Any, batch: np.ndarray) -> dict[str, np.ndarray]:
    """In the run that saved them: the ZeRO-3 checkpoint restored into a ZeRO-1 step with
    another bucket size (re-laid one parameter at a time), its master weights; then a byte
    of ZeRO-1's newest step flipped by process 0 (in a replicated parameter, which every process
    reads), a restore falling back to the step before on every process, and the next step saved
    under the damaged one's number (moved aside by the restore); and a copy of that
    step with a chunk only the last process reads cut short, refused by every process.
    ``ckpt/moved/*``, ``ckpt/fallback_*``, ``ckpt/resaved_step`` and ``ckpt/one_sided`` results."""
    import warnings

    import jax
    import optax
    from jax.experimental import multihost_utils

    import jax_drain as jd

    step = jd.make_train_step(host, _mlp_loss, optax.adam(1e-2), mesh, jd.TrainConfig(bucket_size=512),
                              example_batch=batch)
    state, _ = jd.restore_checkpoint(Path(directory) / "zero3", step.abstract_state())
    out = {f"ckpt/moved/master_params/{k}": v for k, v in step.master_params(state).items()}
    newest = Path(directory) / "zero1" / "3" / "state"
    if jax.process_index() == 0:
        files = [p for p in newest.glob("params.*/*") if p.is_file() and p.name[0].isdigit()]
        damaged = max(files, key=lambda p: p.stat().st_size)
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0x40
        damaged.write_bytes(bytes(data))
    multihost_utils.sync_global_devices("jax_drain damaged")
    zero1 = jd.make_train_step(host, _mlp_loss, optax.adam(1e-2), mesh, jd.TrainConfig(bucket_size=1024),
                               example_batch=batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored, _ = jd.restore_checkpoint(Path(directory) / "zero1", zero1.abstract_state())
    out["ckpt/fallback_step"] = np.array(int(restored.step))
    out["ckpt/fallback_warning"] = np.array(" ".join(str(w.message) for w in caught))
    # The resume loop goes on: one step trained from the fallback and saved under the damaged
    # step's number, which the restore moved aside.
    trained, _ = zero1(restored, batch)
    jd.save_checkpoint(Path(directory) / "zero1", trained, extra={"kind": "zero1"})
    out["ckpt/resaved_step"] = np.array(jd.latest_step(Path(directory) / "zero1"))
    # A copy of step 2 with a chunk that only the last process reads cut short: that process
    # cannot decode it, the others read theirs; every process must refuse it, none wait.
    one_sided = Path(directory) / "one_sided"
    if jax.process_index() == 0:
        shutil.copytree(Path(directory) / "zero1" / "2", one_sided / "2")
        chunk = one_sided / "2" / "state" / "opt_state.master.0" / str(len(jax.devices()) - 1)
        chunk.write_bytes(chunk.read_bytes()[:chunk.stat().st_size // 2])
    multihost_utils.sync_global_devices("jax_drain damaged one side")
    try:
        jd.restore_checkpoint(one_sided, zero1.abstract_state())
        out["ckpt/one_sided"] = np.array("restored")
    except jd.CheckpointCorruptError as e:
        out["ckpt/one_sided"] = np.array(str(e))
    return out


def _model_written(mesh: Any, batch: np.ndarray) -> dict[str, np.ndarray]:
    """An nnx model trained one step with ZeRO-3 (its parameters sharded over both processes)
    and written back with ``step.update_model``: each of its weights as this process then holds
    it, the step's ``master_params``, and the weights before. ``model/*`` results."""
    import jax
    import optax
    from flax import nnx

    import jax_drain as jd

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.up, self.down = nnx.Linear(D, H, rngs=rngs), nnx.Linear(H, D, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.gelu(self.up(x)))

    model = MLP(nnx.Rngs(0))
    before = {k: fetch(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    step = jd.make_train_step(model, lambda m, x: ((m(x) - x) ** 2).mean(), optax.adam(1e-2), mesh,
                              jd.TrainConfig(bucket_size=1024, shard_params=True), example_batch=batch)
    state, _ = step(step.init(), batch)
    step.update_model(model, state)
    out = {}
    for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = "/".join(map(str, k))
        out[f"model/written/{name}"], out[f"model/before/{name}"] = np.asarray(v[...]), before[k]
    flat = jax.tree_util.tree_flatten_with_path(step.master_params(state))[0]
    out.update({"model/master/" + "/".join(str(getattr(p, "key", p)) for p in path): np.asarray(v) for path, v in flat})
    return out


def _input_rules(step: Any, state: Any, batch: np.ndarray) -> dict[str, np.ndarray]:
    """One step on ``batch`` given as the global numpy batch and as each process's own rows
    (``step.local_batch``): the same loss; and rows of another size on the last process refused
    on every process. ``input/*`` results."""
    import jax

    n, me = jax.process_count(), jax.process_index()
    share = batch.shape[0] // n
    _, whole = step(state, batch)
    _, local = step(state, step.local_batch(batch[me * share:(me + 1) * share]))
    out = {"input/global_loss": fetch(whole.loss), "input/local_loss": fetch(local.loss)}
    wrong = batch[me * share:(me + 1) * share - (1 if me == n - 1 else 0)]
    try:
        step.local_batch(wrong)
        out["input/refused"] = np.array("")
    except ValueError as e:
        out["input/refused"] = np.array(str(e))
    return out


# The reported loss is a pmean over devices: gloo and XLA:CPU's in-process all-reduce may add
# the per-device losses in different orders (one float32 ulp). Gradients never go through such
# a sum: an all-to-all plus a local sum in a fixed order, then a 2-way (exact) outer sum. Two
# orders of a sum of n like-signed terms differ by at most n float32 epsilons of it.
LOSS_RTOL = 8 * float(np.finfo(np.float32).eps)


def compare(a: dict[str, np.ndarray], b: dict[str, np.ndarray], rtol: float = 0.0,
            loss_rtol: float = LOSS_RTOL) -> list[str]:
    """Differences between two result dicts (``[]`` if equal). ``rtol=0``: bit for bit, except
    ``*loss*`` entries, to ``loss_rtol``."""
    problems = []
    if sorted(a) != sorted(b):
        problems.append(f"different keys: {sorted(set(a) ^ set(b))}")
    for key in sorted(set(a) & set(b)):
        x, y = np.asarray(a[key], np.float64), np.asarray(b[key], np.float64)
        if "loss" in key and rtol == 0.0:
            if not np.allclose(x, y, rtol=loss_rtol, atol=0):
                problems.append(f"{key}: {x} vs {y}, beyond rtol {loss_rtol}")
            continue
        if x.shape != y.shape:
            problems.append(f"{key}: shape {x.shape} vs {y.shape}")
        elif rtol == 0.0 and not np.array_equal(x, y):
            problems.append(f"{key}: {int(np.sum(x != y))} of {x.size} elements differ (max |diff| {np.max(np.abs(x - y)):.3g})")
        elif rtol and not np.allclose(x, y, rtol=rtol, atol=rtol * np.max(np.abs(y))):
            problems.append(f"{key}: max |diff| {np.max(np.abs(x - y)):.3g} over rtol {rtol}")
    return problems


def worker_env(devices_per_process: int) -> tuple[dict[str, str], str]:
    """The environment of a local CPU worker process with ``devices_per_process`` devices, and
    the directory to start it in (the one holding the jax_drain package). The caller's other
    XLA flags are kept: a worker compiles what the caller would, with only its device count
    changed."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(
        [*kept, f"--xla_force_host_platform_device_count={devices_per_process}"]))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else root
    return env, root


def launch_local(
    num_processes: int,
    devices_per_process: int,
    out_dir: str | os.PathLike,
    timeout: float = LAUNCH_TIMEOUT_S,
    crash: Sequence[int] = (),
    checkpoint: str | os.PathLike | None = None,
    die_while_saving: bool = False,
    host_memory: str | os.PathLike | None = None,
) -> list[str]:
    """Runs ``num_processes`` CPU workers on localhost (gloo collectives) and waits for them.

    Each writes ``out_dir/process{i}.npz``. Returns their stdouts. Raises ``RuntimeError`` --
    after killing the rest -- as soon as one exits with an error (a surviving process would
    wait for it in a collective forever), or when ``timeout`` seconds pass; the message holds
    the failing process's stderr tail. ``crash``: process ids told to exit at start (to test
    exactly that). ``checkpoint``: a directory for :func:`run_checkpoint` (``--checkpoint``;
    ``die_while_saving``: its last process exits during an async save). ``host_memory``: a
    directory for :func:`run_host_memory` (``--host-memory``), run instead of the others.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env, root = worker_env(devices_per_process)
    procs = []
    logs = []
    for i in range(num_processes):
        log_out, log_err = open(out_dir / f"process{i}.out", "w+"), open(out_dir / f"process{i}.err", "w+")
        logs.append((log_out, log_err))
        cmd = [sys.executable, "-m", "jax_drain.testing.multiprocess", "--coordinator", f"127.0.0.1:{port}",
               "--num-processes", str(num_processes), "--process-id", str(i), "--out", str(out_dir)]
        if i in crash:
            cmd.append("--crash")
        if checkpoint is not None:
            cmd += ["--checkpoint", str(checkpoint)] + (["--die-while-saving"] if die_while_saving else [])
        if host_memory is not None:
            cmd += ["--host-memory", str(host_memory)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log_out, stderr=log_err, cwd=root))

    def tail(i: int) -> str:
        logs[i][1].flush()
        text = (out_dir / f"process{i}.err").read_text(errors="replace")
        return "\n".join(text.strip().splitlines()[-15:])

    def stop_all() -> None:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for o, e in logs:
            o.close()
            e.close()

    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # A process that gave up on a dead peer is not the news; the peer is.
                i = next((i for i in failed if codes[i] != PEER_FAILURE_EXIT), failed[0])
                raise RuntimeError(f"process {i} of {num_processes} exited with status {codes[i]}; stopped the "
                                   f"others. Its stderr ends with:\n{tail(i)}")
            if all(c == 0 for c in codes):
                return [(out_dir / f"process{i}.out").read_text() for i in range(num_processes)]
            if time.monotonic() > deadline:
                running = [i for i, c in enumerate(codes) if c is None]
                raise RuntimeError(f"processes {running} still running after {timeout:.0f} s; killed them. "
                                   f"Process {running[0]}'s stderr ends with:\n{tail(running[0])}")
            time.sleep(0.2)
    finally:
        stop_all()


def _peers(process_id: int, num_processes: int) -> str:
    """The other processes, for messages: ``process 1 of 2``."""
    others = [i for i in range(num_processes) if i != process_id]
    return f"process {others[0]} of {num_processes}" if len(others) == 1 else (
        f"one of processes {others} (of {num_processes})")


def _give_up(line: str, status: int = PEER_FAILURE_EXIT, dump: str = "") -> None:
    """Ends this process now, one line on stderr (then ``dump``): no atexit handler, whose
    ``jax.distributed.shutdown`` would wait for the missing peer again."""
    print(line, file=sys.stderr, flush=True)
    if dump:
        print(dump, file=sys.stderr, end="", flush=True)
    sys.stdout.flush()
    os._exit(status)


class _Watchdog:
    """Bounds a worker's waits for its peers: each phase (:meth:`expect`) must end within
    ``timeout`` s, or the process ends with that phase's one-line message. It runs in a thread:
    ``jax.distributed.initialize`` and collectives wait in C++ (without the GIL) for peers that
    may never come, until the runtime's own, longer, timeouts abort the process."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._lock = threading.Lock()
        self._deadline, self._message = math.inf, ""
        threading.Thread(target=self._watch, name="jax_drain-peer-watchdog", daemon=True).start()

    def expect(self, message: str) -> None:
        """A new phase: it must end within ``timeout`` s, else ``message`` and exit."""
        with self._lock:
            self._deadline, self._message = time.monotonic() + self.timeout, message

    def stop(self) -> None:
        with self._lock:
            self._deadline = math.inf

    def _watch(self) -> None:
        while True:
            time.sleep(0.1)
            with self._lock:
                expired = time.monotonic() > self._deadline
                message = self._message
            if expired:
                _give_up(message)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_drain.testing.multiprocess", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="directory for process{ID}.npz")
    p.add_argument("--coordinator", help="HOST:PORT of process 0 (omit for a single process)")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--platform", default="cpu", help="cpu (gloo collectives across processes) or gpu")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--launch", type=int, metavar="N", help="start N local CPU processes and wait for them")
    p.add_argument("--devices-per-process", type=int, default=4, help="with --launch")
    p.add_argument("--timeout", type=float,
                   help=f"seconds; with --launch: for the whole run (default {LAUNCH_TIMEOUT_S:g}); with "
                        f"--coordinator: for the other processes to join, then for the run (default "
                        f"{WORKER_TIMEOUT_S:g}), else exit with status {PEER_FAILURE_EXIT}")
    p.add_argument("--compare", nargs=2, metavar="NPZ", help="compare two result files and exit")
    p.add_argument("--rtol", type=float, default=0.0,
                   help=f"with --compare: 0 means bit for bit (losses to {LOSS_RTOL}); e.g. 1e-5 for GPU vs CPU")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="also save and restore train states spanning the processes into DIR (run_checkpoint)")
    p.add_argument("--host-memory", metavar="DIR",
                   help="instead: measure this process's peak host memory of a save, a restore and a re-layout "
                        "of a ZeRO-3 state in DIR (run_host_memory)")
    p.add_argument("--crash", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--crash-after-join", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--die-while-saving", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.compare:
        a, b = (dict(np.load(f)) for f in args.compare)
        problems = compare(a, b, args.rtol)
        print("\n".join(problems) if problems else f"identical: {len(a)} arrays")
        return 1 if problems else 0
    if not args.out:
        _parser().error("--out is required")
    if args.timeout is not None and not args.timeout > 0:
        _parser().error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.launch:
        launch_local(args.launch, args.devices_per_process, args.out, args.timeout or LAUNCH_TIMEOUT_S,
                     checkpoint=args.checkpoint, host_memory=args.host_memory)
        print(f"{args.launch} processes finished; results in {args.out}")
        return 0
    if args.crash:
        print(f"process {args.process_id}: exiting on purpose (--crash)", file=sys.stderr)
        return 3

    import jax

    if args.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        if args.num_processes > 1:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if not args.coordinator:
        _run_and_save(args)
        return 0
    timeout = args.timeout or WORKER_TIMEOUT_S
    me, peers = f"worker {args.process_id}", _peers(args.process_id, args.num_processes)
    watchdog = _Watchdog(timeout)
    watchdog.expect(
        f"{me}: {peers} did not join within {timeout:g} s at coordinator {args.coordinator} (not started, "
        "crashed, or given another --coordinator or --num-processes); check the other hosts' logs"
    )
    # The runtime's own timeouts are longer than the watchdog's: its message comes first.
    slack = math.ceil(timeout) + 30
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=slack,
                               heartbeat_timeout_seconds=max(100, slack))
    if args.crash_after_join:
        _give_up(f"{me}: exiting on purpose after joining (--crash-after-join)", 3)
    watchdog.expect(
        f"{me}: {peers} died or hangs: the run did not finish within {timeout:g} s after all "
        f"{args.num_processes} processes joined; check the other hosts' logs"
    )
    try:
        _run_and_save(args)
        jax.distributed.shutdown()
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        if isinstance(e, jax.errors.JaxRuntimeError):  # a collective or the coordination service
            _give_up(f"{me}: {peers} died or stopped answering: a collective failed ({type(e).__name__}: "
                     f"{first}); check the other hosts' logs", PEER_FAILURE_EXIT, traceback.format_exc())
        _give_up(f"{me} failed ({type(e).__name__}: {first}); the other processes give up after their "
                 "--timeout", 1, traceback.format_exc())
    watchdog.stop()
    return 0


def _run_and_save(args: argparse.Namespace) -> None:
    import jax

    start = time.perf_counter()
    if args.host_memory:
        results = run_host_memory(jax.devices(), args.host_memory)
    else:
        results = run(jax.devices(), steps=args.steps)
    if args.checkpoint and not args.host_memory:
        results.update(run_checkpoint(jax.devices(), args.checkpoint, die_while_saving=args.die_while_saving))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    np.savez(Path(args.out) / f"process{jax.process_index()}.npz", **results)
    print(f"process {jax.process_index()}/{jax.process_count()}: {len(jax.devices())} devices, "
          f"{len(results)} arrays in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
