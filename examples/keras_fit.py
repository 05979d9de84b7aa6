"""Bring your own Keras model: the paper's hybrid through Keras' own workflow.

    python examples/keras_fit.py --out /tmp/owt_keras       # 4 GPUs, else 4 logical CPUs

Trains an AlexNet-shaped `keras.Sequential` on scikit-learn's handwritten digits (bundled,
no download) with its convolutions data-parallel and its Dense layers sharded over the
devices (scheme owt-b, the FC layers updated after every worker's batch), with Keras'
callbacks, then evaluates, predicts, saves a plain `.keras` model and exports a SavedModel.
Run it again with the same --out after an interruption and BackupAndRestore resumes it,
at any --devices.
"""
import argparse
import os

import keras
import numpy as np
import tensorflow as tf

import owt_tf


def my_keras_model(num_classes: int = 10) -> keras.Model:
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 5, activation="relu"),
        keras.layers.MaxPooling2D(3, strides=2),
        keras.layers.Conv2D(48, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(3, strides=2),
        keras.layers.Flatten(),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(num_classes, activation="softmax"),
    ], name="my_alexnet")


def digits(batch_size: int):
    """The 8x8 digits as 32x32 RGB in [0, 1]: (train, validation) datasets and val images."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = tf.image.resize(d.images[..., None] / 16.0, (32, 32)).numpy()
    images = np.repeat(images, 3, axis=-1).astype(np.float32)
    labels = d.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(images))
    images, labels = images[order], labels[order]
    cut = int(0.8 * len(images))
    train = (tf.data.Dataset.from_tensor_slices((images[:cut], labels[:cut]))
             .shuffle(cut, seed=0).batch(batch_size, drop_remainder=True))
    val = tf.data.Dataset.from_tensor_slices((images[cut:], labels[cut:])).batch(batch_size)
    return train, val, images[cut:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--scheme", default="owt-b", choices=["owt-a", "owt-b", "owt-c"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--out", default="keras_fit_run")
    args = parser.parse_args()
    out = args.out
    keras.utils.set_random_seed(0)  # the same initial weights every run

    strategy = owt_tf.HybridStrategy(devices=args.devices, scheme=args.scheme,
                                     fc_batch="worker" if args.scheme != "owt-a" else "global")
    with strategy.scope():
        model = owt_tf.parallelize(my_keras_model(), seed=0)
        model.compile(optimizer=keras.optimizers.SGD(0.01 * args.devices, momentum=0.9),
                      fc_optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    train_ds, val_ds, images = digits(args.batch_size)
    model.fit(train_ds, epochs=args.epochs, validation_data=val_ds, verbose=2,
              callbacks=[keras.callbacks.TensorBoard(os.path.join(out, "logs")),
                         keras.callbacks.BackupAndRestore(os.path.join(out, "backup")),
                         keras.callbacks.ModelCheckpoint(os.path.join(out, "best.weights.h5"),
                                                         save_weights_only=True,
                                                         save_best_only=True),
                         keras.callbacks.EarlyStopping(patience=2)])
    loss, accuracy = model.evaluate(val_ds, verbose=0)
    probabilities = model.predict(images[:10], verbose=0)
    model.save(os.path.join(out, "model.keras"))
    model.export(os.path.join(out, "serving", "1"))
    print(f"validation: loss {loss:.4f}, accuracy {accuracy:.2%} | first predictions "
          f"{probabilities.argmax(axis=1).tolist()} | saved {out}/model.keras and "
          f"{out}/serving/1")


if __name__ == "__main__":
    main()
