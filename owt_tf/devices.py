"""Devices and the tf.distribute strategy: the one place that decides where replicas run.

K GPUs when the machine has them, else K logical CPUs carved out of the host CPU. Logical
devices can only be configured before TensorFlow initializes its runtime, so entry points
call `setup_devices` before anything else touches TensorFlow ops.

One process: MirroredStrategy over the devices. A cluster (owt_tf.cluster): TensorFlow's
MultiWorkerMirroredStrategy (gRPC collectives, TF_CONFIG-style cluster), with this
worker's D devices as its local replicas; K = W * D.
"""
from __future__ import annotations

import threading
from typing import Callable, List, Sequence, TypeVar

import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy as _mwms

from owt_tf.cluster import Cluster

T = TypeVar("T")


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


def replica_devices(cluster: Cluster, local_devices: Sequence[str]) -> List[str]:
    """Every replica's device in global order: each task's local devices, task by task."""
    return [f"{cluster.task_name_of(w)}{device}" for w in range(cluster.num_workers)
            for device in local_devices]


def make_multiworker_strategy(cluster: Cluster,
                              local_devices: Sequence[str]) -> tf.distribute.MultiWorkerMirroredStrategy:
    """MultiWorkerMirroredStrategy over the cluster, with `local_devices` on this worker.

    Starts this task's gRPC server; collectives then wait for every task of the cluster.
    """
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.spec()), task_type=cluster.task_type,
        task_id=cluster.task_index, rpc_layer="grpc")
    _configure_coordination(cluster)
    try:
        return _LocalDevicesMultiWorkerStrategy(resolver, list(local_devices))
    except RuntimeError as err:
        if "configured at program startup" not in str(err):
            raise
        raise DeviceError("a multi-worker strategy must be built before any TensorFlow op "
                          "runs in the process") from err


# How long a task may stop answering before the coordination service declares it dead and
# every other task's collectives are aborted (the default of 10 s is kept, said here).
HEARTBEAT_TIMEOUT_S = 10


def _configure_coordination(cluster: Cluster) -> None:
    """TensorFlow's coordination service as MultiWorkerMirroredStrategy would configure it
    (it does so only when nobody has), with its heartbeat timeout said here. No shutdown
    barrier: a finished worker ends without TF's teardown (owt_tf.train.exit_worker)."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    first_job, _ = cluster.jobs[0]
    context.context().configure_coordination_service(
        service_type="standalone", service_leader=f"/job:{first_job}/replica:0/task:0",
        heartbeat_timeout_in_ms=HEARTBEAT_TIMEOUT_S * 1000,
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(addr))
                          for job, addr in cluster.jobs])


class _LocalDevicesExtended(_mwms.CollectiveAllReduceExtended):
    """Stock MultiWorkerMirroredStrategy gives a worker without GPUs exactly one replica
    (`_initialize_local_devices`: `num_local_devices = 1` for CPU), whatever logical CPU
    devices exist, so D > 1 logical CPUs per worker cannot be had with it. The rest of the
    strategy (group size = W * local devices, replica ids task by task) is general; only
    the local device list is ours."""

    def __init__(self, container_strategy, cluster_resolver, communication_options,
                 local_devices: Sequence[str]):
        self._owt_local_devices = [tf.DeviceSpec.from_string(d) for d in local_devices]
        super().__init__(container_strategy, cluster_resolver, communication_options)

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        names = tuple(f"{worker_device}/device:{d.device_type}:{d.device_index}"
                      for d in self._owt_local_devices)
        return names, self._owt_local_devices[0].device_type


class _LocalDevicesMultiWorkerStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """MultiWorkerMirroredStrategy whose workers each replicate over given local devices."""

    def __init__(self, cluster_resolver, local_devices: Sequence[str]):
        options = tf.distribute.experimental.CommunicationOptions()
        # tf.distribute.Strategy's own constructor, with our extended object in place of
        # the one MultiWorkerMirroredStrategy.__init__ would build.
        tf.distribute.Strategy.__init__(
            self, _LocalDevicesExtended(self, cluster_resolver, options, local_devices))


def outside_strategy_scope(make: Callable[[], T]) -> T:
    """Runs `make()` outside any tf.distribute scope the caller is in, and returns its result.

    Variables created inside `strategy.scope()` are mirrored and ignore `tf.device`
    (tensorflow/tensorflow#56416), but an FC shard must be one plain variable on one device,
    and users call `owt_tf.parallelize` inside the scope. The scope (like TF's variable
    creator stack) is per thread, so `make` runs in a thread of its own.
    """
    result: dict = {}

    def run():
        try:
            result["value"] = make()
        except BaseException as err:  # re-raised in the caller's thread
            result["error"] = err

    worker = threading.Thread(target=run, name="owt_tf-outside-scope")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
