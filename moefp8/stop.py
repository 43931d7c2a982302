"""Stopping on a signal without losing work (preemption, Ctrl-C).

    with StopSignals(quiet=rank != 0) as stop:
        for step in ...:
            ...                      # the step runs to its end
            if stop.requested: ...   # (agreed over the ranks by the caller) checkpoint, flush, exit

The first SIGTERM (how schedulers preempt) or SIGINT (Ctrl-C) only sets `requested`; the
training loop finishes the step it is in, writes a checkpoint, flushes its logs and exits with
EXIT_STOPPED (moefp8.errors). A second signal stops the process at once (status 128 + signal,
nothing saved). Copies of one signal that arrive within COALESCE_S count once: a Ctrl-C in a
terminal reaches both torchrun and its workers, and torchrun forwards it to them again.
Under torchrun the launcher gives the workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (30 by
default) before SIGKILL: raise it where a step and a save take longer.
"""

import os
import signal
import threading
import time

COALESCE_S = 2.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """SIGTERM/SIGINT handlers for the duration of a `with` block (main thread only; elsewhere,
    e.g. a test calling train() from a thread, nothing is installed). `requested`: the name of
    the first signal received, or None. The handlers write their one line straight to stderr's
    file descriptor (os.write: a buffered print could re-enter the one it interrupted).
    quiet: write nothing (the ranks other than 0)."""

    def __init__(self, quiet: bool = False):
        self.quiet, self.requested, self._first_at, self._old = quiet, None, 0.0, {}

    def _say(self, msg: str) -> None:
        if not self.quiet:
            os.write(2, (msg + "\n").encode())

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.requested is None:
            self.requested, self._first_at = name, now
            self._say(f"{name}: stopping after this step with a checkpoint (send it again to stop at once, "
                      f"without saving)")
        elif now - self._first_at > COALESCE_S:
            self._say(f"{name} again: stopping at once; nothing saved since the last checkpoint")
            os._exit(128 + signum)
