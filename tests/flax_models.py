"""Small Flax models with state besides their parameters (batch statistics, RNG counters), in
the three forms the train step takes: an nnx model, a linen variables dict, and an nnx stack
run by ``nnx.scan``; with random batches and their losses."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

B, HW, C, F, CLASSES = 16, 6, 3, 8, 5  # global batch, image side, channels in, features, classes
D, LAYERS = 8, 3  # the scanned stack's width and depth


def image_batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(B, HW, HW, C)).astype(np.float32),
             "y": rng.integers(0, CLASSES, size=B).astype(np.int32)} for _ in range(n)]


def vector_batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(B, D)).astype(np.float32), "y": rng.normal(size=(B, 1)).astype(np.float32)}
            for _ in range(n)]


def xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1))


# -- nnx ---------------------------------------------------------------------------------------


class CNN(nnx.Module):
    """conv -> BatchNorm -> relu -> dropout -> dense. The conv has no bias: BatchNorm removes any
    shift, so its gradient would be zero up to rounding."""

    def __init__(self, *, axis_name, dropout, rngs):
        self.conv = nnx.Conv(C, F, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(F, axis_name=axis_name, momentum=0.8, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(F * HW * HW, CLASSES, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.norm(self.conv(x)))
        return self.head(self.drop(h).reshape(x.shape[0], -1))


def cnn_loss(model: CNN, batch) -> jax.Array:
    return xent(model(batch["x"]), batch["y"])


class Block(nnx.Module):
    def __init__(self, *, axis_name, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.norm = nnx.BatchNorm(D, axis_name=axis_name, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, h):
        return h + self.drop(jnp.tanh(self.norm(self.lin(h))))


class Stack(nnx.Module):
    """``LAYERS`` blocks stacked and run by ``nnx.scan``: each layer has its own batch
    statistics and dropout stream (state with a leading layer axis), then a dense head."""

    def __init__(self, *, axis_name, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return Block(axis_name=axis_name, rngs=rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, block):
            return block(h)

        return self.head(body(x, self.blocks))


def stack_loss(model: Stack, batch) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


# -- linen -------------------------------------------------------------------------------------


class LinenResNet(nn.Module):
    """A residual block in the ResNet manner: conv -> BatchNorm -> relu -> conv -> BatchNorm,
    added to its input, relu, global mean pool, dense head."""

    axis_name: str | None = "data"
    features: int = F
    classes: int = CLASSES

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, axis_name=self.axis_name)
        h = nn.relu(norm()(nn.Conv(self.features, (3, 3), use_bias=False)(x)))
        y = norm()(nn.Conv(self.features, (3, 3), use_bias=False)(h))
        h = nn.relu(h + y)
        return nn.Dense(self.classes)(jnp.mean(h, axis=(1, 2)))


def linen_variables(module: LinenResNet, seed: int = 0) -> dict:
    """``module.init`` in eval mode (no cross-device mean to bind): ``{"params", "batch_stats"}``."""
    return module.init(jax.random.key(seed), jnp.zeros((1, HW, HW, C)), train=False)


def linen_loss(module: LinenResNet):
    """``loss_fn(variables, batch) -> (loss, updates)``, as ``make_train_step(mutable=["batch_stats"])``
    takes it."""

    def loss_fn(variables, batch):
        logits, updates = module.apply(variables, batch["x"], train=True, mutable=["batch_stats"])
        return xent(logits, batch["y"]), updates

    return loss_fn
