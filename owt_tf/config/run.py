"""The one configuration object of a run: RunConfig, its sections (owt_tf.config.sections)
together, built and changed by flag name, and the values derived from them (K, the global
batch, each layer kind's learning rate).

    RunConfig.from_flags(devices=4, scheme="owt-a")    the defaults with these flags
    config.replace(devices=4)                          a copy with these flags changed
    config.validate()                                  the first bad flag, in one line

The cluster (--cluster, else TF_CONFIG) is resolved once, when a config is made from flags.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Dict, Mapping

from owt_tf.runtime.cluster import ClusterError, resolve_cluster
from owt_tf.config.flags import ConfigError
from owt_tf.config.sections import (FLAG_FIELDS, LR_SCALINGS, ClusterConfig, DataConfig,
                                    ModelConfig, OptimizerConfig, ParallelConfig, RunIOConfig,
                                    flag_metadata)
from owt_tf.config.validation import validate_config


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
            parse = flag_metadata(name).get("parse")
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
        validate_config(self)
        return self


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
