"""One process of a Keras-path run (the same script on every worker, TF_CONFIG set by the
caller, or unset for the one-process reference): parallelize a small model, fit, write the
whole weights, the history and what the process saw of the cluster.

    python keras_cluster_worker.py DEVICES OUT_PREFIX [EPOCHS [BACKUP_DIR [STOP_AFTER]]]

With BACKUP_DIR, fit runs under keras.callbacks.BackupAndRestore (and a ModelCheckpoint and a
TensorBoard writing under OUT_PREFIX.files); with STOP_AFTER the
process stops (exit 3) at the end of that epoch, as an interrupted run would.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import owt_tf  # noqa: E402
from keras_models import alexnet_like, random_data  # noqa: E402


class Interrupted(Exception):
    pass


class StopAfter(keras.callbacks.Callback):
    def __init__(self, epoch: int):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.epoch:
            raise Interrupted(f"stopped after epoch {self.epoch}")


def main(devices: int, out: str, epochs: int = 2, backup: str = "", stop_after: int = 0) -> int:
    strategy = owt_tf.HybridStrategy(devices=devices, scheme="owt-b")
    with strategy.scope():
        model = owt_tf.parallelize(alexnet_like(), seed=0)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = random_data(128, seed=40)
    callbacks = []
    if backup:  # and the other callbacks that write files, into directories not made yet
        callbacks = [keras.callbacks.BackupAndRestore(backup),
                     keras.callbacks.ModelCheckpoint(
                         os.path.join(f"{out}.files", "checkpoints", "e{epoch}.weights.h5"),
                         save_weights_only=True),
                     keras.callbacks.TensorBoard(os.path.join(f"{out}.files", "tensorboard"))]
    if stop_after:
        callbacks.append(StopAfter(stop_after))
    try:
        history = model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
                            callbacks=callbacks).history
    except Interrupted:
        return 3
    evaluated = model.evaluate(x[:50], y[:50], batch_size=32, verbose=0)
    weights = model.get_weights()  # in a cluster a collective: every worker reads
    placement = strategy.placement
    seen = {"replicas": strategy.num_replicas, "worker": placement.worker_id,
            "workers": placement.num_workers, "history": history,
            "evaluate": [float(v) for v in evaluated]}
    with open(f"{out}.worker{placement.worker_id}.json", "w") as f:
        json.dump(seen, f)
    if placement.is_chief:
        np.savez(f"{out}.npz", *weights)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(int(args[0]), args[1], *(int(a) if i != 1 else a
                                            for i, a in enumerate(args[2:]))))
