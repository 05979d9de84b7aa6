"""Run as a script: the Python objects one parallelize (or MirroredStrategy) + compile + fit
+ evaluate + predict cycle leaves alive, after warm-up, in this fresh process; prints JSON
{"owt_tf": per-cycle growth, "mirrored": per-cycle growth, "registry": growth of TF's gradient
registry per owt_tf cycle}. tests/test_lean.py runs it."""
import gc
import json
import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import owt_tf  # noqa: E402

owt_tf.setup_devices(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.framework import ops  # noqa: E402

X = np.random.default_rng(0).random((64, 16, 16, 3), dtype=np.float32)
Y = np.random.default_rng(1).integers(0, 10, 64).astype(np.int32)


def build() -> keras.Model:
    return keras.Sequential([
        keras.Input((16, 16, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10, activation="softmax")])


def cycle(kind: str) -> None:
    if kind == "owt_tf":
        strategy = owt_tf.HybridStrategy(devices=2, scheme="owt-b")
        with strategy.scope():
            model = owt_tf.parallelize(build(), seed=0)
    else:
        strategy = tf.distribute.MirroredStrategy(["/device:CPU:0", "/device:CPU:1"])
        with strategy.scope():
            model = build()
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0, shuffle=False,
              validation_data=(X[:32], Y[:32]))
    model.evaluate(X, Y, batch_size=16, verbose=0)
    model.predict(X[:32], batch_size=16, verbose=0)


def growth(kind: str, cycles: int) -> list:
    counts = []
    for _ in range(cycles):
        cycle(kind)
        gc.collect()
        counts.append((len(gc.get_objects()), len(ops._gradient_registry._registry)))
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(counts, counts[1:])]


cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 4
owt = growth("owt_tf", cycles)
mirrored = growth("mirrored", cycles)
print(json.dumps({"owt_tf": [g for g, _ in owt], "registry": [r for _, r in owt],
                  "mirrored": [g for g, _ in mirrored]}))
