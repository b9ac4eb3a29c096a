"""`python -m lucifer_shard.cli`, as the `lucifer-shard` console script."""
from .group import main

main()
