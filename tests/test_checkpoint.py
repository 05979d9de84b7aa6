"""Checkpoints: resume gives the weights of never stopping, also at another K; wrong logdirs refused."""
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from owt_tf.config import RunConfig
from owt_tf.parallel.head import state as head_state
from owt_tf.training.loop import Trainer
from reference import rel_err


def _fit(devices, config, steps):
    trainer = Trainer(config, devices=devices[:config.parallel.devices])
    trainer.fit(steps=steps, log=lambda line: None, progress=False)
    return trainer


def _assert_same_weights(a, b, tol=1e-5):
    for x, y in zip(a["trunk"], b["trunk"], strict=True):
        assert rel_err(x, y) < tol
    for (xk, xb), (yk, yb) in zip(a["head"], b["head"], strict=True):
        assert rel_err(xk, yk) < tol and rel_err(xb, yb) < tol


@pytest.mark.slow
def test_saved_at_four_devices_resumes_at_two(devices, tmp_path):
    """FC shards and momenta are saved whole and re-split; fc_batch=global, the same global
    batch. With the default --lr and linear scaling: the rates follow the global batch (16),
    not K (scaled by K or by the per-replica batch, the resumed steps would differ)."""
    common = dict(fc_batch="global", lr_scaling="linear", dropout=0.0, eval_every=0,
                  checkpoint_every=0, seed=4, steps=8)
    k4 = RunConfig.from_flags(scheme="owt-a", devices=4, batch_size=4, **common)
    never_stopped = _fit(devices, k4.replace(logdir=str(tmp_path / "k4")), 8)
    moved = str(tmp_path / "moved")
    _fit(devices, k4.replace(logdir=moved), 4)
    at_two = _fit(devices, RunConfig.from_flags(scheme="owt-c", devices=2, batch_size=8, logdir=moved,
                                                **common), 8)
    assert at_two.resumed_from.endswith("ckpt-4")
    _assert_same_weights(at_two.model.full_weights(), never_stopped.model.full_weights())


@pytest.mark.parametrize("k_from,k_to", [(4, 2)])  # 2 -> 4: the Keras path's test
def test_a_sampled_cli_run_resumes_at_another_k(devices, tmp_path, k_from, k_to):
    """The CLI's Partial FC run (--sample-rate 0.25, its class layer kept class-major on
    the shards): the checkpoint holds the head and its momentum whole, so another K
    restores exactly what was saved and goes on training from that step."""
    common = dict(scheme="owt-b", fc_batch="global", loss="sharded", sample_rate=0.25,
                  dropout=0.0, eval_every=0, checkpoint_every=0, seed=5)
    logdir = str(tmp_path / "run")
    first = _fit(devices, RunConfig.from_flags(devices=k_from, batch_size=16 // k_from, steps=3,
                                               logdir=logdir, **common), 3)
    saved = first.model.full_weights()
    saved_momentum = head_state.head_arrays(first.model.head, first.optimizer.fc)
    config = RunConfig.from_flags(devices=k_to, batch_size=16 // k_to, steps=5, logdir=logdir,
                                  **common)
    resumed = Trainer(config, devices=devices[:k_to])
    assert resumed.resumed_from.endswith("ckpt-3") and resumed.model.head.num_shards == k_to
    assert resumed.model.head.layers[-1].class_major
    _assert_same_weights(resumed.model.full_weights(), saved, tol=1e-12)
    restored = head_state.head_arrays(resumed.model.head, resumed.optimizer.fc)
    last = len(resumed.model.head.layers) - 1
    for key in (f"fc{last}_kernel_slot0", f"fc{last}_bias_slot0"):
        assert rel_err(restored[key], saved_momentum[key]) == 0
    resumed.fit(steps=5, log=lambda line: None, progress=False)
    assert int(resumed.step) == 5
    after = resumed.model.full_weights()["head"][-1][0]
    assert 0 < rel_err(after, saved["head"][-1][0]) < 1


@pytest.mark.slow
def test_logdir_of_another_model_is_refused_and_kept(devices, tmp_path):
    logdir = tmp_path / "run"
    _fit(devices, RunConfig.from_flags(steps=2, eval_every=0, logdir=str(logdir), devices=2, batch_size=8), 2)
    before = sorted(os.listdir(logdir / "checkpoints"))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-m", "owt_tf.train", "--model", "vgg_tiny",
                           "--logdir", str(logdir), "--steps", "2"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "owt_tf.train: error" in line]
    assert len(errors) == 1 and "--logdir" in errors[0] and "alexnet_tiny" in errors[0]
    assert sorted(os.listdir(logdir / "checkpoints")) == before


# run_config.json as versions before the config sections wrote it: every flag at the top
# level (--lr-decay-epochs and --profile-steps as typed), the checkpoints' identity beside them.
OLD_FLAT_RUN_CONFIG = {
    "model": "alexnet_tiny", "dataset": "digits", "data_dir": None, "manual_dir": None,
    "download": False, "augment": "auto", "devices": 2, "scheme": "owt-b", "batch_size": 8,
    "fc_batch": "global", "fc_exchange": "gather", "loss": "gathered", "steps": 2,
    "epochs": None, "lr": 0.02, "lr_batch": 128, "lr_scaling": "linear",
    "lr_schedule": "step", "lr_decay_epochs": "10,20", "warmup_epochs": 0.0, "momentum": 0.9,
    "weight_decay": 5e-4, "dropout": 0.25, "seed": 5, "eval_every": 0, "jit": False,
    "logdir": None, "checkpoint_every": 200, "export_dir": None, "log_every": 10,
    "histogram_every": 200, "profile_steps": "1:2", "device_type": "auto",
    "deterministic": False, "skip_nonfinite": 0, "cluster": "127.0.0.1:1,127.0.0.1:2",
    "task_index": 0, "verbose": False, "num_classes": 10, "a_flag_since_removed": 1}


def test_a_run_with_the_old_flat_run_config_still_loads_and_resumes(devices, tmp_path):
    """Runs written before run_config.json had sections: evaluate/export (load_run) read
    them, and a resumed run accepts their checkpoints."""
    import json

    from owt_tf.training.files.checkpoint import CONFIG_FILE
    from owt_tf.training.runs import load_run

    logdir = tmp_path / "old"
    config = RunConfig.from_flags(steps=2, eval_every=0, logdir=str(logdir), devices=2,
                                  batch_size=8, seed=5, dropout=0.25)
    _fit(devices, config, 2)
    written = json.loads((logdir / CONFIG_FILE).read_text())
    assert written["parallel"]["batch_size"] == 8 and written["identity"]["num_classes"] == 10
    (logdir / CONFIG_FILE).write_text(json.dumps(OLD_FLAT_RUN_CONFIG))

    loaded = load_run(str(logdir))
    assert loaded.resumed_from.endswith("ckpt-2")
    got = loaded.config
    assert (got.run.seed, got.model.dropout, got.optimizer.lr) == (5, 0.25, 0.02)
    assert got.optimizer.lr_decay_epochs == (10.0, 20.0) and got.run.profile_steps == (1, 2)
    # one device in this process, no cluster joined, whatever the run was
    assert (got.parallel.devices, got.num_workers, got.run.logdir) == (1, 1, str(logdir))

    resumed = _fit(devices, config.replace(steps=3), 3)  # the flat identity is accepted
    assert resumed.resumed_from.endswith("ckpt-2") and int(resumed.step) == 3


def test_checkpoints_use_the_keras_files_keys_and_old_momentum_names_still_load(devices, tmp_path):
    """Resuming equals training in one go, dropout on (its masks are seeded by the step,
    restored with it). One key scheme for the head's state (owt_tf.parallel.head.state): a
    CLI checkpoint names SGD's momentum as slot 0, as a Keras weights file does; a
    checkpoint written with the names of earlier versions (fc{i}_kernel_momentum) resumes
    exactly (the resume here reads those names; the K-change test and the CLI's
    tests/test_reliability.py resume from today's)."""
    assert RunConfig.from_flags().model.dropout > 0
    base = RunConfig.from_flags(scheme="owt-b", devices=2, batch_size=8, fc_batch="worker",
                                steps=8, eval_every=0, checkpoint_every=0, seed=5)
    whole = _fit(devices, base.replace(logdir=str(tmp_path / "whole")), 8)
    old_dir = str(tmp_path / "old")
    first = _fit(devices, base.replace(logdir=old_dir), 4)
    path = first.checkpoints.manager.latest_checkpoint
    names = {n.split("/.ATTRIBUTES/")[-1] for n, _ in tf.train.list_variables(path)
             if n.startswith("fc/")}
    assert {"fc0_kernel", "fc0_kernel_slot0", "fc2_bias_slot0", "fc_optimizer_kind"} <= names
    first.checkpoints.fc_state.legacy = True  # rewrite it as earlier versions named it
    first.checkpoints.checkpoint.write(path)
    legacy = {n.split("/.ATTRIBUTES/")[-1] for n, _ in tf.train.list_variables(path)
              if n.startswith("fc/")}
    assert "fc0_kernel_momentum" in legacy and not any("slot" in n for n in legacy)
    resumed = _fit(devices, base.replace(logdir=old_dir), 8)
    assert resumed.resumed_from.endswith("ckpt-4")
    _assert_same_weights(resumed.model.full_weights(), whole.model.full_weights())
    resumed.checkpoints.manager.save(checkpoint_number=9)  # saves in the current names again
    assert "fc0_kernel_slot0" in {n.split("/.ATTRIBUTES/")[-1] for n, _ in
                                  tf.train.list_variables(resumed.checkpoints.manager.latest_checkpoint)}
