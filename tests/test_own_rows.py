"""A process's own rows of a streamed global batch (StreamDataset.train_rows): the rows of any
split into workers put back together are the whole batch, unreadable images included; a
worker's rows need only its own rows' files; an unreadable image's row holds the next
readable record of its batch. The cluster run itself: tests/test_multiworker.py."""
import numpy as np
import pytest
import tensorflow as tf

from owt_tf.data.datasets import DatasetError, load_dataset

SEED = 3


def corrupt_folder(root, per_label=10, bad=2, side=40, labels=("a", "b", "c")):
    """`labels` x `per_label` random RGB training images of side x side (PNG and JPEG
    alternately), the first `bad` of each label unreadable (a truncated PNG, then garbage);
    2 readable validation images per label. Returns the root."""
    rng = np.random.default_rng(11)
    for split, count in (("train", per_label), ("validation", 2)):
        for label in labels:
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (side, side + 6, 3), dtype=np.uint8)
                encode, ext = (tf.io.encode_png, "png") if i % 2 == 0 else (tf.io.encode_jpeg, "jpg")
                data = encode(pixels).numpy()
                if split == "train" and i < bad:
                    data = data[: len(data) // 2] if i % 2 == 0 else b"not an image at all"
                (folder / f"{i}.{ext}").write_bytes(data)
    return root


def _batches(ds, global_batch, rows=None, count=5, start=0):
    return [[t.numpy() for t in b]
            for b in ds.train_rows(global_batch, SEED, start, rows).take(count)]


@pytest.mark.slow
@pytest.mark.parametrize("augment", ["alexnet", "none"])
def test_rows_split_over_any_number_of_workers_make_the_whole_batch(tmp_path, augment):
    ds = load_dataset(f"folder:{corrupt_folder(tmp_path / 'd')}", (32, 32, 3), augment=augment)
    whole = _batches(ds, 12, count=6)
    positions = np.concatenate([b[2] for b in whole])
    np.testing.assert_array_equal(positions, np.arange(72))  # no gaps
    failed = np.concatenate([b[3] for b in whole])
    assert 6 <= np.count_nonzero(failed) < 72 // 2  # 6 of 30 unreadable: some met, counted
    for workers in (2, 3, 4):
        rows = 12 // workers
        parts = [_batches(ds, 12, (w * rows, rows), count=6) for w in range(workers)]
        for step, want in enumerate(whole):
            for i, name in enumerate(("images", "labels", "positions", "failed")):
                got = np.concatenate([part[step][i] for part in parts])
                np.testing.assert_array_equal(got, want[i], err_msg=f"{workers} workers, {name}")
    # A resumed stream's rows are the uninterrupted stream's.
    resumed = _batches(ds, 12, (6, 6), count=2, start=3 * 12)
    for got, want in zip(resumed, whole[3:]):
        np.testing.assert_array_equal(got[0], want[0][6:])
        np.testing.assert_array_equal(got[3], want[3][6:])


def test_an_unreadable_row_holds_the_next_readable_record_of_its_batch(tmp_path):
    """With augment 'none' a row is its record's image, normalised: an unreadable row's image
    is the one of the first row after it (wrapping round) whose own record decodes."""
    ds = load_dataset(f"folder:{corrupt_folder(tmp_path / 'd')}", (32, 32, 3), augment="none")
    seen = 0
    for images, labels, _, failed in _batches(ds, 12, count=6):
        for row in np.flatnonzero(failed):
            source = (row + failed[row]) % 12
            assert failed[source] == 0  # the record it holds is that row's, which decodes
            np.testing.assert_array_equal(images[row], images[source])
            assert labels[row] == labels[source]
            seen += 1
    assert seen >= 6


def test_a_workers_rows_need_only_its_own_files(tmp_path):
    """Worker 1 of 2 of a global batch of 8: with every other file of the split deleted, its
    rows of the first batch are unchanged and nothing is counted unreadable."""
    ds = load_dataset(f"folder:{corrupt_folder(tmp_path / 'd', bad=0)}", (32, 32, 3))
    want = _batches(ds, 8, (4, 4), count=1)[0]
    files = [f.decode() for f, _ in ds._train_records(SEED, 0).take(8).as_numpy_iterator()]
    own = set(files[4:])
    for path in ds.train_files:
        if path not in own:
            tf.io.gfile.remove(path)
    got = _batches(ds, 8, (4, 4), count=1)[0]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert not got[3].any()
    # The whole batch needs the others' files: their rows now hold substitutes.
    assert _batches(ds, 8, count=1)[0][3][:4].all()


def test_rows_outside_the_batch_are_refused(tmp_path):
    ds = load_dataset(f"folder:{corrupt_folder(tmp_path / 'd', per_label=4, bad=0)}", (32, 32, 3))
    with pytest.raises(DatasetError, match="not rows of a global batch of 8"):
        ds.train_rows(8, SEED, 0, (6, 4))


def test_a_global_batch_without_a_readable_image_stops_before_its_step(tmp_path):
    """1 readable training image of 24: a global batch of 4 that holds none gives zero rows
    marked failed = 4 (never a short batch), and the run stops before that step, its
    weights untouched, with a DatasetError (the CLI's exit 2)."""
    from owt_tf.config import RunConfig
    from owt_tf.training.loop import Trainer

    root = corrupt_folder(tmp_path / "d", per_label=8, bad=8)
    keep = root / "train" / "a" / "1.jpg"  # one readable image (garbage in the tree)
    keep.write_bytes(tf.io.encode_jpeg(np.full((40, 46, 3), 90, np.uint8)).numpy())
    ds = load_dataset(f"folder:{root}", (32, 32, 3), augment="none")
    batches = _batches(ds, 4, count=6)
    empty = [b for b in batches if (b[3] == 4).all()]
    black = (0.0 - np.float32(ds.mean)) / np.float32(ds.std)  # zero pixels, normalised
    assert empty and all(np.allclose(b[0], black) for b in empty)
    assert all(b[0].shape[0] == 4 and ((b[3] == 4).all() or not (b[3] == 4).any())
               for b in batches)
    first_empty = next(i for i, b in enumerate(batches) if (b[3] == 4).all())
    config = RunConfig.from_flags(dataset=f"folder:{root}", devices=2, scheme="owt-b", batch_size=2,
                       steps=6, eval_every=0, seed=SEED, augment="none",
                       logdir=str(tmp_path / "run"))
    trainer = Trainer(config)
    with pytest.raises(DatasetError, match="none of the 4 training images of the global batch"):
        trainer.fit(log=lambda line: None, progress=False)
    assert int(trainer.step) == first_empty


def _val_batches(ds, global_batch, rows=None):
    return [[t.numpy() for t in b] for b in ds.validation_rows(global_batch, rows)]


def test_validation_rows_of_any_split_make_the_whole_batch_and_hold_every_readable_image(tmp_path):
    """Validation rows put back together are the whole global batches; the non-padding rows
    are exactly the readable validation images, each center-cropped as eval_preprocess does,
    and an unreadable one is a padding row (label -1) in its own place."""
    from owt_tf.data.preprocess import eval_preprocess

    root = corrupt_folder(tmp_path / "d", labels=("a", "b", "c", "d", "e"))  # 10 val images
    bad = root / "validation" / "b" / "0.png"
    bad.write_bytes(b"not an image")
    ds = load_dataset(f"folder:{root}", (32, 32, 3))
    whole = _val_batches(ds, 4)
    assert len(whole) == 3  # 10 images: two whole batches and one padded
    labels = np.concatenate([b[1] for b in whole])
    images = np.concatenate([b[0] for b in whole])
    assert labels.shape == (12,) and np.count_nonzero(labels >= 0) == 9
    assert labels[2] == -1 and (labels[10:] == -1).all()  # b/0.png is the third file
    assert not images[labels < 0].any()
    want = []
    for label, name in enumerate("abcde"):
        for f in sorted((root / "validation" / name).iterdir()):
            if f != bad:
                pixels = tf.io.decode_image(f.read_bytes(), channels=3, expand_animations=False)
                want.append((label, eval_preprocess(pixels[None], (32, 32), ds.mean, ds.std)[0]))
    for (label, image), got_label, got in zip(want, labels[labels >= 0], images[labels >= 0]):
        assert got_label == label
        np.testing.assert_allclose(got, image.numpy(), atol=1e-6)
    for workers in (2, 4):
        rows = 4 // workers
        parts = [_val_batches(ds, 4, (w * rows, rows)) for w in range(workers)]
        for step, want_batch in enumerate(whole):
            for i in range(2):
                got = np.concatenate([part[step][i] for part in parts])
                np.testing.assert_array_equal(got, want_batch[i], err_msg=f"{workers} workers")
