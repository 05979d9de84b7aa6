"""This process's input to the CLI's steps: its replicas' rows of each global batch (a
streamed dataset decodes only those), and what a batch says about the stream: how far it
read, and which rows' images did not decode."""
from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from owt_tf.data.datasets import DatasetError, StreamDataset
from owt_tf.parallel.placement import Placement


def own_input(placement: Placement, dataset, rows: int, stream_rows: Callable,
              whole_batches: Callable) -> tf.data.Dataset:
    """Per-replica batches of this process's rows: a streamed dataset reads and decodes
    only those rows (`stream_rows(own_rows)`); one in memory is sliced from its global
    batches (`whole_batches()`)."""
    if isinstance(dataset, StreamDataset):
        return placement.distribute_own_rows(stream_rows(placement.own_rows(rows)), rows)
    return placement.distribute_batches(whole_batches(), rows)


def failed_decodes(placement: Placement, failed, global_batch: int, step: int) -> np.ndarray:
    """Per row of this process, how many records failed to decode before its image. Stops
    before the step when a row has no image (no record of the global batch decodes): every
    worker's rows see the same batch, so every worker stops here, before any collective."""
    failed = np.concatenate([np.asarray(f) for f in
                             placement.strategy.experimental_local_results(failed)])
    if (failed >= global_batch).any():
        raise DatasetError(f"step {step}: none of the {global_batch} training images "
                           f"of the global batch could be decoded")
    return failed


def stream_end(placement: Placement, positions) -> int:
    """The stream position after this process's rows of the batch."""
    local = placement.strategy.experimental_local_results(positions)
    return max(int(np.max(p)) for p in local) + 1
