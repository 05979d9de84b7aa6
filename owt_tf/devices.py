"""Devices and the tf.distribute strategy: the one place that decides where replicas run.

K GPUs when the machine has them, else K logical CPUs carved out of the host CPU. Logical
devices can only be configured before TensorFlow initializes its runtime, so entry points
call `setup_devices` before anything else touches TensorFlow ops.
"""
from __future__ import annotations

from typing import List, Sequence

import tensorflow as tf


class DeviceError(RuntimeError):
    """The requested device layout cannot be had in this process."""


def setup_devices(k: int, allow_cpu_devices: bool = True) -> List[str]:
    """Returns the names of K devices to place replicas on (GPUs first, else logical CPUs).

    Raises DeviceError when fewer than K GPUs exist and logical CPUs are not allowed, or
    when TensorFlow's runtime was already initialized with fewer than K CPU devices.
    """
    if k < 1:
        raise DeviceError(f"need at least 1 device, got {k}")
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= k:
        return [f"/device:GPU:{i}" for i in range(k)]
    if gpus and not allow_cpu_devices:
        raise DeviceError(
            f"{k} GPUs requested but only {len(gpus)} found; allow logical CPU devices to "
            "run anyway"
        )
    if not gpus and not allow_cpu_devices:
        raise DeviceError(f"{k} GPUs requested but none found and logical CPUs were not allowed")
    return logical_cpu_devices(k)


def logical_cpu_devices(k: int) -> List[str]:
    """K logical CPU devices carved out of the host CPU (before TensorFlow initializes)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    existing = tf.config.get_logical_device_configuration(cpu)
    if existing is None or len(existing) < k:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * max(k, 1)
            )
        except RuntimeError as err:  # runtime already initialized
            have = len(tf.config.list_logical_devices("CPU"))
            if have < k:
                raise DeviceError(
                    f"{k} logical CPU devices requested but TensorFlow was already initialized "
                    f"with {have}; call owt_tf.setup_devices({k}) before any TensorFlow op"
                ) from err
    return [f"/device:CPU:{i}" for i in range(k)]


def make_strategy(devices: Sequence[str]) -> tf.distribute.MirroredStrategy:
    """MirroredStrategy over exactly these devices (RING collectives on CPU, NCCL on GPU)."""
    devices = list(devices)
    if not devices:
        raise DeviceError("make_strategy needs at least one device")
    # Over CPU-only device lists MirroredStrategy picks CollectiveAllReduce (RING), which
    # gives ReplicaContext.all_gather; over GPUs it uses NCCL.
    return _with_fresh_collective_keys(lambda: tf.distribute.MirroredStrategy(devices))


_strategies_made = 0


def _with_fresh_collective_keys(make):
    """Every MirroredStrategy starts its collective group keys at the same number, so a second
    strategy over the same devices in one process reuses the first one's collective instances
    and aborts with "Shape mismatch in the collective instance 100"
    (tensorflow/tensorflow#62790). The class attribute that offsets the keys is read once,
    when the strategy is built; give each strategy its own range."""
    global _strategies_made
    _strategies_made += 1
    cls = tf.distribute.MirroredStrategy
    saved = cls._collective_key_base
    cls._collective_key_base = _strategies_made * 100_000
    try:
        return make()
    finally:
        cls._collective_key_base = saved
