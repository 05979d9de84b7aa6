"""The SavedModel a trained model is served as, and the export directory's layout.

`export_saved_model` writes a DistributedModel as a single-device SavedModel (FC shards
assembled into whole layers) with the signatures of owt_tf.models.signatures (`images`
uint8 in, the eval preprocessing inside; `serving_default`: probabilities, top5,
top5_names; a face model's `embeddings`: embeddings and features). It loads with plain
`tf.saved_model.load`, without owt_tf, and in TF Serving, TFLite and ONNX. Versions follow TF Serving's model base path layout,
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
from owt_tf.models.signatures import (EMBEDDINGS_SIGNATURE, EXPORT_SIGNATURE, class_outputs,
                                      embedding_outputs, images_spec)
from owt_tf.parallel.head.forward import forward
from owt_tf.parallel.head.layout import ShardedHead

EXPORT_METADATA = "owt_tf_export.json"


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
                          class_names: Optional[Sequence[str]] = None,
                          embeddings_only: bool = False, logit_scale: float = 1.0):
    """A `keras.export.ExportArchive` of `model` on one device: the trunk cloned, the FC layers
    as a one-shard ShardedHead (the same forward pass training and evaluation run), both in
    float32 whatever the training precision (`float32_clone`).

    Keras' own archive, not `tf.saved_model.save` of a module holding the trunk: the latter
    stores each Keras 3 variable twice (read by the function under its Keras path, restored
    as `Variable_N`), which `tf.saved_model.load` reconciles but the TF1/C++ loader of TF
    Serving and `saved_model_cli run` do not (keras-team/keras#20095,
    tensorflow/tensorflow#72963, tensorflow/serving#2226); TFLite then also keeps the trunk
    as uninitialised variables and returns NaN.

    A cosine class layer adds the `embeddings` endpoint (`embeddings_only`: it alone, no
    FC layer read or written); its probabilities are the softmax of `logit_scale` times the
    cosines (a margin objective's scale s: its logits without the margin).
    """
    spec = model.spec
    if embeddings_only and not spec.head.cosine:
        raise ExportError("--embeddings-only: the class layer is not cosine "
                          "(owt_tf.layers.NormalizedDense): the model has no embedding")
    trunk = float32_clone(model.trunk)
    height, width, channels = spec.input_shape
    images = images_spec(channels)

    def embed(images):
        return embedding_outputs(trunk(eval_preprocess(images, (height, width), mean, std),
                                       training=False))

    archive = keras.export.ExportArchive()
    archive.track(trunk)
    if spec.head.cosine:  # Keras names the first endpoint serving_default too, unless given
        archive.add_endpoint(EMBEDDINGS_SIGNATURE, embed, input_signature=[images])
    if not embeddings_only:
        _add_classes(archive, model, trunk, (mean, std), class_names, images, logit_scale)
    return archive


def _add_classes(archive, model, trunk, normalization, class_names, images_spec,
                 logit_scale: float) -> None:
    """`serving_default`: probabilities, top5 and top5_names of the whole FC head."""
    spec = model.spec
    head = ShardedHead(spec.head, model.full_weights()["head"], [None])
    height, width, _ = spec.input_shape
    classes = spec.head.num_classes
    names = list(class_names) if class_names else [str(i) for i in range(classes)]
    if len(names) != classes:
        raise ExportError(f"{len(names)} class names for {classes} classes")

    def serve(images):
        x = eval_preprocess(images, (height, width), *normalization)
        return class_outputs(forward(head, trunk(x, training=False), None, False, None),
                             names, logit_scale)

    archive.track(head)
    # The whole FC layers, [kernel0, bias0, kernel1, ...], for readers of the SavedModel.
    archive.add_variable_collection("fc_layers", [v for layer in head.layers
                                                  for v in layer.shard_variables(0)])
    archive.add_endpoint(EXPORT_SIGNATURE, serve, input_signature=[images_spec])


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
                       version: Optional[int] = None, embeddings_only: bool = False,
                       logit_scale: float = 1.0) -> str:
    """Writes the SavedModel of `model` (a DistributedModel) as `base/<version>/`, atomically
    (staged under `base` in a directory TF Serving ignores, then renamed). Returns its path.
    `embeddings_only`, `logit_scale`: as build_serving_archive takes them."""
    out = os.path.abspath(version_path(base, version, overwrite))
    archive = build_serving_archive(model, mean, std, class_names, embeddings_only,
                                    logit_scale)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    _make_readable(parent, files=False)
    staging = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        archive.write_out(staging, verbose=False)
        with open(os.path.join(staging, EXPORT_METADATA), "w") as f:
            json.dump({"model": model.spec.name, "num_classes": model.spec.head.num_classes,
                       "input_shape": list(model.spec.input_shape), "dataset": dataset,
                       "class_names": list(class_names or []) or None,
                       "embeddings_only": embeddings_only,
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


def export_trainer(trainer, base: str, overwrite: bool = False, version: Optional[int] = None,
                   embeddings_only: Optional[bool] = None) -> str:
    """A Trainer's model as export_saved_model writes it: its dataset's normalisation and
    class names, its margin objective's scale; `embeddings_only` None: the run's flag."""
    config, dataset = trainer.config, trainer.dataset
    m = config.model
    if embeddings_only is None:
        embeddings_only = config.run.embeddings_only
    return export_saved_model(trainer.model, dataset.mean, dataset.std, base, overwrite,
                              config.data.dataset, dataset.label_names(), version,
                              embeddings_only, m.scale if m.margin_value is not None else 1.0)


def load_embeddings(path: str) -> Tuple[Tuple[int, int], Callable[[np.ndarray], np.ndarray]]:
    """Any SavedModel with an `embeddings` signature (an owt_tf export from either front
    door, or another's; a version directory, or a base path: its newest version), read with
    plain `tf.saved_model.load` (no model code): the model's input size and
    `embed(uint8 images) -> the backbone's outputs` (the `features` output when there is
    one, else `embeddings`, else the signature's only output). Images go in as the
    signature's one input takes them (uint8, or their pixel values as floats). Anything
    else is an ExportError naming the export and what it lacks."""
    path = latest_version(path)
    if not os.path.exists(os.path.join(path, "saved_model.pb")):
        raise ExportError(f"{path}: no SavedModel there (no saved_model.pb)")
    signatures = tf.saved_model.load(path).signatures
    if EMBEDDINGS_SIGNATURE not in signatures:
        raise ExportError(f"{path} has no '{EMBEDDINGS_SIGNATURE}' signature (only "
                          f"{', '.join(signatures) or 'none'}): export a face model (one "
                          "trained with --objective arcface or cosface, or whose class layer "
                          "is owt_tf.layers.NormalizedDense)")
    signature = signatures[EMBEDDINGS_SIGNATURE]
    inputs = signature.structured_input_signature[1]
    if len(inputs) != 1:
        raise ExportError(f"{path}: its '{EMBEDDINGS_SIGNATURE}' signature takes "
                          f"{len(inputs)} inputs ({', '.join(inputs)}); one, the images, "
                          "is needed")
    (name, spec), = inputs.items()
    outputs = signature.structured_outputs
    output = next((o for o in ("features", "embeddings") if o in outputs),
                  next(iter(outputs)) if len(outputs) == 1 else None)
    if output is None:
        raise ExportError(f"{path}: its '{EMBEDDINGS_SIGNATURE}' signature returns "
                          f"{', '.join(outputs)}; it needs 'features' or 'embeddings'")
    size = _input_size(path, spec)

    def embed(x):
        return signature(**{name: tf.cast(tf.constant(x), spec.dtype)})[output].numpy()

    return size, embed


def _input_size(path: str, spec: tf.TensorSpec) -> Tuple[int, int]:
    """An embeddings export's image size: its metadata's, its input's static size, else
    InsightFace's 112x112."""
    meta_path = os.path.join(path, EXPORT_METADATA)
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            return tuple(json.load(f)["input_shape"][:2])
    if spec.shape.rank == 4 and spec.shape[1] is not None and spec.shape[2] is not None:
        return int(spec.shape[1]), int(spec.shape[2])
    return 112, 112


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
