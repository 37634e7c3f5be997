"""Orbax checkpoints of a train state (replicated params + sharded optimizer state).

A checkpoint directory holds one orbax step directory per saved step. Each stores the state's
arrays (each with its sharding: optimizer shards are written and read shard by shard) and a JSON
description: every leaf's path, shape and dtype plus the bucket-layout fingerprint of each
:class:`~jax_drain.optimizer.DistState` in it. Restoring compares that description with the
target state *before* reading any array, so a checkpoint of another model, bucket size or
data-axis size gives an error that says what differs; saving into a directory that holds
another model's checkpoints, or over an existing step, is refused before anything is written.

Example::

    step = jd.make_train_step(model, loss_fn, tx, mesh, config)
    state = step.init()
    ...
    jd.save_checkpoint("/ckpt/run1", state, extra={"data_position": 1234})

    # later, in a fresh process:
    step = jd.make_train_step(model, loss_fn, tx, mesh, config)
    state, extra = jd.restore_checkpoint("/ckpt/run1", step.abstract_state())
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
from typing import Any

import jax
import numpy as np

from jax_drain.layout import leaf_paths
from jax_drain.optimizer import DistState

PyTree = Any

FORMAT_VERSION = 2
_STATE, _META = "state", "jax_drain"
_META_FILE = "metadata"  # the file orbax's JsonSave writes the description to, in the _META item


class CheckpointMismatchError(ValueError):
    """A checkpoint (or checkpoint directory) belongs to a different model or bucket layout."""


class CheckpointCorruptError(CheckpointMismatchError):
    """A checkpoint step's description is missing, truncated or not what jax_drain writes."""


def state_description(state: PyTree) -> dict[str, Any]:
    """What a checkpoint records about ``state`` besides the arrays (JSON-serialisable).

    ``leaves``: ``[key, path, shape, dtype]`` per leaf (``jax.tree.leaves`` order);
    ``layouts``: the fingerprints of the ``DistState``s in it; ``fingerprint``: a hash of both.
    """
    paths = leaf_paths(state)
    leaves = jax.tree.leaves(state)
    keys = _array_keys(paths)
    described = [
        [key, path, list(np.shape(x)), str(np.dtype(x.dtype))] for key, path, x in zip(keys, paths, leaves)
    ]
    layouts = [
        s.fingerprint
        for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, DistState))
        if isinstance(s, DistState)
    ]
    digest = hashlib.sha256(json.dumps([described, layouts]).encode()).hexdigest()[:16]
    return {"format": FORMAT_VERSION, "fingerprint": digest, "layouts": layouts, "leaves": described}


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest saved step in ``directory``, or ``None`` if it holds no checkpoint."""
    steps = _steps(pathlib.Path(directory))
    return steps[-1] if steps else None


def save_checkpoint(
    directory: str | os.PathLike,
    state: PyTree,
    *,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
    max_to_keep: int | None = None,
) -> pathlib.Path:
    """Saves ``state`` as step ``step`` of ``directory``; returns the step's directory.

    Args:
        directory: the run's checkpoint directory (created if missing).
        state: any pytree of ``jax.Array``s, typically a :class:`~jax_drain.TrainState`.
        step: the step number; defaults to ``state.step``.
        extra: JSON-serialisable data stored alongside (e.g. the data loader's position).
        max_to_keep: keep only this many newest steps (older ones are deleted after saving).

    Raises:
        CheckpointMismatchError: ``directory`` holds checkpoints of a different state layout.
        FileExistsError: step ``step`` is already saved. Nothing is written in either case.
    """
    directory = pathlib.Path(directory).absolute()
    if step is None:
        if not hasattr(state, "step"):
            raise ValueError("pass step=...: the state has no .step field")
        step = int(jax.device_get(state.step))
    step = int(step)
    description = state_description(state)
    existing = _steps(directory)
    if existing:
        saved = _read_description(directory, existing[-1])
        if saved["fingerprint"] != description["fingerprint"]:
            raise CheckpointMismatchError(
                f"{directory} holds checkpoints of a different model or layout (step "
                f"{existing[-1]}): {_differences(saved, description)}. Nothing was written; save "
                "this run to a new directory."
            )
    if step in existing:
        raise FileExistsError(
            f"{directory} already has step {step}; nothing was overwritten. Save under another step "
            "or delete that step's directory first."
        )
    json.dumps(extra or {})  # fail before writing anything if extra is not JSON-serialisable
    keys = [leaf[0] for leaf in description["leaves"]]
    arrays = dict(zip(keys, jax.tree.leaves(state)))
    meta = {**description, "step": step, "extra": extra or {}}
    ocp = _orbax()
    options = ocp.CheckpointManagerOptions(
        create=True, max_to_keep=max_to_keep, enable_async_checkpointing=False
    )
    with ocp.CheckpointManager(directory, options=options) as manager:
        manager.save(step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(arrays), _META: ocp.args.JsonSave(meta),
        }))
        manager.wait_until_finished()
    return directory / str(step)


def restore_checkpoint(
    directory: str | os.PathLike, target: PyTree, *, step: int | None = None
) -> tuple[PyTree, dict[str, Any]]:
    """Restores step ``step`` (default: the latest) of ``directory`` into ``target``'s layout.

    Args:
        directory: a directory written by :func:`save_checkpoint`.
        target: the state to restore into: arrays or ``jax.ShapeDtypeStruct``s *with shardings*,
            e.g. ``train_step.abstract_state()``. Only structure, shapes, dtypes and shardings
            are read; ``target`` itself is not modified.
        step: which saved step; ``None`` for the newest.

    Returns:
        ``(state, extra)``: the restored state (``target``'s tree, arrays placed with
        ``target``'s shardings) and the ``extra`` dict given to :func:`save_checkpoint`.

    Raises:
        FileNotFoundError: no such checkpoint.
        CheckpointMismatchError: the checkpoint was saved from a different model or layout.
    """
    directory = pathlib.Path(directory).absolute()
    steps = _steps(directory)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {directory}")
    step = steps[-1] if step is None else int(step)
    if step not in steps:
        raise FileNotFoundError(f"{directory} has no step {step}; saved steps: {steps}")
    saved = _read_description(directory, step)
    wanted = state_description(target)
    if saved["fingerprint"] != wanted["fingerprint"]:
        raise CheckpointMismatchError(
            f"checkpoint {directory / str(step)} does not match the target state: "
            f"{_differences(saved, wanted)}. Restore it with the model, bucket_size and mesh it "
            "was saved with."
        )
    leaves, treedef = jax.tree.flatten(target)
    abstract = {}
    for (key, path, _, _), leaf in zip(wanted["leaves"], leaves):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            raise ValueError(
                f"target leaf {path!r} has no sharding; pass arrays or ShapeDtypeStructs with "
                "shardings, e.g. train_step.abstract_state()"
            )
        abstract[key] = jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)
    ocp = _orbax()
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True)) as manager:
        restored = manager.restore(step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(abstract)}))
    arrays = restored[_STATE]
    state = jax.tree.unflatten(treedef, [arrays[key] for key, *_ in wanted["leaves"]])
    return state, saved.get("extra", {})


# -- internals ----------------------------------------------------------------------------------


def _orbax():
    import orbax.checkpoint as ocp  # imported on use: it is slow to import

    return ocp


def _steps(directory: pathlib.Path) -> list[int]:
    # Finished orbax steps only: in-progress saves live in temporary, non-numeric directories.
    if not directory.is_dir():
        return []
    return sorted(
        int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit() and (p / _META).is_dir()
    )


def _read_description(directory: pathlib.Path, step: int) -> dict[str, Any]:
    ocp = _orbax()
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True)) as manager:
        try:
            meta = manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
        except (ValueError, OSError) as e:  # JSONDecodeError, UnicodeDecodeError, FileNotFoundError
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise CheckpointCorruptError(_corrupt(directory, step, reason)) from e
    if not isinstance(meta, dict) or "format" not in meta:
        raise CheckpointCorruptError(_corrupt(directory, step, f"not a jax_drain description: {str(meta)[:60]!r}"))
    if meta["format"] != FORMAT_VERSION:
        raise CheckpointMismatchError(
            f"checkpoint step {step} in {directory} has format {meta.get('format')!r}; this "
            f"jax_drain reads format {FORMAT_VERSION}"
        )
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
    if saved["layouts"] != wanted["layouts"]:
        notes.append(
            f"bucket layout fingerprints differ (checkpoint {saved['layouts']}, here "
            f"{wanted['layouts']}): another bucket_size, bucket order or data-axis size"
        )
    return "; ".join(notes) or "the state structures differ"
