"""A public model with batch statistics, unchanged: Flax's own ImageNet ResNet (linen, ``batch_stats``).

The model is ``examples/imagenet/models.py`` of google/flax (checked at commit
``18f8f311c275d57f46d95e41b15aa97b454754c0``), imported from a flax checkout as it is: no line of
it is edited or copied here. Its ``BatchNorm`` layers compute their statistics over the mesh axis
``'batch'`` (hard-coded in the model), so the mesh's data axis is named ``batch`` and
``TrainConfig(axis="batch")``. The loss is the one of the same example's ``train.py``: softmax
cross entropy plus ``1e-4 / 2`` times the squared norm of every kernel, trained with SGD and
Nesterov momentum 0.9; ``make_train_step(variables, loss_fn, ..., mutable=["batch_stats"])``
carries the statistics in ``TrainState.model_state``. ResNet18 with 8 filters on random 32x32
images, 8 virtual CPU devices, each holding 1/8 of the global batch.

The script compares the parameters and running statistics after ``--steps`` steps with one device
running the same steps on whole batches, shows that a batch holding a NaN is skipped with the
statistics kept bit for bit, and that a checkpoint holds the statistics.

    git clone https://github.com/google/flax /tmp/flax && python examples/public_model_resnet.py --flax /tmp/flax

Without a clone, the one file from any flax git directory (e.g. a bare mirror) does as well:

    mkdir -p /tmp/imagenet/examples/imagenet
    git -C FLAX_GIT show HEAD:examples/imagenet/models.py > /tmp/imagenet/examples/imagenet/models.py
    python examples/public_model_resnet.py --flax /tmp/imagenet
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax_drain as jd  # noqa: E402  (before jax: no CUDA-plugin start-up lines without a GPU)

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

BATCH, IMAGE, CLASSES, FILTERS, LR, MOMENTUM, WEIGHT_DECAY = 32, 32, 10, 8, 0.05, 0.9, 1e-4


def load_models(flax_dir):
    """The ImageNet example's ``models`` module, imported from the file unchanged."""
    path = pathlib.Path(flax_dir) / "examples" / "imagenet" / "models.py"
    spec = importlib.util.spec_from_file_location("imagenet_models", path)
    models = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = models  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(models)
    return models


def batches(n, seed=3):
    """Random images (normal, shifted per channel so that the statistics are not 0 and 1), each
    labelled by the largest of ``CLASSES`` fixed random projections of it: a task to learn."""
    rng = np.random.default_rng(seed)
    shift = rng.normal(size=3).astype(np.float32)
    projections = rng.normal(size=(IMAGE * IMAGE * 3, CLASSES))
    out = []
    for _ in range(n):
        images = rng.normal(size=(BATCH, IMAGE, IMAGE, 3)).astype(np.float32) + shift
        out.append({"image": images, "label": np.argmax(images.reshape(BATCH, -1) @ projections, 1).astype(np.int32)})
    return out


def make_loss(module):
    """``train.py``'s loss: cross entropy plus the kernels' L2 penalty; ``(loss, updates)``."""

    def loss_fn(variables, batch):
        logits, updates = module.apply(variables, batch["image"], mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        penalty = sum(jnp.sum(x ** 2) for x in jax.tree.leaves(variables["params"]) if x.ndim > 1)
        return loss + WEIGHT_DECAY * 0.5 * penalty, updates

    return loss_fn


def tx(name="sgd"):
    """``train.py``'s SGD with Nesterov momentum, or LARS (layer-wise trust ratios, the large-batch
    ResNet optimizer), which needs each parameter whole: the step then gives each device whole
    parameters (``ownership="param"``)."""
    if name == "lars":
        return optax.lars(LR, weight_decay=0.0, momentum=MOMENTUM)  # the loss holds the L2 penalty
    return optax.sgd(LR, momentum=MOMENTUM, nesterov=True)


def one_device_step(loss_fn):
    """The same step on one device and the whole batch; the model's ``axis_name='batch'`` is bound
    by a ``vmap`` of size 1, over which a mean is the identity. Returns the loss, the gradient and
    the updated statistics."""

    def grad(params, stats, batch):
        whole = jax.vmap(lambda b: jax.value_and_grad(lambda p: loss_fn({"params": p, "batch_stats": stats}, b),
                                                      has_aux=True)(params), axis_name="batch")
        ((loss, updates), g) = whole(jax.tree.map(lambda x: x[None], batch))
        return jax.tree.map(lambda x: x[0], (loss, g, updates["batch_stats"]))

    return jax.jit(grad)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flax", required=True, help="a flax checkout (holding examples/imagenet/models.py)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tx", choices=["sgd", "lars"], default="sgd")
    args = parser.parse_args(argv)
    models = load_models(args.flax)
    module = models.ResNet18(num_classes=CLASSES, num_filters=FILTERS)
    data = batches(args.steps + 1)
    variables = module.init(jax.random.key(0), data[0]["image"][:1], train=False)  # params, batch_stats
    loss_fn = make_loss(module)

    mesh = jax.make_mesh((8,), ("batch",))
    step = jd.make_train_step(variables, loss_fn, tx(args.tx), mesh, jd.TrainConfig(axis="batch", bucket_size=20_000),
                              example_batch=data[0], mutable=["batch_stats"])
    state, losses = step.init(), []
    for batch in data[:-1]:
        state, metrics = step(state, batch)
        losses.append(float(metrics.loss))
    trained = step.variables(state)

    # A batch with a NaN on one device: skipped, the statistics (and params) kept bit for bit.
    poisoned = {**data[-1], "image": data[-1]["image"].copy()}
    poisoned["image"][BATCH - 1, 0, 0, 0] = np.nan
    after, metrics = step(state, poisoned)
    kept = step.variables(after)
    skipped = bool(metrics.skipped) and all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(kept),
                                                                                 jax.tree.leaves(trained)))

    # A checkpoint holds the statistics.
    with tempfile.TemporaryDirectory() as tmp:
        jd.save_checkpoint(pathlib.Path(tmp) / "ckpt", after)
        restored, _ = jd.restore_checkpoint(pathlib.Path(tmp) / "ckpt", step.abstract_state())
    restored_stats = jax.device_get(restored.model_state["batch_stats"])
    checkpointed = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored_stats),
                                                            jax.tree.leaves(trained["batch_stats"])))

    # The same steps on one device, whole batches.
    grad, opt = one_device_step(loss_fn), tx(args.tx)
    params, stats = variables["params"], variables["batch_stats"]
    opt_state, ref_losses, ref_grads = opt.init(params), [], []
    for batch in data[:-1]:
        loss, g, stats = grad(params, stats, batch)
        updates, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        ref_losses.append(float(loss))
        ref_grads.append(g)
    reference = {"params": jax.device_get(params), "batch_stats": jax.device_get(stats)}

    rel = lambda a, b: float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    diff = {k: max(jax.tree.leaves(jax.tree.map(rel, trained[k], reference[k]))) for k in reference}
    num_params = sum(x.size for x in jax.tree.leaves(variables["params"]))
    print(f"model: flax examples/imagenet/models.py ResNet18(num_filters={FILTERS}), unchanged; {num_params:,} "
          f"params, {len(jax.tree.leaves(variables['batch_stats']))} batch_stats arrays; mesh {dict(mesh.shape)}; "
          f"{args.tx} on {step.ownership == 'param' and 'whole parameters per device' or 'flat shards'}")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps (one device: {ref_losses[0]:.4f} -> "
          f"{ref_losses[-1]:.4f})")
    print(f"max relative difference vs one device: params {diff['params']:.2e}, batch_stats {diff['batch_stats']:.2e}")
    print(f"NaN batch skipped, statistics kept bit for bit: {skipped}; checkpoint holds the statistics: "
          f"{checkpointed}")
    return {"step": step, "state": state, "variables": variables, "trained": trained, "losses": losses,
            "reference": (reference, ref_losses, ref_grads), "data": data[:-1], "skipped": skipped,
            "checkpointed": checkpointed, "loss_fn": loss_fn, "module": module, "diff": diff}


if __name__ == "__main__":
    main()
