"""A run's configuration: one RunConfig in sections, every CLI flag declared once.

    flags.py       how a flag is declared and parsed; ConfigError
    sections.py    the sections (model, data, parallel, optimizer, run, cluster)
    run.py         RunConfig: the sections together, by flag name, and derived values
    validation.py  the checks `RunConfig.validate()` runs
    presets.py     named recipes (--preset)

Pure Python: the CLI checks its flags before TensorFlow loads.
"""
from owt_tf.config.flags import ConfigError
from owt_tf.config.presets import PRESETS, demo, faces, imagenet_paper
from owt_tf.config.run import RunConfig, lr_scale, new_run_dir
from owt_tf.config.sections import (AUGMENTATIONS, FLAG_FIELDS, LR_SCALINGS, LR_SCHEDULES,
                                    SECTIONS, ClusterConfig, DataConfig, ModelConfig,
                                    OptimizerConfig, ParallelConfig, RunIOConfig, flag_fields)
from owt_tf.planner.plan import (AUTO, FC_BATCH_MODES, FC_EXCHANGES, LOSS_MODES, PRECISIONS,
                                 SCHEMES)

__all__ = ["ConfigError", "PRESETS", "demo", "faces", "imagenet_paper", "RunConfig", "lr_scale",
           "new_run_dir", "AUGMENTATIONS", "FLAG_FIELDS", "LR_SCALINGS", "LR_SCHEDULES",
           "SECTIONS", "ClusterConfig", "DataConfig", "ModelConfig", "OptimizerConfig",
           "ParallelConfig", "RunIOConfig", "flag_fields", "AUTO", "FC_BATCH_MODES",
           "FC_EXCHANGES", "LOSS_MODES", "PRECISIONS", "SCHEMES"]
