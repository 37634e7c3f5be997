"""Test setup: 8 virtual CPU devices, set before jax is imported anywhere; the gpu_compile gate.

Tests marked ``gpu_compile`` need the CUDA PJRT plugin (compile-only GPU devices). Without a
usable plugin they skip with the reason, unless ``CI=true`` or ``JAX_DRAIN_REQUIRE_GPU_COMPILE=1``
is set: then they fail, so that CI never passes with them silently skipped.
"""

import atexit
import functools
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# JAX_DRAIN_TEST_PLATFORM=gpu (or cuda, rocm) also brings up the real accelerators, for
# tests/test_gpu_devices.py. CPU stays first, the default backend, so other tests are unchanged.
_ACCELERATOR = os.environ.get("JAX_DRAIN_TEST_PLATFORM", "cpu").lower()
_ACCELERATOR = "cuda" if _ACCELERATOR == "gpu" else _ACCELERATOR
# LLVM's optimisation of the generated machine code at level 1, not 2: the suite's small
# programs spend far longer in LLVM than running (test_sync.py: 68 s at level 2, 44 s at 1).
# Values are IEEE arithmetic at any level (no fast math either way), and XLA's GPU buffer
# assignment, schedule and predicted times are made on HLO before any code is generated
# (tests/test_gpu_targets.py compares them with and without). Level 0 is not used: its code
# differs from level 2's in the last bit where two programs of one computation (ZeRO-1 and
# ZeRO-3 on a tensor-parallel mesh) agree bit for bit at levels 1 and 2. Subprocesses inherit it.
if _ACCELERATOR == "cpu" and "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=1"
# XLA:CPU's older elemental emitters, not its MLIR fusion emitters: the same IEEE arithmetic,
# generated for far less compile time (test_zero3.py, test_pipeline.py and test_feedback.py in
# one process: 408 s with the fusion emitters, 283 s without). CPU code generation only: the GPU
# compiler's assignment, schedule and prices do not read it (tests/test_gpu_targets.py checks).
if _ACCELERATOR == "cpu" and "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
os.environ["JAX_PLATFORMS"] = "cpu" if _ACCELERATOR == "cpu" else f"cpu,{_ACCELERATOR}"

# One persistent compilation cache per run, shared by the xdist workers (they inherit the
# controller's environment): many tests build the same small steps, and XLA:CPU compiles
# dominate the suite. Keyed by the program and the compile options, so a hit is the program
# XLA would compile; a fresh directory per run keeps nothing between runs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="jax_drain_tests_cache_")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax_drain  # noqa: E402,F401  (before jax: no CUDA-plugin start-up lines on a machine without a GPU)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

REQUIRE_GPU_COMPILE = (
    os.environ.get("CI", "").lower() in ("true", "1")
    or os.environ.get("JAX_DRAIN_REQUIRE_GPU_COMPILE", "") == "1"
)


@functools.cache
def gpu_compile_problem() -> str | None:
    """Why compile-only GPU devices cannot be created here (one line), or None if they can."""
    from jax_drain.planner.targets import GpuCompileUnavailable, require_gpu_compile

    try:
        require_gpu_compile()
    except GpuCompileUnavailable as e:
        return str(e)
    return None


def require_gpu_compile() -> None:
    """Skip the running test without a usable CUDA PJRT plugin; in CI, fail it instead."""
    problem = gpu_compile_problem()
    if problem is None:
        return
    if REQUIRE_GPU_COMPILE:
        pytest.fail(f"gpu_compile test not skipped (CI=true or JAX_DRAIN_REQUIRE_GPU_COMPILE=1): {problem}",
                    pytrace=False)
    pytest.skip(f"gpu_compile: {problem}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # tryfirst: before the test's fixtures, which may already compile for the GPU target.
    if item.get_closest_marker("gpu_compile") is not None:
        require_gpu_compile()


def pytest_terminal_summary(terminalreporter):
    """Say why tests skipped, per kind, so that no kind of skip goes unnoticed."""
    skipped = terminalreporter.stats.get("skipped", [])
    kinds = {
        "gpu_compile": "need the CUDA PJRT plugin (CI=true or JAX_DRAIN_REQUIRE_GPU_COMPILE=1 fails them)",
        "gpu": "need real GPUs (JAX_DRAIN_TEST_PLATFORM=gpu on a multi-GPU host)",
        "public_model": "need a public model's source (JAX_DRAIN_FLAX_EXAMPLES=<a flax checkout>, "
                        "JAX_DRAIN_EASYLM=<an EasyLM checkout> with its imports)",
    }
    for marker, why in kinds.items():
        n = sum(1 for r in skipped if marker in r.keywords)
        if n:
            terminalreporter.write_line(f"jax_drain: {n} {marker} tests skipped: they {why}")
    if any("gpu_compile" in r.keywords for r in skipped):
        terminalreporter.write_line(f"jax_drain: {gpu_compile_problem()}")


@pytest.fixture(scope="session")
def cpu_devices():
    devices = jax.devices("cpu")
    assert len(devices) == 8, "tests expect 8 virtual CPU devices"
    return devices


def data_mesh(n: int = 8, axis: str = "data") -> Mesh:
    """A 1-D mesh over the first ``n`` CPU devices."""
    return Mesh(np.array(jax.devices("cpu")[:n]), (axis,))
