"""TensorFlow's start-up as the entry points do it: quiet unless asked, and with glibc's
freed heap kept for reuse.

Every start of TensorFlow prints C++ log lines of no use to a user: a oneDNN notice, CUDA
stub messages and, on a machine without a GPU, "failed call to cuInit: ... (303)" at
ERROR level. Some are written before TensorFlow's own log level applies (absl logs to
stderr until it is initialised), so TF_CPP_MIN_LOG_LEVEL alone cannot hide them.

glibc's malloc gives the top of a heap back to the system once more than 128 KB of it is
free (M_TRIM_THRESHOLD), so a training step's temporaries are unmapped when freed and
page-faulted and zeroed again at the next step: half of the CPU's time went to the kernel in
a run of the `faces` preset on 2 cores. Keeping freed heap (as tcmalloc and jemalloc do) ran
the demo at 1.9x the images/s, the `faces` preset at 1.7x.
"""
from __future__ import annotations

import ctypes
import os
import sys
import tempfile

_M_TRIM_THRESHOLD, _M_TOP_PAD = -1, -2  # malloc.h
KEPT_HEAP_TOP = 2**31 - 1  # bytes of free heap top kept mapped (mallopt takes an int)
HEAP_TOP_PAD = 256 << 20  # bytes asked of the system beyond each heap growth
_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_heap() -> bool:
    """Has glibc's malloc keep the freed top of its heaps for the next allocation instead of
    returning it to the system (its trim threshold and top pad raised, as mallopt(3)).
    Returns whether it did: not when malloc is not glibc's, when another allocator is
    preloaded, or when the user set glibc's malloc parameters (environment) themselves. The
    same settings reach processes started from this one through the environment."""
    if not sys.platform.startswith("linux") or any(os.environ.get(k) for k in _MALLOC_ENV):
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # tcmalloc, jemalloc
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = (libc.mallopt(_M_TRIM_THRESHOLD, KEPT_HEAP_TOP) == 1
                and libc.mallopt(_M_TOP_PAD, HEAP_TOP_PAD) == 1)
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    if done:
        os.environ["MALLOC_TRIM_THRESHOLD_"] = str(KEPT_HEAP_TOP)
        os.environ["MALLOC_TOP_PAD_"] = str(HEAP_TOP_PAD)
    return done


def start_tensorflow(verbose: bool = False):
    """Imports TensorFlow and lists its physical devices (the first CUDA probe); returns the
    module. Unless `verbose`, what TensorFlow's C++ side writes to stderr meanwhile is
    dropped (shown if the import fails), and its later INFO and WARNING lines are hidden.
    Python's own errors and warnings are unaffected afterwards. glibc's freed heap is kept
    for reuse first (`keep_freed_heap`)."""
    keep_freed_heap()
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
