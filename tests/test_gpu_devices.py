"""The mesh value tests of tests/test_mesh.py on real GPUs (skipped without at least two).

On a multi-GPU host::

    JAX_DRAIN_TEST_PLATFORM=gpu python -m pytest -q tests/test_gpu_devices.py

``tests/conftest.py`` then initialises the CUDA backend next to the 8 virtual CPU devices (CPU
stays the default backend). Each mesh kind -- data parallel, tensor parallel, hierarchical
(replica x data), both, expert parallel -- runs on the first 2, 4, 8, ... GPUs against the same
float64 references as on CPU: ``fp32``/``fp32_accum`` within 1e-6 relative, drained equal to
undrained bit for bit, and ``value_and_grad`` equal to the gradient of the global mean loss.
Multi-host runs use ``python -m jax_drain.testing.multiprocess`` (see BUILD.md).
"""

import jax
import pytest

import test_mesh as cases


def _gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend: CPU-only host, or JAX_DRAIN_TEST_PLATFORM unset
        return []


def _usable(devices: list) -> list:
    """2 GPUs, or the largest multiple of 4 (the mesh kinds' 2 x 2 factors)."""
    n = len(devices)
    return devices[: 2 if n < 4 else n - n % 4]


GPUS = _usable(_gpus())

pytestmark = [
    pytest.mark.gpu,  # real GPUs, not the CUDA PJRT plugin's compile-only devices (gpu_compile)
    pytest.mark.skipif(
        len(GPUS) < 2,
        reason=f"needs >= 2 GPUs visible to jax (found {len(_gpus())}); on a multi-GPU host run "
        "JAX_DRAIN_TEST_PLATFORM=gpu python -m pytest tests/test_gpu_devices.py",
    ),
]


@pytest.mark.parametrize("kind", ("dp",) + cases.KINDS)
def test_gpu_devices_reduce_scatter_matches_float64(kind):
    assert all(d.platform == "gpu" for d in GPUS)
    cases.check_values(kind, GPUS)


def test_gpu_devices_tensor_parallel_hierarchical_value_and_grad():
    cases.check_tp_end_to_end(GPUS)


def test_gpu_devices_expert_parallel_value_and_grad():
    cases.check_moe_end_to_end(GPUS)
