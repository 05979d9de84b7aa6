"""MXNet RecordIO, read and written without MXNet (retired; it does not install on today's
Python): the format of InsightFace's `train.rec` + `train.idx`.

A record (dmlc-core's recordio, MXNet's `recordio.py`) is uint32 magic 0xced7230a, uint32
`cflag << 29 | length`, `length` payload bytes, zeros up to a multiple of 4. A payload that
holds the magic at a 4-byte-aligned position is written as parts split there (cflag 1
first, 2 middle, 3 last; 0 a whole record), the magic itself left out and put back between
the parts on reading. A payload is an IRHeader `<IfQQ` (flag, label, id, id2); flag > 0:
`flag` float32 labels follow it (the label field is then 0); then the image bytes.
`train.idx` has lines `key<TAB>byte offset`. What the records mean (images, identities, a
header record) is owt_tf.data.insightface.
"""
from __future__ import annotations

import mmap
import os
import struct
from typing import Iterable, List, Sequence, Tuple, Union

import numpy as np

from owt_tf.data import DatasetError


MAGIC = 0xCED7230A
LENGTH_MASK = (1 << 29) - 1
IR_FORMAT = "<IfQQ"  # flag, label, id, id2: MXNet packs 'IfQQ' natively, 24 bytes, no padding
IR_SIZE = struct.calcsize(IR_FORMAT)
WHOLE, FIRST, MIDDLE, LAST = 0, 1, 2, 3  # cflag: a whole record, or a part of a split one

Label = Union[int, float, Sequence[float]]


def _aligned(n: int) -> int:
    return (n + 3) & ~3


def record_bytes(payload: bytes) -> bytes:
    """`payload` as RecordIO writes it: split at every 4-byte-aligned copy of the magic (the
    copy dropped), each part behind magic and `cflag << 29 | length`, zero-padded to 4."""
    magic = struct.pack("<I", MAGIC)
    out, start = [], 0
    for i in range(0, len(payload) - len(payload) % 4, 4):
        if payload[i:i + 4] == magic:
            cflag = FIRST if start == 0 else MIDDLE
            out += [magic, struct.pack("<I", cflag << 29 | (i - start)), payload[start:i]]
            start = i + 4
    cflag = LAST if start else WHOLE
    rest = payload[start:]
    out += [magic, struct.pack("<I", cflag << 29 | len(rest)), rest]
    out.append(b"\0" * (_aligned(len(payload)) - len(payload)))
    return b"".join(out)


def pack_payload(label: Label, image: bytes, key: int, id2: int = 0) -> bytes:
    """An IRHeader (a scalar label: flag 0; an array: flag = its length, the floats after the
    header) followed by the image bytes, as MXNet's recordio.pack makes it."""
    if np.ndim(label) == 0:
        return struct.pack(IR_FORMAT, 0, float(label), key, id2) + image
    labels = np.asarray(label, np.float32).ravel()
    return struct.pack(IR_FORMAT, labels.size, 0.0, key, id2) + labels.tobytes() + image


def write_record_file(path_prefix: str, images_and_labels: Iterable[Tuple[bytes, Label]],
                      header: bool = True) -> int:
    """Writes `path_prefix`.rec and .idx from (JPEG bytes, label) in order; returns the
    number of images. `header=True` writes InsightFace's layout: images at keys 1..n, one
    identity record per label (images of a label must be consecutive, labels 0, 1, ... in
    order), and the header record at key 0, written last as RecBuilder does; `header=False`:
    images at keys 0..n-1 and nothing else."""
    first_key = 1 if header else 0
    ranges: List[List[int]] = []  # per identity: [first image key, end]
    with open(path_prefix + ".rec", "wb") as rec, open(path_prefix + ".idx", "w") as idx:
        def write(key: int, payload: bytes) -> None:
            idx.write(f"{key}\t{rec.tell()}\n")
            rec.write(record_bytes(payload))

        key = first_key
        for image, label in images_and_labels:
            if header:
                identity = int(np.ravel(label)[0])
                if identity == len(ranges):
                    ranges.append([key, key])
                elif identity != len(ranges) - 1:
                    raise ValueError(f"image {key}: identity {identity} out of order; with a "
                                     f"header record identities must come 0, 1, ... in turn")
                ranges[-1][1] = key + 1
            write(key, pack_payload(label, bytes(image), key))
            key += 1
        if header:
            first_identity = key
            for start_end in ranges:
                write(key, pack_payload(start_end, b"", key))
                key += 1
            write(0, pack_payload([first_identity, key], b"", 0, id2=1))
    return key - first_key - len(ranges)  # the header record (key 0) did not advance `key`


def read_index(idx_path: str) -> Tuple[np.ndarray, np.ndarray]:
    """(keys, offsets) as int64 arrays, in the .idx file's line order."""
    keys, offsets = [], []
    with open(idx_path) as f:
        for number, line in enumerate(f, start=1):
            fields = line.strip().split("\t")
            if fields == [""]:
                continue
            try:
                key, offset = int(fields[0]), int(fields[1])
            except (ValueError, IndexError):
                raise DatasetError(f"{idx_path}: line {number} is {line.strip()[:40]!r}, not "
                                   f"'key<TAB>offset'") from None
            keys.append(key)
            offsets.append(offset)
    if not keys:
        raise DatasetError(f"{idx_path}: no records")
    return np.array(keys, np.int64), np.array(offsets, np.int64)


class RecordFile:
    """Random access to a RecordIO file by byte offset (os.pread, or slices of a read-only
    memory map: both safe from many threads)."""

    def __init__(self, path: str):
        self.path = path
        self.size = os.path.getsize(path)
        self._fd = os.open(path, os.O_RDONLY)
        self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ) if self.size else b""

    def __del__(self):
        close = getattr(getattr(self, "_map", None), "close", None)  # an empty file's b""
        if close is not None:
            close()
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def read(self, offset: int, count: int) -> bytes:
        return os.pread(self._fd, count, offset)

    def read_many(self, offsets: Sequence[int], counts: Sequence[int]) -> List[bytes]:
        """The `counts[i]` bytes at each `offsets[i]`, sliced from a memory map of the file
        (no system call per record): one Python call reads a whole block of records."""
        view = self._map
        return [view[o:o + n] for o, n in zip(offsets, counts)]

    def payload(self, offset: int, where: str) -> bytes:
        """The payload of the record at `offset`, its parts joined; DatasetError (naming
        `where`) if it is damaged."""
        parts, first, start = [], True, offset
        while True:
            at = "" if offset == start else f" at offset {offset}"  # a later part
            if offset + 8 > self.size:
                raise DatasetError(f"{self.path}: {where}: the record runs past the end of the "
                                   f"file ({self.size} bytes): truncated")
            magic, lrec = struct.unpack("<II", self.read(offset, 8))
            if magic != MAGIC:
                raise DatasetError(f"{self.path}: {where}: bad magic 0x{magic:08x}{at}, not a "
                                   f"RecordIO record")
            cflag, length = lrec >> 29, lrec & LENGTH_MASK
            if (cflag in (WHOLE, FIRST)) != first or cflag > LAST:
                raise DatasetError(f"{self.path}: {where}: part flag {cflag}{at} out of "
                                   f"sequence")
            if offset + 8 + length > self.size:
                raise DatasetError(f"{self.path}: {where}: a record of {length} bytes{at} runs "
                                   f"past the end of the file ({self.size} bytes): truncated")
            parts.append(self.read(offset + 8, length))
            if cflag in (WHOLE, LAST):
                return struct.pack("<I", MAGIC).join(parts)
            offset += 8 + _aligned(length)
            first = False


def unpack_payload(payload: bytes, where: str) -> Tuple[int, np.ndarray, bytes]:
    """(flag, labels as float32 [max(flag, 1)], image bytes) of a record payload."""
    if len(payload) < IR_SIZE:
        raise DatasetError(f"{where}: {len(payload)} payload bytes, too few for its "
                           f"{IR_SIZE}-byte IRHeader: truncated")
    flag, label, _, _ = struct.unpack(IR_FORMAT, payload[:IR_SIZE])
    if flag == 0:
        return 0, np.array([label], np.float32), payload[IR_SIZE:]
    end = IR_SIZE + 4 * flag
    if len(payload) < end:
        raise DatasetError(f"{where}: its IRHeader announces {flag} labels but the payload "
                           f"holds {len(payload)} bytes: truncated")
    return flag, np.frombuffer(payload[IR_SIZE:end], np.float32).copy(), payload[end:]
