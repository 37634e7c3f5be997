"""jax_drain.planner.targets: shipped target configs, topologies, compile-only devices and meshes."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jax_drain.planner import plan, targets
from jax_drain.planner.targets import (
    KNOWN_TARGETS,
    GpuCompileUnavailable,
    gpu_compile_available,
    gpu_devices,
    gpu_mesh,
    parse_topology,
    target_config,
)
from jax_drain.planner.schedule import parse_schedule, replica_group_size


def config_field(text: str, field: str) -> str:
    (value,) = re.findall(rf"^\s*{field}:\s*(.+?)\s*$", text, flags=re.M)
    return value


@pytest.mark.parametrize(
    "name, cores, major, bandwidth, l2, description",
    [
        ("h100", 132, 9, 3352320000000, 50 * 2**20, "NVIDIA H100 80GB HBM3"),
        ("h200", 132, 9, 4800000000000, 60 * 2**20, "NVIDIA H200"),
        ("a100", 108, 8, 2039000000000, 40 * 2**20, "NVIDIA A100-SXM4-80GB"),
    ],
)
def test_shipped_configs_describe_their_gpu(name, cores, major, bandwidth, l2, description):
    text = target_config(name)
    assert int(config_field(text, "core_count")) == cores
    assert int(re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)", text).group(1)) == major
    assert int(config_field(text, "memory_bandwidth")) == bandwidth
    assert int(config_field(text, "l2_cache_size")) == l2
    assert config_field(text, "device_description_str") == f'"{description}"'


def test_shipped_configs_share_the_h100_field_set():
    def fields(text):
        return sorted(re.findall(r"^\s*(\w+)\s*[:{]", text, flags=re.M))

    reference = fields(target_config("h100"))
    assert set(KNOWN_TARGETS) == {"h100", "h200", "a100"}
    for name in KNOWN_TARGETS:
        assert fields(target_config(name)) == reference, name


@pytest.mark.parametrize("alias", ["H100", "h100_80gb", " h100 ", "H100_80GB.pbtxt", "h100-80gb"])
def test_target_aliases(alias):
    assert target_config(alias) == target_config("h100")


def test_unknown_target_names_the_known_ones():
    with pytest.raises(ValueError, match="a100, h100, h200"):
        target_config("v100")


def test_target_config_reads_a_pbtxt_path(tmp_path):
    path = tmp_path / "my_gpu.pbtxt"
    path.write_text(target_config("a100").replace('"NVIDIA A100-SXM4-80GB"', '"My GPU"'))
    assert config_field(target_config(str(path)), "device_description_str") == '"My GPU"'


@pytest.mark.parametrize(
    "topology, expected",
    [("1x1x8", (1, 1, 8)), ("1x2x8", (1, 2, 8)), ("2X1x4", (2, 1, 4)), (4, (1, 1, 4)), ("8", (1, 1, 8))],
)
def test_parse_topology(topology, expected):
    assert parse_topology(topology) == expected


@pytest.mark.parametrize(
    "topology", ["1x8", "1x1x8x1", "0x1x8", "1x1x0", "1x1x-8", "axbxc", "1x1x2.5", "", 0, -3, True, 2.0]
)
def test_parse_topology_rejects_malformed(topology):
    with pytest.raises(ValueError, match="<slices>x<hosts per slice>x<gpus per host>"):
        parse_topology(topology)


def _no_topology(monkeypatch, plugin_installed: bool):
    def unavailable(*args, **kwargs):
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(targets.topologies, "get_topology_desc", unavailable)
    monkeypatch.setattr(targets, "_plugin_installed", lambda: plugin_installed)


def test_missing_plugin_error_says_what_to_install(monkeypatch):
    _no_topology(monkeypatch, plugin_installed=False)
    with pytest.raises(GpuCompileUnavailable) as info:
        gpu_devices("a100", "1x1x3")  # a pair no other test caches
    message = str(info.value)
    assert "pip install -e '.[gpu-compile]'" in message and f"jax version {jax.__version__}" in message
    assert "jax-cuda12-plugin" in message and "\n" not in message
    with pytest.raises(GpuCompileUnavailable, match="jax-cuda12-plugin"):
        gpu_mesh((3,), ("data",), target="a100")
    assert isinstance(info.value, RuntimeError)


def test_unregistered_plugin_error_says_to_set_jax_platforms(monkeypatch):
    _no_topology(monkeypatch, plugin_installed=True)
    with pytest.raises(GpuCompileUnavailable, match="JAX_PLATFORMS=cpu"):
        gpu_devices("a100", "1x1x5")


def test_no_jax_plugins_namespace_means_not_installed(monkeypatch):
    """Without any jax plugin, find_spec of the plugin's module raises instead of giving None."""
    def find_spec(name, *args):
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert targets._plugin_installed() is False


def test_gpu_compile_available_is_false_without_raising(monkeypatch):
    _no_topology(monkeypatch, plugin_installed=False)
    monkeypatch.setattr(targets, "gpu_devices", lambda *a: targets._cached_devices("a100", (1, 1, 7)))
    gpu_compile_available.cache_clear()
    try:
        assert gpu_compile_available() is False
    finally:
        gpu_compile_available.cache_clear()


@pytest.mark.gpu_compile
@pytest.mark.parametrize(
    "target, kind",
    [("h100", "NVIDIA H100 80GB HBM3"), ("H200", "NVIDIA H200"), ("a100_80gb", "NVIDIA A100-SXM4-80GB")],
)
def test_gpu_devices_are_compile_only_gpus_of_the_target(target, kind):
    devices = gpu_devices(target)
    assert [d.id for d in devices] == list(range(8))
    assert {d.device_kind for d in devices} == {kind}
    assert {d.platform for d in devices} == {"gpu"}


@pytest.mark.gpu_compile
def test_invalid_config_file_is_a_value_error(tmp_path):
    path = tmp_path / "broken.pbtxt"
    path.write_text("gpu_device_info { no_such_field: 1 }")
    with pytest.raises(ValueError, match="not valid GpuTargetConfigProto"):
        gpu_devices(str(path), 2)


@pytest.mark.gpu_compile
def test_gpu_devices_are_cached_per_target_and_topology():
    assert gpu_devices("h100", "1x1x8") == gpu_devices("H100", 8)
    assert gpu_devices("h100", 8)[0] is gpu_devices("h100_80gb", "1x1x8")[0]
    assert gpu_devices("h100", 8)[0] is not gpu_devices("h200", 8)[0]


@pytest.mark.gpu_compile
def test_multi_host_topology_process_indices():
    devices = gpu_devices("h100", "1x2x8")
    assert [d.id for d in devices] == list(range(16))
    assert [d.process_index for d in devices] == [0] * 8 + [1] * 8
    sliced = gpu_devices("h100", "2x2x4")  # every host of every slice is its own process
    assert [d.process_index for d in sliced] == [h for h in range(4) for _ in range(4)]


@pytest.mark.gpu_compile
def test_gpu_mesh_defaults_to_hosts_of_eight():
    small = gpu_mesh((2, 2), ("a", "b"), target="a100")
    assert small.devices.shape == (2, 2) and small.axis_names == ("a", "b")
    assert {d.process_index for d in small.devices.flat} == {0}
    big = gpu_mesh((2, 8), ("host", "data"))
    assert [[d.process_index for d in row] for row in big.devices] == [[0] * 8, [1] * 8]


@pytest.mark.gpu_compile
def test_gpu_mesh_rejects_mismatches():
    with pytest.raises(ValueError, match="needs 8 devices"):
        gpu_mesh((8,), ("data",), topology="1x2x8")
    with pytest.raises(ValueError, match="do not fill hosts of 8"):
        gpu_mesh((3, 5), ("a", "b"))
    with pytest.raises(ValueError, match="differ in length"):
        gpu_mesh((8,), ("a", "b"))
    with pytest.raises(ValueError, match="positive integers"):
        gpu_mesh((0, 8), ("a", "b"))


def three_scatters(x):
    return tuple(
        jax.lax.psum_scatter((x * (k + 1)).astype(jnp.float32), "data", scatter_dimension=0, tiled=True)
        for k in range(3)
    )


@pytest.mark.gpu_compile
@pytest.mark.parametrize(
    "options, combined_counts",
    [
        ({}, [3]),  # default threshold: XLA merges all three
        ({"xla_gpu_reduce_scatter_combine_threshold_bytes": 0}, [1, 1, 1]),
        # The threshold compares the combined *result* bytes (3 x 512 KiB here), inclusive.
        ({"xla_gpu_reduce_scatter_combine_threshold_bytes": 2 * 512 * 1024}, [1, 2]),
        (
            {
                "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
                "xla_gpu_enable_latency_hiding_scheduler": True,
            },
            [1, 1, 1],
        ),
    ],
    ids=["default", "threshold-0", "threshold-2-results", "threshold-0-lhs"],
)
def test_compiler_options_reach_the_gpu_compiler(options, combined_counts):
    mesh = gpu_mesh((8,), ("data",))
    fn = jax.jit(jax.shard_map(three_scatters, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    compiled = fn.lower(jax.ShapeDtypeStruct((8 * 1024, 1024), jnp.bfloat16)).compile(
        compiler_options=options
    )
    rs = [c for c in parse_schedule(compiled.as_text()).collectives if c.kind == "reduce-scatter"]
    per_result = 1024 // 8 * 1024 * 4
    assert sorted(c.bytes // per_result for c in rs) == combined_counts
    assert {c.dtype for c in rs} == {"f32"}


@pytest.mark.gpu_compile
def test_multi_host_program_compiles_across_hosts():
    mesh = gpu_mesh((16,), ("data",), topology="1x2x8", target="h200")
    fn = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum_scatter(x, "data", scatter_dimension=0, tiled=True),
            mesh=mesh, in_specs=P("data"), out_specs=P("data"),
        )
    )
    compiled = fn.lower(jax.ShapeDtypeStruct((16 * 1024, 256), jnp.float32)).compile()
    (rs,) = parse_schedule(compiled.as_text()).collectives
    assert rs.kind == "reduce-scatter" and rs.bytes == 1024 // 16 * 256 * 4
    start = parse_schedule(compiled.as_text()).computations[rs.computation][rs.start]
    assert replica_group_size(start.attributes) == 16 and rs.group_size == 16  # one group: both hosts


_PLAN_FIGURES = """
import json, sys
from jax_drain import plan
p = plan.plan_preset(plan.preset_config("tiny", layers=1, d_model=128), "fp32_accum+drain", num_buckets=4)
print(json.dumps([p.temp_bytes, p.argument_bytes, p.predicted_step_s, p.exposed_comm_s, p.buckets_in_flight]))
"""


@pytest.mark.gpu_compile
def test_the_suite_s_llvm_level_changes_no_gpu_memory_or_time():
    """tests/conftest.py turns LLVM's optimisation down and XLA:CPU's fusion emitters off for
    speed: XLA's GPU buffer assignment, schedule and prices (what the memory and time claims
    read) are the same without either."""
    speed = ("--xla_backend_optimization_level=1", "--xla_cpu_use_fusion_emitters=false")
    assert all(flag in os.environ["XLA_FLAGS"].split() for flag in speed)
    here = plan.plan_preset(plan.preset_config("tiny", layers=1, d_model=128), "fp32_accum+drain", num_buckets=4)
    flags = " ".join(f for f in os.environ["XLA_FLAGS"].split() if f not in speed)
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", _PLAN_FIGURES], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    default_level = json.loads(out.stdout.strip().splitlines()[-1])
    assert default_level == [here.temp_bytes, here.argument_bytes, here.predicted_step_s, here.exposed_comm_s,
                             here.buckets_in_flight]
