"""Train a small character-level GPT with jax_drain: the main job of the README and docs/examples.md.

Data parallel over 8 virtual CPU devices by default (set up here, before jax starts): bucketed,
drained, fp32-accumulated gradient reduce-scatter, a sharded AdamW (``DistributedOptimizer``)
with weight decay on matrices only and global-norm clipping, and the parameter all-gather chain.
The corpus is ``examples/data/python_docstrings.txt`` (see the README there).

    python examples/train_gpt.py --steps 600 --out runs/gpt                 # about 2-3 minutes
    python examples/train_gpt.py --steps 600 --no-drain --out runs/gpt-nodrain
    python examples/train_gpt.py --steps 600 --reduce bf16 --out runs/gpt-bf16 \\
        --compare runs/gpt runs/gpt-nodrain                                    # overlays the curves
    python examples/train_gpt.py --steps 600 --scan-layers --out runs/gpt-scan --compare runs/gpt
    python examples/train_gpt.py --param-dtype float32 --working-dtype bfloat16 \
        --reduce int8_accum --error-feedback --out runs/gpt-int8 --compare runs/gpt

``--scan-layers`` runs the blocks under ``nnx.scan`` over stacked parameters (same initial
weights as the unrolled model of the same seed) and syncs them with ``ScanGradSync``: each
layer's gradient is reduce-scattered inside the backward scan.

``--param-dtype float32 --working-dtype bfloat16`` is the usual Flax model (float32 params)
trained under a precision policy: bf16 forward, backward and all-gather, float32 master shards.
``--reduce int8_accum --error-feedback`` sends int8 gradients with per-block scales and feeds
each device's rounding error into its next gradient.

Writes ``OUT/losses.json`` (the loss of every step) and ``OUT/loss.png``. With
``--checkpoint-every N`` it saves ``OUT/checkpoints`` every N steps; ``--resume`` continues from
the newest one, giving the same losses as an uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

DATA = pathlib.Path(__file__).resolve().parent / "data" / "python_docstrings.txt"
ADAM_BETAS = (0.9, 0.95)  # b1, b2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="optimizer steps")
    p.add_argument("--reduce", default="fp32_accum",
                   help="GradSync reduce mode: bf16, fp32, fp32_accum, fp32_accum_streamed, int8_accum, fp8_accum, "
                        "int8_accum_streamed")
    p.add_argument("--error-feedback", action="store_true",
                   help="feed each device's wire rounding error into its next gradient (lossy wires)")
    p.add_argument("--no-drain", action="store_true", help="do not chain the bucket collectives")
    p.add_argument("--scan-layers", action="store_true",
                   help="nnx.scan over the blocks; per-layer reduce-scatter inside the backward scan (ScanGradSync)")
    p.add_argument("--microbatches", type=int, default=1, help="gradient accumulation steps per optimizer step")
    p.add_argument("--bucket-size", type=int, default=100_000, help="elements per gradient bucket")
    p.add_argument("--out", default="runs/train_gpt", help="output directory")
    p.add_argument("--devices", type=int, default=8, help="data-parallel devices (virtual CPU devices)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch, sequences")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the model's own dtype")
    p.add_argument("--working-dtype", default=None, choices=["bfloat16"],
                   help="TrainConfig(param_dtype=...): train a float32 model with bf16 working params, "
                        "float32 master shards")
    p.add_argument("--wire-dtype", default=None, choices=["bfloat16"],
                   help="TrainConfig(wire_dtype=...): the dtype gradients travel in (float32 sums)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, then cosine)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient norm clip")
    p.add_argument("--muon", action="store_true",
                   help="Muon for the matrices, AdamW for the rest (optax.multi_transform): each device updates "
                        "whole parameters (TrainConfig ownership='param', chosen by the step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT/checkpoints")
    p.add_argument("--sample", type=int, default=200, help="characters to sample at the end (0: none)")
    p.add_argument("--compare", nargs="*", default=[], metavar="DIR", help="other runs' OUT dirs to overlay in loss.png")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def setup_devices(n: int) -> None:
    """Virtual CPU devices; only effective before jax initialises its backends."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


class Corpus:
    """The text as int32 character ids; batches are a pure function of (seed, step)."""

    def __init__(self, path: pathlib.Path):
        text = path.read_text(encoding="ascii")
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        import numpy as np

        self.ids = np.frombuffer(text.encode("ascii"), np.uint8)
        lookup = np.zeros(256, np.int32)
        lookup[[ord(c) for c in self.chars]] = np.arange(len(self.chars))
        self.ids = lookup[self.ids]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int):
        import numpy as np

        rng = np.random.default_rng([seed, step])  # resumable: no hidden iterator state
        starts = rng.integers(0, len(self.ids) - seq_len - 1, size=batch_size)
        return {"tokens": np.stack([self.ids[s : s + seq_len + 1] for s in starts])}

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class Progress:
    """A one-line progress bar on stderr (``\\r``), with a log line every ``log_every`` steps."""

    def __init__(self, total: int, start: int, log_every: int):
        self.total, self.start, self.log_every = total, start, log_every
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, step: int, losses: list[float]) -> None:
        done = step - self.start
        rate = done / max(time.perf_counter() - self.t0, 1e-9)
        recent = losses[-self.log_every :]
        avg = sum(recent) / len(recent)
        if self.tty:
            width = 30
            filled = int(width * step / self.total)
            eta = (self.total - step) / rate if rate else float("nan")
            sys.stderr.write(
                f"\r[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} loss {losses[-1]:.4f} "
                f"{rate:.2f} steps/s eta {eta:.0f}s "
            )
            sys.stderr.flush()
        if step % self.log_every == 0 or step == self.total:
            if self.tty:
                sys.stderr.write("\n")
            print(f"step {step:5d}/{self.total}  loss {losses[-1]:.4f}  mean(last {len(recent)}) {avg:.4f}  "
                  f"{rate:.2f} steps/s", flush=True)


def build_model(config, vocab_size: int, seed: int):
    """A character GPT: jax_drain.models.GPT's block stack (``vocab_size=None``) between token +
    learned position embeddings and an output head tied to the token embedding.

    With ``config.scan_layers`` the blocks are one stacked module run by ``nnx.scan``; its
    weights are copied from the unrolled model of the same ``seed`` (``nnx.vmap`` would draw
    other random numbers), so both variants start from the same point.
    """
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_drain.models import GPT

    class CharGPT(nnx.Module):
        def __init__(self, config, rngs: nnx.Rngs):
            d, dtype = config.d_model, config.param_dtype
            init = nnx.initializers.normal(0.02)
            self.embed = nnx.Embed(vocab_size, d, dtype=dtype, param_dtype=dtype, embedding_init=init, rngs=rngs)
            self.position = nnx.Param(init(rngs.params(), (config.seq_len, d), dtype))
            self.body = GPT(config, rngs=rngs)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            h = self.embed(tokens) + self.position[...][: tokens.shape[1]]
            h = self.body(h)
            return jnp.einsum("bsd,vd->bsv", h, self.embed.embedding[...], preferred_element_type=jnp.float32)

        def loss(self, batch) -> jax.Array:
            tokens = batch["tokens"]
            logits = self(tokens[:, :-1])
            target = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)

    model = CharGPT(config, nnx.Rngs(seed))
    if config.scan_layers:
        twin = CharGPT(dataclasses.replace(config, scan_layers=False), nnx.Rngs(seed))
        unrolled = nnx.to_pure_dict(nnx.state(twin, nnx.Param))
        blocks = unrolled["body"]["blocks"]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[blocks[i] for i in range(config.num_layers)])
        params = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(params, {**unrolled, "body": {**unrolled["body"], "blocks": stacked}})
        nnx.update(model, params)
    return model


def model_config(args: argparse.Namespace):
    """The ``jax_drain.models.GPTConfig`` of the blocks of a run with ``args``."""
    import jax.numpy as jnp

    from jax_drain.models import GPTConfig

    return GPTConfig(
        num_layers=args.layers, d_model=args.d_model, num_heads=args.heads, seq_len=args.seq_len,
        param_dtype=jnp.dtype(args.param_dtype), remat=False, scan_layers=args.scan_layers,
    )


def optimizer(args: argparse.Namespace):
    """``(tx, schedule)`` of a run with ``args``: global-norm clipping, Adam (``ADAM_BETAS``), weight
    decay on every leaf but the LayerNorms', and the learning rate ``schedule`` (of the step
    count from 0: linear warmup from 0, then cosine decay to a tenth)."""
    import jax_drain as jd  # before jax: no CUDA-plugin start-up lines without a GPU

    import jax
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=max(1, args.steps // 20), decay_steps=args.steps, end_value=args.lr / 10
    )
    # No decay on LayerNorm scales/biases. By name, not ndim > 1: with --scan-layers they are
    # stacked [layers, d] (the unrolled model's matrices are exactly its non-norm leaves).
    matrices = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: not any(str(getattr(k, "key", "")).startswith("ln_") for k in path), params)
    if args.muon:
        # Muon needs each matrix whole: the step runs tx per owner and clips with TrainConfig(max_grad_norm).
        # The embeddings and the head stay with AdamW, as Muon's authors use it.
        labels = lambda params: jax.tree_util.tree_map_with_path(
            lambda path, x: "muon" if x.ndim == 2 and not any(str(getattr(k, "key", "")) in ("embed", "pos", "head")
                                                              for k in path) else "adamw", params)
        muon = optax.contrib.muon(schedule, beta=0.95, weight_decay=args.weight_decay)
        adamw = optax.adamw(schedule, *ADAM_BETAS, weight_decay=args.weight_decay, mask=matrices)
        return optax.multi_transform({"muon": muon, "adamw": adamw}, labels), schedule
    tx = optax.chain(
        jd.clip_by_global_norm(args.clip),
        optax.scale_by_adam(*ADAM_BETAS),
        jd.masked(optax.add_decayed_weights(args.weight_decay), matrices),
        optax.scale_by_learning_rate(schedule),
    )
    return tx, schedule


def plot(losses: list[float], out: pathlib.Path, title: str, compare: list[str]) -> pathlib.Path | None:
    """Writes ``out/loss.png`` (with the ``compare`` runs overlaid); returns its path, or None
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'jax_drain[plot]'): skipping loss.png")
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    curves = [(str(out.name), losses)] + [
        (pathlib.Path(d).name, json.loads((pathlib.Path(d) / "losses.json").read_text())) for d in compare
    ]
    for k, (name, values) in enumerate(curves):
        window = max(1, len(values) // 50)
        smooth = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                  for i in range(len(values))]
        # Distinct line styles keep identical curves (drained vs undrained) visible.
        line, = ax.plot(range(1, len(values) + 1), smooth, linestyle=("-", "--", ":", "-.")[k % 4],
                        label=f"{name} (mean of {window})")
        ax.plot(range(1, len(values) + 1), values, color=line.get_color(), alpha=0.2, linewidth=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / character)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)
    return out / "loss.png"


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    setup_devices(args.devices)

    import jax_drain as jd  # before jax: no CUDA-plugin start-up lines without a GPU

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh

    devices = jax.devices()
    if len(devices) < args.devices:
        raise SystemExit(
            f"asked for {args.devices} devices but jax sees {len(devices)} ({devices[0].platform}); "
            "jax was initialised before this script could set XLA_FLAGS, or use --devices"
        )
    mesh = Mesh(np.array(devices[: args.devices]), ("data",))
    corpus = Corpus(DATA)
    config = model_config(args)
    model = build_model(config, corpus.vocab_size, args.seed)
    tx, _ = optimizer(args)
    train_config = jd.TrainConfig(
        bucket_size=args.bucket_size, reduce=args.reduce, drain=not args.no_drain,
        microbatches=args.microbatches, scan_layers=args.scan_layers, error_feedback=args.error_feedback,
        param_dtype=args.working_dtype, wire_dtype=args.wire_dtype,
        max_grad_norm=args.clip if args.muon else None,
    )
    example = corpus.batch(0, args.batch_size, args.seq_len, args.seed)
    step_fn = jd.make_train_step(model, lambda m, b: m.loss(b), tx, mesh, train_config, example_batch=example)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / "checkpoints"
    losses: list[float] = []
    if args.resume and jd.checkpoint.latest_step(ckpt_dir) is not None:
        state, extra = jd.restore_checkpoint(ckpt_dir, step_fn.abstract_state())
        losses = list(extra["losses"])
        print(f"resumed from {ckpt_dir} at step {int(state.step)}")
    else:
        state = step_fn.init()
    start = int(state.step)

    memory = step_fn.optimizer.memory_summary()
    num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"GPT {config.num_layers}x{config.d_model}, vocab {corpus.vocab_size}, {num_params:,} params "
          f"({args.param_dtype}); {len(corpus.ids):,} characters; mesh {dict(mesh.shape)}")
    if args.scan_layers:
        print(f"{step_fn.sync!r}\n  buckets (elements): {list(step_fn.sync.layer_bucket_sizes)} per layer "
              f"x {step_fn.sync.num_layers}, {list(step_fn.sync.rest_bucket_sizes)} other")
    else:
        print(f"{step_fn.sync!r}\n  buckets (elements): {list(step_fn.sync.bucket_sizes)}")
    print(f"optimizer state per device: {memory['distributed']:,} bytes vs {memory['replicated']:,} "
          f"replicated (fp32 master + adam) = {memory['ratio']:.3f}x")

    progress = Progress(args.steps, start, args.log_every)
    t0 = time.perf_counter()
    for i in range(start, args.steps):
        state, metrics = step_fn(state, corpus.batch(i, args.batch_size, args.seq_len, args.seed))
        losses.append(float(metrics.loss))  # syncs every step: fine at this size, and the bar needs it
        if not math.isfinite(losses[-1]):
            raise SystemExit(f"loss became {losses[-1]} at step {i + 1}")
        progress.update(i + 1, losses)
        if args.checkpoint_every and (i + 1) % args.checkpoint_every == 0:
            jd.save_checkpoint(ckpt_dir, state, extra={"losses": losses})
    wall = time.perf_counter() - t0

    (out / "losses.json").write_text(json.dumps(losses))
    title = (f"char GPT {config.num_layers}x{config.d_model} on {args.devices} devices: reduce={args.reduce}, "
             f"drain={not args.no_drain}, microbatches={args.microbatches}, bucket_size={args.bucket_size}"
             f"{', scan_layers' if args.scan_layers else ''}{', error feedback' if args.error_feedback else ''}")
    png = plot(losses, out, title, args.compare)
    if losses:
        head = losses[: min(10, len(losses))]
        tail = losses[-min(50, len(losses)) :]
        print(f"loss {sum(head) / len(head):.4f} (first {len(head)} steps) -> {sum(tail) / len(tail):.4f} "
              f"(last {len(tail)}); {args.steps - start} steps in {wall:.1f}s")
    print(f"wrote {out / 'losses.json'}" + (f" and {png}" if png else "")
          + (f"; checkpoints in {ckpt_dir}" if args.checkpoint_every else ""))

    if args.sample:
        step_fn.update_model(model, state)
        nnx.update(model, jax.device_put(nnx.state(model), devices[0]))  # sample on one device
        forward = nnx.jit(lambda m, tokens: m(tokens))
        context = corpus.batch(10**6, 1, args.seq_len, args.seed)["tokens"][0, : args.seq_len].tolist()
        generated = []
        key = jax.random.key(args.seed)
        for _ in range(args.sample):
            logits = forward(model, jnp.asarray([context[-args.seq_len :]], jnp.int32))[0, -1]
            key, sub = jax.random.split(key)
            token = int(jax.random.categorical(sub, logits / 0.8))
            context.append(token)
            generated.append(token)
        print("sample:\n" + corpus.decode(generated))
    return losses


if __name__ == "__main__":
    main()
