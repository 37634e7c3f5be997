"""benchmarks/first_step.py: each jax_drain variant is timed against the jit step with its shardings."""

import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jax_drain as jd
from jax_drain import models

from helpers import load_benchmark


@pytest.fixture(scope="module")
def first_step():
    return load_benchmark("first_step")


def _run(build, first, steady):
    return {"build_s": build, "first_s": first, "steady_s": steady, "params": 1000, "losses": [1.0]}


def test_each_variant_is_compared_with_the_jit_step_of_its_shardings(first_step):
    Job = first_step.Job
    timings = {"jit": (1.0, 10.0, 2.0), "jd": (2.0, 6.0, 1.0), "jit_fsdp": (1.0, 8.0, 2.0),
               "jd_zero3": (2.0, 12.0, 1.5), "jit_tp": (1.0, 4.0, 1.0), "jd_gspmd": (1.0, 5.0, 1.0)}
    results = {Job("cpu", v, "m", ()): [_run(*t)] for v, t in timings.items()}
    results[Job("cpu", "jd@abc", "m", (), "/tree")] = [_run(4.0, 20.0, 1.0)]
    rows = {r["variant"]: r for r in first_step.summarize(results)}
    assert {v: r["baseline"] for v, r in rows.items()} == {
        "jit": None, "jit_fsdp": None, "jit_tp": None, "jd": "jit", "jd@abc": "jit", "jd_zero3": "jit_fsdp",
        "jd_gspmd": "jit_tp"}
    assert rows["jd_zero3"]["first_vs_jit"] == 12.0 / 8.0
    assert rows["jd_gspmd"]["to_first_vs_jit"] == 6.0 / 5.0
    assert rows["jd@abc"]["first_vs_jit"] == rows["jd@abc"]["first_s"] / rows["jit"]["first_s"]
    assert all("first_vs_jit" not in rows[v] for v in ("jit", "jit_fsdp", "jit_tp"))
    table = first_step.table(list(rows.values()))
    assert "| m | 0.00M | jd_zero3 | 2.00 (2.00x) | 12.00 (1.50x) |" in table


def test_unknown_variants_are_refused_by_name(first_step):
    with pytest.raises(SystemExit, match="unknown variant.*jd_zero4"):
        first_step.main(["--variants", "jit,jd_zero4", "--gpu-layers", "0"])


def test_the_pairs_share_their_shardings(first_step):
    """jit_tp's shardings are jd_gspmd's param_specs; jit_fsdp splits what ZeRO-3 would."""
    config = first_step._gpt_config({**first_step.CPU_MODELS["gpt-132k"][0]}, "float32")
    params = models.abstract_params(config)
    mesh = jax.make_mesh(*first_step.TP_MESH, devices=jax.devices()[:8])
    tp = first_step._shardings("jit_tp", params, mesh)
    tp_config = first_step._jd_config("jd_gspmd", params)
    assert isinstance(tp_config, jd.TrainConfig) and tp_config.tensor_parallel == "gspmd"
    assert jax.tree.map(lambda s: s.spec, tp) == tp_config.param_specs
    block = tp_config.param_specs["blocks"][0]
    assert (block["attn"]["qkv"]["kernel"], block["attn"]["out"]["kernel"], block["mlp"]["fc_in"]["kernel"],
            block["mlp"]["fc_out"]["kernel"], block["ln_attn"]["scale"]) == (
        P(None, "model"), P("model", None), P(None, "model"), P("model", None), P())
    assert tp_config.param_specs["embed"]["embedding"] == P()
    # The optimizer state's leaves follow their parameter's path.
    opt = first_step._shardings("jit_tp", jax.eval_shape(optax.adamw(1e-3).init, params), mesh)
    assert opt[0].mu["blocks"][1]["mlp"]["fc_out"]["kernel"].spec == P("model", None)
    fsdp = first_step._shardings("jit_fsdp", params, jax.make_mesh((8,), ("data",), devices=jax.devices()[:8]))
    assert fsdp["blocks"][0]["attn"]["qkv"]["kernel"].spec == P("data")
    assert jd.TrainConfig is type(first_step._jd_config("jd_zero3", params)) and first_step._jd_config(
        "jd_zero3", params).shard_params
