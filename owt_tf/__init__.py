"""owt_tf: Krizhevsky's "one weird trick" in TensorFlow 2 / Keras 3.

Conv layers data-parallel (MirroredStrategy), FC layers model-parallel (one shard per
device), activations exchanged with collective ops. Call `setup_devices(K)` before any
other TensorFlow work: logical CPU devices can only be created before the runtime starts.

Everything here loads lazily, so `import owt_tf` (and a CLI rejecting a bad flag) does not
import TensorFlow.
"""
import importlib

__version__ = "0.1.0"

_LAZY = {
    "setup_devices": "owt_tf.runtime.devices",
    "HybridStrategy": "owt_tf.parallel.strategy",
    "parallelize": "owt_tf.fit.parallelize",
    "ParallelModel": "owt_tf.fit.model",
    "fit_dataset": "owt_tf.fit.named_datasets",
    "ParallelPlan": "owt_tf.planner.plan",
    "Trainer": "owt_tf.training.loop",
    "RunConfig": "owt_tf.config",
}


def __getattr__(name):
    if name == "models":
        return importlib.import_module("owt_tf.models")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = ["setup_devices", "HybridStrategy", "parallelize", "ParallelModel", "ParallelPlan",
           "fit_dataset", "models", "Trainer", "RunConfig", "__version__"]
