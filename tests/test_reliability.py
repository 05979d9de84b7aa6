"""Nothing lost on a crash, clear stops on NaN and bad input, bit-identical deterministic resume.

Training runs here are real `python -m owt_tf.train` processes (tests/kill_harness.py kills
one at a chosen moment with SIGKILL); final weights are compared tensor by tensor from the
checkpoints the runs leave behind.
"""
import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from engine_harness import changed_tensors, checkpoint_tensors, every_copy

# One xdist worker runs this module: its module-scoped runs are made once, not per worker.
pytestmark = pytest.mark.xdist_group("test_reliability")

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 12
RUN = ["--steps", str(STEPS), "--eval-every", "0", "--checkpoint-every", "3", "--deterministic",
       "--histogram-every", "0", "--log-every", "1"]


def _env():
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")


def _train(*flags, timeout=600):
    return subprocess.run([sys.executable, "-m", "owt_tf.train", *flags], capture_output=True,
                          text=True, env=_env(), timeout=timeout)


def _killed(moment, at, *flags):
    return subprocess.run([sys.executable, os.path.join(HERE, "kill_harness.py"), moment, str(at),
                           "--", *flags], capture_output=True, text=True, env=_env(), timeout=600)


def _tensors(logdir, step=None):
    """Every saved tensor of the logdir's latest (or step's) checkpoint, save_counter aside."""
    directory = os.path.join(logdir, "checkpoints")
    path = os.path.join(directory, f"ckpt-{step}") if step else tf.train.latest_checkpoint(directory)
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if not name.startswith("save_counter")}


def _assert_bit_identical(a, b):
    assert sorted(a) == sorted(b)
    different = [name for name in a if not np.array_equal(a[name], b[name])]
    assert not different, different


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory):
    """A run of RUN never stopped: its logdir (checkpoints 6, 9 and 12 kept)."""
    logdir = str(tmp_path_factory.mktemp("straight") / "run")
    proc = _train(*RUN, "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return logdir


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    return _tensors(uninterrupted_run, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("moment,at", [("step", 7), ("serialize", 6), ("index", 9)])
def test_sigkill_then_same_command_is_bit_identical(uninterrupted, tmp_path, moment, at):
    logdir = str(tmp_path / "run")
    flags = [*RUN, "--logdir", logdir]
    killed = _killed(moment, at, *flags)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # the index names the last complete checkpoint, from before the kill, and it loads
    latest = tf.train.latest_checkpoint(os.path.join(logdir, "checkpoints"))
    expected = 3 * ((at - 1) // 3)
    assert latest.endswith(f"ckpt-{expected}"), latest
    assert int(_tensors(logdir)["step/.ATTRIBUTES/VARIABLE_VALUE"]) == expected
    resumed = _train(*flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {latest} at step {expected}" in resumed.stdout
    _assert_bit_identical(_tensors(logdir, STEPS), uninterrupted)


def _wait_for(path, proc, timeout=300):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_checkpoint_and_the_run_resumes(uninterrupted, tmp_path, sig):
    """SIGTERM or SIGINT: a checkpoint of the step it stopped at, one line naming it and the
    command that resumes; after SIGTERM the same command (to RUN's end) ends bit-identical
    to the run never stopped."""
    logdir = str(tmp_path / "run")
    flags = [*RUN, "--logdir", logdir]
    # checkpoints every 2 steps and no end in sight, until the signal
    proc = subprocess.Popen([sys.executable, "-m", "owt_tf.train", *flags, "--steps", "100000",
                             "--checkpoint-every", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        _wait_for(os.path.join(logdir, "checkpoints", "checkpoint"), proc)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err[-3000:]
    lines = [l for l in err.splitlines() if signal.Signals(sig).name in l]
    assert len(lines) == 1 and "saved" in lines[0] and f"--logdir {logdir}" in lines[0], err[-3000:]
    stopped = int(lines[0].split(" at step ")[1].split(":")[0])
    assert int(_tensors(logdir)["step/.ATTRIBUTES/VARIABLE_VALUE"]) == stopped
    if sig != signal.SIGTERM:
        return
    assert stopped < STEPS  # the signal came right after the first checkpoint
    resumed = _train(*flags)
    assert resumed.returncode == 0 and f"at step {stopped}" in resumed.stdout, resumed.stderr[-3000:]
    _assert_bit_identical(_tensors(logdir, STEPS), uninterrupted)


@pytest.mark.slow
def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    logdir = str(tmp_path / "run")
    proc = _train("--lr", "100", "--steps", "50", "--checkpoint-every", "1", "--eval-every", "0",
                  "--logdir", logdir)
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = [l for l in proc.stderr.splitlines() if "owt_tf.train: error" in l]
    assert len(errors) == 1, proc.stderr[-3000:]
    line = errors[0]
    bad_step = int(line.split("error: step ")[1].split(":")[0])
    assert "non-finite loss" in line and "conv1/kernel" in line and "is kept" in line
    saved = _tensors(logdir)
    assert int(saved["step/.ATTRIBUTES/VARIABLE_VALUE"]) == bad_step - 1
    assert f"ckpt-{bad_step - 1}" in line
    assert not os.path.exists(os.path.join(logdir, "checkpoints", f"ckpt-{bad_step}.index"))
    floats = {name: v for name, v in saved.items() if np.asarray(v).dtype.kind == "f"}
    # trunk weights are saved through the optimizer that tracks them
    assert any("_trainable_variables" in n for n in floats) and any(n.startswith("fc/") for n in floats)
    for name, value in floats.items():
        assert np.isfinite(value).all(), name


def test_skip_nonfinite_undoes_the_step_exactly(devices, tmp_path):
    from owt_tf.config import RunConfig
    from owt_tf.training.guard import NonFiniteError
    from owt_tf.training.loop import Trainer

    config = RunConfig.from_flags(devices=2, scheme="owt-b", fc_batch="worker", batch_size=8, steps=10,
                                  skip_nonfinite=1, eval_every=0, logdir=str(tmp_path / "run"))
    trainer = Trainer(config, devices=devices[:2])
    real = trainer._train_batches
    poison = {"steps": (3, 4)}

    class Poisoned:
        def __next__(self):
            images, labels, positions = next(real)
            if int(trainer.step) + 1 in poison["steps"]:
                images = trainer.hybrid.strategy.run(lambda x: x * np.nan, args=(images,))
            return images, labels, positions

    trainer._train_batches = Poisoned()
    for _ in range(2):
        assert trainer.train_step().nonfinite is None
    before = every_copy(trainer)
    saved_before = checkpoint_tensors(trainer, tmp_path / "before")
    m = trainer.train_step()
    # NaN pixels: whether ReLU and max-pool drop them forward depends on the kernels (a max
    # that propagates NaN makes the loss NaN too: the report then names the loss first), but
    # conv1's kernel gradient always multiplies by them: the report names it either way.
    assert "gradient of alexnet_tiny_trunk/conv1/kernel" in m.nonfinite
    assert int(trainer.skipped_steps) == 1
    assert int(trainer.step) == 3
    after = every_copy(trainer)
    assert len(after) > len(trainer._state_variables())  # the mirrored ones counted per replica
    assert all(np.array_equal(b, a) for b, a in zip(before, after, strict=True))
    saved_after = checkpoint_tensors(trainer, tmp_path / "after")
    assert len(saved_before) > 20 and not changed_tensors(saved_before, saved_after)
    with pytest.raises(NonFiniteError, match="step 4: non-finite .*gradient of .*conv1/kernel"):
        trainer.train_step()


def _corrupt_tree(root, bad_train, bad_val=1):
    """3 labels x 8 PNGs per split; the first `bad_train` training files per label broken
    (truncated PNG, then garbage), and `bad_val` validation files garbage."""
    for split, bad in (("train", bad_train), ("validation", bad_val)):
        for label in ("a", "b", "c"):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(8 if split == "train" else 2):
                pixels = np.full((20, 20, 3), 30 * i, np.uint8)
                data = tf.io.encode_png(pixels).numpy()
                if i < bad:
                    data = data[: len(data) // 2] if i % 2 == 0 else b"not an image at all"
                (folder / f"{i}.png").write_bytes(data)
    return root


@pytest.mark.slow
def test_corrupt_images_are_skipped_and_counted(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    root = _corrupt_tree(tmp_path / "imgs", bad_train=2)  # 6 of 24 training images broken
    logdir = str(tmp_path / "run")
    proc = _train("--dataset", f"folder:{root}", "--batch-size", "6", "--steps", "10",
                  "--eval-every", "0", "--log-every", "1", "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = _tensors(logdir)
    position = int(saved["data_position/.ATTRIBUTES/VARIABLE_VALUE"])
    skipped = int(saved["skipped_images/.ATTRIBUTES/VARIABLE_VALUE"])
    assert position == 10 * 12  # every position fills a row: an unreadable one, a substitute
    assert skipped == 6 * 5  # 5 epochs of 24 files, 6 of them broken
    assert f"skipped {skipped} unreadable training images" in proc.stdout
    acc = event_accumulator.EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors("data/skipped_images")
    assert events[-1].step == 10
    assert float(tf.make_ndarray(events[-1].tensor_proto)) == skipped
    assert [e.step for e in acc.Tensors("train/skipped_nonfinite")][-1] == 10


def test_validation_skips_a_corrupt_image(tmp_path):
    from owt_tf.data.datasets import load_dataset

    ds = load_dataset(f"folder:{_corrupt_tree(tmp_path / 'imgs', bad_train=0, bad_val=1)}", (32, 32, 3))
    labels = np.concatenate([y.numpy() for _, y in ds.validation(4)])
    assert (labels >= 0).sum() == 3  # 6 files, the first of each label broken


def test_dataset_without_a_readable_image_fails_at_once(tmp_path):
    root = _corrupt_tree(tmp_path / "imgs", bad_train=8)
    work = tmp_path / "cwd"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-m", "owt_tf.train", "--dataset", f"folder:{root}",
                           "--batch-size", "4", "--logdir", str(work / "run")], cwd=work,
                          capture_output=True, text=True, env=_env(), timeout=300)
    errors = [l for l in proc.stderr.splitlines() if "owt_tf.train: error" in l]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "none of the 24 sampled training images (24 in all) could be decoded" in errors[0]
    assert os.listdir(work) == []


def _file_size_limit(limit):
    """For a child process: writes past `limit` bytes per file fail (EFBIG), as on a full disk."""
    import resource

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_failed_checkpoint_write_is_reported_and_the_previous_one_kept(uninterrupted_run,
                                                                       tmp_path):
    logdir = str(tmp_path / "run")
    shutil.copytree(uninterrupted_run, logdir)
    before = _tensors(logdir, STEPS)
    # resumed with a file-size limit far below a checkpoint's data file: the write of the
    # next checkpoint fails the way a full disk makes it fail
    proc = subprocess.run([sys.executable, "-m", "owt_tf.train", *RUN, "--logdir", logdir,
                           "--steps", str(STEPS + 3)],
                          capture_output=True, text=True, env=_env(), timeout=600,
                          preexec_fn=_file_size_limit(200_000))
    assert proc.returncode == 4, proc.stderr[-3000:]
    errors = [l for l in proc.stderr.splitlines() if "owt_tf.train: error" in l]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"could not write the checkpoint of step {STEPS + 3}" in errors[0]
    assert f"ckpt-{STEPS} is intact" in errors[0] and "File too large" in errors[0]
    assert not os.path.exists(os.path.join(logdir, "checkpoints", f"ckpt-{STEPS + 3}_temp"))
    assert tf.train.latest_checkpoint(os.path.join(logdir, "checkpoints")).endswith(
        f"ckpt-{STEPS}")
    _assert_bit_identical(_tensors(logdir, STEPS), before)


# -- one writer per run directory ----------------------------------------------------------

HOLD_LOCK = """
import sys, time
from owt_tf.training.files.rundir import RunDirLock
RunDirLock.take(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def _snapshot(root):
    """Every file under `root` with its size and modification time."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            st = os.stat(os.path.join(folder, name))
            found[os.path.relpath(os.path.join(folder, name), root)] = (st.st_size, st.st_mtime_ns)
    return found


def _errors(proc, prog="owt_tf.train"):
    return [l for l in proc.stderr.splitlines() if f"{prog}: error" in l]


@pytest.mark.slow
def test_locked_logdir_is_refused_at_once_and_a_killed_holder_leaves_no_lock(
        uninterrupted_run, tmp_path):
    logdir = str(tmp_path / "run")
    shutil.copytree(uninterrupted_run, logdir)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, logdir], stdout=subprocess.PIPE,
                              text=True, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = _snapshot(logdir)
        started = time.monotonic()
        proc = _train(*RUN, "--steps", str(STEPS + 1), "--logdir", logdir)
        took = time.monotonic() - started
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = _errors(proc)
        assert len(errors) == 1, proc.stderr[-3000:]
        assert f"--logdir {logdir} is being written by another run (pid {holder.pid} on host " \
               f"{os.uname().nodename}, started " in errors[0]
        assert "Traceback" not in proc.stderr
        assert _snapshot(logdir) == before  # nothing written, not even the lock file
        # readers take no lock
        ev = subprocess.run([sys.executable, "-m", "owt_tf.evaluate", "--logdir", logdir],
                            capture_output=True, text=True, env=_env(), timeout=300)
        assert ev.returncode == 0 and f"checkpoint {logdir}/checkpoints/ckpt-{STEPS}" in ev.stdout, \
            ev.stderr[-3000:]
        assert _snapshot(logdir) == before
    finally:
        holder.kill()
        holder.wait()
    assert took < 60
    # SIGKILLed: the kernel dropped its lock, and the next process takes it
    again = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, logdir], stdout=subprocess.PIPE,
                             text=True, env=_env())
    try:
        assert again.stdout.readline().strip() == "locked"
    finally:
        again.kill()
        again.wait()


@pytest.mark.slow
def test_the_same_command_started_twice_has_one_writer(tmp_path):
    logdir = str(tmp_path / "run")
    command = [sys.executable, "-m", "owt_tf.train", "--steps", "3", "--eval-every", "0",
               "--checkpoint-every", "1", "--logdir", logdir]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env()) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [err[-2000:] for _, err in outs]
    winner = next(p for p in procs if p.returncode == 0)
    loser = next(i for i, p in enumerate(procs) if p.returncode == 2)
    assert f"(pid {winner.pid} on host" in outs[loser][1]
    events = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    assert len(events) == 1 and f".{winner.pid}." in os.path.basename(events[0])


# -- damaged checkpoints ---------------------------------------------------------------------

def _data_file(path):
    files = glob.glob(path + ".data-*")
    assert len(files) == 1, files
    return files[0]


def _truncate(path):
    data = _data_file(path)
    os.truncate(data, os.path.getsize(data) // 2)


def _flip_a_byte(path):
    data = _data_file(path)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x55]))


def _remove_the_shard(path):
    os.remove(_data_file(path))


def _garble_the_index(path):
    with open(path + ".index", "r+b") as f:
        f.write(b"\0garbage" * 16)


DAMAGE = {"truncated": _truncate, "bit-flipped": _flip_a_byte, "missing shard": _remove_the_shard,
          "unreadable index": _garble_the_index}


def _files_of(path):
    return {os.path.basename(f): open(f, "rb").read() for f in glob.glob(path + ".*")
            if not os.path.isdir(f)}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_every_kind_of_damage_is_caught_on_reading_back(uninterrupted_run, tmp_path, damage):
    from owt_tf.training.files.checkpoint import CheckpointDamaged, verify_checkpoint

    directory = str(tmp_path / "checkpoints")
    shutil.copytree(os.path.join(uninterrupted_run, "checkpoints"), directory)
    path = os.path.join(directory, f"ckpt-{STEPS}")
    verify_checkpoint(path)
    DAMAGE[damage](path)
    with pytest.raises(CheckpointDamaged, match=f"ckpt-{STEPS} cannot be read back"):
        verify_checkpoint(path)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "bit-flipped"])  # the others: same path
def test_damaged_latest_checkpoint_falls_back_moves_it_aside_and_ends_equal(
        uninterrupted_run, uninterrupted, tmp_path, damage):
    """ckpt-12 damaged: the same command resumes from ckpt-9, says so in one line, keeps the
    damaged files aside, and ends bit-identical to the run never damaged."""
    logdir = str(tmp_path / "run")
    shutil.copytree(uninterrupted_run, logdir)
    directory = os.path.join(logdir, "checkpoints")
    bad = os.path.join(directory, f"ckpt-{STEPS}")
    DAMAGE[damage](bad)
    damaged_files = _files_of(bad)
    proc = _train(*RUN, "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [l for l in proc.stderr.splitlines() if l.startswith("warning: checkpoint")]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert warnings[0].startswith(f"warning: checkpoint {bad} ")
    assert f"moved to {bad}.damaged; using {directory}/ckpt-9" in warnings[0]
    assert f"resumed from {directory}/ckpt-9 at step 9" in proc.stdout
    # never deleted: the damaged files as they were, aside
    assert {name: open(os.path.join(bad + ".damaged", name), "rb").read()
            for name in os.listdir(bad + ".damaged")} == damaged_files
    _assert_bit_identical(_tensors(logdir, STEPS), uninterrupted)
    state = tf.train.get_checkpoint_state(directory)
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == \
        ["ckpt-6", "ckpt-9", f"ckpt-{STEPS}"]


@pytest.mark.slow
def test_no_readable_checkpoint_stops_and_changes_nothing_evaluate_and_export_skip(
        uninterrupted_run, tmp_path):
    logdir = str(tmp_path / "run")
    shutil.copytree(uninterrupted_run, logdir)
    directory = os.path.join(logdir, "checkpoints")
    # the newest damaged: evaluate and export use ckpt-9 and move nothing
    _flip_a_byte(os.path.join(directory, f"ckpt-{STEPS}"))
    before = _snapshot(logdir)
    ev = subprocess.run([sys.executable, "-m", "owt_tf.evaluate", "--logdir", logdir],
                        capture_output=True, text=True, env=_env(), timeout=300)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert f"checkpoint {directory}/ckpt-9" in ev.stdout
    assert f"warning: checkpoint {directory}/ckpt-{STEPS} cannot be read back" in ev.stderr
    assert "Checksum" in ev.stderr or "checksum" in ev.stderr
    out = str(tmp_path / "model")
    ex = subprocess.run([sys.executable, "-m", "owt_tf.export", "--logdir", logdir, "--out", out],
                        capture_output=True, text=True, env=_env(), timeout=300)
    assert ex.returncode == 0, ex.stderr[-3000:]
    assert f"exported {directory}/ckpt-9 to " in ex.stdout
    assert _snapshot(logdir) == before
    # every checkpoint damaged: train, evaluate and export stop in one line, exit 2
    for step in (6, 9):
        _truncate(os.path.join(directory, f"ckpt-{step}"))
    before = _snapshot(logdir)
    runs = {"owt_tf.train": _train(*RUN, "--logdir", logdir)}
    for prog, more in (("owt_tf.evaluate", []), ("owt_tf.export", ["--out", out])):
        runs[prog] = subprocess.run([sys.executable, "-m", prog, "--logdir", logdir, *more],
                                    capture_output=True, text=True, env=_env(), timeout=300)
    for prog, proc in runs.items():
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = _errors(proc, prog)
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert f"no checkpoint in {directory} can be read" in errors[0]
        for step in (6, 9, STEPS):
            assert f"ckpt-{step} cannot be read back" in errors[0]
    assert os.listdir(out) == ["1"]  # the export of ckpt-9 above, no other
    # the run's files as they were; the lock file records train as its last holder
    lock = "owt_tf.lock"
    assert {k: v for k, v in _snapshot(logdir).items() if k != lock} == \
        {k: v for k, v in before.items() if k != lock}


def test_a_save_that_wrote_garbage_never_costs_the_last_good_checkpoint(devices, tmp_path,
                                                                       monkeypatch):
    """A write that 'succeeds' but stores garbage: read back before the index names it and
    before older checkpoints are rotated out (3 kept: ckpt-1 would go)."""
    from owt_tf.config import RunConfig
    from owt_tf.training.files.checkpoint import CheckpointWriteError
    from owt_tf.training.loop import Trainer

    config = RunConfig.from_flags(devices=2, batch_size=8, steps=4, eval_every=0,
                                  logdir=str(tmp_path / "run"))
    trainer = Trainer(config, devices=devices[:2])
    ckpts = trainer.checkpoints
    for step in (1, 2, 3):
        trainer.train_step()
        ckpts.save(step)
    directory = ckpts.directory
    kept = {step: _files_of(os.path.join(directory, f"ckpt-{step}")) for step in (1, 2, 3)}
    saver = ckpts.checkpoint._saver
    real_save = saver.save

    def save_garbage(*args, **kwargs):
        written = real_save(*args, **kwargs)
        path = written if isinstance(written, str) else written.numpy().decode()
        _flip_a_byte(path)
        return written

    monkeypatch.setattr(saver, "save", save_garbage)
    trainer.train_step()
    with pytest.raises(CheckpointWriteError, match=r"the checkpoint of step 4 was written but .*"
                       r"ckpt-4 cannot be read back \(.*moved to .*ckpt-4.damaged; .*ckpt-3 is intact"):
        ckpts.save(4)
    assert ckpts.latest == os.path.join(directory, "ckpt-3")
    for step, files in kept.items():
        assert _files_of(os.path.join(directory, f"ckpt-{step}")) == files
    assert [n for n in os.listdir(directory) if n.startswith("ckpt-4")] == ["ckpt-4.damaged"]
    assert sorted(os.listdir(os.path.join(directory, "ckpt-4.damaged"))) == \
        ["ckpt-4.data-00000-of-00001", "ckpt-4.index"]
    # the next good save counts again
    monkeypatch.setattr(saver, "save", real_save)
    assert ckpts.save(4) == os.path.join(directory, "ckpt-4")
    assert ckpts.latest.endswith("ckpt-4") and not os.path.exists(
        os.path.join(directory, "ckpt-1.index"))


def test_unreadable_checkpoint_index_is_rebuilt_from_the_files_not_started_over(
        uninterrupted_run, tmp_path):
    """TF reads a garbled `checkpoint` index as "no checkpoint" (and would start over, then
    overwrite ckpt-N): the run moves it aside and resumes from the newest file instead."""
    logdir = str(tmp_path / "run")
    shutil.copytree(uninterrupted_run, logdir)
    index = os.path.join(logdir, "checkpoints", "checkpoint")
    with open(index, "w") as f:
        f.write("garbage {{{\n")
    proc = _train(*RUN, "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"warning: the checkpoint index {index} is unreadable: moved to {index}.damaged" \
        in proc.stderr
    assert f"resumed from {logdir}/checkpoints/ckpt-{STEPS} at step {STEPS}" in proc.stdout
    assert open(index + ".damaged").read() == "garbage {{{\n"
    state = tf.train.get_checkpoint_state(os.path.dirname(index))
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == \
        ["ckpt-6", "ckpt-9", f"ckpt-{STEPS}"]
