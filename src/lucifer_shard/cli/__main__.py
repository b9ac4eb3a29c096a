"""`python -m lucifer_shard.cli`, as the `lucifer-shard` console script."""
from .entry import main

main()
