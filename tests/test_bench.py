"""The benchmark tool: its JSON records, and bytes that agree with the traffic formula."""
import json
import os
import subprocess
import sys

from owt_tf.parallel import traffic

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
