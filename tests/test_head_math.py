"""The sharded head's own math against independent statements of it: FC dropout is applied
in training (inverted: its mean is the evaluation output), and the class-sharded
cross-entropy stays exact where a softmax without its max shift overflows."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from owt_tf.models.spec import HeadSpec
from owt_tf.parallel import HybridStrategy
from owt_tf.parallel import collectives as coll
from owt_tf.parallel.head.forward import forward
from owt_tf.parallel.head.layout import ShardedHead
from owt_tf.parallel.head.loss import loss_terms


def _weights(rng, widths):
    dims = list(widths)
    return [(rng.normal(size=(a, b)).astype(np.float32) * 0.3,
             rng.normal(size=b).astype(np.float32) * 0.1) for a, b in zip(dims[:-1], dims[1:])]


def test_fc_dropout_masks_in_training_and_averages_to_the_evaluation_output(devices):
    """Dropout 0.5 after a ReLU layer: training logits differ from evaluation logits, the
    same seed gives the same mask, and (the next layer being linear) the mean over many seeds
    is the evaluation output, as inverted dropout promises. Skipped dropout fails the first."""
    rng = np.random.default_rng(0)
    spec = HeadSpec(hidden=(64,), num_classes=5, dropout=0.5)
    head = ShardedHead(spec, _weights(rng, (16, 64, 5)), [devices[0]])
    x = tf.constant(rng.normal(size=(4, 16)), tf.float32)
    evaluation = forward(head, x, 0, False, None).numpy()

    def trained(seed):
        return forward(head, x, 0, True, tf.constant([seed, 7], tf.int32)).numpy()

    first = trained(1)
    assert np.abs(first - evaluation).max() > 1e-3
    np.testing.assert_array_equal(first, trained(1))
    assert np.abs(first - trained(2)).max() > 1e-3
    mean = np.mean([trained(s) for s in range(400)], axis=0)
    spread = np.std([trained(s) for s in range(400)], axis=0) / np.sqrt(400)
    assert np.all(np.abs(mean - evaluation) < 5 * spread + 1e-6)


def test_class_sharded_cross_entropy_is_exact_for_large_logits(devices):
    """Logits around 1000 (exp overflows float32 without the max shift), classes split over
    two shards: each row's loss equals TF's own sparse softmax cross-entropy on the whole row."""
    rng = np.random.default_rng(1)
    hybrid = HybridStrategy(devices[:2], "owt-a", loss="sharded")
    spec = HeadSpec(hidden=(), num_classes=6, dropout=0.0)
    head = hybrid.placement.place_head(hybrid.parallel_plan, spec, _weights(rng, (4, 6)))
    logits = (rng.normal(size=(5, 6)) * 30 + 1000).astype(np.float32)
    labels = np.array([0, 5, 2, 3, 1], np.int32)

    @tf.function
    def run():
        def replica():
            k = coll.replica_id()
            ce, _, _ = loss_terms(head, tf.constant(logits[:, 3 * k:3 * (k + 1)]),
                                       tf.constant(labels), k)
            return ce

        return hybrid.strategy.run(replica)

    want = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.constant(logits)).numpy()
    assert np.all(np.isfinite(want))
    for got in hybrid.strategy.experimental_local_results(run()):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-4)
