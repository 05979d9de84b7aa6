"""The custom gradients a traced step registers, released with the model that traced it.

`tf.custom_gradient` in graph mode registers its gradient function under a fresh name
("CustomGradient-<uid>") in TensorFlow's module-global gradient registry and never removes
it (tensorflow/python/ops/custom_gradient.py, `_graph_mode_decorator`;
tensorflow/tensorflow#27492). The function's closure holds the traced tensors, so every
step graph ever traced -- thousands of Operations -- stays alive for the life of the
process: a process that parallelizes and fits one model after another (a hyper-parameter
search, a notebook, a test suite) grew by ~26,000 objects a cycle, 6x MirroredStrategy.
owt_tf's collectives and head are custom gradients (and so is MirroredStrategy's own
`all_reduce`), so the step registers dozens.

A registered gradient is looked up only while the step that registered it is traced (the
step takes its gradients inside its own trace), so once the traces are done the entries
can go. This module is the one place that touches the registry.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator, Set

from tensorflow.python.framework import ops

# name -> {"type": gradient function, "location": ...}: TensorFlow's private registry.
_REGISTRY = ops._gradient_registry._registry  # pylint: disable=protected-access


def _snapshot() -> Set[str]:
    # dict.copy() is one C call: the replicas trace in threads that register concurrently.
    return set(_REGISTRY.copy())


def _drop(names: Set[str], lock: threading.Lock) -> None:
    with lock:
        for name in names:
            _REGISTRY.pop(name, None)
        names.clear()


class TracedGradients:
    """The custom gradients registered while an owner's steps were traced.

        gradients = TracedGradients(owner)     # released at the latest when owner dies
        with gradients.recording():            # around each traced step (any thread)
            ...
        gradients.release()                    # once those traces are done
    """

    def __init__(self, owner: object):
        self._names: Set[str] = set()
        self._lock = threading.Lock()
        # Holds the names, never the owner: the entries go when the owner is collected.
        weakref.finalize(owner, _drop, self._names, self._lock)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Notes every gradient registered while the block runs (a replica's trace: what
        other replicas register meanwhile is noted too, and released with the same loop)."""
        before = _snapshot()
        try:
            yield
        finally:
            new = _snapshot() - before
            with self._lock:
                self._names |= new

    def release(self) -> None:
        """Drops the noted gradients from the registry: call when no trace is under way."""
        _drop(self._names, self._lock)
