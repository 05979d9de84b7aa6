"""--precision bf16 / fp16 against the float32 reference, Keras' own mixed precision as the yardstick.

A low-precision run cannot equal the fp32 reference to 1e-5; the stated tolerance is that
the engine in bf16 (fp16) at K = 4 is no further from the fp32 reference after 3 steps than
twice the distance of Keras' own mixed_bfloat16 (mixed_float16) model on one device, on the
same weights and batches. A wrong loss weight, a dropped loss-scale division or a missing
round shows up as errors of order 1 (tens of times the bound). The ledger must equal the
closed form with 2-byte activations.
"""
from __future__ import annotations

import keras
import numpy as np
import pytest

import owt_tf
from engine_harness import (CONV_LR, FC_LR, MOMENTUM, WD, changed_tensors, checkpoint_tensors,
                            compare_with_reference, every_copy, random_batches)
from keras_models import alexnet_like, copy_of, dataset, random_data
from owt_tf.models import build_model
from owt_tf.models.split import UnsupportedModel
from owt_tf.planner import traffic
from owt_tf.parallel.precision import keras_policy
from reference import ReferenceModel, rel_err

STEPS, BATCH, K = 3, 8, 4


def _keras_low_precision_error(compute_dtype: str, rounds=None, fc_batch="global") -> dict:
    """How far Keras' own mixed-precision alexnet_tiny on one device ends from the fp32
    reference (the same weights, batches, rounds and FC updates): worst relative error of
    loss, gradients and weights over the 3 steps."""
    spec = build_model("alexnet_tiny", num_classes=10, dropout=0.0)
    exact = ReferenceModel(spec, seed=7)
    with keras_policy(compute_dtype):
        low = ReferenceModel(spec, seed=7)
    worst = {"loss": 0.0, "trunk_grads": 0.0, "fc_grads": 0.0, "weights": 0.0}
    rounds = rounds if rounds is not None else [np.arange(K * BATCH)]
    for x, y in random_batches(STEPS, K * BATCH, 10):
        want = exact.step(x, y, rounds, fc_batch, CONV_LR, FC_LR, MOMENTUM, WD)
        got = low.step(x, y, rounds, fc_batch, CONV_LR, FC_LR, MOMENTUM, WD)
        worst["loss"] = max(worst["loss"], abs(got["loss"] - want["loss"]) / want["loss"])
        worst["trunk_grads"] = max([worst["trunk_grads"]] + [
            rel_err(g, w) for g, w in zip(got["trunk_grads"], want["trunk_grads"], strict=True)])
        worst["fc_grads"] = max([worst["fc_grads"]] + [
            rel_err(g, w) for gu, wu in zip(got["fc_grads"], want["fc_grads"], strict=True)
            for g, w in zip(gu, wu, strict=True) if np.linalg.norm(w) > 0])
    for got, want in zip(low.weights()["trunk"], exact.weights()["trunk"], strict=True):
        worst["weights"] = max(worst["weights"], rel_err(got, want))
    for (gk, gb), (wk, wb) in zip(low.weights()["head"], exact.weights()["head"], strict=True):
        worst["weights"] = max(worst["weights"], rel_err(gk, wk), rel_err(gb, wb))
    return worst


CASES = [("data", "global", "gather", "gathered"),
         ("owt-a", "global", "gather", "gathered"),
         ("owt-b", "global", "gather", "gathered"),
         ("owt-b", "worker", "colrow", "sharded"),
         ("owt-c", "global", "colrow", "sharded")]


@pytest.mark.parametrize("scheme,fc_batch,fc_exchange,loss", CASES,
                         ids=["-".join(c) for c in CASES])
def test_bf16_is_as_close_to_the_fp32_reference_as_keras_own_bf16(
        devices, scheme, fc_batch, fc_exchange, loss):
    result = compare_with_reference(devices, scheme, K, BATCH, fc_batch, fc_exchange, loss,
                                    steps=STEPS, precision="bf16", he=False)
    yardstick = _keras_low_precision_error("bfloat16", result["rounds"], fc_batch)
    for what, keras_error in yardstick.items():  # the fp32 update check does not apply here
        err, bound = result["worst"][what], 2 * keras_error + 1e-3
        assert err <= bound, f"{what}: {err:.3g} > {bound:.3g} (Keras' own bf16: {keras_error:.3g})"
    _check_ledger(result, scheme, fc_batch, fc_exchange, loss, "bf16")


def _check_ledger(result, scheme, fc_batch, fc_exchange, loss, precision):
    spec = result["spec"]
    shape = traffic.NetworkShape(result["trunk_params"], result["features"], spec.head.hidden,
                                 spec.head.num_classes)
    expected = traffic.step_traffic(shape, scheme, K, BATCH, fc_exchange, loss, precision)
    ledger = result["ledger"]
    for purpose, nbytes in expected.items():
        assert ledger.by_purpose.get(purpose, 0) == nbytes, (purpose, ledger.summary(), expected)
    transfers = traffic.step_transfers(shape, scheme, K, BATCH, fc_exchange, loss, fc_batch,
                                       precision)
    assert ledger.calls == sum(t.calls for t in transfers), (ledger.calls, transfers)
    if scheme != "data":  # activations, their gradients and FC outputs travel in 2 bytes
        fp32 = traffic.step_traffic(shape, scheme, K, BATCH, fc_exchange, loss)
        assert 2 * ledger.by_purpose["activations"] == fp32["activations"]
        assert 2 * ledger.by_purpose["fc_exchange"] == fp32["fc_exchange"]


def test_fp16_with_a_loss_scale_is_as_close_as_keras_own_fp16(devices):
    """fp16 through the engine with a fixed loss scale of 2^10: the scale must come back out
    of every gradient (else errors of 1000x)."""
    import tensorflow as tf

    from owt_tf.parallel import HybridStrategy
    from owt_tf.training.driver import StepDriver
    from owt_tf.training.optim import build_optimizer

    keras_fp16 = _keras_low_precision_error("float16")
    spec = build_model("alexnet_tiny", num_classes=10, dropout=0.0)
    hybrid = HybridStrategy(devices[:K], "owt-c", batch_size=BATCH, precision="fp16")
    driver = StepDriver(hybrid)
    model = hybrid.placement.build_model(hybrid.parallel_plan, spec, seed=7)
    optim = build_optimizer(hybrid, model, CONV_LR, FC_LR, MOMENTUM, WD)
    ref = ReferenceModel(spec, seed=7)
    scale = tf.constant(2.0 ** 10)

    @tf.function
    def step(x, y):
        return driver.train_step(model, optim, x, y, None, loss_scale=scale)

    for x, y in random_batches(STEPS, K * BATCH, 10):
        out = step(hybrid.placement.distribute_global_batch(x), hybrid.placement.distribute_global_batch(y))
        assert bool(np.all(out["finite"].numpy()))
        ref.step(x, y, [np.arange(K * BATCH)], "global", CONV_LR, FC_LR, MOMENTUM, WD)
    worst = 0.0
    got, want = model.full_weights(), ref.weights()
    for g, w in zip(got["trunk"], want["trunk"], strict=True):
        worst = max(worst, rel_err(g, w))
    for (gk, gb), (wk, wb) in zip(got["head"], want["head"], strict=True):
        worst = max(worst, rel_err(gk, wk), rel_err(gb, wb))
    assert worst <= 2 * keras_fp16["weights"] + 1e-3, (worst, keras_fp16["weights"])
    shape = traffic.NetworkShape(model.trunk.count_params(), spec.trunk_output_dim(model.trunk),
                                 spec.head.hidden, spec.head.num_classes)
    expected = traffic.step_traffic(shape, "owt-c", K, BATCH, precision="fp16")
    assert {p: b for p, b in driver.ledger.by_purpose.items() if b} == {
        p: b for p, b in expected.items() if b}


def test_fp16_overflow_is_a_scale_step_not_a_stop(devices, tmp_path):
    """A loss scale so large that every gradient overflows float16: the step is undone
    exactly, the scale halves, no skip is counted, and training goes on once it fits."""
    from owt_tf.config import RunConfig
    from owt_tf.training.loop import Trainer

    config = RunConfig.from_flags(devices=2, scheme="owt-b", batch_size=8, steps=10,
                                  precision="fp16", eval_every=0, logdir=str(tmp_path / "run"))
    trainer = Trainer(config, devices=devices[:2])
    assert trainer.model.trunk.layers[0].dtype_policy.name == "mixed_float16"
    trainer.loss_scale.scale.assign(2.0 ** 40)

    before = every_copy(trainer)
    saved_before = checkpoint_tensors(trainer, tmp_path / "before")
    m = trainer.train_step()
    assert m.overflowed and m.nonfinite is None and int(trainer.skipped_steps) == 0
    assert not changed_tensors(saved_before, checkpoint_tensors(trainer, tmp_path / "after"))
    assert float(trainer.loss_scale.scale.numpy()) == 2.0 ** 39
    assert all(np.array_equal(b, a) for b, a in zip(before, every_copy(trainer), strict=True))
    for _ in range(40):  # halves until the scaled gradients fit in float16
        m = trainer.train_step()
        assert m.nonfinite is None and int(trainer.skipped_steps) == 0
        if not m.overflowed:
            break
    else:
        pytest.fail("the loss scale never came down to a finite step")
    scale = float(trainer.loss_scale.scale.numpy())
    assert scale < 2.0 ** 39 and int(trainer.loss_scale.good_steps.numpy()) == 1
    assert any(not np.array_equal(b, a) for b, a in zip(before, every_copy(trainer), strict=True))
    assert changed_tensors(saved_before, checkpoint_tensors(trainer, tmp_path / "later"))


def test_a_run_changes_precision_when_it_resumes(devices, tmp_path):
    """fp32 -> fp16 -> bf16 on one logdir: each resumes the last checkpoint (fp16's loss scale
    is saved, and starts fresh when the checkpoint has none); nothing is called damaged."""
    from owt_tf.config import RunConfig
    from owt_tf.training.loop import Trainer

    config = RunConfig.from_flags(devices=2, batch_size=8, eval_every=0, logdir=str(tmp_path),
                                  histogram_every=0)
    quiet = dict(log=lambda line: None, progress=False)
    Trainer(config.replace(steps=2), devices=devices[:2]).fit(**quiet)
    fp16 = Trainer(config.replace(steps=4, precision="fp16"), devices=devices[:2])
    assert fp16.resumed_from.endswith("ckpt-2") and float(fp16.loss_scale.scale.numpy()) == 2.0 ** 15
    fp16.loss_scale.scale.assign(2.0 ** 12)
    fp16.fit(**quiet)
    again = Trainer(config.replace(steps=5, precision="fp16"), devices=devices[:2])
    assert again.resumed_from.endswith("ckpt-4") and float(again.loss_scale.scale.numpy()) == 2.0 ** 12
    again.rundir.release()


@pytest.mark.slow
def test_parallelize_follows_the_models_bf16_policy_and_fit_tracks_keras(devices):
    """A mixed_bfloat16 Keras model: the shards compute in bfloat16 like its Dense layers,
    and fit's loss stays as close to Keras' own bf16 fit as that is to the fp32 fit."""
    x, y = random_data(32 * 3)
    with keras_policy("bfloat16"):
        reference = alexnet_like()
    assert reference.layers[-2].dtype_policy.name == "mixed_bfloat16"
    fp32 = alexnet_like()
    strategy = owt_tf.HybridStrategy(devices=devices[:4], scheme="owt-b")
    with strategy.scope():
        parallel = owt_tf.parallelize(copy_of(reference), seed=0)
        parallel.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                         loss="sparse_categorical_crossentropy")
    assert parallel.head.compute_dtype.name == "bfloat16"
    for m in (reference, fp32):
        m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    want = reference.fit(dataset(x, y, 32), epochs=1, verbose=0).history["loss"][0]
    exact = fp32.fit(dataset(x, y, 32), epochs=1, verbose=0).history["loss"][0]
    got = parallel.fit(dataset(x, y, 32), epochs=1, verbose=0).history["loss"][0]
    assert abs(got - exact) <= 2 * abs(want - exact) + 1e-2 * exact, (got, want, exact)


def test_a_float16_keras_model_is_refused_by_the_cli_with_the_way_out():
    """The CLI's fp16 loss scale serves registry models; a user's mixed_float16 model is
    for parallelize and Keras' fit (tests/test_keras_precision.py)."""
    from owt_tf.models.split import split_keras_model

    with keras_policy("float16"):
        model = alexnet_like()
    with pytest.raises(UnsupportedModel, match="float16 needs a loss scale.*parallelize"):
        split_keras_model(model)


@pytest.mark.slow
def test_bf16_trains_the_demo_about_as_far_as_fp32(devices, tmp_path):
    """The demo configuration (alexnet_tiny on digits, K = 2, owt-b) for 300 steps, seed 0,
    in bf16 and in fp32: both learn (chance is 90 % error), bf16 within 2.5 points of fp32.
    Measured (seeds 0, 1): fp32 2.23 / 1.95 %, bf16 3.90 / 2.23 % (at 600 steps, over seeds
    0-2, the means were 1.49 % and 1.39 %). One pair at half the demo's length: bf16 steps
    run ~2.5x slower than fp32 on a CPU without bf16 arithmetic, and three pairs of whole
    demos cost the suite ~20 minutes; the Keras path's mixed policies are held to a point
    over four seeds in tests/test_keras_precision.py. Validated and saved only at the end."""
    from owt_tf.config import RunConfig
    from owt_tf.training.loop import Trainer

    errors = {}
    for precision in ("fp32", "bf16"):
        config = RunConfig.from_flags(precision=precision, seed=0, steps=300, histogram_every=0,
                                      eval_every=0, checkpoint_every=0,
                                      logdir=str(tmp_path / precision))
        summary = Trainer(config, devices=devices[:2]).fit(log=lambda line: None, progress=False)
        errors[precision] = float(summary["val_top1_error"])
    assert errors["fp32"] < 0.05 and errors["bf16"] < 0.05, errors
    assert errors["bf16"] - errors["fp32"] <= 0.025, errors


def test_a_bf16_run_exports_a_float32_serving_graph(devices, tmp_path):
    """The SavedModel of a bf16 run computes in float32 (TFLite's builtins and ONNX runtimes
    have no bfloat16 path); its predictions equal the bf16 model's to bf16 accuracy."""
    import tensorflow as tf
    from tensorflow.core.protobuf import saved_model_pb2
    from tensorflow.core.framework import types_pb2

    from owt_tf.config import RunConfig
    from owt_tf.training.loop import Trainer

    config = RunConfig.from_flags(devices=2, batch_size=8, steps=2, eval_every=0,
                                  precision="bf16", histogram_every=0,
                                  logdir=str(tmp_path / "run"),
                                  export_dir=str(tmp_path / "models"))
    trainer = Trainer(config, devices=devices[:2])
    trainer.fit(log=lambda line: None, progress=False)
    export = tmp_path / "models" / "1"
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((export / "saved_model.pb").read_bytes())
    graph = proto.meta_graphs[0].graph_def
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    dtypes = {v.type for n in nodes for v in n.attr.values()}
    assert types_pb2.DT_FLOAT in dtypes and types_pb2.DT_BFLOAT16 not in dtypes
    images = np.asarray(trainer.dataset.sample_images(8))
    served = tf.saved_model.load(str(export)).signatures["serving_default"](
        images=tf.constant(images))["probabilities"].numpy()
    # An independent float32 forward pass of the trained weights (one device, Keras layers):
    # the served probabilities are its softmax to float32 rounding, not to bf16's.
    weights = trainer.model.full_weights()
    exact = ReferenceModel(trainer.spec, seed=0)
    exact.trunk.set_weights(weights["trunk"])
    for layer, (kernel, bias) in zip(exact.fc, weights["head"], strict=True):
        layer.set_weights([kernel, bias])
    want = tf.nn.softmax(exact.head(exact.trunk(_eval_input(trainer, images)))).numpy()
    np.testing.assert_allclose(served, want, atol=1e-5)
    # ... and the bf16 model's own predictions are within bf16's rounding of it, no closer.
    low = tf.nn.softmax(trainer._predict_fn(trainer.hybrid.placement.distribute_global_batch(
        _eval_input(trainer, images)))).numpy()
    assert 1e-5 < np.max(np.abs(low - want)) < 0.05


def _eval_input(trainer, images):
    from owt_tf.data.preprocess import eval_preprocess

    h, w, _ = trainer.spec.input_shape
    x = eval_preprocess(images, (h, w), trainer.dataset.mean, trainer.dataset.std)
    return x.numpy()
