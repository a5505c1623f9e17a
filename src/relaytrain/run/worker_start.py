"""What the fork server that starts a run's workers imports once (`launch._worker_context`).

A spawned worker is a fresh interpreter that spends seconds importing torch, transformers and
the training code before its first step; forked from a server that imported them already, it
starts in milliseconds. The server is deaf to SIGINT and SIGTERM, and so every worker is from
its first instruction: a Ctrl-C reaches the whole process group, and the launcher passes stop
requests to its workers through shared memory instead (see launch.py).
"""

import signal

from relaytrain.run import train  # noqa: F401 - torch, transformers, the models, data and loop
from relaytrain.utils.discovery import import_modules_of

for _package in ("relaytrain.strategies", "relaytrain.objectives", "relaytrain.data.sources"):
    import_modules_of(_package)  # every registered strategy, objective and source

for _signal in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signal, signal.SIG_IGN)
