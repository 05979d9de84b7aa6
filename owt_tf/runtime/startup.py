"""TensorFlow's start-up as the entry points do it: quiet unless asked.

Every start of TensorFlow prints C++ log lines of no use to a user: a oneDNN notice, CUDA
stub messages and, on a machine without a GPU, "failed call to cuInit: ... (303)" at
ERROR level. Some are written before TensorFlow's own log level applies (absl logs to
stderr until it is initialised), so TF_CPP_MIN_LOG_LEVEL alone cannot hide them.
"""
from __future__ import annotations

import os
import sys
import tempfile


def start_tensorflow(verbose: bool = False):
    """Imports TensorFlow and lists its physical devices (the first CUDA probe); returns the
    module. Unless `verbose`, what TensorFlow's C++ side writes to stderr meanwhile is
    dropped (shown if the import fails), and its later INFO and WARNING lines are hidden.
    Python's own errors and warnings are unaffected afterwards."""
    if verbose:
        import tensorflow as tf

        return tf
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "tensorflow" in sys.modules:  # already started: nothing left to hide
        import tensorflow as tf

        return tf
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices()
        except BaseException:
            _restore_stderr(saved)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        _restore_stderr(saved)
    return tf


def _restore_stderr(saved: int) -> None:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)
