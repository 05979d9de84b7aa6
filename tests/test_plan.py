"""The cost model: per-layer costs read off the Keras model, the paper's speedups, the CLI.

That predicted bytes equal the byte ledger of real steps is checked in test_equivalence.py,
on the same runs that compare the engine with the single-device reference.
"""
import json
import os
import subprocess
import sys

import pytest

from owt_tf.models.cost import network_cost
from owt_tf.planner import cost_model
from owt_tf.planner import ledger

PAPER_SPEEDUPS = {(2, "owt-a"): 1.95, (2, "owt-c"): 1.93, (4, "owt-a"): 3.74, (4, "owt-c"): 3.66,
                  (8, "owt-a"): 6.25, (8, "owt-c"): 6.16}


@pytest.fixture(scope="module")
def alexnet():
    return network_cost("alexnet", 1000)


def test_alexnet_layer_costs_match_a_hand_count(alexnet):
    """Multiply-adds per example written out from the paper's (docs/paper.md) layer table (224x224 input)."""
    macs = {
        "conv1": 55 * 55 * 64 * 11 * 11 * 3,
        "conv2": 27 * 27 * 192 * 5 * 5 * 64,
        "conv3": 13 * 13 * 384 * 3 * 3 * 192,
        "conv4": 13 * 13 * 256 * 3 * 3 * 384,
        "conv5": 13 * 13 * 256 * 3 * 3 * 256,
        "fc1": 9216 * 4096, "fc2": 4096 * 4096, "fc3": 4096 * 1000,
    }
    got = {l.name: l.flops for l in alexnet.layers if l.kind in ("conv", "fc")}
    assert got == {name: 2 * m for name, m in macs.items()}
    assert alexnet.shape.trunk_params == 2_469_696 and alexnet.shape.fc_params == 58_631_144
    assert sum(l.params for l in alexnet.layers) == alexnet.params
    # docs/paper.md: conv ~90-95 % of the compute, ~5 % of the parameters
    assert 0.90 < alexnet.conv_train_flops / alexnet.train_flops < 0.95
    assert alexnet.shape.trunk_params / alexnet.params < 0.05


def test_paper_table_speedups_within_ten_percent(alexnet):
    hw = cost_model.preset("k20-pcie")
    rows = cost_model.paper_rows(alexnet, hw)
    assert {(r["devices"], r["scheme"]): r["paper"] for r in rows} == PAPER_SPEEDUPS
    for r in rows:
        assert abs(r["error"]) < 0.10, r


def test_k20_preset_reproduces_the_one_gpu_time(alexnet):
    """The only number taken from the paper's table: the 1-GPU row sets the sustained FLOP/s."""
    hw = cost_model.preset("k20-pcie")
    single = cost_model.predict(alexnet, hw, "single", 1, 128)
    steps = cost_model.PAPER_EPOCHS * cost_model.ILSVRC_TRAIN_IMAGES / 128
    assert single.step_time_s * steps / 3600 == pytest.approx(cost_model.PAPER_ONE_GPU_HOURS, rel=1e-9)
    assert 0 < hw.flops < cost_model.K20_PEAK_FLOPS


def test_only_the_round_schemes_overlap_exchange_with_fc_work(alexnet):
    hw = cost_model.preset("k20-pcie")
    for scheme in ("data", "owt-a", "owt-b", "owt-c"):
        p = cost_model.predict(alexnet, hw, scheme, 4, 128)
        assert (p.hidden_s > 0) == (scheme in ("owt-b", "owt-c"))
        assert p.hidden_s <= p.communication_s


def test_shared_link_serializes_the_workers(alexnet):
    hw = cost_model.preset("k20-pcie")
    switched = cost_model.Hardware(**{**hw.__dict__, "shared_link": False, "latency": 0.0})
    shared = cost_model.Hardware(**{**hw.__dict__, "latency": 0.0})
    a = cost_model.predict(alexnet, switched, "data", 8, 128)
    b = cost_model.predict(alexnet, shared, "data", 8, 128)
    assert b.communication_s == pytest.approx(8 * a.communication_s)
    assert a.communication_s == pytest.approx(a.bytes_per_step / hw.link_bandwidth)


def test_alternatives_priced_from_the_same_primitives(alexnet):
    hw = cost_model.preset("k20-pcie")
    data = cost_model.predict(alexnet, hw, "data", 4, 128)
    ps = cost_model.predict_alternative(alexnet, hw, "async-ps", 4, 128)
    assert ps.bytes_per_step == data.bytes_per_step  # push + pull of 1/K shards = an all-reduce
    mp2 = cost_model.predict_alternative(alexnet, hw, "model-parallel", 2, 128)
    grouped2 = cost_model.predict_alternative(alexnet, hw, "grouped-hybrid", 2, 128)
    assert grouped2.bytes_per_step == mp2.bytes_per_step  # one group of two is model parallel
    # model parallel over 2 devices moves every layer boundary once each way for 256 rows
    boundaries = [27 * 27 * 64, 13 * 13 * 192, 13 * 13 * 384, 13 * 13 * 256, 9216, 4096, 4096, 1000]
    want = sum(ledger.all_gather_cost(256 * f * 4 // 2, 2) + ledger.reduce_scatter_cost(256 * f * 4, 2)
               for f in boundaries)
    assert mp2.bytes_per_step == float(want)
    # the paper's point: with K=8 the hybrid beats every alternative that keeps synchronous SGD
    owt = cost_model.predict(alexnet, hw, "owt-c", 8, 128)
    for name in ("model-parallel", "grouped-hybrid"):
        assert owt.step_time_s < cost_model.predict_alternative(alexnet, hw, name, 8, 128).step_time_s
    assert owt.step_time_s < cost_model.predict(alexnet, hw, "data", 8, 128).step_time_s


def test_recommend_is_the_fastest_option(alexnet):
    hw = cost_model.preset("h100-nvlink")
    best = cost_model.recommend(alexnet, hw, 8, 128)
    for scheme in ("data", "owt-a", "owt-b", "owt-c"):
        assert best.step_time_s <= cost_model.predict(alexnet, hw, scheme, 8, 128).step_time_s
    assert best.flags.startswith(f"--devices 8 --batch-size 128 --scheme {best.scheme}")
    ranked = cost_model.rank(alexnet, hw, 8, 128)
    assert ranked[0] == best and ranked == sorted(ranked, key=lambda p: p.step_time_s)
    second = cost_model.runner_up(ranked)
    assert second.scheme != best.scheme and second.step_time_s >= best.step_time_s
    # every runnable configuration is a candidate: 1 data + 4 owt-a + 8 owt-b + 8 owt-c
    assert len({p.key for p in ranked}) == len(ranked) == 21


def test_candidates_respect_what_the_model_and_batch_allow(alexnet):
    hw = cost_model.preset("k20-pcie")
    # 4096-wide hidden layers do not split 3 ways and 128 rows do not: data parallel only
    assert {p.scheme for p in cost_model.rank(alexnet, hw, 3, 128)} == {"data"}
    assert "owt-c" not in {p.scheme for p in cost_model.rank(alexnet, hw, 8, 12)}
    only_global = cost_model.rank(alexnet, hw, 8, 128, fc_batches=("global",))
    assert {p.fc_batch_mode for p in only_global} == {"global"}
    assert [p.scheme for p in cost_model.rank(alexnet, hw, 1, 128)] == ["single"]


def _run(*args, timeout=300):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "owt_tf.plan", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_cli_json_records_on_measured_cpu():
    proc = _run("--model", "alexnet_tiny", "--classes", "10", "--devices", "1,2", "--batch-size", "8",
                "--hardware", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = json.loads(proc.stdout)
    keys = {"scheme", "devices", "fc_batch", "step_time_s", "images_per_sec", "speedup", "bytes_per_step"}
    assert all(keys <= set(r) for r in records)
    by = {(r["devices"], r["scheme"]): r for r in records}
    assert by[(1, "single")]["speedup"] == 1.0 and by[(1, "single")]["bytes_per_step"] == 0
    for scheme in ("data", "owt-a", "owt-b", "owt-c", "model-parallel", "async-ps", "grouped-hybrid"):
        assert by[(2, scheme)]["step_time_s"] > 0
    # train's default --fc-batch global: one FC update on all B*K rows
    assert by[(2, "owt-b")]["fc_batch"] == 16 and by[(2, "owt-b")]["fc_batch_mode"] == "global"
    assert by[(2, "owt-a")]["fc_batch"] == 16


def test_plan_fc_batch_default_is_trains():
    from owt_tf.config import RunConfig
    from owt_tf.plan import build_parser

    args = build_parser().parse_args([])
    assert args.fc_batch == RunConfig().parallel.fc_batch == "global"
    assert (args.fc_exchange, args.loss) == (RunConfig().parallel.fc_exchange, RunConfig().parallel.loss)
    assert args.dataset == RunConfig().data.dataset


def test_recommendation_is_a_table_row_and_a_runnable_command():
    """plan --recommend: per K, the choice's and runner-up's figures are those of rows of
    the table itself, and the printed command parses and validates as train's flags."""
    import shlex

    from owt_tf.cli import parse_config

    ks = (1, 2, 4, 8)
    proc = _run("--recommend", "--json", "--devices", ",".join(map(str, ks)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    payload = json.loads(proc.stdout)
    rows = payload["records"]
    for k in ks:
        rec = payload["recommend"][str(k)]
        for pick in (rec["choice"], rec["runner_up"]) if k > 1 else (rec["choice"],):
            same = [r for r in rows if all(r[f] == pick[f] for f in
                                           ("devices", "scheme", "fc_batch_mode", "fc_exchange", "loss"))]
            assert len(same) == 1, (k, pick)
            for field in ("step_time_s", "speedup", "images_per_sec", "bytes_per_step", "fc_batch"):
                assert same[0][field] == pick[field], (k, field)
        choice = rec["choice"]
        owt_rows = [r for r in rows if r["devices"] == k and (r["scheme"] in
                    ("data", "owt-a", "owt-b", "owt-c") or k == 1)]
        assert choice["step_time_s"] == min(r["step_time_s"] for r in owt_rows)
        command = shlex.split(rec["command"])
        assert command[:3] == ["python", "-m", "owt_tf.train"]
        config = parse_config(command[3:]).validate()
        assert (config.parallel.scheme, config.parallel.devices) == (choice["scheme"], 1 if k == 1 else k)
        assert config.global_batch_size == 128 * k and config.data.dataset == "digits"
        if k > 1:
            assert (config.parallel.fc_exchange, config.parallel.loss) == (choice["fc_exchange"], choice["loss"])
            assert config.parallel.fc_batch == choice["fc_batch_mode"]
    proc = _run("--recommend", "--devices", "8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("recommend K=8:"))
    best = payload["recommend"]["8"]["choice"]
    assert f"({best['step_time_s'] * 1e3:.1f} ms/step, {best['speedup']:.2f}x)" in line
    assert payload["recommend"]["8"]["command"] in proc.stdout


def test_cli_table_paper_and_recommend():
    proc = _run("--paper", "--recommend", "--devices", "1,8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "paper K=8 (1024, 128)" in proc.stdout
    assert "recommend K=8:" in proc.stdout and "runner-up" in proc.stdout
    assert "python -m owt_tf.train --model alexnet --dataset digits --devices 8" in proc.stdout


@pytest.mark.parametrize("args,flag", [
    (("--devices", "0"), "--devices"),
    (("--devices", "2,x"), "--devices"),
    (("--hardware", "tpu"), "--hardware"),
    (("--batch-size", "6", "--devices", "4"), "--batch-size"),
    (("--link-bandwidth", "-1"), "--link-bandwidth"),
    (("--latency", "-1"), "--latency"),
])
def test_cli_rejects_bad_flags_in_one_line(args, flag):
    proc = _run(*args, timeout=120)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if "error" in l]
    assert len(lines) == 1 and flag in lines[0], proc.stderr
