"""Keras callbacks of face recognition: `Verification` measures a pair set (LFW-style) at
the end of every `every` epochs and puts the numbers into the epoch's logs.

The numbers are InsightFace's (owt_tf.data.verification): each image's backbone outputs
plus its mirror's, L2-normalised, squared distances, 10 contiguous folds, thresholds on its
grids. Keys (prefix `name`, default `val_<pairs.name>`, e.g. `val_lfw`):
  `<name>_accuracy`        mean 10-fold verification accuracy
  `<name>_accuracy_std`    its std over the folds
  `<name>_tar_at_far_1e-3` TAR at FAR 1e-3 (the suffix follows `far`)
  `<name>_accuracy_highest` the highest accuracy so far in this fit (arcface_torch's
                           "Accuracy-Highest")

How they reach History and TensorBoard: Keras' CallbackList hands one logs dict to each
callback's `on_epoch_end` in list order, and appends its own History (and progress bar)
last, so Keras' History, the progress bar and any callback listed AFTER this one see the
keys; one listed before it (a TensorBoard, an EarlyStopping on these keys) does not. Place
keras.callbacks.TensorBoard after `Verification`, or give `log_dir=`: the callback then
writes the scalars itself, as Keras' TensorBoard would (`val_` keys under
`<log_dir>/validation` with the prefix dropped, others under `<log_dir>/train`, tags
`epoch_<key>`, step = epoch), so both land on the same charts. Epochs it skips have no keys,
so with every > 1 History's lists are shorter than the epoch count.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from owt_tf.layers import embedding_model
from owt_tf.data.verification import PROTOCOLS, VerificationPairs, VerificationResult, verify

EmbedFn = Callable[[np.ndarray], Any]


def far_suffix(far: float) -> str:
    """`tar_at_far_1e-3` for far=1e-3 (shortest scientific form, no '.', '@' or '=')."""
    return "tar_at_far_" + np.format_float_scientific(far, trim="-", exp_digits=1)


def tensorboard_place(key: str) -> Tuple[str, str]:
    """(run subdirectory, tag) where keras.callbacks.TensorBoard writes an epoch log `key`."""
    if key.startswith("val_"):
        return "validation", f"epoch_{key[len('val_'):]}"
    return "train", f"epoch_{key}"


class Verification(keras.callbacks.Callback):
    """Face verification of `pairs` every `every` epochs, written into the epoch logs.

    How images are embedded (uint8 [B, H, W, C] batches of `batch_size`, after
    `preprocess` when given), each to the backbone's outputs, not normalised:
      1. `embed(images)` when given;
      2. else the model's own `features(images)` method, if it has one (a parallelized
         model: owt_tf.parallelize);
      3. else `owt_tf.layers.embedding_model(model)`: what feeds the model's last
         NormalizedDense, built once per model. It takes what the model's input takes, so
         pass `preprocess` when the model expects e.g. float images in [0, 1].
    `flip` (default, InsightFace's protocol) adds each image's mirror's outputs before
    normalising; `protocol="exact"` scores by the exactly best cosine threshold instead.
    The latest result is kept in `self.result` (a VerificationResult).
    """

    def __init__(self, pairs: VerificationPairs, every: int = 1, batch_size: int = 64,
                 name: Optional[str] = None, flip: bool = True,
                 log_dir: Optional[str] = None, embed: Optional[EmbedFn] = None,
                 preprocess: Optional[EmbedFn] = None, far: float = 1e-3,
                 protocol: str = "insightface") -> None:
        super().__init__()
        if int(every) != every or every < 1:
            raise ValueError(f"every must be a positive integer number of epochs (got {every})")
        if not 0 < far < 1:
            raise ValueError(f"far must be in (0, 1) (got {far}); e.g. far=1e-3")
        self.pairs, self.every, self.batch_size = pairs, int(every), int(batch_size)
        self.name = name if name is not None else f"val_{pairs.name}"
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)} (got {protocol!r})")
        self.flip, self.log_dir, self.far, self.protocol = flip, log_dir, far, protocol
        self.highest = 0.0
        self.embed, self.preprocess = embed, preprocess
        self.result: Optional[VerificationResult] = None
        self._embed_fn: Optional[EmbedFn] = None
        self._writers: Dict[str, Any] = {}

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        self._embed_fn = None

    def log_values(self, result: VerificationResult) -> Dict[str, float]:
        """The epoch-log entries of `result`."""
        return {f"{self.name}_accuracy": result.accuracy,
                f"{self.name}_accuracy_std": result.accuracy_std,
                f"{self.name}_{far_suffix(result.far)}": result.tar,
                f"{self.name}_accuracy_highest": max(self.highest, result.accuracy)}

    def _model_embed_fn(self) -> EmbedFn:
        if self.embed is not None:
            return self.embed
        own = getattr(self.model, "features", None)
        if callable(own):
            return own
        return embedding_model(self.model).predict_on_batch

    def embed_fn(self) -> EmbedFn:
        """The function the pairs go through: uint8 images -> the backbone's outputs."""
        if self._embed_fn is None:
            embed, preprocess = self._model_embed_fn(), self.preprocess
            self._embed_fn = embed if preprocess is None else (lambda x: embed(preprocess(x)))
        return self._embed_fn

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if (epoch + 1) % self.every:
            return
        self.result = verify(self.embed_fn(), self.pairs, batch_size=self.batch_size,
                             flip=self.flip, far=self.far, protocol=self.protocol)
        values = self.log_values(self.result)
        self.highest = max(self.highest, self.result.accuracy)
        if logs is not None:
            logs.update(values)  # the dict every later callback receives
        if self.log_dir is not None:
            self._write_summaries(values, epoch)

    def _writer(self, subdirectory: str):
        if subdirectory not in self._writers:
            self._writers[subdirectory] = tf.summary.create_file_writer(
                os.path.join(self.log_dir, subdirectory))
        return self._writers[subdirectory]

    def _write_summaries(self, values: Dict[str, float], epoch: int) -> None:
        for key, value in values.items():
            subdirectory, tag = tensorboard_place(key)
            with self._writer(subdirectory).as_default():
                tf.summary.scalar(tag, value, step=epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self.highest = 0.0

    def on_train_end(self, logs: Optional[Dict[str, Any]] = None) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
