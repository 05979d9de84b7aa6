"""The sections of a run's configuration, each a frozen dataclass of CLI flags: what is
trained (`model`), on which data (`data`), how it is split over devices (`parallel`), how
it learns (`optimizer`), how long and where it writes (`run`) and which processes take
part (`cluster`). Every flag is declared once, in its section, with its help and choices;
the parallel section takes the plan's flags from ParallelPlan's own declarations.

Pure Python: the CLI builds its parser from these before TensorFlow loads.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

from owt_tf.data import AUGMENTATIONS
from owt_tf.models.face import DEFAULT_MARGINS
from owt_tf.runtime.cluster import DEVICE_TYPES, Cluster
from owt_tf.config.flags import as_flag_error, flag, parse_decay_epochs, parse_profile_steps
from owt_tf.planner.plan import AUTO, ParallelPlan

LR_SCALINGS = ("linear", "sqrt", "none")
LR_SCHEDULES = ("constant", "step", "cosine", "poly")
# --objective: what the class layer's outputs are trained with. softmax: cross-entropy of
# the logits; arcface / cosface: a margin softmax of a cosine class layer (owt_tf.losses).
OBJECTIVES = ("softmax", "arcface", "cosface")
MARGIN_OBJECTIVES = OBJECTIVES[1:]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """model: the network"""

    model: str = flag(
        "alexnet_tiny",
        "network: alexnet (the paper's, 224x224), vgg16 (224x224), their CPU-sized 32x32 "
        "versions alexnet_tiny and vgg_tiny, the face trunks iresnet18, iresnet50, "
        "mobilefacenet (112x112) and face_tiny (32x32), or your own Keras model: PATH.keras or "
        "package.module:function (called with the class count; it returns a keras.Model "
        "split at its Dense head, with its own weights, activations and dropout)")
    dropout: float = flag(0.5, "dropout rate after fc6 and fc7 (face models: before the "
                               "embedding FC)")
    embedding_dim: Optional[int] = flag(
        None, "the embedding width D of a face model (iresnet18, iresnet50, mobilefacenet: "
              "512; face_tiny: 64)", kind=int)
    # The objective of the class layer: a margin softmax turns it into a cosine layer.
    objective: str = flag(
        "softmax", "softmax: cross-entropy of the class layer's logits; arcface / cosface: a "
                   "margin softmax of a cosine class layer (face models become cosine; your "
                   "own model must end in owt_tf.layers.NormalizedDense), computed on the "
                   "shards: needs --loss sharded", choices=OBJECTIVES)
    margin: Optional[float] = flag(
        None, "the margin of --objective arcface (radians, in [0, pi/2); default 0.5) or "
              "cosface (in [0, 1); default 0.35)", kind=float)
    scale: float = flag(64.0, "the logit scale s of --objective arcface or cosface (> 0)")
    interclass_filtering_threshold: float = flag(
        0.0, "Partial FC v2's inter-class filtering for noisy identities, with --objective "
             "arcface or cosface: a non-target cosine above it counts as 0 for that row; 0 "
             "(default) filters nothing; arcface_torch's WebFace configs use 0.4; in [0, 1)")

    @property
    def margin_value(self) -> Optional[float]:
        """The margin a margin objective trains with (--margin, else its default); None
        under softmax."""
        if self.objective not in MARGIN_OBJECTIVES:
            return None
        return DEFAULT_MARGINS[self.objective] if self.margin is None else self.margin


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """data: the dataset and its augmentation"""

    dataset: str = flag(
        "digits",
        "digits (embedded default), faces (embedded synthetic identities with held-out "
        "verification pairs), imagenet2012 (with --manual-dir), folder:PATH "
        "(PATH/train/<label>/*, PATH/validation/<label>/*), prepared:PATH (a set written "
        "by python -m owt_tf.prepare), insightface:PATH (train.rec + "
        "train.idx, *.bin pairs), tfds:NAME (a TFDS dataset prepared in --data-dir) or "
        "synthetic")
    data_dir: Optional[str] = flag(None, "where prepared TFDS datasets live")
    manual_dir: Optional[str] = flag(
        None, "imagenet2012: the folder holding ILSVRC2012_img_train.tar and _val.tar")
    download: bool = flag(
        False, "let TFDS download and prepare a tfds:NAME dataset that is not prepared yet")
    classes: Optional[int] = flag(
        None, "--dataset synthetic only: how many classes its labels take (default 10; a "
        "large head's benchmark runs take 10^5 or more); other datasets have their own",
        kind=int)
    # digits and synthetic are held in memory and never augmented.
    augment: str = flag(
        "auto",
        "training augmentation of a streamed dataset: alexnet (shorter side to 256/224 of "
        "the input, random crop, flip, PCA lighting), crop (the random crop only), none "
        "(the eval view), or auto: alexnet for ImageNet-sized images, none for smaller ones",
        choices=AUGMENTATIONS)


def _plan_flags() -> list:
    """ParallelPlan's fields as flags of the parallel section, declared by the plan."""
    return [(f.name, f.type, flag(f.default, f.metadata["help"], choices=f.metadata["choices"]))
            for f in dataclasses.fields(ParallelPlan)]


def _plan_fields(self) -> Dict[str, Any]:
    """The plan's fields as given (scheme 'auto' kept): HybridStrategy's keywords."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(ParallelPlan)}


def _plan(self) -> ParallelPlan:
    """These choices as a ParallelPlan (its own rules checked, as ConfigErrors); under
    --scheme auto, until the Trainer chooses, owt-b's (it checks the flags auto keeps)."""
    fields = _plan_fields(self)
    if fields["scheme"] == AUTO:
        fields["scheme"] = "owt-b"
    with as_flag_error():
        return ParallelPlan(**fields)


ParallelConfig = dataclasses.make_dataclass("ParallelConfig", [
    ("devices", int, flag(
        2, "devices per process (GPUs, else logical CPU devices); K = this x the cluster's "
           "workers")),
    ("device_type", str, flag(
        "auto",
        "auto: K GPUs, fewer GPUs each split into K/G logical GPUs, no GPU: K logical CPUs; "
        "gpu: the same but no GPU is an error; cpu: logical CPUs even with GPUs",
        choices=DEVICE_TYPES)),
    ("batch_size", int, flag(
        32, "examples per replica (device) per step (B); the global batch is B*K")),
] + _plan_flags(), frozen=True, namespace={"plan": _plan, "plan_fields": _plan_fields})
ParallelConfig.__module__ = __name__
ParallelConfig.__doc__ = "parallel plan: devices, the batch and the plan's fields (ParallelPlan)"


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """optimizer: SGD and its learning rates"""

    # The rate for a batch of lr_batch examples. Each layer kind's rate follows the batch it
    # averages its gradient over (conv: the global batch; FC: fc_batch_size), by lr_scaling:
    # the same global batch gives the same rates at any K, so a run resumes at another K.
    lr: float = flag(
        0.04, "learning rate for a batch of --lr-batch examples; the conv rate is scaled from "
              "it to the global batch, the FC rate to the FC layers' own batch")
    lr_batch: int = flag(
        128, "the batch --lr is the rate for (the same global batch: the same rates at any K)")
    lr_scaling: str = flag("linear", "how a rate grows with its batch: linear, sqrt or none",
                            choices=LR_SCALINGS)
    lr_schedule: str = flag(
        "constant", "constant, step (rates / 10 at --lr-decay-epochs, AlexNet), cosine, or "
                    "poly (arcface_torch's: linear warm-up over --warmup-epochs from 0, then "
                    "(1 - progress)^2 to 0 at the last step)",
        choices=LR_SCHEDULES)
    lr_decay_epochs: Tuple[float, ...] = flag(
        (30.0, 60.0, 80.0), "comma-separated epochs for the step schedule",
        parse=parse_decay_epochs, show="30,60,80")
    warmup_epochs: float = flag(0.0, "linear learning-rate warm-up over this many epochs")
    momentum: float = flag(0.9, "SGD momentum")
    weight_decay: float = flag(5e-4, "L2 weight decay (AlexNet's coupled form)")


@dataclasses.dataclass(frozen=True)
class RunIOConfig:
    """run: length, seed, what is written where"""

    steps: int = flag(600, "optimizer steps to train (in all, counting those of a resumed run)")
    epochs: Optional[float] = flag(
        None, "passes over the training split; when given, overrides --steps", kind=float)
    seed: int = flag(0, "seed for weights, data order and dropout")
    logdir: Optional[str] = flag(
        None, "run directory for checkpoints (default runs/<timestamp>); an existing one resumes")
    eval_every: int = flag(150, "validate every N steps (0: only at the end)")
    checkpoint_every: int = flag(200, "save a checkpoint every N steps (0: only at the end)")
    export_dir: Optional[str] = flag(
        None, "at the end, export the trained model as a SavedModel to EXPORT_DIR/<n>/, n one "
              "past the newest version there (TF Serving's model base path)")
    embeddings_only: bool = flag(
        False, "with --export-dir and a cosine class layer (--objective arcface or cosface): "
               "export the embedding alone, without the class layer (serving_default is then "
               "the embeddings signature)")
    log_every: int = flag(10, "write training scalars to TensorBoard every N steps")
    histogram_every: int = flag(
        200, "write weight and gradient histograms every N steps (0: never)")
    profile_steps: Optional[Tuple[int, int]] = flag(
        None, "A:B: record a TensorBoard profiler trace of steps A to B",
        parse=parse_profile_steps)
    deterministic: bool = flag(
        False, "deterministic ops (tf.config.experimental.enable_op_determinism): a run "
               "killed and resumed ends bit-identical to one never stopped; not with --jit")
    skip_nonfinite: int = flag(
        0, "undo and skip up to N steps whose loss or gradient is not finite, then stop "
           "(0: stop at the first)")
    verbose: bool = flag(False, "show TensorFlow's C++ start-up log lines (hidden by default)")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """cluster: the processes of a multi-worker run (default: TF_CONFIG if set, else one)"""

    addresses: Optional[str] = flag(
        None, "host:port of every worker, comma-separated, for a multi-worker run (default: "
              "TF_CONFIG if set, else one process); every worker runs the same command",
        name="cluster")
    task_index: Optional[int] = flag(
        None, "this worker's place in --cluster (0 is the chief)", kind=int)
    # Resolved from the two flags above, else TF_CONFIG, when the config is made from flags;
    # None: a one-process run.
    resolved: Optional[Cluster] = None

    @property
    def num_workers(self) -> int:
        return self.resolved.num_workers if self.resolved else 1


# The sections of RunConfig by name, in order.
SECTIONS: Dict[str, type] = {"model": ModelConfig, "data": DataConfig, "parallel": ParallelConfig,
                             "optimizer": OptimizerConfig, "run": RunIOConfig,
                             "cluster": ClusterConfig}


def flag_fields() -> Iterator[Tuple[str, dataclasses.Field]]:
    """(section name, field) of every flag, section by section, in declaration order."""
    for name, section in SECTIONS.items():
        for field in dataclasses.fields(section):
            if "help" in field.metadata:
                yield name, field


# flag name (underscores) -> (section, field name), and -> the field's declaration
FLAG_FIELDS: Dict[str, Tuple[str, str]] = {
    field.metadata.get("name") or field.name: (section, field.name)
    for section, field in flag_fields()}
_DECLARATIONS: Dict[str, dataclasses.Field] = {
    field.metadata.get("name") or field.name: field for _, field in flag_fields()}


def flag_metadata(flag_name: str) -> Mapping[str, Any]:
    """A flag's declaration: help, choices, parse, kind, show, name."""
    return _DECLARATIONS[flag_name].metadata
