"""The one configuration object of a run: every CLI flag is a field of `RunConfig`.

`validate()` checks every field against the others before anything is built, so that a
bad combination fails in one line naming the flag, never halfway through training.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import Optional

from owt_tf.parallel.plan import (AUTO, FC_BATCH_MODES, FC_EXCHANGES, LOSS_MODES, PRECISIONS,
                                  SCHEMES, ParallelPlan, PlanError)

LR_SCALINGS = ("linear", "sqrt", "none")
LR_SCHEDULES = ("constant", "step", "cosine")
# --augment: AlexNet's crop + flip + PCA lighting; the random crop alone (no mirror images:
# digits and text are not symmetric); none (training sees the eval view); auto picks per
# dataset (owt_tf.data.datasets.default_augmentation).
AUGMENTATIONS = ("auto", "alexnet", "crop", "none")
# --device-type: where replicas go (owt_tf.devices.device_layout).
DEVICE_TYPES = ("auto", "gpu", "cpu")


_PLAN_FLAGS = {"scheme": "--scheme", "fc_batch": "--fc-batch", "fc_exchange": "--fc-exchange",
               "loss": "--loss", "jit": "--jit", "precision": "--precision",
               "devices": "--devices",
               "batch_size": "--batch-size"}


@contextlib.contextmanager
def _as_flag_error():
    """A PlanError as the ConfigError of the flag it is about."""
    try:
        yield
    except PlanError as err:
        raise ConfigError(_PLAN_FLAGS.get(err.field, "--" + err.field),
                          str(err).split(": ", 1)[1]) from None


class ConfigError(ValueError):
    """A bad flag or flag combination. `flag` names the CLI flag at fault."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclasses.dataclass
class RunConfig:
    """Everything that defines a run. Defaults are the no-flag demo run."""

    model: str = "alexnet_tiny"
    dataset: str = "digits"
    data_dir: Optional[str] = None
    manual_dir: Optional[str] = None
    download: bool = False
    # Training augmentation of a streamed dataset: auto picks from its images (alexnet for
    # ImageNet-sized ones, none for small ones); digits and synthetic are never augmented.
    augment: str = "auto"
    devices: int = 2
    scheme: str = "owt-b"
    batch_size: int = 32  # per worker, as in the paper (128 per GPU there)
    fc_batch: str = "global"
    fc_exchange: str = "gather"
    loss: str = "gathered"
    precision: str = "fp32"  # fp32 | bf16 | fp16 compute, float32 weights (parallel.precision)
    steps: int = 600
    epochs: Optional[float] = None  # when set, overrides steps
    # The rate for a batch of lr_batch examples. Each layer kind's rate follows the batch it
    # averages its gradient over (conv: the global batch; FC: fc_batch_size), by lr_scaling:
    # the same global batch gives the same rates at any K, so a run resumes at another K.
    lr: float = 0.04
    lr_batch: int = 128  # the paper's batch
    lr_scaling: str = "linear"
    lr_schedule: str = "constant"
    lr_decay_epochs: str = "30,60,80"  # 'step' schedule: rates / 10 at these epochs
    warmup_epochs: float = 0.0
    momentum: float = 0.9
    weight_decay: float = 5e-4
    dropout: float = 0.5
    seed: int = 0
    eval_every: int = 150
    jit: bool = False
    logdir: Optional[str] = None  # default: runs/<timestamp>
    checkpoint_every: int = 200
    export_dir: Optional[str] = None
    log_every: int = 10
    histogram_every: int = 200
    profile_steps: Optional[str] = None  # "A:B": profiler trace of steps A..B
    device_type: str = "auto"  # auto | gpu | cpu (owt_tf.devices.device_layout)
    deterministic: bool = False  # op determinism: a resumed run is bit-identical
    skip_nonfinite: int = 0  # steps with a non-finite loss or gradient to undo before stopping
    cluster: Optional[str] = None  # host:port,... of every worker (else TF_CONFIG, else local)
    task_index: Optional[int] = None  # this worker's place in --cluster
    verbose: bool = False  # show TensorFlow's C++ start-up log lines

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def resolved_cluster(self):
        """The multi-worker cluster of this run (--cluster, else TF_CONFIG), or None."""
        from owt_tf.cluster import ClusterError, resolve_cluster

        try:
            return resolve_cluster(self.cluster, self.task_index)
        except ClusterError as err:
            flag, _, message = str(err).partition(": ")
            raise ConfigError(flag, message) from None

    @property
    def num_workers(self) -> int:
        cluster = self.resolved_cluster()
        return cluster.num_workers if cluster else 1

    @property
    def num_replicas(self) -> int:
        """K: --devices on each of the workers."""
        return self.devices * self.num_workers

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.num_replicas

    @property
    def fc_batch_size(self) -> int:
        """Examples behind one FC update: B in 'worker' mode, B*K in 'global' mode."""
        return self.batch_size if self.fc_batch == "worker" else self.global_batch_size

    @property
    def conv_lr(self) -> float:
        """The trunk's rate: --lr scaled from --lr-batch to the global batch."""
        return self.lr * lr_scale(self.lr_scaling, self.global_batch_size / self.lr_batch)

    @property
    def fc_lr(self) -> float:
        """The FC layers' rate: --lr scaled from --lr-batch to the FC layers' own batch."""
        return self.lr * lr_scale(self.lr_scaling, self.fc_batch_size / self.lr_batch)

    def parallel_plan(self) -> ParallelPlan:
        """The run's ParallelPlan (its rules are checked here and by the strategy); under
        --scheme auto, until the Trainer chooses, owt-b's (it checks the flags auto keeps)."""
        with _as_flag_error():
            return ParallelPlan("owt-b" if self.scheme == AUTO else self.scheme, self.fc_batch,
                                self.fc_exchange, self.loss, self.jit, self.precision)

    def validate(self) -> "RunConfig":
        """Raises ConfigError for the first invalid field; returns self when all is well."""
        self.parallel_plan()
        _choice("--lr-scaling", self.lr_scaling, LR_SCALINGS)
        _choice("--lr-schedule", self.lr_schedule, LR_SCHEDULES)
        self.decay_epochs()
        if self.epochs is not None and not (math.isfinite(self.epochs) and self.epochs > 0):
            raise ConfigError("--epochs", f"must be a number > 0, got {self.epochs}")
        if not (math.isfinite(self.warmup_epochs) and self.warmup_epochs >= 0):
            raise ConfigError("--warmup-epochs", f"must be >= 0, got {self.warmup_epochs}")
        from owt_tf.data import DATASET_NAMES
        from owt_tf.models.registry import MODEL_NAMES

        from owt_tf.models.user import UserModelError, check_user_model_name, is_user_model

        if is_user_model(self.model):
            try:
                check_user_model_name(self.model)
            except UserModelError as err:
                raise ConfigError("--model", str(err)) from None
            if self.precision != "fp32":
                raise ConfigError("--precision", "a user's model computes in its own Keras dtype "
                                  "policy; build it under keras.config.set_dtype_policy("
                                  "'mixed_bfloat16') instead")
        else:
            _choice("--model", self.model, MODEL_NAMES + ("PATH.keras", "module:function"))
        if self.dataset.startswith("tfds:"):
            if not self.dataset[len("tfds:"):]:
                raise ConfigError("--dataset", "tfds:NAME needs a dataset name")
        elif not self.dataset.startswith("folder:"):
            _choice("--dataset", self.dataset, DATASET_NAMES + ("folder:PATH", "tfds:NAME"))
        elif not os.path.isdir(self.dataset[len("folder:"):]):
            raise ConfigError("--dataset", f"{self.dataset}: no such directory")
        _choice("--augment", self.augment, AUGMENTATIONS)
        _choice("--device-type", self.device_type, DEVICE_TYPES)
        if self.dataset in ("digits", "synthetic") and self.augment not in ("auto", "none"):
            raise ConfigError("--augment", f"{self.dataset} is held in memory and never "
                              "augmented; use a folder:, tfds: or imagenet2012 dataset")
        _positive_int("--devices", self.devices)
        _positive_int("--batch-size", self.batch_size)
        _positive_int("--lr-batch", self.lr_batch)
        _positive_int("--steps", self.steps)
        plan, k = self.parallel_plan(), self.num_replicas
        with _as_flag_error():
            plan.check_devices(k).check_batch(k, self.batch_size)
        for flag, value in (("--lr", self.lr), ("--weight-decay", self.weight_decay)):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(flag, f"must be a finite number >= 0, got {value}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError("--momentum", f"must be in [0, 1), got {self.momentum}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("--dropout", f"must be in [0, 1), got {self.dropout}")
        self._check_model_fits()
        if self.export_dir and os.path.exists(self.export_dir) and not os.path.isdir(
                self.export_dir):
            raise ConfigError("--export-dir", f"{self.export_dir} exists and is not a directory")
        for flag, value in (("--log-every", self.log_every),
                            ("--histogram-every", self.histogram_every)):
            if value < 0:
                raise ConfigError(flag, f"must be >= 0, got {value}")
        if self.profile_steps is not None:
            self.profile_range()
        if self.checkpoint_every < 0:
            raise ConfigError("--checkpoint-every", f"must be >= 0, got {self.checkpoint_every}")
        if self.eval_every < 0:
            raise ConfigError("--eval-every", f"must be >= 0, got {self.eval_every}")
        if self.skip_nonfinite < 0:
            raise ConfigError("--skip-nonfinite", f"must be >= 0, got {self.skip_nonfinite}")
        if self.deterministic and self.jit:
            # XLA has no deterministic MaxPoolGrad: TF raises on the first step otherwise.
            raise ConfigError("--deterministic", "cannot be combined with --jit (XLA's max-pool "
                              "gradient is not deterministic); drop one of them")
        if self.logdir is not None:
            _check_writable("--logdir", self.logdir)
        elif self.num_workers > 1:
            raise ConfigError("--logdir", "a multi-worker run needs one, the same on every "
                              "worker (python -m owt_tf.launch picks one when not given)")
        return self


    def decay_epochs(self) -> tuple:
        """--lr-decay-epochs as increasing floats."""
        try:
            epochs = tuple(float(e) for e in self.lr_decay_epochs.split(",") if e.strip())
        except ValueError:
            raise ConfigError("--lr-decay-epochs", f"expected comma-separated epochs, got "
                              f"{self.lr_decay_epochs!r}") from None
        if list(epochs) != sorted(epochs) or any(e <= 0 for e in epochs):
            raise ConfigError("--lr-decay-epochs", f"must be increasing and > 0, got "
                              f"{self.lr_decay_epochs!r}")
        return epochs

    def total_steps(self, train_examples: int) -> int:
        """--epochs turned into steps for this global batch, else --steps."""
        if self.epochs is None:
            return self.steps
        return max(1, math.ceil(self.epochs * train_examples / self.global_batch_size))

    def profile_range(self) -> Optional[tuple]:
        """--profile-steps 'A:B' as (A, B), 1 <= A <= B."""
        if self.profile_steps is None:
            return None
        try:
            a, b = (int(part) for part in self.profile_steps.split(":"))
        except ValueError:
            raise ConfigError("--profile-steps", f"expected A:B (step numbers), got "
                              f"{self.profile_steps!r}") from None
        if not 1 <= a <= b:
            raise ConfigError("--profile-steps", f"need 1 <= A <= B, got {self.profile_steps!r}")
        return a, b

    def _check_model_fits(self) -> None:
        """FC widths must split evenly over the devices (class counts are padded instead)."""
        from owt_tf.models.registry import build_model

        from owt_tf.models.user import is_user_model

        if self.scheme in ("data", AUTO) or is_user_model(self.model):
            return  # a user's model is checked when it is loaded (Trainer)
        for width in build_model(self.model, num_classes=2).head.hidden:
            if width % self.num_replicas:
                raise ConfigError("--devices", f"model {self.model}'s FC width {width} is not "
                                  f"divisible by {self.num_replicas} devices")


PRESETS = {
    # The no-flag run: RunConfig's own defaults.
    "demo": {},
    # Krizhevsky 2014 / cuda-convnet2: 128 per worker, FC batch 128 (K FC updates per conv
    # update), 0.01 for a batch of 128: the conv rate (batch 128K) scaled by K, the FC rate
    # (batch 128) unscaled; momentum 0.9, weight decay 5e-4, 90 epochs, rates / 10 at
    # epochs 30, 60 and 80.
    "imagenet-paper": dict(model="alexnet", dataset="imagenet2012", batch_size=128,
                           scheme="owt-b", fc_batch="worker", lr_scaling="linear",
                           lr=0.01, lr_batch=128, momentum=0.9, weight_decay=5e-4, dropout=0.5, epochs=90.0,
                           lr_schedule="step", lr_decay_epochs="30,60,80", eval_every=5000,
                           checkpoint_every=5000, log_every=100, histogram_every=5000),
}


def new_run_dir() -> str:
    """Where a run given no --logdir writes: runs/<start time>."""
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def lr_factor(config: RunConfig, step: int, steps_per_epoch: float, total_steps: int) -> float:
    """Multiplier of both learning rates before `step` (1-based): warm-up, then the schedule."""
    epoch = (step - 1) / steps_per_epoch
    warmup = config.warmup_epochs
    factor = min(1.0, (epoch + 1.0 / steps_per_epoch) / warmup) if warmup > 0 else 1.0
    if config.lr_schedule == "step":
        factor *= 0.1 ** sum(epoch >= e for e in config.decay_epochs())
    elif config.lr_schedule == "cosine":
        factor *= 0.5 * (1.0 + math.cos(math.pi * (step - 1) / max(total_steps, 1)))
    return factor


def lr_scale(rule: str, batch_ratio: float) -> float:
    """How much a learning rate grows when the batch grows `batch_ratio`-fold (docs/paper.md,
    'Batch sizes and learning rates')."""
    if rule == "linear":
        return float(batch_ratio)
    if rule == "sqrt":
        return math.sqrt(batch_ratio)
    if rule == "none":
        return 1.0
    raise ConfigError("--lr-scaling", f"unknown rule {rule!r}; allowed: {', '.join(LR_SCALINGS)}")


def _check_writable(flag: str, path: str) -> None:
    """`path` is, or can become, a directory this process can write (probed, then removed)."""
    existing = path
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing.rstrip(os.sep))
    existing = existing or "."
    if not os.path.isdir(existing):
        where = "is" if existing == path else f"is inside {existing}, which is"
        raise ConfigError(flag, f"{path} {where} not a directory")
    probe = os.path.join(existing, f".owt_tf_write_probe_{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        raise ConfigError(flag, f"cannot write in {existing}: {err.strerror}") from None


def _choice(flag: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(flag, f"unknown value {value!r}; allowed: {', '.join(allowed)}")


def _positive_int(flag: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(flag, f"must be an integer >= 1, got {value!r}")
