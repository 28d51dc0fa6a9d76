"""A harvest split across processes: do the ranks write the files one process writes, and does a harvest stopped
on every rank resume?

    torchrun --nproc_per_node=2 scripts/harvest_ranks.py --dir /tmp/harvest
    torchrun --nproc_per_node=2 scripts/harvest_ranks.py --dir /tmp/ranks --sweep   # scripts/sweep_ranks.py's too

On each rank this builds the same tiny random-weight Qwen3_5ForCausalLM (`recurrent_hooks.demo.tiny_model`) and
five batches (two with padding and a mask), then checks:
1. rank 0 harvests them alone (`distributed=False`) into `alone/`;
2. every rank harvests them together (`distributed=True`, batch i on rank i % world) into `split/`, stopped on every
   rank after the third batch (an exception from the batches, as a preempted job is killed): no manifest yet, and
   the shards of the batches each rank ran;
3. called again, each rank skips its batches on disk and writes the rest; rank 0 writes the manifest: `split/`
   holds the same bytes as `alone/`, file for file, and `rh.HarvestDataset` reads the same items from both;
4. texts through a tokenizer (`tokenizer=`, packed into rows of 8 tokens, a column kept per document): harvested by
   rank 0 alone and by every rank together, the same bytes, file for file (the tokens, the documents' columns and
   the statistics included).
With `--sweep`, the same processes then run scripts/sweep_ranks.py's checks in `--dir`/sweep (one start of the
processes for both: tests/studies/test_distributed.py). Any mismatch raises, and torchrun exits non-zero. Backend: nccl
on CUDA with a GPU per process, else gloo.
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

KEEP = dict(keep=("states", "key"), reduce={"states": lambda s: s.flatten(2).norm(dim=-1)}, progress=False)


class Stopped(Exception):
    """The preemption the batches simulate."""


def batches() -> list:
    generator = torch.Generator().manual_seed(0)
    out = []
    for index, (rows, seq) in enumerate([(2, 9), (3, 5), (1, 7), (2, 6), (4, 3)]):
        ids = torch.randint(3, 128, (rows, seq), generator=generator)
        if index % 2:  # left padding, with a mask
            mask = torch.ones(rows, seq, dtype=torch.long)
            mask[0, :2] = 0
            ids[0, :2] = 0
            out.append({"input_ids": ids, "attention_mask": mask})
        else:
            out.append(ids)
    return out


def stopped_after(all_batches: list, count: int):
    yield from all_batches[:count]
    raise Stopped


def files(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="a directory every rank can write")
    parser.add_argument("--sweep", action="store_true", help="also run scripts/sweep_ranks.py's checks")
    args = parser.parse_args()
    directory = pathlib.Path(args.dir)
    device = setup()
    check(directory, device)
    if args.sweep:
        import sweep_ranks  # (scripts/, this script's folder, is on sys.path)

        sweep_ranks.check(directory / "sweep", device)
    dist.barrier()
    dist.destroy_process_group()


def check(directory: pathlib.Path, device: torch.device) -> None:
    """The checks of the module docstring, on this rank (the process group started)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model(seed=0).to(device)
    data = batches()
    if rank == 0:
        rh.harvest(model, data, directory / "alone", distributed=False, **KEEP)
    dist.barrier()
    split = directory / "split"
    try:
        rh.harvest(model, stopped_after(data, 3), split, distributed=True, **KEEP)
        raise AssertionError(f"rank {rank}: the harvest was not stopped")
    except Stopped:
        pass
    dist.barrier()
    ran = [i for i in range(3) if i % world == rank]
    on_disk = sorted(p.name for p in (split / "shards").glob("*.json"))
    if (split / "manifest.json").exists() or not set(f"{i:06d}.json" for i in ran) <= set(on_disk):
        raise AssertionError(
            f"rank {rank}: after the stop, expected the shards of batches {ran} and no manifest,"
            f" found {sorted(p.name for p in split.rglob('*'))}"
        )
    resumed = rh.harvest(model, data, split, distributed=True, **KEEP)
    if resumed.skipped != len(ran):
        raise AssertionError(f"rank {rank}: the restart skipped {resumed.skipped} batches, expected {len(ran)}")
    alone, together = files(directory / "alone"), files(split)
    if alone != together:
        differ = sorted(name for name in set(alone) | set(together) if alone.get(name) != together.get(name))
        raise AssertionError(f"rank {rank}: the split harvest's files differ from one process's: {differ}")
    for layer in (0, 2):
        for what in ("states", "key"):
            one, two = rh.HarvestDataset(directory / "alone", layer, what), rh.HarvestDataset(split, layer, what)
            if len(one) != len(two) or any(
                one[i]["doc"] != two[i]["doc"] or not torch.equal(one[i]["value"], two[i]["value"])
                for i in range(len(one))
            ):
                raise AssertionError(f"rank {rank}: layer {layer} {what}: the items differ")
    check_texts(directory, model, rank)
    print(
        f"rank {rank}/{world} ({device.type}, {dist.get_backend()}): the split harvest and the resumed one equal"
        " the single-process run, from ids and from texts",
        flush=True,
    )


def tokenizer():
    """A word-level tokenizer of the tiny model's 128 ids: `t3` ... `t127`, and `<pad>`, `<bos>`, `<eos>` (0-2)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocabulary = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, 128)}}
    words = Tokenizer(WordLevel(vocabulary, unk_token="<pad>"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def check_texts(directory: pathlib.Path, model, rank: int) -> None:
    """Step 4 of the module docstring."""
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 12, (9,), generator=generator).tolist()
    texts = [
        {"text": " ".join(f"t{i}" for i in torch.randint(3, 128, (n,), generator=generator).tolist()), "label": n}
        for n in lengths
    ]
    text = dict(tokenizer=tokenizer(), context=8, batch_size=2, **KEEP)
    if rank == 0:
        rh.harvest(model, texts, directory / "alone_text", distributed=False, **text)
    dist.barrier()
    rh.harvest(model, texts, directory / "split_text", distributed=True, **text)
    dist.barrier()
    alone, together = files(directory / "alone_text"), files(directory / "split_text")
    if alone != together:
        differ = sorted(name for name in set(alone) | set(together) if alone.get(name) != together.get(name))
        raise AssertionError(f"rank {rank}: the split text harvest's files differ from one process's: {differ}")
    data = rh.HarvestDataset(directory / "split_text", 0, "states")
    if data.documents["label"] != lengths or int(data.docs.max()) != len(texts) - 1:
        raise AssertionError(f"rank {rank}: the text harvest's documents are not the texts': {data.documents['label']}")


if __name__ == "__main__":
    main()
