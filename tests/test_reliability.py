"""Nothing lost on a crash, clear stops on NaN and bad input, bit-identical deterministic resume.

Training runs here are real `python -m owt_tf.train` processes (tests/kill_harness.py kills
one at a chosen moment with SIGKILL); final weights are compared tensor by tensor from the
checkpoints the runs leave behind.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

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
def uninterrupted(tmp_path_factory):
    logdir = str(tmp_path_factory.mktemp("straight") / "run")
    proc = _train(*RUN, "--logdir", logdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _tensors(logdir, STEPS)


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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_checkpoint_and_the_run_resumes(tmp_path, sig):
    logdir = str(tmp_path / "run")
    flags = ["--steps", "100000", "--eval-every", "0", "--checkpoint-every", "2", "--deterministic",
             "--histogram-every", "0", "--logdir", logdir]
    proc = subprocess.Popen([sys.executable, "-m", "owt_tf.train", *flags], stdout=subprocess.PIPE,
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
    # the same command, to a nearby end, equals a run never stopped
    end = ["--steps", str(stopped + 2)]
    resumed = _train(*flags, *end)
    assert resumed.returncode == 0 and f"at step {stopped}" in resumed.stdout, resumed.stderr[-3000:]
    straight = str(tmp_path / "straight")
    assert _train(*flags[:-1], straight, *end).returncode == 0
    _assert_bit_identical(_tensors(logdir, stopped + 2), _tensors(straight, stopped + 2))


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
    from owt_tf.training.guard import NonFiniteError, is_mirrored
    from owt_tf.training.loop import Trainer

    config = RunConfig(devices=2, scheme="owt-b", fc_batch="worker", batch_size=8, steps=10,
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
    def every_copy():
        """Each variable's value on every device it lives on (mirrored: one per replica)."""
        strategy = trainer.hybrid.strategy
        return [np.array(x) for v in trainer._state_variables()
                for x in strategy.experimental_local_results(v.value if is_mirrored(v) else v)]

    before = every_copy()
    m = trainer.train_step()
    # NaN pixels: ReLU and max-pool drop them forward (the loss stays finite), but conv1's
    # kernel gradient multiplies by them
    assert m.nonfinite == "gradient of alexnet_tiny_trunk/conv1/kernel" and int(trainer.skipped_steps) == 1
    assert int(trainer.step) == 3
    after = every_copy()
    assert len(after) > len(trainer._state_variables())  # the mirrored ones counted per replica
    assert all(np.array_equal(b, a) for b, a in zip(before, after))
    with pytest.raises(NonFiniteError, match="step 4: non-finite gradient of .*conv1/kernel"):
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
    assert position - skipped == 10 * 12  # every example read was either used or skipped
    epochs_done = position // 24
    assert 6 * epochs_done <= skipped <= 6 * (epochs_done + 1)
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
    assert "none of the 24 training images could be decoded" in errors[0]
    assert os.listdir(work) == []


def _file_size_limit(limit):
    """For a child process: writes past `limit` bytes per file fail (EFBIG), as on a full disk."""
    import resource

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_failed_checkpoint_write_is_reported_and_the_previous_one_kept(tmp_path):
    logdir = str(tmp_path / "run")
    flags = ["--steps", "4", "--eval-every", "0", "--checkpoint-every", "2", "--histogram-every", "0",
             "--logdir", logdir]
    assert _train(*flags).returncode == 0
    before = _tensors(logdir, 4)
    # resumed with a file-size limit far below a checkpoint's data file: the write of
    # step 6's checkpoint fails the way a full disk makes it fail
    proc = subprocess.run([sys.executable, "-m", "owt_tf.train", *flags[2:], "--steps", "8"],
                          capture_output=True, text=True, env=_env(), timeout=600,
                          preexec_fn=_file_size_limit(200_000))
    assert proc.returncode == 4, proc.stderr[-3000:]
    errors = [l for l in proc.stderr.splitlines() if "owt_tf.train: error" in l]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "could not write the checkpoint of step 6" in errors[0]
    assert "ckpt-4 is intact" in errors[0] and "File too large" in errors[0]
    assert not os.path.exists(os.path.join(logdir, "checkpoints", "ckpt-6_temp"))
    assert tf.train.latest_checkpoint(os.path.join(logdir, "checkpoints")).endswith("ckpt-4")
    _assert_bit_identical(_tensors(logdir, 4), before)
