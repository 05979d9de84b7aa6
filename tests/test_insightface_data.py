"""insightface:DIR: MXNet RecordIO (train.rec + train.idx) and verification .bin files read
without MXNet, written byte for byte as MXNet writes them; damage is one DatasetError line
naming the file and the record; an undecodable image is skipped and counted."""
import pickle
import struct

import numpy as np
import pytest
import tensorflow as tf

from owt_tf.data.datasets import DatasetError, load_dataset
from owt_tf.data.insightface import (read_identity_records, verification_sets, write_property,
                                     write_verification_bin)
from owt_tf.data.recordio import (IR_FORMAT, MAGIC, pack_payload, read_index, record_bytes,
                                  write_record_file)

SIDE = 16
COLORS = (30, 90, 150, 210)  # identity k: left half COLORS[k], right half 255 - COLORS[k]


def _face(identity, side=SIDE):
    pixels = np.full((side, side, 3), COLORS[identity], np.uint8)
    pixels[:, side // 2:] = 255 - COLORS[identity]
    return tf.io.encode_jpeg(pixels, quality=95).numpy()


def _images(identities=3, per_identity=4, bad=()):
    """(JPEG bytes, identity) in identity order; the (identity, i) in `bad` not an image."""
    return [(b"not an image at all" if (k, i) in bad else _face(k), k)
            for k in range(identities) for i in range(per_identity)]


def _write(root, header=True, **kw):
    root.mkdir(parents=True, exist_ok=True)
    items = _images(**kw)
    write_record_file(str(root / "train"), items, header=header)
    return root, items


def _offset(root, key):
    keys, offsets = read_index(str(root / "train.idx"))
    return int(offsets[list(keys).index(key)])


def _single_line_error(root, *names):
    with pytest.raises(DatasetError) as err:
        load_dataset(f"insightface:{root}", (SIDE, SIDE, 3))
    message = str(err.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message
    return message


def test_records_are_laid_out_as_mxnet_writes_them():
    magic = struct.pack("<I", MAGIC)
    assert record_bytes(b"abcde") == magic + struct.pack("<I", 5) + b"abcde\0\0\0"
    assert len(record_bytes(b"record_0")) == 16  # MXIndexedRecordIO.tell()'s own example
    assert pack_payload(3, b"xy", 7) == struct.pack("<IfQQ", 0, 3.0, 7, 0) + b"xy"
    assert pack_payload([1, 2], b"", 0, id2=1) == (struct.pack("<IfQQ", 2, 0.0, 0, 1)
                                                   + np.float32([1, 2]).tobytes())
    # The magic at an aligned position splits the record there (cflag 1, then 3), dropped.
    split = record_bytes(b"abcd" + magic + b"efghij")
    assert split == (magic + struct.pack("<I", 1 << 29 | 4) + b"abcd"
                     + magic + struct.pack("<I", 3 << 29 | 6) + b"efghij\0\0")
    # Unaligned, it is payload like any other bytes.
    assert record_bytes(b"ab" + magic + b"cd") == magic + struct.pack("<I", 8) + b"ab" + magic + b"cd"


@pytest.mark.parametrize("header", [True, False])
def test_both_layouts_read_back_exactly(tmp_path, header):
    root, items = _write(tmp_path / "set", header=header)
    assert list(read_identity_records(str(root))) == items
    keys, _ = read_index(str(root / "train.idx"))
    if header:  # images 1..12, identities 13..15, the header record (key 0) written last
        assert list(keys) == list(range(1, 16)) + [0]
    else:
        assert list(keys) == list(range(12))
    ds = load_dataset(f"insightface:{root}", (SIDE, SIDE, 3))
    assert ds.records.has_header == header and ds.num_classes == 3
    assert ds.label_names() == ("0", "1", "2")


def test_array_labels_and_the_property_file(tmp_path):
    root = tmp_path / "set"
    root.mkdir()
    items = [(jpeg, [float(k), 0.5]) for jpeg, k in _images()]  # identity = label[0]
    write_record_file(str(root / "train"), items, header=False)
    write_property(str(root), 5, (SIDE, SIDE))
    assert [k for _, k in read_identity_records(str(root))] == [k for k in range(3) for _ in range(4)]
    assert load_dataset(f"insightface:{root}", (SIDE, SIDE, 3)).num_classes == 5


def test_a_split_record_reads_back(tmp_path):
    """A JPEG holding the magic at an aligned position of its payload (in a comment
    segment): written in parts, read back whole, decoded in training."""
    magic = struct.pack("<I", MAGIC)
    plain = _face(1)
    comment = b"xx" + magic + b"yy"  # 24-byte IRHeader + SOI + FFFE + length + "xx": at 32
    jpeg = plain[:2] + b"\xff\xfe" + struct.pack(">H", len(comment) + 2) + comment + plain[2:]
    assert (struct.calcsize(IR_FORMAT) + jpeg.index(magic)) % 4 == 0
    root = tmp_path / "set"
    root.mkdir()
    items = [(_face(0), 0)] * 3 + [(jpeg, 1)] * 3
    write_record_file(str(root / "train"), items, header=False)
    rec = (root / "train.rec").read_bytes()
    _, lrec = struct.unpack("<II", rec[_offset(root, 3):_offset(root, 3) + 8])
    assert lrec >> 29 == 1  # the first part of a split record
    assert list(read_identity_records(str(root))) == items
    np.testing.assert_array_equal(tf.io.decode_jpeg(jpeg).numpy(), tf.io.decode_jpeg(plain).numpy())
    ds = load_dataset(f"insightface:{root}", (SIDE, SIDE, 3))
    _, labels, _, failed = next(iter(ds.train_rows(ds.num_train, seed=0)))
    assert not np.any(failed.numpy()) and sorted(labels.numpy()) == [0, 0, 1, 1]


def _bad_magic(root):
    at = _offset(root, 2)
    data = bytearray((root / "train.rec").read_bytes())
    data[at:at + 4] = b"\0\0\0\0"
    (root / "train.rec").write_bytes(bytes(data))
    return ("train.rec", "key 2", "bad magic")


def _truncated_image(root):
    at = _offset(root, 11)  # the last record of a set without header
    (root / "train.rec").write_bytes((root / "train.rec").read_bytes()[:at + 40])
    return ("train.rec", "key 11", f"offset {at}", "truncated")


def _truncated_header(root):
    at = _offset(root, 0)  # written last in the header layout
    (root / "train.rec").write_bytes((root / "train.rec").read_bytes()[:at + 20])
    return ("train.rec", "key 0", "truncated")


def _offset_past_the_end(root):
    lines = (root / "train.idx").read_text().splitlines()
    lines = [f"3\t{10 ** 7}" if line.startswith("3\t") else line for line in lines]
    (root / "train.idx").write_text("\n".join(lines) + "\n")
    return ("train.idx", "key 3", f"offset {10 ** 7}", "past the end")


def _label_past_the_identities(root):
    at = _offset(root, 5) + 8 + 4  # the IRHeader's label field of image 5
    data = bytearray((root / "train.rec").read_bytes())
    data[at:at + 4] = struct.pack("<f", 9.0)
    (root / "train.rec").write_bytes(bytes(data))
    return ("train.rec", "key 5", "label 9", "[0, 3)")


def _negative_label(root):
    at = _offset(root, 4) + 8 + 4
    data = bytearray((root / "train.rec").read_bytes())
    data[at:at + 4] = struct.pack("<f", -1.0)
    (root / "train.rec").write_bytes(bytes(data))
    return ("train.rec", "key 4", "label -1")


@pytest.mark.parametrize("damage, header", [
    (_bad_magic, True), (_truncated_image, False), (_truncated_header, True),
    (_offset_past_the_end, False), (_label_past_the_identities, True), (_negative_label, False)])
def test_damage_is_one_line_naming_file_and_record(tmp_path, damage, header):
    root, _ = _write(tmp_path / "set", header=header)
    _single_line_error(root, *damage(root))


def test_a_label_outside_the_property_identities(tmp_path):
    root = tmp_path / "set"
    root.mkdir()
    write_record_file(str(root / "train"), _images(identities=4, per_identity=2), header=False)
    write_property(str(root), 3)
    _single_line_error(root, "train.rec", "key 6", "label 3", "[0, 3)")


def test_missing_files_and_bad_index_lines(tmp_path):
    _single_line_error(tmp_path, "no train.rec")
    root, _ = _write(tmp_path / "set", header=False)
    (root / "train.idx").write_text("0\t0\nnot a line\n")
    _single_line_error(root, "train.idx", "line 2")


def test_an_undecodable_image_is_skipped_and_counted(tmp_path):
    """Two of identity 1's images are not images: one at least stays in training (one image
    per identity is held out), its rows hold another record of their batch and count it."""
    root, _ = _write(tmp_path / "set", header=True, per_identity=5, bad=((1, 0), (1, 1)))
    ds = load_dataset(f"insightface:{root}", (SIDE, SIDE, 3))
    assert ds.num_train == 12
    failed_rows = 0
    for images, labels, _, failed in ds.train_rows(ds.num_train, seed=0).take(3):
        failed_rows += int(np.count_nonzero(failed.numpy()))
        _assert_images_show_their_labels(images.numpy(), labels.numpy(), ds)
    assert failed_rows >= 3  # each epoch meets the bad training record(s)


def _assert_images_show_their_labels(images, labels, ds, flips_seen=None):
    pixels = images * np.array(ds.std) + np.array(ds.mean)
    for image, label in zip(pixels, labels):
        left, right = image[:, :SIDE // 2].mean(), image[:, SIDE // 2:].mean()
        want = (COLORS[label], 255 - COLORS[label])
        assert sorted((left, right)) == pytest.approx(sorted(want), abs=4), (label, left, right)
        if flips_seen is not None:
            flips_seen.add(abs(left - want[0]) > 4)


def test_load_dataset_batches_validation_and_flips(tmp_path):
    root, _ = _write(tmp_path / "set", header=True, identities=4, per_identity=5)
    ds = load_dataset(f"insightface:{root}", (SIDE, SIDE, 3))
    assert ds.augment == "flip" and ds.trains_with_flips
    assert ds.mean == (127.5,) * 3 and not ds.has_own_statistics
    assert ds.num_classes == 4 and ds.num_train == 16  # one image of each identity held out
    flips_seen = set()
    for step, (images, labels, positions) in enumerate(ds.train(8, seed=1).take(4)):
        assert images.shape == (8, SIDE, SIDE, 3) and images.dtype == tf.float32
        np.testing.assert_array_equal(positions.numpy(), np.arange(step * 8, step * 8 + 8))
        _assert_images_show_their_labels(images.numpy(), labels.numpy(), ds, flips_seen)
    assert flips_seen == {True, False}
    val = [(x.numpy(), y.numpy()) for x, y in ds.validation(3)]
    labels = np.concatenate([y for _, y in val])
    assert sorted(labels[labels >= 0]) == [0, 1, 2, 3]
    for x, y in val:
        _assert_images_show_their_labels(x[y >= 0], y[y >= 0], ds)
    again = load_dataset(f"insightface:{root}", (SIDE, SIDE, 3))
    np.testing.assert_array_equal(again.val_indices, ds.val_indices)  # a fixed split


def _pair_images(n):
    rng = np.random.default_rng(5)
    return [tf.io.encode_jpeg(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).numpy()
            for _ in range(2 * n)]


def test_verification_bins_read_back(tmp_path):
    jpegs = _pair_images(4)
    same = [True, False, True, False]
    pairs = list(zip(jpegs[0::2], jpegs[1::2]))
    write_verification_bin(str(tmp_path / "lfw.bin"), pairs, same)
    with open(tmp_path / "lfw.bin", "rb") as f:
        images, flags = pickle.load(f, encoding="bytes")  # InsightFace's own reading of it
    assert images == jpegs and flags == same
    write_verification_bin(str(tmp_path / "agedb_30.bin"), pairs[:2], same[:2])
    agedb, lfw = verification_sets(str(tmp_path), (SIDE, SIDE))
    assert (lfw.name, agedb.name) == ("lfw", "agedb_30")
    decoded = np.stack([tf.io.decode_jpeg(j).numpy() for j in jpegs])
    np.testing.assert_array_equal(lfw.first, decoded[0::2])
    np.testing.assert_array_equal(lfw.second, decoded[1::2])
    np.testing.assert_array_equal(lfw.same, same)
    assert len(agedb) == 2
    small = verification_sets(str(tmp_path), (8, 8))[1]
    assert small.first.shape == (4, 8, 8, 3) and small.first.dtype == np.uint8


def test_a_bin_with_an_image_that_does_not_decode_is_one_error_naming_it(tmp_path):
    jpegs = _pair_images(2)
    write_verification_bin(str(tmp_path / "calfw.bin"), [(jpegs[0], jpegs[1]),
                                                         (jpegs[2], b"broken")], [True, False])
    with pytest.raises(DatasetError, match=r"calfw.bin: image 3 \(pair 1\) does not decode"):
        verification_sets(str(tmp_path), (SIDE, SIDE))


def test_a_bin_that_is_not_a_pickle(tmp_path):
    (tmp_path / "cfp_fp.bin").write_bytes(b"\x00garbage")
    with pytest.raises(DatasetError, match="cfp_fp.bin: not a verification"):
        verification_sets(str(tmp_path))


def test_the_faces_set_written_as_insightface_reads_back(tmp_path):
    from owt_tf.data.faces import faces_dataset

    faces = faces_dataset((SIDE, SIDE, 3), identities=5, images_per_identity=4,
                          held_out_identities=3, pairs=10)
    faces.write_insightface(str(tmp_path / "faces"))
    ds = load_dataset(f"insightface:{tmp_path / 'faces'}", (SIDE, SIDE, 3))
    assert ds.num_classes == 5 and ds.records.has_header and len(ds.records.keys) == 20
    (pairs,) = ds.verification_sets()
    np.testing.assert_array_equal(pairs.same, faces.pairs.same)
    jpeg_view = [tf.io.decode_jpeg(tf.io.encode_jpeg(image, quality=95)).numpy()
                 for image in faces.pairs.first]
    np.testing.assert_array_equal(pairs.first, np.stack(jpeg_view))
