"""Prepared sets (`prepared:DIR`): the paper's preprocessing done once, by
`python -m owt_tf.prepare` (every image's shorter side rescaled to 256 and its central
256x256 kept, as JPEG in TFRecord shards, with a manifest), then read for training.

    reader   the manifest's format and checks, and PreparedDataset (a StreamDataset)
    sources  what a prepare reads: folder:PATH, tfds:NAME, insightface:PATH
    writer   the rescaling, the shards and their done marks, resuming, the manifest
             (`prepare`; imported by the entry point, not here)
"""
from owt_tf.data.prepared.reader import PreparedDataset, read_manifest, ten_crop_views

__all__ = ["PreparedDataset", "read_manifest", "ten_crop_views"]
