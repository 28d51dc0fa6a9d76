"""A patching sweep split across processes: does every rank return the single-process result, and does a
preempted sweep resume from its checkpoint?

    torchrun --nproc_per_node=2 scripts/sweep_ranks.py --dir /tmp/sweep

On each rank this builds the same tiny random-weight Qwen3_5ForCausalLM (`recurrent_hooks.demo.tiny_model`, the
seed fixes the weights) and two prompt pairs, then checks:
1. `patching_sweep(..., distributed=True)` (the cells split across the ranks, gathered on every rank) equals the
   same sweep in one process (`distributed=False`) within float32 rounding (per head, the ranks batch other cells
   together; per layer, from the corrupt run's cache, a rank runs the prompts in other pieces), per layer and per
   head, and every rank holds the same bits; from the cache, each rank runs fewer forwards than one process (only
   the pieces and cells of its own positions: it prints both counts);
2. a sweep with one forward per cell stopped on every rank after its first round (an exception from the metric, as
   a preempted job is killed) leaves one checkpoint file per rank; the restarted sweep runs only the cells those
   files lack, gives the same result, writes the whole result to the checkpoint path and removes the ranks' files;
3. the same from the cache, stopped on every rank after its first position: each rank's file holds that whole
   position, and on the restart the ranks run every cell left once between them, each rank the pieces and cells
   of its share of the positions left only.
Any mismatch raises, and torchrun exits non-zero. Backend: nccl on CUDA with a GPU per process, else gloo.
"""

import argparse
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # run from a clone without installing

from _process_group import setup  # noqa: E402  (scripts/, the script's own folder, is on sys.path)

import recurrent_hooks as rh  # noqa: E402
from recurrent_hooks.demo import tiny_model  # noqa: E402

T = 9


class Stopped(Exception):
    """The preemption the metric simulates."""


class Counting:
    """`rh.metrics.logit_difference` that counts its calls and their rows and raises `Stopped` at call `stop_at`."""

    def __init__(self, inner, stop_at=None, counter=None):
        self.inner, self.stop_at = inner, stop_at
        self.counter = counter if counter is not None else {"calls": 0, "rows": 0}

    def for_rows(self, pairs):
        return Counting(self.inner.for_rows(pairs), self.stop_at, self.counter)

    def __call__(self, logits):
        if self.counter["calls"] == self.stop_at:
            raise Stopped
        self.counter["calls"] += 1
        self.counter["rows"] += logits.shape[0]
        return self.inner(logits)


class Forwards:
    """The model's forwards while the `with` block runs (`count`), from a forward pre-hook."""

    def __init__(self, model):
        self.model, self.count = model, 0

    def __enter__(self):
        self.handle = self.model.register_forward_pre_hook(lambda module, args: setattr(self, "count", self.count + 1))
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def same_on_every_rank(name: str, value: torch.Tensor) -> None:
    gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value.contiguous())
    if not all(torch.equal(g, gathered[0]) for g in gathered):
        raise AssertionError(f"rank {dist.get_rank()}: {name} differs between the ranks")


def close(name: str, expected: torch.Tensor, got: torch.Tensor) -> None:
    torch.testing.assert_close(
        got, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {dist.get_rank()}: {name}: {m}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="a directory every rank can write (the checkpoints)")
    directory = pathlib.Path(parser.parse_args().dir)
    device = setup()
    check(directory, device)
    dist.destroy_process_group()


def check(directory: pathlib.Path, device: torch.device) -> None:
    """The checks of the module docstring, on this rank (the process group started)."""
    directory.mkdir(parents=True, exist_ok=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model(seed=0).to(device)
    generator = torch.Generator().manual_seed(0)
    clean, corrupt = (torch.randint(3, 128, (2, T), generator=generator).to(device) for _ in range(2))
    metric = rh.metrics.logit_difference(torch.tensor([5, 9]), wrong=4)
    for heads in (False, True):
        common = dict(heads=heads, progress=False)
        with Forwards(model) as one:
            alone = rh.patching_sweep(model, clean, corrupt, metric, distributed=False, **common)
        with Forwards(model) as mine:
            split = rh.patching_sweep(model, clean, corrupt, metric, distributed=True, **common)
        close(f"heads={heads}: the split sweep vs one process", alone.values, split.values)
        same_on_every_rank(f"heads={heads}: the split sweep", split.values)
        if not heads:  # from the corrupt run's cache: the pieces and cells of the rank's own positions only
            print(
                f"rank {rank}/{world}: from the cache, {mine.count} forwards split, {one.count} in one process",
                flush=True,
            )
            if mine.count >= one.count:
                raise AssertionError(
                    f"rank {rank}: {mine.count} forwards in the split sweep from the cache, not fewer"
                    f" than one process's {one.count}"
                )
            from_cache = alone.values  # one process's, also the reference of the resumed sweeps

    path = directory / "sweep.pt"
    stopping = Counting(metric, stop_at=3)  # 2 baselines, one round (budget 0: a batch a round), then stopped
    try:  # rounds of clean memories are the per-cell path's (reuse_prefix=False)
        rh.patching_sweep(
            model,
            clean,
            corrupt,
            stopping,
            distributed=True,
            batch_size=4,
            budget_bytes=0,
            progress=False,
            checkpoint=path,
            reuse_prefix=False,
        )
        raise AssertionError(f"rank {rank}: the sweep was not stopped")
    except Stopped:
        pass
    dist.barrier()
    own = path.with_name(f"{path.name}.rank{rank}")
    if not own.is_file() or int(torch.load(own, weights_only=True)["done"].sum()) != 4:
        raise AssertionError(f"rank {rank}: no checkpoint of its first round (4 cells) at {own}")
    resumed = Counting(metric)
    result = rh.patching_sweep(
        model,
        clean,
        corrupt,
        resumed,
        distributed=True,
        batch_size=4,
        budget_bytes=0,
        progress=False,
        checkpoint=path,
        reuse_prefix=False,
    )
    cells = clean.shape[0] * len(result.layers) * T
    share = cells // world - 4  # this rank's share of the cells left (the split is even here)
    if resumed.counter["calls"] != 2 + -(-share // 4):
        raise AssertionError(
            f"rank {rank}: {resumed.counter['calls'] - 2} forwards after the restart, expected"
            f" {-(-share // 4)} for the {share} cells its share still had"
        )
    close("the resumed sweep vs one process", from_cache, result.values)
    dist.barrier()
    if not path.is_file() or any(directory.glob("sweep.pt.rank*")):
        raise AssertionError(
            f"rank {rank}: expected the whole result at {path} and no rank files, found"
            f" {sorted(p.name for p in directory.iterdir())}"
        )
    resumed_from_cache(model, (clean, corrupt), metric, directory / "from_cache.pt", from_cache)
    print(
        f"rank {rank}/{world} ({device.type}, {dist.get_backend()}): the split sweeps and the resumed one equal"
        " the single-process run",
        flush=True,
    )


def resumed_from_cache(model, prompts, metric, path, expected):
    """Check 3 of the module docstring: a sweep from the cache (default batch: a position's cells are one batch)
    stopped on every rank after its first position, then restarted."""
    (clean, corrupt), rank, world = prompts, dist.get_rank(), dist.get_world_size()
    try:  # 2 baselines, the rank's first position, its second (the first saved), stopped at its third
        rh.patching_sweep(
            model,
            clean,
            corrupt,
            Counting(metric, stop_at=4),
            distributed=True,
            progress=False,
            checkpoint=path,
            reuse_prefix=True,
        )
        raise AssertionError(f"rank {rank}: the sweep from the cache was not stopped")
    except Stopped:
        pass
    dist.barrier()
    done = torch.load(path.with_name(f"{path.name}.rank{rank}"), weights_only=True)["done"]
    whole = done.flatten(0, -2).all(0)  # [positions]: the positions done for every pair and layer
    if int(whole.sum()) != 1 or not torch.equal(done, whole.expand_as(done)):
        raise AssertionError(f"rank {rank}: its checkpoint holds {int(done.sum())} cells, not one whole position's")
    resumed = Counting(metric)
    with Forwards(model) as mine:
        result = rh.patching_sweep(
            model, clean, corrupt, resumed, distributed=True, progress=False, checkpoint=path, reuse_prefix=True
        )
    rows = torch.tensor([resumed.counter["rows"] - 2 * clean.shape[0]], device=clean.device)  # but the baselines
    dist.all_reduce(rows)
    left, positions_left = done.numel() - world * int(done.sum()), T - world
    if int(rows) != left:
        raise AssertionError(
            f"rank {rank}: the ranks ran {int(rows)} cells after the restart, expected the {left} left, each once"
        )
    # the probe and the baselines (2 + 2), then a piece and at most one batch per position of its share
    most = 4 + 2 * -(-positions_left // world)
    print(f"rank {rank}/{world}: from the cache, resumed, {mine.count} forwards (at most {most})", flush=True)
    if mine.count > most:
        raise AssertionError(
            f"rank {rank}: {mine.count} forwards after the restart, more than the {most} of its"
            f" share of the {positions_left} positions left"
        )
    close("the sweep from the cache resumed vs one process", expected, result.values)
    dist.barrier()
    if not path.is_file() or any(path.parent.glob(f"{path.name}.rank*")):
        raise AssertionError(f"rank {rank}: expected the whole result at {path} and no rank files")


if __name__ == "__main__":
    main()
