"""A parallelized Keras model's weights and files: whole FC layers from the shards, `.keras`
files and SavedModels of the user's own architecture (a plain one-device model), and Keras'
weight files (`save_weights`, ModelCheckpoint, BackupAndRestore) that restore at any K:
`save_own_variables` writes each FC layer and its optimizer slots as whole tensors.
"""
from __future__ import annotations

import json
import warnings
from typing import Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf

from owt_tf.runtime.devices import outside_strategy_scope
from owt_tf.fit import callbacks as keras_callbacks
from owt_tf.fit import files as keras_files
from owt_tf.layers import embedding_model
from owt_tf.models.signatures import (EMBEDDINGS_SIGNATURE, EXPORT_SIGNATURE, class_outputs,
                                      embedding_outputs, images_spec, keras_pixels)
from owt_tf.parallel.head import state as head_state
from owt_tf.parallel.head.layout import copy_shards_into


def write_embedding_archive(embedding: keras.Model, path: str,
                            plain: Optional[keras.Model] = None,
                            logit_scale: float = 1.0) -> None:
    """A SavedModel (keras.export.ExportArchive) under owt_tf's export contract
    (owt_tf.models.signatures, the CLI's export's signatures): `embeddings` (the output of
    `embedding`, a face model's input to its class layer: `features`, and `embeddings`
    normalised) and, given the whole `plain` model, `serving_default` (its cosine class
    layer's probabilities at `logit_scale`, top5, top5_names); without it `serving_default`
    is the embedding (TF Serving needs that name) and only the embedding's variables are
    kept. Both take `images`, uint8 at the model's input size, fed to it as pixel values."""
    model = plain if plain is not None else embedding
    height, width, channels = model.inputs[0].shape[1:]
    spec = images_spec(channels, height, width)
    archive = keras.export.ExportArchive()
    archive.track(model)

    def embed(images):
        return embedding_outputs(embedding(keras_pixels(embedding, images), training=False))

    if plain is not None:
        names = [str(i) for i in range(plain.outputs[0].shape[-1])]

        def serve(images):
            return class_outputs(plain(keras_pixels(plain, images), training=False), names,
                                 logit_scale)

        archive.add_endpoint(EXPORT_SIGNATURE, serve, input_signature=[spec])
    archive.add_endpoint(EMBEDDINGS_SIGNATURE, embed, input_signature=[spec])
    archive.write_out(path, verbose=False)


def _deserialize_with_zero_head(source: dict, dense_names: List[str]) -> keras.Model:
    """The model rebuilt from its config with its head layers' kernels drawn as zeros (they
    are overwritten at once; a Glorot draw of a 10M-class head is a 5 GB temporary), their
    initializers then set back, so that the model's config is the user's."""
    initializers = {}

    def zero_head(config):
        if isinstance(config, dict):
            inner = config.get("config")
            if isinstance(inner, dict) and inner.get("name") in dense_names \
                    and "kernel_initializer" in inner:
                initializers[inner["name"]] = inner["kernel_initializer"]
                inner["kernel_initializer"] = {"module": "keras.initializers",
                                               "class_name": "Zeros", "config": {},
                                               "registered_name": None}
            for value in config.values():
                zero_head(value)
        elif isinstance(config, list):
            for value in config:
                zero_head(value)

    zero_head(source)
    plain = keras.saving.deserialize_keras_object(source)
    for name, initializer in initializers.items():
        plain.get_layer(name).kernel_initializer = keras.initializers.deserialize(initializer)
    return plain


def _h5_group(store):
    """The HDF5 group behind Keras' weights store, or None for any other store. Keras has no
    public way to write or read a variable a part at a time; its H5IOStore keeps the group
    of the object being saved (keras/src/saving/saving_lib.py, `H5IOStore._h5_entry_group`,
    created on first write by `_create_h5_group`)."""
    if not hasattr(store, "_h5_entry_group"):
        return None
    if not getattr(store, "_h5_entry_initialized", True):
        if getattr(store, "mode", "r") not in ("w", "a"):
            return None
        store._create_h5_group(store._h5_entry_path)  # pylint: disable=protected-access
    return store._h5_entry_group  # pylint: disable=protected-access


class SavingMixin:
    """ParallelModel's weights, save, save_weights, export and Keras' variable store."""

    # -- weights, saving, export -------------------------------------------------------------
    def fc_weights(self) -> List:
        """Every Dense layer of the head whole: [(kernel, bias), ...] as numpy arrays."""
        return self.head.full_weights(self._hybrid.placement.read_shards)

    def _layer_weights(self) -> List[List[np.ndarray]]:
        """Each head layer's weights as the user's layer holds them: [kernel, bias], or
        [kernel] for a cosine layer (NormalizedDense has no bias)."""
        return [[kernel, bias] if layer.use_bias else [kernel]
                for layer, (kernel, bias) in zip(self.head.layers, self.fc_weights())]

    def get_weights(self) -> List[np.ndarray]:
        """The trunk's weights, then each head layer's kernel and bias, whole (the order of
        the user's model when its head is last); EarlyStopping's restore_best_weights uses it."""
        self._average_statistics()
        return self.trunk.get_weights() + [w for ws in self._layer_weights() for w in ws]

    def set_weights(self, weights) -> None:
        n = len(self.trunk.get_weights())
        self.trunk.set_weights(weights[:n])
        head = list(weights[n:])
        state = {}
        for i, layer in enumerate(self.head.layers):
            state[head_state.weight_key(i, "kernel")] = head.pop(0)
            state[head_state.weight_key(i, "bias")] = (
                head.pop(0) if layer.use_bias else np.zeros((layer.out_dim,), np.float32))
        self._restore_head(state)

    def to_keras_model(self) -> keras.Model:
        """The user's architecture as a plain one-device Keras model with these weights. Its
        head layers are built on zeros (no random draw to throw away) and filled shard by
        shard: besides the model itself, no whole copy of the head is made (in a cluster
        the shards are gathered whole, as every worker must take part)."""
        self._average_statistics()
        source = json.loads(self._source_json)
        plain = outside_strategy_scope(lambda: _deserialize_with_zero_head(source,
                                                                          self._dense_names))
        for layer in self.trunk.layers:
            if layer.weights:
                plain.get_layer(layer.name).set_weights(layer.get_weights())
        if self._hybrid.placement.cluster is not None:
            for name, weights in zip(self._dense_names, self._layer_weights()):
                plain.get_layer(name).set_weights(weights)
            return plain
        for name, layer in zip(self._dense_names, self.head.layers):
            target = plain.get_layer(name)
            copy_shards_into(layer, target.kernel,
                             target.bias if layer.use_bias else None)
        return plain

    def save(self, filepath, overwrite=True, **kwargs):
        """The model as a plain one-device Keras model (`.keras`): it loads without owt_tf,
        compiled as this one, with the optimizer's state (trunk and every shard, whole;
        owt_tf.fit.files), so that `load_model` + `fit` continues the run, and
        `parallelize` of the loaded model continues it at any K."""
        plain = self.to_keras_model()
        if getattr(self, "compiled", False) and getattr(self, "optimizer", None) is not None:
            keras_files.write_state(self, plain)
        with keras_callbacks.chief_path(filepath, self._hybrid.placement.is_chief) as path:
            return plain.save(path, overwrite=overwrite, **kwargs)

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """Keras' save_weights (each FC layer and its slots whole: save_own_variables); in a
        cluster only the chief's file is kept."""
        self._average_statistics()
        with keras_callbacks.chief_path(filepath, self._hybrid.placement.is_chief) as path:
            return super().save_weights(path, overwrite=overwrite, **kwargs)

    def export(self, filepath, format="tf_saved_model", *, embeddings_only: bool = False,
               **kwargs):
        """The plain one-device model exported by Keras (a SavedModel by default). A model
        whose class layer is cosine (NormalizedDense: a face model) is exported under
        owt_tf's export contract, the signatures the CLI's export has
        (owt_tf.models.signatures): `images` uint8 in (fed to the model as pixel values:
        its normalisation is its own layers), `serving_default` the classes, `embeddings`
        the class layer's input (`features`, and `embeddings` normalised).
        `embeddings_only`: that signature alone (also under the name `serving_default`,
        which TF Serving needs), and the class layer left out of the file (a face model is
        served by its embedding; a 10M-class head is GBs nobody serves)."""
        if not self.head.spec.cosine:
            if embeddings_only:
                raise ValueError("embeddings_only: the embedding is the input of a cosine "
                                 "class layer (owt_tf.layers.NormalizedDense); this model's "
                                 "class layer is a Dense")
            return self.to_keras_model().export(filepath, format=format, **kwargs)
        if format != "tf_saved_model":
            raise ValueError(f"format {format!r}: a cosine model exports a SavedModel with an "
                             "embeddings signature (format='tf_saved_model')")
        with keras_callbacks.chief_path(filepath, self._hybrid.placement.is_chief) as path:
            if embeddings_only:  # the trunk alone: the class layer is never built
                write_embedding_archive(self._plain_trunk(), path)
            else:
                plain = self.to_keras_model()
                write_embedding_archive(embedding_model(plain, plain.get_layer(
                    self._dense_names[-1])), path, plain, self._logit_scale())
        return filepath

    def _logit_scale(self) -> float:
        """The compiled margin loss's scale s (its logits without the margin are s times the
        cosines), 1 without one."""
        return float(getattr(getattr(self, "loss", None), "scale", 1.0) or 1.0)

    def _plain_trunk(self) -> keras.Model:
        """The trunk (a cosine head's embedding) as a one-device model with these weights."""
        self._average_statistics()
        trunk = outside_strategy_scope(lambda: keras.models.clone_model(self.trunk))
        trunk.set_weights(self.trunk.get_weights())
        return trunk

    def save_own_variables(self, store):
        """Each FC layer, and its optimizer slots, as whole tensors: the same file at any K.
        Into Keras' HDF5 store they are written a shard at a time (no whole copy in memory:
        a 10M-class head and its momentum are 11 GB)."""
        super().save_own_variables(store)
        group = _h5_group(store) if self._hybrid.placement.cluster is None else None
        if group is None:
            for name, value in self.head_state().items():
                store[name] = value
            return

        def write(key, shape, dtype, parts):
            dataset = group.create_dataset(key, shape=shape, dtype=dtype)
            for index, value in parts:
                dataset[index] = value

        for name, value in head_state.write_head_parts(self.head, self._fc_optimizer,
                                                       write).items():
            store[name] = value

    def load_own_variables(self, store):
        super_keys = [k for k in store.keys() if not k.startswith("fc")]
        if super_keys:
            super().load_own_variables({k: store[k] for k in super_keys})
        group = _h5_group(store)
        # HDF5 datasets are read a shard at a time by the restore, not whole here.
        state = {k: (group[k] if group is not None and group[k].ndim == 2 else np.asarray(store[k]))
                 for k in store.keys() if k.startswith("fc")}
        self._restore_head(state)

    @property
    def dense_names(self) -> List[str]:
        """The user's Dense layers of the head, in order."""
        return list(self._dense_names)

    def head_state(self) -> Dict[str, np.ndarray]:
        """Every FC layer and its optimizer slots, whole (the same arrays at any K)."""
        return head_state.head_arrays(self.head, self._fc_optimizer, self._hybrid.placement.read_shards)

    def _restore_head(self, state: Dict[str, np.ndarray]) -> None:
        head_state.restore_weights(self.head, state, self._dense_names)
        if not any("_slot" in k for k in state):
            return
        if self._fc_optimizer is None:  # loaded before compile: applied by compile
            # (read now: a file's datasets close with it)
            self._pending_fc_slots = {k: np.asarray(v) for k, v in state.items()}
        else:
            self.restore_fc_slots(state)

    def restore_fc_slots(self, state: Dict[str, np.ndarray]) -> None:
        """The FC optimizer's slots and step count, if they were saved by the same kind of
        optimizer with as many slots; else fresh ones are kept with a warning, as Keras does
        for an optimizer whose saved state does not match."""
        opt = self._fc_optimizer
        if not head_state.slots_fit(state, opt):
            warnings.warn(f"Skipping the FC optimizer state: it was saved by "
                          f"{head_state.saved_kind(state) or 'an optimizer'} with "
                          f"{head_state.saved_slots(state)} slot(s) per weight; this model's FC "
                          f"optimizer is {opt.kind} with {opt.num_slots}", stacklevel=2)
            return
        head_state.restore_slots(self.head, state, opt)
        opt.sync_iterations()
