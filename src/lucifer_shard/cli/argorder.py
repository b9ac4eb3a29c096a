"""Arguments in the wrong order. `convert` and `plan` take MODEL OUT, the checks take OUT MODEL; a
swap is recognised from what each directory holds and named before anything is read or written."""
from __future__ import annotations

from pathlib import Path

from ..errors import IN_ORDER, UsageRefused
from ..outnames import MANIFEST_NAME, STATE_DIR


def is_output(path: Path) -> bool:
    """A lucifer-shard output (finished or not)."""
    return (path / MANIFEST_NAME).is_file() or (path / STATE_DIR).is_dir()


def is_checkpoint(path: Path) -> bool:
    from ..source.checkpoint import INDEX_NAME, SINGLE_NAME  # numpy and safetensors: not at CLI start-up

    return (path / "config.json").is_file() and ((path / INDEX_NAME).is_file() or (path / SINGLE_NAME).is_file())


def refuse_swapped(command: str, model: str | Path | None, out: Path | None, model_first: bool) -> None:
    """UsageRefused when MODEL is an output and OUT a checkpoint (the two were swapped)."""
    if model is None or out is None:
        return
    m, o = Path(model), Path(out)
    if m.is_dir() and o.is_dir() and is_output(m) and not is_output(o) and is_checkpoint(o):
        right = f"{o} {m}" if model_first else f"{m} {o}"
        usage = "MODEL OUT" if model_first else "OUT MODEL"
        raise UsageRefused(f"{command} takes {usage}, but {m} is a lucifer-shard output and {o} a checkpoint: "
                           f"the arguments are swapped", remedy=IN_ORDER.at(command=command, args=right))
