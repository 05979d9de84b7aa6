"""Checkpoints: tf.train.Checkpoint + CheckpointManager in <logdir>/checkpoints; resume.

Saved: the trunk (mirrored variables) and its Keras optimizer's slots, every FC layer with
its momentum, and the step. The data position and the dropout seeds follow from the step
(the input order is fixed by --seed; dropout is stateless, seeded by step), so restoring
the step restores them.

FC layers are saved whole, never per shard: per-shard variables would not restore at
another K ("Received incompatible tensor with shape (256, 16) ... (256, 32)"). `FcState`
serializes each FC kernel, bias and their momenta as one full (unpadded) tensor and splits
them again for whatever layout the restoring run has, so a run saved at K=4 resumes at
K=2, or under another scheme.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import base as trackable  # _serialize_to_tensors API

from owt_tf.parallel.shards import ShardReader, read_local_shards

CONFIG_FILE = "run_config.json"


class CheckpointMismatch(ValueError):
    """The logdir's checkpoint belongs to another network or class count."""


def _op_error_text(err: Exception) -> str:
    """The OS's words from a TF op error, without TF's function-node and op decorations."""
    text = (getattr(err, "message", None) or str(err)).splitlines()[0]
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", text)
    return re.sub(r"\s*\[Op:\w+\]", "", text).strip()


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, read-only, gone); the previous one is kept."""


class FcState(trackable.Trackable):
    """Every FC layer and its momentum as full tensors, whatever the device layout.

    In a cluster each process holds only its own shards; `read_shards` then gathers the
    others' (a collective: every worker saves, as TF's multi-worker checkpointing asks).
    Restoring assigns each process's own shards from the full tensors.
    """

    def __init__(self, model, optim, read_shards: ShardReader = read_local_shards):
        self._head = model.head
        self._optim = optim
        self._read = read_shards

    def _momenta(self, k: int) -> List[tf.Variable]:
        """Shard k's momentum variables, in the order of head.shard_variables(k)."""
        return self._optim.fc.slots(k)

    def _shard_state(self, k: int) -> List[tf.Variable]:
        """[W0, b0, W1, b1, ..., then their momenta in the same order] of shard k."""
        return self._head.shard_variables(k) + self._momenta(k)

    # Names without "/": TF escapes "/" differently when saving and restoring these tensors.
    def full_tensors(self) -> Dict[str, np.ndarray]:
        values = self._read({k: self._shard_state(k) for k in self._head.local_shards})
        tensors = {}
        for name, layers in zip(("", "_momentum"), self._head.join_groups(values, 2)):
            for i, (kernel, bias) in enumerate(layers):
                tensors[f"fc{i}_kernel{name}"], tensors[f"fc{i}_bias{name}"] = kernel, bias
        return tensors

    def _serialize_to_tensors(self) -> Dict[str, tf.Tensor]:
        return {k: tf.constant(v) for k, v in self.full_tensors().items()}

    def _restore_from_tensors(self, restored_tensors: Dict[str, tf.Tensor]):
        ops = []
        for i, layer in enumerate(self._head.layers):
            for group, name in enumerate(("", "_momentum")):
                kernel = np.asarray(restored_tensors[f"fc{i}_kernel{name}"])
                bias = np.asarray(restored_tensors[f"fc{i}_bias{name}"])
                if kernel.shape != (layer.in_dim, layer.out_dim):
                    raise CheckpointMismatch(
                        f"FC layer {i} was saved as {kernel.shape}, this model has "
                        f"{(layer.in_dim, layer.out_dim)}")
                ops += self._head.assign_whole(self._shard_state, group, i, kernel, bias)
        return tf.group(ops)


class RunCheckpoints:
    """The checkpoints of one run directory: save every N steps, resume from the latest.

    In a cluster every worker saves (gathering the FC shards is a collective), as TF's
    multi-worker guidance asks, but only the chief into <logdir>/checkpoints: the others
    write to a temporary directory that is emptied after each save and removed by
    `close`. Every worker restores from the chief's directory.
    """

    def __init__(self, logdir: str, model, optim, step: tf.Variable, identity: Dict[str, object],
                 counters: Optional[Dict[str, tf.Variable]] = None, max_to_keep: int = 3,
                 read_shards: ShardReader = read_local_shards, is_chief: bool = True):
        self.directory = os.path.join(logdir, "checkpoints")
        self.identity = identity
        self.is_chief = is_chief
        self.checkpoint = tf.train.Checkpoint(trunk=model.trunk,
                                              trunk_optimizer=optim.trunk.optimizer,
                                              fc=FcState(model, optim, read_shards), step=step,
                                              **(counters or {}))
        write_to = self.directory if is_chief else tempfile.mkdtemp(prefix="owt_tf_worker_ckpt_")
        self.manager = tf.train.CheckpointManager(self.checkpoint, write_to, max_to_keep)

    @property
    def latest(self) -> Optional[str]:
        """The newest complete checkpoint of the run (the chief's)."""
        return tf.train.latest_checkpoint(self.directory)

    def close(self) -> None:
        """Removes a non-chief worker's temporary checkpoint directory."""
        if not self.is_chief:
            shutil.rmtree(self.manager.directory, ignore_errors=True)

    def check_identity(self, logdir: str) -> None:
        """Refuses a logdir whose checkpoints come from another model or class count."""
        path = os.path.join(logdir, CONFIG_FILE)
        if not os.path.exists(path) or self.latest is None:
            return
        with open(path) as f:
            saved = json.load(f)
        for key, value in self.identity.items():
            if saved.get(key) != value:
                raise CheckpointMismatch(f"--logdir {logdir} holds a run with {key}="
                                         f"{saved.get(key)!r}, this run has {key}={value!r}; "
                                         "use another --logdir")

    def write_identity(self, logdir: str, config: Dict[str, object]) -> None:
        os.makedirs(logdir, exist_ok=True)
        tmp = os.path.join(logdir, CONFIG_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump({**config, **self.identity}, f, indent=1, sort_keys=True)
        os.replace(tmp, os.path.join(logdir, CONFIG_FILE))

    def restore_latest(self) -> Optional[str]:
        latest = self.latest
        if latest:
            self.checkpoint.restore(latest).assert_existing_objects_matched()
        return latest

    def save(self, step: int) -> str:
        """Writes ckpt-<step>. Atomic as far as a resume can tell: TF writes the data under a
        temporary name and renames it, and only then rewrites the `checkpoint` index file
        (itself written to a temporary file and renamed), so a write killed at any point
        leaves the index naming the previous, complete checkpoint."""
        os.makedirs(self.manager.directory, exist_ok=True)  # a non-chief's may be removed
        try:
            path = self.manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as err:
            previous = self.latest
            kept = f"{previous} is intact" if previous else "there is no earlier checkpoint"
            # TF's half-written temporary files: never named by the index, so only clutter.
            shutil.rmtree(os.path.join(self.manager.directory, f"ckpt-{step}_temp"),
                          ignore_errors=True)
            raise CheckpointWriteError(f"could not write the checkpoint of step {step} in "
                                       f"{self.manager.directory}: {_op_error_text(err)}; "
                                       f"{kept}") from None
        if self.is_chief:
            return path
        for name in os.listdir(self.manager.directory):  # a non-chief's copy: not kept
            target = os.path.join(self.manager.directory, name)
            shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
        return os.path.join(self.directory, os.path.basename(path))
