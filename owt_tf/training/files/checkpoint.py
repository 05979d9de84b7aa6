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

Damaged checkpoints: every checkpoint is read back (the index, and each tensor through
tf.train.load_checkpoint's reader, which checks the tensor's CRC32C) before the `checkpoint`
index names it and older ones are rotated out, so a write that stored garbage never costs
the last good one. On resume the newest checkpoint that reads back and restores completely
is used; newer damaged ones (truncated, bit-flipped, a missing shard, an unreadable index)
are named in one line and moved aside into `ckpt-N.damaged/`, never deleted, and the index
is rewritten without them. Readers (`read_only`: evaluate, export, non-chief workers) skip
them and move nothing.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys
import tempfile
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint_management
from tensorflow.python.trackable import base as trackable  # _serialize_to_tensors API

from owt_tf.parallel.head import state as head_state
from owt_tf.parallel.head.state import HeadStateMismatch
from owt_tf.parallel.head.layout import ShardReader, read_local_shards

CONFIG_FILE = "run_config.json"
# run_config.json: the config's sections, and under this key what the checkpoints must match
# (model, dataset, class count).
IDENTITY_KEY = "identity"


class CheckpointMismatch(HeadStateMismatch):
    """The logdir's checkpoint belongs to another network or class count."""


def _op_error_text(err: Exception) -> str:
    """The OS's words from a TF op error, without TF's function-node and op decorations."""
    text = (getattr(err, "message", None) or str(err)).splitlines()[0]
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", text)
    return re.sub(r"\s*\[Op:\w+\]", "", text).strip()


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, read-only, gone); the previous one is kept."""


class CheckpointDamaged(ValueError):
    """A checkpoint does not read back: its index or a tensor is unreadable or fails its checksum."""


class NoReadableCheckpoint(ValueError):
    """The run has checkpoints, but none of them reads back and restores."""


# What TF's checkpoint reader raises on a damaged file: DataLossError for a checksum
# mismatch, NotFoundError for a missing shard, and IndexError "Read less bytes than
# requested" from the Python wrapper for a truncated data file.
_READ_ERRORS = (tf.errors.OpError, IndexError, ValueError, OSError)


def _reason(err: BaseException) -> str:
    text = _op_error_text(err) if isinstance(err, tf.errors.OpError) else str(err)
    return (text.splitlines() or [type(err).__name__])[0][:400]


def verify_checkpoint(path: str) -> None:
    """Reads the checkpoint at `path` back: its index and every tensor, each checked against
    the CRC32C stored with it. Raises CheckpointDamaged naming the first failure."""
    try:
        reader = tf.train.load_checkpoint(path)
        for name in sorted(reader.get_variable_to_shape_map()):
            reader.get_tensor(name)
    except _READ_ERRORS as err:
        raise CheckpointDamaged(f"{path} cannot be read back ({_reason(err)})") from None


def move_aside(path: str) -> str:
    """Moves the files of checkpoint `path` (ckpt-N.index, ckpt-N.data-*) into a new
    directory ckpt-N.damaged/ beside them (never deletes them); returns that directory."""
    target = path + ".damaged"
    n = 1
    while os.path.exists(target):
        n += 1
        target = f"{path}.damaged.{n}"
    os.makedirs(target)
    for name in glob.glob(glob.escape(path) + ".index") + glob.glob(glob.escape(path) + ".data-*"):
        os.replace(name, os.path.join(target, os.path.basename(name)))
    return target


def _step_of(path: str) -> int:
    return int(path.rsplit("-", 1)[1])


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr)


class FcState(trackable.Trackable):
    """Every FC layer and its momentum as whole tensors, whatever the device layout, under
    the key scheme both front doors share (owt_tf.parallel.head.state).

    In a cluster each process holds only its own shards; `read_shards` then gathers the
    others' (a collective: every worker saves, as TF's multi-worker checkpointing asks).
    Restoring assigns each process's own shards from the whole tensors. `legacy`: the
    checkpoint being restored names the momentum as before the shared scheme.
    """

    def __init__(self, model, optim, read_shards: ShardReader = read_local_shards):
        self._head = model.head
        self._optim = optim
        self._read = read_shards
        self.legacy = False

    def full_tensors(self) -> Dict[str, np.ndarray]:
        return head_state.head_arrays(self._head, self._optim.fc, self._read)

    def _serialize_to_tensors(self) -> Dict[str, tf.Tensor]:
        tensors = {k: tf.constant(v) for k, v in self.full_tensors().items()}
        if self.legacy:  # the names TF looks up in an old checkpoint (slot 0 was "momentum")
            tensors = {_legacy_name(k): v for k, v in tensors.items() if k != head_state.KIND_KEY}
        return tensors

    def _restore_from_tensors(self, restored_tensors: Dict[str, tf.Tensor]):
        arrays = {k: np.asarray(v) for k, v in restored_tensors.items()}
        ops = head_state.restore_weights(self._head, arrays)
        if not head_state.slots_fit(arrays, self._optim.fc):
            raise HeadStateMismatch(f"the checkpoint's FC optimizer state "
                                    f"({head_state.saved_kind(arrays)}) is not this run's SGD")
        ops += head_state.restore_slots(self._head, arrays, self._optim.fc)
        return tf.group(ops)


def _legacy_name(key: str) -> str:
    """fc{i}_kernel_slot0 -> fc{i}_kernel_momentum (checkpoints before the shared scheme)."""
    return key.replace("_slot0", head_state.LEGACY_SGD_SLOT)


class RunCheckpoints:
    """The checkpoints of one run directory: save every N steps, resume from the latest.

    In a cluster every worker saves (gathering the FC shards is a collective), as TF's
    multi-worker guidance asks, but only the chief into <logdir>/checkpoints: the others
    write to a temporary directory that is emptied after each save and removed by
    `close`. Every worker restores from the chief's directory.
    """

    def __init__(self, logdir: str, model, optim, step: tf.Variable, identity: Dict[str, object],
                 counters: Optional[Dict[str, tf.Variable]] = None, max_to_keep: int = 3,
                 read_shards: ShardReader = read_local_shards, is_chief: bool = True,
                 read_only: bool = False,
                 optional_counters: Optional[Dict[str, tf.Variable]] = None):
        self.directory = os.path.join(logdir, "checkpoints")
        self.identity = identity
        self.is_chief = is_chief
        self.max_to_keep = max_to_keep
        # Only the run's writer moves damaged checkpoints aside; readers leave files alone.
        self.moves_damaged = is_chief and not read_only
        self.fc_state = FcState(model, optim, read_shards)
        required = dict(trunk=model.trunk, trunk_optimizer=optim.trunk.optimizer,
                        fc=self.fc_state, step=step, **(counters or {}))
        # Saved, but a checkpoint without them restores too (keeping their initial values):
        # state only some runs have, e.g. fp16's loss scale in a run resumed from fp32.
        self.optional = dict(optional_counters or {})
        self.checkpoint = tf.train.Checkpoint(**required, **self.optional)
        self._required_only = tf.train.Checkpoint(**required)
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
        if not os.path.exists(path) or not self._listed()[0]:
            return
        with open(path) as f:
            saved = json.load(f)
        saved = saved.get(IDENTITY_KEY, saved)  # at the top level in runs of earlier versions
        for key, value in self.identity.items():
            if saved.get(key) != value:
                raise CheckpointMismatch(f"--logdir {logdir} holds a run with {key}="
                                         f"{saved.get(key)!r}, this run has {key}={value!r}; "
                                         "use another --logdir")

    def write_identity(self, logdir: str, config: Dict[str, object]) -> None:
        os.makedirs(logdir, exist_ok=True)
        tmp = os.path.join(logdir, CONFIG_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump({**config, IDENTITY_KEY: self.identity}, f, indent=1, sort_keys=True)
        os.replace(tmp, os.path.join(logdir, CONFIG_FILE))

    def _listed(self) -> Tuple[List[str], bool]:
        """The run's checkpoints, newest first, and whether the `checkpoint` index named them
        (False: the index is missing or unreadable, and these are the files on disk)."""
        state = tf.train.get_checkpoint_state(self.directory)
        if state is None:  # also when TF cannot parse the index: it logs and returns None
            return self._on_disk(), False
        paths = list(state.all_model_checkpoint_paths)
        if state.model_checkpoint_path and state.model_checkpoint_path not in paths:
            paths.append(state.model_checkpoint_path)
        # get_checkpoint_state joins relative names to the directory as given; rejoin alike.
        paths = [os.path.join(self.directory, os.path.basename(p)) for p in paths]
        return sorted(set(paths), key=_step_of, reverse=True), True

    def _on_disk(self) -> List[str]:
        """Every ckpt-N with an .index file in the checkpoint directory, newest first."""
        indexes = glob.glob(os.path.join(glob.escape(self.directory), "ckpt-*.index"))
        paths = [p[:-len(".index")] for p in indexes
                 if re.fullmatch(r"ckpt-\d+\.index", os.path.basename(p))]
        return sorted(paths, key=_step_of, reverse=True)

    def _restore(self, path: str) -> None:
        """Restores `path` after reading it back whole; CheckpointDamaged if it cannot be."""
        verify_checkpoint(path)
        listed = [name for name, _ in tf.train.list_variables(path)]
        saved = {name.split("/")[0] for name in listed}
        self.fc_state.legacy = any(name.endswith(head_state.LEGACY_SGD_SLOT) for name in listed)
        checkpoint = (self.checkpoint if all(name in saved for name in self.optional)
                      else self._required_only)
        try:
            checkpoint.restore(path).assert_existing_objects_matched().expect_partial()
        except _READ_ERRORS as err:
            if isinstance(err, HeadStateMismatch):
                raise
            raise CheckpointDamaged(f"{path} does not restore ({_reason(err)})") from None
        finally:
            self.fc_state.legacy = False  # saves always use the current names

    def restore_latest(self, warn: Callable[[str], None] = _warn) -> Optional[str]:
        """Restores the newest checkpoint that reads back and restores completely, and returns
        its path (None: the run has no checkpoint). Newer damaged ones are named in one line
        each and, by the run's writer, moved aside and dropped from the index. With none
        readable: NoReadableCheckpoint, and nothing is changed."""
        candidates, indexed = self._listed()
        damaged: List[Tuple[str, str]] = []
        for path in candidates:
            try:
                self._restore(path)
            except CheckpointDamaged as err:
                damaged.append((path, str(err)))
                continue
            for bad, why in damaged:
                if self.moves_damaged:
                    why += f"; moved to {move_aside(bad)}"
                warn(f"checkpoint {why}; using {path}")
            if not indexed:
                self._recover_index(path, candidates, warn)
            elif damaged and self.moves_damaged:
                self._forget(bad for bad, _ in damaged)
            return path
        if damaged:
            raise NoReadableCheckpoint(
                f"no checkpoint in {self.directory} can be read: "
                + "; ".join(why for _, why in damaged)
                + "; nothing was changed: move them away to start over, or use another --logdir")
        return None

    def _recover_index(self, latest: str, candidates: List[str], warn) -> None:
        """The `checkpoint` index was missing or unreadable while checkpoints exist (TF would
        start over and overwrite them): the writer moves the unreadable file aside and writes
        a new index naming the checkpoints up to `latest`."""
        index = os.path.join(self.directory, "checkpoint")
        how = "unreadable" if os.path.exists(index) else "missing"
        if not self.moves_damaged:
            warn(f"the checkpoint index {index} is {how}; using {latest}")
            return
        moved = ""
        if os.path.exists(index):
            os.replace(index, index + ".damaged")
            moved = f"moved to {index}.damaged, "
        kept = [os.path.basename(p) for p in reversed(candidates)
                if _step_of(p) <= _step_of(latest) and os.path.exists(p + ".index")]
        self._write_index(kept[-self.max_to_keep:])
        warn(f"the checkpoint index {index} is {how}: {moved}rewritten from the files on disk; "
             f"using {latest}")

    def _forget(self, paths) -> None:
        """Rewrites the `checkpoint` index without `paths` (moved aside)."""
        gone = {os.path.basename(p) for p in paths}
        state = tf.train.get_checkpoint_state(self.directory)
        names = [os.path.basename(p) for p in state.all_model_checkpoint_paths]
        stamps = list(state.all_model_checkpoint_timestamps)
        kept = [i for i, name in enumerate(names) if name not in gone]
        self._write_index([names[i] for i in kept],
                          [stamps[i] for i in kept] if len(stamps) == len(names) else None,
                          state.last_preserved_timestamp)

    def _write_index(self, names: List[str], stamps: Optional[List[float]] = None,
                     last_preserved: Optional[float] = None) -> None:
        """Writes the `checkpoint` index naming `names` (oldest first; the last is the latest),
        and rebuilds the manager from it, so that rotation never counts a checkpoint that was
        moved aside."""
        if stamps is None:  # the manager keeps only checkpoints that have a timestamp
            stamps = [os.path.getmtime(os.path.join(self.directory, name + ".index"))
                      for name in names]
        # What CheckpointManager itself writes the index with (the public
        # tf.compat.v1.train.update_checkpoint_state prints a deprecation warning).
        checkpoint_management.update_checkpoint_state_internal(
            self.directory, names[-1], names, save_relative_paths=True,
            all_model_checkpoint_timestamps=stamps, last_preserved_timestamp=last_preserved)
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.directory,
                                                  self.max_to_keep)

    def _verify_written(self, path: str) -> None:
        """A write callback: runs after the files are written and before the manager names
        them in the index and rotates old checkpoints out (CheckpointOptions runs the
        caller's callbacks before the manager's own)."""
        verify_checkpoint(path)

    def save(self, step: int) -> str:
        """Writes ckpt-<step>. Atomic as far as a resume can tell: TF writes the data under a
        temporary name and renames it, and only then rewrites the `checkpoint` index file
        (itself written to a temporary file and renamed), so a write killed at any point
        leaves the index naming the previous, complete checkpoint."""
        os.makedirs(self.manager.directory, exist_ok=True)  # a non-chief's may be removed
        # The chief's checkpoints are read back before they count; a non-chief's copy is
        # thrown away at once.
        options = (tf.train.CheckpointOptions(experimental_write_callbacks=[self._verify_written])
                   if self.is_chief else None)
        try:
            path = self.manager.save(checkpoint_number=step, options=options)
        except CheckpointDamaged as err:
            previous = self.latest
            kept = f"{previous} is intact" if previous else "there is no earlier checkpoint"
            moved = move_aside(os.path.join(self.manager.directory, f"ckpt-{step}"))
            raise CheckpointWriteError(f"the checkpoint of step {step} was written but {err}: "
                                       f"moved to {moved}; {kept}") from None
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
