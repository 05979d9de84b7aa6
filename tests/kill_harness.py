"""Runs `python -m owt_tf.train` and SIGKILLs itself at a chosen moment (tests only).

    python tests/kill_harness.py MOMENT STEP -- <train flags>

MOMENT is where the process dies, without any chance to clean up:
    step          while step STEP runs (a thread kills the process once the step has started)
    serialize     while checkpoint STEP's tensors are being gathered for writing
    serialized    once checkpoint STEP's tensors are gathered (in a cluster: this worker has
                  done its part of the gather, and the chief is writing the files)
    index         after checkpoint STEP's data files are written, before the `checkpoint`
                  index file names them
"""
import os
import signal
import sys
import threading
import time


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# The checkout this file is in, before an installed owt_tf: `python tests/kill_harness.py`
# puts tests/ first on sys.path, so another checkout's editable install would win.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    moment, at = sys.argv[1], int(sys.argv[2])
    flags = sys.argv[sys.argv.index("--") + 1:]
    from tensorflow.python.checkpoint import checkpoint_management

    from owt_tf import train
    from owt_tf.training import loop
    from owt_tf.training.files import checkpoint

    if moment == "step":
        real_step = loop.Trainer.train_step

        def train_step(self, *args, **kwargs):
            if int(self.step) + 1 == at:
                threading.Thread(target=lambda: (time.sleep(0.002), _die()), daemon=True).start()
            return real_step(self, *args, **kwargs)

        loop.Trainer.train_step = train_step
    elif moment == "serialize":
        real = checkpoint.FcState._serialize_to_tensors

        def serialize(self):
            if int(self._optim.trunk.optimizer.iterations.numpy()) == at:
                _die()
            return real(self)

        checkpoint.FcState._serialize_to_tensors = serialize
    elif moment == "serialized":
        real = checkpoint.FcState._serialize_to_tensors

        def serialized(self):
            tensors = real(self)
            if int(self._optim.trunk.optimizer.iterations.numpy()) == at:
                _die()
            return tensors

        checkpoint.FcState._serialize_to_tensors = serialized
    elif moment == "index":
        real_update = checkpoint_management.update_checkpoint_state_internal

        def update(save_dir, model_checkpoint_path, *args, **kwargs):
            if model_checkpoint_path.endswith(f"ckpt-{at}"):
                _die()
            return real_update(save_dir, model_checkpoint_path, *args, **kwargs)

        checkpoint_management.update_checkpoint_state_internal = update
    else:
        raise SystemExit(f"unknown moment {moment!r}")
    return train.main(flags)


if __name__ == "__main__":
    sys.exit(main())
