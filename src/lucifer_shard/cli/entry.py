"""The `lucifer-shard` console script: stops are recorded from the process's first act (lucifer_shard.stops),
then the commands are imported and run. Nothing heavy is imported before that (cli/__init__.py is lazy)."""
from __future__ import annotations

from typing import NoReturn

from .. import stops


def main() -> NoReturn:
    stops.record_stops()
    try:
        from .group import cli  # click and every command: a stop meanwhile waits in the flag

        if (signum := stops.received()) is not None:
            stops.end_now(signum, "interrupted before the command began: nothing was done")
        cli()  # the command's run raises a recorded stop (cli/console.py); click exits through SystemExit
    except SystemExit as e:
        stops.exit_now(e.code)
    stops.exit_now(0)
