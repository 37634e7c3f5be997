"""A public model, unchanged, trained tensor parallel by XLA: Flax's own lm1b Transformer.

The model is ``examples/lm1b/models.py`` of google/flax (checked at commit
``18f8f311c275d57f46d95e41b15aa97b454754c0``), imported from a flax checkout as it is: no line of
it is edited or copied here. It is a linen decoder written the GSPMD way (global shapes, no
collectives, ``nn.with_logical_partitioning`` on its parameters); its logical axis rules and mesh
axis names are read from the same checkout's ``examples/lm1b/configs/default.py`` (``mlp`` and
``vocab`` over ``tensor``, ``embed`` over ``fsdp``). The mesh is lm1b's ``(data, fsdp, tensor)``
at ``(4, 1, 2)`` on 8 virtual CPU devices: data parallel 4, tensor (model) parallel 2
(``--mesh 2,2,2`` also shards every ``embed`` dimension over ``fsdp``). ``--stages 2`` adds a
``stage`` axis after ``data`` and pipelines lm1b's decoder blocks (a list of identical linen
blocks, ``encoderdecoderblock_0``...: the step stacks them, one share per stage), in the
``--schedule`` given, with ZeRO-3 under ``--zero3``.
``jd.make_train_step`` reads the shardings from the boxes with ``TrainConfig(logical_axis_rules=)``
and runs the loss on global shapes (``tensor_parallel="gspmd"``). The script checks that every
``tensor``-sharded weight is held as 1/2 blocks on each device and compares the losses and
parameters after ``--steps`` steps with plain one-device optax on whole batches. Dropout is off
(lm1b trains with 0.1) so that the two runs compute the same function.

    git clone https://github.com/google/flax /tmp/flax && python examples/public_model_lm1b.py --flax /tmp/flax

Without a clone, the two files from any flax git directory (e.g. a bare mirror) do as well:

    mkdir -p /tmp/lm1b/examples/lm1b/configs
    git -C FLAX_GIT show HEAD:examples/lm1b/models.py > /tmp/lm1b/examples/lm1b/models.py
    git -C FLAX_GIT show HEAD:examples/lm1b/configs/default.py > /tmp/lm1b/examples/lm1b/configs/default.py
    python examples/public_model_lm1b.py --flax /tmp/lm1b
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax_drain as jd  # noqa: E402  (before jax: no CUDA-plugin start-up lines without a GPU)

import argparse  # noqa: E402
import ast  # noqa: E402
import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

BATCH, SEQ, VOCAB, LR, WD, MAX_NORM = 16, 32, 256, 3e-3, 0.1, 1.0


def load_lm1b(flax_dir):
    """lm1b's ``models`` module (imported from the file, unchanged) and its config's mesh axes
    and logical axis rules (read with ``ast``: the config file needs ``ml_collections``)."""
    lm1b = pathlib.Path(flax_dir) / "examples" / "lm1b"
    spec = importlib.util.spec_from_file_location("lm1b_models", lm1b / "models.py")
    models = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = models  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(models)
    found = {}
    for node in ast.walk(ast.parse((lm1b / "configs" / "default.py").read_text())):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            if node.targets[0].attr in ("mesh_axes", "logical_axis_rules"):
                found[node.targets[0].attr] = ast.literal_eval(node.value)
    return models, tuple(found["mesh_axes"]), tuple(tuple(rule) for rule in found["logical_axis_rules"])


def batches(n, seed=1):
    """Random token sequences (ids 1..VOCAB-1) ending in a few padding zeros, as lm1b's packed ones."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        tokens = rng.integers(1, VOCAB, size=(BATCH, SEQ), dtype=np.int32)
        tokens[np.arange(SEQ) >= rng.integers(SEQ // 2, SEQ + 1, size=(BATCH, 1))] = 0
        yield {"inputs": tokens}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flax", required=True, help="a flax checkout (holding examples/lm1b/models.py)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mesh", default="4,1,2", help="sizes of lm1b's mesh axes (data, fsdp, tensor)")
    parser.add_argument("--stages", type=int, default=1, help="a stage axis of this size after data (pipeline)")
    parser.add_argument("--schedule", default="gpipe", help="the pipeline's schedule (with --stages)")
    parser.add_argument("--zero3", action="store_true", help="shard the parameters too (TrainConfig(shard_params=True))")
    args = parser.parse_args(argv)
    models, mesh_axes, rules = load_lm1b(args.flax)
    config = models.TransformerConfig(
        vocab_size=VOCAB, output_vocab_size=VOCAB, emb_dim=32, num_heads=4, num_layers=2 * args.stages, qkv_dim=32, mlp_dim=64,
        max_len=SEQ, dropout_rate=0.0, attention_dropout_rate=0.0, deterministic=True)
    module = models.TransformerLM(config)

    def loss_fn(variables, batch):  # lm1b's weighted cross entropy, padding (id 0) not counted
        inputs = batch["inputs"]
        logits = module.apply(variables, inputs)
        weights = (inputs > 0).astype(jnp.float32)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, inputs)
        return jd.WeightedLoss(jnp.sum(nll * weights), jnp.sum(weights))

    data = list(batches(args.steps))
    variables = module.init(jax.random.key(0), data[0]["inputs"][:1])  # boxed: nn.LogicallyPartitioned
    sizes = tuple(int(n) for n in args.mesh.split(","))
    pipeline = {}
    if args.stages > 1:  # ("data", "stage", "fsdp", "tensor"): the data axes first, as XLA's split wants them
        sizes, mesh_axes = (sizes[0], args.stages, *sizes[1:]), (mesh_axes[0], "stage", *mesh_axes[1:])
        pipeline = dict(stage_axis="stage", pipeline_microbatches=2 * args.stages, pipeline_schedule=args.schedule)
    mesh = jax.make_mesh(sizes, mesh_axes)
    decay = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # kernels and embeddings only
    step = jd.make_train_step(
        variables, loss_fn, jd.adamw(LR, weight_decay=WD, mask=decay, max_norm=MAX_NORM), mesh,
        jd.TrainConfig(axis="data", logical_axis_rules=rules, bucket_size=8192, shard_params=args.zero3, **pipeline),
        example_batch=data[0])
    assert step.tensor_parallel == "gspmd", step.tensor_parallel
    state, losses = step.init(), []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics.loss))

    # (b) each device holds its own block: 1/n of every dimension sharded over mesh axes of size n.
    size = lambda entry: int(np.prod([mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry or ())]))
    blocks = {}
    for path, x in jax.tree_util.tree_leaves_with_path(() if args.zero3 else state.params):
        spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        want = tuple(d // size(e) for d, e in zip(x.shape, spec))
        got = {s.data.shape for s in x.addressable_shards}
        assert got == {want}, (jax.tree_util.keystr(path), x.shape, spec, got)
        if want != x.shape:
            blocks[jax.tree_util.keystr(path)] = (x.shape, want)

    # (c) the same steps with plain optax on one device, whole batches, float32.
    plain = nn.meta.unbox(variables)
    tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, weight_decay=WD, mask=decay))
    mean_loss = lambda v, b: (lambda w: w.total / w.count)(loss_fn(v, b))
    opt_state, ref_losses, ref_grads, grad = tx.init(plain), [], [], jax.jit(jax.value_and_grad(mean_loss))
    for batch in data:
        loss, g = grad(plain, batch)
        updates, opt_state = tx.update(g, opt_state, plain)
        plain = optax.apply_updates(plain, updates)
        ref_losses.append(float(loss))
        ref_grads.append(g)
    got = step.master_params(state)  # the model's own tree (with a stage axis the step holds the blocks stacked)
    rel = lambda a, b: float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    param_diff = max(jax.tree.leaves(jax.tree.map(rel, got, jax.device_get(plain))))
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))

    print(f"model: flax examples/lm1b/models.py TransformerLM, unchanged; rules {rules}; mesh {dict(mesh.shape)}")
    print(f"tensor_parallel={step.tensor_parallel}; {len(blocks)} weights sharded over the model axes, e.g.")
    for path, (shape, block) in list(blocks.items())[:4]:
        print(f"  {path}: global {shape} -> {block} per device")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps (optax: {ref_losses[0]:.4f} -> "
          f"{ref_losses[-1]:.4f})")
    print(f"max relative difference vs one-device optax: params {param_diff:.2e}, losses {loss_diff:.2e}")
    return {"step": step, "state": state, "losses": losses, "blocks": blocks, "param_diff": param_diff,
            "loss_diff": loss_diff, "reference": (plain, ref_losses, ref_grads), "data": data, "variables": variables,
            "mean_loss": mean_loss, "rules": rules, "mesh": mesh}


if __name__ == "__main__":
    main()
