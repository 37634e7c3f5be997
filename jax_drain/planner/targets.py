"""Compile-only XLA:GPU devices: ship GPU target configs, build topologies and meshes.

XLA's GPU compiler does not need a GPU: given a ``GpuTargetConfigProto`` (device facts such as SM
count, memory size and bandwidth) the CUDA PJRT plugin creates *compile-only* devices. A program
jitted over a :class:`jax.sharding.Mesh` of those devices lowers and compiles with the real GPU
pipeline (collective combiners, latency-hiding scheduler, buffer assignment), so
``compiled.as_text()`` and ``compiled.memory_analysis()`` describe what would run on the GPUs.

Requirements: the CUDA PJRT plugin (``jax-cuda12-plugin``, module ``jax_plugins.xla_cuda12``) at
the installed jax's version: ``pip install -e '.[gpu-compile]'``; no CUDA libraries. On a machine
without a visible NVIDIA GPU, ``import jax_drain`` registers the plugin without its CUDA version
check (which would fail without CUDA libraries and only guards running on a GPU), so no
``JAX_PLATFORMS=cpu`` is needed; where jax started first, the first call here registers it. With a
GPU visible the plugin registers as jax decides. Without a usable plugin, :func:`gpu_devices`,
:func:`gpu_mesh` and everything built on them raise :class:`GpuCompileUnavailable`;
:func:`gpu_compile_available` says so without raising.

Example::

    mesh = gpu_mesh((8,), ("data",), target="h100")
    compiled = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"))).lower(
        jax.ShapeDtypeStruct((8 * 1024, 1024), jnp.bfloat16)).compile(
        compiler_options={"xla_gpu_reduce_scatter_combine_threshold_bytes": 0})
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.resources
import importlib.util
import math
import os
import types
from collections.abc import Mapping

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh

from jax_drain import _quiet

__all__ = [
    "KNOWN_TARGETS",
    "GpuCompileUnavailable",
    "gpu_compile_available",
    "gpu_devices",
    "gpu_mesh",
    "parse_topology",
    "require_gpu_compile",
    "target_config",
]

KNOWN_TARGETS: Mapping[str, str] = types.MappingProxyType(
    {
        "h100": "h100_80gb.pbtxt",
        "h200": "h200_141gb.pbtxt",
        "a100": "a100_80gb.pbtxt",
    }
)
"""Target name -> GpuTargetConfigProto text file in ``jax_drain/planner/target_configs/``."""

# One host of this many GPUs is the usual node size (DGX/HGX); used for the default topology.
GPUS_PER_HOST = 8

# The topology name is only a label for the PJRT topology; it need not be unique.
_TOPOLOGY_NAME = "jax_drain"

_TOPOLOGY_FORMAT = (
    'topology must be "<slices>x<hosts per slice>x<gpus per host>" with positive integers '
    '(e.g. "1x1x8" for one 8-GPU host, "1x2x8" for two), or an int n meaning "1x1xn"'
)


def _canonical_target(name: str) -> str:
    """Key of ``KNOWN_TARGETS`` for ``name`` ("H100", "h100_80gb", "h100_80gb.pbtxt", ...)."""
    key = name.strip().lower().replace("-", "_").removesuffix(".pbtxt")
    for known, filename in KNOWN_TARGETS.items():
        if key in (known, filename.removesuffix(".pbtxt")):
            return known
    raise ValueError(
        f"unknown GPU target {name!r}; known targets: {', '.join(sorted(KNOWN_TARGETS))} "
        "(aliases like 'h100_80gb' and any case work), or pass a path to a GpuTargetConfigProto "
        ".pbtxt file"
    )


def _is_config_path(name: str) -> bool:
    return name.endswith(".pbtxt") and os.path.isfile(name)


def target_config(name: str) -> str:
    """GpuTargetConfigProto text for a known target (case-insensitive, aliases allowed).

    A path to an existing ``.pbtxt`` file is read as is, for GPUs not shipped here.

    Example::

        >>> 'core_count: 132' in target_config("H100")
        True
    """
    if _is_config_path(name):
        with open(name, encoding="utf-8") as f:
            return f.read()
    filename = KNOWN_TARGETS[_canonical_target(name)]
    return (importlib.resources.files("jax_drain.planner") / "target_configs" / filename).read_text("utf-8")


def parse_topology(topology: str | int) -> tuple[int, int, int]:
    """``(slices, hosts per slice, gpus per host)`` of a PJRT GPU topology string.

    Example::

        >>> parse_topology("1x2x8"), parse_topology(4), parse_topology("8")
        ((1, 2, 8), (1, 1, 4), (1, 1, 8))
    """
    if isinstance(topology, bool) or not isinstance(topology, (int, str)):
        raise ValueError(f"{_TOPOLOGY_FORMAT}; got {topology!r}")
    parts = [topology] if isinstance(topology, int) else topology.strip().lower().split("x")
    if len(parts) == 1:
        parts = [1, 1, parts[0]]
    if len(parts) != 3:
        raise ValueError(f"{_TOPOLOGY_FORMAT}; got {topology!r}")
    try:
        dims = tuple(p if isinstance(p, int) else int(p.strip()) for p in parts)
    except ValueError:
        raise ValueError(f"{_TOPOLOGY_FORMAT}; got {topology!r}") from None
    if any(d <= 0 for d in dims):
        raise ValueError(f"{_TOPOLOGY_FORMAT}; got {topology!r}")
    return dims  # type: ignore[return-value]


#: The CUDA PJRT plugin: its pip distribution and the module jax discovers it by.
PLUGIN_PACKAGE = "jax-cuda12-plugin"
PLUGIN_MODULE = "jax_plugins.xla_cuda12"


class GpuCompileUnavailable(RuntimeError):
    """Compile-only GPU devices cannot be created here: the CUDA PJRT plugin is missing or unusable.

    The message is one line saying what to install or set.
    """


def _plugin_installed() -> bool:
    try:
        return importlib.util.find_spec(PLUGIN_MODULE) is not None
    except (ImportError, ValueError):  # not even the jax_plugins namespace package is installed
        return False


def _plugin_version() -> str | None:
    try:
        return importlib.metadata.version(PLUGIN_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def _unavailable(cause: BaseException) -> GpuCompileUnavailable:
    version = jax.__version__
    install = f"pip install -e '.[gpu-compile]' (or pip install 'jax[cuda12-local]=={version}')"
    if not _plugin_installed():
        return GpuCompileUnavailable(
            f"compile-only GPU devices need the CUDA PJRT plugin {PLUGIN_PACKAGE} ({PLUGIN_MODULE}) "
            f"at the installed jax version {version}, and it is not installed: {install}; no GPU "
            "or CUDA libraries are needed"
        )
    plugin = _plugin_version()
    mismatch = f", but the plugin is {plugin}" if plugin not in (None, version) else ""
    reason = " ".join(str(cause).split())
    # Installed but not registered: usually its CUDA version check failed at jax start-up.
    return GpuCompileUnavailable(
        f"the CUDA PJRT plugin {PLUGIN_PACKAGE} ({PLUGIN_MODULE}) is installed but did not "
        f"register with jax {version}{mismatch}: without CUDA libraries set JAX_PLATFORMS=cpu (or "
        "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1) before jax initialises its backends; to reinstall it "
        f"at jax's version: {install}. Cause: {reason}"
    )


def _topology(config: str, dims: tuple[int, int, int]) -> topologies.TopologyDescription:
    make = lambda: topologies.get_topology_desc(
        _TOPOLOGY_NAME, "cuda", target_config=config, topology="x".join(map(str, dims)))
    try:
        return make()
    except NotImplementedError:
        # jax started before jax_drain and its CUDA version check left the plugin unregistered;
        # without a visible GPU that check guards nothing, so register the plugin now.
        try:
            retry = _quiet.register_cuda_plugin()
        except Exception:  # noqa: BLE001 - the original error says more
            retry = False
        if not retry:
            raise
        return make()


@functools.lru_cache(maxsize=None)
def _cached_devices(config_key: str, dims: tuple[int, int, int]) -> tuple[jax.Device, ...]:
    config = target_config(config_key)
    try:
        topo = _topology(config, dims)
    except Exception as e:
        if isinstance(e, NotImplementedError) or not _plugin_installed():
            raise _unavailable(e) from e
        if not (isinstance(e, jax.errors.JaxRuntimeError) and "GpuTargetConfigProto" in str(e)):
            raise
        raise ValueError(
            f"target config {config_key!r} is not valid GpuTargetConfigProto text ({e}); start "
            "from a shipped one, e.g. jax_drain/planner/target_configs/h100_80gb.pbtxt"
        ) from e
    return tuple(topo.devices)


def gpu_devices(target: str = "h100", topology: str | int = "1x1x8") -> list[jax.Device]:
    """Compile-only GPU devices of ``target`` laid out as ``topology`` (cached per pair).

    Devices are ordered by id: host-major, so ``"1x2x8"`` gives ids 0-7 with
    ``process_index == 0`` and ids 8-15 with ``process_index == 1``. Programs over them compile as
    one SPMD program spanning all hosts.

    Raises :class:`GpuCompileUnavailable` (saying what to install or set) when the CUDA PJRT
    plugin is missing or unusable.

    Example::

        >>> [d.device_kind for d in gpu_devices("h200", 2)]
        ['NVIDIA H200', 'NVIDIA H200']
    """
    key = os.path.abspath(target) if _is_config_path(target) else _canonical_target(target)
    return list(_cached_devices(key, parse_topology(topology)))


def _default_topology(n: int) -> str:
    if n <= GPUS_PER_HOST:
        return f"1x1x{n}"
    if n % GPUS_PER_HOST:
        raise ValueError(
            f"{n} devices do not fill hosts of {GPUS_PER_HOST} GPUs; pass topology= explicitly "
            '(e.g. "1x3x4")'
        )
    return f"1x{n // GPUS_PER_HOST}x{GPUS_PER_HOST}"


def gpu_mesh(
    shape: tuple[int, ...],
    axis_names: tuple[str, ...],
    target: str = "h100",
    topology: str | int | None = None,
) -> Mesh:
    """A :class:`~jax.sharding.Mesh` of ``shape`` over compile-only GPU devices.

    ``topology=None`` means one host holding ``prod(shape)`` GPUs if that is at most 8, otherwise
    hosts of 8 (``"1x(n/8)x8"``). Devices fill the mesh in id order, so trailing axes vary fastest
    and an inner axis of size <= 8 stays within a host.

    Example::

        >>> mesh = gpu_mesh((2, 8), ("fsdp", "data"))   # two 8-GPU H100 hosts
        >>> mesh.devices[1, 0].process_index
        1
    """
    shape = tuple(shape)
    axis_names = tuple(axis_names)
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {shape} and axis names {axis_names} differ in length")
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s <= 0 for s in shape):
        raise ValueError(f"mesh shape must be positive integers; got {shape}")
    n = math.prod(shape)
    if topology is None:
        topology = _default_topology(n)
    devices = gpu_devices(target, topology)
    if len(devices) != n:
        raise ValueError(
            f"mesh shape {shape} needs {n} devices but topology {topology!r} has {len(devices)}; "
            "make the topology's slices*hosts*gpus equal the mesh size"
        )
    return Mesh(np.array(devices, dtype=object).reshape(shape), axis_names)


def require_gpu_compile() -> None:
    """Raise :class:`GpuCompileUnavailable` unless compile-only GPU devices can be created here."""
    gpu_devices("h100", 1)


@functools.lru_cache(maxsize=None)
def gpu_compile_available() -> bool:
    """Whether compile-only GPU devices can be created here (the CUDA PJRT plugin works).

    Never raises for a missing or unusable plugin. Example::

        >>> import pytest
        >>> if not gpu_compile_available(): pytest.skip("needs jax-cuda12-plugin")
    """
    try:
        require_gpu_compile()
    except GpuCompileUnavailable:
        return False
    return True
