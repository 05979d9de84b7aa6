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
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import base as trackable  # _serialize_to_tensors API

from owt_tf.parallel.shards import ShardedDense, assemble

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
    """Every FC layer and its momentum as full tensors, whatever the device layout."""

    def __init__(self, model, optim):
        self._layers: List[ShardedDense] = model.head.layers
        self._optim = optim

    def _momenta(self, layer_index: int):
        """Per-shard momentum variables (kernel list, bias list) of one layer."""
        layer = self._layers[layer_index]
        if self._optim.fc_shards is not None:
            slots = self._optim.fc_shards.slots
            return ([slots[k][2 * layer_index] for k in range(layer.num_shards)],
                    [slots[k][2 * layer_index + 1] for k in range(layer.num_shards)])
        keras_opt = self._optim.fc_mirrored.optimizer
        momentum = lambda v: keras_opt.momentums[keras_opt._get_variable_index(v)]  # noqa: E731
        return [momentum(v) for v in layer.kernels], [momentum(v) for v in layer.biases]

    # Names without "/": TF escapes "/" differently when saving and restoring these tensors.
    def _serialize_to_tensors(self) -> Dict[str, tf.Tensor]:
        tensors = {}
        for i, layer in enumerate(self._layers):
            kernel, bias = assemble(layer, [v.numpy() for v in layer.kernels],
                                    [v.numpy() for v in layer.biases])
            mk, mb = self._momenta(i)
            m_kernel, m_bias = assemble(layer, [v.numpy() for v in mk], [v.numpy() for v in mb])
            tensors.update({f"fc{i}_kernel": kernel, f"fc{i}_bias": bias,
                            f"fc{i}_kernel_momentum": m_kernel, f"fc{i}_bias_momentum": m_bias})
        return {k: tf.constant(v) for k, v in tensors.items()}

    def _restore_from_tensors(self, restored_tensors: Dict[str, tf.Tensor]):
        ops = []
        for i, layer in enumerate(self._layers):
            mk, mb = self._momenta(i)
            for name, kernels, biases in (("", layer.kernels, layer.biases),
                                          ("_momentum", mk, mb)):
                kernel = np.asarray(restored_tensors[f"fc{i}_kernel{name}"])
                bias = np.asarray(restored_tensors[f"fc{i}_bias{name}"])
                if kernel.shape != (layer.in_dim, layer.out_dim):
                    raise CheckpointMismatch(
                        f"FC layer {i} was saved as {kernel.shape}, this model has "
                        f"{(layer.in_dim, layer.out_dim)}")
                kernel_parts, bias_parts = layer.split_full(kernel, bias)
                for var, part in zip(kernels + biases, kernel_parts + bias_parts):
                    ops.append(var.assign(part))
        return tf.group(ops)


class RunCheckpoints:
    """The checkpoints of one run directory: save every N steps, resume from the latest."""

    def __init__(self, logdir: str, model, optim, step: tf.Variable, identity: Dict[str, object],
                 counters: Optional[Dict[str, tf.Variable]] = None, max_to_keep: int = 3):
        self.directory = os.path.join(logdir, "checkpoints")
        self.identity = identity
        self.checkpoint = tf.train.Checkpoint(trunk=model.trunk,
                                              trunk_optimizer=optim.trunk.optimizer,
                                              fc=FcState(model, optim), step=step,
                                              **(counters or {}))
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep)

    def check_identity(self, logdir: str) -> None:
        """Refuses a logdir whose checkpoints come from another model or class count."""
        path = os.path.join(logdir, CONFIG_FILE)
        if not os.path.exists(path) or self.manager.latest_checkpoint is None:
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
        latest = self.manager.latest_checkpoint
        if latest:
            self.checkpoint.restore(latest).assert_existing_objects_matched()
        return latest

    def save(self, step: int) -> str:
        """Writes ckpt-<step>. Atomic as far as a resume can tell: TF writes the data under a
        temporary name and renames it, and only then rewrites the `checkpoint` index file
        (itself written to a temporary file and renamed), so a write killed at any point
        leaves the index naming the previous, complete checkpoint."""
        try:
            return self.manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as err:
            previous = self.manager.latest_checkpoint
            kept = f"{previous} is intact" if previous else "there is no earlier checkpoint"
            # TF's half-written temporary files: never named by the index, so only clutter.
            shutil.rmtree(os.path.join(self.directory, f"ckpt-{step}_temp"), ignore_errors=True)
            raise CheckpointWriteError(f"could not write the checkpoint of step {step} in "
                                       f"{self.directory}: {_op_error_text(err)}; {kept}") from None
