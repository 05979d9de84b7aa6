"""The Keras path on several hosts, the Keras way: the same script on every worker with
TF_CONFIG set (here 2 workers x 2 logical CPUs on 127.0.0.1), `HybridStrategy(devices=2)`
reading it as MultiWorkerMirroredStrategy does, `fit(x, y)` giving every global batch the
rows a one-process run at K = 4 gives. Held to that one-process run on every weight."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from owt_tf import launch

WORKER = os.path.join(os.path.dirname(__file__), "keras_cluster_worker.py")
pytestmark = pytest.mark.slow


def _run(devices, out, tf_config=None, *extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    return subprocess.Popen([sys.executable, WORKER, str(devices), out, *map(str, extra)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs, timeout=600, code=0):
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, text in zip(procs, outputs):
        assert p.returncode == code, text[-3000:]


def _cluster_configs():
    addresses = [f"127.0.0.1:{port}" for port in launch.free_ports(2)]
    return [launch.tf_config(addresses, i) for i in range(2)]


def _assert_same_weights(got_prefix, want_prefix):
    a, b = np.load(f"{got_prefix}.npz"), np.load(f"{want_prefix}.npz")
    assert len(a.files) == len(b.files)
    for key in b.files:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_two_workers_of_two_devices_equal_one_process_of_four(tmp_path):
    cluster = str(tmp_path / "cluster")
    _wait([_run(2, cluster, config) for config in _cluster_configs()])
    single = str(tmp_path / "single")
    _wait([_run(4, single)])
    # The cluster formed: each worker saw 4 replicas over 2 workers, as itself.
    for worker in range(2):
        with open(f"{cluster}.worker{worker}.json") as f:
            seen = json.load(f)
        assert (seen["replicas"], seen["workers"], seen["worker"]) == (4, 2, worker)
    with open(f"{cluster}.worker0.json") as f:
        got = json.load(f)
    with open(f"{single}.worker0.json") as f:
        want = json.load(f)
    assert want["workers"] == 1 and want["replicas"] == 4
    for name in want["history"]:
        np.testing.assert_allclose(got["history"][name], want["history"][name], rtol=1e-5)
    np.testing.assert_allclose(got["evaluate"], want["evaluate"], rtol=1e-5)
    _assert_same_weights(cluster, single)


def test_backup_and_restore_interrupted_in_a_cluster_resumes_in_one_process(tmp_path):
    """BackupAndRestore in the 2 x 2 cluster, stopped after epoch 2 of 3; the same callback
    in 1 process x 4 devices finishes the run from the chief's backup: it equals an
    uninterrupted 1 x 4 run."""
    backup = tmp_path / "backup"
    _wait([_run(2, str(tmp_path / "stopped"), config, 3, backup, 2)
           for config in _cluster_configs()], code=3)
    # The backup is there (which worker wrote it cannot be told from the files); only the
    # chief wrote the shared files: one TensorBoard event file (they are named by process).
    assert sorted(os.listdir(backup)) == ["latest.weights.h5", "training_metadata.json"]
    files = tmp_path / "stopped.files"
    assert sorted(os.listdir(files / "checkpoints")) == ["e1.weights.h5", "e2.weights.h5"]
    assert len(os.listdir(files / "tensorboard" / "train")) == 1
    resumed = str(tmp_path / "resumed")
    _wait([_run(4, resumed, None, 3, backup)])
    whole = str(tmp_path / "whole")
    _wait([_run(4, whole, None, 3)])
    with open(f"{resumed}.worker0.json") as f:
        history = json.load(f)["history"]
    assert len(history["loss"]) == 1  # epoch 3 only: epochs 1-2 came from the backup
    _assert_same_weights(resumed, whole)
