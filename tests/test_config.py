"""Bad configurations fail before anything is built: one line naming the flag, exit code 2."""
import os
import subprocess
import sys

import pytest

from owt_tf.config import ConfigError, RunConfig, imagenet_paper

BAD = [
    (dict(scheme="owt-d"), "--scheme"),
    (dict(model="resnet"), "--model"),
    (dict(dataset="imagenet1999"), "--dataset"),
    (dict(devices=0), "--devices"),
    (dict(devices=-2), "--devices"),
    (dict(scheme="owt-c", devices=4, batch_size=6), "--batch-size"),
    (dict(scheme="owt-a", fc_batch="worker"), "--fc-batch"),
    (dict(scheme="data", fc_batch="worker"), "--fc-batch"),
    (dict(scheme="single", devices=2), "--devices"),
    (dict(fc_exchange="ring"), "--fc-exchange"),
    (dict(lr_scaling="cubic"), "--lr-scaling"),
    (dict(lr_batch=0), "--lr-batch"),
    (dict(lr=float("nan")), "--lr"),
    (dict(momentum=1.0), "--momentum"),
    (dict(dropout=1.0), "--dropout"),
    (dict(batch_size=0), "--batch-size"),
    (dict(steps=0), "--steps"),
    # 2 workers x 3 devices: K = 6 does not divide the FC width 256
    (dict(cluster="127.0.0.1:1,127.0.0.1:2", task_index=0, devices=3), "--devices"),
    (dict(cluster="127.0.0.1:1,127.0.0.1:2", task_index=0, scheme="owt-c", devices=2,
          batch_size=6), "--batch-size"),
    (dict(cluster="127.0.0.1:1,127.0.0.1:2", task_index=0), "--logdir"),
    (dict(cluster="127.0.0.1:1,127.0.0.1:2", task_index=2), "--task-index"),
    (dict(cluster="127.0.0.1:1,nonsense"), "--cluster"),
    (dict(task_index=1), "--task-index"),
]


@pytest.mark.parametrize("changes,flag", BAD, ids=[f for _, f in BAD])
def test_invalid_config_names_the_flag(changes, flag):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_flags(**changes).validate()
    assert err.value.flag == flag
    assert str(err.value).startswith(flag)


def test_fc_width_not_divisible_by_devices():
    with pytest.raises(ConfigError, match="FC width 256 is not divisible by 3"):
        RunConfig.from_flags(devices=3, scheme="owt-a").validate()
    RunConfig.from_flags(devices=3, scheme="data").validate()  # mirrored FC layers are not split
    RunConfig.from_flags(devices=4, scheme="owt-b").validate()  # 10 classes over 4: padded, allowed


def test_learning_rates_follow_the_batch():
    c = RunConfig.from_flags(lr=0.01, lr_batch=32, batch_size=32, devices=4, scheme="owt-b", lr_scaling="linear")
    assert c.conv_lr == pytest.approx(0.04) and c.fc_lr == pytest.approx(0.04)
    w = c.replace(fc_batch="worker")  # FC batch 32: the rate for 32
    assert w.conv_lr == pytest.approx(0.04) and w.fc_lr == pytest.approx(0.01)
    s = c.replace(lr_scaling="sqrt")
    assert s.conv_lr == pytest.approx(0.02)
    assert c.replace(lr_scaling="none").conv_lr == pytest.approx(0.01)


@pytest.mark.parametrize("devices,batch_size", [(1, 64), (2, 32), (4, 16), (8, 8)])
def test_the_same_global_batch_gives_the_same_rates_at_any_k(devices, batch_size):
    c = RunConfig.from_flags(lr=0.04, lr_batch=128, devices=devices, batch_size=batch_size, fc_batch="global")
    assert c.conv_lr == pytest.approx(0.02) and c.fc_lr == pytest.approx(0.02)


def test_the_paper_preset_keeps_the_papers_rates():
    # 0.01 for 128 per worker: conv rate x K on the 128K batch, FC rate 0.01 on its 128
    for k in (1, 2, 8):
        c = imagenet_paper().replace(devices=k)
        assert c.conv_lr == pytest.approx(0.01 * k) and c.fc_lr == pytest.approx(0.01)


def _cli(*args, cwd):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "owt_tf.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


CLI_BAD = [
    (["--scheme", "owt-z"], "--scheme"),
    (["--model", "vgg99"], "--model"),
    (["--dataset", "mnist-9"], "--dataset"),
    (["--devices", "0"], "--devices"),
    (["--scheme", "owt-c", "--devices", "4", "--batch-size", "6"], "--batch-size"),
    (["--devices", "3"], "--devices"),  # alexnet_tiny's FC width 256 over 3 devices
    (["--batch-size", "many"], "--batch-size"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--skip-nonfinite", "-1"], "--skip-nonfinite"),
    (["--deterministic", "--jit"], "--deterministic"),
    (["--lr", "nan"], "--lr"),
    (["--momentum", "1.0"], "--momentum"),
    (["--epochs", "0"], "--epochs"),
    (["--profile-steps", "5:2"], "--profile-steps"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
    (["--lr-schedule", "step", "--lr-decay-epochs", "60,30"], "--lr-decay-epochs"),
    (["--dropout", "1.5"], "--dropout"),
    (["--scheme", "owt-a", "--fc-batch", "worker"], "--fc-batch"),
    (["--cluster", "127.0.0.1:1,127.0.0.1:2"], "--task-index"),
]


@pytest.mark.parametrize("args,flag", CLI_BAD, ids=[a[1] for a in CLI_BAD])
def test_cli_rejects_bad_flags_in_one_line(tmp_path, args, flag):
    before = set(os.listdir(tmp_path))
    proc = _cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "error" in lines[0] and flag in lines[0], proc.stderr
    assert proc.stdout == ""
    assert set(os.listdir(tmp_path)) == before  # nothing written


def test_a_mistyped_flag_gets_a_suggestion_and_launch_says_where_train_flags_go(tmp_path):
    proc = _cli("--batch-sise", "3", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().endswith("(did you mean --batch-size?)"), proc.stderr
    far = _cli("--zzz", cwd=tmp_path)
    assert far.returncode == 2 and "did you mean" not in far.stderr, far.stderr
    launch = subprocess.run([sys.executable, "-m", "owt_tf.launch", "--workers", "2", "--steps", "5"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert launch.returncode == 2 and "flags go after --" in launch.stderr, launch.stderr
    assert launch.stdout == "" and os.listdir(tmp_path) == []  # nothing started or written


def test_cli_dataset_and_output_errors_in_one_line(tmp_path):
    """Errors found once TensorFlow is up: still exit 2, one error line, nothing written."""
    busy = tmp_path / "busy_export"  # a file where the model base path should be
    busy.write_text("keep")
    empty_label = tmp_path / "imgs"
    (empty_label / "train" / "cat").mkdir(parents=True)
    (empty_label / "validation").mkdir()
    cases = [
        (["--dataset", "imagenet2012"], "--manual-dir"),
        (["--dataset", "imagenet2012", "--manual-dir", str(tmp_path)], "ILSVRC2012_img_train.tar"),
        (["--dataset", f"folder:{empty_label}"], "has no images"),
        (["--export-dir", str(busy)], "--export-dir"),
        (["--dataset", "tfds:mnist", "--data-dir", str(tmp_path / "nothing")], "not prepared"),
    ]
    work = tmp_path / "cwd"
    work.mkdir()
    for args, needle in cases:
        proc = _cli(*args, "--logdir", str(work / "run"), cwd=work)
        errors = [line for line in proc.stderr.splitlines() if "owt_tf.train: error" in line]
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert len(errors) == 1 and needle in errors[0], (args, proc.stderr[-2000:])
        assert not (work / "run").exists() and os.listdir(work) == []
    assert busy.read_text() == "keep"


def _unwritable_dir(tmp_path):
    """A directory this process cannot write: a read-only folder, or for root (who ignores
    permissions) a kernel filesystem that refuses new files."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        (ro / "keep").write_text("keep")
        ro.chmod(0o555)
        return ro
    return "/sys"


def test_cli_refuses_logdirs_it_cannot_use(tmp_path):
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("keep")
    cases = [(a_file, "not a directory"), (a_file / "run", "not a directory"),
             (os.path.join(str(_unwritable_dir(tmp_path)), "owt_run"), "cannot write")]
    work = tmp_path / "cwd"
    work.mkdir()
    for logdir, needle in cases:
        proc = _cli("--logdir", str(logdir), cwd=work)
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2, (logdir, proc.stderr)
        assert len(lines) == 1 and "--logdir" in lines[0] and needle in lines[0], proc.stderr
        assert os.listdir(work) == []
    assert a_file.read_text() == "keep"
