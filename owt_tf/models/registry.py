"""Model names -> builders. Imports nothing heavy, so flags can be checked without TensorFlow."""
from __future__ import annotations

import importlib
from typing import Optional

MODEL_BUILDERS = {
    "alexnet": "owt_tf.models.alexnet:alexnet",
    "alexnet_tiny": "owt_tf.models.alexnet:alexnet_tiny",
    "vgg16": "owt_tf.models.vgg:vgg16",
    "vgg_tiny": "owt_tf.models.vgg:vgg_tiny",
    "iresnet18": "owt_tf.models.face:iresnet18",
    "iresnet50": "owt_tf.models.face:iresnet50",
    "iresnet100": "owt_tf.models.face:iresnet100",
    "mobilefacenet": "owt_tf.models.face:mobilefacenet",
    "face_tiny": "owt_tf.models.face:face_tiny",
}
# Face trunks output an embedding; their builders take `embedding_dim`.
EMBEDDING_MODELS = ("iresnet18", "iresnet50", "iresnet100", "mobilefacenet", "face_tiny")
MODEL_NAMES = tuple(MODEL_BUILDERS)
# The FC layers' widths of each registry model (what must split evenly over K devices),
# known without building it; tests check them against the built models.
FC_WIDTHS = {
    "alexnet": (4096, 4096),
    "alexnet_tiny": (256, 256),
    "vgg16": (4096, 4096),
    "vgg_tiny": (256, 256),
    # Face models: the class layer sits on the embedding, no hidden FC layers.
    "iresnet18": (),
    "iresnet50": (),
    "iresnet100": (),
    "mobilefacenet": (),
    "face_tiny": (),
}


def build_model(name: str, num_classes: Optional[int], dropout: float = 0.5, image_size=None,
                seed: Optional[int] = None, embedding_dim: Optional[int] = None):
    """The ModelSpec registered under `name` (at `image_size` x `image_size` when given), or
    the user's model (`PATH.keras`, `module:function`: its own head, dropout and size).
    `num_classes` None: a registry model's default, a user model's own. `embedding_dim`:
    a face model's embedding width (EMBEDDING_MODELS), None its default."""
    from owt_tf.models.user import is_user_model, user_model_spec

    if is_user_model(name):
        return user_model_spec(name, num_classes, seed)
    if num_classes is None:
        num_classes = 10
    if name not in MODEL_BUILDERS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    module, function = MODEL_BUILDERS[name].split(":")
    sized = {"image_size": image_size} if image_size else {}
    if embedding_dim is not None:
        if name not in EMBEDDING_MODELS:
            raise KeyError(f"model {name!r} has no embedding; embedding_dim is for "
                           f"{', '.join(EMBEDDING_MODELS)}")
        sized["embedding_dim"] = embedding_dim
    return getattr(importlib.import_module(module), function)(num_classes=num_classes,
                                                              dropout=dropout, **sized)
