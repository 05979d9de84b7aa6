"""TensorBoard: a short run's event files hold every tag of the contract, read back by TensorBoard."""
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

from owt_tf.config import RunConfig
from owt_tf.training.files import summaries
from owt_tf.training.loop import Trainer


def test_event_files_hold_every_contract_tag(devices, tmp_path):
    config = RunConfig.from_flags(steps=8, eval_every=4, log_every=2, histogram_every=4, devices=2,
                                  batch_size=8, logdir=str(tmp_path))
    Trainer(config, devices=devices[:2]).fit(log=lambda line: None, progress=False)
    acc = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["tensors"])
    missing = set(summaries.CONTRACT_TAGS) - tags
    assert not missing, f"missing tags {missing}; have {sorted(tags)}"
    steps = [e.step for e in acc.Tensors(summaries.TRAIN_LOSS)]
    assert steps == [2, 4, 6, 8]
    assert [e.step for e in acc.Tensors(summaries.VAL_TOP1)] == [4, 8]
    value = lambda tag: float(tf.make_ndarray(acc.Tensors(tag)[0].tensor_proto))  # noqa: E731
    assert value(summaries.BYTES_PER_STEP) > 0
    assert abs(value(summaries.LR_CONV) - config.conv_lr) < 1e-7
    assert "config" in tags and "train/sample_images" in tags
    assert any(t.startswith("weights/fc0") for t in tags)
    assert any(t.startswith("gradients/trunk") for t in tags)
