"""Prepared sets (`python -m owt_tf.prepare`, `prepared:DIR`): the stored images are the
paper's rescaled central crops of the originals, the manifest's counts and statistics are
right, unreadable files are listed and passed over, a stopped prepare resumes to the same
bytes, training and evaluation read the set as the folder path does, and a bad manifest is
one line."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from PIL import Image

from owt_tf.data import DatasetError
from owt_tf.data.datasets import load_dataset
from owt_tf.data.prepared import read_manifest
from owt_tf.data.prepared import writer as prepare_writer
from owt_tf.data.prepared.writer import PrepareSettings, prepare
from owt_tf.data.preprocess import (DeviceBatch, decode_train_crop, eval_preprocess, finish_images,
                                     train_draws)
from owt_tf.training.evaluation import (evaluate_probabilities, evaluate_ten_crop_batches,
                                        ten_crops, upscale_for_ten_crop)

CLASSES = ("cat", "dog", "fox")
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")


def _photo(h, w, seed):
    """A smooth photo-like RGB image (colour waves, a little noise): a misplaced crop or a
    wrong scale shows as a large difference, JPEG's own error stays small."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    f = rng.uniform(15, 45, 6)
    img = np.stack([128 + 90 * np.sin(xx / f[0] + yy / f[1]),
                    128 + 80 * np.cos(yy / f[2] - xx / f[3]),
                    128 + 70 * np.sin((xx + yy) / f[4]) * np.cos(xx / f[5])], -1)
    return np.clip(img + rng.normal(0, 2, img.shape), 0, 255).astype(np.uint8)


def _write_folder(root, per_class=8, val_per_class=2, bad=True):
    """train/<class>/ and validation/<class>/ of 500x375 and 375x500 JPEGs (one PNG), plus
    a truncated JPEG and a text file among the training images."""
    seed = 0
    for split, count in (("train", per_class), ("validation", val_per_class)):
        for name in CLASSES:
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                seed += 1
                h, w = (375, 500) if i % 2 == 0 else (500, 375)
                pixels = _photo(h, w, seed)
                if split == "train" and name == "cat" and i == 3:
                    Image.fromarray(pixels).save(folder / f"{i}.png")
                else:
                    Image.fromarray(pixels).save(folder / f"{i}.jpg", quality=95)
    if bad:
        whole = (root / "train" / "dog" / "0.jpg").read_bytes()
        (root / "train" / "dog" / "truncated.jpg").write_bytes(whole[:len(whole) // 2])
        (root / "train" / "fox" / "notes.txt").write_text("not an image\n")
    return root


def _paper_view(path, side=256, keep_aspect=False):
    """The paper's stored image, computed with PIL alone: shorter side to `side` (PIL's
    bilinear, a triangle filter widened when shrinking), central side x side unless
    keep_aspect."""
    image = Image.open(path).convert("RGB")
    w, h = image.size
    scale = side / min(h, w)
    nw, nh = max(round(w * scale), side), max(round(h * scale), side)
    pixels = np.asarray(image.resize((nw, nh), Image.BILINEAR)).astype(np.float64)
    if keep_aspect:
        return pixels
    top, left = (nh - side) // 2, (nw - side) // 2
    return pixels[top:top + side, left:left + side]


def _stored(directory, split, dct_method="INTEGER_ACCURATE"):
    """(source name, label, decoded uint8 image) of every record of a split, shard order
    (decoded accurately; dct_method "": as the training and evaluation paths decode)."""
    manifest = read_manifest(str(directory))
    files = [os.path.join(directory, s["file"]) for s in manifest["splits"][split]["shards"]]
    spec = {"image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64),
            "source": tf.io.FixedLenFeature([], tf.string)}
    out = []
    for serialized in tf.data.TFRecordDataset(files):
        ex = tf.io.parse_single_example(serialized, spec)
        out.append((ex["source"].numpy().decode(), int(ex["label"]),
                    tf.io.decode_jpeg(ex["image"], channels=3, dct_method=dct_method).numpy()))
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _write_folder(tmp_path_factory.mktemp("photos"))


@pytest.fixture(scope="module")
def prepared(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "set"
    prepare(f"folder:{source}", str(out), PrepareSettings(shard_size=5), verbose=0)
    return out


def test_shards_hold_the_rescaled_central_crops_with_their_labels(source, prepared):
    records = _stored(prepared, "train")
    assert len(records) == 24  # 8 per class; the truncated JPEG and the text file left out
    for name, label, image in records:
        assert name.split("/")[1] == CLASSES[label]
        assert image.shape == (256, 256, 3)
        expected = _paper_view(source / name)
        assert np.abs(image - expected).mean() < 1.5, name
        shifted = _paper_view(source / name)[:, 8:]  # the crop 8 pixels off: far worse
        assert np.abs(image[:, :-8] - shifted).mean() > 3 * np.abs(image - expected).mean()
    names = [name for name, _, _ in records]
    assert len(set(names)) == 24 and names != sorted(names)  # written in a shuffled order
    val = _stored(prepared, "validation")
    assert sorted(n for n, _, _ in val) == sorted(
        f"validation/{c}/{i}.jpg" for c in CLASSES for i in range(2))


def test_keep_aspect_keeps_the_whole_rescaled_image(tmp_path):
    root = tmp_path / "src"
    for split in ("train", "validation"):
        (root / split / "a").mkdir(parents=True)
        for i, (h, w) in enumerate([(375, 500), (500, 375)]):
            Image.fromarray(_photo(h, w, i)).save(root / split / "a" / f"{i}.jpg", quality=95)
    out = tmp_path / "out"
    manifest = prepare(f"folder:{root}", str(out), PrepareSettings(keep_aspect=True),
                       verbose=0).manifest
    assert manifest["settings"]["crop"] == "keep-aspect"
    shapes = {}
    for name, _, image in _stored(out, "train"):
        shapes[name] = image.shape[:2]
        assert np.abs(image - _paper_view(root / name, keep_aspect=True)).mean() < 1.5
    assert shapes == {"train/a/0.jpg": (256, 341), "train/a/1.jpg": (341, 256)}
    data = load_dataset(f"prepared:{out}", (224, 224, 3))  # crops over the whole width
    for (encoded, label), draws in zip(data._ordered_train_records(), train_draws(1, 0)):
        fast = data._train_crop(0, (encoded, label), draws)[0]
        generic = decode_train_crop(encoded, (224, 224), 3, draws.corner)
        np.testing.assert_array_equal(fast.numpy(), generic.numpy())


class OwtPrepareDigits(tfds.core.GeneratorBasedBuilder):
    """A real TFDS builder, prepared offline: 40 x 30 PNGs of four classes."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self, supervised_keys=("image", "label"),
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(30, 40, 3)),
                "label": tfds.features.ClassLabel(names=["w", "x", "y", "z"])}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(12), "test": self._generate_examples(4)}

    def _generate_examples(self, count):
        for i in range(count):
            yield i, {"image": _photo(30, 40, i), "label": i % 4}


def test_a_tfds_source_keeps_its_classes_and_splits(tmp_path):
    data_dir = str(tmp_path / "tfds")
    OwtPrepareDigits(data_dir=data_dir).download_and_prepare()
    out = tmp_path / "out"
    manifest = prepare("tfds:owt_prepare_digits", str(out), PrepareSettings(side=32),
                       data_dir=data_dir, verbose=0).manifest
    assert manifest["classes"] == ["w", "x", "y", "z"]
    assert manifest["counts"] == {"train": 12, "validation": 4, "unreadable": 0}
    train = _stored(out, "train")
    assert sorted(name for name, _, _ in train) == sorted(f"train[{i}]" for i in range(12))
    stored = list(OwtPrepareDigits(data_dir=data_dir).as_dataset(  # TFDS' stored order
        split="train", shuffle_files=False, as_supervised=True))
    for name, label, image in train:
        original, expected = stored[int(name[len("train["):-1])]
        assert label == int(expected) and image.shape == (32, 32, 3)
        enlarged = Image.fromarray(original.numpy()).resize((43, 32), Image.BILINEAR)
        assert np.abs(image - np.asarray(enlarged, np.float64)[:, 5:37]).mean() < 3


def test_an_insightface_source_keeps_its_identities_and_held_out_images(tmp_path):
    from owt_tf.data.insightface_stream import InsightFaceDataset
    from owt_tf.data.recordio import write_record_file

    root = tmp_path / "faces"
    root.mkdir()
    items = [(tf.io.encode_jpeg(_photo(112, 112, 10 * k + i)).numpy(), k)
             for k in range(3) for i in range(4)]
    items[5] = (b"not an image at all", 1)
    write_record_file(str(root / "train"), items)
    out = tmp_path / "out"
    manifest = prepare(f"insightface:{root}", str(out), PrepareSettings(side=112),
                       verbose=0).manifest
    held = InsightFaceDataset(str(root), (112, 112, 3)).val_indices
    assert manifest["classes"] == ["0", "1", "2"]
    assert manifest["counts"] == {"train": 8, "validation": 3, "unreadable": 1}
    assert [e["file"] for e in manifest["bad_files"]] == ["train.rec key 6"]
    val = _stored(out, "validation")
    assert sorted(name for name, _, _ in val) == sorted(f"train.rec key {i + 1}" for i in held)
    for name, label, image in val + _stored(out, "train"):
        key = int(name.split()[-1])
        assert label == items[key - 1][1]
        original = tf.io.decode_jpeg(items[key - 1][0], dct_method="INTEGER_ACCURATE").numpy()
        assert np.abs(image.astype(float) - original).mean() < 1.5


def test_manifest_counts_classes_and_statistics(source, prepared):
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["classes"] == list(CLASSES)
    assert manifest["source"] == f"folder:{source}"
    assert manifest["settings"] == {"side": 256, "crop": "center", "quality": 90,
                                    "shard_size": 5}
    assert manifest["counts"] == {"train": 24, "validation": 6, "unreadable": 2}
    assert manifest["splits"]["train"]["class_counts"] == [8, 8, 8]
    assert manifest["splits"]["validation"]["class_counts"] == [2, 2, 2]
    assert [s["file"] for s in manifest["splits"]["train"]["shards"]] == [
        f"train-{i:05d}-of-00006.tfrecord" for i in range(6)]  # 26 items, 5 a shard
    pixels = np.concatenate([_paper_view(source / "train" / c / f)
                             for c in CLASSES for f in sorted(os.listdir(source / "train" / c))
                             if f.endswith((".jpg", ".png")) and f != "truncated.jpg"])
    flat = pixels.reshape(-1, 3)
    np.testing.assert_allclose(manifest["mean"], flat.mean(0), atol=0.5)
    np.testing.assert_allclose(manifest["std"], flat.std(0), atol=0.5)
    assert not (prepared / "progress").exists() and not (prepared / "prepare_state.json").exists()


def test_unreadable_files_are_listed_and_the_prepare_goes_on(prepared):
    manifest = read_manifest(str(prepared))
    bad = {entry["file"]: entry for entry in manifest["bad_files"]}
    assert set(bad) == {"train/dog/truncated.jpg", "train/fox/notes.txt"}
    assert all(entry["split"] == "train" and entry["error"] for entry in bad.values())


def _shard_bytes(directory):
    return {f: (directory / f).read_bytes() for f in sorted(os.listdir(directory))
            if f.endswith(".tfrecord")}


def test_a_stopped_prepare_resumes_to_the_same_bytes(source, prepared, tmp_path, monkeypatch):
    out = tmp_path / "stopped"
    finish = prepare_writer._Shard.finish
    calls = []

    def stop_after_three(shard):
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a kill would, between shards
        calls.append(shard.file)
        return finish(shard)

    monkeypatch.setattr(prepare_writer._Shard, "finish", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepare(f"folder:{source}", str(out), PrepareSettings(shard_size=5), verbose=0)
    monkeypatch.setattr(prepare_writer._Shard, "finish", finish)
    assert not (out / "manifest.json").exists() and len(calls) == 3
    assert (out / "train-00003-of-00006.tfrecord.tmp").exists()  # the shard it was writing
    with pytest.raises(DatasetError, match="not finished preparing.*run the same prepare"):
        read_manifest(str(out))
    result = prepare(f"folder:{source}", str(out), PrepareSettings(shard_size=5), verbose=0)
    assert result.resumed_images == 15 and not result.already_done
    assert _shard_bytes(out) == _shard_bytes(prepared)
    assert (out / "manifest.json").read_text() == (prepared / "manifest.json").read_text()
    again = prepare(f"folder:{source}", str(out), PrepareSettings(shard_size=5), verbose=0)
    assert again.already_done


def test_an_unfinished_or_finished_set_of_other_settings_is_refused(source, prepared, tmp_path):
    with pytest.raises(DatasetError, match="already holds a set prepared from .* settings"):
        prepare(f"folder:{source}", str(prepared), PrepareSettings(quality=80), verbose=0)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("")
    with pytest.raises(DatasetError, match="not empty and holds no prepared set"):
        prepare(f"folder:{source}", str(tmp_path / "other"), verbose=0)


def test_training_batches_are_random_224_crops_and_flips_of_the_stored_images(prepared):
    """Each row: its stream record's stored image, the 224 window at its draws' corner
    (room 33 in a 256 image), mirrored where its flip says, normalised by the manifest."""
    data = load_dataset(f"prepared:{prepared}", (224, 224, 3))
    assert data.augment == "alexnet" and data.num_train == 24 and data.num_classes == 3
    manifest = read_manifest(str(prepared))
    assert data.mean == tuple(manifest["mean"]) and data.std == tuple(manifest["std"])
    data.augment = "crop"  # the same crops and draws, no flips or lighting: exact pixels
    images, labels, positions = next(iter(data.train(8, seed=3)))
    records = list(data._train_records(3, 0).take(8))
    draws = list(train_draws(3, 0).take(8))
    for row in range(8):
        stored = tf.io.decode_jpeg(records[row][0], channels=3).numpy().astype(np.float64)
        assert int(labels[row]) == int(records[row][1])
        oy, ox = np.minimum((draws[row].corner.numpy() * 33).astype(int), 32)
        pixels = images[row].numpy() * data.std + np.array(data.mean)
        window = stored[oy:oy + 224, ox:ox + 224]
        assert np.abs(pixels - window).max() < 8 and np.abs(pixels - window).mean() < 0.2
    np.testing.assert_array_equal(positions.numpy(), np.arange(8))
    data.augment = "alexnet"
    flipped, _, _ = next(iter(data.train(8, seed=3)))
    for row in range(8):
        plain = images[row].numpy()
        mirror = plain[:, ::-1]
        got = flipped[row].numpy()
        # lighting shifts each channel by a constant: compare with it taken out
        def off(ref):
            return np.abs((got - got.mean((0, 1))) - (ref - ref.mean((0, 1)))).mean()
        assert (off(mirror) < off(plain)) == bool(draws[row].flip.numpy())


def test_the_cli_finishes_the_same_input_on_the_device(prepared):
    """What `train` reads (on_device: uint8 crops and each row's draws, finished by the
    step on its device) is, finished, exactly what the pipeline's own finishing gives."""
    data = load_dataset(f"prepared:{prepared}", (224, 224, 3))
    images, labels, positions, _ = next(iter(data.train_rows(8, seed=3)))
    raw, raw_labels, raw_positions, _ = next(iter(data.train_rows(8, seed=3, on_device=True)))
    assert isinstance(raw, DeviceBatch) and raw.crops.dtype == tf.uint8
    assert raw.crops.shape == (8, 224, 224, 3) and bool(tf.reduce_any(raw.flips))
    np.testing.assert_array_equal(finish_images(raw, data.mean, data.std).numpy(), images.numpy())
    np.testing.assert_array_equal(raw_labels.numpy(), labels.numpy())
    np.testing.assert_array_equal(raw_positions.numpy(), positions.numpy())


def test_a_resumed_stream_continues_the_uninterrupted_one(prepared):
    """Shards in an order drawn per epoch, blocks shuffled: a stream started at position p
    holds the uninterrupted stream's records from p on (blocks of 7 here, across shard and
    epoch boundaries), and an epoch holds every record once."""
    data = load_dataset(f"prepared:{prepared}", (224, 224, 3))
    data.shuffle_block = 7
    def sources(start, count):
        return [bytes(image.numpy()) for image, _ in data._train_records(4, start).take(count)]
    whole = sources(0, 80)
    assert len(set(whole[:24])) == 24 and set(whole[:24]) == set(whole[24:48])
    assert whole[:24] != whole[24:48]  # another order each epoch
    for start in (3, 7, 23, 30, 55):
        assert sources(start, 80 - start) == whole[start:], start


def test_the_fast_crop_is_the_generic_crop(prepared):
    """A 256-pixel stored image and a 224 input: the window decoded alone equals
    StreamDataset's decode-crop-and-resize of the same window."""
    data = load_dataset(f"prepared:{prepared}", (224, 224, 3))
    rng = np.random.default_rng(0)
    for (encoded, label), draws in zip(data._ordered_train_records().take(4),
                                       train_draws(5, 0).take(4)):
        corner = tf.constant(rng.uniform(size=2), tf.float32)
        fast = data._train_crop(0, (encoded, label), draws._replace(corner=corner))[0]
        generic = decode_train_crop(encoded, (224, 224), 3, corner)
        np.testing.assert_array_equal(fast.numpy(), generic.numpy())


def test_evaluation_center_crop_and_ten_crops_as_the_folder_path(prepared):
    data = load_dataset(f"prepared:{prepared}", (224, 224, 3))
    records = _stored(prepared, "validation", dct_method="")
    stored, labels = [image for _, _, image in records], [label for _, label, _ in records]
    images, got = next(iter(data.validation(6)))
    np.testing.assert_array_equal(got.numpy(), labels)
    expected = eval_preprocess(np.stack(stored), (224, 224), data.mean, data.std)
    np.testing.assert_allclose(images.numpy(), expected.numpy(), atol=1e-4)
    views, got = next(iter(data.validation_ten_crops(6)))
    assert views.shape == (6, 10, 224, 224, 3)
    np.testing.assert_array_equal(got.numpy(), labels)
    crops = ten_crops(upscale_for_ten_crop(np.stack(stored), (224, 224)), (224, 224))
    for v, crop in enumerate(crops):
        expected = (crop.astype(np.float32) - np.array(data.mean)) / np.array(data.std)
        np.testing.assert_allclose(views[:, v].numpy(), expected, atol=1e-4)


def test_ten_crop_error_of_a_streamed_set_equals_the_in_memory_path(prepared):
    """`evaluate --ten-crop` on a prepared set: every validation image's ten views streamed
    and scored give the error rates the in-memory path gives on the same stored images
    (`evaluate_probabilities`, ten_crops of upscale_for_ten_crop), for a predictor that
    reads every pixel."""
    data = load_dataset(f"prepared:{prepared}", (224, 224, 3))
    records = _stored(prepared, "validation", dct_method="")
    stored = np.stack([image for _, _, image in records])
    labels = np.array([label for _, label, _ in records])
    weights = np.random.default_rng(0).normal(size=(224 * 224 * 3, 3)).astype(np.float32)
    calls = []

    def predict(x):  # a softmax of a fixed random linear map of the uint8 pixels
        assert x.dtype == np.uint8 and x.shape[1:] == (224, 224, 3)
        calls.append(len(x))
        logits = (x.reshape(len(x), -1).astype(np.float32) / 255.0) @ weights
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    want = evaluate_probabilities(predict, stored, labels, (224, 224), ten_crop=True)
    calls.clear()
    got = evaluate_ten_crop_batches(predict, data.validation_ten_crops(4, normalized=False))
    assert got == want
    assert sum(calls) == 10 * len(labels) and 0 < want["top1_error"] < 1


def _copy_set(prepared, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(prepared, out)
    return out


@pytest.mark.parametrize("damage, message", [
    ("missing", r"no manifest\.json: not a prepared set; make one with python -m owt_tf.prepare"),
    ("not json", r"manifest\.json is damaged .*prepare it again \(delete .* first, or use "
                 r"another --out\): python -m owt_tf\.prepare folder:"),
    ("old format", r"older format \(version 0; this owt_tf reads version 1\): prepare it again"),
    ("no classes", r"is damaged \(no 'classes' list\)"),
    ("shard gone", r"train-00002-of-00006\.tfrecord is missing \(listed in manifest\.json\)"),
    ("shard cut", r"train-00002-of-00006\.tfrecord has \d+ bytes, manifest\.json says \d+"),
])
def test_a_bad_manifest_is_one_line_naming_the_fix(prepared, tmp_path, damage, message):
    out = _copy_set(prepared, tmp_path)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if damage == "missing":
        manifest_path.unlink()
    elif damage == "not json":
        manifest_path.write_text(manifest_path.read_text()[:-30])  # cut short
    elif damage in ("old format", "no classes"):
        manifest.update(format_version=0) if damage == "old format" else manifest.pop("classes")
        manifest_path.write_text(json.dumps(manifest))
    elif damage == "shard gone":
        (out / "train-00002-of-00006.tfrecord").unlink()
    else:
        shard = out / "train-00002-of-00006.tfrecord"
        shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(DatasetError, match=message) as err:
        load_dataset(f"prepared:{out}", (224, 224, 3))
    assert "\n" not in str(err.value)


def test_train_cli_says_one_line_for_an_old_manifest(prepared, tmp_path):
    out = _copy_set(prepared, tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(dict(manifest, format_version=0)))
    proc = subprocess.run([sys.executable, "-m", "owt_tf.train", "--dataset", f"prepared:{out}",
                           "--model", "alexnet_tiny", "--steps", "1", "--devices", "1",
                           "--logdir", str(tmp_path / "run")],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "older format" in lines[0] and "prepare it again" in lines[0]


def test_prepare_cli_refuses_bad_flags_in_one_line(tmp_path):
    out = ["--out", str(tmp_path / "o")]
    for args, message in ([["folder:/no/such/dir"] + out, "no such directory"],
                          [["photos"] + out, "SOURCE 'photos'"],
                          [[f"folder:{tmp_path}", "--quality", "0"] + out,
                           "--quality must be in 1..100"]):
        proc = subprocess.run([sys.executable, "-m", "owt_tf.prepare"] + args,
                              capture_output=True, text=True, env=ENV, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_killed_prepare_continues_where_it_stopped(tmp_path):
    """The CLI killed (SIGKILL) after some shards; the same command again ends with the
    bytes of an uninterrupted prepare and reports the unreadable files on stderr."""
    source = _write_folder(tmp_path / "src", per_class=30, val_per_class=2)
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "owt_tf.prepare", f"folder:{source}", "--out", str(out),
               "--shard-size", "4", "--quiet"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    marks = out / "progress"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if marks.is_dir() and len(list(marks.glob("*.json"))) >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the prepare ended before it could be killed"
    assert not (out / "manifest.json").exists()
    again = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resumed: " in again.stdout and "Traceback" not in again.stderr
    assert "2 files could not be read" in again.stderr
    whole = tmp_path / "whole"
    prepare(f"folder:{source}", str(whole), PrepareSettings(shard_size=4), verbose=0)
    assert _shard_bytes(out) == _shard_bytes(whole)


@pytest.mark.slow
def test_train_cli_trains_on_a_prepared_set(prepared, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "owt_tf.train",
                           "--dataset", f"prepared:{prepared}",
                           "--model", "alexnet_tiny", "--steps", "2", "--batch-size", "4",
                           "--devices", "2", "--logdir", str(tmp_path / "run")],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 2 steps" in proc.stdout
    stats = json.loads((tmp_path / "run" / "input_stats.json").read_text())
    manifest = read_manifest(str(prepared))
    np.testing.assert_allclose(stats["mean"], manifest["mean"])
    # 10-crop evaluation of the run, its validation views streamed from the set
    proc = subprocess.run([sys.executable, "-m", "owt_tf.evaluate", "--logdir",
                           str(tmp_path / "run"), "--ten-crop"],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    images = manifest["counts"]["validation"]
    assert f"validation ({images} images, 10-crop): top-1 error" in proc.stdout


@pytest.mark.slow
def test_bench_prints_the_prepared_set_beside_bare_decode_of_the_originals(prepared):
    proc = subprocess.run([sys.executable, "-m", "owt_tf.bench", "--input", f"prepared:{prepared}",
                           "--image-size", "224", "--batch-size", "4", "--devices", "1",
                           "--steps", "1", "--warmup", "1"],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training, prepared set" in proc.stdout and "bare decode_jpeg, originals" in proc.stdout
    assert "prepared training / bare decode of the originals:" in proc.stdout
