"""The input pipeline: the digits split, and which rows each replica gets."""
import numpy as np
import tensorflow as tf

from owt_tf.data.datasets import DatasetError, load_dataset
from owt_tf.runtime.devices import make_strategy
import pytest


def load_digits_targets():
    from sklearn.datasets import load_digits

    return load_digits().target


def test_digits_split_is_fixed_disjoint_and_complete():
    a = load_dataset("digits", (32, 32, 3))
    b = load_dataset("digits", (32, 32, 3), seed=99)
    assert a.train_images.shape == (1438, 32, 32, 3) and a.val_images.shape == (359, 32, 32, 3)
    assert a.train_images.dtype == np.uint8
    np.testing.assert_array_equal(a.val_labels, b.val_labels)
    # every original example lands in exactly one split
    assert len(a.train_labels) + len(a.val_labels) == 1797
    np.testing.assert_array_equal(np.bincount(np.concatenate([a.train_labels, a.val_labels])),
                                  np.bincount(load_digits_targets()))
    assert sorted(set(a.train_labels.tolist())) == list(range(10))


def test_replica_k_gets_rows_k_b_to_k_plus_1_b(devices):
    """The run contract (docs/design.md): the global batch is split in replica order."""
    strategy = make_strategy(devices[:4])
    ds = tf.data.Dataset.range(64).batch(16)
    for i, batch in enumerate(strategy.experimental_distribute_dataset(ds)):
        parts = strategy.experimental_local_results(batch)
        for k, part in enumerate(parts):
            np.testing.assert_array_equal(part.numpy(), np.arange(i * 16 + k * 4, i * 16 + k * 4 + 4))


def test_training_order_depends_on_seed_not_devices():
    ds = load_dataset("digits", (32, 32, 3))
    first = [y.numpy() for _, y, _ in ds.train(32, seed=1).take(3)]
    again = [y.numpy() for _, y, _ in ds.train(32, seed=1).take(3)]
    other = [y.numpy() for _, y, _ in ds.train(32, seed=2).take(3)]
    assert all((a == b).all() for a, b in zip(first, again))
    assert not all((a == b).all() for a, b in zip(first, other))


def test_validation_covers_every_example_once_with_padding():
    ds = load_dataset("digits", (32, 32, 3))
    labels = np.concatenate([y.numpy() for _, y in ds.validation(64)])
    assert len(labels) % 64 == 0
    np.testing.assert_array_equal(labels[labels >= 0], ds.val_labels)
    assert (labels[len(ds.val_labels):] == -1).all()


def test_every_registered_prefix_is_loaded_and_validated(tmp_path):
    """The one registry of dataset names (owt_tf.data): load_dataset dispatches every
    PREFIX:ARG it lists (a missing directory is that dataset's own error, not "unknown"),
    and --dataset's check takes every form it lists and refuses another prefix."""
    from owt_tf.config import ConfigError, RunConfig
    from owt_tf.data import DATASET_PREFIXES, dataset_forms

    for prefix in DATASET_PREFIXES:
        with pytest.raises(Exception) as caught:
            load_dataset(f"{prefix}:{tmp_path / 'missing'}", (32, 32, 3))
        assert "unknown dataset" not in str(caught.value), prefix
        if DATASET_PREFIXES[prefix] != "NAME":
            with pytest.raises(ConfigError, match="no such directory"):
                RunConfig.from_flags(environ={}, dataset=f"{prefix}:{tmp_path / 'missing'}").validate()
            RunConfig.from_flags(environ={}, dataset=f"{prefix}:{tmp_path}").validate()
    with pytest.raises(ConfigError, match="unknown value") as caught:
        RunConfig.from_flags(environ={}, dataset=f"lmdb:{tmp_path}").validate()
    assert all(form in str(caught.value) for form in dataset_forms())


def test_unknown_dataset_and_too_small_dataset():
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_dataset("cifar-12", (32, 32, 3))
    with pytest.raises(DatasetError, match="fewer than one global batch"):
        load_dataset("digits", (32, 32, 3)).train(4096, seed=0)


def test_resumed_digits_stream_starts_at_the_right_batch():
    ds = load_dataset("digits", (32, 32, 3))
    from_start = [y.numpy() for _, y, _ in ds.train(32, seed=1).take(5)]
    resumed = [y.numpy() for _, y, _ in ds.train(32, seed=1, start=3 * 32).take(2)]
    np.testing.assert_array_equal(resumed[0], from_start[3])
    np.testing.assert_array_equal(resumed[1], from_start[4])


def test_distribute_global_batch_gives_replica_k_its_rows(devices):
    from owt_tf.parallel import HybridStrategy

    hybrid = HybridStrategy(devices[:4], "owt-a", batch_size=3)
    parts = hybrid.strategy.experimental_local_results(
        hybrid.placement.distribute_global_batch(np.arange(12)))
    for k, part in enumerate(parts):
        np.testing.assert_array_equal(part.numpy(), np.arange(3 * k, 3 * k + 3))
