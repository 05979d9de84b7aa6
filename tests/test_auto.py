"""`--scheme auto` / `scheme="auto"`: the planner's ranking picks scheme, FC exchange and loss
for the run's own hardware, model, K and batch; the run says what it chose."""
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import owt_tf
from owt_tf.models.cost import Uncountable, network_cost, trunk_cost
from owt_tf.planner import auto
from owt_tf.planner import cost_model
from owt_tf.planner.plan import SCHEMES, PlanError
from owt_tf.training.driver import StepDriver

from keras_models import alexnet_like, random_data


@pytest.fixture(scope="module")
def alexnet():
    return network_cost("alexnet", 1000)


def test_choice_is_the_first_row_of_plans_ranking(alexnet):
    hw = cost_model.preset("h100-nvlink")
    ranked = cost_model.rank(alexnet, hw, 8, 128)
    choice = auto.choose(alexnet, hw, 8, 128)
    assert choice.choice == ranked[0] and choice.runner_up == cost_model.runner_up(ranked)
    assert (choice.scheme, choice.fc_exchange, choice.loss) == (
        ranked[0].scheme, ranked[0].fc_exchange, ranked[0].loss)
    assert choice.runner_up.scheme != choice.scheme
    line = choice.line
    assert f"chose {choice.scheme}" in line
    assert f"{choice.choice.step_time_s * 1e3:.1f} ms/step" in line
    assert f"runner-up {choice.runner_up.scheme}" in line
    assert f"{choice.runner_up.step_time_s * 1e3:.1f} ms/step" in line


def test_the_fc_batch_mode_is_kept(alexnet):
    hw = cost_model.preset("k20-pcie")
    worker = auto.choose(alexnet, hw, 4, 128, fc_batch="worker")
    assert worker.scheme in ("owt-b", "owt-c") and worker.choice.fc_batch_mode == "worker"
    assert worker.runner_up.scheme in ("owt-b", "owt-c")


def test_fallback_when_the_model_cannot_be_counted():
    hw = cost_model.preset("k20-pcie")
    fallback = auto.choose(None, hw, 4, 32, hidden=(64,), note="cannot count X")
    assert (fallback.scheme, fallback.choice) == (auto.FALLBACK_SCHEME, None)
    assert "fallback" in fallback.line and "cannot count X" in fallback.line
    assert auto.choose(None, hw, 4, 32, hidden=(6,)).scheme == "data"  # 6 does not split 4 ways
    assert auto.choose(None, hw, 1, 32).scheme == "single"


@pytest.mark.parametrize("hardware", ["k20-pcie", "h100-nvlink"])
def test_a_huge_head_is_sharded_and_the_line_says_why(hardware):
    """A million classes: the class layer is 4.1 G of AlexNet's 4.15 G parameters; data
    parallelism would all-reduce them every step. The planner shards the head, ranks data
    below every model-parallel row, and the printed line names the head's share."""
    huge = network_cost("alexnet", 1_000_000)
    hw = cost_model.preset(hardware)
    ranked = cost_model.rank(huge, hw, 4, 32)
    data = next(i for i, p in enumerate(ranked) if p.scheme == "data")
    assert ranked[0].scheme in ("owt-a", "owt-b", "owt-c")
    assert all(p.scheme in ("owt-a", "owt-b", "owt-c") for p in ranked[:data])
    choice = auto.choose(huge, hw, 4, 32)
    assert choice.scheme == ranked[0].scheme
    assert "why: the head holds 4151.5 M of 4154.0 M parameters (99.9 %" in choice.line
    assert "the 1,000,000-class layer 4097.0 M" in choice.line
    assert auto.choose(network_cost("alexnet", 1000), hw, 1, 32).reason == ""  # single


def test_gpu_names_map_to_presets():
    assert auto.gpu_preset("NVIDIA H200") == "h200-nvlink"
    assert auto.gpu_preset("NVIDIA H100 80GB HBM3") == "h100-nvlink"
    assert auto.gpu_preset("Tesla K20c") == "k20-pcie"
    assert auto.gpu_preset("NVIDIA GeForce RTX 4090") is None


def test_a_user_trunk_is_counted_or_refused_by_name():
    model = alexnet_like()
    from owt_tf.models.split import split_keras_model

    split = split_keras_model(model)
    net = trunk_cost(split.trunk, int(np.prod(split.trunk.output_shape[1:])), split.head)
    flops = {l.name: l.flops for l in net.layers if l.kind in ("conv", "fc")}
    assert flops == {"conv1": 2 * 14 * 14 * 8 * 3 * 3 * 3, "conv2": 2 * 5 * 5 * 8 * 3 * 3 * 8,
                     "fc1": 2 * 200 * 32, "fc2": 2 * 32 * 16, "fc3": 2 * 16 * 10}
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.DepthwiseConv2D(3, name="depthwise")(inputs)
    with pytest.raises(Uncountable, match="depthwise"):
        trunk_cost(keras.Model(inputs, keras.layers.Flatten()(h)), 108, split.head)


def test_auto_resolves_to_a_valid_plan_on_logical_cpus(devices):
    hybrid = owt_tf.HybridStrategy(devices=devices[:2], scheme="auto", batch_size=8)
    assert hybrid.scheme == "auto"
    with pytest.raises(PlanError, match="auto"):
        hybrid.model_parallel  # noqa: B018 -- nothing is placed before the choice
    choice = hybrid.choose_scheme(lambda: network_cost("alexnet_tiny", 10))
    assert choice.scheme in SCHEMES and choice.scheme != "single" and hybrid.scheme == choice.scheme
    assert choice.hardware.startswith("this CPU (measured now")
    assert (hybrid.parallel_plan.fc_exchange, hybrid.parallel_plan.loss) == (choice.fc_exchange, choice.loss)
    rounds = StepDriver(hybrid).rounds
    assert rounds.num_replicas == 2 and rounds.batch_size == 8
    hw_ranked = choice.choice
    assert hw_ranked.devices == 2 and hw_ranked.batch_size == 8
    with pytest.raises(PlanError, match="once"):
        hybrid.choose_scheme(lambda: network_cost("alexnet_tiny", 10))


def test_parallelize_chooses_for_the_users_model_and_fits(devices, capsys):
    strategy = owt_tf.HybridStrategy(devices=devices[:2], scheme="auto")
    with strategy.scope():
        model = owt_tf.parallelize(alexnet_like(), seed=0)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    line = capsys.readouterr().out
    assert f"--scheme auto chose {strategy.scheme}" in line
    assert "why: the head holds" in line
    assert strategy.scheme in ("owt-a", "owt-b", "owt-c")  # parallelize shards the head
    x, y = random_data(32)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


@pytest.mark.slow
def test_train_scheme_auto_names_its_choice_and_records_it(tmp_path):
    logdir = tmp_path / "run"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-m", "owt_tf.train", "--scheme", "auto", "--devices", "2",
         "--batch-size", "16", "--steps", "3", "--eval-every", "0", "--logdir", str(logdir)],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((logdir / "run_config.json").read_text())["parallel"]
    assert saved["scheme"] in SCHEMES and saved["scheme"] != "single"
    lines = [l for l in proc.stdout.splitlines() if "--scheme auto chose" in l]
    assert len(lines) == 1 and f"chose {saved['scheme']}" in lines[0]
    assert "runner-up" in lines[0] and "ms/step" in lines[0]
    done = [l for l in proc.stdout.splitlines() if l.startswith("done: 3 steps")]
    assert done and f"| {saved['scheme']} on 2 devices" in done[0]


USER_MODELS = '''
import keras

def plain(num_classes):
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu", name="fc1"),
        keras.layers.Dense(num_classes, name="predictions"),
    ], name="plain_net")

def depthwise(num_classes):
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.DepthwiseConv2D(3, name="dw"),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu", name="fc1"),
        keras.layers.Dense(num_classes, name="predictions"),
    ], name="dw_net")
'''


@pytest.mark.parametrize("function,counted", [("plain", True), ("depthwise", False)])
def test_trainer_chooses_for_a_user_model_or_says_why_not(devices, tmp_path, monkeypatch,
                                                          capsys, function, counted):
    from owt_tf.config import RunConfig
    from owt_tf.training.loop import Trainer

    (tmp_path / "auto_user_models.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("auto_user_models", None)
    config = RunConfig.from_flags(model=f"auto_user_models:{function}", dataset="synthetic", devices=2,
                       scheme="auto", batch_size=8, steps=1, eval_every=0,
                       logdir=str(tmp_path / "run"))
    trainer = Trainer(config, devices=devices[:2])
    line = next(l for l in capsys.readouterr().out.splitlines() if "--scheme auto chose" in l)
    assert trainer.config.parallel.scheme in SCHEMES and trainer.hybrid.scheme == trainer.config.parallel.scheme
    assert f"chose {trainer.config.parallel.scheme}" in line
    if counted:
        assert "runner-up" in line and trainer.hybrid.auto_choice.choice is not None
    else:
        assert trainer.config.parallel.scheme == auto.FALLBACK_SCHEME
        assert "fallback" in line and "cannot count model" in line and "dw" in line
    trainer.fit(log=lambda text: None)
    assert int(trainer.step) == 1
