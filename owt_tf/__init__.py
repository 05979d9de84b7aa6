"""owt_tf: Krizhevsky's "one weird trick" in TensorFlow 2 / Keras 3.

Conv layers data-parallel (MirroredStrategy), FC layers model-parallel (one shard per
device), activations exchanged with collective ops. Call `setup_devices(K)` before any
other TensorFlow work: logical CPU devices can only be created before the runtime starts.
"""
from owt_tf.devices import setup_devices

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: importing owt_tf must not initialize TensorFlow's runtime before setup_devices.
    if name == "HybridStrategy":
        from owt_tf.parallel.strategy import HybridStrategy
        return HybridStrategy
    if name == "models":
        import owt_tf.models as models
        return models
    if name == "Trainer":
        from owt_tf.training.loop import Trainer
        return Trainer
    raise AttributeError(name)


__all__ = ["setup_devices", "HybridStrategy", "models", "Trainer", "__version__"]
