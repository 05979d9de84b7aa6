"""The benchmark tool: its JSON records, and bytes that agree with the traffic formula."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from owt_tf.planner import traffic

KEYS = {"model", "scheme", "devices", "batch_size", "fc_batch", "jit", "images_per_sec",
        "step_time_s", "bytes_per_step", "peak_memory_bytes"}


def test_bench_writes_records_side_by_side(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-m", "owt_tf.bench", "--devices", "2", "--schemes", "single,data,owt-b",
         "--batch-size", "8", "--classes", "10", "--steps", "2", "--warmup", "1", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert [r["scheme"] for r in records] == ["single", "data", "owt-b"]
    for r in records:
        assert KEYS <= set(r)
        assert r["step_time_s"] > 0 and r["images_per_sec"] > 0
    single, data, owt_b = records
    assert single["devices"] == 1 and single["batch_size"] == 16 and single["bytes_per_step"] == 0
    assert owt_b["devices"] == 2 and owt_b["batch_size"] == 8
    net = traffic.NetworkShape(51_024, 288, (256, 256), 10)
    for r in (data, owt_b):
        want = traffic.total(traffic.step_traffic(net, r["scheme"], 2, 8))
        assert r["bytes_per_step"] == float(want)
    assert "owt-b" in proc.stdout and "MB/step" in proc.stdout


def test_bench_rejects_unknown_scheme():
    proc = subprocess.run([sys.executable, "-m", "owt_tf.bench", "--schemes", "owt-q"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--schemes" in proc.stderr


def test_big_head_runs_both_trainers_in_fresh_processes(tmp_path):
    """`--big-head` at a tiny size: owt_tf (parallelize + fit, the head as 2 shards, loss on
    the shards, no logits gather) and plain Keras under MirroredStrategy each train in their
    own process, and the ratios are the quotients of their figures. Same model, weights and
    batches: the losses fit reports agree, so the owt process really trained."""
    from owt_tf.planner import ledger

    out = tmp_path / "big_head.json"
    proc = subprocess.run(
        [sys.executable, "-m", "owt_tf.bench", "--big-head", "--classes", "64", "--devices", "2",
         "--batch-size", "8", "--steps", "2", "--warmup", "1", "--out", str(out)],
        capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    owt, mirrored = data["records"]
    assert (owt["runner"], mirrored["runner"]) == ("owt_tf", "mirrored")
    for r in (owt, mirrored):
        assert r["classes"] == 64 and r["devices"] == 2 and r["global_batch"] == 16
        assert r["steps"] == 2 and len(r["step_times_s"]) == 2 and r["step_time_s"] > 0
        assert r["peak_rss_bytes"] >= r["baseline_rss_bytes"] > 0
        assert len(r["losses"]) == 3 and r["bytes_per_step"] > 0
    assert owt["how"].startswith("owt_tf.parallelize owt-b")
    assert (owt["loss_mode"], owt["head_shards"]) == ("sharded", 2)
    # gathering the logits: each device's [16 rows, 32 classes] shard to the other
    gathered_logits = ledger.all_gather_cost(16 * 32 * 4, 2)
    assert 0 < owt["bytes_by_purpose"]["logits"] < gathered_logits / 4
    assert mirrored["bytes_by_purpose"]["fc_grad"] == ledger.all_reduce_cost((256 * 64 + 64) * 4, 2)
    np.testing.assert_allclose(owt["losses"], mirrored["losses"], rtol=1e-4)
    ratios = data["ratios"]
    assert ratios["peak_rss"] == owt["peak_rss_bytes"] / mirrored["peak_rss_bytes"]
    assert ratios["step_time"] == owt["step_time_s"] / mirrored["step_time_s"]
    assert "owt_tf / MirroredStrategy: peak memory" in proc.stdout


@pytest.mark.slow
def test_big_head_times_owt_tf_at_each_sample_rate(tmp_path):
    """`--big-head --sample-rates 1,0.25 --baseline none`: owt_tf alone, once per Partial FC
    rate, each in its own process; the rate-0.25 run's step time and peak RSS are printed and
    written over rate 1's. Same weights and batches: the first batch's loss differs (the
    sampled softmax's is below the full one's)."""
    out = tmp_path / "big_head.json"
    proc = subprocess.run(
        [sys.executable, "-m", "owt_tf.bench", "--big-head", "--classes", "256", "--devices", "2",
         "--batch-size", "8", "--steps", "2", "--warmup", "1", "--baseline", "none",
         "--sample-rates", "1,0.25", "--save-weights", "--out", str(out)],
        capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    full, sampled = data["records"]
    assert [r["runner"] for r in data["records"]] == ["owt_tf", "owt_tf"]
    assert (full["sample_rate"], sampled["sample_rate"]) == (1.0, 0.25)
    assert sampled["how"].endswith("sample_rate 0.25") and "sample_rate" not in full["how"]
    assert sampled["losses"][0] < full["losses"][0]
    # --save-weights: each run's peak after writing and after reading its weights file,
    # measured after training's (which the record keeps apart)
    for r in (full, sampled):
        assert r["load_peak_rss_bytes"] >= r["save_peak_rss_bytes"] >= r["peak_rss_bytes"] > 0
    assert "MB after save_weights" in proc.stdout
    assert data["ratios"] is None
    assert data["sampling_ratios"] == {"0.25": {
        "step_time": sampled["step_time_s"] / full["step_time_s"],
        "peak_rss": sampled["peak_rss_bytes"] / full["peak_rss_bytes"]}}
    assert "owt_tf sample_rate 0.25 / 1: step time" in proc.stdout
    # the classes x sample rate grid: one row for 256 classes, a cell per rate
    row = next(line for line in proc.stdout.splitlines() if line.strip().startswith("256 |"))
    assert row.count("/") == 2 and "not run" not in row


def test_big_head_rejects_a_sample_rate_outside_zero_to_one():
    proc = subprocess.run([sys.executable, "-m", "owt_tf.bench", "--big-head", "--sample-rates",
                           "1,1.5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--sample-rates: must be a number in (0, 1]" in proc.stderr


@pytest.mark.slow
def test_first_step_and_keras_step_benchmarks_write_their_records(tmp_path):
    """`--first-step` times each K's first step in a fresh process (the graph of K=4 larger
    than K=2's: more replicas); `--keras-step` runs the CLI's step, parallelize(...).fit and
    MirroredStrategy fit, and the trunk alone under it, each in its own process, and prints
    their ratios."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    first = tmp_path / "first.json"
    proc = subprocess.run(
        [sys.executable, "-m", "owt_tf.bench", "--first-step", "--devices", "2,4", "--schemes",
         "owt-b", "--fc-batch", "worker", "--batch-size", "4", "--classes", "10",
         "--out", str(first)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two, four = json.loads(first.read_text())
    assert (two["devices"], four["devices"]) == (2, 4) and two["fc_batch"] == "worker"
    assert 0 < two["second_step_s"] < two["first_step_s"] and four["graph_ops"] > two["graph_ops"]
    assert "first step s" in proc.stdout
    keras_out = tmp_path / "keras.json"
    proc = subprocess.run(
        [sys.executable, "-m", "owt_tf.bench", "--keras-step", "--model", "alexnet_tiny",
         "--schemes", "owt-b", "--devices", "2", "--batch-size", "8", "--classes", "10",
         "--warmup", "1", "--steps", "2", "--out", str(keras_out)],
        capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(keras_out.read_text())
    assert [r["runner"] for r in records] == ["cli", "keras", "mirrored", "trunk"]
    assert all(r["step_time_s"] > 0 and r["global_batch"] == 16 for r in records)
    assert "/ MirroredStrategy fit" in proc.stdout and "/ the CLI's step" in proc.stdout
    assert "the conv trunk alone" in proc.stdout


def test_input_bench_on_an_insightface_set(tmp_path):
    """`--input insightface:DIR`: five alternating rounds of the training input and of bare
    decode_jpeg of the same bytes; the median rounds and their ratio, as printed."""
    import tensorflow as tf

    from owt_tf.data.recordio import write_record_file

    rng = np.random.default_rng(0)
    images = [(tf.io.encode_jpeg(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).numpy(), k)
              for k in range(4) for _ in range(10)]
    write_record_file(str(tmp_path / "train"), images, header=True)
    out = tmp_path / "input.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-m", "owt_tf.bench", "--input", f"insightface:{tmp_path}",
         "--image-size", "16", "--batch-size", "4", "--devices", "2", "--steps", "2",
         "--warmup", "1", "--out", str(out)], capture_output=True, text=True, env=env,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    training, bare = json.loads(out.read_text())
    assert training["pipeline"].startswith("training") and bare["pipeline"].startswith("bare")
    for r in (training, bare):
        assert r["global_batch"] == 8 and r["images_per_round"] == 16 and r["image_size"] == 16
        assert len(r["rounds_images_per_sec"]) == 5 and min(r["rounds_images_per_sec"]) > 0
        assert r["images_per_sec"] == pytest.approx(np.median(r["rounds_images_per_sec"]), rel=1e-3)
    ratio = training["images_per_sec"] / bare["images_per_sec"]
    assert f"training / bare decode of the same bytes: {ratio:.2f}x" in proc.stdout
