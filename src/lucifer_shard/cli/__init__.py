"""The `lucifer-shard` commands and their text/JSON rendering; the one room that may import every
other (formats/ to output/, engine/, proof/ and the runtime shim, the heavy ones inside the commands)."""
from .group import cli, main

__all__ = ["cli", "main"]
