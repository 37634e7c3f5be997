"""Public models this project did not write, unchanged.

``examples/public_model_lm1b.py`` imports Flax's own ``examples/lm1b/models.py`` (a linen
Transformer with ``nn.with_logical_partitioning``) from a flax source tree and trains it through
``tensor_parallel="gspmd"`` with lm1b's own logical axis rules on its ``(data, fsdp, tensor)``
mesh; here its losses and parameters after 5 AdamW steps must be within the float32 rounding
bounds of one-device optax, and every device must hold its own block of every sharded weight.

With ``--stages 2`` the same lm1b runs on a ``stage`` axis: its decoder, a list of identical
linen blocks, is stacked by the step, a share per stage (GPipe with ZeRO-1, 1F1B with ZeRO-3),
within the same rounding bounds. So is EasyLM's LLaMA below, whose blocks (``h/0``...) are a
list too, each under ``nn.remat``.

``examples/public_model_resnet.py`` imports Flax's ImageNet ``examples/imagenet/models.py`` (a
linen ResNet whose BatchNorm layers average over the axis ``'batch'``) and trains ResNet18 with
its ``batch_stats`` as mutable model state; its parameters and statistics must be within the
rounding bounds of one device on whole batches, a NaN batch must leave them bit for bit and a
checkpoint must hold the statistics.

Flax's ``examples/nnx_toy_examples/06_scan_over_layers.py`` (``ScanMLP``: ``nnx.scan`` over blocks
of Linear, BatchNorm and Dropout made by ``nnx.vmap``) is found as a scanned stack by
``TrainConfig(scan_layers=None)``; ZeRO-3 must train it exactly as ZeRO-1 does, and its
per-device BatchNorm statistics in training mode must be refused. On a stage axis, under a head,
it must train like one device, ZeRO-1 and ZeRO-3, GPipe and 1F1B.

The NNX GSPMD guide's ``MultiDotReluDot`` (its code cell in ``docs_nnx/guides/flax_gspmd.md``: a
scanned stack, the whole model, whose weights declare their 'model' split and whose layers
constrain their activations over ``('data', 'model')``) must train on a ``(data, stage, model)``
mesh in the guide's ``jax.set_mesh`` context like one device, its constraint kept over 'model'.

Flax's pip package has no ``examples/``, and CI has neither network nor a flax checkout, so the
models' source is found only through ``JAX_DRAIN_FLAX_EXAMPLES``: a flax checkout (a directory
holding the example files named in ``FILES``) or a flax git directory,
bare or not (the files are then read from its ``HEAD`` with ``git show``), or beside an editable
flax install. Without it these tests skip, saying so; nothing else in the suite depends on them.
Run them with::

    git clone https://github.com/google/flax /tmp/flax
    JAX_DRAIN_FLAX_EXAMPLES=/tmp/flax python -m pytest -q -n 0 tests/test_public_models.py

A ``JAX_DRAIN_FLAX_EXAMPLES`` that holds neither fails them instead of skipping.

``examples/public_model_llama.py`` imports EasyLM's LLaMA (``EasyLM/models/llama/llama_model.py``,
a pjit model whose activations are constrained over its batch axes ``("dp", "fsdp")`` and its
model axis ``"mp"``) from an EasyLM source tree and trains it on its own mesh, in its trainer's
``with mesh:``, with ``("dp", "fsdp")`` as the data axes, ZeRO-1 and ZeRO-3: its constraints must
stay in force over ``"mp"`` alone, its losses and parameters must be within the rounding bounds of
one-device optax, and a checkpoint must resume bit for bit. Its source is found through
``JAX_DRAIN_EASYLM`` (a checkout or a git directory, as above); its model file imports packages
jax_drain does not need (``pip install 'transformers<5' mlxu einops ml_collections``). Without
either these tests skip, saying which::

    git clone https://github.com/young-geng/EasyLM /tmp/EasyLM
    JAX_DRAIN_EASYLM=/tmp/EasyLM python -m pytest -q -n 0 tests/test_public_models.py -k llama
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from helpers import (adam_rounding_bounds, assert_within, assert_within_rounding, loss_rounding_bounds, reference_run,
                     rounding_chain, sgd_rounding_bounds, train_on)

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = ("examples/lm1b/models.py", "examples/lm1b/configs/default.py", "examples/imagenet/models.py",
         "examples/nnx_toy_examples/06_scan_over_layers.py", "docs_nnx/guides/flax_gspmd.md")
ENV = "JAX_DRAIN_FLAX_EXAMPLES"


def _has_models(path: pathlib.Path) -> bool:
    return all((path / f).is_file() for f in FILES)


def _files_at_head(git_dir: pathlib.Path, files, out: pathlib.Path, given: str) -> pathlib.Path:
    """``files`` as they are at ``git_dir``'s HEAD (a bare mirror or a clone), written under ``out``."""
    try:
        for f in files:
            text = subprocess.run(["git", "-C", str(git_dir), "show", f"HEAD:{f}"], check=True, capture_output=True,
                                  text=True).stdout
            (out / f).parent.mkdir(parents=True, exist_ok=True)
            (out / f).write_text(text)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.fail(f"{given} holds neither {list(files)} nor a git history with them: {e}")
    return out


@pytest.fixture(scope="module")
def flax_source(tmp_path_factory) -> str:
    """A directory holding the models' files, or a skip naming ``JAX_DRAIN_FLAX_EXAMPLES``."""
    given = os.environ.get(ENV)
    if given:
        path = pathlib.Path(given)
        if _has_models(path):
            return str(path)
        return str(_files_at_head(path, FILES, tmp_path_factory.mktemp("flax"), f"{ENV}={given}"))
    import flax

    beside = pathlib.Path(flax.__file__).resolve().parent.parent  # an editable install from a checkout
    if _has_models(beside):
        return str(beside)
    pytest.skip(f"no flax examples source: the flax package has no examples/; set {ENV} to a flax checkout "
                "or git directory (git clone https://github.com/google/flax) to run Flax's lm1b and ImageNet models")


def _groups(line: str) -> list[list[int]]:
    """The replica groups of one HLO collective: ``{{0,2},{1,3}}`` or the iota form ``[2,2]<=[4]``."""
    if m := re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line):
        return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[(\d+)\](?!T)", line):
        return np.arange(int(m.group(3))).reshape(int(m.group(1)), int(m.group(2))).tolist()
    raise AssertionError(f"replica groups not understood: {line.strip()[:200]}")


def _coordinate(mesh, index: int, axis: str) -> int:
    """The coordinate along ``axis`` of the device at ``index`` in the mesh's device order."""
    return int(np.unravel_index(index, mesh.devices.shape)[mesh.axis_names.index(axis)])


@functools.cache
def _example(name: str = "public_model_lm1b"):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / f"examples/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _assert_like_one_device_adamw(run, ex, trained, *, loss, params, micro_batches, what, b2=0.999, losses=True):
    """The run's parameters (``trained``) and losses within the AdamW trajectory's float32
    rounding bounds of one-device optax (``run["reference"]``): each step's gradient is the
    one-device gradient's chain of roundings plus the sum over the 8 devices and over the
    ``micro_batches`` each device sums."""
    want, want_losses, gradients = run["reference"]
    additions = rounding_chain(jax.grad(loss), params, run["data"][0]) + 8 + micro_batches
    bounds = adam_rounding_bounds(gradients, additions=additions, learning_rate=ex.LR, params=params, b2=b2,
                                  max_norm=ex.MAX_NORM, weight_decay=ex.WD)
    assert_within(trained, jax.device_get(want), bounds[-1], what=what)
    if losses:
        loss_bounds = loss_rounding_bounds(want_losses, gradients, bounds, additions=additions)
        assert np.all(np.abs(np.asarray(run["losses"]) - want_losses) <= loss_bounds), (run["losses"], want_losses)


@pytest.mark.public_model
@pytest.mark.parametrize("mesh", ["4,1,2", "2,2,2"], ids=["data4_tensor2", "data2_fsdp2_tensor2"])
def test_flax_lm1b_transformer_unchanged_trains_like_one_device_optax(flax_source, mesh, cpu_devices):
    ex = _example()
    run = ex.main(["--flax", flax_source, "--steps", "5", "--mesh", mesh])
    step, state, run_mesh = run["step"], run["state"], run["mesh"]
    assert step.tensor_parallel == "gspmd" and step.sync.tensor_parallel == "gspmd"
    assert run["rules"] == (("mlp", "tensor"), ("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"))

    # Every device holds 1/n of every dimension declared over mesh axes of size n (the example
    # checks each leaf); the ones lm1b shards over "tensor" are held as halves.
    blocks = {k.replace("['", "").replace("']", "/").rstrip("/"): v for k, v in run["blocks"].items()}
    fsdp = run_mesh.shape["fsdp"]
    assert blocks["params/decoder/Embed_0/embedding"] == ((256, 32), (128, 32 // fsdp))
    assert blocks["params/decoder/logitdense/kernel"] == ((32, 256), (32 // fsdp, 128))
    for layer in range(2):
        mlp = f"params/decoder/encoderdecoderblock_{layer}/MlpBlock_0"
        assert blocks[f"{mlp}/Dense_0/kernel"] == ((32, 64), (32 // fsdp, 32))
        assert blocks[f"{mlp}/Dense_1/kernel"] == ((64, 32), (32, 32 // fsdp))

    # XLA computed on the blocks. jax_drain's own all-gathers (the optimizer's parameter gathers)
    # span only "data". With lm1b's mesh at fsdp=1 no all-gather spans "tensor" at all: no weight
    # (nor activation) is gathered over the model axis. (At fsdp=2 XLA chooses to gather some
    # attention activations over "tensor" in the backward pass: the partitioner's choice for
    # lm1b's attention, whose kernels are sharded over "fsdp" only.)
    hlo = step.lower(state, run["data"][0]).compile().as_text()
    gathers = [(_groups(line), "jax_drain/gather/" in line) for line in hlo.splitlines()
               if re.search(r" all-gather(-start)?\(", line)]
    spans = lambda groups, axis: any(len({_coordinate(run_mesh, i, axis) for i in g}) > 1 for g in groups)
    ours = [groups for groups, mine in gathers if mine]
    assert ours and all(spans(g, "data") and not spans(g, "tensor") and not spans(g, "fsdp") for g in ours), ours
    if fsdp == 1:
        assert not [groups for groups, _ in gathers if spans(groups, "tensor")], gathers

    _assert_like_one_device_adamw(run, ex, jax.device_get(state.params), loss=run["mean_loss"],
                                  params=nn.meta.unbox(run["variables"]), micro_batches=1,
                                  what="lm1b params after 5 AdamW steps")
    assert run["losses"][-1] < run["losses"][0]


@pytest.mark.public_model
@pytest.mark.parametrize("schedule,zero3", [("gpipe", False), ("1f1b", True)], ids=["zero1-gpipe", "zero3-1f1b"])
def test_flax_lm1b_blocks_unchanged_train_on_a_stage_axis_like_one_device_optax(flax_source, schedule, zero3,
                                                                                  cpu_devices):
    """lm1b's decoder is a list of identical linen blocks (``encoderdecoderblock_0``...), not a
    scan: on ``(data, stage, fsdp, tensor)`` = (2, 2, 1, 2) the step stacks them, each stage
    holding its two, with XLA's tensor parallelism inside each stage and AdamW's ``ndim`` mask
    read on lm1b's own tree; it trains within the rounding bounds of one-device optax."""
    ex = _example()
    args = ["--flax", flax_source, "--steps", "5", "--mesh", "2,1,2", "--stages", "2", "--schedule", schedule]
    run = ex.main(args + (["--zero3"] if zero3 else []))
    step, state = run["step"], run["state"]
    assert (step.stage_axis, step.pipeline_schedule, step.tensor_parallel) == ("stage", schedule, "gspmd")
    if not zero3:  # each stage holds its own two of the four blocks, split over "tensor" as lm1b declares
        blocks = {k.replace("['", "").replace("']", "/").rstrip("/"): v for k, v in run["blocks"].items()}
        stacked = "params/decoder/[encoderdecoderblock_0..encoderdecoderblock_3]"
        assert blocks[f"{stacked}/MlpBlock_0/Dense_0/kernel"] == ((4, 32, 64), (2, 32, 32))
        assert blocks[f"{stacked}/LayerNorm_0/scale"] == ((4, 32), (2, 32))
    _assert_like_one_device_adamw(run, ex, step.master_params(state), loss=run["mean_loss"],
                                  params=nn.meta.unbox(run["variables"]), micro_batches=4,
                                  what="lm1b params after 5 AdamW steps")


@pytest.mark.public_model
def test_flax_imagenet_resnet_unchanged_trains_its_batch_stats_like_one_device(flax_source, cpu_devices):
    ex = _example("public_model_resnet")
    run = ex.main(["--flax", flax_source, "--steps", "4"])
    step, trained, variables = run["step"], run["trained"], run["variables"]
    want, want_losses, gradients = run["reference"]
    assert set(run["state"].model_state) == {"batch_stats"} and step.sync.num_buckets > 1

    # Each step's gradient is the one-device gradient's chain of roundings plus the sum over the
    # 8 devices; the parameters follow SGD with Nesterov momentum from there.
    # (The model's statistics need its axis 'batch' bound: a vmap of size 1.)
    loss = lambda params, stats, batch: run["loss_fn"]({"params": params, "batch_stats": stats}, batch)[0]
    grad = jax.vmap(jax.grad(loss), in_axes=(None, None, 0), axis_name="batch")
    grad_chain = rounding_chain(grad, variables["params"], variables["batch_stats"],
                                jax.tree.map(lambda x: x[None], run["data"][0])) + 8
    bounds = sgd_rounding_bounds(gradients, additions=grad_chain, learning_rate=ex.LR, momentum=ex.MOMENTUM,
                                 nesterov=True, params=variables["params"])
    assert_within(trained["params"], want["params"], bounds[-1], what="ResNet18 params after 4 steps")
    # The running statistics: each step's are the forward's statistics (within the forward and
    # backward chain, which bounds the forward's) of parameters within that chain's bounds, mixed
    # into the running averages.
    assert_within_rounding(trained["batch_stats"], want["batch_stats"], additions=4 * grad_chain,
                           what="ResNet18 batch_stats after 4 steps")
    for path, moved, start in zip(jax.tree_util.tree_leaves_with_path(trained["batch_stats"]),
                                  jax.tree.leaves(trained["batch_stats"]), jax.tree.leaves(variables["batch_stats"])):
        assert not np.allclose(moved, start), f"{jax.tree_util.keystr(path[0])} did not move"
    loss_bounds = loss_rounding_bounds(want_losses, gradients, bounds, additions=grad_chain)
    assert np.all(np.abs(np.asarray(run["losses"]) - want_losses) <= loss_bounds), (run["losses"], want_losses)
    assert run["losses"][-1] < run["losses"][0]
    assert run["skipped"] and run["checkpointed"]
    # The trained variables evaluate with the module itself, on the running statistics.
    logits = run["module"].apply(trained, run["data"][0]["image"], train=False)
    assert logits.shape == (ex.BATCH, ex.CLASSES) and np.all(np.isfinite(logits))


@pytest.mark.public_model
def test_flax_nnx_scan_over_layers_unchanged_trains_the_same_under_zero3(flax_source, cpu_devices):
    """Flax's ``ScanMLP``, unchanged: found as a scanned stack, whose layer buckets ZeRO-3 gathers
    and reduces inside the scan body; 3 Adam steps give ZeRO-1's parameters bit for bit (the same
    buckets, the same reduction), and the loss falls. In training mode its BatchNorm (no
    ``axis_name``) keeps statistics per device, which is refused, sharded or not."""
    import optax
    from flax import nnx
    from jax.sharding import Mesh

    import jax_drain as jd

    path = pathlib.Path(flax_source) / "examples/nnx_toy_examples/06_scan_over_layers.py"
    spec = importlib.util.spec_from_file_location("flax_scan_over_layers", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # builds and prints its own small model
    dim, rng = 16, np.random.default_rng(5)
    batches = [{"x": rng.normal(size=(32, dim)).astype(np.float32), "y": rng.normal(size=(32, dim)).astype(np.float32)}
               for _ in range(3)]
    loss = lambda model, batch: jax.numpy.mean((model(batch["x"]) - batch["y"]) ** 2)  # noqa: E731
    mesh = Mesh(np.array(cpu_devices), ("data",))

    def step_for(model, **config):
        return jd.make_train_step(model, loss, optax.adam(1e-2), mesh,
                                  jd.TrainConfig(bucket_size=100, scan_layers=None, **config), example_batch=batches[0])

    def trained(shard_params):
        model = example.ScanMLP(dim, n_layers=3, rngs=nnx.Rngs(0))
        model.eval()  # running statistics, no dropout
        step = step_for(model, shard_params=shard_params)
        assert isinstance(step.sync, jd.ScanGradSync) and step.sync.layer_layout.num_buckets >= 2
        state, losses = step.init(), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics.loss))
        step.update_model(model, state)
        return nnx.to_pure_dict(nnx.state(model, nnx.Param)), losses

    (zero1, losses1), (zero3, losses3) = trained(False), trained(True)
    assert losses3 == losses1 and losses1[-1] < losses1[0]
    for a, b in zip(jax.tree.leaves(zero3), jax.tree.leaves(zero1)):
        np.testing.assert_array_equal(a, b)
    untrained = nnx.to_pure_dict(nnx.state(example.ScanMLP(dim, n_layers=3, rngs=nnx.Rngs(0)), nnx.Param))
    assert not np.array_equal(zero3["layers"]["linear"]["kernel"], untrained["layers"]["linear"]["kernel"])
    for shard_params in (False, True):
        step = step_for(example.ScanMLP(dim, n_layers=3, rngs=nnx.Rngs(0)), shard_params=shard_params)
        with pytest.raises(ValueError, match="axis_name='data'"):
            step(step.init(), batches[0])


@pytest.mark.public_model
@pytest.mark.parametrize("shard_params,schedule", [(False, "gpipe"), (True, "gpipe"), (False, "1f1b"), (True, "1f1b")],
                         ids=["zero1-gpipe", "zero3-gpipe", "zero1-1f1b", "zero3-1f1b"])
def test_flax_nnx_scan_over_layers_unchanged_trains_on_a_stage_axis_like_one_device(
        flax_source, shard_params, schedule, cpu_devices):
    """Flax's ``ScanMLP``, unchanged, as the stack of a model with a head, on ``(data, stage) =
    (2, 4)``: each stage runs its own layer with that layer's running statistics and dropout
    key (evaluation mode), and 3 SGD steps follow one-device optax on whole batches within the
    rounding of their gradients, ZeRO-1 and ZeRO-3, GPipe and 1F1B."""
    import optax
    from flax import nnx
    from jax.sharding import Mesh

    import jax_drain as jd

    path = pathlib.Path(flax_source) / "examples/nnx_toy_examples/06_scan_over_layers.py"
    spec = importlib.util.spec_from_file_location("flax_scan_over_layers", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    dim, layers, rng = 16, 4, np.random.default_rng(11)

    class WithHead(nnx.Module):  # the user's model around Flax's stack: a head after it
        def __init__(self, rngs):
            self.body = example.ScanMLP(dim, n_layers=layers, rngs=rngs)
            self.head = nnx.Linear(dim, 1, rngs=rngs)

        def __call__(self, x):
            return self.head(self.body(x))[:, 0]

    model = WithHead(nnx.Rngs(0))
    model.eval()
    norm = model.body.layers.bn  # statistics that differ layer by layer, so each stage must read its own
    norm.mean[...] = jax.numpy.asarray(rng.normal(size=(layers, dim)) / 2, np.float32)
    norm.var[...] = jax.numpy.asarray(rng.uniform(0.5, 2.0, size=(layers, dim)), np.float32)
    batches = [{"x": rng.normal(size=(32, dim)).astype(np.float32), "y": rng.normal(size=(32,)).astype(np.float32)}
               for _ in range(3)]
    loss = lambda m, batch: jax.numpy.mean((m(batch["x"]) - batch["y"]) ** 2)  # noqa: E731
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    start = jax.device_get(nnx.to_pure_dict(params))
    mesh = Mesh(np.array(cpu_devices).reshape(2, 4), ("data", "stage"))
    step = jd.make_train_step(model, loss, optax.sgd(0.1), mesh,
                              jd.TrainConfig(stage_axis="stage", pipeline_microbatches=4, shard_params=shard_params,
                                             pipeline_schedule=schedule),
                              example_batch=batches[0])
    step.update_model(model, train_on(step, batches))

    def one_device(p, b):
        return loss(nnx.merge(graphdef, nnx.State(p), other, copy=True), b)

    want, _, gradients = reference_run(one_device, start, optax.sgd(0.1), batches)
    additions = rounding_chain(jax.grad(one_device), start, batches[0]) + 8 + 4
    bounds = sgd_rounding_bounds(gradients, additions=additions, learning_rate=0.1, params=start)
    assert_within(nnx.to_pure_dict(nnx.state(model, nnx.Param)), want, bounds[-1], what="after 3 steps")


def _gspmd_guide_cell(flax_source: str, defines: str) -> str:
    """The code cell of Flax's NNX GSPMD guide (``docs_nnx/guides/flax_gspmd.md``) that defines
    ``defines``, as written there."""
    text = (pathlib.Path(flax_source) / "docs_nnx/guides/flax_gspmd.md").read_text()
    (cell,) = [c for c in re.findall(r"```\{code-cell\}\n(.*?)```", text, re.S) if f"class {defines}" in c]
    return cell


@pytest.mark.public_model
@pytest.mark.parametrize("shard_params,schedule", [(False, "gpipe"), (True, "1f1b")], ids=["zero1-gpipe", "zero3-1f1b"])
def test_flax_gspmd_guide_s_scanned_model_trains_on_a_stage_axis_with_xla_s_tensor_parallel(
        flax_source, shard_params, schedule, cpu_devices):
    """Flax's NNX GSPMD guide's ``MultiDotReluDot``, its cell unchanged and the whole model: a
    ``jax.lax.scan`` over layers made by ``nnx.vmap``, each weight declaring its 'model' split
    (``nnx.with_partitioning``), each layer constraining its activation to ``P('data',
    'model')``, run in the guide's ``jax.set_mesh`` context, every parameter in the stack. On
    ``(data, stage, model) = (2, 2, 2)``: the declared shardings pick tensor parallelism by XLA;
    each device holds its stage's layers' 'model' half of ``w2`` (``dot1``'s kernel, the
    smallest stacked leaf, whole on every stage); the constraint keeps 'model' (its 'data',
    manual in the step, dropped); and 3 SGD steps follow one-device optax within the rounding
    of the gradients, GPipe with ZeRO-1 and 1F1B with ZeRO-3."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jax_drain as jd

    namespace = {"jax": jax, "jnp": jnp, "nnx": nnx, "P": P}
    exec(_gspmd_guide_cell(flax_source, "MultiDotReluDot"), namespace)
    dim, layers, rng = 16, 4, np.random.default_rng(13)
    auto = (jax.sharding.AxisType.Auto,) * 3
    mesh = jax.make_mesh((2, 2, 2), ("data", "stage", "model"), axis_types=auto, devices=cpu_devices)
    with jax.set_mesh(mesh):
        model = namespace["MultiDotReluDot"](dim, layers, rngs=nnx.Rngs(0))
    batches = [{"x": rng.normal(size=(32, dim)).astype(np.float32), "y": rng.normal(size=(32, dim)).astype(np.float32)}
               for _ in range(3)]
    loss = lambda m, batch: jnp.mean((m(batch["x"]) - batch["y"]) ** 2)  # noqa: E731
    graphdef, params = nnx.split(model, nnx.Param)
    start = jax.device_get(nnx.to_pure_dict(params))
    with jax.set_mesh(mesh):
        step = jd.make_train_step(model, loss, optax.sgd(0.1), mesh,
                                  jd.TrainConfig(stage_axis="stage", pipeline_microbatches=4,
                                                 shard_params=shard_params, pipeline_schedule=schedule),
                                  example_batch=batches[0])
        assert step.tensor_parallel == "gspmd"
        state = step.init()
        if not shard_params:
            held = lambda x: {s.data.shape for s in x.addressable_shards}  # noqa: E731
            assert held(state.params["layers"]["w2"]) == {(layers // 2, dim // 2, dim)}  # its stage's, its half
            assert held(state.params["layers"]["dot1"]["kernel"]) == {(layers, dim, dim // 2)}  # every stage's
        program = step.lower(state, batches[0]).as_text()
        # The layer's activation [rows, dim] (a micro-batch's rows): constrained over 'model' alone
        # (the open ``{?}`` ones are jax's own, which name no axis).
        activation = re.compile(rf"sdy\.sharding_constraint .* : tensor<\d+x{dim}xf32>")
        constrained = [line for line in program.splitlines() if activation.search(line) and '"' in line]
        assert constrained and all('[{}, {"model"}]>' in line for line in constrained), constrained
        step.update_model(model, train_on(step, batches, state))

    one = jax.make_mesh((1, 1, 1), ("data", "stage", "model"), axis_types=auto, devices=cpu_devices[:1])

    def one_device(p, b):
        return loss(nnx.merge(graphdef, nnx.State(p), copy=True), b)

    with jax.set_mesh(one):  # the guide's constraint names its mesh's axes
        want, _, gradients = reference_run(one_device, start, optax.sgd(0.1), batches)
        additions = rounding_chain(jax.grad(one_device), start, batches[0]) + 8 + 4
    bounds = sgd_rounding_bounds(gradients, additions=additions, learning_rate=0.1, params=start)
    assert_within(jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param))), want, bounds[-1],
                  what=f"after 3 steps ({schedule}, {shard_params=})")


# -- EasyLM's LLaMA: a pjit model with its own activation constraints ----------------------------

EASYLM_ENV = "JAX_DRAIN_EASYLM"
EASYLM_FILES = ("EasyLM/__init__.py", "EasyLM/jax_utils.py", "EasyLM/bpt.py", "EasyLM/models/__init__.py",
                "EasyLM/models/llama/llama_model.py")
#: What EasyLM's model file imports that jax_drain does not need (transformers: its Flax classes,
#: which transformers 5 no longer has).
EASYLM_NEEDS = "pip install 'transformers<5' mlxu einops ml_collections"


@pytest.fixture(scope="module")
def easylm_source(tmp_path_factory) -> str:
    """An EasyLM checkout whose model file imports, or a skip naming ``JAX_DRAIN_EASYLM`` or the
    missing packages."""
    given = os.environ.get(EASYLM_ENV)
    if not given:
        pytest.skip(f"no EasyLM source: set {EASYLM_ENV} to an EasyLM checkout or git directory "
                    "(git clone https://github.com/young-geng/EasyLM) to run its LLaMA")
    path = pathlib.Path(given)
    if not all((path / f).is_file() for f in EASYLM_FILES):
        path = _files_at_head(path, EASYLM_FILES, tmp_path_factory.mktemp("easylm"), f"{EASYLM_ENV}={given}")
    try:
        _example("public_model_llama").load_easylm(path)
    except ImportError as e:
        pytest.skip(f"EasyLM's model file does not import here ({e}); it needs `{EASYLM_NEEDS}`")
    return str(path)


def _model_constraints(program: str) -> dict[str, list[str]]:
    """The lowered program's sharding constraints on the model's activations, by kind: ``xq``,
    ``xk``, ``xv`` and the feed-forward output (each device's (batch, SEQ, HIDDEN) block) and the
    attention weights ((batch, HEADS, SEQ, SEQ)), forward and backward. The step's own leave
    every dimension open (``{?}``)."""
    ex = _example("public_model_llama")
    local = ex.BATCH // 4  # the batch is split over dp x fsdp = 4 devices in both meshes
    shapes = {"hidden": f"tensor<{local}x{ex.SEQ}x{ex.HIDDEN}xf32>",
              "attention": f"tensor<{local}x{ex.HEADS}x{ex.SEQ}x{ex.SEQ}xf32>"}
    lines = [line.strip() for line in program.splitlines() if "sdy.sharding_constraint" in line and "{?}" not in line]
    return {kind: [line for line in lines if line.endswith(shape)] for kind, shape in shapes.items()}


#: What EasyLM's code and its trainer's ``with mesh:`` make jax say, every time: not ours to fix.
easylm_warnings = pytest.mark.filterwarnings(
    "ignore:.*mesh.. context manager has been deprecated:DeprecationWarning",
    "ignore:jax.interpreters.pxla.thread_resources is deprecated:DeprecationWarning",
    "ignore:jax.experimental.pjit.pjit has been deprecated:DeprecationWarning")


@pytest.mark.public_model
@easylm_warnings
@pytest.mark.parametrize("zero3", [False, True], ids=["zero1", "zero3"])
@pytest.mark.parametrize("mesh", ["4,1,2", "2,2,2"], ids=["dp4_mp2", "dp2_fsdp2_mp2"])
def test_easylm_llama_unchanged_keeps_its_constraints_and_trains_like_one_device_optax(
        easylm_source, mesh, zero3, tmp_path, cpu_devices):
    """EasyLM's LLaMA, its file unchanged, on its own ('dp', 'fsdp', 'mp') mesh in its trainer's
    ``with mesh:``: the data axes ('dp', 'fsdp') are jax_drain's, its partition rules (less
    'fsdp', which jax_drain's ZeRO covers) shard the weights over 'mp'. Its activation
    constraints stay in force over 'mp' and name no data axis; 5 AdamW steps give one-device
    optax's losses and parameters within their float32 rounding bounds; a checkpoint resumes bit
    for bit."""
    ex = _example("public_model_llama")
    run = ex.main(["--easylm", easylm_source, "--steps", "5", "--mesh", mesh] + ["--zero3"] * zero3)
    step, state, run_mesh, data = run["step"], run["state"], run["mesh"], run["data"]
    assert step.tensor_parallel == "gspmd" and step.sync.tensor_parallel == "gspmd"
    assert step.config.data_axes == ("dp", "fsdp") and tuple(run_mesh.axis_names) == ("dp", "fsdp", "mp")

    # EasyLM's own rules, as its trainer matches them; jax_drain's specs are those less 'fsdp'.
    wte = lambda specs: specs["params"]["transformer"]["wte"]["embedding"]  # noqa: E731
    wq = lambda specs: specs["params"]["transformer"]["h"]["0"]["attention"]["wq"]["kernel"]  # noqa: E731
    assert (wte(run["easylm_specs"]), wq(run["easylm_specs"])) == (P("mp", "fsdp"), P("fsdp", "mp"))
    assert (wte(run["specs"]), wq(run["specs"])) == (P("mp", None), P(None, "mp"))
    if not zero3:  # each device holds its half of every weight EasyLM shards over 'mp'
        blocks = {k.replace("['", "").replace("']", "/").rstrip("/"): v for k, v in run["blocks"].items()}
        assert blocks["params/transformer/wte/embedding"] == ((256, 64), (128, 64))
        assert blocks["params/lm_head/kernel"] == ((64, 256), (64, 128))
        for layer in range(ex.LAYERS):
            block = f"params/transformer/h/{layer}"
            assert blocks[f"{block}/attention/wq/kernel"] == ((64, 64), (64, 32))
            assert blocks[f"{block}/attention/wo/kernel"] == ((64, 64), (32, 64))
            assert blocks[f"{block}/feed_forward/w2/kernel"] == ((128, 64), (64, 64))
        assert len(blocks) == 2 + 7 * ex.LAYERS  # every kernel and the embedding; the norm scales whole
    else:  # the example checked that each device holds 1/8 of every bucket
        assert not run["blocks"] and run["held"] * 8 >= sum(x.size for x in jax.tree.leaves(run["variables"]))

    # The model's constraints are in force inside the step, over 'mp' alone: each device's block
    # of xq, xk, xv and the feed-forward output is (None, None, "mp"), the attention weights'
    # (None, "mp", None, None); the data axes, manual in the step, are named by none of them.
    with run["context"]():
        program = step.lower(state, data[0]).as_text()
    constraints = _model_constraints(program)
    hidden, attention = constraints["hidden"], constraints["attention"]
    assert len(hidden) >= 4 * ex.LAYERS and len(attention) >= ex.LAYERS, constraints  # forward; backward too
    for line in hidden:
        assert re.search(r'<@\w+, \[\{\}, \{\}, \{"mp"\}\]>', line), line
    for line in attention:
        assert re.search(r'<@\w+, \[\{\}, \{"mp"\}, \{\}, \{\}\]>', line), line
    blocks_of_the_batch = re.compile(rf"sdy\.sharding_constraint .* : tensor<{ex.BATCH // 4}x\d+x")
    activations = [line for line in program.splitlines() if blocks_of_the_batch.search(line)]
    assert not [line for line in activations if '"dp"' in line or '"fsdp"' in line], activations

    _assert_like_one_device_adamw(run, ex, run["trained"], loss=run["loss_fn"], params=run["variables"],
                                  micro_batches=1, b2=ex.B2, what="EasyLM LLaMA params after 5 AdamW steps")
    assert run["losses"][-1] < run["losses"][0]

    # A checkpoint of the trained state, restored into the step's layout, is the state bit for
    # bit, and the next step from it is the next step from the state itself.
    import jax_drain as jd

    directory = tmp_path / "checkpoints"
    jd.save_checkpoint(directory, state)
    restored, _ = jd.restore_checkpoint(directory, step.abstract_state())
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(restored),
                          jax.tree.leaves(state)):
        np.testing.assert_array_equal(jax.device_get(a), jax.device_get(b), err_msg=jax.tree_util.keystr(path[0]))
    after = next(ex.batches(1, seed=2))
    with run["context"]():
        resumed, resumed_metrics = step(restored, after)
        going, going_metrics = step(state, after)
    assert int(resumed.step) == int(going.step) == 6
    assert float(resumed_metrics.loss) == float(going_metrics.loss)
    for a, b in zip(jax.tree.leaves(step.master_params(resumed)), jax.tree.leaves(step.master_params(going))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.public_model
@easylm_warnings
@pytest.mark.parametrize("schedule,zero3", [("gpipe", False), ("1f1b", True)], ids=["zero1-gpipe", "zero3-1f1b"])
def test_easylm_llama_blocks_unchanged_train_on_a_stage_axis_like_one_device_optax(easylm_source, schedule, zero3,
                                                                                   cpu_devices):
    """EasyLM's LLaMA keeps its blocks in a list (``transformer/h/0``..., each under its own
    ``nn.remat``, each with its own copy of the rotary table): on ``(dp, stage, fsdp, mp)`` =
    (2, 2, 1, 2), in its trainer's ``with mesh:``, the step stacks the four blocks, two per stage,
    with XLA's tensor parallelism over 'mp' inside each stage; 5 AdamW steps stay within the
    rounding bounds of one-device optax."""
    ex = _example("public_model_llama")
    args = ["--easylm", easylm_source, "--steps", "5", "--mesh", "2,1,2", "--stages", "2", "--schedule", schedule]
    run = ex.main(args + ["--zero3"] * zero3)
    step = run["step"]
    assert (step.stage_axis, step.pipeline_schedule, step.tensor_parallel) == ("stage", schedule, "gspmd")
    if not zero3:  # two blocks per stage, each split over 'mp' as EasyLM's rules say
        blocks = {k.replace("['", "").replace("']", "/").rstrip("/"): v for k, v in run["blocks"].items()}
        stacked = "params/transformer/h/[0..3]"
        assert blocks[f"{stacked}/attention/wq/kernel"] == ((4, 64, 64), (2, 64, 32))
        assert blocks[f"{stacked}/attention_norm/kernel"] == ((4, 64), (2, 64))
    _assert_like_one_device_adamw(run, ex, run["trained"], loss=run["loss_fn"], params=run["variables"],
                                  micro_batches=4, b2=ex.B2, what="EasyLM LLaMA params after 5 AdamW steps")


@pytest.mark.public_model
@easylm_warnings
def test_easylm_llama_constraints_need_its_trainers_mesh_context(easylm_source, cpu_devices):
    """EasyLM's helper applies a constraint only when the mesh of ``with mesh:`` has its axes:
    built and run outside it, the program holds none of the model's constraints, and still
    trains like one-device optax (the constraints are layout, not arithmetic)."""
    ex = _example("public_model_llama")
    run = ex.main(["--easylm", easylm_source, "--steps", "2", "--context", "none"])
    with run["context"]():
        program = run["step"].lower(run["state"], run["data"][0]).as_text()
    assert _model_constraints(program) == {"hidden": [], "attention": []}
    _assert_like_one_device_adamw(run, ex, run["trained"], loss=run["loss_fn"], params=run["variables"],
                                  micro_batches=1, b2=ex.B2, losses=False, what="EasyLM LLaMA params, no mesh context")
