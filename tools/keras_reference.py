"""The plain-Keras reference for a `folder:` dataset: the same network as `--model`, trained
by `keras.Model.fit` on the same images for the same epochs, its held-out error printed.

    python tools/keras_reference.py --dataset folder:D --model alexnet_tiny --epochs 10

The network is owt_tf's own model spec as one `keras.Sequential`: its conv trunk, then Dense
layers of the head's widths with ReLU and dropout, and the class layer. Inputs are the
images resized whole to the model's input size and standardised with the training split's
per-channel mean and spread; no augmentation. SGD with momentum, no weight decay; Keras'
default initialisers unless `--init owt` (owt_tf's own seeded draws, Glorot-uniform).
"""
from __future__ import annotations

import argparse
import os

import numpy as np


def folder_arrays(root: str, split: str, class_names, size, channels: int):
    """All images of `root/split/<class>/` resized whole to `size`: (float32 images, labels)."""
    import tensorflow as tf

    images, labels = [], []
    for label, name in enumerate(class_names):
        folder = os.path.join(root, split, name)
        for file in sorted(os.listdir(folder)):
            image = tf.io.decode_image(tf.io.read_file(os.path.join(folder, file)),
                                       channels=channels, expand_animations=False)
            images.append(tf.image.resize(tf.cast(image, tf.float32), size).numpy())
            labels.append(label)
    return np.stack(images), np.array(labels, np.int32)


def keras_model(spec, seed: int, init: str):
    """The spec's trunk and head as one Sequential; `init` 'owt' copies owt_tf's draws."""
    import keras

    from owt_tf.models.spec import initial_head_weights, initial_trunk_weights

    trunk = spec.build_trunk()
    head = []
    for width in spec.head.hidden:
        head += [keras.layers.Dense(width, activation="relu"),
                 keras.layers.Dropout(spec.head.dropout)]
    head.append(keras.layers.Dense(spec.head.num_classes))
    model = keras.Sequential([trunk] + head)
    model.build((None,) + tuple(spec.input_shape))
    if init == "owt":
        trunk.set_weights(initial_trunk_weights(trunk, seed))
        dense = [layer for layer in head if isinstance(layer, keras.layers.Dense)]
        for layer, weights in zip(dense, initial_head_weights(spec.trunk_output_dim(trunk),
                                                              spec.head, seed)):
            layer.set_weights(list(weights))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True, help="folder:PATH")
    parser.add_argument("--model", default="alexnet_tiny")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.04)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--init", choices=("keras", "owt"), default="keras")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import keras

    from owt_tf.models.registry import build_model

    keras.utils.set_random_seed(args.seed)
    root = args.dataset[len("folder:"):]
    classes = sorted(d for d in os.listdir(os.path.join(root, "train"))
                     if os.path.isdir(os.path.join(root, "train", d)))
    spec = build_model(args.model, num_classes=len(classes))
    h, w, c = spec.input_shape
    val_split = "validation" if os.path.isdir(os.path.join(root, "validation")) else "test"
    x, y = folder_arrays(root, "train", classes, (h, w), c)
    vx, vy = folder_arrays(root, val_split, classes, (h, w), c)
    mean, std = x.mean(axis=(0, 1, 2)), x.std(axis=(0, 1, 2))
    x, vx = (x - mean) / std, (vx - mean) / std
    model = keras_model(spec, args.seed, args.init)
    model.compile(optimizer=keras.optimizers.SGD(args.lr, momentum=args.momentum),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, shuffle=True, verbose=0)
    _, accuracy = model.evaluate(vx, vy, verbose=0)
    print(f"keras fit {args.model} {args.epochs} epochs batch {args.batch_size} lr {args.lr} "
          f"init {args.init}: held-out top-1 error {1 - accuracy:.2%} ({len(vy)} images)")


if __name__ == "__main__":
    main()
