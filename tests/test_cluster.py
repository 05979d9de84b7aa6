"""Cluster resolution (TF_CONFIG, --cluster/--task-index) and the launcher's pure parts."""
import json
import os

import pytest
from tensorflow.python.distribute import multi_worker_util

from owt_tf import launch
from owt_tf.runtime.cluster import ClusterError, parse_tf_config, resolve_cluster
from owt_tf.config import RunConfig
from owt_tf.runtime.devices import replica_devices

WORKERS = ["10.0.0.1:2222", "10.0.0.2:2222", "10.0.0.3:2222"]


def _tf_config(cluster, task_type, index):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


@pytest.mark.parametrize("cluster,task", [
    ({"worker": WORKERS}, ("worker", 2)),
    ({"chief": ["10.0.0.9:2222"], "worker": WORKERS}, ("worker", 0)),
    ({"chief": ["10.0.0.9:2222"], "worker": WORKERS}, ("chief", 0)),
])
def test_worker_order_is_multiworker_mirrored_strategys(cluster, task):
    """Global replica order must be TensorFlow's (id_in_cluster), or shard j would not sit on
    replica j's device."""
    got = parse_tf_config(_tf_config(cluster, *task))
    assert got.worker_id == multi_worker_util.id_in_cluster(cluster, *task)
    assert got.is_chief == multi_worker_util.is_chief(cluster, *task)
    assert got.num_workers == sum(len(v) for v in cluster.values())
    devices = replica_devices(got, ["/device:CPU:0", "/device:CPU:1"])
    assert len(devices) == 2 * got.num_workers
    assert devices[2 * got.worker_id] == f"/job:{task[0]}/task:{task[1]}/device:CPU:0"


def test_flags_win_over_tf_config_and_one_task_is_a_local_run():
    env = {"TF_CONFIG": _tf_config({"worker": WORKERS}, "worker", 1)}
    flagged = resolve_cluster("127.0.0.1:5000,127.0.0.1:5001", 1, env)
    assert flagged.spec() == {"worker": ["127.0.0.1:5000", "127.0.0.1:5001"]}
    assert flagged.worker_id == 1 and not flagged.is_chief
    assert resolve_cluster(None, None, env).num_workers == 3
    assert resolve_cluster(None, None, {}) is None
    assert resolve_cluster(None, None, {"TF_CONFIG": _tf_config({"worker": WORKERS[:1]},
                                                                "worker", 0)}) is None


@pytest.mark.parametrize("text,words", [
    ("{not json", "TF_CONFIG"),
    (_tf_config({"worker": WORKERS, "evaluator": ["e:1"]}, "worker", 0), "evaluator"),
    (_tf_config({"worker": WORKERS}, "worker", 3), "worker:3 is not in the cluster"),
    (_tf_config({"chief": ["a:1", "b:1"], "worker": WORKERS}, "worker", 0), "one chief"),
])
def test_bad_tf_config_is_refused(text, words):
    with pytest.raises(ClusterError, match=words):
        resolve_cluster(None, None, {"TF_CONFIG": text})


def test_config_counts_every_workers_devices():
    config = RunConfig.from_flags(cluster="127.0.0.1:1,127.0.0.1:2", task_index=1, devices=2, batch_size=8)
    assert (config.num_workers, config.num_replicas, config.global_batch_size) == (2, 4, 32)
    assert config.conv_lr == pytest.approx(config.optimizer.lr * 32 / config.optimizer.lr_batch)  # the global batch's rate


def test_launcher_flags_and_addresses():
    flags = launch.worker_flags(["--scheme", "owt-b"], 2, "runs/x")
    assert flags == ["--scheme", "owt-b", "--devices", "2", "--logdir", "runs/x"]
    assert launch.worker_flags(["--logdir=mine"], 1, "runs/x") == ["--logdir=mine", "--devices", "1"]
    for reserved in ("--devices", "--cluster", "--task-index=1"):
        with pytest.raises(launch.LaunchError, match="set by the launcher"):
            launch.worker_flags([reserved, "3"], 2, "runs/x")
    ports = launch.free_ports(4)
    assert len(set(ports)) == 4
    addresses = [f"127.0.0.1:{p}" for p in ports]
    parsed = parse_tf_config(launch.tf_config(addresses, 3))
    assert parsed.worker_id == 3 and parsed.task_name_of(3) == "/job:worker/task:3"


def test_launcher_names_the_killed_worker_when_both_ended_in_one_poll():
    """A worker killed by a signal is the cause; the one that exited on finding it gone
    (code 5) is not, even when it comes first and both ended before the launcher looked."""
    import io
    import sys
    import time

    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    commands = [[sys.executable, "-c", "raise SystemExit(5)"], [sys.executable, "-c", killed]]
    workers = launch.Workers(commands, [dict(os.environ)] * 2, out=io.StringIO())
    try:
        deadline = time.monotonic() + 60
        while not workers.all_done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [p.returncode for p in workers.procs] == [5, -9]
        assert workers.first_failure() == 1
    finally:
        workers.stop(grace=1)


def test_launch_refuses_scheme_auto_before_starting_workers():
    """Each worker would price its own hardware: refused once, by the launcher's check."""
    addresses = ["127.0.0.1:1", "127.0.0.1:2"]
    with pytest.raises(launch.LaunchError, match="--scheme: 'auto' needs one process"):
        launch.check_train_flags(launch.worker_flags(["--scheme", "auto"], 1, "runs/x"), addresses)
    launch.check_train_flags(launch.worker_flags(["--scheme", "owt-a"], 1, "runs/x"), addresses)


def test_join_bound_from_the_environment():
    from owt_tf.runtime.cluster import DEFAULT_JOIN_TIMEOUT_S, join_timeout_s

    assert join_timeout_s({}) == DEFAULT_JOIN_TIMEOUT_S
    assert join_timeout_s({"OWT_TF_JOIN_TIMEOUT_S": "7.5"}) == 7.5
    for bad in ("soon", "0", "-3"):
        with pytest.raises(ClusterError, match="OWT_TF_JOIN_TIMEOUT_S"):
            join_timeout_s({"OWT_TF_JOIN_TIMEOUT_S": bad})


WAITING_WORKER = """
import sys, time
from owt_tf.runtime.cluster import resolve_cluster, watch_peers_start
watch_peers_start(resolve_cluster(sys.argv[1], 0), 3.0, prefix="error: ")
time.sleep(60)  # as a worker blocked in TensorFlow's cluster registration
"""


def test_a_task_that_never_starts_ends_the_waiting_worker_naming_only_it():
    """Task 1 listens (started), task 2 does not: after the bound, one line naming task 2,
    and the waiting worker is SIGKILLed (TF's registration would ignore SIGTERM)."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as started, socket.socket() as never:
        started.bind(("127.0.0.1", 0))
        started.listen()
        never.bind(("127.0.0.1", 0))  # bound, never listening: connections refused
        addresses = ["127.0.0.1:1", *(f"127.0.0.1:{s.getsockname()[1]}" for s in (started, never))]
        begun = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", WAITING_WORKER, ",".join(addresses)],
                              capture_output=True, text=True, timeout=60)
        took = time.monotonic() - begun
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: task /job:worker/task:2 ({addresses[2]}) did not start within 3 s"), lines
    assert 3 <= took < 30
