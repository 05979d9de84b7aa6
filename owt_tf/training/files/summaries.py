"""TensorBoard: the writer of a run and the tag names other tools rely on (docs/design.md).

Summaries are written from the host loop, outside strategy.run: tf.summary inside a replica
function records replica 0 only. Watch a run with `tensorboard --logdir runs`.
"""
from __future__ import annotations

import json
from typing import Dict, Iterable, Optional, Tuple

import numpy as np
import tensorflow as tf

TRAIN_LOSS = "train/loss"
TRAIN_TOP1 = "train/top1_error"
VAL_LOSS = "val/loss"
VAL_TOP1 = "val/top1_error"
VAL_TOP5 = "val/top5_error"
LR_CONV = "lr/conv"
LR_FC = "lr/fc"
IMAGES_PER_SEC = "perf/images_per_sec"
BYTES_PER_STEP = "comm/bytes_per_step"
SKIPPED_IMAGES = "data/skipped_images"  # training images that could not be decoded, in all
SKIPPED_NONFINITE = "train/skipped_nonfinite"  # steps undone for a non-finite loss or gradient
LOSS_SCALE = "train/loss_scale"  # --precision fp16: the dynamic loss scale
# Face verification of the dataset's pairs (the mean over its pair sets, and each one's under
# <tag>/<set name>; the highest accuracy so far of each set under VAL_HIGHEST/<set name>).
VAL_VERIFICATION = "val/verification_accuracy"
VAL_TAR = "val/tar_at_far_1e-3"
VAL_HIGHEST = "val/verification_accuracy_highest"
CONTRACT_TAGS = (TRAIN_LOSS, TRAIN_TOP1, VAL_LOSS, VAL_TOP1, VAL_TOP5, LR_CONV, LR_FC,
                 IMAGES_PER_SEC, BYTES_PER_STEP)


class RunSummaries:
    """Scalars, the config, sample inputs, histograms and an optional profile of one run."""

    def __init__(self, logdir: Optional[str], profile_steps: Optional[Tuple[int, int]] = None):
        """`logdir` None: write nothing (a multi-worker run's non-chief workers)."""
        self.logdir = logdir
        self.writer = (tf.summary.create_file_writer(logdir) if logdir
                       else tf.summary.create_noop_writer())
        self.profile_steps = profile_steps if logdir else None
        self._profiling = False

    def config(self, config: Dict[str, object]) -> None:
        rows = "\n".join(f"| {k} | {json.dumps(v)} |" for k, v in sorted(config.items()))
        with self.writer.as_default():
            tf.summary.text("config", f"| flag | value |\n|---|---|\n{rows}", step=0)

    def sample_images(self, images: np.ndarray, step: int, count: int = 8) -> None:
        """A few training inputs as the model sees their pixels (before normalization)."""
        with self.writer.as_default():
            tf.summary.image("train/sample_images", images[:count], step=step, max_outputs=count)

    def train(self, step: int, loss: float, top1_error: float, images_per_sec: float,
              bytes_per_step: float, conv_lr: float, fc_lr: float) -> None:
        with self.writer.as_default():
            for tag, value in ((TRAIN_LOSS, loss), (TRAIN_TOP1, top1_error),
                               (IMAGES_PER_SEC, images_per_sec), (BYTES_PER_STEP, bytes_per_step),
                               (LR_CONV, conv_lr), (LR_FC, fc_lr)):
                tf.summary.scalar(tag, value, step=step)

    def counters(self, step: int, skipped_images: int, skipped_nonfinite: int,
                 loss_scale: Optional[float] = None) -> None:
        with self.writer.as_default():
            tf.summary.scalar(SKIPPED_IMAGES, skipped_images, step=step)
            tf.summary.scalar(SKIPPED_NONFINITE, skipped_nonfinite, step=step)
            if loss_scale is not None:
                tf.summary.scalar(LOSS_SCALE, loss_scale, step=step)

    def validation(self, step: int, loss: float, top1_error: float, top5_error: float) -> None:
        with self.writer.as_default():
            tf.summary.scalar(VAL_LOSS, loss, step=step)
            tf.summary.scalar(VAL_TOP1, top1_error, step=step)
            tf.summary.scalar(VAL_TOP5, top5_error, step=step)
        self.writer.flush()

    def verification(self, step: int, results: Dict[str, object],
                     highest: Dict[str, float]) -> None:
        """`results`: VerificationResult by pair set name; `highest`: each set's highest
        accuracy so far."""
        if not results:
            return
        with self.writer.as_default():
            for tag, field in ((VAL_VERIFICATION, "accuracy"), (VAL_TAR, "tar")):
                values = {name: getattr(r, field) for name, r in results.items()}
                tf.summary.scalar(tag, float(np.mean(list(values.values()))), step=step)
                for name, value in values.items():
                    tf.summary.scalar(f"{tag}/{name}", value, step=step)
            for name, value in highest.items():
                tf.summary.scalar(f"{VAL_HIGHEST}/{name}", value, step=step)
        self.writer.flush()

    def histograms(self, step: int, kind: str, named: Iterable[Tuple[str, np.ndarray]]) -> None:
        """`kind` is 'weights' or 'gradients'; one histogram per named array."""
        with self.writer.as_default():
            for name, value in named:
                tf.summary.histogram(f"{kind}/{name}", value, step=step)

    def before_step(self, step: int) -> None:
        if self.profile_steps and step == self.profile_steps[0] and not self._profiling:
            tf.profiler.experimental.start(self.logdir)
            self._profiling = True

    def after_step(self, step: int) -> None:
        if self._profiling and step >= self.profile_steps[1]:
            tf.profiler.experimental.stop()
            self._profiling = False

    def close(self) -> None:
        if self._profiling:
            tf.profiler.experimental.stop()
            self._profiling = False
        self.writer.flush()
        self.writer.close()
