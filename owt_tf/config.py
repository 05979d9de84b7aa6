"""The one configuration object of a run, in sections: what is trained (`model`), on which
data (`data`), how it is split over devices (`parallel`), how it learns (`optimizer`), how
long and where it writes (`run`) and which processes take part (`cluster`).

Every CLI flag of `python -m owt_tf.train` is one field of one section, declared once with
its help text and choices (owt_tf.cli builds the parser from these declarations). Flag
names are unique across sections, so a config is built or changed by flag name:
`RunConfig.from_flags(devices=4, scheme="owt-a")`, `config.replace(devices=4)`.

`validate()` only reads the config (and whether --dataset folder:PATH / --export-dir exist):
a bad combination fails in one line naming the flag, before anything is built. The cluster
(--cluster, else TF_CONFIG) is resolved once, when a config is made from flags.

Why one module over 450 lines: every flag is declared once, here, with its section, help and
choices; split across files, the one place to read or add a flag would be several.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

from owt_tf.cluster import DEVICE_TYPES, Cluster, ClusterError, resolve_cluster
from owt_tf.parallel.plan import (AUTO, FC_BATCH_MODES, FC_EXCHANGES, LOSS_MODES, PRECISIONS,
                                  SCHEMES, ParallelPlan, PlanError, Scheme, check_auto_processes,
                                  widths_problem)

LR_SCALINGS = ("linear", "sqrt", "none")
LR_SCHEDULES = ("constant", "step", "cosine")
# --augment: AlexNet's crop + flip + PCA lighting; the random crop alone (no mirror images:
# digits and text are not symmetric); none (training sees the eval view); auto picks per
# dataset (owt_tf.data.datasets.default_augmentation).
AUGMENTATIONS = ("auto", "alexnet", "crop", "none")


class ConfigError(ValueError):
    """A bad flag or flag combination. `flag` names the CLI flag at fault."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.message = message


# -- values given as text on the command line, parsed once -------------------------------
def parse_decay_epochs(text: str) -> Tuple[float, ...]:
    """--lr-decay-epochs "30,60,80" as increasing epochs (30.0, 60.0, 80.0)."""
    try:
        epochs = tuple(float(e) for e in text.split(",") if e.strip())
    except ValueError:
        raise ConfigError("--lr-decay-epochs", f"expected comma-separated epochs, got "
                          f"{text!r}") from None
    check_decay_epochs(epochs)
    return epochs


def check_decay_epochs(epochs: Tuple[float, ...]) -> None:
    if list(epochs) != sorted(epochs) or any(not e > 0 for e in epochs):
        raise ConfigError("--lr-decay-epochs", f"must be increasing and > 0, got "
                          f"{','.join(f'{e:g}' for e in epochs)!r}")


def parse_profile_steps(text: str) -> Tuple[int, int]:
    """--profile-steps "A:B" as (A, B), 1 <= A <= B."""
    try:
        a, b = (int(part) for part in text.split(":"))
    except ValueError:
        raise ConfigError("--profile-steps", f"expected A:B (step numbers), got "
                          f"{text!r}") from None
    check_profile_steps((a, b))
    return a, b


def check_profile_steps(steps: Tuple[int, int]) -> None:
    a, b = steps
    if not 1 <= a <= b:
        raise ConfigError("--profile-steps", f"need 1 <= A <= B, got '{a}:{b}'")


def _flag(default: Any, help: str, *, choices: Optional[Tuple[str, ...]] = None,
          parse: Optional[Callable[[str], Any]] = None, kind: Optional[type] = None,
          show: Optional[str] = None, name: Optional[str] = None) -> Any:
    """A field that is a CLI flag. `help` and `choices` become its --help line; `parse`
    turns the command line's text into the field's value (and `show` is the default as
    typed); `kind` is the value's type when the default (None) does not tell; `name`
    the flag's name when it is not the field's."""
    metadata = {"help": help, "choices": choices, "parse": parse, "kind": kind, "show": show,
                "name": name}
    return dataclasses.field(default=default, metadata=metadata)


# -- the sections -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """model: the network"""

    model: str = _flag(
        "alexnet_tiny",
        "network: alexnet (the paper's, 224x224), vgg16 (224x224), their CPU-sized 32x32 "
        "versions alexnet_tiny and vgg_tiny, or your own Keras model: PATH.keras or "
        "package.module:function (called with the class count; it returns a keras.Model "
        "split at its Dense head, with its own weights, activations and dropout)")
    dropout: float = _flag(0.5, "dropout rate after fc6 and fc7")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """data: the dataset and its augmentation"""

    dataset: str = _flag(
        "digits",
        "digits (embedded default), imagenet2012 (with --manual-dir), folder:PATH "
        "(PATH/train/<label>/*, PATH/validation/<label>/*), tfds:NAME (a TFDS dataset "
        "prepared in --data-dir) or synthetic")
    data_dir: Optional[str] = _flag(None, "where prepared TFDS datasets live")
    manual_dir: Optional[str] = _flag(
        None, "imagenet2012: the folder holding ILSVRC2012_img_train.tar and _val.tar")
    download: bool = _flag(
        False, "let TFDS download and prepare a tfds:NAME dataset that is not prepared yet")
    classes: Optional[int] = _flag(
        None, "--dataset synthetic only: how many classes its labels take (default 10; a "
        "large head's benchmark runs take 10^5 or more); other datasets have their own",
        kind=int)
    # digits and synthetic are held in memory and never augmented.
    augment: str = _flag(
        "auto",
        "training augmentation of a streamed dataset: alexnet (shorter side to 256/224 of "
        "the input, random crop, flip, PCA lighting), crop (the random crop only), none "
        "(the eval view), or auto: alexnet for ImageNet-sized images, none for smaller ones",
        choices=AUGMENTATIONS)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """parallel plan: devices, the scheme and the batch"""

    devices: int = _flag(
        2, "devices per process (GPUs, else logical CPU devices); K = this x the cluster's "
           "workers")
    device_type: str = _flag(
        "auto",
        "auto: K GPUs, fewer GPUs each split into K/G logical GPUs, no GPU: K logical CPUs; "
        "gpu: the same but no GPU is an error; cpu: logical CPUs even with GPUs",
        choices=DEVICE_TYPES)
    scheme: str = _flag(
        "owt-b", "single | data (pure data parallel) | owt-a | owt-b | owt-c (docs/paper.md) | "
                 "auto: the planner (python -m owt_tf.plan --recommend) picks scheme, "
                 "--fc-exchange and --loss for this machine, model, K and batch (--fc-batch is "
                 "kept); one process", choices=SCHEMES + (AUTO,))
    batch_size: int = _flag(
        32, "examples per replica (device) per step (B); the global batch is B*K")
    fc_batch: str = _flag(
        "global", "global: FC updated once per step on B*K; worker: after every round on B "
                  "(b, c)", choices=FC_BATCH_MODES)
    fc_exchange: str = _flag(
        "gather", "gather (paper: all-gather FC outputs) or colrow (Megatron column/row "
                  "pairs)", choices=FC_EXCHANGES)
    loss: str = _flag(
        "gathered", "gathered (all-gather logits) or sharded (class-sharded softmax "
                    "cross-entropy)", choices=LOSS_MODES)
    precision: str = _flag(
        "fp32", "compute dtype of the trunk and the FC shards, and of the activations they "
                "exchange: fp32, bf16 or fp16 (float32 weights, optimizer state and loss; fp16 "
                "with a dynamic loss scale)", choices=tuple(PRECISIONS))
    jit: bool = _flag(False, "XLA-compile the conv trunk's forward and backward on each device")

    def plan(self) -> ParallelPlan:
        """These choices as a ParallelPlan (its own rules checked, as ConfigErrors); under
        --scheme auto, until the Trainer chooses, owt-b's (it checks the flags auto keeps)."""
        with _as_flag_error():
            return ParallelPlan("owt-b" if self.scheme == AUTO else self.scheme, self.fc_batch,
                                self.fc_exchange, self.loss, self.jit, self.precision)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """optimizer: SGD and its learning rates"""

    # The rate for a batch of lr_batch examples. Each layer kind's rate follows the batch it
    # averages its gradient over (conv: the global batch; FC: fc_batch_size), by lr_scaling:
    # the same global batch gives the same rates at any K, so a run resumes at another K.
    lr: float = _flag(
        0.04, "learning rate for a batch of --lr-batch examples; the conv rate is scaled from "
              "it to the global batch, the FC rate to the FC layers' own batch")
    lr_batch: int = _flag(
        128, "the batch --lr is the rate for (the same global batch: the same rates at any K)")
    lr_scaling: str = _flag("linear", "how a rate grows with its batch: linear, sqrt or none",
                            choices=LR_SCALINGS)
    lr_schedule: str = _flag(
        "constant", "constant, step (rates / 10 at --lr-decay-epochs, AlexNet) or cosine",
        choices=LR_SCHEDULES)
    lr_decay_epochs: Tuple[float, ...] = _flag(
        (30.0, 60.0, 80.0), "comma-separated epochs for the step schedule",
        parse=parse_decay_epochs, show="30,60,80")
    warmup_epochs: float = _flag(0.0, "linear learning-rate warm-up over this many epochs")
    momentum: float = _flag(0.9, "SGD momentum")
    weight_decay: float = _flag(5e-4, "L2 weight decay (AlexNet's coupled form)")


@dataclasses.dataclass(frozen=True)
class RunIOConfig:
    """run: length, seed, what is written where"""

    steps: int = _flag(600, "optimizer steps to train (in all, counting those of a resumed run)")
    epochs: Optional[float] = _flag(
        None, "passes over the training split; when given, overrides --steps", kind=float)
    seed: int = _flag(0, "seed for weights, data order and dropout")
    logdir: Optional[str] = _flag(
        None, "run directory for checkpoints (default runs/<timestamp>); an existing one resumes")
    eval_every: int = _flag(150, "validate every N steps (0: only at the end)")
    checkpoint_every: int = _flag(200, "save a checkpoint every N steps (0: only at the end)")
    export_dir: Optional[str] = _flag(
        None, "at the end, export the trained model as a SavedModel to EXPORT_DIR/<n>/, n one "
              "past the newest version there (TF Serving's model base path)")
    log_every: int = _flag(10, "write training scalars to TensorBoard every N steps")
    histogram_every: int = _flag(
        200, "write weight and gradient histograms every N steps (0: never)")
    profile_steps: Optional[Tuple[int, int]] = _flag(
        None, "A:B: record a TensorBoard profiler trace of steps A to B",
        parse=parse_profile_steps)
    deterministic: bool = _flag(
        False, "deterministic ops (tf.config.experimental.enable_op_determinism): a run "
               "killed and resumed ends bit-identical to one never stopped; not with --jit")
    skip_nonfinite: int = _flag(
        0, "undo and skip up to N steps whose loss or gradient is not finite, then stop "
           "(0: stop at the first)")
    verbose: bool = _flag(False, "show TensorFlow's C++ start-up log lines (hidden by default)")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """cluster: the processes of a multi-worker run (default: TF_CONFIG if set, else one)"""

    addresses: Optional[str] = _flag(
        None, "host:port of every worker, comma-separated, for a multi-worker run (default: "
              "TF_CONFIG if set, else one process); every worker runs the same command",
        name="cluster")
    task_index: Optional[int] = _flag(
        None, "this worker's place in --cluster (0 is the chief)", kind=int)
    # Resolved from the two flags above, else TF_CONFIG, when the config is made from flags;
    # None: a one-process run.
    resolved: Optional[Cluster] = None

    @property
    def num_workers(self) -> int:
        return self.resolved.num_workers if self.resolved else 1


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run. Defaults are the no-flag demo run."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    run: RunIOConfig = dataclasses.field(default_factory=RunIOConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)

    # -- made and changed by flag name ----------------------------------------------------
    @classmethod
    def from_flags(cls, environ: Mapping[str, str] = os.environ, **flags: Any) -> "RunConfig":
        """The defaults changed by `flags` (flag names with underscores: devices=4,
        cluster="h:1,h:2"), with the cluster resolved from --cluster, else TF_CONFIG in
        `environ`."""
        return cls()._with_flags(flags)._resolving_cluster(environ)

    def replace(self, **flags: Any) -> "RunConfig":
        """A copy with these flags changed (the cluster resolved again if --cluster or
        --task-index are among them)."""
        changed = self._with_flags(flags)
        if flags.keys() & {"cluster", "task_index"}:
            changed = changed._resolving_cluster(os.environ)
        return changed

    def to_flags(self) -> Dict[str, Any]:
        """Every flag's value, by flag name (what from_flags takes)."""
        return {name: getattr(getattr(self, section), field)
                for name, (section, field) in FLAG_FIELDS.items()}

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        """Section -> {field: value} of every flag: run_config.json's layout."""
        out: Dict[str, Dict[str, Any]] = {}
        for section, field in FLAG_FIELDS.values():
            out.setdefault(section, {})[field] = getattr(getattr(self, section), field)
        return out

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> "RunConfig":
        """A config read back from run_config.json: this layout (to_dict's) or the flat one
        of earlier versions (flag name -> value, lists of numbers as text). Unknown keys are
        ignored; the cluster is not resolved (a recorded run is read, not joined)."""
        if isinstance(saved.get("parallel"), dict):
            flags = {}
            for name, (section, field) in FLAG_FIELDS.items():
                if field in saved.get(section, {}):
                    flags[name] = saved[section][field]
        else:
            flags = {k: v for k, v in saved.items() if k in FLAG_FIELDS}
        for name, value in flags.items():
            parse = _metadata(name).get("parse")
            if parse and isinstance(value, str):
                flags[name] = parse(value)
            elif isinstance(value, list):
                flags[name] = tuple(value)
        return cls()._with_flags(flags)

    def _with_flags(self, flags: Mapping[str, Any]) -> "RunConfig":
        by_section: Dict[str, Dict[str, Any]] = {}
        for name, value in flags.items():
            if name not in FLAG_FIELDS:
                raise TypeError(f"RunConfig has no flag {name!r}")
            section, field = FLAG_FIELDS[name]
            by_section.setdefault(section, {})[field] = value
        return dataclasses.replace(self, **{
            section: dataclasses.replace(getattr(self, section), **fields)
            for section, fields in by_section.items()})

    def _resolving_cluster(self, environ: Mapping[str, str]) -> "RunConfig":
        try:
            cluster = resolve_cluster(self.cluster.addresses, self.cluster.task_index, environ)
        except ClusterError as err:
            flag, _, message = str(err).partition(": ")
            raise ConfigError(flag, message) from None
        return dataclasses.replace(self, cluster=dataclasses.replace(self.cluster,
                                                                     resolved=cluster))

    # -- derived values -------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        return self.cluster.num_workers

    @property
    def num_replicas(self) -> int:
        """K: --devices on each of the workers."""
        return self.parallel.devices * self.num_workers

    @property
    def global_batch_size(self) -> int:
        return self.parallel.batch_size * self.num_replicas

    @property
    def fc_batch_size(self) -> int:
        """Examples behind one FC update: B in 'worker' mode, B*K in 'global' mode."""
        if self.parallel.fc_batch == "worker":
            return self.parallel.batch_size
        return self.global_batch_size

    @property
    def conv_lr(self) -> float:
        """The trunk's rate: --lr scaled from --lr-batch to the global batch."""
        o = self.optimizer
        return o.lr * lr_scale(o.lr_scaling, self.global_batch_size / o.lr_batch)

    @property
    def fc_lr(self) -> float:
        """The FC layers' rate: --lr scaled from --lr-batch to the FC layers' own batch."""
        o = self.optimizer
        return o.lr * lr_scale(o.lr_scaling, self.fc_batch_size / o.lr_batch)

    def total_steps(self, train_examples: int) -> int:
        """--epochs turned into steps for this global batch, else --steps."""
        if self.run.epochs is None:
            return self.run.steps
        return max(1, math.ceil(self.run.epochs * train_examples / self.global_batch_size))

    # -- checks ---------------------------------------------------------------------------
    def validate(self) -> "RunConfig":
        """Raises ConfigError for the first invalid field; returns self when all is well.
        Reads the config only (and whether --dataset folder:PATH and --export-dir exist)."""
        plan = self.parallel.plan()
        for name, (section, field) in FLAG_FIELDS.items():
            choices = _metadata(name)["choices"]
            if choices:
                _choice(_flag_text(name), getattr(getattr(self, section), field), choices)
        self._check_optimizer()
        self._check_model_and_data()
        p = self.parallel
        _positive_int("--devices", p.devices)
        _positive_int("--batch-size", p.batch_size)
        _positive_int("--steps", self.run.steps)
        k = self.num_replicas
        with _as_flag_error():
            plan.check_devices(k).check_batch(k, p.batch_size)
        with _as_flag_error():
            check_auto_processes(p.scheme, self.num_workers)
        self._check_model_fits()
        self._check_run()
        return self

    def _check_optimizer(self) -> None:
        o = self.optimizer
        check_decay_epochs(o.lr_decay_epochs)
        if not (math.isfinite(o.warmup_epochs) and o.warmup_epochs >= 0):
            raise ConfigError("--warmup-epochs", f"must be >= 0, got {o.warmup_epochs}")
        _positive_int("--lr-batch", o.lr_batch)
        for flag, value in (("--lr", o.lr), ("--weight-decay", o.weight_decay)):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(flag, f"must be a finite number >= 0, got {value}")
        if not 0.0 <= o.momentum < 1.0:
            raise ConfigError("--momentum", f"must be in [0, 1), got {o.momentum}")

    def _check_model_and_data(self) -> None:
        from owt_tf.data import DATASET_NAMES
        from owt_tf.models.registry import MODEL_NAMES
        from owt_tf.models.user import UserModelError, check_user_model_name, is_user_model

        model, dataset, augment = self.model.model, self.data.dataset, self.data.augment
        if is_user_model(model):
            try:
                check_user_model_name(model)
            except UserModelError as err:
                raise ConfigError("--model", str(err)) from None
            if self.parallel.precision != "fp32":
                raise ConfigError("--precision", "a user's model computes in its own Keras dtype "
                                  "policy; build it under keras.config.set_dtype_policy("
                                  "'mixed_bfloat16') instead")
        else:
            _choice("--model", model, MODEL_NAMES + ("PATH.keras", "module:function"))
        if not 0.0 <= self.model.dropout < 1.0:
            raise ConfigError("--dropout", f"must be in [0, 1), got {self.model.dropout}")
        if dataset.startswith("tfds:"):
            if not dataset[len("tfds:"):]:
                raise ConfigError("--dataset", "tfds:NAME needs a dataset name")
        elif not dataset.startswith("folder:"):
            _choice("--dataset", dataset, DATASET_NAMES + ("folder:PATH", "tfds:NAME"))
        elif not os.path.isdir(dataset[len("folder:"):]):
            raise ConfigError("--dataset", f"{dataset}: no such directory")
        if self.data.classes is not None:
            if dataset != "synthetic":
                raise ConfigError("--classes", f"{dataset} has its own classes; --classes sets "
                                  "those of --dataset synthetic")
            if self.data.classes < 2:
                raise ConfigError("--classes", f"must be >= 2, got {self.data.classes}")
        if dataset in ("digits", "synthetic") and augment not in ("auto", "none"):
            raise ConfigError("--augment", f"{dataset} is held in memory and never "
                              "augmented; use a folder:, tfds: or imagenet2012 dataset")

    def _check_model_fits(self) -> None:
        """FC widths must split evenly over the devices (class counts are padded instead).
        A user's model is checked when it is loaded (Trainer)."""
        from owt_tf.models.registry import FC_WIDTHS

        if (self.parallel.scheme == AUTO or not Scheme(self.parallel.scheme).model_parallel
                or self.model.model not in FC_WIDTHS):
            return
        widths = FC_WIDTHS[self.model.model]
        names = [f"model {self.model.model}'s FC layer {i + 1}" for i in range(len(widths))]
        problem = widths_problem(widths, self.num_replicas, names)
        if problem:
            raise ConfigError("--devices", problem)

    def _check_run(self) -> None:
        r = self.run
        if r.epochs is not None and not (math.isfinite(r.epochs) and r.epochs > 0):
            raise ConfigError("--epochs", f"must be a number > 0, got {r.epochs}")
        if r.export_dir and os.path.exists(r.export_dir) and not os.path.isdir(r.export_dir):
            raise ConfigError("--export-dir", f"{r.export_dir} exists and is not a directory")
        for flag, value in (("--log-every", r.log_every), ("--histogram-every", r.histogram_every),
                            ("--checkpoint-every", r.checkpoint_every),
                            ("--eval-every", r.eval_every),
                            ("--skip-nonfinite", r.skip_nonfinite)):
            if value < 0:
                raise ConfigError(flag, f"must be >= 0, got {value}")
        if r.profile_steps is not None:
            check_profile_steps(r.profile_steps)
        if r.deterministic and self.parallel.jit:
            # XLA has no deterministic MaxPoolGrad: TF raises on the first step otherwise.
            raise ConfigError("--deterministic", "cannot be combined with --jit (XLA's max-pool "
                              "gradient is not deterministic); drop one of them")
        if r.logdir is None and self.num_workers > 1:
            raise ConfigError("--logdir", "a multi-worker run needs one, the same on every "
                              "worker (python -m owt_tf.launch picks one when not given)")


SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))


def flag_fields() -> Iterator[Tuple[str, dataclasses.Field]]:
    """(section name, field) of every flag, section by section, in declaration order."""
    for section in dataclasses.fields(RunConfig):
        for field in dataclasses.fields(section.default_factory):
            if "help" in field.metadata:
                yield section.name, field


# flag name (underscores) -> (section, field name), and -> the field's declaration
FLAG_FIELDS: Dict[str, Tuple[str, str]] = {
    field.metadata["name"] or field.name: (section, field.name)
    for section, field in flag_fields()}
_DECLARATIONS: Dict[str, dataclasses.Field] = {
    field.metadata["name"] or field.name: field for _, field in flag_fields()}


def _metadata(flag_name: str) -> Mapping[str, Any]:
    return _DECLARATIONS[flag_name].metadata


def _flag_text(flag_name: str) -> str:
    return "--" + flag_name.replace("_", "-")


# -- presets --------------------------------------------------------------------------------
def demo() -> RunConfig:
    """The no-flag run: RunConfig's own defaults."""
    return RunConfig()


def imagenet_paper() -> RunConfig:
    """Krizhevsky 2014 / cuda-convnet2: 128 per replica, FC batch 128 (K FC updates per conv
    update), 0.01 for a batch of 128: the conv rate (batch 128K) scaled by K, the FC rate
    (batch 128) unscaled; momentum 0.9, weight decay 5e-4, 90 epochs, rates / 10 at epochs
    30, 60 and 80."""
    return RunConfig()._with_flags(dict(
        model="alexnet", dataset="imagenet2012", batch_size=128, scheme="owt-b",
        fc_batch="worker", lr_scaling="linear", lr=0.01, lr_batch=128, momentum=0.9,
        weight_decay=5e-4, dropout=0.5, epochs=90.0, lr_schedule="step",
        lr_decay_epochs=(30.0, 60.0, 80.0), eval_every=5000, checkpoint_every=5000,
        log_every=100, histogram_every=5000))


PRESETS: Dict[str, Callable[[], RunConfig]] = {"demo": demo, "imagenet-paper": imagenet_paper}


def new_run_dir() -> str:
    """Where a run given no --logdir writes: runs/<start time>."""
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


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
        raise ConfigError(_PLAN_FLAGS.get(err.field, "--" + err.field), err.message) from None


def _choice(flag: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(flag, f"unknown value {value!r}; allowed: {', '.join(allowed)}")


def _positive_int(flag: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(flag, f"must be an integer >= 1, got {value!r}")
