"""Multi-process: 2 processes x 4 CPU devices under jax.distributed (gloo) == 1 process x 8.

The test starts and stops its processes itself (localhost, a free port, a timeout) and fails
with the failing process's stderr instead of hanging. ``pytest -k multiprocess`` selects it.
"""

import time

import numpy as np
import pytest

from jax_drain.testing import multiprocess as worker

# Generous for 2 shared cores: the run itself takes ~15 s.
TIMEOUT_S = 240


def test_multiprocess_two_processes_match_one_process(tmp_path, cpu_devices):
    start = time.monotonic()
    stdouts = worker.launch_local(2, 4, tmp_path, timeout=TIMEOUT_S)
    assert all("8 devices" in out for out in stdouts), stdouts
    reference = worker.run(cpu_devices)  # this process's 8 devices, the same meshes and data
    assert {k.split("/")[0] for k in reference} == {"sync", "opt"}
    assert sum(k.startswith("sync/shard") for k in reference) >= 2
    for i in range(2):
        got = dict(np.load(tmp_path / f"process{i}.npz"))
        assert worker.compare(got, reference) == [], f"process {i}"
    # Shards, parameters and master weights bit for bit (compare's rule); the optimizer moved them.
    first, last = reference["opt/loss0"], reference["opt/loss2"]
    assert last < first and np.all(np.isfinite(reference["opt/params/w1"]))
    print(f"multiprocess run + reference: {time.monotonic() - start:.1f} s")


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
