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
    with pytest.raises(ConfigError, match="FC layer 1: width 256 is not divisible by 3"):
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


def test_flags_are_routed_to_their_sections():
    c = RunConfig.from_flags(devices=4, scheme="owt-a", lr=0.1, dataset="synthetic",
                             dropout=0.0, steps=7, cluster="127.0.0.1:1,127.0.0.1:2",
                             task_index=1, logdir="runs/x")
    assert (c.parallel.devices, c.parallel.scheme, c.optimizer.lr) == (4, "owt-a", 0.1)
    assert (c.data.dataset, c.model.dropout, c.run.steps) == ("synthetic", 0.0, 7)
    assert (c.cluster.addresses, c.cluster.task_index, c.num_workers) == ("127.0.0.1:1,127.0.0.1:2", 1, 2)
    changed = c.replace(devices=2, lr=0.2)
    assert (changed.parallel.devices, changed.optimizer.lr, changed.parallel.scheme) == (2, 0.2, "owt-a")
    assert c.parallel.devices == 4  # a copy
    assert changed.replace(cluster=None, task_index=None).num_workers == 1
    assert RunConfig.from_flags(**c.to_flags()) == c
    with pytest.raises(TypeError, match="no flag 'devicez'"):
        RunConfig.from_flags(devicez=2)


def test_the_cluster_is_resolved_once_from_the_environment(monkeypatch):
    tf_config = ('{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, '
                 '"task": {"type": "worker", "index": 1}}')
    monkeypatch.setenv("TF_CONFIG", tf_config)
    c = RunConfig.from_flags(devices=2, logdir="runs/x")
    assert (c.num_workers, c.num_replicas, c.cluster.resolved.worker_id) == (2, 4, 1)
    monkeypatch.delenv("TF_CONFIG")  # held by the config, not read again
    assert c.validate().num_workers == 2
    assert RunConfig.from_flags(devices=2).num_workers == 1


def test_validate_writes_nothing_and_loads_no_model(tmp_path):
    """No probe file in the logdir's parent, no model built (Keras is never imported)."""
    code = ("import sys\n"
            "from owt_tf.config import RunConfig, ConfigError\n"
            f"RunConfig.from_flags(logdir={str(tmp_path / 'run')!r}, scheme='owt-a').validate()\n"
            "try:\n"
            "    RunConfig.from_flags(devices=3, scheme='owt-a').validate()\n"
            "except ConfigError as err:\n"
            "    print(err)\n"
            "print(sorted(m for m in ('keras', 'tensorflow') if m in sys.modules))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "--devices: model alexnet_tiny's FC layer 1: width 256 is not divisible by 3 devices", "[]"]
    assert os.listdir(tmp_path) == []


def test_the_fc_width_table_matches_the_models():
    from owt_tf.models.registry import FC_WIDTHS, MODEL_NAMES, build_model

    assert set(FC_WIDTHS) == set(MODEL_NAMES)
    for name in MODEL_NAMES:
        assert tuple(build_model(name, num_classes=3).head.hidden) == FC_WIDTHS[name], name


def test_text_flags_are_parsed_once_into_values():
    from owt_tf.cli import parse_config

    c = parse_config(["--lr-decay-epochs", "5,7.5", "--profile-steps", "3:9"])
    assert c.optimizer.lr_decay_epochs == (5.0, 7.5) and c.run.profile_steps == (3, 9)
    assert parse_config([]).optimizer.lr_decay_epochs == (30.0, 60.0, 80.0)
    with pytest.raises(ConfigError, match="--lr-decay-epochs: must be increasing"):
        RunConfig.from_flags(lr_decay_epochs=(3.0, 1.0)).validate()
    with pytest.raises(ConfigError, match="--profile-steps: need 1 <= A <= B"):
        RunConfig.from_flags(profile_steps=(4, 2)).validate()
    big = parse_config(["--dataset", "synthetic", "--classes", "100000"]).validate()
    assert big.data.classes == 100_000  # an int, as from_flags gives it


def test_presets_are_configs_and_flags_override_them():
    from owt_tf.cli import parse_config
    from owt_tf.config import PRESETS, demo

    assert demo() == RunConfig() and set(PRESETS) == {
        "demo", "imagenet-paper", "faces", "ms1mv3-r50", "ms1mv3-r100", "glint360k-r100",
        "wf42m-pfc0.2-r100", "ms1mv3-mbf"}
    paper = imagenet_paper()
    assert (paper.model.model, paper.data.dataset, paper.parallel.fc_batch) == (
        "alexnet", "imagenet2012", "worker")
    given = parse_config(["--preset", "imagenet-paper", "--lr", "0.5", "--scheme", "owt-c"])
    assert given == paper.replace(lr=0.5, scheme="owt-c")


def test_run_config_dict_round_trip_and_the_old_flat_layout():
    c = RunConfig.from_flags(devices=4, lr_decay_epochs=(1.0, 2.0), profile_steps=(2, 3),
                             model="vgg_tiny")
    import json

    saved = json.loads(json.dumps(c.to_dict()))
    assert set(saved) == {"model", "data", "parallel", "optimizer", "run", "cluster"}
    assert RunConfig.from_dict(saved) == c
    flat = {"model": "vgg_tiny", "devices": 4, "lr_decay_epochs": "1,2", "profile_steps": "2:3",
            "num_classes": 10, "removed_flag": True}
    assert RunConfig.from_dict(flat) == c


def test_help_is_grouped_by_section_with_every_flag_once():
    from owt_tf.cli import build_train_parser
    from owt_tf.config import FLAG_FIELDS

    parser = build_train_parser()
    titles = [g.title for g in parser._action_groups]
    assert {"model", "data", "parallel plan", "optimizer", "run", "cluster"} <= set(titles)
    flags = [s for a in parser._actions for s in a.option_strings if not s.startswith("--no-")]
    expected = {"--" + name.replace("_", "-") for name in FLAG_FIELDS} | {"-h", "--help", "--preset"}
    assert sorted(flags) == sorted(expected)
    text = " ".join(parser.format_help().split())
    assert "examples per replica (device) per step (B)" in text and "(default: 30,60,80)" in text
