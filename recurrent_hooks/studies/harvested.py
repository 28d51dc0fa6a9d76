"""Read a harvest back: `rh.HarvestDataset`, one item per harvested token, mem-mapped from the shards.

    data = rh.HarvestDataset("harvest/", layer=0, what="states")
    len(data)                        # harvested (non-pad) tokens
    data[0]                          # {"doc": 0, "position": 0, "value": Tensor [*per-token shape]}
    loader = torch.utils.data.DataLoader(data, batch_size=256, sampler=data.sampler(seed=0))
    x = data.take(torch.nonzero(data.positions == 7).flatten())   # [n, ...]: every doc's token 7, stacked

Items are in (doc, position) order: the shards in batch order, each shard's tokens row by row. A value is a view of
the mapped file (read from the disk when touched, shared by processes through the page cache); a memory of several
parts is a dict of them. The mappings are opened in each process on first use (a `DataLoader`'s workers open
their own; the dataset pickles without them).

Module contents: `HarvestDataset`, `ShardShuffle` (the seeded sampler `HarvestDataset.sampler` returns).
"""

import bisect
import operator
import os
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from ..engine.errors import InvalidValue, Unavailable
from .harvest import read_manifest
from .shards import MappedShard

__all__ = ["HarvestDataset", "ShardShuffle"]


class HarvestDataset(Dataset):
    """One item per harvested token of one mixer and value (the module docstring).

        data = rh.HarvestDataset(out, layer=2, what="states")     # what: as harvest's keep named it ("key", ...)
        data.docs, data.positions                                  # int64 [len(data)]: every item's doc and position
    `layer` is a decoder layer, or a mixer's name in the manifest (its module path where a layer has several).
    """

    def __init__(self, out: str | os.PathLike, layer: int | str, what: str = "states") -> None:
        self.out = pathlib.Path(out)
        manifest = read_manifest(self.out)
        self.mixer = _mixer_name(manifest, layer, self.out)
        names = sorted(name for name in manifest["values"] if name.split("/")[0] == self.mixer)
        whats = sorted({name.split("/", 1)[1].split(".")[0] for name in names})
        if what not in whats:
            raise Unavailable(f"HarvestDataset: {self.out} kept no {what!r} of mixer {self.mixer!r}; it kept {whats}")
        self.layer, self.what = manifest["mixers"][self.mixer]["layer"], what
        # the tensors of this value in each shard: one, or one per part ("states.C", "states.n", ...)
        self._names = [name for name in names if name.split("/", 1)[1].split(".")[0] == what]
        self._parts = [name.split("/", 1)[1].partition(".")[2] for name in self._names]
        self._files = [self.out / shard["file"] for shard in manifest["shards"]]
        counts = [shard["tokens"] for shard in manifest["shards"]]
        self._starts = [0]
        for count in counts:
            self._starts.append(self._starts[-1] + count)
        self.dtype = manifest["values"][self._names[0]]["dtype"]
        self.shape = tuple(manifest["values"][self._names[0]]["shape"])
        self._maps: list[MappedShard] | None = None
        self._index: tuple[Tensor, Tensor] | None = None

    def __repr__(self) -> str:
        return (f"HarvestDataset({str(self.out)!r}, layer={self.layer}, what={self.what!r}: {len(self)} tokens,"
                f" {len(self._files)} shards, {self.dtype} {list(self.shape)})")

    def __len__(self) -> int:
        return self._starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None, "_index": None}  # (mappings are per process)

    @property
    def shards(self) -> list[MappedShard]:
        if self._maps is None:
            for file in self._files:
                if not file.is_file():
                    raise Unavailable(f"HarvestDataset: {file}, listed in {self.out / 'manifest.json'}, is missing")
            self._maps = [MappedShard(file) for file in self._files]
        return self._maps

    @property
    def docs(self) -> Tensor:
        """Every item's document id, int64 `[len(self)]`."""
        return self._doc_positions()[0]

    @property
    def positions(self) -> Tensor:
        """Every item's position in its document (among its non-pad tokens), int64 `[len(self)]`."""
        return self._doc_positions()[1]

    def _doc_positions(self) -> tuple[Tensor, Tensor]:
        if self._index is None:
            empty = torch.zeros(0, dtype=torch.long)
            docs, positions = (torch.cat([empty, *(shard[name] for shard in self.shards)]) for name in ("doc", "position"))
            self._index = docs, positions
        return self._index

    def _locate(self, index: Any) -> tuple[int, int]:
        try:
            index = operator.index(index)  # (an int, a numpy integer, a one-element integer tensor)
        except TypeError:
            raise InvalidValue(f"HarvestDataset: expected an integer index, got {type(index).__name__}") from None
        if not -len(self) <= index < len(self):
            raise IndexError(f"HarvestDataset: index {index} is out of range for {len(self)} tokens")
        index %= len(self)
        shard = bisect.bisect_right(self._starts, index) - 1
        return shard, index - self._starts[shard]

    def _value(self, shard: MappedShard, rows: int | Tensor) -> Any:
        if self._parts == [""]:
            return shard[self._names[0]][rows]
        return {part: shard[name][rows] for part, name in zip(self._parts, self._names)}

    def __getitem__(self, index: int) -> dict[str, Any]:
        shard, row = self._locate(index)
        mapped = self.shards[shard]
        return {"doc": int(mapped["doc"][row]), "position": int(mapped["position"][row]),
                "value": self._value(mapped, row)}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Several items (a `DataLoader` asks for a batch at once)."""
        return [self[int(index)] for index in indices]

    def take(self, indices: Tensor | Sequence[int]) -> Any:
        """The values of `indices` stacked: `[len(indices), *shape]` (a dict of parts for a memory of several), read
        shard by shard (one gather per shard)."""
        indices = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        if len(indices) and not (-len(self) <= int(indices.min()) and int(indices.max()) < len(self)):
            raise IndexError(f"HarvestDataset.take: indices from {int(indices.min())} to {int(indices.max())} are out"
                             f" of range for {len(self)} tokens")
        indices = indices % max(len(self), 1)
        shard_of = torch.bucketize(indices, torch.tensor(self._starts[1:]), right=True)
        pieces, order = [], []
        for shard in shard_of.unique().tolist():
            where = (shard_of == shard).nonzero().flatten()
            pieces.append(self._value(self.shards[shard], indices[where] - self._starts[shard]))
            order.append(where)
        if not pieces:
            return self._empty()
        inverse = torch.cat(order).argsort()
        if self._parts == [""]:
            return torch.cat(pieces)[inverse]
        return {part: torch.cat([piece[part] for piece in pieces])[inverse] for part in self._parts}

    def _empty(self) -> Any:
        dtype = getattr(torch, self.dtype)
        if self._parts == [""]:
            return torch.empty(0, *self.shape, dtype=dtype)
        return {part: self.shards[0][name][:0] if self.shards else torch.empty(0)
                for part, name in zip(self._parts, self._names)}

    def sampler(self, seed: int = 0, shards_at_once: int = 4) -> "ShardShuffle":
        """A seeded shuffle of the items that reads few shards at a time (`ShardShuffle`)."""
        return ShardShuffle(self._starts, seed, shards_at_once)


class ShardShuffle(Sampler[int]):
    """A seeded random order of a harvest's items that keeps reads local: the shards in a random order, taken
    `shards_at_once` at a time, the items of those shards shuffled together. Every item once per epoch; the same
    order for the same seed and epoch (`set_epoch(e)` before each epoch, as `DistributedSampler`)."""

    def __init__(self, starts: Sequence[int], seed: int = 0, shards_at_once: int = 4) -> None:
        if not isinstance(shards_at_once, int) or shards_at_once < 1:
            raise InvalidValue(f"HarvestDataset.sampler: expected shards_at_once >= 1, got {shards_at_once!r}")
        self.starts, self.seed, self.shards_at_once, self.epoch = list(starts), int(seed), shards_at_once, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.starts[-1]

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(len(self.starts) - 1, generator=generator).tolist()
        for group in range(0, len(order), self.shards_at_once):
            items = torch.cat([torch.arange(self.starts[s], self.starts[s + 1]) for s in order[group:group +
                                                                                               self.shards_at_once]])
            yield from items[torch.randperm(len(items), generator=generator)].tolist()


def _mixer_name(manifest: dict[str, Any], layer: int | str, out: pathlib.Path) -> str:
    mixers = manifest["mixers"]
    if isinstance(layer, str):
        if layer in mixers:
            return layer
        named = [name for name, info in mixers.items() if info["path"] == layer]
    elif isinstance(layer, int) and not isinstance(layer, bool):
        named = [name for name, info in mixers.items() if info["layer"] == layer]
    else:
        raise InvalidValue(f"HarvestDataset: expected layer= a decoder layer (int) or a mixer name, got {layer!r}")
    if len(named) == 1:
        return named[0]
    available = {name: info["layer"] for name, info in mixers.items()}
    if not named:
        raise Unavailable(f"HarvestDataset: {out} harvested no mixer at {layer!r}; its mixers (name: layer):"
                          f" {available}")
    raise Unavailable(f"HarvestDataset: layer {layer} has several mixers in {out} ({named}): pass one's name")
