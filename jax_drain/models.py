"""GPT model presets (flax.nnx), used downstream in functional form.

The models are ordinary ``nnx.Module``s, but the planner, benchmarks and
examples only see a *params pytree* (a nested dict of plain arrays, or of
``jax.ShapeDtypeStruct``s) and a pure ``loss(params, batch) -> f32 scalar``, so
that the loss can be differentiated inside ``jax.shard_map``, compiled from
abstract inputs and its gradient bucketed leaf by leaf.

Example::

    cfg = preset("tiny-tied")
    params = init_params(cfg, jax.random.key(0))
    loss = make_loss(cfg)
    grads = jax.grad(loss)(params, example_batch(cfg, 4, jax.random.key(1)))

Leaves are ordered by sorted dict keys (``blocks`` < ``embed`` < ``ln_f``),
not in forward order; the backward order is derived elsewhere from the traced
loss.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from flax import nnx

from jax_drain.layout import leaf_paths

__all__ = [
    "GPTConfig",
    "PRESETS",
    "preset",
    "GPT",
    "init_params",
    "abstract_params",
    "make_forward",
    "make_loss",
    "example_batch",
    "tensor_parallel_specs",
    "leaf_paths",
]

# A nested dict ``{"blocks": {0: {"attn": {"qkv": {"kernel": ...}}}}, ...}``
# whose leaves are arrays or ShapeDtypeStructs.
Params = dict[str, Any]
Batch = dict[str, Any]

_INIT_STD = 0.02  # GPT-2 initialisation


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a pre-LayerNorm GPT.

    ``vocab_size=None`` is a bare block stack whose input is activations
    ``[B, S, d]``; an int adds a token embedding that is tied with the output
    head. ``param_dtype`` is normalised to a ``jnp.dtype``.

    Example::

        >>> GPTConfig(num_layers=2, d_model=256, num_heads=4, seq_len=64).num_params()
        1575424
    """

    num_layers: int = 8
    d_model: int = 2048
    num_heads: int = 16
    seq_len: int = 512
    mlp_ratio: int = 4
    vocab_size: int | None = None
    param_dtype: jnp.dtype = jnp.bfloat16
    remat: bool = True
    scan_layers: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "d_model", "num_heads", "seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                "pick num_heads that divides d_model"
            )
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size < 2):
            raise ValueError(
                f"vocab_size must be None (block stack) or an int >= 2, got {self.vocab_size!r}"
            )
        dtype = jnp.dtype(self.param_dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"param_dtype must be a floating dtype such as jnp.bfloat16, got {dtype}")
        # Canonical dtype so that equal configs compare and hash equal.
        object.__setattr__(self, "param_dtype", dtype)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def tied(self) -> bool:
        """Whether the model has a (tied) token embedding and output head."""
        return self.vocab_size is not None

    def num_params(self) -> int:
        """Closed-form parameter count.

        Example::

            >>> preset("gpt-blocks").num_params()
            402722816
        """
        d = self.d_model
        # qkv (3d^2) + attention out (d^2) + MLP (2 * ratio * d^2) + 2 LayerNorms (scale, bias).
        per_block = (4 + 2 * self.mlp_ratio) * d * d + 4 * d
        final_norm = 2 * d
        embedding = (self.vocab_size or 0) * d
        return self.num_layers * per_block + final_norm + embedding


_TINY = GPTConfig(num_layers=2, d_model=256, num_heads=4, seq_len=64)

PRESETS: dict[str, GPTConfig] = {
    "gpt-blocks": GPTConfig(),
    "gpt-tied": GPTConfig(vocab_size=32768),
    # gpt-blocks with its blocks stacked and run by nnx.scan (jax_drain.ScanGradSync's model).
    "gpt-blocks-scan": GPTConfig(scan_layers=True),
    "tiny": _TINY,
    "tiny-tied": dataclasses.replace(_TINY, vocab_size=512),
}


def preset(name: str) -> GPTConfig:
    """The preset config called ``name``.

    Example::

        >>> preset("tiny").d_model
        256
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of {sorted(PRESETS)} "
            "or build a GPTConfig directly"
        ) from None


def _linear(d_in: int, d_out: int, config: GPTConfig, rngs: nnx.Rngs, std: float = _INIT_STD) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=False,
        dtype=config.param_dtype,
        param_dtype=config.param_dtype,
        kernel_init=nnx.initializers.normal(std),
        rngs=rngs,
    )


def _layer_norm(config: GPTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # nnx.LayerNorm computes its statistics and the normalisation in float32
    # and casts the result back to `dtype`.
    return nnx.LayerNorm(
        config.d_model, dtype=config.param_dtype, param_dtype=config.param_dtype, rngs=rngs
    )


class Attention(nnx.Module):
    """Causal multi-head self-attention with a fused qkv projection, no biases."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        d = config.d_model
        self.num_heads = config.num_heads
        self.qkv = _linear(d, 3 * d, config, rngs)
        # GPT-2: scale residual-branch outputs so the residual stream does not grow with depth.
        self.out = _linear(d, d, config, rngs, std=_INIT_STD / math.sqrt(2 * config.num_layers))

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq, d = x.shape
        qkv = self.qkv(x).reshape(batch, seq, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        # The XLA implementation takes logits and softmax in float32 even for
        # bf16 inputs; pinning it keeps memory benchmarks independent of cuDNN.
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return self.out(y.reshape(batch, seq, d))


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        d, hidden = config.d_model, config.mlp_ratio * config.d_model
        self.fc_in = _linear(d, hidden, config, rngs)
        self.fc_out = _linear(hidden, d, config, rngs, std=_INIT_STD / math.sqrt(2 * config.num_layers))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc_out(jax.nn.gelu(self.fc_in(x)))


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.ln_attn = _layer_norm(config, rngs)
        self.attn = Attention(config, rngs=rngs)
        self.ln_mlp = _layer_norm(config, rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


def _apply_block(block: Block, x: jax.Array) -> jax.Array:
    return block(x)


# Saves only the block inputs; everything inside a block is recomputed in backward.
_remat_block = nnx.remat(_apply_block)


class GPT(nnx.Module):
    """The GPT of ``config``; see :func:`make_forward` for what ``__call__`` takes.

    Parameter paths: ``blocks/<i>/{ln_attn,attn/qkv,attn/out,ln_mlp,mlp/fc_in,mlp/fc_out}/...``,
    ``ln_f/{scale,bias}`` and, with a vocabulary, ``embed/embedding``. With
    ``scan_layers=True`` the blocks are one stacked module (``blocks/attn/qkv/kernel``
    has a leading ``num_layers`` axis) run by ``nnx.scan``.

    Example::

        model = GPT(preset("tiny"), rngs=nnx.Rngs(0))
        y = model(jnp.zeros((2, 64, 256), jnp.bfloat16))
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.config = config
        if config.tied:
            self.embed = nnx.Embed(
                config.vocab_size,
                config.d_model,
                dtype=config.param_dtype,
                param_dtype=config.param_dtype,
                embedding_init=nnx.initializers.normal(_INIT_STD),
                rngs=rngs,
            )
        if config.scan_layers:

            @nnx.split_rngs(splits=config.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked_blocks(rngs: nnx.Rngs) -> Block:
                return Block(config, rngs=rngs)

            self.blocks = stacked_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.ln_f = _layer_norm(config, rngs)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Block stack: activations ``[B, S, d]`` -> final-LN'd ``[B, S, d]``.
        Tied: int tokens ``[B, S]`` -> float32 logits ``[B, S, vocab]``."""
        config = self.config
        if config.tied:
            if not jnp.issubdtype(inputs.dtype, jnp.integer):
                raise TypeError(f"a model with a vocabulary takes int token ids, got {inputs.dtype}")
            h = self.embed(inputs)
        else:
            h = inputs.astype(config.param_dtype)
        h = self.ln_f(self._blocks(h))
        if not config.tied:
            return h
        # Second use of the embedding table: its gradient is complete only at
        # the very end of backward, after the input embedding's contribution.
        table = self.embed.embedding[...]
        return jnp.einsum("bsd,vd->bsv", h, table, preferred_element_type=jnp.float32)

    def _blocks(self, h: jax.Array) -> jax.Array:
        apply = _remat_block if self.config.remat else _apply_block
        if self.config.scan_layers:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def scan_step(h: jax.Array, block: Block) -> jax.Array:
                return apply(block, h)

            return scan_step(h, self.blocks)
        for block in self.blocks:
            h = apply(block, h)
        return h

    def loss(self, batch: Batch) -> jax.Array:
        """Float32 scalar mean loss: MSE against ``batch["y"]`` for a block stack,
        next-token cross-entropy on ``batch["tokens"]`` with a vocabulary."""
        if not self.config.tied:
            out = self(batch["x"])
            return jnp.mean(jnp.square(out.astype(jnp.float32) - batch["y"].astype(jnp.float32)))
        tokens = batch["tokens"]
        logits = self(tokens[:, :-1])
        targets = tokens[:, 1:]
        target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logits)


def _abstract_model(config: GPTConfig) -> GPT:
    return nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))


def _param_dict(model: GPT) -> Params:
    # nnx.State flattens to arrays too, but its key paths end in `.value`
    # (Variables are pytree nodes); a pure dict gives clean paths.
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def init_params(config: GPTConfig, key: jax.Array) -> Params:
    """Freshly initialised parameters: a nested dict of arrays in ``config.param_dtype``.

    Example::

        params = init_params(preset("tiny"), jax.random.key(0))
        params["blocks"][0]["attn"]["qkv"]["kernel"].shape  # (256, 768)
    """
    return _param_dict(GPT(config, rngs=nnx.Rngs(key)))


def abstract_params(config: GPTConfig) -> Params:
    """:func:`init_params`'s pytree with ``jax.ShapeDtypeStruct`` leaves; allocates nothing.

    Example::

        shapes = abstract_params(preset("gpt-blocks"))
        sum(math.prod(s.shape) for s in jax.tree.leaves(shapes))  # 402722816
    """
    return _param_dict(_abstract_model(config))


def _model_builder(config: GPTConfig) -> Callable[[Params], GPT]:
    """A function that rebuilds the model around a params pytree (traced or concrete)."""
    abstract = _abstract_model(config)
    graphdef, state = nnx.split(abstract, nnx.Param)
    expected = jax.tree.structure(nnx.to_pure_dict(state))

    def build(params: Params) -> GPT:
        # nnx.merge matches a pure dict by sorted key order, not by name, so a
        # wrong tree would silently mis-assign leaves: check it first.
        if jax.tree.structure(params) != expected:
            raise ValueError(
                "params do not match this GPTConfig; build them with init_params(config, key) "
                f"or abstract_params(config) for the same config.\nexpected {expected}\ngot      "
                f"{jax.tree.structure(params)}"
            )
        return nnx.merge(graphdef, params)

    return build


def make_forward(config: GPTConfig) -> Callable[[Params, jax.Array], jax.Array]:
    """Pure ``forward(params, inputs)``, the model's ``__call__``.

    Block stack: activations ``[B, S, d]`` -> final-LN'd activations ``[B, S, d]``.
    With a vocabulary: int tokens ``[B, S]`` -> float32 logits ``[B, S, vocab]``.

    Example::

        cfg = preset("tiny-tied")
        logits = make_forward(cfg)(init_params(cfg, jax.random.key(0)), jnp.zeros((2, 64), jnp.int32))
    """
    build = _model_builder(config)

    def forward(params: Params, inputs: jax.Array) -> jax.Array:
        return build(params)(inputs)

    return forward


def make_loss(config: GPTConfig) -> Callable[[Params, Batch], jax.Array]:
    """Pure ``loss(params, batch) -> float32 scalar`` (mean over the local batch).

    Differentiable w.r.t. ``params``, traceable with ``ShapeDtypeStruct`` params
    and usable inside ``jax.shard_map`` on a per-device batch.

    Example::

        cfg = preset("tiny")
        loss = make_loss(cfg)
        value, grads = jax.value_and_grad(loss)(
            init_params(cfg, jax.random.key(0)), example_batch(cfg, 4, jax.random.key(1))
        )
    """
    build = _model_builder(config)

    def loss(params: Params, batch: Batch) -> jax.Array:
        return build(params).loss(batch)

    return loss


#: Megatron's split of a block: these matrices by columns (their output features) ...
_COLUMN_PARALLEL = ("attn/qkv/kernel", "mlp/fc_in/kernel")
#: ... and these by rows, so that each block needs one sum over the model axis per sublayer.
_ROW_PARALLEL = ("attn/out/kernel", "mlp/fc_out/kernel")


def tensor_parallel_specs(params: Params, axis: str = "model") -> Any:
    """Megatron's tensor-parallel split of a GPT's parameters over ``axis``: ``qkv`` and
    ``fc_in`` by columns, the attention's ``out`` and ``fc_out`` by rows; embeddings and norms
    replicated. A scanned stack's leading layer axis is never split. Pass it as
    ``TrainConfig(tensor_parallel="gspmd", param_specs=...)`` (the model's loss is written for
    global shapes) or to the planner's ``param_specs``.

    Example::

        >>> specs = tensor_parallel_specs(abstract_params(preset("tiny")))
        >>> specs["blocks"][0]["mlp"]["fc_in"]["kernel"], specs["blocks"][0]["mlp"]["fc_out"]["kernel"]
        (P(None, 'model'), P('model', None))
    """
    def spec(path: Any, leaf: Any) -> P:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        if name.endswith(_COLUMN_PARALLEL):
            return P(*([None] * (len(leaf.shape) - 1)), axis)
        if name.endswith(_ROW_PARALLEL):
            return P(*([None] * (len(leaf.shape) - 2)), axis, None)
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


def example_batch(config: GPTConfig, batch_size: int, key: jax.Array | None = None) -> Batch:
    """A batch for :func:`make_loss`: random arrays if ``key`` is given, else ShapeDtypeStructs.

    Block stack: ``{"x", "y"}`` of shape ``[batch_size, seq_len, d_model]`` in
    ``param_dtype``; with a vocabulary: ``{"tokens"}`` int32 ``[batch_size, seq_len + 1]``.

    Example::

        example_batch(preset("tiny-tied"), 8)["tokens"]  # ShapeDtypeStruct((8, 65), int32)
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if config.tied:
        spec = {"tokens": jax.ShapeDtypeStruct((batch_size, config.seq_len + 1), jnp.int32)}
    else:
        act = jax.ShapeDtypeStruct((batch_size, config.seq_len, config.d_model), config.param_dtype)
        spec = {"x": act, "y": act}
    if key is None:
        return spec
    if config.tied:
        tokens = spec["tokens"]
        return {"tokens": jax.random.randint(key, tokens.shape, 0, config.vocab_size, tokens.dtype)}
    key_x, key_y = jax.random.split(key)
    return {
        "x": jax.random.normal(key_x, spec["x"].shape, spec["x"].dtype),
        "y": jax.random.normal(key_y, spec["y"].shape, spec["y"].dtype),
    }
