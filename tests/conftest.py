"""Test setup: 8 virtual CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# JAX_DRAIN_TEST_PLATFORM=gpu (or cuda, rocm) also brings up the real accelerators, for
# tests/test_gpu_devices.py. CPU stays first, the default backend, so other tests are unchanged.
_ACCELERATOR = os.environ.get("JAX_DRAIN_TEST_PLATFORM", "cpu").lower()
_ACCELERATOR = "cuda" if _ACCELERATOR == "gpu" else _ACCELERATOR
os.environ["JAX_PLATFORMS"] = "cpu" if _ACCELERATOR == "cpu" else f"cpu,{_ACCELERATOR}"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402


@pytest.fixture(scope="session")
def cpu_devices():
    devices = jax.devices("cpu")
    assert len(devices) == 8, "tests expect 8 virtual CPU devices"
    return devices


def data_mesh(n: int = 8, axis: str = "data") -> Mesh:
    """A 1-D mesh over the first ``n`` CPU devices."""
    return Mesh(np.array(jax.devices("cpu")[:n]), (axis,))
