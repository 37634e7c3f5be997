"""Where a described bucket layout puts each parameter element, on the host.

A :class:`~jax_drain.chain.ChainedSync`'s description (``sync.description``, saved in every
checkpoint) says for each chain and bucket which runs of which parameter's local block lie where.
Its global shard arrays (one per bucket, ``[*layers, spec ranks * padded]``) hold, for each rank
along the chain's spec axes (major first), that rank's whole padded bucket; a ``data_major`` chain
stores them ``[data rank, spec rank, shard]`` instead.

:func:`param_placements` turns a description into, per parameter, the runs of stored positions
its elements occupy. Reading a parameter (:func:`read_param`) or writing one
(:func:`write_param`) then touches only those runs, through a callback, so a checkpoint moves
between layouts one parameter at a time, reading slices from disk and writing into the blocks a
process holds. :func:`host_to_params` and :func:`host_from_params` are the same rule over whole
arrays in memory.

Example::

    placements = param_placements(sync.description)
    w = read_param(placements["w"], lambda i, lo, hi: shards[i][..., lo:hi])
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np

Description = list[dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Run:
    """Stored positions ``[lo, hi)`` along the last axis of shard array ``array`` (flat order
    over the description's chains and buckets): a block's flat elements ``[start, start + hi - lo)``."""

    array: int
    lo: int
    hi: int
    start: int


@dataclasses.dataclass(frozen=True)
class Block:
    """One spec rank's local block of a parameter: its place in the global array and its runs."""

    index: tuple[slice, ...]
    shape: tuple[int, ...]
    runs: tuple[Run, ...]


@dataclasses.dataclass(frozen=True)
class ParamPlacement:
    """Where one parameter's elements lie: ``rows`` leading layer dimensions (a scanned stack's),
    the global shape (rows included) and one :class:`Block` per spec rank."""

    global_shape: tuple[int, ...]
    rows: int
    blocks: tuple[Block, ...]


def shard_array_shapes(description: Description) -> list[tuple[int, ...]]:
    """The global shape of each shard array the description lays out (flat order)."""
    return [(*_rows(chain), math.prod(chain["spec_sizes"]) * padded)
            for chain in description for _, padded, _ in chain["buckets"]]


def param_placements(description: Description) -> dict[str, ParamPlacement]:
    """Every described parameter's :class:`ParamPlacement`, by path."""
    runs: dict[str, dict[int, list[Run]]] = {}
    meta: dict[str, tuple] = {}
    array = 0
    for chain in description:
        sizes = dict(zip(chain["spec_axes"], chain["spec_sizes"]))
        rows = _rows(chain)
        ranks = _spec_ranks(chain)
        for _, padded, pieces in chain["buckets"]:
            for r in range(len(ranks)):
                for path, shape, _, offset, spec, global_shape, start, size in pieces:
                    lo = r * padded + offset
                    runs.setdefault(path, {}).setdefault(r, []).extend(
                        Run(array, a, b, start + a_in - lo)
                        for a, b, a_in in _stored(chain, padded, lo, lo + size))
                    meta[path] = (chain, rows, tuple(shape), spec, tuple(global_shape), sizes, ranks)
            array += 1
    out = {}
    for path, per_rank in runs.items():
        chain, rows, shape, spec, global_shape, sizes, ranks = meta[path]
        local = (*rows, *shape)
        out[path] = ParamPlacement(global_shape, len(rows), tuple(
            Block(_block(spec, local, ranks[r], sizes), local, tuple(r_runs)) for r, r_runs in sorted(per_rank.items())))
    return out


def read_param(placement: ParamPlacement, read: Callable[[int, int, int], np.ndarray], dtype: Any = None) -> np.ndarray:
    """A parameter's global array from its runs: ``read(array, lo, hi)`` returns
    ``shard_array[..., lo:hi]``. A block several spec ranks hold alike is read once, and a
    block that is the whole parameter is read straight into it."""
    out = None
    seen = set()
    for block in placement.blocks:
        key = _key(block.index)
        if key in seen:
            continue
        seen.add(key)
        for run in block.runs:
            values = np.asarray(read(run.array, run.lo, run.hi))
            if out is None:
                out = np.zeros(placement.global_shape, dtype or values.dtype)
            if run is block.runs[0]:
                # A view of ``out`` where the block is contiguous in it, else a copy put back below.
                flat = out[block.index].reshape(*block.shape[:placement.rows], -1)
            flat[..., run.start:run.start + run.hi - run.lo] = values
        if not np.shares_memory(flat, out):
            out[block.index] = flat.reshape(block.shape)
    return out


def write_param(placement: ParamPlacement, value: np.ndarray, write: Callable[[int, int, int, np.ndarray], None]) -> None:
    """Writes a parameter's global array ``value`` into its runs: ``write(array, lo, hi, values)``
    stores ``values`` (``[*rows, hi - lo]``) at ``shard_array[..., lo:hi]``."""
    value = np.asarray(value)
    if tuple(value.shape) != placement.global_shape:
        raise ValueError(f"expected a parameter of shape {placement.global_shape}, got {value.shape}")
    for block in placement.blocks:
        flat = value[block.index].reshape(*block.shape[:placement.rows], -1)
        for run in block.runs:
            write(run.array, run.lo, run.hi, flat[..., run.start:run.start + run.hi - run.lo])


def host_to_params(description: Description, buckets: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """Per-parameter global arrays (by path) from global shard arrays laid out as ``description``
    says (flat order), on the host: how a sync's shards become whole parameters."""
    shapes = shard_array_shapes(description)
    if len(shapes) != len(buckets):
        raise ValueError(f"the description has {len(shapes)} buckets, got {len(buckets)} arrays")
    arrays = [np.asarray(b) for b in buckets]
    return {path: read_param(placement, lambda i, lo, hi: arrays[i][..., lo:hi])
            for path, placement in param_placements(description).items()}


def host_from_params(description: Description, params: dict[str, np.ndarray], dtype: Any) -> list[np.ndarray]:
    """Inverse of :func:`host_to_params`: global shard arrays (flat order, padding zero) in
    ``dtype`` for the layout ``description`` says, from per-parameter arrays by path."""
    out = [np.zeros(shape, dtype) for shape in shard_array_shapes(description)]

    def write(i: int, lo: int, hi: int, values: np.ndarray) -> None:
        out[i][..., lo:hi] = values

    for path, placement in param_placements(description).items():
        if path not in params:
            raise KeyError(f"no array for parameter {path!r}")
        write_param(placement, params[path], write)
    return out


def _rows(chain: dict[str, Any]) -> tuple[int, ...]:
    return () if chain["num_layers"] is None else (chain["num_layers"],)


def _spec_ranks(chain: dict[str, Any]) -> list[dict[str, int]]:
    """Each rank along a described chain's spec axes, major first: ``{axis: coordinate}``."""
    sizes = chain["spec_sizes"]
    return [dict(zip(chain["spec_axes"], np.unravel_index(r, sizes))) if sizes else {}
            for r in range(math.prod(sizes))]


def _block(spec: list, local_shape: Sequence[int], coords: dict[str, int], sizes: dict[str, int]) -> tuple:
    """The global-array index of one rank's local block of a parameter."""
    index = []
    for entry, size in zip(spec + [None] * (len(local_shape) - len(spec)), local_shape):
        if entry is None:
            index.append(slice(None))
            continue
        k = 0
        for axis in entry:  # the entry's axes split the dimension, first major
            k = k * sizes[axis] + int(coords[axis])
        index.append(slice(k * size, (k + 1) * size))
    return tuple(index)


def _stored(chain: dict[str, Any], padded: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Positions ``[lo, hi)`` of the spec-rank-major form (every spec rank's whole bucket in
    turn) as stored runs ``(a, b, lo_of_run)``: the same for most chains; a ``data_major``
    chain stores ``[data rank, spec rank, shard]``, so the range splits at each shard."""
    if not chain.get("data_major"):
        return [(lo, hi, lo)]
    spec_ranks, shard = math.prod(chain["spec_sizes"]), padded // chain["axis_size"]
    out = []
    q = lo
    while q < hi:
        s, d, j = q // padded, (q % padded) // shard, q % shard
        end = min(hi, q + shard - j)
        a = (d * spec_ranks + s) * shard + j
        out.append((a, a + end - q, q))
        q = end
    return out


def _key(index: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop) for s in index)
