"""Which cluster this process belongs to: TF_CONFIG, or --cluster / --task-index.

Pure Python (no TensorFlow import), so that flags can be checked before TensorFlow loads.
A cluster has W worker tasks; every worker runs the same command with D devices, so a run
has K = W * D replicas. Global replica order is MultiWorkerMirroredStrategy's: task by
task (a `chief` task first when there is one), devices in order within a task; FC shard
j lives on global replica j's device.

    TF_CONFIG='{"cluster": {"worker": ["host1:2222", "host2:2222"]},
                "task": {"type": "worker", "index": 0}}'

TensorFlow's convention: with a `chief` task it is the chief, else worker 0 is; only the
chief writes checkpoints and TensorBoard files.

A task that never starts: TensorFlow's cluster registration would wait for it for its own
default timeout, silently. `watch_peers_start` bounds that wait (OWT_TF_JOIN_TIMEOUT_S,
default 120 s): every task's gRPC server listens as soon as the task builds its strategy,
so a peer address that accepts no connection by then names the missing task, and the
waiting worker is ended.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Mapping, Optional, Tuple

TASK_TYPES = ("chief", "worker")
# --device-type: the kind of device each worker's replicas go on (owt_tf.runtime.devices.device_layout).
DEVICE_TYPES = ("auto", "gpu", "cpu")
JOIN_TIMEOUT_ENV = "OWT_TF_JOIN_TIMEOUT_S"
DEFAULT_JOIN_TIMEOUT_S = 120.0


class ClusterError(ValueError):
    """TF_CONFIG or --cluster / --task-index do not describe a usable cluster."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The tasks of a multi-worker run and which one this process is."""

    jobs: Tuple[Tuple[str, Tuple[str, ...]], ...]  # (task type, addresses), chief first
    task_type: str
    task_index: int

    @property
    def tasks(self) -> List[Tuple[str, int]]:
        """Every task in global order: (type, index)."""
        return [(job, i) for job, addresses in self.jobs for i in range(len(addresses))]

    @property
    def num_workers(self) -> int:
        return len(self.tasks)

    @property
    def worker_id(self) -> int:
        """This task's place in the global order (MultiWorkerMirroredStrategy's id_in_cluster)."""
        return self.tasks.index((self.task_type, self.task_index))

    @property
    def is_chief(self) -> bool:
        return self.worker_id == 0

    def task_name_of(self, worker_id: int) -> str:
        job, index = self.tasks[worker_id]
        return f"/job:{job}/task:{index}"

    def spec(self) -> Dict[str, List[str]]:
        return {job: list(addresses) for job, addresses in self.jobs}

    def peers(self) -> List[Tuple[str, str]]:
        """(task name, host:port) of every other task."""
        addresses = [a for _, group in self.jobs for a in group]
        return [(self.task_name_of(w), addresses[w]) for w in range(self.num_workers)
                if w != self.worker_id]


def join_timeout_s(environ: Mapping[str, str] = os.environ) -> float:
    """How long a worker waits for every other task to start (OWT_TF_JOIN_TIMEOUT_S)."""
    text = environ.get(JOIN_TIMEOUT_ENV, "").strip()
    try:
        value = float(text) if text else DEFAULT_JOIN_TIMEOUT_S
    except ValueError:
        raise ClusterError(f"{JOIN_TIMEOUT_ENV}: expected seconds, got {text!r}") from None
    if value <= 0:
        raise ClusterError(f"{JOIN_TIMEOUT_ENV}: must be > 0, got {text!r}")
    return value


def _listening(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def watch_peers_start(cluster: Cluster, timeout_s: float, prefix: str = "") -> subprocess.Popen:
    """Starts a watcher process that ends this one (one line on stderr, then SIGKILL) when
    some task of the cluster has not started within `timeout_s`; the watcher exits quietly
    once every task listens, or when this process ends.

    A process, not a thread: TensorFlow blocks in cluster registration inside a call that
    holds the GIL (no other Python thread runs; measured), and the process ignores SIGTERM
    meanwhile, so only SIGKILL ends it. Nothing but the logdir lock is written before then."""
    job = json.dumps({"parent": os.getpid(), "timeout_s": timeout_s, "peers": cluster.peers(),
                      "prefix": prefix})
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; from owt_tf.runtime.cluster import _watch; _watch(sys.argv[1])",
         job], stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=path))


def _watch(job_json: str) -> None:
    """The watcher process of `watch_peers_start`."""
    job = json.loads(job_json)
    parent, peers = job["parent"], [tuple(p) for p in job["peers"]]
    deadline = time.monotonic() + job["timeout_s"]
    while peers:
        if os.getppid() != parent:  # the worker ended (we were re-parented)
            return
        peers = [(task, address) for task, address in peers if not _listening(address)]
        if not peers:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    names = ", ".join(f"{task} ({address})" for task, address in peers)
    print(f"{job['prefix']}{'task' if len(peers) == 1 else 'tasks'} {names} did not start "
          f"within {job['timeout_s']:g} s (nothing accepts connections there; the bound is "
          f"{JOIN_TIMEOUT_ENV}); stopped this worker; start every worker with the same "
          "command", file=sys.stderr, flush=True)
    os.kill(parent, signal.SIGKILL)


def parse_cluster_flags(cluster: str, task_index: Optional[int]) -> Cluster:
    """--cluster host:port,host:port --task-index i: a cluster of worker tasks."""
    addresses = tuple(a.strip() for a in cluster.split(",") if a.strip())
    if not addresses:
        raise ClusterError("--cluster: expected host:port,host:port,...")
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ClusterError(f"--cluster: {address!r} is not host:port")
    if len(set(addresses)) != len(addresses):
        raise ClusterError(f"--cluster: an address appears twice in {cluster!r}")
    if task_index is None:
        raise ClusterError("--task-index: needed with --cluster (this worker's place in it)")
    if not 0 <= task_index < len(addresses):
        raise ClusterError(f"--task-index: must be in 0..{len(addresses) - 1}, got {task_index}")
    return Cluster((("worker", addresses),), "worker", task_index)


def parse_tf_config(text: str) -> Cluster:
    """TensorFlow's TF_CONFIG JSON (cluster of chief/worker tasks, and this task)."""
    try:
        config = json.loads(text)
        spec, task = config["cluster"], config["task"]
        task_type, task_index = task["type"], int(task["index"])
    except (ValueError, KeyError, TypeError) as err:
        raise ClusterError(f"TF_CONFIG: expected {{\"cluster\": {{...}}, \"task\": {{\"type\": ..., "
                           f"\"index\": ...}}}}, got {text!r} ({err})") from None
    unknown = set(spec) - set(TASK_TYPES)
    if unknown:
        raise ClusterError(f"TF_CONFIG: task types {sorted(unknown)} are not supported "
                           f"(owt_tf trains with {' and '.join(TASK_TYPES)} tasks only)")
    if len(spec.get("chief", [])) > 1:
        raise ClusterError("TF_CONFIG: at most one chief task")
    jobs = tuple((job, tuple(spec[job])) for job in TASK_TYPES if spec.get(job))
    if not jobs:
        raise ClusterError("TF_CONFIG: the cluster has no chief or worker task")
    if task_type not in spec or not 0 <= task_index < len(spec[task_type]):
        raise ClusterError(f"TF_CONFIG: task {task_type}:{task_index} is not in the cluster")
    return Cluster(jobs, task_type, task_index)


def resolve_cluster(cluster_flag: Optional[str] = None, task_index: Optional[int] = None,
                    environ: Mapping[str, str] = os.environ) -> Optional[Cluster]:
    """The cluster named by the flags, else by TF_CONFIG; None for a one-process run."""
    if cluster_flag:
        return parse_cluster_flags(cluster_flag, task_index)
    if task_index is not None:
        raise ClusterError("--task-index: only meaningful with --cluster")
    text = environ.get("TF_CONFIG", "").strip()
    if not text:
        return None
    cluster = parse_tf_config(text)
    return cluster if cluster.num_workers > 1 else None  # one task: a plain local run
