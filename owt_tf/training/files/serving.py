"""The SavedModel a trained model is served as, and the export directory's layout.

`export_saved_model` writes a DistributedModel as a single-device SavedModel (FC shards
assembled into whole layers) whose `serving_default` takes `images`, uint8 [N, H, W, C],
does the eval preprocessing inside, and returns `probabilities` [N, classes], `top5`
[N, 5] int64 and `top5_names`. It loads with plain `tf.saved_model.load`, without owt_tf,
and in TF Serving, TFLite and ONNX. Versions follow TF Serving's model base path layout,
`BASE/<version>/`; a version is staged in a directory TF Serving ignores and renamed into
place, so a crash never leaves half a model. `load_export` reads one back with the dataset
named in its metadata (what `python -m owt_tf.evaluate --model` scores).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Callable, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from owt_tf.data.arrays import ArrayDataset
from owt_tf.data.datasets import load_dataset
from owt_tf.data.preprocess import eval_preprocess
from owt_tf.parallel.head.forward import forward
from owt_tf.parallel.head.layout import ShardedHead

EXPORT_METADATA = "owt_tf_export.json"
EXPORT_SIGNATURE = "serving_default"


class ExportError(ValueError):
    """The export cannot be written as asked."""


def versions(base: str) -> List[int]:
    """The numbered versions under a model base path, lowest first."""
    if not os.path.isdir(base):
        return []
    return sorted(int(d) for d in os.listdir(base)
                  if d.isdigit() and os.path.isdir(os.path.join(base, d)))


def version_path(base: str, version: Optional[int] = None, overwrite: bool = False) -> str:
    """Where version `version` (default: one past the newest) of the model at `base` goes:
    TF Serving's layout, `base/<version>/`, so a running server loads a new one by itself."""
    if os.path.exists(base) and not os.path.isdir(base):
        raise ExportError(f"--out {base} exists and is not a directory")
    if version is None:
        version = (versions(base) or [0])[-1] + 1
    if version < 0:
        raise ExportError(f"--version must be >= 0, got {version}")
    path = os.path.join(base, str(version))
    if os.path.exists(path) and not overwrite:
        raise ExportError(f"{path} exists; pass --overwrite to replace version {version}")
    return path


def latest_version(path: str) -> str:
    """An export directory itself, or a model base path's newest version."""
    found = versions(path)
    if found and not os.path.exists(os.path.join(path, "saved_model.pb")):
        return os.path.join(path, str(found[-1]))
    return path


def build_serving_archive(model, mean: Sequence[float], std: Sequence[float],
                          class_names: Optional[Sequence[str]] = None):
    """A `keras.export.ExportArchive` of `model` on one device: the trunk cloned, the FC layers
    as a one-shard ShardedHead (the same forward pass training and evaluation run), both in
    float32 whatever the training precision (`float32_clone`).

    Keras' own archive, not `tf.saved_model.save` of a module holding the trunk: the latter
    stores each Keras 3 variable twice (read by the function under its Keras path, restored
    as `Variable_N`), which `tf.saved_model.load` reconciles but the TF1/C++ loader of TF
    Serving and `saved_model_cli run` do not (keras-team/keras#20095,
    tensorflow/tensorflow#72963, tensorflow/serving#2226); TFLite then also keeps the trunk
    as uninitialised variables and returns NaN.
    """
    spec = model.spec
    trunk = float32_clone(model.trunk)
    head = ShardedHead(spec.head, model.full_weights()["head"], [None])
    height, width, channels = spec.input_shape
    classes = spec.head.num_classes
    names = list(class_names) if class_names else [str(i) for i in range(classes)]
    if len(names) != classes:
        raise ExportError(f"{len(names)} class names for {classes} classes")
    label_names = tf.constant(names)

    def serve(images):
        x = eval_preprocess(images, (height, width), mean, std)
        logits = forward(head, trunk(x, training=False), None, False, None)
        probabilities = tf.nn.softmax(logits)
        top5 = tf.math.top_k(probabilities, k=min(5, classes)).indices
        return {"probabilities": probabilities, "top5": tf.cast(top5, tf.int64),
                "top5_names": tf.gather(label_names, top5)}

    archive = keras.export.ExportArchive()
    archive.track(trunk)
    archive.track(head)
    # The whole FC layers, [kernel0, bias0, kernel1, ...], for readers of the SavedModel.
    archive.add_variable_collection("fc_layers", [v for layer in head.layers
                                                  for v in layer.shard_variables(0)])
    archive.add_endpoint(EXPORT_SIGNATURE, serve, input_signature=[
        tf.TensorSpec([None, None, None, channels], tf.uint8, name="images")])
    return archive


def float32_clone(trunk: keras.Model) -> keras.Model:
    """A copy of `trunk` whose layers compute in float32, whatever policy it trained under
    (--precision bf16/fp16, a mixed_bfloat16 Keras model): an export is served where
    bfloat16 may have no kernel (TFLite's builtins, ONNX runtimes, CPUs without it), and its
    weights are the float32 masters anyway."""
    def as_float32(layer):
        return layer.__class__.from_config({**layer.get_config(), "dtype": "float32"})

    copy = keras.models.clone_model(trunk, clone_function=as_float32)
    copy.set_weights(trunk.get_weights())
    return copy


def _make_readable(path: str, files: bool = True) -> None:
    """Directories 0777 and files 0666 less the umask (mkdtemp made the staging dir 0700,
    which a serving account could not read)."""
    umask = os.umask(0)
    os.umask(umask)
    if not files:
        os.chmod(path, 0o777 & ~umask)
        return
    for root, _, names in os.walk(path):
        os.chmod(root, 0o777 & ~umask)
        for name in names:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def export_saved_model(model, mean: Sequence[float], std: Sequence[float], base: str,
                       overwrite: bool = False, dataset: Optional[str] = None,
                       class_names: Optional[Sequence[str]] = None,
                       version: Optional[int] = None) -> str:
    """Writes the SavedModel of `model` (a DistributedModel) as `base/<version>/`, atomically
    (staged under `base` in a directory TF Serving ignores, then renamed). Returns its path."""
    out = os.path.abspath(version_path(base, version, overwrite))
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    _make_readable(parent, files=False)
    archive = build_serving_archive(model, mean, std, class_names)
    staging = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        archive.write_out(staging, verbose=False)
        with open(os.path.join(staging, EXPORT_METADATA), "w") as f:
            json.dump({"model": model.spec.name, "num_classes": model.spec.head.num_classes,
                       "input_shape": list(model.spec.input_shape), "dataset": dataset,
                       "class_names": list(class_names or []) or None,
                       "mean": list(mean),
                       "std": list(std)}, f, indent=1)
        _make_readable(staging)
        if os.path.exists(out):
            retired = out + ".old-" + os.path.basename(staging)
            os.replace(out, retired)
            os.replace(staging, out)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def load_export(path: str) -> Tuple[ArrayDataset, Tuple[int, int],
                                    Callable[[np.ndarray], np.ndarray]]:
    """An export (a version directory, or a base path: its newest version): the dataset its
    metadata names, the model's input size and `predict(uint8 images) -> probabilities`."""
    path = latest_version(path)
    meta_path = os.path.join(path, EXPORT_METADATA)
    if not os.path.exists(meta_path):
        raise ExportError(f"--model {path} is not an owt_tf export (no {EXPORT_METADATA})")
    with open(meta_path) as f:
        meta = json.load(f)
    serve = tf.saved_model.load(path).signatures[EXPORT_SIGNATURE]
    dataset = load_dataset(meta.get("dataset", "digits"), tuple(meta["input_shape"]))

    def predict(x):
        return serve(images=tf.constant(x))["probabilities"].numpy()

    return dataset, tuple(meta["input_shape"][:2]), predict
