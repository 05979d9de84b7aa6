"""`python -m owt_tf.train`: train a CNN with the hybrid scheme. No flags: the demo run.

Every flag is a field of owt_tf.config.RunConfig. Bad flags fail in one line, exit code 2,
before anything is built.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from typing import List, Optional

from owt_tf.config import (AUGMENTATIONS, FC_BATCH_MODES, FC_EXCHANGES, LOSS_MODES, LR_SCALINGS,
                           LR_SCHEDULES, PRESETS, SCHEMES, ConfigError, RunConfig, new_run_dir,
                           DEVICE_TYPES)
from owt_tf.startup import start_tensorflow

HELP = {
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
    "scheme": "single | data (pure data parallel) | owt-a | owt-b | owt-c (docs/paper.md)",
    "batch_size": "examples per worker per step (B); the global batch is B*K",
    "fc_batch": "global: FC updated once per step on B*K; worker: after every round on B (b, c)",
    "fc_exchange": "gather (paper: all-gather FC outputs) or colrow (Megatron column/row pairs)",
    "loss": "gathered (all-gather logits) or sharded (class-sharded softmax cross-entropy)",
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
CHOICES = {"lr_schedule": LR_SCHEDULES, "scheme": SCHEMES, "fc_batch": FC_BATCH_MODES, "fc_exchange": FC_EXCHANGES,
           "loss": LOSS_MODES, "lr_scaling": LR_SCALINGS,
           "augment": AUGMENTATIONS, "device_type": DEVICE_TYPES}


# Exit codes: 0 done, 2 bad flags or input (nothing written), 3 non-finite loss or gradient,
# 4 a checkpoint could not be written, 5 another worker of the cluster is gone (restart all
# to resume), 128+N ended by signal N after saving a checkpoint.
EXIT_NONFINITE = 3
EXIT_WRITE = 4
EXIT_WORKER_LOST = 5


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


def device_counts(text: str) -> List[int]:
    """argparse type for a list of K values, e.g. "1,2,4,8" (the plan and study tools)."""
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ks or any(k < 1 for k in ks):
        raise argparse.ArgumentTypeError(f"device counts must be >= 1, got {text!r}")
    return ks


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m owt_tf.train", description=__doc__,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = RunConfig()
    for field in dataclasses.fields(RunConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=HELP[field.name])
            continue
        kind = type(default) if default is not None else str
        if field.name == "epochs":
            kind = float
        elif field.name == "task_index":
            kind = int
        parser.add_argument(flag, type=kind, default=default, help=HELP[field.name],
                            choices=CHOICES.get(field.name))
    parser.add_argument("--preset", choices=tuple(PRESETS), default="demo",
                        help="a named recipe; flags given with it override its values")
    return parser


def parse_config(argv: Optional[List[str]] = None) -> RunConfig:
    """Flags over the preset's values over RunConfig's defaults."""
    parser = build_parser()
    preset = parser.parse_args(argv).preset
    parser.set_defaults(**PRESETS[preset])
    args = vars(parser.parse_args(argv))
    args.pop("preset")
    return RunConfig(**args)


def _fail(message) -> int:
    print(f"python -m owt_tf.train: error: {message}", file=sys.stderr)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    config = parse_config(argv)
    try:
        config.validate()
    except ConfigError as err:
        return _fail(err)
    try:
        watch_cluster_start(config)
    except ValueError as err:  # ClusterError: a bad OWT_TF_JOIN_TIMEOUT_S
        return _fail(err)
    if config.logdir is None:
        config = config.replace(logdir=new_run_dir())
    print(run_banner(config), flush=True)
    # TensorFlow loads only now, after the flags were found good.
    start_tensorflow(config.verbose)
    from owt_tf.data.datasets import DatasetError
    from owt_tf.training.checkpoint import CheckpointMismatch, NoReadableCheckpoint
    from owt_tf.training.loop import Trainer
    from owt_tf.training.rundir import RunDirBusy

    from owt_tf.training.checkpoint import CheckpointWriteError
    from owt_tf.training.guard import Interrupted, NonFiniteError, WorkerLost

    try:
        trainer = Trainer(config)
    except (ConfigError, CheckpointMismatch, DatasetError, RunDirBusy, NoReadableCheckpoint) as err:
        return _fail(err)
    code = 0
    try:
        trainer.fit()
    except Interrupted as stop:
        print(f"python -m owt_tf.train: {stop}", file=sys.stderr)
        code = 128 + stop.signum  # the shell's convention for "ended by this signal"
    except NonFiniteError as err:
        print(f"python -m owt_tf.train: error: {err}", file=sys.stderr)
        code = EXIT_NONFINITE
    except CheckpointWriteError as err:
        print(f"python -m owt_tf.train: error: {err}", file=sys.stderr)
        code = EXIT_WRITE
    except WorkerLost as err:
        print(f"python -m owt_tf.train: error: {err}", file=sys.stderr)
        code = EXIT_WORKER_LOST
    if trainer.hybrid.num_workers > 1:
        exit_worker(code)
    return code


def run_banner(config: RunConfig) -> str:
    """What the run trains, where it writes and how to watch it: printed before TensorFlow
    starts, so that a user sees it at once."""
    workers = config.num_workers
    k = config.devices * workers
    spread = f"{config.devices} devices x {workers} workers" if workers > 1 else f"{k} devices"
    return (f"python -m owt_tf.train: {config.model} on {config.dataset} | K={k} ({spread}) | "
            f"{config.scheme} | global batch {config.global_batch_size}\n"
            f"  writing to {config.logdir} (checkpoints, TensorBoard); watch it with: "
            f"tensorboard --logdir {config.logdir}")


def watch_cluster_start(config: RunConfig) -> None:
    """In a cluster: a watcher process ends this worker (one line naming the missing tasks,
    then SIGKILL) when some task has not started within the join bound, instead of waiting
    on TensorFlow's cluster registration for its default timeout."""
    from owt_tf.cluster import join_timeout_s, watch_peers_start

    cluster = config.resolved_cluster()
    if cluster is not None:
        watch_peers_start(cluster, join_timeout_s(), prefix="python -m owt_tf.train: error: ")


def exit_worker(code: int) -> None:
    """Ends a multi-worker process now, skipping TensorFlow's teardown. That teardown can
    stall a worker for tens of seconds after the run, and a worker that outlives another
    logs "Failed to send RPC to coordination service" / "tasks have crashed" from its
    heartbeat (tensorflow/tensorflow#58434). Everything of the run is written by now
    (checkpoints and exports synchronously, TensorBoard closed). Python's own exit
    handlers still run (autograph removes its temporary files in one)."""
    import atexit

    atexit._run_exitfuncs()  # noqa: SLF001 -- what sys.exit would run, without the C++ teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
