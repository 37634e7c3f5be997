"""The planner on compile-only GPU devices, with the tiny presets (fast)."""

import json
import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jax_drain.planner import cli, plan, targets
from jax_drain.planner.targets import GpuCompileUnavailable, gpu_mesh

TINY = plan.preset_config("tiny", layers=2, d_model=256)
OVERLAP_4 = {"xla_gpu_experimental_parallel_collective_overlap_limit": 4}


@pytest.fixture(scope="module")
def reports():
    run = lambda strategy, **kw: plan.plan_preset(TINY, strategy, num_buckets=6, **kw)
    return {
        "drained": run("fp32_accum+drain"),
        "undrained": run("fp32_accum", compiler_options=OVERLAP_4),
        "drain2": run("fp32_accum+drain2", compiler_options=OVERLAP_4),
        "gspmd": run("gspmd"),
        "no_comm": run("no_comm"),
    }


@pytest.mark.gpu_compile
def test_finds_one_collective_per_bucket_and_the_in_flight_bound(reports):
    drained = reports["drained"]
    assert drained.num_buckets >= 6
    assert len(drained.collectives) == drained.num_buckets == drained.pairs
    assert {(c.kind, c.dtype) for c in drained.collectives} == {("all-to-all", "bf16")}
    assert sorted(plan._bucket_of(c) for c in drained.collectives) == list(range(drained.num_buckets))
    assert drained.buckets_in_flight == 1 and drained.chains_in_flight == {"dense": 1}
    assert reports["drain2"].buckets_in_flight == 2
    assert reports["undrained"].buckets_in_flight > 2
    assert reports["no_comm"].collectives == () and reports["no_comm"].buckets_in_flight == 0
    assert reports["gspmd"].strategy == "gspmd" and reports["gspmd"].collectives  # XLA's own


@pytest.mark.gpu_compile
def test_json_fields_are_present_and_consistent(reports, tmp_path):
    row = reports["drained"].to_json()
    for field in ("strategy", "num_buckets", "temp_bytes", "pairs", "overlapped", "compile_s",
                  "argument_bytes", "output_bytes", "buckets_in_flight", "collectives"):
        assert field in row
    assert row["strategy"] == "fp32_accum+drain"
    assert row["pairs"] == len(row["collectives"]) and 0 <= row["overlapped"] <= row["pairs"]
    assert row["overlapped"] == sum(c["overlapped"] for c in row["collectives"])
    assert row["temp_bytes"] > 0 and row["output_bytes"] > 0
    json.dumps(row)  # serialisable


@pytest.mark.gpu_compile
def test_table_and_plot(reports, tmp_path):
    table = reports["drained"].table()
    assert "fp32_accum+drain" in table and "all-to-all" in table and "temp" in table
    path = tmp_path / "plan.png"
    reports["drained"].plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.gpu_compile
def test_cli_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    code = cli.main(["--preset", "tiny", "--layers", "2", "--strategy", "bf16+drain", "--num-buckets", "4",
                      "--json", str(out), "--plot", str(png)])
    assert code == 0
    row = json.loads(out.read_text())
    assert row["strategy"] == "bf16+drain" and row["num_buckets"] >= 4
    assert {c["kind"] for c in row["collectives"]} == {"reduce-scatter"}
    assert png.exists() and "reduce-scatter" in capsys.readouterr().out


@pytest.mark.gpu_compile
def test_plan_of_a_user_step():
    mesh = gpu_mesh((8,), ("data",))
    from jax.sharding import NamedSharding, PartitionSpec as P

    step = jax.jit(lambda x: jnp.sum(x ** 2, axis=0), in_shardings=NamedSharding(mesh, P("data")),
                   out_shardings=NamedSharding(mesh, P()))
    report = plan.plan(step, jax.ShapeDtypeStruct((8 * 128, 256), jnp.float32), scope=None)
    assert report.num_devices == 8
    assert [c.kind for c in report.collectives] == ["all-reduce"]


def test_bad_inputs_are_refused_before_compiling(capsys):
    with pytest.raises(ValueError, match="unknown GPU target|known targets"):
        plan.plan_preset(TINY, "bf16", target="tpu9", num_buckets=2)
    with pytest.raises(ValueError, match="topology"):
        plan.plan_preset(TINY, "bf16", topology="8xx", num_buckets=2)
    with pytest.raises(ValueError, match="unknown strategy 'fp64'"):
        plan.plan_preset(TINY, "fp64", num_buckets=2)
    assert cli.main(["--preset", "tiny", "--target", "v100"]) == 2
    assert "error:" in capsys.readouterr().err
    assert cli.main(["--preset", "tiny", "--xla-option", "novalue"]) == 2


@pytest.mark.gpu_compile
def test_a_step_that_does_not_trace_is_a_plan_error():
    mesh = gpu_mesh((8,), ("data",))

    def broken(x):
        return x @ jnp.ones((3, 3))  # shapes do not match: fails while tracing

    from jax.sharding import NamedSharding, PartitionSpec as P
    step = jax.jit(broken, in_shardings=NamedSharding(mesh, P("data")))
    with pytest.raises(plan.PlanError, match="could not trace the step"):
        plan.plan(step, jax.ShapeDtypeStruct((8, 4), jnp.float32))


def test_without_the_plugin_one_error_and_one_line_from_the_cli(monkeypatch, capsys):
    def unavailable(*args, **kwargs):
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(targets.topologies, "get_topology_desc", unavailable)
    monkeypatch.setattr(targets, "_plugin_installed", lambda: False)
    with pytest.raises(GpuCompileUnavailable, match=r"pip install -e '\.\[gpu-compile\]'"):
        plan.plan_preset(TINY, "bf16", target="a100", topology="1x1x6", num_buckets=2)  # never cached
    assert cli.main(["--preset", "tiny", "--target", "a100", "--topology", "1x1x6"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ")
    assert "jax-cuda12-plugin" in err and jax.__version__ in err


def test_jax_drain_plan_is_the_public_entry():
    import jax_drain.plan as entry

    assert entry.plan is plan.plan and entry.plan_preset is plan.plan_preset and entry.main is cli.main
    assert entry.gpu_mesh is gpu_mesh and entry.GpuCompileUnavailable is GpuCompileUnavailable
    assert all(hasattr(entry, name) for name in entry.__all__)


def _python(*args: str) -> subprocess.CompletedProcess:
    root = pathlib.Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, *args], cwd=root, capture_output=True, text=True, timeout=120)


def test_python_m_jax_drain_plan_runs_the_cli():
    done = _python("-m", "jax_drain.plan", "--help")
    assert done.returncode == 0, done.stderr
    assert "--preset" in done.stdout and "--xla-option" in done.stdout and "exit status" in done.stdout


def test_the_runtime_imports_neither_the_planner_nor_the_test_harness():
    done = _python("-c", "import sys, jax_drain; print(sorted(m for m in sys.modules if m.startswith("
                   "('jax_drain.plan', 'jax_drain.testing'))))")
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize("name,expected", [
    ("gspmd", (None, None)), ("no_comm", (None, None)), ("bf16", ("bf16", None)),
    ("fp32_accum+drain", ("fp32_accum", 1)), ("fp32_accum_streamed+drain4", ("fp32_accum_streamed", 4)),
])
def test_strategy_names(name, expected):
    s = plan.Strategy.parse(name)
    assert (s.reduce, s.max_in_flight) == expected and s.name == name


def _count(params, size, order=None):
    from jax_drain.layout import BucketLayout
    return BucketLayout.build(params, size, 128, order).num_buckets


def _achievable_counts(params):
    """Every bucket count some size gives: the count only changes where the size crosses the sum
    of a run of consecutive leaves (one dtype, in the default order)."""
    leaves = jax.tree.leaves(params)[::-1]
    sizes = {1}
    for dtype in {leaf.dtype for leaf in leaves}:
        run = [math.prod(leaf.shape) for leaf in leaves if leaf.dtype == dtype]
        for i in range(len(run)):
            for j in range(i + 1, len(run) + 1):
                sizes |= {sum(run[i:j]), sum(run[i:j]) + 1}
    return {_count(params, s) for s in sizes}


def test_bucket_size_for_gives_the_requested_count():
    params = {f"w{i}": jax.ShapeDtypeStruct((100 + i, 64), jnp.bfloat16) for i in range(12)}
    for want in (1, 3, 5, 12):
        size = plan.bucket_size_for(params, want)
        got = _count(params, size)
        assert got == min(_achievable_counts(params), key=lambda c: (abs(c - want), -c)), (want, got)
        assert _count(params, size + 1) < got or size == sum(math.prod(p.shape) for p in params.values())


@pytest.mark.parametrize("preset", ["gpt-blocks", "gpt-tied"])
@pytest.mark.parametrize("want", [4, 12, 24, 66])
def test_bucket_size_for_lands_within_ten_percent_on_the_presets(preset, want):
    from jax_drain import models

    params = models.abstract_params(models.preset(preset))
    got = _count(params, plan.bucket_size_for(params, want))
    assert abs(got - want) <= 0.1 * want, (preset, want, got)


def test_bucket_size_for_with_one_large_leaf_gives_the_best_achievable():
    # One leaf of 1M elements and six of 10k: at most 7 buckets (one per leaf). For 12, 24 and
    # 66 buckets a single leaf is larger than total / n and only 7 leaves exist, so 10% is
    # impossible: the best achievable count is 7. 4 buckets is reachable (big alone + 3 pairs).
    params = {"big": jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16),
              **{f"small{i}": jax.ShapeDtypeStruct((100, 100), jnp.bfloat16) for i in range(6)}}
    total = sum(math.prod(p.shape) for p in params.values())
    achievable = _achievable_counts(params)
    assert max(achievable) == 7
    for want in (4, 12, 24, 66):
        got = _count(params, plan.bucket_size_for(params, want))
        best = min(achievable, key=lambda c: (abs(c - want), -c))
        assert got == best, (want, got, best)
        if abs(best - want) > 0.1 * want:  # impossible: the big leaf exceeds total / n, too few leaves
            assert want > 7 and 1024 * 1024 > total / want
        else:
            assert abs(got - want) <= 0.1 * want


def test_bucket_size_for_refuses_a_non_positive_count():
    with pytest.raises(ValueError, match="positive"):
        plan.bucket_size_for({"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}, 0)


@pytest.fixture(scope="module")
def expert_reports():
    """The expert mesh of tests/test_mesh.py (2 hosts; dense and expert chains), drained and not."""
    mesh = gpu_mesh((2, 2, 2, 2), ("replica", "data", "expert", "model"), topology="1x2x8")
    out = {}
    for drain in (True, False):
        step, args, sync = plan.build_mesh_step(mesh, layers=4, d_model=256, expert=True, drain=drain)
        out[drain] = sync, plan.plan(step, *args, topology="1x2x8", compiler_options=OVERLAP_4)
    return out


@pytest.mark.gpu_compile
def test_planner_bounds_each_bucket_chain(expert_reports):
    sync, drained = expert_reports[True]
    assert sync.num_buckets >= 2 and sync.num_expert_buckets >= 2
    assert drained.chains_in_flight == {"dense": 1, "expert": 1} and drained.buckets_in_flight == 1
    # Every bucket of both chains is found: an inner all-to-all and an outer all-reduce each,
    # where XLA may merge one dense and one expert all-reduce into one collective (without a
    # name, or with both names, depending on the XLA version).
    carried = {ref for c in drained.collectives for ref in drained.buckets_of(c)}
    assert carried == {("dense", k) for k in range(sync.num_buckets)} | \
        {("expert", k) for k in range(sync.num_expert_buckets)}
    for c in drained.collectives:
        refs = drained.buckets_of(c)
        assert refs and (len(refs) == 1 or c.kind == "all-reduce"), (c, refs)
        assert c.group_size == (2 if c.kind == "all-reduce" else 4 if refs[0][0] == "dense" else 2)
    row = drained.to_json()
    assert row["chains_in_flight"] == {"dense": 1, "expert": 1}
    assert {c["chain"] for c in row["collectives"]} == {"dense", "expert"}
    assert "expert" in drained.table() and "dense 1, expert 1" in drained.table()

    _, undrained = expert_reports[False]
    assert undrained.chains_in_flight["dense"] > 1 and undrained.chains_in_flight["expert"] > 1
    assert undrained.buckets_in_flight == max(undrained.chains_in_flight.values())


@pytest.mark.gpu_compile
def test_scanned_preset_syncs_inside_the_backward_scan():
    config = plan.preset_config("tiny", layers=2, d_model=256, scan_layers=True)
    in_scan = plan.plan_preset(config, "fp32_accum+drain", num_buckets=4)
    floor = plan.plan_preset(config, "no_comm", num_buckets=4)
    chains = {chain: [c for c, refs in zip(in_scan.collectives, in_scan.collective_buckets) if refs[0][0] == chain]
              for chain in ("layers", "dense")}
    (final_norm,) = chains["dense"]  # the non-stacked leaves, after the scan, in ENTRY
    assert len(chains["layers"]) == 2  # one per layer bucket, inside the loop body
    assert all(c.computation != final_norm.computation for c in chains["layers"])
    assert in_scan.chains_in_flight.get("layers") == 1
    assert in_scan.temp_bytes < floor.temp_bytes  # below the stacked gradients' floor
