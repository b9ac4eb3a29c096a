"""The plan of a streamed read of a checkpoint: in which order to take the work (a conversion's parts,
a diff's groups) so that few shards are on disk at once, and how many bytes that is. Pure arithmetic
over which shards each item reads; `engine.feed` and `proof.diff_source` do the downloads."""
from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def stream_order(items: list[T], files: dict[int, list[str]], sizes: dict[str, int]) -> list[T]:
    """`items` (parts of a conversion, groups of a diff) in the order that holds the fewest shard bytes
    on disk at once (`peak_bytes`) of three: as given, by the shards each reads (first, then last),
    and greedily (each next item the one needing the fewest bytes not yet downloaded). Which wins
    depends on how the checkpoint's shards group its tensors. `files`: id(item) -> the shards it reads
    (in shard order); `sizes`: shard -> bytes."""
    index = {name: i for i, name in enumerate(sorted(sizes))}
    given = {id(p): i for i, p in enumerate(items)}

    def shards(p: T) -> list[int]:
        return [index[f] for f in files[id(p)]]
    by_shard = sorted(items, key=lambda p: (shards(p)[:1], shards(p)[-1:], given[id(p)]))
    left, greedy, present = list(items), [], set()
    while left:
        item = min(left, key=lambda p: (sum(sizes[f] for f in files[id(p)] if f not in present), shards(p),
                                        given[id(p)]))
        left.remove(item)
        greedy.append(item)
        present = (present | set(files[id(item)])) & {f for p in left for f in files[id(p)]}
    return min((list(items), by_shard, greedy), key=lambda order: peak_bytes(order, files, sizes))


def peak_bytes(order: list, files: dict[int, list[str]], sizes: dict[str, int], lead: int = 1) -> int:
    """The most shard bytes on disk at once when `order` is streamed: a shard is there from `lead` items
    before the first item that reads it (the download runs ahead of the work) to the last (a pure
    function of the order, checked against a walk in the tests)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, p in enumerate(order):
        for f in files[id(p)]:
            first.setdefault(f, i)
            last[f] = i
    return max((sum(sizes[f] for f in first if first[f] - lead <= i <= last[f]) for i in range(len(order))),
               default=0)
