"""Failures the user can fix, and how the command line reports them.

Every such failure is a `UserError` whose message is one line naming the value and the fix
(`data.path=/x: ...; pick a new folder`). The entry points (`python -m moefp8.train`,
`python -m moefp8.data`) print it once, as `error: <message>` (`config error:` for the
config), and exit with `EXIT_ERROR`; no stack trace. Under torchrun the rank that found the
error prints it and leaves it in the launcher's error file (`write_elastic_error`), so the
launcher's report names it as the root cause; ranks that merely learnt of it (`quiet=True`)
print nothing and exit with the same status a little later (`QUIET_EXIT_DELAY_S`): the launcher
takes the first rank to fail as the root cause and stops the others, so the reporting rank must
fail first, also when a quiet rank got there sooner.

Exit statuses: 0 done (or nothing to do), EXIT_ERROR a user error or a failed run,
EXIT_STOPPED stopped on a signal after writing a checkpoint (the same command resumes),
EXIT_INTERRUPTED interrupted before training began (nothing was written).
"""

import json
import os
import sys
import time

EXIT_ERROR = 1
EXIT_STOPPED = 75  # sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports an interrupted command
QUIET_EXIT_DELAY_S = 2.0  # under a launcher: a quiet rank's head start for the reporting rank (which prints at once)


class UserError(ValueError):
    """A failure the user can fix; str(e) is one line naming the value and the fix.
    quiet: this rank learnt of the error from another rank, which reports it."""

    def __init__(self, msg: str, quiet: bool = False):
        super().__init__(msg)
        self.quiet = quiet


class RankError(UserError):
    """A UserError of this rank alone (an out-of-memory step): its peers may be waiting inside a
    collective, so the process group is not ended in order (moefp8.parallel); the launcher stops them."""


def first_line(text) -> str:
    """The first non-blank line of str(text) (an exception's message), stripped."""
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def write_elastic_error(msg: str, env=os.environ) -> None:
    """Under torchrun: `msg` as this worker's error file (TORCHELASTIC_ERROR_FILE), the format of
    torch.distributed.elastic's `@record`, so the launcher's report shows it as the root cause
    instead of a link. Nothing without a launcher, and never raises."""
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": msg, "extraInfo": {"py_callstack": msg,
                                                                   "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass


def report(msg: str, code: int = EXIT_ERROR, quiet: bool = False, env=os.environ):
    """Prints `msg` once on stderr (unless quiet), leaves it for torchrun, exits with `code`.
    A quiet rank under a launcher waits QUIET_EXIT_DELAY_S first (the launcher usually stops it
    sooner, once the reporting rank has exited)."""
    sys.stdout.flush()
    if not quiet:
        print(msg, file=sys.stderr, flush=True)
        write_elastic_error(msg, env)
    elif int(env.get("WORLD_SIZE", "1")) > 1:
        time.sleep(QUIET_EXIT_DELAY_S)
    sys.exit(code)
