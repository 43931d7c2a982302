"""The run directory (`train.out_dir`): created, checked and owned by one run at a time.

A run directory holds what one training run writes (README "Training"): config.yaml,
metrics.jsonl, starts.jsonl, step_N/ checkpoints, latest, wandb/. Guarantees:

- `open_run_dir` creates it or refuses, in one line, a path that is a file, that cannot be
  written, or a folder that holds files moefp8 did not write (no `starts.jsonl`: not a run dir).
  `train.resume=none` is refused in a folder that already holds a run.
- `RunLock` makes the run its only owner while it runs: `lock.json` (pid, host, boot id, the
  process's start time, date, command), created with O_EXCL, kept fresh by a heartbeat thread
  (mtime every HEARTBEAT_S) and removed at exit. A second run stops with one line naming the
  owner. A lock is stale, and taken over with a note, when its owner is gone: on this host and
  boot, its pid no longer runs the process that wrote it; elsewhere, its heartbeat is older than
  STALE_S (a killed job on another node).

Only rank 0 calls these (the others learn the outcome through `Parallel.on_main`).
"""

import datetime
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from moefp8 import checkpoint
from moefp8.errors import UserError
from moefp8.testing import boot_id

LOCK = "lock.json"
HEARTBEAT_S = 30.0
STALE_S = 300.0  # 10 missed heartbeats
RUN_MARK = "starts.jsonl"  # written at every start: marks a folder as a moefp8 run dir
RUN_FILES = ("config.yaml", "metrics.jsonl", RUN_MARK, "latest", "wandb_run_id")


class RunDirError(UserError):
    """The run directory cannot be used; the message names it and the fix."""


def open_run_dir(path: str | Path, resume: str) -> Path:
    """Creates the run dir (parents too) or checks the existing one; returns it. RunDirError
    when it is a file, cannot be created or written, holds files that are not a run's, or holds a
    run while resume == "none"."""
    p = Path(path)
    key = f"train.out_dir={path}"
    if p.exists() and not p.is_dir():
        raise RunDirError(f"{key}: is a file, not a directory; pick a directory (a new one starts a new run)")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise RunDirError(f"{key}: cannot write there ({e.strerror or e}: {e.filename or p}); pick a writable "
                          f"directory") from None
    entries = sorted(x.name for x in p.iterdir() if x.name != LOCK)
    if entries and RUN_MARK not in entries:
        theirs = [n for n in entries if not is_run_entry(n)]
        if theirs:
            raise RunDirError(f"{key}: holds files that are not a moefp8 run's ({len(entries)} entries, e.g. "
                              f"{theirs[0]}); pick a new or empty directory")
    if resume == "none" and any(is_run_entry(n) for n in entries):
        raise RunDirError(f"train.resume=none: {p} already holds a run ({', '.join(entries[:3])}"
                          f"{', ...' if len(entries) > 3 else ''}); pick a new train.out_dir for a fresh start, "
                          f"or resume it with train.resume=auto")
    return p


def is_run_entry(name: str) -> bool:
    """A name a run writes into its run dir (files, step_N/ checkpoints, partial saves, wandb/)."""
    return name in RUN_FILES or name.startswith("step_") or name == "wandb" or name.endswith(".tmp")


def _proc_start(pid: int) -> str:
    """A process's start time in clock ticks since boot (/proc/PID/stat field 22); "" if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


class RunLock:
    """The run dir's lock (module docstring). `acquire()` or RunDirError; `release()` removes it if
    it is still ours. A context manager: acquire on enter, release on exit."""

    def __init__(self, run_dir: Path, say=print):
        self.path, self.say = Path(run_dir) / LOCK, say
        self.me = {"pid": os.getpid(), "host": socket.gethostname(), "boot": boot_id(),
                   "proc_start": _proc_start(os.getpid()),
                   "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "command": " ".join(sys.argv)}
        self._stop = threading.Event()
        self.held = False

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                other, why = self._read_other()
                if why is None:
                    raise RunDirError(f"train.out_dir={self.path.parent}: another run owns it ({other}; lock "
                                      f"{self.path}); wait for it to end or pick another train.out_dir (if "
                                      f"that run is gone, delete the lock)") from None
                self.say(f"run dir: taking over a stale lock ({why})")
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
            self.held = True
            threading.Thread(target=self._beat, name="moefp8-run-lock", daemon=True).start()
            return
        raise RunDirError(f"train.out_dir={self.path.parent}: could not take the lock {self.path} (another run "
                          f"took it at the same moment); pick another train.out_dir")

    def _read_other(self) -> tuple[str, str | None]:
        """(who holds the lock, why it is stale, or None while its owner may still run)."""
        age = 0.0
        try:
            age = time.time() - self.path.stat().st_mtime
            info = json.loads(self.path.read_text())
        except FileNotFoundError:
            return "gone", "it was just removed"
        except (OSError, ValueError):  # torn: its writer died while writing (or it is being written now)
            return "an unreadable lock", None if age < STALE_S else f"unreadable and {age:.0f} s old"
        who = f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}"
        if info.get("host") == self.me["host"] and info.get("boot") == self.me["boot"]:
            pid = info.get("pid")
            if not isinstance(pid, int) or _proc_start(pid) != info.get("proc_start"):
                return who, f"{who}: that process has ended"
            return who, None
        if age > STALE_S:
            return who, f"{who}: no heartbeat for {age:.0f} s"
        return who, None

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        self._stop.set()
        if not self.held:
            return
        self.held = False
        try:
            if json.loads(self.path.read_text()).get("pid") == self.me["pid"]:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def take(out_dir: str, resume: str, say) -> RunLock:
    """Rank 0 at start: the run dir created or checked (`open_run_dir`), locked for this run, and
    the leftovers of killed checkpoint saves removed. Returns the held lock."""
    run_dir = open_run_dir(out_dir, resume)
    lock = RunLock(run_dir, say)
    lock.acquire()
    for p in checkpoint.remove_partial(run_dir):
        say(f"run dir: removed {p.name}, a checkpoint save that did not finish")
    return lock
