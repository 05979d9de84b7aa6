"""The run directory: whether this process can write it (`check_writable`, before a run
starts) and one writer per run directory: an exclusive OS lock on `<logdir>/owt_tf.lock`.

A run (or the chief of a cluster) takes the lock before it writes anything in its logdir
and holds it until the process ends. The lock is `fcntl.flock` on an open file: the kernel
drops it when the process dies, however it dies (SIGKILL included), so there is never a
stale lock to clean up. The file itself stays and records the last holder (pid, host, start
time), which is what a refused second run reports. Readers (`evaluate`, `export`, the
non-chief workers of a cluster) take no lock.

Where flock does not hold: it is as good as the filesystem's locking. On a local disk it
always holds. Linux NFS clients map flock to NFS byte-range locks, which hold between hosts
with NFSv4 (or NFSv3 with a working lockd), but not on a mount with `nolock`/`local_lock=all`,
where a lock is seen only by processes of the same host; likewise Lustre mounted with
`localflock`, and FUSE or SMB filesystems without lock support (sshfs, some CIFS mounts).
Where flock fails outright (ENOLCK, EOPNOTSUPP) the run warns in one line and goes on
unlocked. On such filesystems the user must make sure that one run writes a logdir, or
keep the logdir on a disk with working locks.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from typing import Dict, List, Optional

LOCK_FILE = "owt_tf.lock"
# flock errors that mean "this filesystem cannot lock", not "someone holds the lock".
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunDirBusy(RuntimeError):
    """Another process holds the run directory's lock."""


class RunDirUnusable(ValueError):
    """The run directory is not a directory, or cannot be created or written."""


def check_writable(logdir: str) -> None:
    """Raises RunDirUnusable unless `logdir` is, or can become, a directory this process
    can write: probed with a file in its nearest existing ancestor, removed at once, so
    that a run fails before it builds anything and leaves nothing behind."""
    existing = logdir
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing.rstrip(os.sep))
    existing = existing or "."
    if not os.path.isdir(existing):
        where = "is" if existing == logdir else f"is inside {existing}, which is"
        raise RunDirUnusable(f"{logdir} {where} not a directory")
    probe = os.path.join(existing, f".owt_tf_write_probe_{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        raise RunDirUnusable(f"cannot write in {existing}: {err.strerror}") from None


class RunDirLock:
    """This process's exclusive lock on one run directory (see the module docstring).

    A process takes a logdir's lock once; taking it again in the same process (several
    Trainers of one logdir, as tests make) returns the same lock.
    """

    _held: Dict[str, "RunDirLock"] = {}  # realpath of the logdir -> this process's lock

    def __init__(self, logdir: str, fd: int, created: List[str], enforced: bool):
        self.logdir = logdir
        self.path = os.path.join(logdir, LOCK_FILE)
        self._fd: Optional[int] = fd
        self._created = created  # directories this lock made, outermost first
        self._users = 1
        self.enforced = enforced

    @classmethod
    def take(cls, logdir: str) -> "RunDirLock":
        """Locks `logdir` (creating it) for this process, or raises RunDirBusy naming the
        holder. Nothing in the logdir is changed when the lock is refused."""
        key = os.path.realpath(logdir)
        if key in cls._held:
            lock = cls._held[key]
            lock._users += 1
            return lock
        created = _make_dirs(logdir)
        path = os.path.join(logdir, LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        enforced = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_recorded_holder(fd))
            os.close(fd)
            raise RunDirBusy(f"--logdir {logdir} is being written by another run ({holder}); "
                             "wait for it to end or use another --logdir") from None
        except OSError as err:
            if err.errno not in _UNSUPPORTED:
                os.close(fd)
                raise
            enforced = False
            print(f"warning: cannot lock {path} ({err.strerror}): this filesystem has no "
                  "working flock; make sure no other run writes this --logdir",
                  file=sys.stderr)
        _write_holder(fd)
        lock = cls(logdir, fd, created, enforced)
        cls._held[key] = lock
        return lock

    def release(self) -> None:
        """Gives the lock up (when the last of this process's users releases it)."""
        self._users -= 1
        if self._users > 0 or self._fd is None:
            return
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None
        RunDirLock._held.pop(os.path.realpath(self.logdir), None)

    def abandon(self) -> None:
        """Releases the lock of a run that failed before writing anything, and removes what
        taking it created (the lock file, and the logdir if it did not exist before)."""
        self._users = 1
        self.release()
        if self._created:
            _remove_quietly(self.path)
            for directory in reversed(self._created):
                try:
                    os.rmdir(directory)  # only if empty: never what someone else wrote
                except OSError:
                    break


def _make_dirs(logdir: str) -> List[str]:
    """Creates `logdir` and its missing parents; returns those created, outermost first."""
    missing = []
    path = os.path.abspath(logdir)
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    os.makedirs(logdir, exist_ok=True)
    return list(reversed(missing))


def _write_holder(fd: int) -> None:
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)


def _read_holder(fd: int) -> Dict[str, object]:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def _recorded_holder(fd: int, wait: float = 2.0) -> Dict[str, object]:
    """The holder's record; a run that has just taken the lock writes it a moment after,
    so an empty one is read again for up to `wait` seconds (else the refusal cannot say
    who holds the logdir)."""
    deadline = time.monotonic() + wait
    holder = _read_holder(fd)
    while not holder and time.monotonic() < deadline:
        time.sleep(0.02)
        holder = _read_holder(fd)
    return holder


def _describe(holder: Dict[str, object]) -> str:
    if not holder:
        return "holder not recorded yet"
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
            f"{holder.get('started', '?')}")


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
