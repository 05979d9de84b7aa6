"""Files on the Keras path in a cluster: the chief writes the paths the user gave, every
other worker into a scratch directory of its own, removed after. Both a parallelized model's
own `save` / `save_weights` (the same script runs on every worker) and fit's file-writing
callbacks go through here.

Keras 3's callbacks write from every worker to the same path as if each were alone. On a
shared filesystem two workers creating a missing directory race (`exists`, then
`os.makedirs`: FileExistsError in `BackupAndRestore` and `ModelCheckpoint`), one copies a
file the other is writing (`double_checkpoint`), and TensorBoard gets every event once per
worker. Keras 2 sent a non-chief worker's writes to temporary paths; this is that rule for
Keras 3. Every worker still runs every callback, since saving the weights or writing the
head's histograms reads the shards, a collective.
"""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from typing import Iterator, List, Optional, Sequence

import keras


@contextlib.contextmanager
def _scratch_directory() -> Iterator[str]:
    scratch = tempfile.mkdtemp(prefix="owt_tf_worker_")
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def chief_path(filepath: str, is_chief: bool) -> Iterator[str]:
    """`filepath` on the chief; elsewhere a path in a scratch directory, removed after. Every
    worker must still write: reading the shards is a collective."""
    if is_chief:
        yield filepath
        return
    with _scratch_directory() as scratch:
        yield os.path.join(scratch, os.path.basename(str(filepath)))


def _under(scratch: str, path: str) -> str:
    """`path`'s place inside `scratch` (format placeholders such as `{epoch}` kept)."""
    return os.path.join(scratch, os.path.splitdrive(str(path))[1].lstrip("/\\"))


def _worker_backup(callback: keras.callbacks.BackupAndRestore,
                   scratch: str) -> keras.callbacks.BackupAndRestore:
    """A BackupAndRestore of this worker's own, seeded with the shared backup so that it
    restores what the chief's restores (every worker must start from the same state)."""
    backup_dir = os.path.join(scratch, "backup")
    if os.path.isdir(callback.backup_dir):
        shutil.copytree(callback.backup_dir, backup_dir)
    return keras.callbacks.BackupAndRestore(
        backup_dir, save_freq=callback.save_freq,
        double_checkpoint=callback.double_checkpoint,
        delete_checkpoint=callback.delete_checkpoint)


def _worker_copy(callback: keras.callbacks.Callback, scratch: str) -> keras.callbacks.Callback:
    if isinstance(callback, keras.callbacks.BackupAndRestore):
        return _worker_backup(callback, scratch)
    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        own = copy.copy(callback)
        own.filepath = _under(scratch, callback.filepath)
        return own
    if isinstance(callback, keras.callbacks.TensorBoard):
        own = copy.copy(callback)
        own.log_dir = _under(scratch, callback.log_dir)
        return own
    return callback


@contextlib.contextmanager
def chief_writes_files(callbacks: Optional[Sequence[keras.callbacks.Callback]],
                       is_chief: bool) -> Iterator[Optional[List[keras.callbacks.Callback]]]:
    """`callbacks` for this worker's fit: unchanged on the chief (or alone); elsewhere the
    file-writing ones (BackupAndRestore, ModelCheckpoint, TensorBoard) write under a scratch
    directory instead. On a worker, a ModelCheckpoint's `best` and the like are tracked by
    its copy, not by the object passed in."""
    if is_chief or not callbacks or not isinstance(callbacks, (list, tuple)):
        yield callbacks
        return
    with _scratch_directory() as scratch:
        yield [_worker_copy(callback, scratch) for callback in callbacks]
