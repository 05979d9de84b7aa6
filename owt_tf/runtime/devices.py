"""Devices and the tf.distribute strategy: the one place that decides where replicas run.

K GPUs when the machine has them; fewer GPUs split into K logical GPUs; no GPU: K logical
CPUs carved out of the host CPU (`device_layout`; --device-type chooses explicitly). Logical
devices can only be configured before TensorFlow initializes its runtime, so entry points
call `setup_devices` before anything else touches TensorFlow ops.

One process: MirroredStrategy over the devices. A cluster (owt_tf.runtime.cluster): TensorFlow's
MultiWorkerMirroredStrategy (gRPC collectives, TF_CONFIG-style cluster), with this
worker's D devices as its local replicas; K = W * D.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
from typing import Callable, List, Optional, Sequence, TypeVar

import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy as _mwms

from owt_tf.runtime.cluster import DEVICE_TYPES, Cluster

T = TypeVar("T")


class DeviceError(RuntimeError):
    """The requested device layout cannot be had in this process."""


@dataclasses.dataclass(frozen=True)
class DeviceLayout:
    """Where K replicas go: K physical GPUs, G GPUs each split into `per_gpu` logical GPUs,
    or K logical CPUs."""

    kind: str  # "gpu", "logical_gpu" or "cpu"
    per_gpu: int = 1

    def note(self, k: int, num_gpus: int) -> Optional[str]:
        """The line a run prints when its replicas share a GPU; None otherwise."""
        if self.kind != "logical_gpu":
            return None
        return (f"owt_tf: K={k} on {num_gpus} GPU(s): each split into {self.per_gpu} logical "
                "GPUs that share its compute and memory (right numbers, not K GPUs' speed)")


def device_layout(k: int, num_gpus: int, device_type: str = "auto") -> DeviceLayout:
    """The layout for K replicas on a machine with `num_gpus` GPUs.

    auto: K GPUs when there are that many; fewer (at least one): every GPU split into K/G
    logical GPUs, so no GPU idles while the CPU trains; none: K logical CPUs. gpu: as auto,
    but no GPU is an error. cpu: K logical CPUs whatever the machine has.
    """
    if k < 1:
        raise DeviceError(f"need at least 1 device, got {k}")
    if device_type not in DEVICE_TYPES:
        raise DeviceError(f"device type {device_type!r}: expected one of {', '.join(DEVICE_TYPES)}")
    if device_type == "cpu":
        return DeviceLayout("cpu")
    if num_gpus >= k:
        return DeviceLayout("gpu")
    if num_gpus == 0:
        if device_type == "gpu":
            raise DeviceError(f"{k} GPUs requested but none found (--device-type cpu trains on "
                              "logical CPU devices)")
        return DeviceLayout("cpu")
    if k % num_gpus:
        raise DeviceError(f"K={k} replicas over {num_gpus} GPUs: K must be a multiple of the GPU "
                          "count (each GPU is split into K/G logical GPUs)")
    return DeviceLayout("logical_gpu", k // num_gpus)


def setup_devices(k: int, device_type: str = "auto") -> List[str]:
    """Returns the names of K devices to place replicas on (see `device_layout`), configuring
    logical devices first where the layout needs them.

    Raises DeviceError when the layout cannot be had, or when TensorFlow's runtime was
    already initialized with fewer devices than it needs.
    """
    gpus = tf.config.list_physical_devices("GPU")
    layout = device_layout(k, len(gpus), device_type)
    if layout.kind == "gpu":
        return [f"/device:GPU:{i}" for i in range(k)]
    if layout.kind == "logical_gpu":
        names = logical_gpu_devices(gpus, layout.per_gpu)
        print(layout.note(k, len(gpus)), file=sys.stderr)
        return names
    return logical_cpu_devices(k)


def logical_gpu_devices(gpus: Sequence, per_gpu: int) -> List[str]:
    """Every physical GPU split into `per_gpu` logical GPUs, each given an equal part of its
    memory (TensorFlow needs a memory limit per logical GPU); before TensorFlow initializes.
    MirroredStrategy then picks RING collectives (NCCL cannot run between logical GPUs of one
    device)."""
    for index, gpu in enumerate(gpus):
        existing = tf.config.get_logical_device_configuration(gpu)
        if existing is not None and len(existing) == per_gpu:
            continue
        limit = int(_gpu_memory_mb(index) * 0.9) // per_gpu
        try:
            tf.config.set_logical_device_configuration(
                gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=limit)] * per_gpu)
        except RuntimeError as err:  # runtime already initialized
            raise DeviceError(f"{per_gpu} logical GPUs per GPU requested but TensorFlow was "
                              "already initialized; call owt_tf.setup_devices before any "
                              "TensorFlow op") from err
    return [f"/device:GPU:{i}" for i in range(len(gpus) * per_gpu)]


def _gpu_memory_mb(index: int) -> int:
    """GPU `index`'s memory in MiB, from nvidia-smi (TensorFlow reports it only once its
    runtime is up, and then logical devices can no longer be configured)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits",
                              "-i", str(index)], capture_output=True, text=True, timeout=30, check=True)
        return int(out.stdout.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as err:
        raise DeviceError(f"cannot read GPU {index}'s memory with nvidia-smi ({err}); split GPUs "
                          "need it: use --devices <number of GPUs> or --device-type cpu") from None


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
