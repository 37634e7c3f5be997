"""The planner's search for the fastest configuration that fits a memory budget.

The compiled tests use small models (a one-block preset, the example user model shrunk, a plain
MLP) and budgets taken from an independent compile, never from the search itself: the choice
must fit, be no slower than every default strategy that fits, and its config must build.
"""

import contextlib
import dataclasses
import importlib.util
import io
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_drain as jd
from jax_drain.planner import cli, compare, plan, search
from jax_drain.planner.plan import Plan
from jax_drain.planner.timing import StepTime

TINY = plan.preset_config("tiny", layers=1, d_model=128)
ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "plan_my_model.py")
TINY_EXAMPLE = ["--layers", "1", "--d-model", "128", "--seq", "32", "--micro-batch", "2"]
S = jax.ShapeDtypeStruct


def _main(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def _total(p: Plan) -> int:
    return p.temp_bytes + p.argument_bytes


def _check_choice(found: dict, budget: int) -> dict:
    """The done-when, read from the JSON: the choice fits and no fitting default is faster."""
    choice = found["choice"]
    assert choice is not None and choice["temp_plus_args_bytes"] <= budget
    assert choice["temp_bytes"] + choice["argument_bytes"] == choice["temp_plus_args_bytes"]
    fitting = [r for r in found["rows"] if r["default"] and r["temp_plus_args_bytes"] is not None
               and r["temp_plus_args_bytes"] <= budget]
    for row in fitting:
        assert choice["predicted_step_s"] <= row["predicted_step_s"], row["strategy"]
    assert [r["chosen"] for r in found["rows"]].count(True) == 1
    jd.TrainConfig(**choice["config"])  # every field one TrainConfig takes
    return choice


# -- a preset ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def preset_search(tmp_path_factory):
    """The budget: the streamed default's own temp + arguments, compiled apart from the search
    (on this preset the other defaults need more)."""
    reference = plan.plan_preset(TINY, "fp32_accum_streamed+drain", num_buckets=24)
    budget = _total(reference)
    path = tmp_path_factory.mktemp("search") / "search.json"
    png = path.with_suffix(".png")
    code, out, err = _main(["--preset", "tiny", "--layers", "1", "--d-model", "128",
                            "--memory-budget", repr(budget / 2**20), "--max-compiles", "5",
                            "--json", str(path), "--plot", str(png)])
    assert code == 0, err
    return reference, budget, json.loads(path.read_text()), out, err, png


@pytest.mark.gpu_compile
def test_preset_choice_fits_and_no_fitting_default_is_faster(preset_search):
    reference, budget, found, out, _, _ = preset_search
    assert found["memory_budget_bytes"] == budget
    choice = _check_choice(found, budget)
    assert choice["predicted_step_s"] <= reference.predicted_step_s
    # The search's own row of that default is the program compiled apart.
    (row,) = [r for r in found["rows"] if r["default"] and r["strategy"] == "fp32_accum_streamed+drain"]
    assert (row["temp_bytes"], row["argument_bytes"], row["predicted_step_s"]) == (
        reference.temp_bytes, reference.argument_bytes, reference.predicted_step_s)
    assert any(r["default"] and not r["fits"] for r in found["rows"])  # the budget excludes some
    assert {r["strategy"] for r in found["rows"] if r["default"]} | {
        p["strategy"] for p in found["pruned"] if p["num_buckets_asked"] == 24} >= {
        search.Candidate.of(name, 24).strategy for name in search.DEFAULT_CANDIDATES}


@pytest.mark.gpu_compile
def test_preset_search_reports_its_cost_table_and_plot(preset_search):
    _, budget, found, out, err, png = preset_search
    compiled = [r for r in found["rows"] if r["compile_s"] is not None]
    assert found["compiles"] == len(compiled) + (found["floor"] is not None) <= 5
    assert found["compile_s"] >= sum(r["compile_s"] for r in compiled) > 0
    assert found["search_s"] >= found["compile_s"] and found["stopped"]
    keys = {(r["strategy"], r["bucket_size"]) for r in compiled}
    for p in found["pruned"]:  # pruned means never compiled, and says why
        assert p["why"] and (p["strategy"], p["bucket_size"]) not in keys
    assert len(keys) == len(compiled)  # nothing compiled twice
    lines = out.splitlines()
    assert lines[0].startswith("search: the fastest step within") and f"{found['compiles']} compiles" in lines[1]
    assert any("chosen" in line and found["choice"]["strategy"] in line for line in lines)
    assert any(line.startswith("choice: ") for line in lines) and "jd.TrainConfig(" in out
    assert err.count(" temp + arguments") == found["compiles"]  # one progress line per compile
    assert png.read_bytes()[:4] == b"\x89PNG"


# -- your model, --loss ------------------------------------------------------------------------


@pytest.mark.gpu_compile
def test_loss_model_choice_fits_and_no_fitting_default_is_faster(tmp_path):
    spec = importlib.util.spec_from_file_location("plan_my_model_for_search", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    params, batch = example.params(layers=1, d_model=128), example.batch(micro_batch=2, seq=32)
    ref = compare.plan_model(example.loss, params, batch, ["fp32_accum+drain"], num_buckets=24, progress=False)
    reference = ref.rows[0].plan
    budget = _total(reference)
    path = tmp_path / "search.json"
    code, out, err = _main(["--loss", f"{EXAMPLE}:loss", "--params", f"{EXAMPLE}:params", "--batch",
                            f"{EXAMPLE}:batch", *TINY_EXAMPLE, "--memory-budget", repr(budget / 2**20),
                            "--max-compiles", "5", "--json", str(path), "-q"])
    assert code == 0, err
    assert err == ""  # -q: no progress lines
    found = json.loads(path.read_text())
    choice = _check_choice(found, budget)
    assert choice["predicted_step_s"] <= reference.predicted_step_s
    assert "plan_my_model" in out.splitlines()[0]


# -- ZeRO-3 when the whole parameters cannot fit -----------------------------------------------


def mlp_loss(params, batch):
    x = batch["x"]
    for w in params["layers"]:
        x = jax.checkpoint(lambda x, w: jnp.tanh(x @ w))(x, w)
    return jnp.mean((x - batch["y"]).astype(jnp.float32) ** 2)


MLP_PARAMS = {"layers": [S((512, 512), jnp.bfloat16)] * 8}
MLP_BATCH = {"x": S((8 * 8, 512), jnp.bfloat16), "y": S((8 * 8, 512), jnp.bfloat16)}


def _nbytes(tree, divide=1):
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize // divide for x in jax.tree.leaves(tree))


@pytest.mark.gpu_compile
def test_whole_parameters_over_the_budget_leave_zero3_and_the_config_trains():
    whole = _nbytes(MLP_PARAMS) + _nbytes(MLP_BATCH, 8)
    found = search.search_model(mlp_loss, MLP_PARAMS, MLP_BATCH, whole - 1, max_compiles=6, num_buckets=4,
                                progress=False)
    assert found.floor is None  # only ZeRO-3 can fit: no floor compiled
    assert all(r.candidate.shard_params for r in found.rows)
    by_args = [p for p in found.pruned if "arguments alone" in p.why]
    assert {p.candidate.strategy for p in by_args} >= {"fp32_accum", "fp32_accum+drain", "fp32_accum_streamed+drain"}
    assert found.compiles == len(found.rows) and found.compiles <= 6
    choice = found.choice
    assert choice.fits and choice.temp_plus_args_bytes <= whole - 1
    config = found.config(max_grad_norm=1.0)
    assert config.shard_params and config.bucket_size == choice.bucket_size and config.max_grad_norm == 1.0
    # The chosen config builds and runs a step (8 CPU devices).
    rng = np.random.default_rng(0)
    params = {"layers": [jnp.asarray(rng.normal(size=(512, 512)) * 0.05, jnp.bfloat16) for _ in range(8)]}
    batch = {k: jnp.asarray(rng.normal(size=(64, 512)), jnp.bfloat16) for k in ("x", "y")}
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices("cpu"))
    step = jd.make_train_step(params, mlp_loss, optax.sgd(0.1), mesh, config, example_batch=batch)
    state, metrics = step(step.init(), batch)
    assert np.isfinite(float(metrics.loss))


@pytest.mark.gpu_compile
def test_nothing_fits_names_the_least_memory_and_the_cli_exits_2(tmp_path):
    shards = _nbytes(MLP_PARAMS, 8) + _nbytes(MLP_BATCH, 8)
    with pytest.raises(search.BudgetTooSmall, match=r"arguments alone need at least .* MiB") as e:
        search.search_model(mlp_loss, MLP_PARAMS, MLP_BATCH, shards - 1, progress=False)
    assert e.value.search is None and e.value.smallest_bytes == shards  # before any compile
    with pytest.raises(search.BudgetTooSmall, match=r"the smallest found, .* needs [\d.,]+ MiB") as e:
        search.search_model(mlp_loss, MLP_PARAMS, MLP_BATCH, shards + 1, max_compiles=1, num_buckets=4, progress=False)
    found = e.value.search
    assert found.compiles == 1 and found.choice is None
    assert e.value.smallest_bytes == min(r.temp_plus_args_bytes for r in found.rows) > shards + 1
    # The CLI: one line on stderr, exit 2, the JSON written with its choice null.
    path = tmp_path / "none.json"
    code, out, err = _main(["--preset", "tiny", "--layers", "1", "--d-model", "128", "--memory-budget", "0.01",
                            "--json", str(path)])
    assert code == 2 and err.startswith("error: no configuration fits 0.0 MiB") and len(err.splitlines()) == 1
    assert json.loads(path.read_text())["choice"] is None


# -- a tensor-parallel mesh --------------------------------------------------------------------

TP_AXES = {"model": 2}


def _local_bytes(params, specs, model_size):
    """Bytes of each device's blocks: a leaf split over the model axis holds 1/model_size of itself."""
    return sum(math.prod(p.shape) * jnp.dtype(p.dtype).itemsize // (model_size if any(spec) else 1)
               for p, spec in zip(jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(
                   x, jax.sharding.PartitionSpec))))


@pytest.fixture(scope="module")
def tensor_parallel_plan():
    """Every baseline and the drained sync of TINY on ("data", "model") = (4, 2), Megatron's split."""
    params = jd.models.abstract_params(TINY)
    specs = jd.models.tensor_parallel_specs(params)
    batch = jd.models.example_batch(TINY, 4 * 2)
    report = compare.plan_model(jd.models.make_loss(TINY), params, batch,
                                ["gspmd", "gspmd_fsdp", "no_comm", "fp32_accum+drain"], num_buckets=24,
                                progress=False, model_axes=TP_AXES, param_specs=specs)
    return params, specs, batch, report


@pytest.mark.gpu_compile
def test_tensor_parallel_plans_split_the_parameters_and_price_every_strategy(tensor_parallel_plan):
    params, specs, batch, report = tensor_parallel_plan
    assert "tensor parallel over model=2" in report.model
    local = _local_bytes(params, specs, 2) + _nbytes(batch, 4)
    assert local < _nbytes(params) + _nbytes(batch, 4)  # the split is not empty
    floor = report.row("no_comm").plan
    for name in ("gspmd", "no_comm", "fp32_accum+drain"):
        p = report.row(name).plan
        # XLA's arguments are each device's blocks: the specs reached the compiled program.
        assert p.argument_bytes == local, name
        assert p.predicted_step_s is not None and p.exposed_comm_s is not None, name
        assert floor.predicted_step_s <= p.predicted_step_s, name
    fsdp = report.row("gspmd_fsdp").plan
    assert fsdp.argument_bytes < local and floor.predicted_step_s <= fsdp.predicted_step_s
    # The sync reduce-scatters each device's blocks over the 4 data devices, no more.
    sync = report.row("fp32_accum+drain").plan
    assert sync.num_buckets and any(c.kind == "all-to-all" and c.group_size == 4 for c in sync.collectives)


@pytest.mark.gpu_compile
def test_tensor_parallel_search_fits_and_its_config_trains_on_the_mesh(tensor_parallel_plan, tmp_path):
    """The CLI's search with --model-axis: its budget is the drained default's own temp + arguments
    from the independent plan above; the chosen config carries the specs and trains."""
    params, specs, batch, report = tensor_parallel_plan
    budget = _total(report.row("fp32_accum+drain").plan)
    path = tmp_path / "search.json"
    code, out, err = _main(["--preset", "tiny", "--layers", "1", "--d-model", "128", "--model-axis", "model=2",
                            "--memory-budget", repr(budget / 2**20), "--max-compiles", "3", "--json", str(path), "-q"])
    assert code == 0, err
    found = json.loads(path.read_text())
    assert found["model_axes"] == TP_AXES and "tensor parallel over model=2" in out.splitlines()[0]
    assert "jd.TrainConfig(tensor_parallel='gspmd', param_specs=<the specs searched>, " in out
    choice = _check_choice(found, budget)
    # The Python search's TrainConfig of that choice (Search.config) carries the specs.
    row = dataclasses.replace(_row(choice["strategy"], choice["num_buckets_asked"], 1, 1.0, args=1),
                              bucket_size=choice["bucket_size"], config=choice["config"])
    config = search.Search((row,), budget, None, (), 1, 0.0, 0.0, "", "h100", "1x1x8", 8,
                           model_axes=TP_AXES, param_specs=specs).config()
    assert config.tensor_parallel == "gspmd" and config.param_specs == specs
    rng = np.random.default_rng(0)
    values = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape) * 0.05, s.dtype), params)
    data = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), batch)
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices("cpu"))
    step = jd.make_train_step(values, jd.models.make_loss(TINY), optax.sgd(0.1), mesh, config, example_batch=data)
    state, metrics = step(step.init(), data)
    assert np.isfinite(float(metrics.loss))
    assert config.bucket_size == choice["bucket_size"] and config.reduce == choice["config"]["reduce"]


@pytest.mark.gpu_compile
def test_your_model_s_own_specs_reach_the_plan_from_the_cli(tmp_path):
    spec = importlib.util.spec_from_file_location("plan_my_model_for_tp", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    params, batch = example.params(layers=1, d_model=128), example.batch(micro_batch=2, seq=32)
    path = tmp_path / "plan.json"
    code, out, err = _main(["--loss", f"{EXAMPLE}:loss", "--params", f"{EXAMPLE}:params", "--batch",
                            f"{EXAMPLE}:batch", *TINY_EXAMPLE, "--model-axis", "model=2", "--param-specs",
                            f"{EXAMPLE}:param_specs", "--strategy", "fp32_accum+drain", "--json", str(path), "-q"])
    assert code == 0, err
    (row,) = json.loads(path.read_text())
    # The batch: micro-batch 2 on each of the 8 devices, split over the 4 data devices.
    local = _local_bytes(params, example.param_specs(params), 2) + _nbytes(batch, 4)
    assert row["argument_bytes"] == local and row["predicted_step_s"] is not None
    assert "tensor parallel over model=2" in out


@pytest.mark.gpu_compile
def test_a_tensor_parallel_search_prunes_zero3_with_split_leaves_before_building():
    """The runtime refuses ZeRO-3 with split leaves on a GSPMD tensor-parallel mesh: the search
    prunes it with why, instead of a failed row (a trace, no compile)."""
    params = jd.models.abstract_params(TINY)
    model = compare.prepare_model(jd.models.make_loss(TINY), params, jd.models.example_batch(TINY, 8),
                                  model_axes=TP_AXES, param_specs=jd.models.tensor_parallel_specs(params))
    run = search._Run(model, 2**40, modes=search.SEARCH_MODES, num_buckets=24, max_compiles=1, compiler_options={},
                      progress=False)
    assert "gathers whole leaves" in run.why_pruned(search.Candidate(split_leaves=True, shard_params=True), 1024)
    assert run.why_pruned(search.Candidate(shard_params=True), 1024) is None
    assert run.why_pruned(search.Candidate(split_leaves=True), 1024) is None


# -- without compiling -------------------------------------------------------------------------


def test_cli_refuses_what_a_search_cannot_take(capsys):
    assert cli.main(["--memory-budget", "100", "--strategy", "fp32_accum+drain"]) == 2
    assert "leave out --strategy" in capsys.readouterr().err
    assert cli.main(["--memory-budget", "100", "--bucket-size", "1024"]) == 2
    assert "leave out --bucket-size" in capsys.readouterr().err
    assert cli.main(["--max-compiles", "3"]) == 2
    assert "--max-compiles bounds a search" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--memory-budget", "-5"])
    with pytest.raises(ValueError, match="memory_budget must be a positive number"):
        search.search_model(mlp_loss, MLP_PARAMS, MLP_BATCH, 0)
    with pytest.raises(ValueError, match="modes must name reduce modes"):
        search.search_model(mlp_loss, MLP_PARAMS, MLP_BATCH, 2**30, modes=("fp64",))
    for argv, said in ((["--model-axis", "model"], "--model-axis takes NAME=SIZE"),
                       (["--model-axis", "data=2"], "the data-parallel axis"),
                       (["--model-axis", "model=3"], "do not divide the 8"),
                       (["--loss", "x.py:f", "--param-specs", "x.py:s"], "--param-specs needs --model-axis"),
                       (["--param-specs", "x.py:s"], "--param-specs goes with --loss"),
                       (["--step", "x.py:f", "--model-axis", "model=2"], "--model-axis does not reach --step")):
        assert cli.main([*argv, "--memory-budget", "100"]) == 2, argv
        assert said in capsys.readouterr().err, argv
    with pytest.raises(ValueError, match="give model_axes .* and param_specs .* together"):
        compare.prepare_model(mlp_loss, MLP_PARAMS, MLP_BATCH, model_axes={"model": 2})
    with pytest.raises(ValueError, match=r"param_specs name axes \['tensor'\]"):
        compare.prepare_model(mlp_loss, MLP_PARAMS, MLP_BATCH, model_axes={"model": 2},
                              param_specs={"layers": [jax.sharding.PartitionSpec(None, "tensor")] * 8})


@pytest.mark.parametrize("candidate", [
    search.Candidate(), search.Candidate(max_in_flight=None), search.Candidate("fp32_accum_streamed", 3),
    search.Candidate(split_leaves=True, blocks=True), search.Candidate(shard_params=True),
    search.Candidate("fp32_accum_streamed", 2, shard_params=True, reshard_after_forward=False, blocks=True),
])
def test_candidate_names_and_configs_are_the_planner_s_and_train_config_s(candidate):
    parsed = plan.Strategy.parse(candidate.strategy)
    assert search.Candidate.of(parsed, candidate.num_buckets) == candidate
    config = jd.TrainConfig(**candidate.config_fields(4096))
    assert (config.reduce, config.split_leaves, config.shard_params, config.reshard_after_forward) == (
        candidate.reduce, candidate.split_leaves, candidate.shard_params, candidate.reshard_after_forward)
    assert config.drain == (candidate.max_in_flight is not None)
    assert config.bucket_boundaries == ("remat" if candidate.blocks else None)
    depth = candidate.max_in_flight or 1
    assert candidate.compiler_options() == (
        {"xla_gpu_experimental_parallel_collective_overlap_limit": depth} if depth > 1 else {})


def test_reshard_without_zero3_is_refused():
    with pytest.raises(ValueError, match="needs shard_params=True"):
        search.Candidate(reshard_after_forward=False)


def _row(strategy, buckets, temp, step, *, args=100, budget=200, default=False):
    p = Plan("h100", "1x1x8", 8, temp * 2**20, args * 2**20, 0, 1.0, (), 1, 1, (temp * 2**20,), buckets,
             strategy, 1024, step_time=StepTime(step * 1e-3, 0.5e-3, {"all-to-all": 0.5e-3}, 0.0, step * 0.9e-3))
    c = search.Candidate.of(strategy, buckets)
    return search.SearchRow(c, 1024, c.config_fields(1024), p, default, fits=(temp + args) <= budget)


def test_choice_frontier_table_json_and_plot_without_compiling(tmp_path):
    rows = (_row("fp32_accum", 24, 150, 10.0, default=True), _row("fp32_accum+drain", 24, 90, 11.0, default=True),
            _row("fp32_accum+drain", 12, 99, 10.5), _row("fp32_accum+drain", 6, 120, 10.2),
            _row("fp32_accum+drain+zero3", 24, 40, 13.0, args=12, default=True),
            _row("fp32_accum_streamed+drain", 24, 95, 12.0, default=True))
    pruned = (search.Pruned(search.Candidate(max_in_flight=2, num_buckets=6), 4096, "it keeps at least as much"),)
    found = search.Search(rows, 200 * 2**20, None, pruned, 6, 12.5, 13.0, "a local optimum", "h100", "1x1x8", 8, "mine")
    assert found.choice is rows[2]  # 10.5 ms: the fastest of those within 200 MiB
    assert [r.strategy + str(r.candidate.num_buckets) for r in found.frontier()] == [
        "fp32_accum+drain+zero324", "fp32_accum+drain24", "fp32_accum+drain12", "fp32_accum+drain6",
        "fp32_accum24"]
    data = found.to_json()
    assert set(data) >= {"rows", "choice", "memory_budget_bytes", "compiles", "compile_s", "search_s", "pruned",
                         "stopped"}
    assert data["choice"]["config"]["bucket_size"] == 1024 and data["choice"]["predicted_step_s"] == 10.5e-3
    assert data["choice"]["temp_plus_args_bytes"] == 199 * 2**20
    assert [r["chosen"] for r in data["rows"]] == [False, False, True, False, False, False]
    assert data["pruned"] == [{"strategy": "fp32_accum+drain2", "num_buckets_asked": 6, "bucket_size": 4096,
                               "why": "it keeps at least as much"}]
    json.dumps(data)
    table = found.table()
    assert "6 compiles, 12.5 s compiling" in table and "1 candidate pruned" in table
    assert "fastest default strategy that fits, fp32_accum+drain with 24 buckets, 11.00 ms" in table
    chosen = next(line for line in table.splitlines() if "chosen" in line)
    assert chosen.split()[1:3] == ["fp32_accum+drain", "12"]
    assert "over budget" in next(line for line in table.splitlines() if line.split()[1:3] == ["fp32_accum", "24"])
    assert found.config().bucket_size == 1024 and found.config().drain
    assert found.plot(tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_a_compiled_row_over_the_budget_prunes_what_keeps_as_much_alive():
    over = _row("fp32_accum+drain", 12, 150, 10.0)
    keeps = search._keeps_at_least
    c = search.Candidate(num_buckets=6)
    assert keeps(c, 2048, over) and keeps(c.replace(max_in_flight=2), 1024, over)  # larger, or deeper
    assert keeps(c.replace(max_in_flight=None), 1024, over)  # undrained keeps every bucket
    assert not keeps(c, 512, over)  # smaller buckets may fit
    assert not keeps(c.replace(reduce="fp32_accum_streamed"), 2048, over)  # another mode: unknown
    assert not keeps(c.replace(blocks=True), 2048, over)
