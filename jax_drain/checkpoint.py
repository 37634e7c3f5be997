"""Orbax checkpoints of a train state you can trust and move.

A checkpoint directory holds one orbax step directory per saved step. Each stores the state's
arrays, one directory per array (``<step>/state/<key>/``; optimizer shards written and read
shard by shard), and a JSON description: every leaf's path, shape and dtype, a checksum of
every array that any process layout can compute from the shards it holds, and the bucket layout
of each :class:`~jax_drain.optimizer.DistState` in it.

* **Integrity**: restoring verifies every array's checksum; a corrupted array file is refused
  with an error naming the array and its directory, by every process alike. Without ``step=``
  the newest *intact* step is restored; the damaged newer steps are moved to
  ``<directory>/damaged/`` (so the resumed run can save those step numbers again) and reported
  by a warning and a WARNING record of the ``jax_drain.checkpoint`` logger.
* **The memory of one process's shards**: each process writes the shards it holds and reads
  back, straight from the files, only the blocks its devices hold.
* **Moving**: a checkpoint restores into a step built for another data-axis size, bucket size,
  mesh or process count: the optimizer shards are re-laid on the host one parameter at a time
  (the layouts in both descriptions say where every element is), each process reading only the
  parameters its target blocks need. Parameters and other state restore into any sharding.
* **ZeRO-3**: a state whose parameters are :class:`~jax_drain.zero3.ParamShards` restores into
  a step with replicated parameters and back (and onto another layout), through
  per-parameter arrays like the optimizer state.
* **Error feedback**: the residuals of an :class:`~jax_drain.feedback.ErrorFeedback` are saved
  and restored with the state when the bucket layout is the same; restored into another layout
  (or into a step that has them from a checkpoint that has not) they start from zero, with a
  warning: a device's rounding residual means nothing on another device or layout.
* **Atomic and asynchronous**: orbax writes a step into a temporary directory and renames it
  when complete, so a kill at any moment leaves the previous steps restorable;
  :func:`save_checkpoint_async` returns at once (after copying the arrays to the host, so the
  next step may donate them) and writes in the background. A save still running when the
  process exits is finished first.
* **One writer, steps in order**: saves into one directory are serialised within a process
  (each waits for the previous one) and refused from a second process while one is saving
  (``CheckpointBusyError``). A step must come after the newest saved one, so the newest step is
  always the latest save; to go on from an earlier step you restored, pass
  ``supersede_newer=True``, which moves the newer steps to ``<directory>/superseded/``.
* **The description is checksummed too**: ``extra`` and the layout descriptions are covered by
  a checksum of the description; an edited description is refused as damage, like an array.

A checkpoint of another model (other parameter paths or shapes) is refused before any array is
read, saying what differs; saving into a directory that holds another model's checkpoints, over
an existing step, before the newest step, or a state that is not arrays, is refused before
anything is written.

Example::

    step = jd.make_train_step(model, loss_fn, tx, mesh, config, example_batch=batch)
    state = step.init()
    ...
    jd.save_checkpoint("/ckpt/run1", state, extra={"data_position": 1234})

    # later, in a fresh process, maybe on another mesh or bucket size:
    step = jd.make_train_step(model, loss_fn, tx, other_mesh, other_config, example_batch=batch)
    state, extra = jd.restore_checkpoint("/ckpt/run1", step.abstract_state())
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import operator
import os
import pathlib
import re
import socket
import threading
import time
import warnings
from typing import Any, Iterator, Sequence

try:
    import fcntl
except ImportError:  # not on Windows: saves there are serialised within a process only
    fcntl = None

import jax
import numpy as np

from jax_drain._blocks import BlockPaths
from jax_drain._host_layout import param_placements, read_param, write_param
from jax_drain._relayout import LocalBlocks, SavedArrays, UnreadableArray, verify_parts
from jax_drain.feedback import ErrorFeedback
from jax_drain.zero3 import ParamShards
from jax_drain.layout import leaf_paths, path_str
from jax_drain.optimizer import DistState
from jax_drain.ownership import owned_leaves, pack_owner_on_host, packing_mismatch, row_span, unpack_owner_on_host

PyTree = Any

FORMAT_VERSION = 5
# Format 3 descriptions carry no checksum of their own; they are read without that check.
_READABLE_FORMATS = (3, 4, FORMAT_VERSION)
_STATE, _META = "state", "jax_drain"
_SUPERSEDED = "superseded"  # where supersede_newer=True moves the steps it replaces
_DAMAGED = "damaged"  # where a restore moves the damaged steps newer than the one it restored
_LOCK_FILE = ".jax_drain-saving"  # held (flock) by the process saving into the directory
_META_FILE = "metadata"  # the file orbax's JsonSave writes the description to, in the _META item
# One shard set of a DistState: its master shards, or one FlatShards node of the tx state.
_SHARD = re.compile(r"^((?:.*/)?(?:master|shards))/(\d+)$")


class CheckpointMismatchError(ValueError):
    """A checkpoint (or checkpoint directory) belongs to a different model or bucket layout."""


class CheckpointCorruptError(CheckpointMismatchError):
    """A checkpoint step is damaged: its description or an array file is unreadable or does
    not match its checksum."""


class CheckpointBusyError(RuntimeError):
    """Another process is saving into the checkpoint directory."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed while it was being started or written in the background (the
    step was not saved; the earlier steps are intact). Its cause is the error that stopped it:
    orbax's, or a collective's when a peer process stopped."""


class CheckpointStepExistsError(FileExistsError, ValueError):
    """The step is saved already (nothing was overwritten): a ``FileExistsError`` and, like
    every step out of order, a ``ValueError``. Save under a later step, or pass
    ``supersede_newer=True`` to go on from an earlier step you restored."""


def state_description(state: PyTree) -> dict[str, Any]:
    """What a checkpoint records about ``state`` besides the arrays (JSON-serialisable).

    ``leaves``: ``[key, path, shape, dtype]`` per leaf (``jax.tree.leaves`` order); ``layouts``:
    per ``DistState``, its path in the state, layout fingerprint and description (and with
    whole-parameter ownership the packing of its ``tx`` state); ``feedback``:
    per ``ErrorFeedback``, its path and layout fingerprint; ``params``: per ZeRO-3
    ``ParamShards``, its path, layout fingerprint and description; ``fingerprint``: a hash of
    the leaves and the layouts.
    """
    paths = leaf_paths(state)
    leaves = jax.tree.leaves(state)
    keys = _array_keys(paths)
    described = [
        [key, path, list(np.shape(x)), str(np.dtype(x.dtype))] for key, path, x in zip(keys, paths, leaves)
    ]
    layouts = [
        {"path": path, "fingerprint": s.layout.fingerprint, "description": s.layout.description,
         **({"packing": s.layout.packing} if s.layout.packing else {})}
        for path, s in _dist_states(state)
    ]
    feedback = [{"path": path, "fingerprint": node.fingerprint} for path, node in _nodes(state, ErrorFeedback)]
    params = [
        {"path": path, "fingerprint": node.layout.fingerprint, "description": node.layout.description}
        for path, node in _nodes(state, ParamShards)
    ]
    hashed = [described, [x["fingerprint"] for x in layouts]] + ([feedback] if feedback else [])
    hashed += [[x["fingerprint"] for x in params]] if params else []
    digest = hashlib.sha256(json.dumps(hashed).encode()).hexdigest()[:16]
    return {"format": FORMAT_VERSION, "fingerprint": digest, "layouts": layouts, "leaves": described,
            "feedback": feedback, "params": params}


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest saved step in ``directory``, or ``None`` if it holds no checkpoint."""
    steps = _steps(_directory(directory))
    return steps[-1] if steps else None


def save_checkpoint(
    directory: str | os.PathLike,
    state: PyTree,
    *,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
    max_to_keep: int | None = None,
    supersede_newer: bool = False,
) -> pathlib.Path:
    """Saves ``state`` as step ``step`` of ``directory``; returns the step's directory.

    Steps are saved in increasing order, so the newest step is the latest save and what
    :func:`restore_checkpoint` restores. Going on from an earlier step (restored with
    ``step=``) is a branch: pass ``supersede_newer=True`` and the steps at or after ``step``
    move to ``<directory>/superseded/<step>`` (no longer restored; delete them when you no
    longer need them).

    Example::

        state, extra = jd.restore_checkpoint("/ckpt/run1", step.abstract_state(), step=100)
        ...  # train on from step 100: steps 200, 300 of the old run are now superseded
        jd.save_checkpoint("/ckpt/run1", state, step=150, supersede_newer=True)

    Args:
        directory: the run's checkpoint directory (created if missing).
        state: any pytree of ``jax.Array``s (or numpy arrays), typically a
            :class:`~jax_drain.TrainState`; not an abstract state.
        step: the step number, 0 or more, after the newest saved step; defaults to ``state.step``.
        extra: JSON-serialisable data stored alongside (e.g. the data loader's position).
        max_to_keep: keep only this many newest steps, 1 or more (older ones are deleted after
            saving); ``None`` keeps every step.
        supersede_newer: move the saved steps at or after ``step`` aside (to
            ``<directory>/superseded/``) instead of refusing the save.

    Raises:
        CheckpointMismatchError: ``directory`` holds checkpoints of a different state layout.
        ValueError: ``step`` is negative, or not after the newest saved step (without
            ``supersede_newer``), or ``max_to_keep`` is below 1. A step saved already raises a
            ``FileExistsError`` that is also a ``ValueError``.
        TypeError: a leaf of ``state`` is not an array (a ``jax.ShapeDtypeStruct``, a Python
            number), or ``extra`` is not JSON-serialisable.
        CheckpointBusyError: another process is saving into ``directory``.
        OSError: ``directory`` cannot be written. Nothing is written in any of these cases.
        CheckpointSaveError: writing the files failed (the step is not saved; earlier steps are
            intact).
    """
    pending = save_checkpoint_async(directory, state, step=step, extra=extra, max_to_keep=max_to_keep,
                                    supersede_newer=supersede_newer)
    return pending.wait()


class PendingSave:
    """A checkpoint being written in the background by :func:`save_checkpoint_async`.

    ``wait()`` (from any thread, any number of times) blocks until the step is on disk and
    raises the save's error if it failed. A save nobody waited for is finished when the
    process exits; an error there is logged on the ``jax_drain.checkpoint`` logger.
    """

    def __init__(self, manager: Any, path: pathlib.Path, lock: "_DirectoryLock | None" = None):
        self._manager, self.path, self._lock = manager, path, lock
        self._error: Exception | None = None
        self._finishing = threading.Lock()

    def wait(self) -> pathlib.Path:
        """Blocks until the step is on disk (renamed into place); returns its directory."""
        with self._finishing:
            if self._manager is not None:
                manager, self._manager = self._manager, None
                try:
                    manager.wait_until_finished()
                except Exception as e:  # noqa: BLE001 - the save's own error, raised below
                    self._error = e
                except BaseException:  # interrupted: the save goes on, wait() again
                    self._manager = manager
                    raise
                self._finish(manager)
        if self._error is not None:
            raise CheckpointSaveError(
                f"saving step {self.path.name} into {self.path.parent} failed: {type(self._error).__name__}: "
                f"{self._error}. The step was not saved; the earlier steps are intact."
            ) from self._error
        return self.path

    def done(self) -> bool:
        manager = self._manager
        return manager is None or not manager.is_saving_in_progress()

    def _finish(self, manager: Any) -> None:
        try:
            manager.close()
        except Exception:  # noqa: BLE001 - close() raises the save's error again; it is kept above
            _log.debug("closing the checkpoint manager of %s", self.path, exc_info=True)
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        _saves.forget(self)


def save_checkpoint_async(
    directory: str | os.PathLike,
    state: PyTree,
    *,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
    max_to_keep: int | None = None,
    supersede_newer: bool = False,
) -> PendingSave:
    """:func:`save_checkpoint` that returns once the arrays are copied to the host.

    The next training steps may run (and donate ``state``) while the files are written; call
    ``.wait()`` on the result to learn whether the save succeeded. The step appears in
    ``directory`` only when complete: a kill in between leaves the earlier steps. A save into
    the same directory waits for this one first; the process waits for it at exit.

    Example::

        pending = jd.save_checkpoint_async("/ckpt/run1", state)
        state, metrics = step(state, batch)      # runs while the checkpoint is written
        pending.wait()
    """
    directory = _directory(directory)
    _check_leaves(state)
    step = _step_number(state, step)
    _check_max_to_keep(max_to_keep)
    extra = _json_extra(extra)
    description = state_description(state)
    with _saves.turn(directory) as lock:
        existing = _steps(directory)
        if existing:
            # Another bucket layout or mesh is fine (a run resumed elsewhere); another model is not.
            saved = _read_description(directory, existing[-1])
            if not _same_model(saved, description):
                raise CheckpointMismatchError(
                    f"{directory} holds checkpoints of a different model (step {existing[-1]}): "
                    f"{_differences(saved, description)}. Nothing was written; save this run to a new directory."
                )
        _check_order(directory, step, existing, supersede_newer)
        keys = [leaf[0] for leaf in description["leaves"]]
        arrays = dict(zip(keys, jax.tree.leaves(state)))
        try:  # collectives over every process: a peer that stopped fails them
            checksums = _checksums(arrays)
            meta = {**description, "step": step, "extra": extra, "checksums": checksums}
            meta["digest"] = _digest(meta)
            if supersede_newer:
                _supersede(directory, [s for s in existing if s >= step])
                _every_process_here("jax_drain superseded")
        except Exception as e:
            raise _save_failed(directory, step, e) from e
        pending = PendingSave(_start_save(directory, step, arrays, meta, max_to_keep), directory / str(step), lock)
        _saves.started(pending)
    return pending


def restore_checkpoint(
    directory: str | os.PathLike, target: PyTree, *, step: int | None = None
) -> tuple[PyTree, dict[str, Any]]:
    """Restores step ``step`` (default: the newest intact one) of ``directory`` into ``target``.

    Args:
        directory: a directory written by :func:`save_checkpoint`.
        target: the state to restore into: arrays or ``jax.ShapeDtypeStruct``s *with shardings*,
            e.g. ``train_step.abstract_state()``: the same model, on any mesh and bucket layout.
            Only structure, shapes, dtypes, shardings and layouts are read.
        step: which saved step; ``None`` for the newest step that is intact. Damaged newer
            steps are skipped and moved to ``<directory>/damaged/``, so a run resumed from the
            restored step saves those step numbers again; each is reported by a ``UserWarning``
            naming what is damaged, and the move by a WARNING record of the
            ``jax_drain.checkpoint`` logger with the attributes ``damaged_steps``,
            ``restored_step`` and ``moved_to``.

    Returns:
        ``(state, extra)``: the restored state (``target``'s tree, arrays placed with
        ``target``'s shardings) and the ``extra`` dict given to :func:`save_checkpoint`.

    Raises:
        FileNotFoundError: no such checkpoint.
        CheckpointMismatchError: the checkpoint was saved from a different model, or a step
            directory was renamed by hand (its name is not the step its description records).
        CheckpointCorruptError: the step (or, without ``step=``, every step) is damaged: a file
            unreadable, or an array or the description (``extra`` and the layouts included) not
            matching its checksum. The error names the file.
    """
    directory = _directory(directory)
    _check_target(target)
    steps = _steps(directory)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {directory}{_incomplete_steps(directory)}")
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise TypeError(f"step must be an int (a saved step: {steps}) or None for the newest intact one, "
                            f"got {step!r}")
        if int(step) not in steps:
            raise FileNotFoundError(f"{directory} has no step {step}; saved steps: {steps}"
                                    f"{_incomplete_steps(directory)}")
        return _restore_step(directory, int(step), target)
    damaged: dict[int, str] = {}
    for candidate in reversed(steps):
        try:
            restored = _restore_step(directory, candidate, target)
        except CheckpointCorruptError as e:
            damaged[candidate] = str(e)
            warnings.warn(f"{e} Trying the previous step.", stacklevel=2)
            continue
        if damaged:
            _set_aside_damaged(directory, sorted(damaged), candidate)
        return restored
    raise CheckpointCorruptError(f"every step in {directory} is damaged:\n" + "\n".join(damaged.values()))


# -- internals ----------------------------------------------------------------------------------


def _directory(directory: Any) -> pathlib.Path:
    """``directory`` as an absolute path, or a ``TypeError`` saying what a directory is."""
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise TypeError(f"directory must be a non-empty path (str or os.PathLike), got {type(directory).__name__} "
                        f"{directory!r:.60}")
    return pathlib.Path(directory).absolute()


def _json_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    """``extra`` as it is written; raises before anything is written unless it is a dict that
    reads back equal (JSON: no tuples, which come back as lists, and string keys only)."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict of JSON values (or None), got {type(extra).__name__}; nothing was "
                        "written")
    try:
        back = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra must hold JSON values (str, int, float, bool, None, lists, dicts): {e}. Convert numpy "
                        "values with .item() or .tolist(); nothing was written") from None
    if back != extra:
        raise ValueError(f"extra would not read back as given ({extra!r} reads back as {back!r}): use string keys "
                         "and lists, not tuples; nothing was written")
    return back


def _digest(meta: dict[str, Any]) -> str:
    """The checksum of a description (everything in it but the checksum itself)."""
    body = {key: value for key, value in meta.items() if key != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _check_leaves(state: PyTree) -> None:
    """Every leaf of ``state`` holds values: a ``jax.Array`` or a numpy array."""
    if jax.tree_util.treedef_is_leaf(jax.tree.structure(state)):
        raise TypeError(f"state must be a pytree of arrays (a TrainState, or a dict of arrays), got a bare "
                        f"{type(state).__name__}: a restore names every array by its path; wrap it, e.g. "
                        "{'x': x}; nothing was written")
    for path, leaf in zip(leaf_paths(state), jax.tree.leaves(state)):
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise ValueError(
                f"save_checkpoint: state leaf {path!r} was deleted: the state was consumed by a train step that "
                "donated it (TrainConfig(donate=True)). Save the state the step returned; nothing was written.")
        if isinstance(leaf, (jax.Array, np.ndarray)) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"save_checkpoint: state leaf {path!r} is a typed PRNG key array ({leaf.dtype}): save its bits, "
                "jax.random.key_data(key), and rebuild it with jax.random.wrap_key_data after the restore; "
                "nothing was written.")
        if isinstance(leaf, (jax.Array, np.ndarray)) and np.size(leaf) == 0:
            raise ValueError(
                f"save_checkpoint: state leaf {path!r} has no elements (shape {list(np.shape(leaf))}); the checkpoint "
                "format (orbax) stores no empty arrays. Leave it out of the state; nothing was written.")
        if isinstance(leaf, (jax.Array, np.ndarray)):
            continue
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"save_checkpoint: state leaf {path!r} is a jax.ShapeDtypeStruct: an abstract state has no values "
                "to save. Pass the state itself (what step.init() or a train step returns), not "
                "step.abstract_state(); nothing was written."
            )
        raise TypeError(
            f"save_checkpoint: state leaf {path!r} is a {type(leaf).__name__} ({leaf!r:.40}), not an array: "
            "a checkpoint restores arrays placed with shardings. Keep it in the state as an array "
            "(jnp.asarray(x)), or pass plain values in extra={...}; nothing was written."
        )


def _check_target(target: PyTree) -> None:
    """A restore target: a pytree of arrays or ``jax.ShapeDtypeStruct``s."""
    leaves = jax.tree.leaves(target)
    bad = [(path, leaf) for path, leaf in zip(leaf_paths(target), leaves)
           if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))]
    if not leaves or bad:
        what = f"leaf {bad[0][0]!r} is a {type(bad[0][1]).__name__} ({bad[0][1]!r:.40})" if bad else "it has no leaves"
        raise TypeError(f"restore_checkpoint: target must be a pytree of arrays or jax.ShapeDtypeStructs with "
                        f"shardings, e.g. train_step.abstract_state(); {what}")


def _step_number(state: PyTree, step: Any) -> int:
    """``step`` (or ``state.step``) as an int, 0 or more."""
    if step is None:
        if not hasattr(state, "step"):
            raise ValueError("pass step=...: the state has no .step field")
        step = jax.device_get(state.step)
    try:
        if isinstance(step, bool) or np.ndim(step) != 0:
            raise TypeError
        number = operator.index(step)
    except TypeError:
        raise TypeError(f"save_checkpoint: step={step!r} is not an integer; pass the training step count, e.g. "
                        "step=int(state.step). Nothing was written.") from None
    if number < 0:
        raise ValueError(f"save_checkpoint: step={number} is negative; steps are training step counts, 0 or more. "
                         "Nothing was written.")
    return number


def _check_max_to_keep(max_to_keep: Any) -> None:
    if max_to_keep is None:
        return
    if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, (int, np.integer)):
        raise TypeError(f"save_checkpoint: max_to_keep={max_to_keep!r} is not an integer; pass 1 or more, or None "
                        "to keep every step. Nothing was written.")
    if max_to_keep < 1:
        raise ValueError(f"save_checkpoint: max_to_keep={max_to_keep} would delete every step, this one too; pass "
                         "1 or more, or None to keep every step. Nothing was written.")


def _check_order(directory: pathlib.Path, step: int, existing: list[int], supersede_newer: bool) -> None:
    """A step must come after the newest saved one: orbax writes nothing otherwise, and a newer
    step left in place would be restored as the latest."""
    if not existing or step > existing[-1] or supersede_newer:
        return
    newer = [s for s in existing if s >= step]
    branch = (f"To go on from an earlier step you restored, pass supersede_newer=True: steps {newer} move to "
              f"{directory / _SUPERSEDED}. Otherwise save under a step after {existing[-1]}, or into a new directory.")
    if step in existing:
        raise CheckpointStepExistsError(f"{directory} already has step {step}; nothing was overwritten. {branch}")
    raise ValueError(f"save_checkpoint: step={step} is before the newest step {existing[-1]} in {directory}, so "
                     f"it would never be restored as the latest; nothing was written. {branch}")


def _every_process_here(name: str) -> None:
    """A barrier of a multi-process run (nothing in one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _set_aside_damaged(directory: pathlib.Path, steps: list[int], restored: int) -> None:
    """Moves the damaged ``steps`` newer than ``restored`` to ``directory/damaged/`` (the first
    process, once every process has tried them), so a run resumed from ``restored`` can save
    those step numbers; reports it on the ``jax_drain.checkpoint`` logger, whose record carries
    ``damaged_steps``, ``restored_step`` and ``moved_to`` (``None`` where the move failed)."""
    _every_process_here("jax_drain damaged steps tried")
    aside: pathlib.Path | None = directory / _DAMAGED
    try:
        _move_steps(directory, steps, aside)
    except OSError as e:  # a read-only copy, say: the restore itself stands
        warnings.warn(f"could not move the damaged steps {steps} of {directory} aside ({e}); a save of those step "
                      "numbers will be refused until they are moved out of the directory", stacklevel=3)
        aside = None
    _every_process_here("jax_drain damaged steps moved")
    _log.warning("restored step %d of %s; the newer steps %s are damaged%s", restored, directory, steps,
                 f" and were moved to {aside}" if aside else "",
                 extra={"damaged_steps": steps, "restored_step": restored, "moved_to": aside})


def _move_steps(directory: pathlib.Path, steps: list[int], aside: pathlib.Path) -> None:
    """Moves ``steps`` into ``aside`` (a name taken already gets a suffix); in a multi-process
    run the first process moves them."""
    if not steps or jax.process_index() != 0:
        return
    aside.mkdir(exist_ok=True)
    for step in steps:
        target, n = aside / str(step), 0
        while target.exists():
            n += 1
            target = aside / f"{step}.{n}"
        os.rename(directory / str(step), target)


def _supersede(directory: pathlib.Path, steps: list[int]) -> None:
    """Moves ``steps`` to ``directory/superseded/`` (a name taken already gets a suffix); in a
    multi-process run the first process moves them."""
    if not steps or jax.process_index() != 0:
        return
    _move_steps(directory, steps, directory / _SUPERSEDED)
    _log.info("moved steps %s of %s to %s", steps, directory, directory / _SUPERSEDED)


def _start_save(directory: pathlib.Path, step: int, arrays: dict[str, Any], meta: dict[str, Any],
                max_to_keep: int | None) -> Any:
    """An orbax manager writing ``step`` in the background."""
    ocp = _orbax(directory)
    # Directories made in the caller's thread: made in the background, a failure there leaves
    # orbax's writer threads waiting for them until its timeout, and the process cannot exit.
    options = ocp.CheckpointManagerOptions(
        create=True, max_to_keep=max_to_keep, enable_async_checkpointing=True,
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    manager = ocp.CheckpointManager(directory, options=options, item_handlers=_handlers(ocp))
    try:
        started = manager.save(step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(arrays), _META: ocp.args.JsonSave(meta),
        }))
    except BaseException as e:
        with contextlib.suppress(Exception):
            manager.close()
        if isinstance(e, OSError) and e.errno is not None:
            raise _unwritable(directory, e) from e
        if isinstance(e, Exception):  # orbax's, or a collective's: a save failure, whatever raised it
            raise _save_failed(directory, step, e) from e
        raise
    if not started:  # orbax declines some saves silently (e.g. a step not after its latest)
        manager.close()
        raise RuntimeError(f"orbax declined to save step {step} into {directory} (steps there: "
                           f"{_steps(directory)}); nothing was written.")
    return manager


class _DirectoryLock:
    """This process's claim to save into a directory: an exclusive ``flock`` on a lock file
    there. The kernel drops it when the process dies, so a killed saver blocks nobody."""

    def __init__(self, path: pathlib.Path, fd: int | None):
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, directory: pathlib.Path) -> "_DirectoryLock":
        path = directory / _LOCK_FILE
        try:
            directory.mkdir(parents=True, exist_ok=True)
            while True:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                if fcntl is None:
                    return cls(path, fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise CheckpointBusyError(
                        f"another process ({holder}) is saving into {directory}; nothing was written. Two runs "
                        "saving into one directory would lose each other's steps: give each run its own "
                        "directory, or save again once that save is over (the lock is freed when its process "
                        "has waited for its save, exits or dies)."
                    ) from None
                if _same_file(fd, path):
                    break
                os.close(fd)  # its holder removed it between our open and flock: lock the new one
        except OSError as e:
            raise _unwritable(directory, e) from e
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
        return cls(path, fd)

    @classmethod
    def acquire_for_run(cls, directory: pathlib.Path) -> "_DirectoryLock":
        """:meth:`acquire` by this run: in a multi-process run the first process holds the lock
        for all of them (they save one step together), and every process raises its error."""
        if jax.process_count() == 1:
            return cls.acquire(directory)
        from jax.experimental import multihost_utils

        lock, error = cls(directory / _LOCK_FILE, None), None
        if jax.process_index() == 0:
            try:
                lock = cls.acquire(directory)
            except (CheckpointBusyError, OSError) as e:
                error = e
        held = multihost_utils.process_allgather(np.array([error is None], np.int32))
        if not np.asarray(held).all():
            lock.release()
            raise error or CheckpointBusyError(
                f"process 0 of this run could not lock {directory} for saving (its error says why); nothing "
                "was written.")
        return lock

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # while still locked: a waiter holding the old file tries again
        os.close(self._fd)
        self._fd = None


def _save_failed(directory: pathlib.Path, step: int, error: Exception) -> CheckpointSaveError:
    """A save that failed before its step was written, saying what to do."""
    return CheckpointSaveError(
        f"saving step {step} into {directory} failed before it was written: {type(error).__name__}: {error}. Nothing "
        "was written; the earlier steps are intact. In a multi-process run a peer that stopped (killed, out of "
        "memory) ends a save this way: restart every process, and restore_checkpoint restores the newest complete "
        "step")


def _unwritable(directory: pathlib.Path, error: OSError) -> OSError:
    """``error`` (same class) saying that ``directory`` cannot be written and what to do."""
    return type(error)(error.errno, f"cannot save a checkpoint into {directory}: {error.strerror} "
                                    f"({error.filename}); nothing was written. Save into a directory this "
                                    "process can write.")


def _same_file(fd: int, path: pathlib.Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


class _Saves:
    """This process's saves in progress, by directory: a save into a directory waits for the
    previous one there; the process waits for all of them at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._turns: dict[pathlib.Path, threading.Lock] = {}
        self._pending: dict[pathlib.Path, PendingSave] = {}
        self._exit_hook = False

    @contextlib.contextmanager
    def turn(self, directory: pathlib.Path) -> Iterator[_DirectoryLock]:
        """Inside: the only save into ``directory`` being set up, the previous one finished, the
        directory locked against other processes (released on an error; else the save's)."""
        key = _resolved(directory)
        with self._lock:
            turn = self._turns.setdefault(key, threading.Lock())
        with turn:
            previous = self._pending.get(key)
            if previous is not None:
                with contextlib.suppress(CheckpointSaveError):  # its error is its waiter's
                    previous.wait()
            lock = _DirectoryLock.acquire_for_run(directory)
            try:
                yield lock
            except BaseException:
                lock.release()
                raise

    def started(self, pending: PendingSave) -> None:
        with self._lock:
            self._pending[_resolved(pending.path.parent)] = pending
            if not self._exit_hook:
                self._exit_hook = True
                _at_exit(self.finish_all)

    def forget(self, pending: PendingSave) -> None:
        with self._lock:
            key = _resolved(pending.path.parent)
            if self._pending.get(key) is pending:
                del self._pending[key]

    def finish_all(self) -> None:
        """Waits for every save nobody waited for (at exit)."""
        with self._lock:
            pending = list(self._pending.values())
        for save in pending:
            try:
                save.wait()
            except CheckpointSaveError as e:
                _log.error("%s", e)


def _resolved(directory: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(os.path.realpath(directory))


def _at_exit(function: Any) -> None:
    """Runs ``function`` at exit while orbax's threads may still start work: before Python joins
    the threads and before ``concurrent.futures`` refuses new work (its hook, registered when it
    is imported, runs after those registered later). ``atexit`` would run after both: too late."""
    import concurrent.futures.thread  # noqa: F401 - registered before ours, so it runs after

    threading._register_atexit(function)  # noqa: SLF001 - the only hook that runs early enough


_saves = _Saves()


def _restore_step(directory: pathlib.Path, step: int, target: PyTree) -> tuple[PyTree, dict[str, Any]]:
    saved = _read_description(directory, step)
    wanted = state_description(target)
    leaves, treedef = jax.tree.flatten(target)
    for (_, path, _, _), leaf in zip(wanted["leaves"], leaves):
        if getattr(leaf, "sharding", None) is None:
            raise ValueError(
                f"target leaf {path!r} has no sharding; pass arrays or ShapeDtypeStructs with "
                "shardings, e.g. train_step.abstract_state()"
            )
    same = saved["fingerprint"] == wanted["fingerprint"]
    if not same:
        _check_movable(directory, step, saved, wanted)
    _check_orbax_files(directory, step, saved)
    source = SavedArrays(directory / str(step) / _STATE, saved["leaves"])
    try:
        state = _read_held(directory, step, saved, wanted, leaves, source) if same else \
            _moved(directory, step, saved, wanted, leaves, source)
    except UnreadableArray as e:
        key = next(k for k, p, *_ in saved["leaves"] if p == e.path)
        raise CheckpointCorruptError(_bad_array(directory, step, key, saved, f"is unreadable ({e.reason})")) from e
    return jax.tree.unflatten(treedef, state), saved.get("extra", {})


def _read_held(directory: pathlib.Path, step: int, saved: dict[str, Any], wanted: dict[str, Any],
               leaves: list[Any], source: SavedArrays) -> list[jax.Array]:
    """The target's arrays from a step saved with its layout: each process reads the blocks its
    devices hold, straight from the files. Then every array is checked against its checksum,
    each process summing the shards it holds; an array that some process could not read is
    refused by every process (none waits for another that gave up)."""
    arrays, reasons = {}, {}
    for (key, path, shape, _), leaf in zip(wanted["leaves"], leaves):
        blocks = LocalBlocks(shape, leaf.dtype, leaf.sharding)
        try:
            blocks.fill(lambda index, path=path: source.read(path, index))
        except UnreadableArray as e:
            reasons[key] = e.reason
        arrays[key] = blocks.array()
    keys = list(arrays)
    sums, unreadable = _summed_over_processes([arrays[k] for k in keys], [k in reasons for k in keys])
    _refuse_damaged(directory, step, saved, keys, sums, unreadable, reasons,
                    whole=lambda key: jax.device_get(arrays[key]))
    return [arrays[key] for key in keys]


def _moved(directory: pathlib.Path, step: int, saved: dict[str, Any], wanted: dict[str, Any],
           leaves: list[Any], source: SavedArrays) -> list[jax.Array]:
    """The target's arrays from a step saved with another layout. Each process builds only the
    blocks its devices hold, reading from the files only the runs of the parameters those blocks
    need, one parameter at a time; every saved array is checked against its checksum first,
    each process reading its share."""
    _verify_in_parts(directory, step, saved, source)
    targets = {path: LocalBlocks(shape, leaf.dtype, leaf.sharding)
               for (_, path, shape, _), leaf in zip(wanted["leaves"], leaves)}
    arrays: dict[str, jax.Array] = {}
    # Each group of arrays is made as soon as it is complete, and its host blocks dropped.
    for move in (_relaid, _repacked, _feedback_restarted, _params_moved):
        for paths in move(saved, wanted, source, targets):
            arrays.update((path, targets.pop(path).array()) for path in paths)
    saved_paths = BlockPaths([path for _, path, *_ in saved["leaves"]])
    for path, blocks in list(targets.items()):  # the leaves kept as saved (stacked blocks: row by row)
        blocks.fill(lambda index, path=path: _read_leaf(source, saved_paths.source(path), index))
        arrays[path] = targets.pop(path).array()
    return [arrays[path] for _, path, *_ in wanted["leaves"]]


def _verify_in_parts(directory: pathlib.Path, step: int, saved: dict[str, Any], source: SavedArrays) -> None:
    """Checks every saved array against its recorded checksum, each process summing its share
    of the elements (:func:`~jax_drain._relayout.verify_parts`) a chunk at a time; the shares
    add up across processes, and so does whether any process could not read its share, so all
    of them refuse the same array."""
    recorded = saved.get("checksums", {})
    entries = saved["leaves"]
    part, parts = jax.process_index(), jax.process_count()
    sums, reasons = np.zeros(len(entries), np.uint64), {}
    for i, (key, path, shape, _) in enumerate(entries):
        if not str(recorded.get(key, "")).startswith(_SUM_PREFIX):
            continue  # a whole-array checksum of format 4: checked on the whole array
        total = 0
        try:
            for index in verify_parts(shape, part, parts, _CHUNK):
                total = (total + int(_element_sum(_host_bits(source.read(path, index)), index, tuple(shape)))) % (1 << 64)
        except UnreadableArray as e:
            reasons[key] = e.reason
        sums[i] = total
    keys = [key for key, *_ in entries]
    added = _added_over_processes(np.concatenate([sums, np.array([k in reasons for k in keys], np.uint64)]))
    paths = {key: path for key, path, *_ in entries}
    _refuse_damaged(directory, step, saved, keys, added[:len(keys)], added[len(keys):], reasons,
                    whole=lambda key: source.read(paths[key]))


def _added_over_processes(values: np.ndarray) -> np.ndarray:
    """``values`` (uint64) added up over the processes (mod 2**64): one small all-gather that
    every process joins; the values themselves in one process."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    # uint32 halves: without x64, JAX would narrow uint64 on the way.
    gathered = np.asarray(multihost_utils.process_allgather(values.view(np.uint32)), np.uint32)
    return gathered.reshape(jax.process_count(), -1).copy().view(np.uint64).sum(axis=0, dtype=np.uint64)


def _refuse_damaged(directory: pathlib.Path, step: int, saved: dict[str, Any], keys: list[str], sums: np.ndarray,
                    unreadable: np.ndarray, reasons: dict[str, str], whole: Any) -> None:
    """Raises :class:`CheckpointCorruptError` for the first array some process could not read
    or whose elements do not add up to its recorded checksum (``whole(key)``: the whole array,
    for a format-4 checksum)."""
    recorded = saved.get("checksums", {})
    shapes = {key: (shape, dtype) for key, _, shape, dtype in saved["leaves"]}
    for key, total, bad in zip(keys, sums, unreadable):
        if bad:
            raise CheckpointCorruptError(_bad_array(directory, step, key, saved,
                                                    f"is unreadable ({reasons.get(key, 'on another process')})"))
        want = str(recorded.get(key, ""))
        if want.startswith(_SUM_PREFIX):
            got = _checksum_text(shapes[key][1], shapes[key][0], int(total))
        else:  # a format-4 whole-array checksum (format 3 recorded none)
            got = _sha256(whole(key)) if key in recorded else want
        if want != got:
            raise CheckpointCorruptError(_bad_array(directory, step, key, saved, "does not match its checksum"))


def _check_orbax_files(directory: pathlib.Path, step: int, saved: dict[str, Any]) -> None:
    """Refuses the step if orbax's metadata of its arrays, or an array's ``.zarray``, is not
    JSON: damage to the step even where the arrays' data would read."""
    item = directory / str(step) / _STATE
    for path in [item / "_METADATA", *sorted((item / "array_metadatas").glob("*"))]:
        reason = _not_json(path)
        if reason:
            raise CheckpointCorruptError(_bad_file(directory, step, path, f"(orbax's metadata of the arrays) is {reason}"))
    for key, *_ in saved["leaves"]:
        reason = _not_json(item / key / ".zarray")
        if reason:
            raise CheckpointCorruptError(_bad_array(directory, step, key, saved, f"is unreadable: its metadata is {reason}",
                                                    item / key / ".zarray"))


def _not_json(path: pathlib.Path) -> str:
    """Why ``path`` is not a JSON file ('' if it is one)."""
    try:
        json.loads(path.read_bytes())
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError) as e:
        return f"not JSON ({type(e).__name__})"
    return ""


def _bad_array(directory: pathlib.Path, step: int, key: str, saved: dict[str, Any], what: str,
               file: pathlib.Path | None = None) -> str:
    path = next((p for k, p, *_ in saved["leaves"] if k == key), key)
    file = file or directory / str(step) / _STATE / key
    return f"checkpoint step {directory / str(step)}: array {path!r} (file {file}) {what}; {_damaged_advice(directory, step)}"


def _bad_file(directory: pathlib.Path, step: int, file: pathlib.Path, what: str) -> str:
    return f"checkpoint step {directory / str(step)}: file {file} {what}; {_damaged_advice(directory, step)}"


def _damaged_advice(directory: pathlib.Path, step: int) -> str:
    others = [s for s in _steps(directory) if s != step]
    return ("the file was damaged after saving. "
            + (f"Restore another step (step=..., saved: {others}) or remove that step directory." if others
               else f"No other step is saved in {directory}."))


def _relaid(saved: dict[str, Any], wanted: dict[str, Any], source: SavedArrays,
            targets: dict[str, LocalBlocks]) -> Iterator[list[str]]:
    """Writes the target's DistState shard arrays, re-laid from the saved ones one parameter at
    a time (only the parameters this process's blocks hold); yields each shard set's paths once
    it is written."""
    sources, sets = _shard_sets(saved), _shard_sets(wanted)
    for old, new in zip(saved["layouts"], wanted["layouts"]):
        reads = param_placements(json.loads(old["description"]))
        writes = param_placements(json.loads(new["description"]))
        for name, paths in sets.items():
            if name.startswith(_below(new["path"])):
                _move_params(reads, writes, source, sources[name], targets, paths)
                yield paths


def _move_params(reads: dict[str, Any], writes: dict[str, Any], source: SavedArrays, froms: list[str],
                 targets: dict[str, LocalBlocks], tos: list[str]) -> None:
    """Each parameter from the saved shard arrays ``froms`` (laid out as ``reads`` says) into
    the target's ``tos`` (as ``writes`` says), read only where this process holds a block."""
    value = _WholeParams(reads, lambda param: read_param(reads[param],
                                                         lambda i, lo, hi: source.read_last(froms[i], lo, hi)))
    for param in value.in_read_order(writes):
        placement = writes[param]
        if not any(targets[tos[run.array]].holds(run.lo, run.hi) for block in placement.blocks for run in block.runs):
            continue
        write_param(placement, value(param), lambda i, lo, hi, v: targets[tos[i]].write_last(lo, hi, v))


class _WholeParams:
    """``value(param)``: a saved parameter's whole array by the target's path, built where the
    two hold a list of blocks in different forms (``jax_drain._blocks.BlockPaths``): a stacked
    parameter's row, or the blocks' parameters stacked. ``read(saved path)`` reads one; the last
    stacked one read is kept, so that taking its rows one after another reads it once."""

    def __init__(self, saved: Any, read: Any):
        self.paths, self.read = BlockPaths(list(saved)), read
        self._last: tuple[str, np.ndarray] | None = None

    def in_read_order(self, params: Any) -> list[str]:
        """``params`` with the rows of one stacked parameter next to each other."""
        def key(param: str) -> str:
            how = self.paths.source(param)
            return how[1] if how is not None and how[0] == "row" else param
        return sorted(params, key=key)

    def __call__(self, param: str) -> np.ndarray:
        how = self.paths.source(param)
        if how is None:
            raise KeyError(param)
        if how[0] == "same":
            return self.read(param)
        if how[0] == "stack":
            return np.stack([self.read(p) for p in how[1]])
        if self._last is None or self._last[0] != how[1]:
            self._last = (how[1], self.read(how[1]))
        return self._last[1][how[2]]


def _read_leaf(source: SavedArrays, how: tuple | None, index: tuple) -> np.ndarray:
    """``array[index]`` of a target leaf from the saved leaves, as ``BlockPaths.source`` gives
    ``how`` (the same leaf, a row of a stacked one, or the blocks' leaves stacked)."""
    if how is None:  # pragma: no cover - _same_model refused it before
        raise CheckpointMismatchError(f"the checkpoint has no leaf for index {index}")
    if how[0] == "same":
        return source.read(how[1], index)
    if how[0] == "row":
        return source.read(how[1], (how[2], *index))
    rows = range(len(how[1]))[index[0]] if index else range(len(how[1]))
    return np.stack([source.read(how[1][r], tuple(index[1:])) for r in rows])


def _repacked(saved: dict[str, Any], wanted: dict[str, Any], source: SavedArrays,
              targets: dict[str, LocalBlocks]) -> Iterator[list[str]]:
    """Writes the target's owner-packed ``tx`` state arrays, moved from the saved owners to the
    target's: each saved owner's row is read (once, and only if it holds state one of this
    process's target owners needs) and unpacked, and each target owner this process holds is
    packed from the state leaves it owns; yields their paths once written."""
    for old, new in zip(saved["layouts"], wanted["layouts"]):
        if "packing" not in old or "packing" not in new:
            continue
        before, after = json.loads(old["packing"]), json.loads(new["packing"])
        froms, tos = _packed_paths(saved, old), _packed_paths(wanted, new)
        mine = [r for r in range(after["owners"])
                if any(targets[p].holds(*row_span(after, targets[p].shape[-1], r)) for p in tos)]
        needed = {path for r in mine for path in owned_leaves(after, r, shared=True)}
        values: dict[str, np.ndarray] = {}
        for r in range(before["owners"]):
            if needed & set(owned_leaves(before, r)):
                rows = [source.read_last(p, *row_span(before, source.shape(p)[-1], r)) for p in froms]
                values.update((k, v) for k, v in unpack_owner_on_host(before, rows, r).items() if k in needed)
        for r in mine:
            for path, row in zip(tos, pack_owner_on_host(after, values, r)):
                targets[path].write_last(*row_span(after, targets[path].shape[-1], r), row)
        yield tos


def _packed_paths(description: dict[str, Any], layout: dict[str, Any]) -> list[str]:
    """The paths of a whole-parameter ownership DistState's packed ``tx`` state arrays, in order."""
    if "packing" not in layout:
        return []
    prefix = _below(layout["path"]) + "inner/"
    found = {int(path[len(prefix):]): path for _, path, *_ in description["leaves"]
             if path.startswith(prefix) and path[len(prefix):].isdigit()}
    return [found[i] for i in sorted(found)]


def _owned(layout: dict[str, Any]) -> bool:
    return any(chain.get("owners") for chain in json.loads(layout["description"]))


def _ownership_changed(saved: dict[str, Any], wanted: dict[str, Any]) -> str:
    """Why the saved DistStates' ``tx`` state is kept in another form than the target's ('' if not)."""
    for old, new in zip(saved["layouts"], wanted["layouts"]):
        if _owned(old) != _owned(new):
            kinds = ["whole parameters per owner (ownership='param')" if _owned(x) else
                     "flat shards (ownership='element')" for x in (old, new)]
            return (f"the optimizer state at {old['path']!r} was saved on {kinds[0]} and the target keeps "
                    f"it on {kinds[1]}; tx state does not convert between the two: restore with the ownership it was "
                    "saved with")
    return ""


def _packing_unmovable(saved: dict[str, Any], wanted: dict[str, Any]) -> str:
    """Why owner-packed ``tx`` state cannot move to the target's owners ('' if it can)."""
    for old, new in zip(saved["layouts"], wanted["layouts"]):
        if not _owned(old):
            continue
        where = old["path"]
        if "packing" not in old:
            return (f"the optimizer state at {where!r} uses whole-parameter ownership and was saved without the "
                    "packing of its tx state (an earlier version): restore with the mesh, bucket size and ownership "
                    "it was saved with")
        reason = packing_mismatch(json.loads(old["packing"]), json.loads(new["packing"]))
        if reason:
            return f"the optimizer state at {where!r} uses whole-parameter ownership, and {reason}"
    return ""


def _below(path: str) -> str:
    """The prefix of the leaf paths below the node at ``path`` (``<root>``: the whole state)."""
    return "" if path == "<root>" else path + "/"


def _param_roots(description: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ZeRO-3 ``ParamShards`` of a state description, by path."""
    return {x["path"]: x for x in description.get("params", [])}


def _under(description: dict[str, Any], root: str) -> list[str]:
    """The paths of the leaves below ``root``, in leaf order."""
    return [path for _, path, *_ in description["leaves"] if path.startswith(root + "/")]


def _param_shapes(description: dict[str, Any], root: str) -> dict[str, tuple]:
    """Parameter path -> global shape below ``root``, from ZeRO-3 shards' layout or from the
    replicated leaves: what must agree for one to restore into the other."""
    node = _param_roots(description).get(root)
    if node is None:
        return {path[len(root) + 1:]: tuple(shape) for _, path, shape, _ in description["leaves"]
                if path.startswith(root + "/")}
    return {piece[0]: tuple(piece[5]) for chain in json.loads(node["description"])
            for _, _, pieces in chain["buckets"] for piece in pieces}


def _params_moved(saved: dict[str, Any], wanted: dict[str, Any], source: SavedArrays,
                  targets: dict[str, LocalBlocks]) -> Iterator[list[str]]:
    """Writes the target's parameters where they are kept in another form than saved: ZeRO-3
    shards re-laid onto another layout, built from replicated parameters, or replicated
    parameters built from shards (one parameter at a time, as the optimizer state moves);
    yields their paths once written."""
    have, want = _param_roots(saved), _param_roots(wanted)
    for root in sorted(have.keys() | want.keys()):
        old, new = have.get(root), want.get(root)
        if old is not None and new is not None and old["fingerprint"] == new["fingerprint"]:
            continue
        froms, tos = _under(saved, root), _under(wanted, root)
        if old is not None and new is not None:
            _move_params(param_placements(json.loads(old["description"])),
                         param_placements(json.loads(new["description"])), source, froms, targets, tos)
        elif new is not None:  # replicated parameters saved, ZeRO-3 shards wanted
            writes = param_placements(json.loads(new["description"]))
            value = _WholeParams([p[len(root) + 1:] for p in froms], lambda p: source.read(f"{root}/{p}"))
            for param in value.in_read_order(writes):
                write_param(writes[param], value(param), lambda i, lo, hi, v: targets[tos[i]].write_last(lo, hi, v))
        else:  # ZeRO-3 shards saved, replicated parameters wanted
            reads = param_placements(json.loads(old["description"]))
            value = _WholeParams(reads, lambda p: read_param(reads[p],
                                                             lambda i, lo, hi: source.read_last(froms[i], lo, hi)))
            for param in value.in_read_order([p[len(root) + 1:] for p in tos]):
                whole = value(param)
                targets[f"{root}/{param}"].fill(lambda index, whole=whole: whole[index])
        yield tos


def _feedback_leaves(description: dict[str, Any]) -> dict[str, tuple[str, tuple, str]]:
    """Every error-feedback leaf's path -> (its ErrorFeedback's fingerprint, shape, dtype)."""
    nodes = [(_below(x["path"]), x["fingerprint"]) for x in description.get("feedback", [])]
    out = {}
    for _, path, shape, dtype in description["leaves"]:
        for prefix, fingerprint in nodes:
            if path.startswith(prefix):
                out[path] = (fingerprint, tuple(shape), dtype)
    return out


def _feedback_restarted(saved: dict[str, Any], wanted: dict[str, Any], source: SavedArrays,
                        targets: dict[str, LocalBlocks]) -> Iterator[list[str]]:
    """The target's error-feedback residuals: the saved ones where they belong to the same
    layout (left to be read as they are), zeros (with a warning) where they do not or were not
    saved; yields the paths of the zeroed ones."""
    have, reset = _feedback_leaves(saved), []
    for path, entry in _feedback_leaves(wanted).items():
        if have.get(path) != entry:
            reset.append(path)  # its blocks are zero until written
    if reset:
        warnings.warn(
            f"error-feedback residuals {reset[:3]}{'...' if len(reset) > 3 else ''} start from zero: the "
            "checkpoint has none for this bucket layout (saved on another mesh or layout, or without them)",
            stacklevel=5)
    yield reset


def _shard_sets(description: dict[str, Any]) -> dict[str, list[str]]:
    """The paths of each DistState shard set (its master shards, each FlatShards node of its tx
    state), in flat (bucket) order."""
    prefixes = tuple(_below(layout["path"]) for layout in description["layouts"])
    sets: dict[str, dict[int, str]] = {}
    for _, path, *_ in description["leaves"]:
        match = _SHARD.match(path)
        if match and path.startswith(prefixes):
            sets.setdefault(match.group(1), {})[int(match.group(2))] = path
    return {name: [members[i] for i in sorted(members)] for name, members in sets.items()}


def _same_model(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two state descriptions differ at most in their DistStates' layouts and their
    error feedback: every other leaf has the same path, shape and dtype, and the shard sets are
    the same."""
    roots = _param_roots(a).keys() | _param_roots(b).keys()

    def plain(description: dict[str, Any]) -> dict[str, tuple]:
        shards = {p for paths in _shard_sets(description).values() for p in paths}
        shards |= _feedback_leaves(description).keys()
        shards |= {p for layout in description["layouts"] for p in _packed_paths(description, layout)}
        shards |= {p for root in roots for p in _under(description, root)}
        return {path: (tuple(shape), dtype) for _, path, shape, dtype in description["leaves"] if path not in shards}

    # A list of blocks stacked by a stage axis is the same model as the blocks one by one.
    same = lambda x, y: BlockPaths.expanded(x) == BlockPaths.expanded(y)  # noqa: E731
    shapes = lambda d, root: {k: (v,) for k, v in _param_shapes(d, root).items()}  # noqa: E731
    return (same(plain(a), plain(b)) and _shard_sets(a).keys() == _shard_sets(b).keys()
            and [x["path"] for x in a["layouts"]] == [x["path"] for x in b["layouts"]]
            and all(same(shapes(a, root), shapes(b, root)) for root in roots))


def _check_movable(directory: pathlib.Path, step: int, saved: dict[str, Any], wanted: dict[str, Any]) -> None:
    """Only the DistStates' layouts may differ: every other leaf must match path, shape, dtype.
    Owner-packed ``tx`` state moves to other owners only as owner-packed state of the same ``tx``."""
    moved = f"checkpoint {directory / str(step)} was saved with another bucket layout than the target's: "
    reason = _ownership_changed(saved, wanted)
    if reason:
        raise CheckpointMismatchError(moved + reason)
    if not _same_model(saved, wanted):
        raise CheckpointMismatchError(
            f"checkpoint {directory / str(step)} does not match the target state: "
            f"{_differences(saved, wanted)}. Restore it with the model (and optimizer) it was saved with."
        )
    reason = _packing_unmovable(saved, wanted)
    if reason:
        raise CheckpointMismatchError(moved + reason)


def _dist_states(state: PyTree) -> list[tuple[str, DistState]]:
    """Each DistState in ``state`` with its path (as :func:`~jax_drain.layout.leaf_paths` writes it)."""
    return _nodes(state, DistState)


def _nodes(state: PyTree, kind: type) -> list[tuple[str, Any]]:
    """Each node of type ``kind`` in ``state`` with its path (as ``leaf_paths`` writes it)."""
    found, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, kind))
    return [(path_str(path), node) for path, node in found if isinstance(node, kind)]


def _sha256(array: Any) -> str:
    """A whole array's checksum in descriptions of format 4 and before."""
    array = np.ascontiguousarray(np.asarray(array))
    return hashlib.sha256(str(array.dtype).encode() + str(array.shape).encode() + array.tobytes()).hexdigest()


# A checksum that any process layout can compute and check without holding a whole array: the
# sum (mod 2**64) over elements of a 64-bit mix of each element's global index and bits. Each
# process sums the shards it owns (one replica of each), the processes' sums add up, and a
# restore on another mesh or process count adds up the same terms.
_SUM_PREFIX = "sum64:"
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_CHUNK = 1 << 20  # elements hashed at once: bounds the temporaries to a few times 8 MiB


def _checksums(arrays: dict[str, Any]) -> dict[str, str]:
    """Each array's layout-free checksum (``_SUM_PREFIX``, dtype, shape, sum); in a
    multi-process run every process calls it with the same keys (one small all-gather)."""
    keys = list(arrays)
    sums, _ = _summed_over_processes([arrays[k] for k in keys])
    return {k: _checksum_text(arrays[k].dtype, np.shape(arrays[k]), int(s)) for k, s in zip(keys, sums)}


def _summed_over_processes(arrays: Sequence[Any], flags: Sequence[bool] = ()) -> tuple[np.ndarray, np.ndarray]:
    """``(sums, flags)``: each array's element sum for its checksum (an array spanning processes
    summed over them, each adding the shards it holds) and ``flags`` (one per array) counted
    over the processes, both in one small all-gather that every process joins."""
    partial = np.array([_owned_sum(a) for a in arrays], np.uint64)
    spread = np.array([isinstance(a, jax.Array) and not a.is_fully_addressable for a in arrays], bool)
    added = _added_over_processes(np.concatenate([partial, np.asarray(flags, np.uint64)]))
    return np.where(spread, added[:len(arrays)], partial), added[len(arrays):]


def _checksum_text(dtype: Any, shape: Any, total: int) -> str:
    return f"{_SUM_PREFIX}{jax.numpy.dtype(dtype)}{list(shape)}:{total:016x}"


def _owned_sum(array: Any) -> int:
    """This process's part of an array's checksum: the first replica of each shard it holds,
    one shard at a time (the whole array for a numpy array)."""
    shape = np.shape(array)
    if isinstance(array, jax.Array):
        parts = [(s.index, s.data) for s in array.addressable_shards if s.replica_id == 0]
    else:
        parts = [(tuple(slice(None) for _ in shape), array)]
    total = 0
    for index, data in parts:
        total = (total + int(_element_sum(_host_bits(data), index, shape))) % (1 << 64)
    return total


def _host_bits(data: Any) -> np.ndarray:
    """An array's elements as unsigned integers of their own width, on the host."""
    if isinstance(data, jax.Array) and jax.dtypes.issubdtype(data.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(data)
    host = np.ascontiguousarray(np.asarray(data))
    width = host.dtype.itemsize
    return host.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]) if width in (1, 2, 4, 8) \
        else host.view(np.uint8)


def _element_sum(bits: np.ndarray, index: tuple, shape: tuple[int, ...]) -> np.uint64:
    """Sum over the block ``bits`` (at ``index`` of an array of ``shape``) of each element's mix
    of global flat index and bits, mod 2**64."""
    if bits.ndim != len(shape):  # wider-than-8-byte elements were viewed as bytes
        shape, index = (*shape, bits.shape[-1]), (*index, slice(None))
    starts = [0 if s.start is None else int(s.start) for s in index]
    strides = np.cumprod((shape[1:] + (1,))[::-1])[::-1] if shape else np.array([], np.int64)
    flat_bits = bits.reshape(-1)
    # Global flat index of every element of the block, one leading-axis slab at a time.
    inner = np.zeros((), np.uint64)
    for d in range(1, bits.ndim):
        axis = (starts[d] + np.arange(bits.shape[d], dtype=np.uint64)) * np.uint64(strides[d])
        inner = np.add.outer(inner, axis)
    inner = inner.reshape(-1)
    rows = bits.shape[0] if bits.ndim else 1
    per_row = max(inner.size, 1)
    step = max(1, _CHUNK // per_row)
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            lead = ((starts[0] + np.arange(r0, r1, dtype=np.uint64)) * np.uint64(strides[0]))[:, None] if bits.ndim \
                else np.zeros((1, 1), np.uint64)
            flat_index = (lead + inner[None, :]).reshape(-1)
            z = flat_index * _GOLDEN + flat_bits[r0 * per_row:r1 * per_row].astype(np.uint64)
            z = (z ^ (z >> np.uint64(30))) * _MIX1
            z = (z ^ (z >> np.uint64(27))) * _MIX2
            z ^= z >> np.uint64(31)
            total = total + z.sum(dtype=np.uint64)
    return total


def _handlers(ocp: Any) -> dict[str, Any]:
    # One directory per array (no OCDBT aggregation), so a damaged file names its array.
    return {_STATE: ocp.StandardCheckpointHandler(use_ocdbt=False), _META: ocp.JsonCheckpointHandler()}


def _orbax(directory: pathlib.Path):
    import orbax.checkpoint as ocp  # imported on use: it is slow to import

    _OrbaxNotes.install(directory)
    return ocp


@contextlib.contextmanager
def _read_only_manager(ocp: Any, directory: pathlib.Path) -> Iterator[Any]:
    with _expected_orbax_notes():
        options = ocp.CheckpointManagerOptions(read_only=True)
        manager = ocp.CheckpointManager(directory, options=options, item_handlers=_handlers(ocp))
    with manager:
        yield manager


# Where orbax's notes about jax_drain's own choices go, at DEBUG (see _OrbaxNotes).
_log = logging.getLogger(__name__)
_in_jax_drain = threading.local()


@contextlib.contextmanager
def _expected_orbax_notes() -> Iterator[None]:
    """Inside: orbax's notes on this thread are about jax_drain's options (read-only managers)."""
    _in_jax_drain.depth = getattr(_in_jax_drain, "depth", 0) + 1
    try:
        yield
    finally:
        _in_jax_drain.depth -= 1


class _OrbaxNotes(logging.Filter):
    """orbax's warnings about options jax_drain sets on purpose, moved to the
    ``jax_drain.checkpoint`` logger at DEBUG.

    jax_drain writes one directory per array (``use_ocdbt=False``, so a damaged file names its
    array: orbax then warns "Skipping merge of OCDBT checkpoints" from its save thread) and reads
    through read-only managers (orbax warns "read_only=True, setting ..." and "Given directory
    is read only"). These come on every save and restore and mean nothing is wrong. Only those
    messages, and only for jax_drain's own directories or managers, are moved; every other orbax
    message (and anything at ERROR) goes where it went before. Installed once, on the ``absl``
    logger orbax writes to.
    """

    EXPECTED = ("Skipping merge of OCDBT checkpoints: No per-process OCDBT checkpoint subdirs",
                "CheckpointManagerOptions.read_only=True, setting", "Given directory is read only=")
    _installed: "_OrbaxNotes | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        super().__init__()
        self.directories: set[str] = set()

    @classmethod
    def install(cls, directory: pathlib.Path) -> None:
        with cls._lock:
            if cls._installed is None:
                cls._installed = cls()
                logging.getLogger("absl").addFilter(cls._installed)
            cls._installed.directories.add(str(directory))

    def _ours(self, message: str) -> bool:
        if getattr(_in_jax_drain, "depth", 0):
            return True
        return any(message.endswith(d) or f"{d}{os.sep}" in message for d in list(self.directories))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or not any(e in str(record.msg) for e in self.EXPECTED):
            return True
        message = record.getMessage()
        if not self._ours(message):
            return True
        _log.debug("orbax: %s", message)
        return False


def _steps(directory: pathlib.Path) -> list[int]:
    # Finished orbax steps only: in-progress saves live in temporary, non-numeric directories.
    if not directory.is_dir():
        return []
    steps = [p for p in directory.iterdir() if p.is_dir() and p.name.isdigit() and (p / _META).is_dir()]
    for p in steps:
        if p.name != str(int(p.name)):
            raise CheckpointMismatchError(
                f"{p} is named like a step but not as saves name them ({str(int(p.name))!r}): a step "
                "directory renamed by hand is neither restored nor skipped; rename it back to the step its "
                "description records, or move it out of the checkpoint directory")
    return sorted(int(p.name) for p in steps)


def _incomplete_steps(directory: pathlib.Path) -> str:
    """What a directory's step-named folders lack, for an error that found no complete step:
    empty where there are none."""
    if not directory.is_dir():
        return ""
    lacking = sorted((int(p.name), p) for p in directory.iterdir()
                     if p.is_dir() and p.name.isdigit() and not (p / _META).is_dir())
    if not lacking:
        return ""
    shown = ", ".join(f"{p.name} (holds {sorted(c.name for c in p.iterdir())[:4] or 'nothing'})" for _, p in lacking[:4])
    return (f". Step directories {shown} lack the '{_META}' description every finished save holds ("
            "deleted by hand, or not written by jax_drain). They are not restored; move them out of the checkpoint directory "
            "(or delete them) and restore the steps that are complete")


def _read_description(directory: pathlib.Path, step: int) -> dict[str, Any]:
    ocp = _orbax(directory)
    with _read_only_manager(ocp, directory) as manager:
        try:
            meta = manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
        except (ValueError, OSError) as e:  # JSONDecodeError, UnicodeDecodeError, FileNotFoundError
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise CheckpointCorruptError(_corrupt(directory, step, reason)) from e
    if not isinstance(meta, dict) or "format" not in meta:
        raise CheckpointCorruptError(_corrupt(directory, step, f"not a jax_drain description: {str(meta)[:60]!r}"))
    if meta["format"] not in _READABLE_FORMATS:
        raise CheckpointMismatchError(
            f"checkpoint step {step} in {directory} has format {meta.get('format')!r}; this "
            f"jax_drain reads formats {list(_READABLE_FORMATS)}"
        )
    if meta["format"] >= 4 and meta.get("digest") != _digest(meta):
        raise CheckpointCorruptError(_corrupt(directory, step, "it does not match its checksum: it was edited or "
                                                                "damaged after saving"))
    if meta.get("step", step) != step:
        raise CheckpointMismatchError(
            f"checkpoint step directory {directory / str(step)} holds step {meta['step']!r} (its description "
            "records it): it was renamed by hand. Rename it back, or move it out of the checkpoint directory")
    leaves = meta.get("leaves")
    if not (isinstance(meta.get("fingerprint"), str) and isinstance(meta.get("layouts"), list)
            and isinstance(leaves, list) and all(isinstance(x, list) and len(x) == 4 for x in leaves)):
        raise CheckpointCorruptError(_corrupt(directory, step, "its fingerprint, layouts or leaves are missing or malformed"))
    return meta


def _corrupt(directory: pathlib.Path, step: int, reason: str) -> str:
    others = [s for s in _steps(directory) if s != step]
    return (
        f"checkpoint step directory {directory / str(step)} is damaged: its description "
        f"{directory / str(step) / _META / _META_FILE} is unreadable ({reason}); the save did not "
        "finish or the file was changed since. "
        + (f"Restore another step (step=..., saved: {others}) or remove that step directory."
           if others else f"No other step is saved in {directory}; remove that step directory to save there again.")
    )


def _array_keys(paths: list[str]) -> list[str]:
    # Orbax names each array by its key; keep them readable and filesystem-safe.
    keys = [re.sub(r"[^A-Za-z0-9_.-]", "_", p.replace("/", ".")) or "leaf" for p in paths]
    if len(set(keys)) != len(keys):
        keys = [f"{i:05d}.{k}" for i, k in enumerate(keys)]
    return keys


def _differences(saved: dict[str, Any], wanted: dict[str, Any], limit: int = 6) -> str:
    """A short human-readable diff of two state descriptions."""
    have = {path: (shape, dtype) for _, path, shape, dtype in saved["leaves"]}
    want = {path: (shape, dtype) for _, path, shape, dtype in wanted["leaves"]}
    notes = []
    missing = [p for p in want if p not in have]
    unexpected = [p for p in have if p not in want]
    if missing:
        notes.append(f"{len(missing)} leaves missing from the checkpoint (e.g. {missing[:3]})")
    if unexpected:
        notes.append(f"{len(unexpected)} leaves only in the checkpoint (e.g. {unexpected[:3]})")
    for path in want:
        if path in have and have[path] != want[path]:
            (s1, d1), (s2, d2) = have[path], want[path]
            notes.append(f"{path!r} is {d1}{s1} in the checkpoint, {d2}{s2} here")
            if len(notes) >= limit:
                break
    have_layouts = [x["fingerprint"] for x in saved["layouts"]]
    want_layouts = [x["fingerprint"] for x in wanted["layouts"]]
    if have_layouts != want_layouts:
        notes.append(
            f"bucket layout fingerprints differ (checkpoint {have_layouts}, here {want_layouts}): "
            "another bucket_size, bucket order or mesh"
        )
    return "; ".join(notes) or "the state structures differ"
