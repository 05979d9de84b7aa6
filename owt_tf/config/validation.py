"""Whether a run's configuration can work, checked before anything is built: the first bad
flag or combination raises ConfigError in one line naming the flag.

Reads the config only (and whether --dataset folder:PATH and --export-dir exist). Pure
Python: no TensorFlow.
"""
from __future__ import annotations

import math
import os

from owt_tf.config.flags import (ConfigError, as_flag_error, check_choice, check_decay_epochs,
                                 check_positive_int, check_profile_steps, flag_text)
from owt_tf.config.sections import FLAG_FIELDS, MARGIN_OBJECTIVES, flag_metadata
from owt_tf.data import DATASET_PREFIXES, dataset_forms, dataset_prefix
from owt_tf.models.face import MARGIN_RANGES
from owt_tf.planner.plan import AUTO, Scheme, check_auto_processes, sampling_problem, widths_problem


# Datasets held in memory and never augmented.
IN_MEMORY = ("digits", "synthetic", "faces")


def validate_config(config) -> None:
    """Raises ConfigError for the first invalid field of the RunConfig `config`."""
    plan = config.parallel.plan()
    for name, (section, field) in FLAG_FIELDS.items():
        choices = flag_metadata(name)["choices"]
        if choices:
            check_choice(flag_text(name), getattr(getattr(config, section), field), choices)
    check_optimizer(config)
    check_model_and_data(config)
    check_objective(config)
    p = config.parallel
    check_positive_int("--devices", p.devices)
    check_positive_int("--batch-size", p.batch_size)
    check_positive_int("--steps", config.run.steps)
    k = config.num_replicas
    with as_flag_error():
        plan.check_devices(k).check_batch(k, p.batch_size)
    with as_flag_error():
        check_auto_processes(p.scheme, config.num_workers)
    check_sampling(config)
    check_model_fits(config)
    check_run(config)


def check_sampling(config) -> None:
    """--sample-rate < 1 needs the loss on the shards, so a scheme that keeps it there."""
    p = config.parallel
    problem = sampling_problem(p.sample_rate, p.loss == "sharded" and p.scheme != AUTO)
    if problem:
        raise ConfigError("--sample-rate", f"{problem}: needs --loss sharded (and a "
                          "--scheme, not auto)")


def check_optimizer(config) -> None:
    o = config.optimizer
    check_decay_epochs(o.lr_decay_epochs)
    if not (math.isfinite(o.warmup_epochs) and o.warmup_epochs >= 0):
        raise ConfigError("--warmup-epochs", f"must be >= 0, got {o.warmup_epochs}")
    check_positive_int("--lr-batch", o.lr_batch)
    for flag_name, value in (("--lr", o.lr), ("--weight-decay", o.weight_decay)):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(flag_name, f"must be a finite number >= 0, got {value}")
    if not 0.0 <= o.momentum < 1.0:
        raise ConfigError("--momentum", f"must be in [0, 1), got {o.momentum}")


def check_model_and_data(config) -> None:
    from owt_tf.models.registry import MODEL_NAMES
    from owt_tf.models.user import UserModelError, check_user_model_name, is_user_model

    model, dataset, augment = config.model.model, config.data.dataset, config.data.augment
    if is_user_model(model):
        try:
            check_user_model_name(model)
        except UserModelError as err:
            raise ConfigError("--model", str(err)) from None
        if config.parallel.precision != "fp32":
            raise ConfigError("--precision", "a user's model computes in its own Keras dtype "
                              "policy; build it under keras.config.set_dtype_policy("
                              "'mixed_bfloat16') instead")
    else:
        check_choice("--model", model, MODEL_NAMES + ("PATH.keras", "module:function"))
    if not 0.0 <= config.model.dropout < 1.0:
        raise ConfigError("--dropout", f"must be in [0, 1), got {config.model.dropout}")
    check_dataset(dataset)
    if config.data.classes is not None:
        if dataset != "synthetic":
            raise ConfigError("--classes", f"{dataset} has its own classes; --classes sets "
                              "those of --dataset synthetic")
        if config.data.classes < 2:
            raise ConfigError("--classes", f"must be >= 2, got {config.data.classes}")
    if dataset in IN_MEMORY and augment not in ("auto", "none"):
        raise ConfigError("--augment", f"{dataset} is held in memory and never "
                          "augmented; use a folder:, tfds: or imagenet2012 dataset")


def check_objective(config) -> None:
    """--objective, --margin, --scale and --embedding-dim: a margin softmax needs a cosine
    class layer (a face model, or the user's ending in NormalizedDense: checked when it is
    loaded) and the loss on the shards; the embedding width is a face model's."""
    from owt_tf.models.registry import EMBEDDING_MODELS
    from owt_tf.models.user import is_user_model

    m, p = config.model, config.parallel
    user = is_user_model(m.model)
    if m.embedding_dim is not None:
        if user or m.model not in EMBEDDING_MODELS:
            raise ConfigError("--embedding-dim", f"model {m.model} has no embedding to size; "
                              f"it is for {', '.join(EMBEDDING_MODELS)}")
        check_positive_int("--embedding-dim", m.embedding_dim)
    if not (math.isfinite(m.scale) and m.scale > 0):
        raise ConfigError("--scale", f"must be a number > 0, got {m.scale}")
    if not 0 <= m.interclass_filtering_threshold < 1:  # NaN fails too
        raise ConfigError("--interclass-filtering-threshold",
                          f"must be in [0, 1), got {m.interclass_filtering_threshold}")
    if m.interclass_filtering_threshold and m.margin_value is None:
        raise ConfigError("--interclass-filtering-threshold", "filters a margin softmax's "
                          "cosines: needs --objective arcface or cosface")
    if m.objective not in MARGIN_OBJECTIVES:
        if m.margin is not None:
            raise ConfigError("--margin", f"is the margin of --objective arcface or cosface, "
                              f"not {m.objective}")
        return
    low, high = MARGIN_RANGES[m.objective]
    if not low <= m.margin_value < high:  # NaN fails too
        raise ConfigError("--margin", f"{m.objective}'s margin must be in [{low:g}, "
                          f"{high:.4g}), got {m.margin_value}")
    if not user and m.model not in EMBEDDING_MODELS:
        raise ConfigError("--objective", f"{m.objective} trains a cosine class layer on an "
                          f"embedding: use a face model ({', '.join(EMBEDDING_MODELS)}) or "
                          "your own ending in owt_tf.layers.NormalizedDense, not "
                          f"{m.model}")
    if p.loss != "sharded" or p.scheme == AUTO:
        raise ConfigError("--objective", f"{m.objective} puts its margin on the shard that "
                          "holds the label: add --loss sharded (and a --scheme, not auto)")


def check_dataset(dataset: str) -> None:
    """A known name, or PREFIX:ARG of the registry (owt_tf.data): a NAME, or an existing
    directory."""
    prefix, argument = dataset_prefix(dataset)
    if prefix is None:
        check_choice("--dataset", dataset, dataset_forms())
    elif not argument:
        raise ConfigError("--dataset", f"{prefix}:{DATASET_PREFIXES[prefix]} needs a "
                          f"{'dataset name' if DATASET_PREFIXES[prefix] == 'NAME' else 'directory'}")
    elif DATASET_PREFIXES[prefix] != "NAME" and not os.path.isdir(argument):
        raise ConfigError("--dataset", f"{dataset}: no such directory")


def check_model_fits(config) -> None:
    """FC widths must split evenly over the devices (class counts are padded instead).
    A user's model is checked when it is loaded (Trainer)."""
    from owt_tf.models.registry import FC_WIDTHS

    p = config.parallel
    if p.scheme == AUTO or not Scheme(p.scheme).model_parallel or config.model.model not in FC_WIDTHS:
        return
    widths = FC_WIDTHS[config.model.model]
    names = [f"model {config.model.model}'s FC layer {i + 1}" for i in range(len(widths))]
    problem = widths_problem(widths, config.num_replicas, names)
    if problem:
        raise ConfigError("--devices", problem)


def check_run(config) -> None:
    from owt_tf.models.user import is_user_model

    r = config.run
    if r.epochs is not None and not (math.isfinite(r.epochs) and r.epochs > 0):
        raise ConfigError("--epochs", f"must be a number > 0, got {r.epochs}")
    if r.export_dir and os.path.exists(r.export_dir) and not os.path.isdir(r.export_dir):
        raise ConfigError("--export-dir", f"{r.export_dir} exists and is not a directory")
    if r.embeddings_only and not r.export_dir:
        raise ConfigError("--embeddings-only", "shapes the export: add --export-dir DIR")
    # A user's model is checked when it is loaded (Trainer): its class layer says.
    if (r.embeddings_only and config.model.objective not in MARGIN_OBJECTIVES
            and not is_user_model(config.model.model)):
        raise ConfigError("--embeddings-only", "exports the input of a cosine class layer: "
                          "train with --objective arcface or cosface")
    for flag_name, value in (("--log-every", r.log_every), ("--histogram-every", r.histogram_every),
                             ("--checkpoint-every", r.checkpoint_every),
                             ("--eval-every", r.eval_every),
                             ("--skip-nonfinite", r.skip_nonfinite)):
        if value < 0:
            raise ConfigError(flag_name, f"must be >= 0, got {value}")
    if r.profile_steps is not None:
        check_profile_steps(r.profile_steps)
    if r.deterministic and config.parallel.jit:
        # XLA has no deterministic MaxPoolGrad: TF raises on the first step otherwise.
        raise ConfigError("--deterministic", "cannot be combined with --jit (XLA's max-pool "
                          "gradient is not deterministic); drop one of them")
    if r.logdir is None and config.num_workers > 1:
        raise ConfigError("--logdir", "a multi-worker run needs one, the same on every "
                          "worker (python -m owt_tf.launch picks one when not given)")
