"""Reading a checkpoint with the host memory of one process's shards.

:class:`SavedArrays` reads a saved step's arrays in slices (tensorstore, straight from the
files orbax wrote), so a process reads only the blocks its devices hold, or, moving onto another
layout, only the runs of the parameters its target blocks need.
:class:`LocalBlocks` holds the blocks of one target array that this process's devices hold,
filled piece by piece, and becomes a ``jax.Array`` without any process holding the whole array.
:func:`verify_parts` yields the index boxes a process checks a saved array's checksum over:
each process its share, so together they read every element once.

Example::

    source = SavedArrays(step_dir / "state", description["leaves"])
    blocks = LocalBlocks(shape, dtype, sharding)
    blocks.write_last(0, 128, source.read_last("opt_state/master/0", 0, 128))
    array = blocks.array()
"""

from __future__ import annotations

import math
import pathlib
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np


class UnreadableArray(ValueError):
    """A saved array's files could not be read or decoded; ``path`` names the array."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


class SavedArrays:
    """The arrays of one saved item (orbax's zarr directories, one per array), by leaf path.

    ``leaves``: the state description's ``[key, path, shape, dtype]`` entries."""

    def __init__(self, item: pathlib.Path, leaves: Sequence[Sequence[Any]]):
        self._item = item
        self._leaves = {path: (key, tuple(shape), dtype) for key, path, shape, dtype in leaves}
        self._stores: dict[str, Any] = {}

    def key(self, path: str) -> str:
        """The array's directory name in the item."""
        return self._leaves[path][0]

    def shape(self, path: str) -> tuple[int, ...]:
        return self._leaves[path][1]

    def read(self, path: str, index: tuple = ()) -> np.ndarray:
        """``array[index]`` read from disk (only the chunks it touches)."""
        try:
            store = self._stores[path] if path in self._stores else self._open(path)
            return np.asarray(store[index].read().result())
        except UnreadableArray:
            raise
        except Exception as e:  # noqa: BLE001 - tensorstore's errors name the file
            raise UnreadableArray(path, _first_line(e)) from e

    def read_last(self, path: str, lo: int, hi: int) -> np.ndarray:
        """``array[..., lo:hi]``."""
        return self.read(path, (*(slice(None),) * (len(self.shape(path)) - 1), slice(lo, hi)))

    def _open(self, path: str) -> Any:
        import tensorstore as ts  # orbax's own storage layer

        # A missing chunk file is damage, not zeros.
        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(self._item / self.key(path))},
                "fill_missing_data_reads": False}
        store = ts.open(spec, open=True, read=True).result()
        if tuple(store.shape) != self.shape(path):
            raise UnreadableArray(path, f"its files hold shape {tuple(store.shape)}, the description {self.shape(path)}")
        self._stores[path] = store
        return store


class LocalBlocks:
    """The blocks of a global array of ``shape`` that this process's devices hold under
    ``sharding`` (one per distinct index), zero until written; :meth:`array` makes the
    ``jax.Array``. ``devices``: only these devices' blocks (default: every addressable one)."""

    def __init__(self, shape: Sequence[int], dtype: Any, sharding: jax.sharding.Sharding, *,
                 devices: Sequence[Any] | None = None):
        self.shape, self.dtype, self.sharding = tuple(shape), dtype, sharding
        self._blocks: dict[tuple, tuple[tuple[slice, ...], np.ndarray]] = {}
        indices = sharding.addressable_devices_indices_map(self.shape)
        for device, index in indices.items():
            if devices is not None and device not in devices:
                continue
            index = _normalized(index, self.shape)
            if _key(index) not in self._blocks:
                self._blocks[_key(index)] = (index, np.zeros([s.stop - s.start for s in index], dtype))

    def holds(self, lo: int, hi: int) -> bool:
        """Whether any block overlaps positions ``[lo, hi)`` of the last axis."""
        return any(index[-1].start < hi and lo < index[-1].stop for index, _ in self._blocks.values())

    def write_last(self, lo: int, hi: int, values: np.ndarray) -> None:
        """Stores ``values`` (the whole array's leading dimensions, ``hi - lo`` last) at
        ``array[..., lo:hi]``: the part of it each block holds."""
        for index, block in self._blocks.values():
            first, last = index[-1].start, index[-1].stop
            a, b = max(lo, first), min(hi, last)
            if a < b:
                block[..., a - first:b - first] = values[(*index[:-1], slice(a - lo, b - lo))]

    def fill(self, read: Callable[[tuple[slice, ...]], np.ndarray]) -> None:
        """Every block from ``read(index)`` (``array[index]`` of the source), kept as read
        where it has the block's shape and dtype."""
        for key, (index, block) in self._blocks.items():
            values = np.asarray(read(index))
            if values.shape == block.shape and values.dtype == block.dtype:
                self._blocks[key] = (index, values)
            else:
                block[...] = values

    def block(self, index: tuple) -> np.ndarray:
        """The block at ``index`` (as the sharding gives it)."""
        return self._blocks[_key(_normalized(index, self.shape))][1]

    def array(self) -> jax.Array:
        return jax.make_array_from_callback(self.shape, self.sharding, self.block)


def verify_parts(shape: Sequence[int], part: int, parts: int, chunk: int) -> Iterator[tuple[slice, ...]]:
    """Index boxes of an array of ``shape`` for process ``part`` of ``parts`` to check: its
    share of the leading axis (a scalar: process 0), at most about ``chunk`` elements each."""
    shape = tuple(shape)
    if not shape:
        if part == 0:
            yield ()
        return
    lo, hi = shape[0] * part // parts, shape[0] * (part + 1) // parts
    rest = lambda k: tuple(slice(0, n) for n in shape[k:])  # noqa: E731
    row = math.prod(shape[1:])
    if row <= chunk or len(shape) == 1:
        step = max(1, chunk // max(row, 1))
        for r in range(lo, hi, step):
            yield (slice(r, min(hi, r + step)), *rest(1))
        return
    across = max(1, chunk // max(math.prod(shape[2:]), 1))
    for r in range(lo, hi):
        for c in range(0, shape[1], across):
            yield (slice(r, r + 1), slice(c, min(shape[1], c + across)), *rest(2))


def _normalized(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _key(index: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop) for s in index)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__
