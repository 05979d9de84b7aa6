"""Partial FC's class sample drawn without a pass over the shard: every positive kept, the
others uniform over the non-positive classes (a chi-square test over many draws), ids
distinct and ascending, a pure function of (seed, step, shard); and the whole-shard rule
(uniform scores, top-k) where the sample is too large a share of the shard."""
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from owt_tf.parallel.head import sampling

WIDTH, NUM_VALID, RATE = 1000, 997, 0.05  # 3 padding columns, 50 sampled classes


def _sample(labels, seed, k=0, width=WIDTH, num_valid=NUM_VALID, rate=RATE):
    return sampling.shard_sample([tf.constant(labels, tf.int32)], k, width,
                                 k * width + num_valid, rate, True, tf.constant(seed, tf.int32))


def test_the_direct_draw_is_the_one_taken_here():
    size = sampling.sample_size(RATE, NUM_VALID, WIDTH, 8)
    assert sampling.direct_draws(size, NUM_VALID) is not None
    assert sampling.direct_draws(sampling.sample_size(0.6, NUM_VALID, WIDTH, 8), NUM_VALID) is None


def test_positives_kept_ids_distinct_and_a_pure_function_of_the_seed():
    labels = [3, 3, 10, 996, 1500, -1, 40, 10]  # 1500: another shard's; 996 the last class
    a = _sample(labels, [7, 1])
    ids, valid = a.ids.numpy(), a.valid.numpy()
    kept = ids[valid]
    assert len(kept) == sampling.sample_count(RATE, NUM_VALID) == 50
    assert {3, 10, 40, 996} <= set(kept) and len(set(kept)) == len(kept)
    assert np.all(np.diff(ids) > 0) and ids.max() < NUM_VALID  # distinct, no padding class
    same = _sample(labels, [7, 1])
    np.testing.assert_array_equal(same.ids.numpy(), ids)
    other_step = _sample(labels, [7, 2]).ids.numpy()
    other_shard = _sample([y + WIDTH for y in labels], [7, 1], k=1).ids.numpy()
    assert not np.array_equal(other_step, ids) and not np.array_equal(other_shard, ids)
    # more positives than the sample: all of them, nothing else
    many = list(range(0, 120, 2))
    big = _sample(many, [1, 1])
    assert sorted(big.ids.numpy()[big.valid.numpy()]) == many


@pytest.mark.parametrize("rate", [RATE, 0.6])  # the direct draw; the whole-shard scores
def test_the_others_are_uniform_over_the_non_positive_classes(rate):
    labels = tf.constant([3, 10, 40, 996], tf.int32)
    positives = {3, 10, 40, 996}

    @tf.function
    def draw(step):
        s = sampling.shard_sample([labels], 0, WIDTH, NUM_VALID, rate, True,
                                  tf.stack([tf.constant(5), step]))
        return tf.scatter_nd(tf.boolean_mask(s.ids, s.valid)[:, None],
                             tf.ones_like(tf.boolean_mask(s.ids, s.valid)), [WIDTH])

    counts = np.zeros(WIDTH, np.int64)
    draws = 3000 if rate == RATE else 600
    for step in range(draws):
        counts += draw(tf.constant(step)).numpy()
    assert all(counts[p] == draws for p in positives)
    assert counts[NUM_VALID:].sum() == 0
    others = np.array([counts[c] for c in range(NUM_VALID) if c not in positives])
    per_draw = sampling.sample_count(rate, NUM_VALID) - len(positives)
    assert others.sum() == draws * per_draw
    p_value = stats.chisquare(others).pvalue
    assert p_value > 1e-4, p_value
