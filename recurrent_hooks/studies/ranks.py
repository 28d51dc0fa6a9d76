"""A sweep's cells across the processes of a `torch.distributed` group, and a checkpoint of the finished ones.

    torchrun --nproc_per_node=8 sweep.py    # each rank: rh.patching_sweep(model, clean, corrupt, metric,
                                            #                              checkpoint="sweep.pt")

Module contents:
- `Ranks`: this process's rank in the group that shares a sweep (`Ranks.of(distributed, model)`), which cells
  are its own (`mine`, or `dealt` units of cells) and the collective that gives every rank the same cells
  (`gathered`: of the checkpoint files each rank read before the split, so that all ranks split the same cells; of
  the result at the end).
- `Checkpoint`: the finished cells of one sweep on disk, per rank, merged on load whatever the ranks were.

A cell is one entry of the sweep's `values` (flattened). With one forward per cell, rank r of W takes the r-th of
W contiguous shares of the cells still to run (contiguous: a share's cells are few layers and pairs, as one
process's are). From the corrupt run's cache, the ranks share whole positions instead (`sweep._dealt`): every
cell of a position of a group of pairs on one rank (but for fewer positions than ranks), which runs the prompts in
pieces up to its own positions only. Every rank computes the baselines itself; the cells' values are exchanged
with `all_gather`, so each rank's result is the one a single process makes of the same batches, bit for bit, but
for the pieces: from the cache, a rank that skips positions runs the prompts in longer pieces than one process,
which rounds otherwise (float32 rounding; the same holds for a resumed sweep).
"""

import dataclasses
import hashlib
import os
import pathlib
from typing import Any

import torch
from torch import Tensor, nn

from ..engine.errors import InvalidValue

_WHERE = "patching_sweep"


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's place among the processes that share one sweep (rank 0 of 1 when it runs alone)."""

    rank: int = 0
    world: int = 1
    group: Any = None

    @classmethod
    def of(cls, distributed: bool | None, model: nn.Module, where: str = _WHERE) -> "Ranks":
        """The default process group's ranks when `distributed` is True, or None and a group is initialized and
        the model is not tensor-parallel (its ranks run every forward together); else this process alone."""
        dist = torch.distributed
        ready = dist.is_available() and dist.is_initialized()
        if distributed is True and not ready:
            raise InvalidValue(
                f"{where}: distributed=True needs an initialized torch.distributed process group"
                " (torchrun, then torch.distributed.init_process_group()), and none is"
            )
        if distributed is False or not ready or distributed is None and getattr(model, "tp_size", None):
            return cls()
        return cls(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)

    def mine(self, todo: Tensor) -> Tensor:
        """The indices of this rank's share of `todo` (flat cell indices, in order)."""
        bounds = [len(todo) * r // self.world for r in range(self.world + 1)]
        return todo[bounds[self.rank] : bounds[self.rank + 1]]

    def dealt(self, count: int) -> list[int]:
        """The indices of this rank's units among `count` units dealt snake-wise, in order: ranks 0..W-1, then
        W-1..0, and again (of units whose cost falls along the list, each rank gets nearly the same total)."""
        turn = lambda k: k % self.world if k // self.world % 2 == 0 else self.world - 1 - k % self.world  # noqa: E731
        return [k for k in range(count) if turn(k) == self.rank]

    def gathered(self, values: Tensor, done: Tensor) -> tuple[Tensor, Tensor]:
        """Every rank's cells in one tensor, the same on every rank: `values` where each rank set `done`, from that
        rank, and the cells any rank has done."""
        if self.world == 1:
            return values, done
        flat, mask = values.flatten().contiguous(), done.flatten().to(values.device).contiguous()
        all_values = [torch.empty_like(flat) for _ in range(self.world)]
        all_done = [torch.empty_like(mask) for _ in range(self.world)]
        torch.distributed.all_gather(all_values, flat, group=self.group)
        torch.distributed.all_gather(all_done, mask, group=self.group)
        out, union = flat.clone(), torch.zeros_like(mask)
        for got, where in zip(all_values, all_done):
            out, union = torch.where(where, got, out), union | where
        return out.reshape(values.shape), union.reshape(done.shape).to(done.device)

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier(group=self.group)


class Checkpoint:
    """The finished cells of one sweep: `path` for a single process, `path.rank<r>` for rank r of several, written
    after each round (a temporary file, then renamed: a killed job leaves the last complete one). On load, every
    such file whose sweep is this one is merged, whatever the number of ranks that wrote it; one made by another
    sweep (other prompts, layers, positions, memory or heads) raises. The metric is not checked."""

    def __init__(self, path: str | os.PathLike | None, ranks: Ranks, key: dict[str, Any]) -> None:
        self.path = None if path is None else pathlib.Path(path)
        self.ranks, self.key = ranks, key
        self.own = (
            None
            if self.path is None
            else (self.path if ranks.world == 1 else self.path.with_name(f"{self.path.name}.rank{ranks.rank}"))
        )

    def load(self, values: Tensor, done: Tensor) -> None:
        """Fill `values` and `done` from the files on disk."""
        if self.path is None:
            return
        for file in [self.path, *sorted(self.path.parent.glob(f"{self.path.name}.rank*"))]:
            if not file.is_file():
                continue
            saved = torch.load(file, weights_only=True)
            if isinstance(saved.get("key"), dict) and "what" in saved["key"]:  # written before "what" became "memory"
                saved["key"]["memory"] = saved["key"].pop("what")
            if saved.get("key") != self.key:
                raise InvalidValue(
                    f"{_WHERE}: checkpoint {file} holds another sweep's cells"
                    f" ({_differs(saved.get('key'), self.key)});"
                    " remove it or pass another checkpoint path"
                )
            where = saved["done"]
            values[where] = saved["values"].to(values.device, values.dtype)[where]
            done |= where

    def save(self, values: Tensor, done: Tensor) -> None:
        if self.own is None:
            return
        partial = self.own.with_name(self.own.name + ".partial")
        torch.save({"key": self.key, "values": values.cpu(), "done": done.cpu()}, partial)
        os.replace(partial, self.own)

    def finish(self, values: Tensor) -> None:
        """The whole result in `path` (rank 0), and the ranks' own files removed."""
        if self.path is None:
            return
        if self.ranks.rank == 0:
            done = torch.ones(values.shape, dtype=torch.bool)
            partial = self.path.with_name(self.path.name + ".partial")
            torch.save({"key": self.key, "values": values.cpu(), "done": done}, partial)
            os.replace(partial, self.path)
        self.ranks.barrier()
        if self.own != self.path and self.own is not None and self.own.exists():
            self.own.unlink()


def sweep_key(clean_ids: Tensor, corrupt_ids: Tensor, **axes: Any) -> dict[str, Any]:
    """What identifies a sweep in its checkpoint: its prompts (a digest) and its axes."""
    digest = hashlib.sha256()
    for ids in (clean_ids, corrupt_ids):
        digest.update(f"{tuple(ids.shape)} {ids.tolist()}".encode())
    return {"prompts": digest.hexdigest(), **axes}


def _differs(saved: Any, key: dict[str, Any]) -> str:
    if not isinstance(saved, dict):
        return "no sweep key"
    names = [name for name in key if saved.get(name) != key[name]]
    return "its " + ", ".join(names) + " differ" if names else "its key differs"
