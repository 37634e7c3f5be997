"""The examples run (a handful of steps, in-process on the 8 test devices) and write their outputs."""

import importlib.util
import json
import math
import pathlib
import sys

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
# A small model so each run compiles in seconds; everything else at the script's defaults.
SMALL = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "16",
         "--bucket-size", "4000", "--sample", "0", "--log-every", "2"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (linen modules) look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_gpt():
    return _load("train_gpt")


@pytest.fixture(scope="module")
def drained(train_gpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt") / "drained"
    return out, train_gpt.main(["--steps", "4", "--out", str(out), *SMALL])


def test_train_gpt_writes_losses_and_plot(drained, capsys):
    out, losses = drained
    assert json.loads((out / "losses.json").read_text()) == losses
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_gpt_undrained_is_identical_and_overlays(train_gpt, drained, tmp_path):
    out, losses = drained
    undrained = train_gpt.main(["--steps", "4", "--no-drain", "--out", str(tmp_path), "--compare", str(out), *SMALL])
    assert undrained == losses
    assert (tmp_path / "loss.png").exists()


def test_train_gpt_with_muon_updates_whole_matrices(train_gpt, tmp_path, capsys):
    """--muon: Muon for the matrices, AdamW for the rest; the step picks whole-parameter
    ownership itself, and the drained run equals the undrained one bit for bit."""
    losses = train_gpt.main(["--steps", "3", "--muon", "--out", str(tmp_path / "a"), *SMALL])
    assert "ownership='param'" in capsys.readouterr().out
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert train_gpt.main(["--steps", "3", "--muon", "--no-drain", "--out", str(tmp_path / "b"), *SMALL]) == losses


def test_train_gpt_resume(train_gpt, drained, tmp_path):
    _, uninterrupted = drained
    first = train_gpt.main(["--steps", "2", "--checkpoint-every", "2", "--out", str(tmp_path), *SMALL])
    assert first == uninterrupted[:2]
    resumed = train_gpt.main(["--steps", "4", "--resume", "--out", str(tmp_path), *SMALL])
    assert resumed == uninterrupted  # the restored run continues bit for bit
    assert json.loads((tmp_path / "losses.json").read_text()) == uninterrupted


def test_train_gpt_float32_model_under_a_precision_policy_with_int8_feedback(train_gpt, tmp_path):
    """The wire-precision guide's run (docs/howto/wire_precision.md): a float32 model with bf16
    working params, an int8 wire with error feedback, next to the same policy with fp32_accum.

    The losses may differ by what the wire and rounding change, carried to first order along a
    one-device reference run (:func:`_reference`). The schedule starts at 0, so the first step
    leaves the parameters as they were: the first two losses are computed at parameters both runs
    share and differ by the forward's rounding alone, and the gradients of steps 1 and 2 by the
    wire's error (half a quantization step of each device's leaf, with the residual it carries:
    ``quantized_wire_errors``) and two evaluations' rounding of the local gradients (float32
    backward, the bf16 cast, the devices' mean: ``device_mean_errors``). ``adam_error_bounds``
    carries those to the master parameters after the first AdamW step with a learning rate, the
    bf16 working copies add an ulp where the masters may differ (``cast_error_bounds``), and the
    third loss moves by ``|g_3|`` times that. Adam turns an error as large as a small gradient
    into a whole update of either sign, and the worst case over all elements, each difference
    of the sign that raises the loss, exceeds the loss change of a training step; the elements'
    errors are independent and of random sign, so the third loss is held to their Hoeffding
    bound at failure probability 1e-6, which a wire that loses its scales exceeds many times.
    A fourth step would compute its gradient at parameters that already differ, moving it by the
    curvature times that difference, which these bounds do not carry: three steps.
    """
    import jax
    import jax.numpy as jnp

    from helpers import (adam_error_bounds, assert_within, cast_error_bounds, device_mean_errors, loss_rounding_bounds,
                         quantized_wire_errors)

    policy = ["--steps", "3", *SMALL, "--param-dtype", "float32", "--working-dtype", "bfloat16"]
    exact = train_gpt.main([*policy, "--out", str(tmp_path / "fp32_accum")])
    int8 = train_gpt.main([*policy, "--reduce", "int8_accum", "--error-feedback", "--out", str(tmp_path / "int8")])
    assert exact[-1] < exact[0]

    ref = _reference(train_gpt, policy)
    assert ref.learning_rates[0] == 0  # the premise: step 1 leaves the parameters as they were
    wire = quantized_wire_errors(ref.device_gradients, error_feedback=True)
    local = device_mean_errors(ref.device_gradients, additions=ref.backward_chain, dtype=jnp.bfloat16)
    masters = adam_error_bounds(ref.gradients, [jax.tree.map(np.add, w, r) for w, r in zip(wire, local)],
                                learning_rates=ref.learning_rates, params=ref.params[0], **ref.adam)
    working = [cast_error_bounds(b, p, jnp.bfloat16) for b, p in zip(masters, ref.params[1:])]
    # The loss's own roundings: one device's forward, then the 8 devices' losses summed and averaged.
    bounds = loss_rounding_bounds(ref.losses, ref.gradients, working, additions=ref.forward_chain + 9, failure=1e-6)
    assert_within(np.asarray(int8), np.asarray(exact), bounds, what="int8_accum + feedback vs fp32_accum losses")


def test_train_linen():
    losses = _load("train_linen").main(["--steps", "20"])
    assert len(losses) == 20 and losses[-1] < 0.5 * losses[0]


def test_flax_state_trains_nnx_and_linen_side_by_side(capsys):
    """docs/howto/your_model.md's nnx and linen paths: both train, their statistics evaluate to
    finite logits."""
    losses = _load("flax_state").main(["--steps", "6"])
    assert all(len(curve) == 6 and np.all(np.isfinite(curve)) for curve in losses.values())
    assert "eval logits finite: nnx True, linen True" in capsys.readouterr().out


def test_train_gpt_scan_layers_matches_unrolled(train_gpt, tmp_path):
    """--scan-layers (nnx.scan over the blocks, ScanGradSync, same initial weights) follows the
    unrolled run: the same computation, rounded differently where the scan body is compiled on
    its own. Bounded along a one-device reference run (:func:`_reference`): the schedule's first
    step leaves the parameters as they were, so the first two losses differ by at most the
    forward's roundings (``rounding_chain`` of the loss, and the devices' mean), and the third by
    ``|g_3|`` times the parameters' bound after the first AdamW step with a learning rate, whose
    gradients (steps 1 and 2, at the shared parameters) differ by the local backward's roundings
    and the devices' mean (``device_mean_errors``, ``adam_error_bounds``). The model is float32:
    for a bf16 model the worst case of the forward's rounding alone (every bf16 rounding one ulp
    off, each in the direction that moves the loss) exceeds the loss change of a swapped layer
    order; in float32 a swapped layer order is past the first loss's bound, and a layer's
    gradient given to another layer past the third's many times.
    """
    from helpers import adam_error_bounds, assert_within, device_mean_errors, loss_rounding_bounds

    args = ["--steps", "3", *SMALL, "--layers", "2", "--param-dtype", "float32"]  # two layers: a real scan
    unrolled = train_gpt.main([*args, "--out", str(tmp_path / "unrolled")])
    scanned = train_gpt.main([*args, "--scan-layers", "--out", str(tmp_path / "scan")])
    assert scanned[-1] < scanned[0]

    ref = _reference(train_gpt, args)
    assert ref.learning_rates[0] == 0  # the premise: step 1 leaves the parameters as they were
    masters = adam_error_bounds(ref.gradients, device_mean_errors(ref.device_gradients, additions=ref.backward_chain),
                                learning_rates=ref.learning_rates, params=ref.params[0], **ref.adam)
    bounds = loss_rounding_bounds(ref.losses, ref.gradients, masters, additions=ref.forward_chain + 9)
    assert_within(np.asarray(scanned), np.asarray(unrolled), bounds, what="scanned vs unrolled losses")


def _reference(train_gpt, argv: list[str]):
    """``train_gpt.main(argv)`` redone on one device with plain optax: the unrolled model, the same
    initial weights, optimizer (``optimizer(args)``) and batches, each device's local batch split
    from the global one as the data axis splits it. Returns per step the loss (the devices'
    mean), each device's local gradient, their mean and the learning rate; the master parameters
    before every step and after the last; the ``rounding_chain`` of one device's loss and of its
    gradient; and Adam's ``b1``, ``b2``, the clip norm and weight decay (``adam``): the
    trajectory bounds' inputs."""
    import types

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from helpers import rounding_chain

    args = train_gpt.parse_args(argv)
    corpus = train_gpt.Corpus(train_gpt.DATA)
    config = train_gpt.model_config(args)
    model = train_gpt.build_model(config, corpus.vocab_size, args.seed)  # unrolled: no --scan-layers here
    assert not config.scan_layers
    tx, schedule = train_gpt.optimizer(args)
    graphdef, state = nnx.split(model, nnx.Param)
    dtype = args.working_dtype  # the working copies' (bf16 under a precision policy), else the model's own
    working = lambda params: jax.tree.map(lambda x: x.astype(dtype or x.dtype), params)  # noqa: E731

    def loss(params, batch):
        values = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(values, params)
        return nnx.merge(graphdef, values).loss(batch)

    @jax.jit
    def step(params, opt_state, batches, count):
        losses, grads = jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0))(working(params), batches)
        mean = jax.tree.map(lambda g: jnp.mean(g.astype(jnp.float32), axis=0), grads)
        updates, opt_state = tx.update(mean, opt_state, params)
        return losses, grads, optax.apply_updates(params, updates), opt_state, schedule(count)

    devices = args.devices
    split = lambda batch: jax.tree.map(lambda x: x.reshape(devices, -1, *x.shape[1:]), batch)  # noqa: E731
    params = nnx.to_pure_dict(state)
    first = jax.tree.map(lambda x: x[0], split(corpus.batch(0, args.batch_size, args.seq_len, args.seed)))
    abstract = jax.eval_shape(working, params)
    out = types.SimpleNamespace(
        args=args, losses=[], device_gradients=[], gradients=[], learning_rates=[], params=[params],
        forward_chain=rounding_chain(loss, abstract, first),
        backward_chain=rounding_chain(jax.grad(loss), abstract, first),
        adam=dict(b1=train_gpt.ADAM_BETAS[0], b2=train_gpt.ADAM_BETAS[1], max_norm=args.clip,
                  weight_decay=args.weight_decay))
    opt_state = jax.jit(tx.init)(params)
    for t in range(args.steps):
        batches = split(corpus.batch(t, args.batch_size, args.seq_len, args.seed))
        losses, grads, params, opt_state, learning_rate = step(params, opt_state, batches, t)
        grads = jax.tree.map(lambda g: np.asarray(g, np.float64), grads)
        out.losses.append(float(np.mean(np.asarray(losses, np.float64))))
        out.device_gradients.append(grads)
        out.gradients.append(jax.tree.map(lambda g: g.mean(axis=0), grads))
        out.learning_rates.append(float(learning_rate))
        out.params.append(params)
    return out


def test_quickstart_runs_and_its_shards_are_the_mean_gradient(capsys):
    """examples/quickstart.py is docs/howto/your_model.md's "only the gradient sync": it must run
    and be right."""
    import jax

    quickstart = _load("quickstart")
    out = capsys.readouterr().out
    assert "bucket" in out and f"{quickstart.sync.num_buckets} buckets" in out
    # The mean over devices of each device's local gradient: with equal local batches, the
    # gradient of the mean loss over the global batch.
    from helpers import assert_within_rounding, rounding_chain

    want = jax.grad(quickstart.loss_fn)(quickstart.params, quickstart.batch)
    local = jax.tree.map(lambda x: x[: x.shape[0] // 8], quickstart.batch)
    additions = rounding_chain(jax.grad(quickstart.loss_fn), quickstart.params, local) + 9  # + 8 devices, the mean
    assert_within_rounding(quickstart.mean_grads, want, additions=additions, what="mean gradient")


def test_tensor_parallel_example_trains_like_optax_on_one_device():
    """examples/tensor_parallel.py is docs/howto/tensor_parallel.md's step: it trains, and its
    params equal plain optax (clip + adamw with the same mask) on one device, whole batches."""
    import jax
    import optax

    example = _load("tensor_parallel")
    assert example.losses[-1] < 0.5 * example.losses[0]
    reference_loss = lambda p, b: example.jnp.mean(
        (example.jax.nn.gelu((b["x"] * p["norm"]) @ p["w_in"] + p["b_in"]) @ p["w_out"] + p["b_out"] - b["y"]) ** 2)
    from helpers import adam_rounding_bounds, assert_within, reference_run, rounding_chain

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.1, mask=example.decay))
    params = jax.tree.map(np.asarray, example.params)
    batches = list(example.batches(example.STEPS))
    want, _, gradients = reference_run(reference_loss, params, tx, batches)
    additions = rounding_chain(jax.grad(reference_loss), params, batches[0]) + 8  # + the devices' sum
    bounds = adam_rounding_bounds(gradients, additions=additions, learning_rate=3e-3, params=params, max_norm=1.0,
                                  weight_decay=0.1)
    assert_within(jax.device_get(example.state.params), want, bounds[-1], what="params after training")


def test_several_hosts_example_trains_saves_and_resumes_on_another_host_count(tmp_path):
    """examples/several_hosts.py as 2 local "hosts" of 4 CPU devices (a torchrun-like launch),
    then 1, then 2 again, one checkpoint directory: each run resumes the last one's step, with
    every weight split over the host's 4 devices."""
    import re
    import subprocess

    runs = []
    for hosts in (2, 1, 2):
        done = subprocess.run([sys.executable, str(EXAMPLES / "several_hosts.py"), "--local", str(hosts),
                               "--ckpt", str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        found = re.search(r"(\d) hosts x 4 devices: step (\d+), loss ([\d.]+), .* held as \(32, 32\) blocks of "
                          r"\(32, 128\)", done.stdout)
        assert found, done.stdout[-2000:]
        runs.append((int(found[1]), int(found[2]), float(found[3])))
    assert [(h, s) for h, s, _ in runs] == [(2, 5), (1, 10), (2, 15)]
    assert runs[0][2] > runs[1][2] > runs[2][2]
