"""The `lucifer-shard` commands and their text/JSON rendering; the one room that may import every
other (formats/ to output/, engine/, proof/ and the runtime shim, the heavy ones inside the commands).

`cli` and `main` are loaded on first use, so that the console script (entry.py) records stops before
click and the commands are imported."""


def __getattr__(name: str):
    if name in ("cli", "main"):
        from . import group

        return getattr(group, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["cli", "main"]
