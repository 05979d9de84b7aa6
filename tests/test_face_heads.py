"""Face heads on the shards: a model whose class layer is owt_tf.layers.NormalizedDense,
compiled with a margin loss (ArcFace, CosFace), trains under HybridStrategy with the cosine
layer sharded (each shard normalises its own columns, the margin on the label's shard, the
softmax on the shards: no logits gathered) exactly as one-device Keras `fit` trains it;
with Partial FC the margin goes on the kept label column; under mixed_bfloat16 with scale
64 nothing overflows."""
from __future__ import annotations

import keras
import numpy as np
import pytest

import owt_tf
from keras_models import copy_of, update_rel_diff
from owt_tf.fit.compiling import CompileError
from owt_tf.layers import NormalizedDense
from owt_tf.losses import ArcFace, CosFace, MarginSoftmax
from owt_tf.planner import ledger

CLASSES, K, BATCH = 22, 4, 32  # 22 classes: the cosine layer is padded to 24 over 4 shards


def face_net(seed: int = 3, embedding: int = 16) -> keras.Model:
    """A conv trunk, an embedding Dense, a cosine class layer (as face models end)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, activation="relu", name="conv")(inputs)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(embedding, name="embedding")(h)
    outputs = NormalizedDense(CLASSES, name="classes")(h)
    return keras.Model(inputs, outputs, name="face_net")


def _data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 8, 8, 3)).astype(np.float32),
            rng.integers(0, CLASSES, n).astype(np.int32))


def _recorded(run):
    with ledger.recording(ledger.TrafficLedger()) as recorded:
        result = run()
    return recorded, result


def _sgd():
    return keras.optimizers.SGD(0.05, momentum=0.9)


@pytest.mark.parametrize("scheme,loss", [("owt-a", ArcFace), ("owt-b", ArcFace),
                                         ("owt-c", CosFace)])
def test_margin_fit_on_the_shards_equals_one_device_keras(devices, scheme, loss):
    reference = face_net()
    x, y = _data(3 * BATCH)
    strategy = owt_tf.HybridStrategy(devices=devices[:K], scheme=scheme)
    with strategy.scope():
        parallel = owt_tf.parallelize(copy_of(reference), seed=0)
        parallel.compile(optimizer=_sgd(), loss=loss(), metrics=["accuracy"])
    assert parallel.head.spec.cosine and parallel.head.loss_mode == "sharded"
    before = reference.get_weights()
    reference.compile(optimizer=_sgd(), loss=loss(), metrics=["accuracy"])
    want = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    recorded, got = _recorded(lambda: parallel.fit(x, y, batch_size=BATCH, epochs=2,
                                                   shuffle=False, verbose=0).history)
    assert update_rel_diff(before, parallel.to_keras_model().get_weights(),
                           reference.get_weights()) < 1e-4
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert parallel.evaluate(x, y, batch_size=BATCH, verbose=0) == pytest.approx(
        reference.evaluate(x, y, batch_size=BATCH, verbose=0), rel=1e-5)
    # no [rows, classes] cosines gathered: a few numbers per row travel for the softmax
    one_gather = ledger.all_gather_cost(BATCH * 24 // K * 4, K)
    assert 0 < recorded.by_purpose[ledger.LOGITS] < one_gather, recorded.summary()


def test_the_margin_changes_the_update(devices):
    """The yardstick can fail: the same fit with a plain normalised softmax (margin 0)
    moves the weights differently from ArcFace's by far more than the tolerance above."""
    reference = face_net()
    x, y = _data(2 * BATCH)
    before = reference.get_weights()
    arc, plain = copy_of(reference), copy_of(reference)
    arc.compile(optimizer=_sgd(), loss=ArcFace())
    plain.compile(optimizer=_sgd(), loss=MarginSoftmax(scale=64.0))
    for m in (arc, plain):
        m.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert update_rel_diff(before, plain.get_weights(), arc.get_weights()) > 0.05


def test_a_margin_loss_needs_a_cosine_class_layer(devices):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8, 8, 3))
    outputs = keras.layers.Dense(CLASSES)(keras.layers.Flatten()(inputs))
    strategy = owt_tf.HybridStrategy(devices=devices[:2], scheme="owt-b")
    with strategy.scope():
        parallel = owt_tf.parallelize(keras.Model(inputs, outputs), seed=0)
        with pytest.raises(CompileError, match="NormalizedDense"):
            parallel.compile(optimizer="sgd", loss=ArcFace())


def _sampled_margin_loss(cos: np.ndarray, labels: np.ndarray, kept: np.ndarray,
                         scale: float, margin: float) -> np.ndarray:
    """numpy: ArcFace's per-example loss over the kept columns only (Partial FC)."""
    logits = scale * np.clip(cos, -1, 1)
    rows = np.arange(len(labels))
    theta = np.arccos(np.clip(cos[rows, labels], -1, 1))
    logits[rows, labels] = scale * np.cos(theta + margin)
    logits = np.where(kept[None, :], logits, -np.inf)
    top = logits.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
    return log_norm - logits[rows, labels]


def test_partial_fc_applies_the_margin_on_the_kept_label_column(devices):
    """sample_rate 0.5: the first step's loss equals numpy's ArcFace over the columns the
    shards kept (every label kept, the margin on it); a full softmax's loss differs."""
    import tensorflow as tf

    from owt_tf.parallel.head import sampling
    from owt_tf.parallel.head.loss import sample_columns

    reference = face_net(seed=4)
    x, y = _data(2 * BATCH, seed=2)
    strategy = owt_tf.HybridStrategy(devices=devices[:K], scheme="owt-a", sample_rate=0.5)
    with strategy.scope():
        parallel = owt_tf.parallelize(copy_of(reference), seed=0)
        parallel.compile(optimizer=keras.optimizers.SGD(0.0), loss=ArcFace())
    assert parallel.head.loss_mode == "sharded"
    history = parallel.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, shuffle=False, verbose=0).history
    # the columns step 0's update kept (owt-a: one update, seeded by its first round's seed)
    head = parallel.head
    seed = tf.random.experimental.stateless_fold_in(tf.constant([parallel._seed, 0], tf.int32), 0)
    masks = [sampling.column_mask(sample_columns(head, [tf.constant(y[:BATCH])], k, seed)).numpy()
             for k in range(head.num_shards)]
    kept = np.concatenate(masks)[:CLASSES]
    assert kept[y[:BATCH]].all() and kept.sum() < CLASSES
    cos = reference.predict(x[:BATCH], verbose=0)  # the cosines, before any update
    want = _sampled_margin_loss(cos.astype(np.float64), y[:BATCH], kept, 64.0, 0.5).mean()
    full = _sampled_margin_loss(cos.astype(np.float64), y[:BATCH], np.ones(CLASSES, bool), 64.0,
                                0.5).mean()
    assert history["loss"][0] == pytest.approx(want, rel=1e-4)
    assert abs(full - want) > 1e-3 * abs(want)


@pytest.mark.slow
def test_mixed_bfloat16_with_scale_64_stays_finite(devices):
    """mixed_bfloat16 trunk, float32 cosine head (NormalizedDense's own policy), ArcFace
    scale 64: a few hundred steps without a NaN, and the loss falls."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = face_net(seed=5)
        assert model.get_layer("classes").compute_dtype == "float32"
        x, y = _data(8 * BATCH, seed=5)
        strategy = owt_tf.HybridStrategy(devices=devices[:2], scheme="owt-b")
        with strategy.scope():
            parallel = owt_tf.parallelize(model, seed=0)
            parallel.compile(optimizer=_sgd(), loss=ArcFace())
        history = parallel.fit(x, y, batch_size=BATCH, epochs=40, shuffle=False, verbose=0).history
    finally:
        keras.config.set_dtype_policy("float32")
    losses = history["loss"]
    assert len(losses) == 40 and np.all(np.isfinite(losses)), losses
    assert losses[-1] < 0.8 * losses[0], losses


def _trained_face_model(devices, k: int = 2):
    reference = face_net(seed=6)
    x, y = _data(2 * BATCH, seed=6)
    strategy = owt_tf.HybridStrategy(devices=devices[:k], scheme="owt-b")
    with strategy.scope():
        parallel = owt_tf.parallelize(copy_of(reference), seed=0)
        parallel.compile(optimizer=_sgd(), loss=ArcFace())
    parallel.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return parallel, x


def _numpy_embeddings(plain: keras.Model, x: np.ndarray) -> np.ndarray:
    features = keras.Model(plain.inputs, plain.get_layer("classes").input).predict(x, verbose=0)
    return features / np.linalg.norm(features, axis=1, keepdims=True)


def test_predict_embeddings_are_the_normalised_input_of_the_class_layer(devices):
    parallel, x = _trained_face_model(devices)
    rows = x[:37]  # not a multiple of the global batch: the last batch is padded
    got = parallel.predict(rows, batch_size=BATCH, embeddings=True, verbose=0)
    want = _numpy_embeddings(parallel.to_keras_model(), rows)
    assert got.shape == (37, 16)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(parallel.embed(rows), want, rtol=1e-5, atol=1e-6)
    # and the classes again after it: the predict step is traced anew for them
    np.testing.assert_allclose(parallel.predict(rows, batch_size=BATCH, verbose=0),
                               parallel.to_keras_model().predict(rows, verbose=0),
                               rtol=1e-5, atol=1e-6)


_LOAD_AND_RUN = """
import json, sys
import numpy as np
import tensorflow as tf
loaded = tf.saved_model.load(sys.argv[1])
x = np.load(sys.argv[2])
out = {name: {k: v.numpy().tolist() for k, v in fn(images=tf.constant(x)).items()
              if v.dtype != tf.string}
       for name, fn in loaded.signatures.items()}
print(json.dumps({"owt_tf_loaded": any(m.startswith("owt_tf") for m in sys.modules),
                  "signatures": out}))
"""


def _load_in_fresh_process(path, x, tmp_path):
    import json
    import subprocess
    import sys

    np.save(tmp_path / "x.npy", x)
    out = subprocess.run([sys.executable, "-c", _LOAD_AND_RUN, str(path), str(tmp_path / "x.npy")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_export_has_an_embeddings_signature_a_fresh_process_loads(devices, tmp_path):
    """The export contract (owt_tf.models.signatures), loaded without owt_tf: `images`
    uint8 in, fed to the model as pixel values; `serving_default` the softmax of the
    margin loss's scale times the classes' cosines, `embeddings` the class layer's input
    (`features`) and it normalised, all equal to the trained model's; an
    `embeddings_only` export has the embedding alone and no class layer in its variables."""
    import tensorflow as tf

    parallel, _ = _trained_face_model(devices)
    rows = np.random.default_rng(0).integers(0, 256, size=(5, 8, 8, 3)).astype(np.uint8)
    pixels = rows.astype(np.float32)
    plain = parallel.to_keras_model()
    parallel.export(str(tmp_path / "full"))
    parallel.export(str(tmp_path / "embedding"), embeddings_only=True)
    full = _load_in_fresh_process(tmp_path / "full", rows, tmp_path)
    assert not full["owt_tf_loaded"]
    assert set(full["signatures"]) == {"serving_default", "embeddings"}
    served = full["signatures"]["serving_default"]
    assert set(served) == {"probabilities", "top5"}  # and top5_names, strings
    logits = 64.0 * plain.predict(pixels, verbose=0)  # ArcFace's scale
    want = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(served["probabilities"], want / want.sum(1, keepdims=True),
                               rtol=1e-4, atol=1e-6)
    embedded = full["signatures"]["embeddings"]
    features_model = keras.Model(plain.inputs, plain.get_layer("classes").input)

    def features_of(images):
        return features_model.predict(images, verbose=0)

    features = features_of(pixels)
    np.testing.assert_allclose(embedded["features"], features, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(embedded["embeddings"], _numpy_embeddings(plain, pixels),
                               rtol=1e-5, atol=1e-6)
    only = _load_in_fresh_process(tmp_path / "embedding", rows, tmp_path)
    # TF Serving needs a default signature: Keras makes it the embedding
    assert set(only["signatures"]) == {"serving_default", "embeddings"}
    for signature in only["signatures"].values():
        for name in ("features", "embeddings"):
            np.testing.assert_allclose(signature[name], embedded[name], rtol=1e-6, atol=1e-6)
    # `evaluate --verification` reads the Keras path's export as it reads the CLI's
    import subprocess
    import sys

    from owt_tf.data.faces import faces_dataset
    from owt_tf.data.verification import verify

    proc = subprocess.run([sys.executable, "-m", "owt_tf.evaluate", "--verification", "faces",
                           str(tmp_path / "full")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pairs = faces_dataset((8, 8, 3)).verification_pairs()
    want = verify(lambda images: features_of(images.astype(np.float32)), pairs)
    assert (f"verification accuracy {want.accuracy:.2%} ± {want.accuracy_std:.2%} (10 folds) "
            f"| TAR@FAR=1e-3 {want.tar:.2%}") in proc.stdout, proc.stdout
    shapes = [tuple(s) for _, s in tf.train.list_variables(str(tmp_path / "embedding" / "variables" / "variables"))]
    assert (16, CLASSES) not in shapes and (16, CLASSES) in [
        tuple(s) for _, s in tf.train.list_variables(str(tmp_path / "full" / "variables" / "variables"))]


def test_verification_callback_reads_the_parallelized_model(devices):
    """owt_tf.callbacks.Verification on a parallelized model embeds through its `features`:
    its accuracy equals the protocol's on the one-device model's class-layer input."""
    from owt_tf.callbacks import Verification
    from owt_tf.data.verification import VerificationPairs, verify

    reference = face_net(seed=7)
    x, y = _data(2 * BATCH, seed=7)
    rng = np.random.default_rng(7)
    first = rng.normal(size=(40, 8, 8, 3)).astype(np.float32)
    second = np.where(np.arange(40)[:, None, None, None] % 2 == 0,
                      first + 0.1 * rng.normal(size=first.shape).astype(np.float32),
                      rng.normal(size=first.shape).astype(np.float32))
    pairs = VerificationPairs(first, second, np.arange(40) % 2 == 0, name="toy")
    strategy = owt_tf.HybridStrategy(devices=devices[:2], scheme="owt-b")
    with strategy.scope():
        parallel = owt_tf.parallelize(copy_of(reference), seed=0)
        parallel.compile(optimizer=keras.optimizers.SGD(0.0), loss=ArcFace())
    history = parallel.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                           callbacks=[Verification(pairs, batch_size=BATCH)]).history
    plain = parallel.to_keras_model()
    features = keras.Model(plain.inputs, plain.get_layer("classes").input)
    mean = verify(lambda images: features.predict(images, verbose=0), pairs).accuracy
    assert history["val_toy_accuracy"][0] == pytest.approx(mean, abs=1e-9)
    assert mean > 0.7  # near-duplicates against strangers: far from chance
