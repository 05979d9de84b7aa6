"""`python -m owt_tf.launch`: a multi-worker run on this machine, one process per worker.

    python -m owt_tf.launch --workers 2 --devices-per-worker 2 -- --scheme owt-b --steps 100

starts W `python -m owt_tf.train` processes on 127.0.0.1, each with free ports in its
TF_CONFIG and `--devices D`, so the run has K = W * D replicas over TensorFlow's own
multi-worker runtime (MultiWorkerMirroredStrategy, gRPC). Their output is streamed with a
`[worker i]` prefix. When one worker fails (non-zero exit, or killed), the others are
stopped (SIGTERM, then SIGKILL after --grace seconds) and the launcher exits with the
failed worker's code; running the same command again resumes from the last checkpoint.
SIGINT / SIGTERM to the launcher are passed to every worker (they agree on a step, save
and exit); a second one kills them. Every process started is ended before it returns.

On a real cluster there is no launcher: set TF_CONFIG on each host and run
`python -m owt_tf.train` with the same flags everywhere.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from owt_tf.cli import OneLineParser, parse_config
from owt_tf.config import ConfigError

HOST = "127.0.0.1"
# Flags the launcher sets for every worker: given by the user they would contradict it.
RESERVED_FLAGS = ("--devices", "--cluster", "--task-index")
# owt_tf.train's exit codes after SIGINT / SIGTERM, once the checkpoint is saved.
SAVED_AND_STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)


class LaunchError(ValueError):
    """The launcher's flags cannot start a run."""


def free_ports(n: int) -> List[int]:
    """N distinct free TCP ports on the loopback address (bound all at once, then released)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in sockets]


def tf_config(addresses: Sequence[str], index: int) -> str:
    return json.dumps({"cluster": {"worker": list(addresses)},
                       "task": {"type": "worker", "index": index}})


def worker_flags(train_flags: Sequence[str], devices_per_worker: int,
                 default_logdir: str) -> List[str]:
    """Every worker's `python -m owt_tf.train` flags: the user's, --devices D, and one shared
    --logdir (a fresh runs/<timestamp> unless given)."""
    for flag in train_flags:
        name = flag.split("=", 1)[0]
        if name in RESERVED_FLAGS:
            raise LaunchError(f"{name} is set by the launcher (use --devices-per-worker / "
                              "--workers)")
    flags = list(train_flags) + ["--devices", str(devices_per_worker)]
    if not any(f == "--logdir" or f.startswith("--logdir=") for f in train_flags):
        flags += ["--logdir", default_logdir]
    return flags


def check_train_flags(flags: Sequence[str], addresses: Sequence[str]) -> None:
    """The workers' flags, checked once here as worker 0 would check them (one error line
    instead of W)."""
    try:
        parse_config(list(flags)).replace(cluster=",".join(addresses), task_index=0).validate()
    except ConfigError as err:
        raise LaunchError(f"train flags: {err}") from None
    except SystemExit:  # argparse already printed its one line
        raise LaunchError("train flags: see the line above") from None


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the launcher dies, however it dies (Linux prctl
    PR_SET_PDEATHSIG), so that no worker outlives it; SIGTERM makes workers save and stop."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class Workers:
    """The worker processes of one launch: start, stream, watch, stop."""

    def __init__(self, commands: Sequence[List[str]], envs: Sequence[Dict[str, str]],
                 out=sys.stdout):
        self.out = out
        self._lock = threading.Lock()
        self.procs: List[subprocess.Popen] = []
        self._threads: List[threading.Thread] = []
        for i, (command, env) in enumerate(zip(commands, envs)):
            # Own session: a terminal's Ctrl-C reaches the launcher only, which passes it on.
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)
            self.procs.append(proc)
            self.say(f"worker {i}: pid {proc.pid}")
        # Readers only once every worker is started: preexec_fn is unsafe while other
        # threads run (subprocess' documentation).
        for i, proc in enumerate(self.procs):
            thread = threading.Thread(target=self._stream, args=(i, proc), daemon=True)
            thread.start()
            self._threads.append(thread)

    def say(self, line: str, prefix: str = "[launch]") -> None:
        with self._lock:
            self.out.write(f"{prefix} {line}\n")
            self.out.flush()

    def _stream(self, i: int, proc: subprocess.Popen) -> None:
        for raw in iter(proc.stdout.readline, b""):
            self.say(raw.decode(errors="replace").rstrip("\n"), prefix=f"[worker {i}]")

    def first_failure(self) -> Optional[int]:
        """Index of a worker that failed, if any. A worker that stopped for a signal after
        saving (exit 128 + SIGINT/SIGTERM) did not fail: the workers agree on the step to
        stop at, so the others are saving the same checkpoint and end by themselves. Of
        several failed workers, one killed by a signal is the cause: the others exited on
        their own after finding it gone (within one poll, when its collectives abort)."""
        failed = [(i, proc.poll()) for i, proc in enumerate(self.procs)]
        failed = [(i, code) for i, code in failed
                  if code is not None and code not in (0, *SAVED_AND_STOPPED)]
        killed = [i for i, code in failed if code < 0]
        return killed[0] if killed else (failed[0][0] if failed else None)

    def all_done(self) -> bool:
        return all(proc.poll() is not None for proc in self.procs)

    def signal_all(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signum)

    def stop(self, grace: float) -> None:
        """SIGTERM to every worker still running; SIGKILL to those left after `grace` s."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while not self.all_done() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        for thread in self._threads:
            thread.join(timeout=5)


def run(workers: int, devices_per_worker: int, train_flags: Sequence[str], grace: float = 10.0,
        out=sys.stdout) -> int:
    """Launches the workers and waits for them; returns the run's exit code."""
    if workers < 1 or devices_per_worker < 1:
        raise LaunchError("--workers and --devices-per-worker must be >= 1")
    flags = worker_flags(train_flags, devices_per_worker,
                         os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")))
    addresses = [f"{HOST}:{port}" for port in free_ports(workers)]
    check_train_flags(flags, addresses)
    command = [sys.executable, "-m", "owt_tf.train", *flags]
    envs = []
    for i in range(workers):
        env = dict(os.environ, TF_CONFIG=tf_config(addresses, i), PYTHONUNBUFFERED="1")
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        envs.append(env)
    procs = Workers([command] * workers, envs, out)
    procs.say(f"{workers} workers x {devices_per_worker} devices on {', '.join(addresses)}: "
              f"{' '.join(command[1:])}")
    received: List[int] = []

    def forward(signum, frame):
        received.append(signum)
        procs.say(f"{signal.Signals(signum).name}: passed to every worker"
                  + (" (again: killing them)" if len(received) > 1 else ""))
        procs.signal_all(signum if len(received) == 1 else signal.SIGKILL)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            done = procs.all_done()  # read first: one ending after it is seen next poll
            failed = procs.first_failure()
            if failed is not None and not received:
                code = procs.procs[failed].returncode
                procs.say(f"worker {failed} (pid {procs.procs[failed].pid}, /job:worker/task:"
                          f"{failed}) {describe_exit(code)}; stopping the other workers")
                procs.stop(grace)
                procs.say("run stopped; run the same command again to resume from the last "
                          "checkpoint")
                return 128 - code if code < 0 else code
            if done:
                break
            time.sleep(0.05)
        codes = [proc.returncode for proc in procs.procs]
        for i, code in enumerate(codes):
            if code:
                procs.say(f"worker {i} {describe_exit(code)}")
        bad = [c for c in codes if c]
        return 0 if not bad else (128 - bad[0] if bad[0] < 0 else bad[0])
    finally:
        procs.stop(grace)  # nothing started here outlives the launcher
        for s, handler in previous.items():
            signal.signal(s, handler)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m owt_tf.launch", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="worker processes W")
    parser.add_argument("--devices-per-worker", type=int, default=1,
                        help="devices D of each worker (GPUs, else logical CPUs); K = W * D")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds the other workers get to stop after one fails")
    parser.add_argument("train_flags", nargs=argparse.REMAINDER,
                        help="-- then the flags of python -m owt_tf.train")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse's REMAINDER takes flags only after the first positional; train's flags
        # given without "--" land here.
        parser.error(f"{' '.join(unknown)}: python -m owt_tf.train's flags go after --, "
                     "e.g. python -m owt_tf.launch --workers 2 -- --steps 100")
    flags = args.train_flags[1:] if args.train_flags[:1] == ["--"] else args.train_flags
    try:
        return run(args.workers, args.devices_per_worker, flags, args.grace)
    except LaunchError as err:
        print(f"python -m owt_tf.launch: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
