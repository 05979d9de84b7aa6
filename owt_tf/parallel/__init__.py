"""The parallelism plan: FC shards, schemes, collectives and HybridStrategy. No training loop.

Loads lazily: `owt_tf.planner.plan` is pure Python, so the CLI checks a plan before
TensorFlow is imported.
"""
import importlib

_LAZY = {
    "DistributedModel": "owt_tf.parallel.strategy",
    "HybridStrategy": "owt_tf.parallel.strategy",
    "StepRounds": "owt_tf.planner.plan",
    "Scheme": "owt_tf.planner.plan",
    "ParallelPlan": "owt_tf.planner.plan",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = list(_LAZY)
