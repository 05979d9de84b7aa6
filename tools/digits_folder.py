"""Writes scikit-learn's bundled handwritten digits as a `folder:` dataset of real PNGs.

    python tools/digits_folder.py OUT        # OUT/train/<0..9>/*.png, OUT/validation/<0..9>/*.png

Each image is written at its true size (8x8, grayscale, 0..16 scaled to 0..255) with the
same fixed 80/20 train/validation split as `--dataset digits`, so the two can be compared.
No download: the digits ship with scikit-learn.
"""
from __future__ import annotations

import argparse
import os
import zlib
import struct

import numpy as np

SPLIT_SEED = 20140421  # owt_tf.data.datasets' split of `digits`


def png_bytes(image: np.ndarray) -> bytes:
    """An 8-bit grayscale PNG of `image` (uint8 [H, W]), written with zlib alone."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    h, w = image.shape
    rows = b"".join(b"\x00" + image[r].tobytes() for r in range(h))
    header = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


def write_digits_folder(out: str) -> dict:
    """Writes the tree under `out`; returns the image count per split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.clip(np.rint(digits.images / 16.0 * 255.0), 0, 255).astype(np.uint8)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(images))
    n_val = len(images) // 5
    counts = {}
    for split, picks in (("validation", order[:n_val]), ("train", order[n_val:])):
        for i in picks:
            folder = os.path.join(out, split, str(digits.target[i]))
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{i:04d}.png"), "wb") as f:
                f.write(png_bytes(images[i]))
        counts[split] = len(picks)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the folder to write (train/ and validation/ inside)")
    counts = write_digits_folder(parser.parse_args().out)
    print(", ".join(f"{n} {split}" for split, n in counts.items()))


if __name__ == "__main__":
    main()
