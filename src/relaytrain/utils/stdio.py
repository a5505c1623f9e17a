"""Standard output and error that a run outlives: a reader that goes away ends the printing,
never the training.

`relaytrain train | head -3` closes the pipe after three lines. Python ignores SIGPIPE, so the
next write raises BrokenPipeError (rich turns it into SystemExit(1)), and a run that was training
well would end as failed. Under `outliving_readers()` the streams are wrapped: the first write or
flush that finds its reader gone points the stream's descriptor at /dev/null, and the run goes on
without a word, writing metrics.csv, status.json and results.json as ever (a pipe's reader is
not the run's record). The launcher wraps its workers' streams too (`launch._spawned_worker`).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager


class Outliving:
    """A text stream whose writes and flushes survive a reader that went away (then go nowhere)."""

    def __init__(self, stream):
        self.stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        """Point the stream's descriptor at /dev/null: what it still buffers, and every later
        write (this process's, and a library's that writes to the descriptor), goes there."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self.stream.fileno())
        finally:
            os.close(devnull)
        self.reader_gone = True

    def __getattr__(self, name: str):  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)


@contextmanager
def outliving_readers():
    """sys.stdout and sys.stderr wrapped in `Outliving` for the duration (already wrapped: as they are)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (s if isinstance(s, Outliving) or s is None else Outliving(s) for s in saved)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
