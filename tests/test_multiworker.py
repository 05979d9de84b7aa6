"""Multi-worker runs over loopback: `python -m owt_tf.launch` with 2 workers x 2 logical CPUs
(and 2 x 1).

Each run is real: `python -m owt_tf.train` processes on 127.0.0.1 joined by TensorFlow's
gRPC collectives (MultiWorkerMirroredStrategy). Held to a one-process, one-device
run of the same global batch (the independent reference), to the closed-form bytes for
K, and to an uninterrupted run after a worker is SIGTERMed or SIGKILLed and the command rerun.
"""
import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

from owt_tf import launch
from owt_tf.models import build_model
from owt_tf.planner import traffic
from owt_tf.training.files import summaries
from test_reliability import _files_of, _flip_a_byte

# One xdist worker runs this module: its module-scoped runs are made once, not per worker.
pytestmark = pytest.mark.xdist_group("test_multiworker")

WORKERS, PER_WORKER, BATCH, STEPS, LR = 2, 2, 8, 6, 0.01
K = WORKERS * PER_WORKER
# fc_batch=global, no dropout (its masks are drawn per shard, so they differ from one
# device's), validation only at the end.
COMMON = ["--steps", str(STEPS), "--dropout", "0", "--eval-every", "0", "--log-every", "1",
          "--histogram-every", "0", "--fc-batch", "global"]


def _env(tmpdir):
    # TMPDIR: where non-chief workers put their temporary checkpoints (must be left empty).
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TMPDIR=str(tmpdir))


def _launch(tmp, *flags, workers=WORKERS, per_worker=PER_WORKER, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "owt_tf.launch", "--workers", str(workers),
         "--devices-per-worker", str(per_worker), "--", *flags],
        capture_output=True, text=True, env=_env(tmp), timeout=timeout)


def _pids(output):
    return [int(p) for p in re.findall(r"\[launch\] worker \d+: pid (\d+)", output)]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _tensors(logdir, step):
    reader = tf.train.load_checkpoint(os.path.join(logdir, "checkpoints", f"ckpt-{step}"))
    return {name: np.asarray(reader.get_tensor(name)) for name in reader.get_variable_to_shape_map()
            if not name.startswith(("save_counter", "_CHECKPOINTABLE_OBJECT_GRAPH"))}


def _scalar(logdir, tag):
    acc = event_accumulator.EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    return [float(tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, one device, the same global batch of K * B: the same rates, since the
    rates follow the global batch, not K."""
    logdir = str(tmp_path_factory.mktemp("single") / "run")
    proc = subprocess.run(
        [sys.executable, "-m", "owt_tf.train", "--scheme", "single", "--devices", "1",
         "--batch-size", str(K * BATCH), "--lr", str(LR), *COMMON, "--logdir", logdir],
        capture_output=True, text=True, env=_env(tmp_path_factory.mktemp("tmp")), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _tensors(logdir, STEPS)


@pytest.fixture(scope="module")
def cluster_runs(tmp_path_factory):
    """Each scheme's uninterrupted run (2 x 2 unless said): logdir, launcher output, temp dir."""
    runs = {}

    def run(scheme, workers=WORKERS, per_worker=PER_WORKER):
        key = (scheme, workers, per_worker)
        if key not in runs:
            base = tmp_path_factory.mktemp(scheme)
            tmp = base / "tmp"
            tmp.mkdir()
            logdir = str(base / "run")
            # The reference's global batch at every K (B = global / K), and the same --lr:
            # the rates follow the global batch.
            k = workers * per_worker
            proc = _launch(tmp, "--scheme", scheme, "--batch-size", str(K * BATCH // k),
                           "--lr", str(LR),
                           *COMMON, "--checkpoint-every", "2", "--logdir", logdir,
                           "--export-dir", str(base / "model"), workers=workers,
                           per_worker=per_worker)
            assert proc.returncode == 0, proc.stdout[-4000:]
            runs[key] = (logdir, proc.stdout, tmp)
        return runs[key]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("scheme,workers,per_worker", [
    ("owt-a", 2, 2), ("owt-b", 2, 2), ("owt-c", 2, 2),
    ("owt-c", 2, 1),  # one device per worker: what stock MultiWorkerMirroredStrategy gives a CPU
])
def test_workers_match_one_device(reference, cluster_runs, scheme, workers, per_worker):
    k = workers * per_worker
    logdir, output, tmp = cluster_runs(scheme, workers, per_worker)
    got = _tensors(logdir, STEPS)
    assert sorted(got) == sorted(reference)
    worst = {}
    for name, want in reference.items():
        if want.dtype.kind == "f":
            worst[name] = float(np.max(np.abs(got[name] - want)) / (np.max(np.abs(want)) + 1e-12))
        else:  # step, data position, counters
            assert np.array_equal(got[name], want), name
    assert max(worst.values()) < 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    # Every FC layer is in the checkpoint whole, though each process held 2 of its 4 shards.
    assert got["fc/.ATTRIBUTES/fc0_kernel"].shape == reference["fc/.ATTRIBUTES/fc0_kernel"].shape

    # The chief's SavedModel holds the FC layers both processes' shards make up.
    exported = tf.saved_model.load(os.path.join(os.path.dirname(logdir), "model", "1"))
    layers = exported.fc_layers
    for i, (kernel, bias) in enumerate(zip(layers[0::2], layers[1::2])):
        assert np.array_equal(kernel.numpy(), got[f"fc/.ATTRIBUTES/fc{i}_kernel"])
        assert np.array_equal(bias.numpy(), got[f"fc/.ATTRIBUTES/fc{i}_bias"])

    # The bytes the chief's ledger reported equal the formula for this K (per worker).
    spec = build_model("alexnet_tiny", 10)
    trunk = spec.build_trunk()
    net = traffic.NetworkShape(trunk.count_params(), spec.trunk_output_dim(trunk),
                               spec.head.hidden, spec.head.num_classes)
    want = float(traffic.total(traffic.step_traffic(net, scheme, k, K * BATCH // k)))
    assert _scalar(logdir, summaries.BYTES_PER_STEP) == [want] * STEPS

    # Files from the chief only: one event file (the chief's pid), non-chief temp removed.
    chief_pid = _pids(output)[0]
    events = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    assert len(events) == 1 and f".{chief_pid}." in os.path.basename(events[0])
    assert os.listdir(tmp) == []
    assert f"{scheme} on {k} devices ({workers} workers x {per_worker})" in output


def test_launcher_leaves_no_process_behind(cluster_runs):
    _, output, _ = cluster_runs("owt-b")
    pids = _pids(output)
    assert len(pids) == WORKERS
    assert not [p for p in pids if _alive(p)]


def _wait_for(path, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def _signal_worker_1(command, env, checkpoint):
    """Runs the launcher until `checkpoint` exists, sends worker 1 `signum`; returns the
    launcher's exit code, its output, the victim's pid and the seconds it took to end."""
    def run(signum):
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env)
        try:
            _wait_for(checkpoint, proc)
            head = ""
            while len(_pids(head)) < WORKERS:  # the pid lines come first
                head += proc.stdout.readline()
            victim = _pids(head)[1]
            os.kill(victim, signum)
            sent = time.monotonic()
            # Read on through the same buffered pipe (communicate() would bypass what
            # readline() already buffered); the watchdog bounds the wait.
            watchdog = threading.Timer(120, proc.kill)
            watchdog.start()
            rest = proc.stdout.read()
            proc.wait()
            watchdog.cancel()
            return proc.returncode, head + rest, victim, time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
    return run


def _latest_step(logdir):
    latest = tf.train.latest_checkpoint(os.path.join(logdir, "checkpoints"))
    return int(latest.rsplit("-", 1)[1]) if latest else 0


@pytest.mark.slow
def test_preempted_then_killed_worker_and_the_same_command_resumes(cluster_runs, tmp_path):
    """SIGTERM to one worker: all stop at one step with one checkpoint. SIGKILL to one
    worker: the other stops on its own, naming it. Each time the same command resumes, and
    the run ends equal to one never interrupted."""
    straight, _, _ = cluster_runs("owt-b")
    logdir = str(tmp_path / "run")
    flags = ["--scheme", "owt-b", "--batch-size", str(BATCH), "--lr", str(LR), *COMMON,
             "--checkpoint-every", "1", "--logdir", logdir]
    command = [sys.executable, "-m", "owt_tf.launch", "--workers", str(WORKERS),
               "--devices-per-worker", str(PER_WORKER), "--grace", "20", "--", *flags]
    ckpt = lambda n: os.path.join(logdir, "checkpoints", f"ckpt-{n}.index")  # noqa: E731

    code, output, _, _ = _signal_worker_1(command, _env(tmp_path), ckpt(1))(signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    stopped = re.findall(r"\[worker (\d)\] .*at step (\d+): saved", output)
    assert sorted(w for w, _ in stopped) == ["0", "1"], output[-3000:]
    assert len({step for _, step in stopped}) == 1  # both at the same step
    preempted_at = int(stopped[0][1])
    assert _latest_step(logdir) == preempted_at < STEPS
    assert "another worker's stop signal" in output  # worker 0 got no signal itself

    code, output, victim, seconds = _signal_worker_1(command, _env(tmp_path),
                                                     ckpt(preempted_at + 1))(signal.SIGKILL)
    assert "resumed from" in output, output[-3000:]
    assert code == 128 + signal.SIGKILL, output[-3000:]
    assert f"worker 1 (pid {victim}, /job:worker/task:1) was killed by SIGKILL" in output
    # The survivor stops on its own, naming the lost task (not the launcher's SIGTERM).
    assert re.search(r"\[worker 0\].*task /job:worker/task:1 is unreachable or gone", output), \
        output[-3000:]
    assert seconds < 60
    assert not [p for p in _pids(output) if _alive(p)]
    assert preempted_at < _latest_step(logdir) < STEPS, "the run finished before the kill"

    again = subprocess.run(command, capture_output=True, text=True, env=_env(tmp_path),
                           timeout=600)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "resumed from" in again.stdout
    want, got = _tensors(straight, STEPS), _tensors(logdir, STEPS)
    assert sorted(got) == sorted(want)
    different = [n for n in want if not np.array_equal(got[n], want[n])]
    assert not different, different


def test_bad_train_flags_fail_in_the_launcher(tmp_path):
    proc = _launch(tmp_path, "--scheme", "owt-c", "--batch-size", "6", timeout=300)
    assert proc.returncode == 2
    assert "--batch-size" in proc.stderr and "K = 4" in proc.stderr
    assert "pid" not in proc.stdout  # nothing was started
    reserved = _launch(tmp_path, "--devices", "3", timeout=300)
    assert reserved.returncode == 2 and "--devices is set by the launcher" in reserved.stderr


# -- faults while checkpointing, and a worker that never starts -----------------------------

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill_harness.py")
JOIN_TIMEOUT_S = 20


class ManualCluster:
    """Workers started one by one (not by the launcher), so that one may run under the kill
    harness or not at all; fresh ports each time."""

    def __init__(self, flags, tmp, workers=WORKERS):
        self.flags = flags
        self.tmp = tmp
        self.addresses = [f"127.0.0.1:{p}" for p in launch.free_ports(workers)]

    def start(self, index, harness=None, join_timeout_s=120):
        env = dict(_env(self.tmp), TF_CONFIG=launch.tf_config(self.addresses, index),
                   OWT_TF_JOIN_TIMEOUT_S=str(join_timeout_s))
        prefix = [HARNESS, *harness, "--"] if harness else ["-m", "owt_tf.train"]
        return subprocess.Popen([sys.executable, *prefix, *self.flags, "--devices",
                                 str(PER_WORKER)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)


def _end_times(procs, timeout=300):
    """Waits for every process; returns {index: (exit code, output, monotonic end time)}."""
    out = {i: [] for i in procs}
    readers = [threading.Thread(target=lambda i=i, p=p: out[i].append(p.stdout.read()), daemon=True)
               for i, p in procs.items()]
    for r in readers:
        r.start()
    ended, deadline = {}, time.monotonic() + timeout
    try:
        while len(ended) < len(procs):
            assert time.monotonic() < deadline, "a worker hung"
            for i, p in procs.items():
                if i not in ended and p.poll() is not None:
                    ended[i] = time.monotonic()
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for r in readers:
        r.join(timeout=10)
    return {i: (p.returncode, "".join(out[i]), ended[i]) for i, p in procs.items()}


@pytest.mark.slow
def test_faults_while_checkpointing_and_a_missing_worker_then_the_same_command_resumes(
        cluster_runs, tmp_path):
    """The chief killed mid-save; a worker killed while the chief writes; a worker that
    never starts; the newest checkpoint damaged. Each ends every process within a bound,
    the same command resumes, and the run ends equal to one never interrupted."""
    straight, _, _ = cluster_runs("owt-b")
    logdir = str(tmp_path / "run")
    flags = ["--scheme", "owt-b", "--batch-size", str(BATCH), "--lr", str(LR), *COMMON,
             "--checkpoint-every", "2", "--logdir", logdir]

    # 1. the chief dies after ckpt-4's data is written, before the index names it
    cluster = ManualCluster(flags, tmp_path)
    ended = _end_times({0: cluster.start(0, ("index", "4")), 1: cluster.start(1)})
    (chief, chief_out, chief_end), (worker, worker_out, worker_end) = ended[0], ended[1]
    assert chief == -signal.SIGKILL, chief_out[-3000:]
    assert worker == 5, worker_out[-3000:]
    assert "task /job:worker/task:0 is unreachable or gone" in worker_out
    assert worker_end - chief_end < 60
    assert _latest_step(logdir) == 2

    # 2. the same command: worker 1 dies once it has done its part of ckpt-4's gather
    cluster = ManualCluster(flags, tmp_path)
    ended = _end_times({0: cluster.start(0), 1: cluster.start(1, ("serialized", "4"))})
    (chief, chief_out, chief_end), (worker, worker_out, worker_end) = ended[0], ended[1]
    assert worker == -signal.SIGKILL, worker_out[-3000:]
    assert "resumed from" in chief_out and chief == 5, chief_out[-3000:]
    assert "task /job:worker/task:1 is unreachable or gone" in chief_out
    assert chief_end - worker_end < 60
    assert _latest_step(logdir) == 4  # the chief finished writing it
    _tensors(logdir, 4)  # and it reads back

    # 3. worker 1 never starts: the chief gives up within the bound, naming it
    cluster = ManualCluster(flags, tmp_path)
    started = time.monotonic()
    (chief, chief_out, chief_end), = _end_times(
        {0: cluster.start(0, join_timeout_s=JOIN_TIMEOUT_S)}).values()
    # ended by its watcher: TF's registration holds the GIL and ignores SIGTERM
    assert chief == -signal.SIGKILL, chief_out[-3000:]
    assert f"owt_tf.train: error: task /job:worker/task:1 ({cluster.addresses[1]}) did not " \
           f"start within {JOIN_TIMEOUT_S} s" in chief_out
    assert chief_end - started < JOIN_TIMEOUT_S + 30
    assert _latest_step(logdir) == 4

    # 4. the newest checkpoint damaged, then the same command with every worker: each
    # falls back to the same intact ckpt-2, only the chief moves ckpt-4 aside (a second
    # mover would leave ckpt-4.damaged.1 or fail), and the run ends as if never stopped
    bad = os.path.join(logdir, "checkpoints", "ckpt-4")
    _flip_a_byte(bad)
    damaged_files = _files_of(bad)
    cluster = ManualCluster(flags, tmp_path)
    ended = _end_times({0: cluster.start(0), 1: cluster.start(1)})
    assert [ended[i][0] for i in (0, 1)] == [0, 0], ended[0][1][-3000:] + ended[1][1][-3000:]
    for i in (0, 1):
        assert f"resumed from {logdir}/checkpoints/ckpt-2 at step 2" in ended[i][1], ended[i][1][-3000:]
    assert f"moved to {bad}.damaged; using {logdir}/checkpoints/ckpt-2" in ended[0][1]
    assert "moved to" not in ended[1][1]
    aside = sorted(n for n in os.listdir(os.path.dirname(bad)) if n.startswith("ckpt-4.damaged"))
    assert aside == ["ckpt-4.damaged"]
    assert {name: open(os.path.join(bad + ".damaged", name), "rb").read()
            for name in os.listdir(bad + ".damaged")} == damaged_files
    want, got = _tensors(straight, STEPS), _tensors(logdir, STEPS)
    assert sorted(got) == sorted(want)
    for name in want:
        if want[name].dtype.kind == "f":
            assert np.max(np.abs(got[name] - want[name])) <= 1e-5 * (np.max(np.abs(want[name])) + 1e-12), name
        else:
            assert np.array_equal(got[name], want[name]), name


# -- streamed input: every worker decodes only its own rows ---------------------------------

def _decoded_lines(output):
    """{worker: (images it decoded, images of its steps' global batches)} from the launcher's output."""
    found = re.findall(r"\[worker (\d)\] input: this worker decoded (\d+) of the (\d+) training", output)
    return {int(w): (int(n), int(m)) for w, n, m in found}


def _final_validation(output):
    """(top-1 %, top-5 %, loss) from a run's `done:` line."""
    found = re.search(r"val top-1 error ([\d.]+)% top-5 ([\d.]+)% loss ([\d.]+)", output)
    assert found, output[-3000:]
    return found.group(1), found.group(2), float(found.group(3))


@pytest.mark.slow
def test_folder_with_corrupt_images_equals_one_process_and_resumes(tmp_path):
    """2 workers x 2 devices on a folder: dataset with unreadable images, run as two
    invocations (--steps 3, then --steps 6), equal to one process of 4 devices at both
    checkpoints (1e-5; the stream position and the unreadable count exactly), each worker
    having decoded about half of the images."""
    from test_own_rows import corrupt_folder

    root = corrupt_folder(tmp_path / "data")  # 6 of 30 training images unreadable
    (root / "validation" / "b" / "2.png").write_bytes(b"not an image")  # 6 of 7 readable
    batch, steps = 2, 6
    flags = ["--dataset", f"folder:{root}", "--scheme", "owt-b", "--batch-size", str(batch),
             "--lr", str(LR), "--augment", "alexnet", *COMMON[2:], "--checkpoint-every", "3"]
    one = str(tmp_path / "one")
    proc = subprocess.run([sys.executable, "-m", "owt_tf.train", "--devices", str(K), *flags,
                           "--steps", str(steps), "--logdir", one],
                          capture_output=True, text=True, env=_env(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cluster = str(tmp_path / "cluster")
    runs = [_launch(tmp_path, *flags, "--steps", str(n), "--logdir", cluster) for n in (3, steps)]
    for run in runs:
        assert run.returncode == 0, run.stdout[-4000:]
    assert "resumed from" in runs[1].stdout
    for step in (3, steps):
        want, got = _tensors(one, step), _tensors(cluster, step)
        assert sorted(got) == sorted(want)
        for name in want:
            if want[name].dtype.kind == "f":
                scale = np.max(np.abs(want[name])) + 1e-12
                assert np.max(np.abs(got[name] - want[name])) <= 1e-5 * scale, (step, name)
            else:
                assert np.array_equal(got[name], want[name]), (step, name)
    # Validation: each worker decodes only its rows of each batch (an unreadable image is a
    # padding row), and the metrics are the one process's.
    want_eval = _final_validation(proc.stdout)
    got_eval = _final_validation(runs[1].stdout)
    assert got_eval[:2] == want_eval[:2] and abs(got_eval[2] - want_eval[2]) <= 2e-4, (got_eval, want_eval)
    final = _tensors(cluster, steps)
    assert int(final["data_position/.ATTRIBUTES/VARIABLE_VALUE"]) == steps * K * batch
    assert int(final["skipped_images/.ATTRIBUTES/VARIABLE_VALUE"]) > 0
    for run in runs:
        decoded = _decoded_lines(run.stdout)
        assert sorted(decoded) == [0, 1], run.stdout[-3000:]
        for n, m in decoded.values():
            assert m == 3 * K * batch  # the images of 3 global batches
            assert m / WORKERS <= n <= 0.7 * m  # its half, and a few tried for unreadable rows
