"""What the `python -m owt_tf.X` entry points share: an argparse parser whose errors are one
line and exit code 2, the list-of-K flag type, and train's flags generated from the fields
of `RunConfig` (train parses them, launch checks its workers' flags with them).

Pure Python (no TensorFlow import), so that every entry point rejects a bad flag before
TensorFlow loads.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from typing import List, Optional

from owt_tf.config import (AUGMENTATIONS, DEVICE_TYPES, FC_BATCH_MODES, FC_EXCHANGES, LOSS_MODES, LR_SCALINGS,
                           LR_SCHEDULES, PRECISIONS, PRESETS, SCHEMES, RunConfig)

TRAIN_DESCRIPTION = """`python -m owt_tf.train`: train a CNN with the hybrid scheme. No flags: the demo run.

Every flag is a field of owt_tf.config.RunConfig. Bad flags fail in one line, exit code 2,
before anything is built.
"""
TRAIN_HELP = {
    "model": "network: alexnet (the paper's, 224x224), vgg16 (224x224), their CPU-sized 32x32 "
             "versions alexnet_tiny and vgg_tiny, or your own Keras model: PATH.keras or "
             "package.module:function (called with the class count; it returns a keras.Model "
             "split at its Dense head, with its own weights, activations and dropout)",
    "dataset": "digits (embedded default), imagenet2012 (with --manual-dir), folder:PATH (PATH/train/<label>/*, PATH/validation/"
               "<label>/*), tfds:NAME (a TFDS dataset prepared in --data-dir) or synthetic",
    "data_dir": "where prepared TFDS datasets live",
    "augment": "training augmentation of a streamed dataset: alexnet (shorter side to "
               "256/224 of the input, random crop, flip, PCA lighting), crop (the random crop "
               "only), none (the eval view), or auto: alexnet for ImageNet-sized images, none "
               "for smaller ones",
    "download": "let TFDS download and prepare a tfds:NAME dataset that is not prepared yet",
    "manual_dir": "imagenet2012: the folder holding ILSVRC2012_img_train.tar and _val.tar",
    "devices": "devices per process (GPUs, else logical CPU devices); K = this x the cluster's "
               "workers",
    "scheme": "single | data (pure data parallel) | owt-a | owt-b | owt-c (docs/paper.md) | "
              "auto: the planner (python -m owt_tf.plan --recommend) picks scheme, --fc-exchange "
              "and --loss for this machine, model, K and batch (--fc-batch is kept); one process",
    "batch_size": "examples per worker per step (B); the global batch is B*K",
    "fc_batch": "global: FC updated once per step on B*K; worker: after every round on B (b, c)",
    "fc_exchange": "gather (paper: all-gather FC outputs) or colrow (Megatron column/row pairs)",
    "loss": "gathered (all-gather logits) or sharded (class-sharded softmax cross-entropy)",
    "precision": "compute dtype of the trunk and the FC shards, and of the activations they "
                 "exchange: fp32, bf16 or fp16 (float32 weights, optimizer state and loss; fp16 "
                 "with a dynamic loss scale)",
    "steps": "optimizer steps to train (in all, counting those of a resumed run)",
    "epochs": "passes over the training split; when given, overrides --steps",
    "lr_schedule": "constant, step (rates / 10 at --lr-decay-epochs, AlexNet) or cosine",
    "lr_decay_epochs": "comma-separated epochs for the step schedule",
    "warmup_epochs": "linear learning-rate warm-up over this many epochs",
    "lr": "learning rate for a batch of --lr-batch examples; the conv rate is scaled from it "
          "to the global batch, the FC rate to the FC layers' own batch",
    "lr_batch": "the batch --lr is the rate for (the same global batch: the same rates at any K)",
    "lr_scaling": "how a rate grows with its batch: linear, sqrt or none",
    "momentum": "SGD momentum",
    "weight_decay": "L2 weight decay (AlexNet's coupled form)",
    "dropout": "dropout rate after fc6 and fc7",
    "seed": "seed for weights, data order and dropout",
    "eval_every": "validate every N steps (0: only at the end)",
    "jit": "XLA-compile the conv trunk's forward and backward on each device",
    "logdir": "run directory for checkpoints (default runs/<timestamp>); an existing one resumes",
    "checkpoint_every": "save a checkpoint every N steps (0: only at the end)",
    "export_dir": "at the end, export the trained model as a SavedModel to EXPORT_DIR/<n>/, "
                  "n one past the newest version there (TF Serving's model base path)",
    "log_every": "write training scalars to TensorBoard every N steps",
    "histogram_every": "write weight and gradient histograms every N steps (0: never)",
    "profile_steps": "A:B: record a TensorBoard profiler trace of steps A to B",
    "device_type": "auto: K GPUs, fewer GPUs each split into K/G logical GPUs, no GPU: K logical "
                   "CPUs; gpu: the same but no GPU is an error; cpu: logical CPUs even with GPUs",
    "deterministic": "deterministic ops (tf.config.experimental.enable_op_determinism): a run "
                     "killed and resumed ends bit-identical to one never stopped; not with --jit",
    "skip_nonfinite": "undo and skip up to N steps whose loss or gradient is not finite, "
                      "then stop (0: stop at the first)",
    "cluster": "host:port of every worker, comma-separated, for a multi-worker run (default: "
               "TF_CONFIG if set, else one process); every worker runs the same command",
    "task_index": "this worker's place in --cluster (0 is the chief)",
    "verbose": "show TensorFlow's C++ start-up log lines (hidden by default)",
}
TRAIN_CHOICES = {"lr_schedule": LR_SCHEDULES, "scheme": SCHEMES + ("auto",), "fc_batch": FC_BATCH_MODES, "fc_exchange": FC_EXCHANGES,
           "loss": LOSS_MODES, "lr_scaling": LR_SCALINGS, "precision": tuple(PRECISIONS),
           "augment": AUGMENTATIONS, "device_type": DEVICE_TYPES}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are a single line and exit code 2, and an unknown flag close to
    a known one is answered with "did you mean"."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}{self._suggestion(message)}\n")

    def _suggestion(self, message: str) -> str:
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        known = [s for action in self._actions for s in action.option_strings]
        for flag in message[len(prefix):].split():
            close = difflib.get_close_matches(flag.split("=")[0], known, n=1, cutoff=0.75)
            if flag.startswith("--") and close:
                return f" (did you mean {close[0]}?)"
        return ""


def fail(prog: str, message: object) -> int:
    """Prints `PROG: error: MESSAGE` to stderr; returns exit code 2 (bad flags or input)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def device_counts(text: str) -> List[int]:
    """argparse type for a list of K values, e.g. "1,2,4,8" (the plan and study tools)."""
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ks or any(k < 1 for k in ks):
        raise argparse.ArgumentTypeError(f"device counts must be >= 1, got {text!r}")
    return ks


def build_train_parser(description: str = TRAIN_DESCRIPTION) -> argparse.ArgumentParser:
    """`python -m owt_tf.train`'s parser: one flag per RunConfig field, plus --preset."""
    parser = OneLineParser(prog="python -m owt_tf.train", description=description,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = RunConfig()
    for field in dataclasses.fields(RunConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=TRAIN_HELP[field.name])
            continue
        kind = type(default) if default is not None else str
        if field.name == "epochs":
            kind = float
        elif field.name == "task_index":
            kind = int
        parser.add_argument(flag, type=kind, default=default, help=TRAIN_HELP[field.name],
                            choices=TRAIN_CHOICES.get(field.name))
    parser.add_argument("--preset", choices=tuple(PRESETS), default="demo",
                        help="a named recipe; flags given with it override its values")
    return parser


def parse_config(argv: Optional[List[str]] = None) -> RunConfig:
    """Train's flags over the preset's values over RunConfig's defaults (not yet validated)."""
    parser = build_train_parser()
    preset = parser.parse_args(argv).preset
    parser.set_defaults(**PRESETS[preset])
    args = vars(parser.parse_args(argv))
    args.pop("preset")
    return RunConfig(**args)
