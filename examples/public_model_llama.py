"""A public model, unchanged, with its own activation constraints: EasyLM's LLaMA.

The model is ``EasyLM/models/llama/llama_model.py`` of young-geng/EasyLM (checked at commit
``fe5b2c354e25d697fce7cd225e23bbbe72570da3``), imported from an EasyLM checkout as it is: no line
of it is edited or copied here. It is a linen LLaMA written for ``pjit`` (global shapes, no
collectives) whose activations are constrained over the batch axes: ``xq``, ``xk``, ``xv`` and
the feed-forward output to ``PS(("dp", "fsdp"), None, "mp")``, the attention weights to
``PS(("dp", "fsdp"), "mp", None, None)``, through EasyLM's ``jax_utils.with_sharding_constraint``,
which applies them only when the mesh of the current ``with mesh:`` context has those axes.

The mesh is EasyLM's own (``LLaMAConfigurator.get_jax_mesh``, axes ``('dp', 'fsdp', 'mp')``) at
``(4, 1, 2)`` on 8 virtual CPU devices (``--mesh 2,2,2`` as well). EasyLM splits the batch over
``('dp', 'fsdp')``, so both are jax_drain's data axes, ``TrainConfig(axis=("dp", "fsdp"))``:
jax_drain splits the batch over them and reduces the gradients over them in its buckets, and XLA
partitions the model over ``mp`` (``tensor_parallel="gspmd"``). The parameter specs are EasyLM's
own partition rules (``LLaMAConfigurator.get_partition_rules()``, matched by its own
``match_partition_rules``) with ``fsdp`` left out: what EasyLM shards over ``fsdp`` (the
parameters, ZeRO-3 style) jax_drain shards over the data axes itself, the optimizer state by
default (ZeRO-1) and the parameters with ``--zero3`` (``TrainConfig(shard_params=True)``).
Inside the step the model's constraints keep their ``mp`` and lose the data axes, which the step
has made manual: each device's block of ``xq`` is constrained to ``(None, None, "mp")``.

``--stages 2`` adds a ``stage`` axis after ``dp`` and pipelines the model's blocks (a list,
``transformer/h/0``..., each under EasyLM's ``nn.remat``: the step stacks them, a share per
stage; each block's copy of the rotary table is one constant), in the ``--schedule`` given.

The step is built and run inside ``with mesh:``, as EasyLM's own trainer does: without it the
model applies none of its constraints (``--context none``: the same numbers, a program without
them). ``jax.set_mesh`` will not do instead: EasyLM's helper reads only the mesh of ``with
mesh:``, and with jax 0.10.2 the model does not even trace inside the step under ``jax.set_mesh``
(its rotary tables are built under ``jax.ensure_compile_time_eval()``, which jax fails to run
inside a ``shard_map`` manual over some axes while ``jax.set_mesh`` is active:
``NotImplementedError: Unhandled OpSharding type``). The script checks that every ``mp``-sharded weight is held as 1/2 blocks on each
device and compares the losses and parameters after ``--steps`` AdamW steps with plain
one-device optax on whole batches (run outside the mesh context). The loss is EasyLM's
``cross_entropy_loss_and_accuracy`` on its batch format (``input_tokens``, ``target_tokens``,
``loss_masks``); dropout is off (as in EasyLM's configs) so that both runs compute one function.

The model file needs ``transformers`` (its Flax classes, gone from transformers 5), ``mlxu``,
``einops`` and ``ml_collections``; jax_drain does not, so install them for this script only::

    pip install 'transformers<5' mlxu einops ml_collections
    git clone https://github.com/young-geng/EasyLM /tmp/EasyLM && python examples/public_model_llama.py --easylm /tmp/EasyLM

Without a clone, the ``EasyLM/`` folder from any EasyLM git directory (e.g. a bare mirror) does
as well::

    mkdir -p /tmp/easylm && git -C EASYLM_GIT archive HEAD EasyLM | tar -x -C /tmp/easylm
    python examples/public_model_llama.py --easylm /tmp/easylm

The loss passes ``attention_mask`` and ``position_ids`` itself, as EasyLM's own ``init_fn`` and
``FlaxLLaMAPreTrainedModel`` do: the module's fallback for a missing ``position_ids`` calls
``jnp.clip(..., a_min=0)``, an argument current jax no longer has.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax_drain as jd  # noqa: E402  (before jax: no CUDA-plugin start-up lines without a GPU)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

BATCH, SEQ, VOCAB, HIDDEN, LAYERS, HEADS, INTERMEDIATE = 16, 16, 256, 64, 2, 4, 128
LR, B2, WD, MAX_NORM = 3e-3, 0.95, 0.1, 1.0  # EasyLM's AdamW defaults for b2 and clipping
MODEL_FILE = "EasyLM/models/llama/llama_model.py"
DATA_AXES = ("dp", "fsdp")  # EasyLM's batch axes: its batches are constrained to PS(("dp", "fsdp"))
#: The mesh contexts the step can be built and run in; EasyLM's ``with_sharding_constraint`` sees
#: the mesh of ``with mesh:`` only.
CONTEXTS = {"with_mesh": lambda mesh: mesh, "none": lambda mesh: contextlib.nullcontext()}


# jax 0.10 deprecates `with mesh:` and jax.experimental.pjit, which EasyLM's helper reads and its
# jax_utils imports: said at every step, and not this script's to change.
warnings.filterwarnings("ignore", r".*mesh.. context manager has been deprecated", DeprecationWarning)
warnings.filterwarnings("ignore", r"jax\.interpreters\.pxla\.thread_resources is deprecated", DeprecationWarning)
warnings.filterwarnings("ignore", r"jax\.experimental\.pjit\.pjit has been deprecated", DeprecationWarning)


def load_easylm(easylm_dir):
    """EasyLM's ``llama_model`` and ``jax_utils`` modules, imported from the checkout unchanged.

    The model file imports ``EasyLM.jax_utils`` and ``EasyLM.bpt`` by package name, so the
    checkout's root goes on ``sys.path``.
    """
    root = pathlib.Path(easylm_dir).resolve()
    if not (root / MODEL_FILE).is_file():
        raise FileNotFoundError(f"{root} holds no {MODEL_FILE}: pass an EasyLM checkout (or its EasyLM/ folder's parent)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    llama = importlib.import_module("EasyLM.models.llama.llama_model")
    utils = importlib.import_module("EasyLM.jax_utils")
    loaded = pathlib.Path(llama.__file__).resolve()
    if loaded != root / MODEL_FILE:
        raise ImportError(f"EasyLM was already imported from {loaded}, not from {root}")
    return llama, utils


def batches(n, seed=1):
    """Token sequences in EasyLM's batch format, something to learn in a few steps: each row counts
    from a random token in a random stride (mod VOCAB), its targets are its inputs shifted by one,
    and ``loss_masks`` leaves out a random tail (at least half the row counts)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        start, stride = rng.integers(0, VOCAB, size=(BATCH, 1)), rng.choice([1, 2, 3, 5], size=(BATCH, 1))
        tokens = ((start + stride * np.arange(SEQ + 1)) % VOCAB).astype(np.int32)
        masks = (np.arange(SEQ) < rng.integers(SEQ // 2, SEQ + 1, size=(BATCH, 1))).astype(np.float32)
        yield {"input_tokens": tokens[:, :-1], "target_tokens": tokens[:, 1:], "loss_masks": masks}


def without_axes(specs, axes):
    """``specs`` (a tree of ``PartitionSpec``) with the mesh axes ``axes`` left out of every entry."""
    def entry(e):
        names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        kept = tuple(a for a in names if a not in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return jax.tree.map(lambda s: P(*map(entry, s)), specs, is_leaf=lambda x: isinstance(x, P))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--easylm", required=True, help=f"an EasyLM checkout (holding {MODEL_FILE})")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mesh", default="4,1,2", help="sizes of EasyLM's mesh axes (dp, fsdp, mp)")
    parser.add_argument("--zero3", action="store_true", help="shard the parameters over the data axes (ZeRO-3)")
    parser.add_argument("--stages", type=int, default=1, help="a stage axis of this size after dp (pipeline)")
    parser.add_argument("--schedule", default="gpipe", help="the pipeline's schedule (with --stages)")
    parser.add_argument("--context", choices=sorted(CONTEXTS), default="with_mesh",
                        help="the mesh context the step is built and run in: with_mesh (EasyLM's trainer's), "
                             "or none, which leaves EasyLM's constraints out")
    args = parser.parse_args(argv)
    llama, utils = load_easylm(args.easylm)
    configurator = llama.LLaMAConfigurator
    config = configurator.finalize_config(configurator.get_default_config(dict(
        base_model="debug", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS * args.stages, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        max_position_embeddings=SEQ)))
    module = llama.FlaxLLaMAForCausalLMModule(config, dtype=jnp.float32, param_dtype=jnp.float32)

    def loss_fn(variables, batch):  # EasyLM's train_step: its loss on the logits, dropout off
        tokens = batch["input_tokens"]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits = module.apply(variables, tokens, jnp.ones_like(tokens), positions, deterministic=True).logits
        loss, _ = utils.cross_entropy_loss_and_accuracy(logits, batch["target_tokens"], batch["loss_masks"])
        return loss  # a mean over sequences: the mean over one device's share is what the step wants

    data = list(batches(args.steps))
    init_tokens = data[0]["input_tokens"][:1]
    init_positions = np.arange(SEQ, dtype=np.int32)[None]
    variables = module.init(jax.random.key(0), init_tokens, np.ones_like(init_tokens), init_positions)
    rules = configurator.get_partition_rules()
    easylm_specs = utils.match_partition_rules(rules, variables)
    specs = without_axes(easylm_specs, DATA_AXES)
    pipeline = {}
    if args.stages > 1:  # ("dp", "stage", "fsdp", "mp"): LLaMA's blocks h/0, h/1... stacked, a share per stage
        dp, fsdp, mp = (int(n) for n in args.mesh.split(","))
        devices = np.array(jax.devices()[:dp * args.stages * fsdp * mp]).reshape(dp, args.stages, fsdp, mp)
        mesh = jax.sharding.Mesh(devices, ("dp", "stage", "fsdp", "mp"))  # Auto axes, as EasyLM's own mesh
        pipeline = dict(stage_axis="stage", pipeline_microbatches=2 * args.stages, pipeline_schedule=args.schedule)
    else:
        mesh = configurator.get_jax_mesh(args.mesh)  # ("dp", "fsdp", "mp")
    decay = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # kernels and embeddings only
    tx = jd.adamw(LR, b2=B2, weight_decay=WD, mask=decay, max_norm=MAX_NORM)
    train_config = jd.TrainConfig(axis=DATA_AXES, param_specs=specs, tensor_parallel="gspmd",
                                  shard_params=args.zero3, bucket_size=8192, **pipeline)
    context = functools.partial(CONTEXTS[args.context], mesh)
    with context():  # with_mesh, as EasyLM's trainer: its constraints apply only under `with mesh:`
        step = jd.make_train_step(variables, loss_fn, tx, mesh, train_config, example_batch=data[0])
        state, losses = step.init(), []
        for batch in data:
            state, metrics = step(state, batch)
            losses.append(float(metrics.loss))

    # (b) each device holds its own block: 1/n of every dimension sharded over mesh axes of size n.
    size = lambda entry: int(np.prod([mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry or ())]))
    blocks, held = {}, 0
    if args.zero3:  # ZeRO-3: each device holds 1/(data x mp) of every flat bucket of parameters
        for x in jax.tree.leaves(state.params):
            got = {s.data.shape for s in x.addressable_shards}
            assert got == {(x.shape[0] // mesh.size,)}, (x.shape, x.sharding.spec, got)
            held += x.shape[0] // mesh.size
    else:
        for path, x in jax.tree_util.tree_leaves_with_path(state.params):
            spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
            want = tuple(d // size(e) for d, e in zip(x.shape, spec))
            got = {s.data.shape for s in x.addressable_shards}
            assert got == {want}, (jax.tree_util.keystr(path), x.shape, spec, got)
            if want != x.shape:
                blocks[jax.tree_util.keystr(path)] = (x.shape, want)

    # (c) the same steps with plain optax on one device, whole batches, float32, no mesh context.
    plain = variables
    ref_tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, b2=B2, weight_decay=WD, mask=decay))
    opt_state, ref_losses, ref_grads, grad = ref_tx.init(plain), [], [], jax.jit(jax.value_and_grad(loss_fn))
    for batch in data:
        loss, g = grad(plain, batch)
        updates, opt_state = ref_tx.update(g, opt_state, plain)
        plain = optax.apply_updates(plain, updates)
        ref_losses.append(float(loss))
        ref_grads.append(g)
    trained = step.master_params(state)
    rel = lambda a, b: float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    param_diff = max(jax.tree.leaves(jax.tree.map(rel, trained, jax.device_get(plain))))
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))

    mode = "ZeRO-3" if args.zero3 else "ZeRO-1"
    print(f"model: EasyLM {MODEL_FILE} FlaxLLaMAForCausalLMModule, unchanged; mesh {dict(mesh.shape)}, "
          f"data axes {DATA_AXES}, {mode}, context {args.context}")
    if args.zero3:
        total = sum(x.size for x in jax.tree.leaves(variables))
        print(f"tensor_parallel={step.tensor_parallel}; each device holds {held} parameter elements of {total} "
              f"(1/{mesh.size} of each bucket)")
    else:
        print(f"tensor_parallel={step.tensor_parallel}; {len(blocks)} weights held as blocks over mp, e.g.")
    for path, (shape, block) in list(blocks.items())[:4]:
        print(f"  {path}: global {shape} -> {block} per device")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps (optax: {ref_losses[0]:.4f} -> "
          f"{ref_losses[-1]:.4f})")
    print(f"max relative difference vs one-device optax: params {param_diff:.2e}, losses {loss_diff:.2e}")
    return {"step": step, "state": state, "losses": losses, "blocks": blocks, "held": held, "param_diff": param_diff,
            "loss_diff": loss_diff, "reference": (plain, ref_losses, ref_grads), "data": data, "variables": variables,
            "loss_fn": loss_fn, "trained": trained, "mesh": mesh, "specs": specs, "easylm_specs": easylm_specs,
            "tx": tx, "config": train_config, "rules": rules, "context": context}


if __name__ == "__main__":
    main()
