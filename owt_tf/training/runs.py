"""A run directory read back: a one-device Trainer restored from its latest checkpoint (what
`python -m owt_tf.evaluate --logdir` scores and `python -m owt_tf.export` writes out).

Whatever the run was (K devices, several workers, any scheme), it is restored on one
device of this process, read-only: no lock taken, damaged checkpoints left in place.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional, Tuple

from owt_tf.config import ClusterConfig, RunConfig
from owt_tf.training.files.checkpoint import CONFIG_FILE
from owt_tf.training.loop import Trainer
from owt_tf.training.files.serving import ExportError, export_trainer


def load_run(logdir: str) -> Trainer:
    """A Trainer on one device restored from the latest checkpoint in `logdir`."""
    if not os.path.isdir(logdir):
        raise ExportError(f"--logdir {logdir}: no such directory")
    path = os.path.join(logdir, CONFIG_FILE)
    if not os.path.exists(path):
        raise ExportError(f"--logdir {logdir} has no {CONFIG_FILE}: not an owt_tf run")
    with open(path) as f:
        saved = json.load(f)
    # This version's layout, or the flat one of runs written before it.
    recorded = RunConfig.from_dict(saved)
    # One device in this process, whatever the run was (several workers included: the
    # cluster is not resolved, so none is joined); the run's own export target is not this
    # export's. No class sampling: it is a training device, and needs the sharded loss.
    # A margin objective's loss is computed "on the shards" (here one: the same loss).
    margin = recorded.model.margin_value is not None
    config = recorded.replace(scheme="single", devices=1, fc_batch="global",
                              fc_exchange="gather", loss="sharded" if margin else "gathered",
                              sample_rate=1.0,
                              logdir=logdir,
                              batch_size=min(64, recorded.parallel.batch_size),
                              export_dir=None, embeddings_only=False)
    config = dataclasses.replace(config, cluster=ClusterConfig())
    trainer = Trainer(config, read_only=True)  # reads only: no lock, damaged ones left in place
    if trainer.resumed_from is None:
        raise ExportError(f"--logdir {logdir} has no checkpoint")
    return trainer


def export_run(logdir: str, base: str, version: Optional[int] = None,
               overwrite: bool = False, embeddings_only: bool = False) -> Tuple[str, str]:
    """The latest checkpoint of the run in `logdir` as the SavedModel `base/<version>/`
    (`embeddings_only`: the embedding alone). Returns (the checkpoint exported, the
    SavedModel's path)."""
    trainer = load_run(logdir)
    path = export_trainer(trainer, base, overwrite, version, embeddings_only)
    return trainer.resumed_from, path
