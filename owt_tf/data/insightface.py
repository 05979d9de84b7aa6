"""InsightFace's face-recognition sets as they ship (`insightface:DIR`), read without MXNet:
the training images in MXNet RecordIO (`train.rec` + `train.idx`), the verification pairs
in pickled `*.bin` files; and a writer of both formats, byte for byte as MXNet writes them.

RecordIO (dmlc-core's recordio, MXNet's `recordio.py`): a record is uint32 magic
0xced7230a, uint32 `cflag << 29 | length`, `length` payload bytes, zeros up to a multiple of
4. A payload that holds the magic at a 4-byte-aligned position is written as parts split
there (cflag 1 first, 2 middle, 3 last; 0 a whole record), the magic itself left out and put
back between the parts on reading. A payload is an IRHeader `<IfQQ` (flag, label, id, id2);
flag > 0: `flag` float32 labels follow it (the label field is then 0) and an image's
identity is the first; then the JPEG bytes. `train.idx` has lines `key<TAB>byte offset`.

Sets ship two ways. With a header record (InsightFace's RecBuilder): key 0 has flag 2 and
labels [first identity record, end], images are keys 1 .. first-1, and each key of
[first, end) is an identity's record (labels [its first image, end)), so there are
end - first identities. Without one: every key of the .idx is an image, and the identity
count is the `property` file's first field ("identities,height,width") or else the largest
label + 1. A key 0 counts as a header only when it has labels, at least two, and no image:
an image whose label is an array is still an image.

The whole .idx and every record's header are checked when the set is opened (one read of
a few bytes per record through a memory map): a damaged set (bad magic, a truncated record,
an .idx offset past the end of the .rec, a label that is no identity) is a DatasetError
naming the file and the record, before training starts. An image that does not decode is
not damage to the set: the stream skips it as it does any folder image (owt_tf.data.stream).

The dataset that trains on a set (`insightface:DIR`) is owt_tf.data.insightface_stream.

Validation: InsightFace sets have no classification validation split. One image of each
identity with at least 3 images (of at most VALIDATION_IDENTITIES identities, evenly spread
over the labels) is held out of training, drawn from a fixed seed, so the split never
changes with --seed. Face verification is measured on the `*.bin` pairs instead
(`verification_sets`).
"""
from __future__ import annotations

import dataclasses
import glob
import os
import pickle
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from owt_tf.data import DatasetError
from owt_tf.data.verification import VerificationPairs

from owt_tf.data.recordio import (FIRST, IR_SIZE, LENGTH_MASK, MAGIC, WHOLE, RecordFile,
                                 read_index, unpack_payload)


VALIDATION_IDENTITIES = 10_000  # identities with an image held out for validation, at most
MIN_IMAGES_TO_HOLD_OUT = 3  # an identity keeps at least two training images
_SPLIT_SEED = 20140421  # fixed: the validation split never changes with --seed
_SCAN_CHUNK = 1 << 20  # records whose headers are gathered from the memory map at once


# ---------------------------------------------------------------------------------- writing


def write_property(directory: str, identities: int,
                   image_size: Tuple[int, int] = (112, 112)) -> None:
    """InsightFace's `property` file: "identities,height,width"."""
    with open(os.path.join(directory, "property"), "w") as f:
        f.write(f"{identities},{image_size[0]},{image_size[1]}\n")


def write_verification_bin(path: str, pairs_jpegs: Sequence[Tuple[bytes, bytes]],
                           same: Sequence[bool]) -> None:
    """A verification `.bin`: the pickle of (JPEG bytes two per pair, same/different)."""
    if len(pairs_jpegs) != len(same):
        raise ValueError(f"{len(pairs_jpegs)} pairs but {len(same)} same/different flags")
    images = [bytes(image) for pair in pairs_jpegs for image in pair]
    with open(path, "wb") as f:
        # Protocol 2, as the Python 2 era files InsightFace ships: any reader loads it.
        pickle.dump((images, [bool(s) for s in same]), f, protocol=2)


# ---------------------------------------------------------------------------------- reading


@dataclasses.dataclass
class RecordSet:
    """The image records of an InsightFace `train.rec`: where each image's JPEG bytes are
    and its identity. `image_length` -1: a split record, whose JPEG is read by joining parts."""

    rec: RecordFile
    idx_path: str
    keys: np.ndarray  # int64 [N]: the images' keys, ascending
    offsets: np.ndarray  # int64 [N]: their records' byte offsets in the .rec
    image_start: np.ndarray  # int64 [N]: byte offset of the JPEG bytes (whole records)
    image_length: np.ndarray  # int64 [N]
    labels: np.ndarray  # int32 [N]: identities
    num_identities: int
    has_header: bool

    def where(self, i: int) -> str:
        return f"key {int(self.keys[i])} (offset {int(self.offsets[i])})"

    def image_bytes(self, i: int) -> bytes:
        """The i-th image's encoded bytes."""
        if self.image_length[i] >= 0:
            return self.rec.read(int(self.image_start[i]), int(self.image_length[i]))
        payload = self.rec.payload(int(self.offsets[i]), self.where(i))
        return unpack_payload(payload, f"{self.rec.path}: {self.where(i)}")[2]

    def block(self, indices: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(encoded bytes as an object array, int32 identities) of the images `indices`:
        whole records sliced from the .rec's memory map in one call, split ones joined."""
        indices = np.asarray(indices, np.int64)
        encoded = np.empty(len(indices), object)
        encoded[:] = self.rec.read_many(self.image_start[indices].tolist(),
                                        np.maximum(self.image_length[indices], 0).tolist())
        for k in np.flatnonzero(self.image_length[indices] < 0):
            encoded[k] = self.image_bytes(int(indices[k]))
        return encoded, self.labels[indices]


def open_record_set(directory: str) -> RecordSet:
    """The checked image records of DIR/train.rec + train.idx (module docstring)."""
    rec_path, idx_path = (os.path.join(directory, f"train.{ext}") for ext in ("rec", "idx"))
    for path in (rec_path, idx_path):
        if not os.path.isfile(path):
            raise DatasetError(f"insightface:{directory}: no {os.path.basename(path)} in "
                               f"{directory}")
    rec = RecordFile(rec_path)
    keys, offsets = read_index(idx_path)
    by_key = dict(zip(keys.tolist(), offsets.tolist()))
    header = _header_record(rec, idx_path, by_key)
    if header is not None:
        first_identity, end = header
        if not 2 <= first_identity <= len(by_key) or end < first_identity:
            raise DatasetError(f"{rec_path}: key 0 (offset {by_key[0]}): a header record with "
                               f"labels [{first_identity}, {end}], not [first identity, end] "
                               f"of the {len(by_key)} records")
        image_keys = np.arange(1, first_identity, dtype=np.int64)
        num_identities = end - first_identity
    else:
        image_keys = np.unique(keys)
        num_identities = _property_identities(directory)
    try:
        image_offsets = np.array([by_key[k] for k in image_keys.tolist()], np.int64)
    except KeyError as err:
        raise DatasetError(f"{idx_path}: no key {err.args[0]}, an image record per the header "
                           f"record (key 0)") from None
    start, length, labels = _scan_headers(rec, idx_path, image_keys, image_offsets)
    if num_identities is None:
        num_identities = int(labels.max()) + 1 if labels.size else 0
    identities = _identities(labels, num_identities, rec_path, image_keys, image_offsets)
    return RecordSet(rec, idx_path, image_keys, image_offsets, start, length, identities,
                     num_identities, header is not None)


def _header_record(rec: RecordFile, idx_path: str, by_key: dict) -> Optional[Tuple[int, int]]:
    """(first identity record, end) from key 0 if it is a header record, else None."""
    if 0 not in by_key:
        return None
    offset = by_key[0]
    where = f"key 0 (offset {offset})"
    if not 0 <= offset <= rec.size - 8:
        raise DatasetError(f"{idx_path}: {where}: past the end of {rec.path} ({rec.size} bytes)")
    flag, labels, image = unpack_payload(rec.payload(offset, where), f"{rec.path}: {where}")
    if flag < 2 or image:
        return None
    return int(labels[0]), int(labels[1])


def _property_identities(directory: str) -> Optional[int]:
    path = os.path.join(directory, "property")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        return int(text.split(",")[0])
    except ValueError:
        raise DatasetError(f"{path}: {text[:40]!r} is not 'identities,height,width'") from None


def _scan_headers(rec: RecordFile, idx_path: str, keys: np.ndarray, offsets: np.ndarray):
    """(JPEG start, JPEG length, first label as float32) of every record, each checked;
    whole records read through a memory map in chunks, split ones one by one."""
    n = len(keys)
    start, length = np.zeros(n, np.int64), np.zeros(n, np.int64)
    labels = np.zeros(n, np.float32)
    if n == 0:
        return start, length, labels
    raw = np.memmap(rec.path, np.uint8, mode="r") if rec.size else np.zeros(0, np.uint8)
    for lo in range(0, n, _SCAN_CHUNK):
        part = slice(lo, min(n, lo + _SCAN_CHUNK))
        start[part], length[part], labels[part] = _scan_chunk(
            rec, raw, idx_path, keys[part], offsets[part])
    return start, length, labels


def _scan_chunk(rec: RecordFile, raw: np.ndarray, idx_path: str, keys, offsets):
    def fail(i, problem: str, file: str = rec.path):
        raise DatasetError(f"{file}: key {keys[i]} (offset {offsets[i]}): {problem}")

    past = np.flatnonzero((offsets < 0) | (offsets + 8 > rec.size))
    if past.size:
        fail(past[0], f"past the end of {rec.path} ({rec.size} bytes)", idx_path)
    head = _gather(raw, offsets, 8).view("<u4")  # [n, 2]: magic, cflag << 29 | length
    bad = np.flatnonzero(head[:, 0] != MAGIC)
    if bad.size:
        fail(bad[0], f"bad magic 0x{int(head[bad[0], 0]):08x}, not a RecordIO record")
    cflag, size = head[:, 1] >> 29, (head[:, 1] & LENGTH_MASK).astype(np.int64)
    mid = np.flatnonzero(cflag > FIRST)
    if mid.size:
        fail(mid[0], f"a record starting with part flag {int(cflag[mid[0]])} (not 0 or 1)")
    over = np.flatnonzero(offsets + 8 + size > rec.size)
    if over.size:
        fail(over[0], f"a record of {int(size[over[0]])} bytes runs past the end of the file "
                      f"({rec.size} bytes): truncated")
    whole = cflag == WHOLE
    short = np.flatnonzero(whole & (size < IR_SIZE))
    if short.size:
        fail(short[0], f"{int(size[short[0]])} payload bytes, too few for its {IR_SIZE}-byte "
                       f"IRHeader: truncated")
    ir = _gather(raw, np.where(whole, offsets + 8, 0), IR_SIZE + 4)
    flag = ir[:, :4].copy().view("<u4")[:, 0].astype(np.int64)
    scalar = ir[:, 4:8].copy().view("<f4")[:, 0]
    first = ir[:, IR_SIZE:].copy().view("<f4")[:, 0]
    header_bytes = IR_SIZE + 4 * flag
    cut = np.flatnonzero(whole & (size < header_bytes))
    if cut.size:
        fail(cut[0], f"its IRHeader announces {int(flag[cut[0]])} labels but the payload holds "
                     f"{int(size[cut[0]])} bytes: truncated")
    start = offsets + 8 + header_bytes
    length = size - header_bytes
    labels = np.where(flag > 0, first, scalar).astype(np.float32)
    for i in np.flatnonzero(~whole):  # split records: rare, joined one by one
        where = f"key {keys[i]} (offset {offsets[i]})"
        _, record_labels, _ = unpack_payload(rec.payload(int(offsets[i]), where),
                                             f"{rec.path}: {where}")
        start[i], length[i], labels[i] = -1, -1, record_labels[0]
    return start, length, labels


def _gather(raw: np.ndarray, offsets: np.ndarray, count: int) -> np.ndarray:
    """uint8 [n, count]: the `count` bytes at each offset (zeros past the end of the file)."""
    at = offsets[:, None] + np.arange(count, dtype=np.int64)
    inside = at < raw.size
    out = np.asarray(raw[np.where(inside, at, 0)]) if raw.size else np.zeros(at.shape, np.uint8)
    return np.where(inside, out, 0).astype(np.uint8)


def _identities(labels: np.ndarray, num_identities: int, rec_path: str, keys: np.ndarray,
                offsets: np.ndarray) -> np.ndarray:
    """The float labels as int32 identities; DatasetError naming the first that is none."""
    identity = np.floor(labels)
    wrong = np.flatnonzero(~np.isfinite(labels) | (identity != labels) | (identity < 0)
                           | (identity >= num_identities))
    if wrong.size:
        i = wrong[0]
        raise DatasetError(f"{rec_path}: key {keys[i]} (offset {offsets[i]}): label "
                           f"{labels[i]:g} is not an identity in [0, {num_identities})")
    return identity.astype(np.int32)


def read_identity_records(directory: str) -> Iterator[Tuple[bytes, int]]:
    """(JPEG bytes, identity) of every image of DIR/train.rec, in key order; the set is
    checked first (DatasetError if damaged), the images are not decoded."""
    records = open_record_set(directory)
    for i in range(len(records.keys)):
        yield records.image_bytes(i), int(records.labels[i])


def held_out_for_validation(labels: np.ndarray,
                            max_identities: int = VALIDATION_IDENTITIES) -> np.ndarray:
    """Indices of the images held out for validation: one of each identity with at least
    MIN_IMAGES_TO_HOLD_OUT images, for at most `max_identities` identities evenly spread
    over the labels; which image is drawn from a fixed seed."""
    counts = np.bincount(labels) if labels.size else np.zeros(0, np.int64)
    eligible = np.flatnonzero(counts >= MIN_IMAGES_TO_HOLD_OUT)
    if not eligible.size:
        return np.zeros(0, np.int64)
    spread = np.linspace(0, len(eligible) - 1, min(max_identities, len(eligible)))
    chosen = eligible[np.unique(spread.round().astype(int))]
    by_identity = np.argsort(labels, kind="stable")
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    draws = np.random.default_rng(_SPLIT_SEED).integers(0, counts[chosen])
    return np.sort(by_identity[firsts[chosen] + draws])


# --------------------------------------------------------------------- verification pairs


def read_verification_bin(path: str, image_size: Tuple[int, int] = (112, 112),
                          channels: int = 3) -> VerificationPairs:
    """A `.bin` of pairs decoded to uint8 [P, H, W, C] at `image_size` (resized when not
    already that size). A file that is not such a pickle, or holds an image that does not
    decode, is a DatasetError naming the file (and the image): leaving a pair out would
    move every later pair into another fold, and the numbers would no longer be the ones
    published for the set."""
    try:
        with open(path, "rb") as f:
            images, same = pickle.load(f, encoding="bytes")
    except Exception as err:  # pickle raises many kinds for a file that is not one
        raise DatasetError(f"{path}: not a verification .bin pickle ({type(err).__name__}: "
                           f"{err})".splitlines()[0]) from None
    if len(images) != 2 * len(same):
        raise DatasetError(f"{path}: {len(images)} images for {len(same)} pairs (needs two each)")
    if not same:
        raise DatasetError(f"{path}: no pairs")
    decoded = []
    for index, image in enumerate(images):
        pixels = _decode_pair_image(image, image_size, channels)
        if pixels is None:
            raise DatasetError(f"{path}: image {index} (pair {index // 2}) does not decode")
        decoded.append(pixels)
    flags = np.array([bool(s) for s in same], bool)
    return VerificationPairs(np.stack(decoded[0::2]), np.stack(decoded[1::2]), flags,
                             os.path.splitext(os.path.basename(path))[0])


def _decode_pair_image(image, size: Tuple[int, int], channels: int) -> Optional[np.ndarray]:
    data = image.tobytes() if isinstance(image, np.ndarray) else bytes(image)
    try:
        pixels = tf.io.decode_image(data, channels=channels, expand_animations=False)
    except (tf.errors.InvalidArgumentError, ValueError):
        return None
    if tuple(pixels.shape[:2]) != tuple(size):
        pixels = tf.round(tf.image.resize(tf.cast(pixels, tf.float32), size, method="bilinear"))
        pixels = tf.cast(tf.clip_by_value(pixels, 0, 255), tf.uint8)
    return pixels.numpy()


def verification_sets(directory: str,
                      image_size: Tuple[int, int] = (112, 112)) -> List[VerificationPairs]:
    """Every `*.bin` in `directory` (lfw, cfp_fp, agedb_30, ...), by name, as VerificationPairs."""
    return [read_verification_bin(path, image_size)
            for path in sorted(glob.glob(os.path.join(directory, "*.bin")))]
