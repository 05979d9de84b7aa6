"""`python -m owt_tf.train`: train a CNN with the hybrid scheme. No flags: the demo run.

Every flag is a field of one section of owt_tf.config.RunConfig; the flags and their help
are generated in owt_tf.cli (launch checks its workers' flags with the same parser). Bad flags fail in one
line, exit code 2, before anything is built.
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional

from owt_tf.cli import fail, parse_config
from owt_tf.config import ConfigError, RunConfig, new_run_dir
from owt_tf.runtime.startup import start_tensorflow
from owt_tf.training.files.rundir import RunDirUnusable, check_writable

# Exit codes: 0 done, 2 bad flags or input (nothing written), 3 non-finite loss or gradient,
# 4 a checkpoint could not be written, 5 another worker of the cluster is gone (restart all
# to resume), 128+N ended by signal N after saving a checkpoint.
EXIT_NONFINITE = 3
EXIT_WRITE = 4
EXIT_WORKER_LOST = 5
PROG = "python -m owt_tf.train"


def main(argv: Optional[List[str]] = None) -> int:
    try:
        config = parse_config(argv).validate()
    except ConfigError as err:
        return fail(PROG, err)
    try:
        watch_cluster_start(config)
    except ValueError as err:  # ClusterError: a bad OWT_TF_JOIN_TIMEOUT_S
        return fail(PROG, err)
    if config.run.logdir is None:
        config = config.replace(logdir=new_run_dir())
    try:
        check_writable(config.run.logdir)
    except RunDirUnusable as err:
        return fail(PROG, ConfigError("--logdir", str(err)))
    print(run_banner(config), flush=True)
    # TensorFlow loads only now, after the flags were found good.
    start_tensorflow(config.run.verbose)
    from owt_tf.data.datasets import DatasetError
    from owt_tf.parallel.head.state import HeadStateMismatch
    from owt_tf.training.files.checkpoint import NoReadableCheckpoint
    from owt_tf.training.loop import Trainer
    from owt_tf.training.files.rundir import RunDirBusy

    from owt_tf.training.files.checkpoint import CheckpointWriteError
    from owt_tf.training.guard import Interrupted, NonFiniteError, WorkerLost

    try:
        trainer = Trainer(config)
    except (ConfigError, HeadStateMismatch, DatasetError, RunDirBusy, NoReadableCheckpoint) as err:
        return fail(PROG, err)
    code = 0
    try:
        trainer.fit()
    except Interrupted as stop:
        print(f"python -m owt_tf.train: {stop}", file=sys.stderr)
        code = 128 + stop.signum  # the shell's convention for "ended by this signal"
    except NonFiniteError as err:
        print(f"python -m owt_tf.train: error: {err}", file=sys.stderr)
        code = EXIT_NONFINITE
    except CheckpointWriteError as err:
        print(f"python -m owt_tf.train: error: {err}", file=sys.stderr)
        code = EXIT_WRITE
    except WorkerLost as err:
        print(f"python -m owt_tf.train: error: {err}", file=sys.stderr)
        code = EXIT_WORKER_LOST
    except DatasetError as err:  # a global batch with no readable image, before its step
        print(f"python -m owt_tf.train: error: {err}", file=sys.stderr)
        code = 2
    if trainer.hybrid.placement.num_workers > 1:
        exit_worker(code)
    return code


def run_banner(config: RunConfig) -> str:
    """What the run trains, where it writes and how to watch it: printed before TensorFlow
    starts, so that a user sees it at once."""
    workers, devices, logdir = config.num_workers, config.parallel.devices, config.run.logdir
    k = config.num_replicas
    spread = f"{devices} devices x {workers} workers" if workers > 1 else f"{k} devices"
    return (f"python -m owt_tf.train: {config.model.model} on {config.data.dataset} | K={k} "
            f"({spread}) | {config.parallel.scheme}"
            f"{' (chosen once the model is built)' if config.parallel.scheme == 'auto' else ''} | global batch {config.global_batch_size}\n"
            f"  writing to {logdir} (checkpoints, TensorBoard); watch it with: "
            f"tensorboard --logdir {logdir}")


def watch_cluster_start(config: RunConfig) -> None:
    """In a cluster: a watcher process ends this worker (one line naming the missing tasks,
    then SIGKILL) when some task has not started within the join bound, instead of waiting
    on TensorFlow's cluster registration for its default timeout."""
    from owt_tf.runtime.cluster import join_timeout_s, watch_peers_start

    cluster = config.cluster.resolved
    if cluster is not None:
        watch_peers_start(cluster, join_timeout_s(), prefix="python -m owt_tf.train: error: ")


def exit_worker(code: int) -> None:
    """Ends a multi-worker process now, skipping TensorFlow's teardown. That teardown can
    stall a worker for tens of seconds after the run, and a worker that outlives another
    logs "Failed to send RPC to coordination service" / "tasks have crashed" from its
    heartbeat (tensorflow/tensorflow#58434). Everything of the run is written by now
    (checkpoints and exports synchronously, TensorBoard closed). Python's own exit
    handlers still run (autograph removes its temporary files in one)."""
    import atexit

    atexit._run_exitfuncs()  # noqa: SLF001 -- what sys.exit would run, without the C++ teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
