"""Your own model in the planner: a small decoder-only transformer in plain JAX.

The planner needs three things from a module, all without allocating anything:

* ``loss(params, batch)``: the mean loss of one device's part of the batch;
* ``params()``: the parameters, global shapes, as ``jax.ShapeDtypeStruct`` (or arrays);
* ``batch()``: one step's global batch (every device's), split over the devices along its
  leading axis.

    python -m jax_drain.plan --loss examples/plan_my_model.py:loss \\
        --params examples/plan_my_model.py:params --batch examples/plan_my_model.py:batch

compiles the gradient step for 8 compile-only H100s once per strategy (plain ``jax.jit``, no
communication, jax_drain's fp32-accumulated reduce-scatter undrained, drained and streamed) and
says whether the activations or the gradient sync set the peak. ``params`` and ``batch`` take
keyword arguments with defaults, so the planner's ``--layers``, ``--d-model``, ``--seq`` and
``--micro-batch`` reach them (and it passes ``num_devices``); without such keywords they are
plain zero-argument functions. ``param_specs`` splits the model over a ``"model"`` axis too
(``--model-axis model=2 --param-specs examples/plan_my_model.py:param_specs``).
"""

import jax
import jax.numpy as jnp

LAYERS = 6
D_MODEL = 768
HEAD_DIM = 64
VOCAB = 16384
SEQ = 256
MICRO_BATCH = 4  # sequences per device
DTYPE = jnp.bfloat16


def _spec(*shape: int, dtype=DTYPE) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def params(layers: int = LAYERS, d_model: int = D_MODEL) -> dict:
    """Abstract parameters: token embedding, pre-norm blocks (attention, 4x MLP), unembedding."""
    block = lambda: {
        "norm_attn": _spec(d_model, dtype=jnp.float32),
        "qkv": _spec(d_model, 3 * d_model),
        "proj": _spec(d_model, d_model),
        "norm_mlp": _spec(d_model, dtype=jnp.float32),
        "up": _spec(d_model, 4 * d_model),
        "down": _spec(4 * d_model, d_model),
    }
    return {
        "embed": _spec(VOCAB, d_model),
        "blocks": [block() for _ in range(layers)],
        "norm_out": _spec(d_model, dtype=jnp.float32),
        "unembed": _spec(d_model, VOCAB),
    }


def param_specs(params: dict) -> dict:
    """Tensor parallel over a ``"model"`` axis, Megatron's way: ``qkv`` and ``up`` split by
    columns, ``proj`` and ``down`` by rows, the embeddings over the vocabulary; for
    ``--model-axis model=2 --param-specs examples/plan_my_model.py:param_specs``."""
    from jax.sharding import PartitionSpec as P

    columns, rows = P(None, "model"), P("model", None)
    block = {"norm_attn": P(), "qkv": columns, "proj": rows, "norm_mlp": P(), "up": columns, "down": rows}
    return {"embed": rows, "blocks": [block] * len(params["blocks"]), "norm_out": P(), "unembed": columns}


def batch(micro_batch: int = MICRO_BATCH, seq: int = SEQ, num_devices: int = 8) -> dict:
    """The global batch: ``micro_batch`` sequences of ``seq + 1`` tokens per device."""
    return {"tokens": _spec(micro_batch * num_devices, seq + 1, dtype=jnp.int32)}


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 ** 2, axis=-1, keepdims=True) + 1e-6) * scale).astype(x.dtype)


def _positions(seq: int, d_model: int) -> jax.Array:
    pos = jnp.arange(seq, dtype=jnp.float32)[:, None]
    freq = jnp.exp(-jnp.log(10000.0) * jnp.arange(0, d_model, 2, dtype=jnp.float32) / d_model)
    return jnp.concatenate([jnp.sin(pos * freq), jnp.cos(pos * freq)], axis=-1).astype(DTYPE)


def _block(p: dict, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    heads = d // HEAD_DIM
    q, k, v = jnp.split(_norm(x, p["norm_attn"]) @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, HEAD_DIM) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / HEAD_DIM ** 0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(x.dtype)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d) @ p["proj"]
    return x + jax.nn.gelu(_norm(x, p["norm_mlp"]) @ p["up"]) @ p["down"]


def loss(params: dict, batch: dict) -> jax.Array:
    """Next-token cross-entropy, mean over this device's tokens; each block rematerialised."""
    tokens = batch["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs] + _positions(inputs.shape[1], params["embed"].shape[1])
    for p in params["blocks"]:
        x = jax.checkpoint(_block)(p, x)
    logits = (_norm(x, params["norm_out"]) @ params["unembed"]).astype(jnp.float32)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logits)
