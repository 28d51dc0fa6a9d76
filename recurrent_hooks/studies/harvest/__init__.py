"""Every state of a dataset: `rh.harvest` streams per-token values of every batch to shards on disk.

    batches = [{"input_ids": ids, "attention_mask": mask}, ...]        # or id tensors without padding
    rh.harvest(model, batches, "harvest/", keep=("states",), reduce={"states": rh.probe(a, b)})
    data = rh.HarvestDataset("harvest/", layer=0)       # one item per non-pad token: {"doc", "position", "token",
                                                        # "value"}; data.documents, data.stats
    rh.harvest(model, texts, "text/", tokenizer=tok, context=128)    # texts: tokenized and packed (`text`)

What is kept per token and layer: a memory ("states", "windows"), its reduction (`reduce=`, as `watch` takes it:
a norm, `rh.probe(a, b)`, any function of a chunk of states), or a value of the kernel call named in the mixer's
`VALUES` ("key", "value", "beta", "dt", "output", ...). Only non-pad tokens are kept. Document ids are the rows'
running numbers over the batches (batch 0's rows are docs 0..B-1, batch 1's the next ones); a token's position is
its index among its row's non-pad tokens.

The directory (docs/harvest.md):

    out/request.json                 what is harvested: the model (class, config and weights digests), keep, reduce,
                                     layers, dtype, the tokenizer and text arguments; written with the first shard
                                     (a call refused before leaves none)
    out/shards/000000.safetensors    batch 0: `doc`, `position`, `token` [tokens], `<mixer>/<what>` [tokens, ...], the
                                     values' statistics `stats/...` (`stats`), the columns of the documents that
                                     start in it in its metadata (`documents`)
    out/shards/000000.json           its record: docs, tokens, bytes, the file's SHA-256, the batch's input digest
    out/manifest.json                written last, when every batch is on disk: the request, the model config, the
                                     mixers, each value's dtype and per-token shape, the shards, the totals, the
                                     merged statistics' file (out/stats.safetensors) with its size and SHA-256
    out/.lock.rank0                  while a harvest runs: its lock (`lock.DirectoryLock`), removed at the end

One request owns a directory. Everything a call can check before running a batch is checked before it writes
anything; a second harvest into a directory that one is writing is refused by the lock (never deleting the other's
files), and the lock of a killed one is taken over. Each file is written to a temporary name and renamed
(`shards`): a killed harvest leaves complete shards and no partial one. Called again with the same arguments, it
skips the batches on disk (it checks that each is the same batch, its input digest, and that its shard is whole,
its size and SHA-256 against its record: a damaged shard is named in a warning and written anew) and writes the
others; `out` holding another request's harvest, or more batches than the call passes, is refused. Under an
initialized `torch.distributed` group, batch i is rank i % world's; each rank writes its own shards, under its own
lock, and rank 0 the manifest once all are on disk.

The package: this module (`harvest`, `Harvest`: what a harvest directory holds, read from its manifest), `dataset`
(`HarvestDataset`, the reader), `shards` (the files: shards written atomically, read mapped; the manifest read and
every shard checked against it), `lock` (one writer per directory and rank), `text` (texts tokenized and packed),
`stats` (the values' statistics) and `documents` (the documents' columns).
"""

import dataclasses
import hashlib
import json
import os
import pathlib
import warnings
from collections.abc import Iterable, Mapping, Sequence, Sized
from typing import Any

import torch
from torch import Tensor, nn

from ...engine.declare.kernels import KEEPABLE, KERNEL_IO
from ...engine.declare.memory_parts import parts_of
from ...engine.errors import InvalidValue, RecurrentHooksError, RecurrentHooksWarning, Unavailable, add_note
from ...engine.handle.arguments import normalize_reduce
from ...engine.handle.kind import PADDING
from ...engine.policy import Paths
from ...engine.watch import watch
from ..probes import Probe
from ..ranks import Ranks
from .dataset import HarvestDataset
from .lock import DirectoryLock
from .shards import (
    FORMAT,
    PARTIAL,
    check_shards,
    file_digest,
    read_header,
    read_manifest,
    record_problem,
    shard_problem,
    write_json,
    write_shard,
)
from .stats import STATS, shard_stats, write_stats
from .text import Rows, TextRequest, jsonable, text_rows, tokenizer_identity

__all__ = ["harvest", "Harvest"]

_WHERE = "harvest"
_SAMPLED = 1024  # values per weight tensor in the weights digest
_COLUMNS = ("doc", "position", "token")  # a shard's tensors besides the values and their statistics


@dataclasses.dataclass(frozen=True)
class Harvest:
    """What a harvest directory holds (its `manifest.json`); `rh.harvest` returns it.

    h = rh.harvest(model, batches, "out/", keep=("states",), reduce={"states": norm})
    h.tokens, h.docs                 # non-pad tokens and documents harvested
    h.values                         # {"0/states": ("float32", (...)), ...}: dtype and per-token shape
    h.dataset(0, "states")           # rh.HarvestDataset("out/", layer=0, what="states")
    rh.Harvest.open("out/").verify() # every shard's bytes against the manifest's SHA-256
    """

    out: pathlib.Path
    tokens: int
    docs: int
    batches: int
    mixers: dict[str, dict[str, Any]]  # mixer name ("0", or a module path) -> {"layer", "path", "kind"}
    values: dict[str, tuple[str, tuple[int, ...]]]  # "<mixer>/<what>" -> (dtype, per-token shape)
    bytes: int  # of the shards
    written: int = 0  # bytes this call wrote (0 when everything was on disk)
    skipped: int = 0  # batches this call found on disk

    @classmethod
    def open(cls, out: str | os.PathLike, **run: int) -> "Harvest":
        manifest = read_manifest(pathlib.Path(out))
        return cls(
            pathlib.Path(out),
            manifest["tokens"],
            manifest["docs"],
            manifest["batches"],
            manifest["mixers"],
            {key: (v["dtype"], tuple(v["shape"])) for key, v in manifest["values"].items()},
            sum(shard["bytes"] for shard in manifest["shards"]),
            **run,
        )

    def verify(self) -> "Harvest":
        """Check every shard against the manifest's record of it (its size and SHA-256: every byte is read); raises
        `InvalidValue` naming each damaged shard, which `rh.harvest` called again with the same arguments writes
        anew (it checks the shards it skips in the same way).

            rh.Harvest.open("harvest/").verify()
        """
        check_shards(self.out)
        return self

    def dataset(self, layer: int | str, what: str = "states") -> Any:
        return HarvestDataset(self.out, layer=layer, what=what)


def harvest(
    model: nn.Module,
    batches: Iterable[Any],
    out: str | os.PathLike,
    *,
    keep: str | Iterable[str] = ("states",),
    reduce: Any = None,
    layers: Iterable[int] | None = None,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    forward_kwargs: Mapping[str, Any] | None = None,
    distributed: bool | None = None,
    paths: Paths | None = None,
    tokenizer: Any = None,
    context: int | None = None,
    packing: bool = True,
    text_column: str = "text",
    batch_size: int = 8,
) -> Harvest:
    """Run `model` on every batch and write what `keep` names, per layer and non-pad token, to shards in `out`.

        batches = ({"input_ids": ids, "attention_mask": mask} for ids, mask in loader)
        h = rh.harvest(model, batches, "out/", keep=("states", "key"), reduce={"states": rh.probe(a, b)},
                       layers=[0, 4], dtype=torch.bfloat16)
        rh.HarvestDataset("out/", layer=4, what="key")[0]   # {"doc": 0, "position": 0, "value": [key_heads, key_dim]}

    - `batches`: dicts with `input_ids` `[batch, seq]` and `attention_mask` (0 at pad tokens; other keys, one
      value per row, are kept as the documents' columns), or id tensors without padding (one holding
      `config.pad_token_id` is refused: pass a mask). The same batches in the same order on every call and every
      rank: a harvest resumes by batch number.
    - `keep`: "states", "windows", and names of the mixers' per-token values (`RecurrentMixer.VALUES`: "key",
      "value", "beta", "dt", "output", ...); `reduce`: as `watch` takes it (`{"states": fn}`, `{"states": {layer:
      fn}}`, `rh.probe(a, b)`), keeping fn's result instead of the memory. `layers`: decoder layers (default: all
      the recurrent ones). `dtype`: what floating values are stored as (default: as computed; float32 states).
    - `forward_kwargs`: passed to every forward (after `use_cache=False`, which it may override); `paths`: the
      watch's (`rh.Paths`); `distributed`: split the batches across the ranks of the initialized `torch.distributed`
      group (None: when there is one and the model is not tensor-parallel); `progress`: a tqdm bar in tokens/s and
      bytes written (rank 0's).

    - Text in: with `tokenizer=`, `batches` is the texts (strings, or a `datasets.Dataset`/`IterableDataset`, its
      text in `text_column`, its other columns kept per document), tokenized and cut into rows of `context` tokens,
      `batch_size` rows per forward: `packing=True` packs the documents (a bos at each one's start, else an eos at
      its end) into full contexts (the last one padded), each token keeping its document id and position in it;
      `packing=False` gives each document a row, truncated at `context` (`text` module). The tokenizer (its class,
      vocabulary digest, special tokens) and these arguments are part of the request.

    Every token's id is stored next to its doc and position; a batch's other keys (one value per row) and a text
    dataset's other columns are kept per document (`HarvestDataset.documents`); per value, the count, every
    feature's mean and variance and the mean squared norm are formed as the shards are written
    (`HarvestDataset.stats`). Returns the `Harvest` on disk. A full disk (any error writing) loses no shard
    already written: call again with the same arguments to go on. The module docstring says what the directory
    holds.
    """
    out = pathlib.Path(out)
    text = _check_inputs(batches, tokenizer, context, packing, text_column, batch_size)
    ranks = Ranks.of(distributed, model, _WHERE)
    job = _Job(model, out, ranks, _checked_keep(keep), reduce, layers, dtype, forward_kwargs, paths)
    job.request["tokenizer"] = None if text is None else tokenizer_identity(tokenizer)
    job.request["text"] = None if text is None else text.described(tokenizer)
    job.key = hashlib.sha256(json.dumps(job.request, sort_keys=True).encode()).hexdigest()
    from tqdm.auto import tqdm  # a dependency of transformers

    written = skipped = count = docs = 0
    with DirectoryLock(out, ranks.rank, _WHERE):  # (nothing is written before: the request is checked by then)
        job.open()
        with tqdm(desc=_WHERE, unit="tok", unit_scale=True, disable=not progress or ranks.rank != 0) as bar:
            for batch in batches if text is None else text_rows(batches, tokenizer, text):
                rows = _checked_rows(batch, count, docs, job.pad_id, job.vocab)
                if count % ranks.world == ranks.rank:
                    done = job.batch(count, rows)
                    written += done.written
                    skipped += done.written == 0
                    bar.update(done.tokens)
                    bar.set_postfix_str(f"{_size(written)} written, {skipped} batches on disk")
                docs += len(rows.documents)
                count += 1
        ranks.barrier()
        records = job.records(count)  # (every rank: a refusal here is every rank's, none waits for rank 0)
        if ranks.rank == 0:
            job.finish(count, records)
    ranks.barrier()  # (every rank's lock released: the directory holds the harvest's files only)
    return Harvest.open(out, written=written, skipped=skipped)


@dataclasses.dataclass(frozen=True)
class _Done:
    tokens: int
    written: int  # bytes; 0: the batch was on disk


class _Job:
    """One harvest: its request, its mixers' names and what each keeps, and the batches' shards."""

    def __init__(
        self,
        model: nn.Module,
        out: pathlib.Path,
        ranks: Ranks,
        keep: tuple[str, ...],
        reduce: Any,
        layers: Iterable[int] | None,
        dtype: torch.dtype | None,
        forward_kwargs: Mapping[str, Any] | None,
        paths: Paths | None,
    ) -> None:
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise InvalidValue(
                f"{_WHERE}: expected dtype= a floating torch.dtype (as torch.bfloat16) or None, got {dtype!r}"
            )
        if forward_kwargs is not None and not isinstance(forward_kwargs, Mapping):
            raise InvalidValue(f"{_WHERE}: expected forward_kwargs= a mapping, got {type(forward_kwargs).__name__}")
        self.model, self.out, self.ranks, self.keep, self.dtype = model, out, ranks, keep, dtype
        # no cache by default: a harvest runs prompts only (and all-linear qwen3_5 models cannot build one in 5.24-5.25)
        self.forward_kwargs = {"use_cache": False, **(forward_kwargs or {})}
        memories = {name for name in keep if name in KEEPABLE}
        watch_keep = (*memories, *(KERNEL_IO if set(keep) - memories else ()))
        self.reduce = normalize_reduce(reduce, {KEEPABLE[name]: None for name in memories}, _WHERE)
        self.watch = dict(keep=watch_keep, reduce=reduce, layers=layers, paths=paths, keep_device="cpu")
        with watch(model, **self.watch) as w:  # (entered without a forward: the mixers, and errors before any work)
            named = _mixer_names(model, w.mixers, w.layers)
            for mixer in named:
                _check_keep(mixer, keep)
            self.mixers = {
                name: {"layer": mixer.layer, "path": path, "kind": type(mixer).__name__}
                for mixer, (name, path) in named.items()
            }
        self.pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        self.vocab = _vocabulary(model)
        self.request = _request(model, keep, self.reduce, self.mixers, dtype)
        self.key = hashlib.sha256(json.dumps(self.request, sort_keys=True).encode()).hexdigest()
        self.claimed = False  # request.json is this request's on disk

    def open(self) -> None:
        """Under this rank's lock: `out` checked against this request (another's refused, unless it wrote nothing
        but its request.json), this rank's temporary files of a killed run removed."""
        self.claimed = _claim(self.out, self.request)
        (self.out / "shards").mkdir(parents=True, exist_ok=True)
        for leftover in (self.out / "shards").glob(f".*.rank{self.ranks.rank}{PARTIAL}"):  # from a killed run
            leftover.unlink()

    def _claim_once(self) -> None:
        """request.json written, before this call's first file (a call refused before writing leaves none)."""
        if not self.claimed:
            write_json(self.out / "request.json", self.request, self.ranks.rank)
            self.claimed = True

    def shard(self, index: int) -> pathlib.Path:
        return self.out / "shards" / f"{index:06d}.safetensors"

    def batch(self, index: int, rows: Rows) -> _Done:
        """Batch `index` on disk: found there (the same batch), adopted (a shard whose record a kill prevented), or
        run and written."""
        shard, record = self.shard(index), self.shard(index).with_suffix(".json")
        digest, first_doc, docs = _digest(rows), rows.first_doc, len(rows.documents)
        saved = _read_record(record)
        if saved is not None:
            _same_batch(saved.get("inputs"), digest, index, record)
            problem = record_problem(shard, saved)
            if problem is None:
                return _Done(saved["tokens"], 0)
            warnings.warn(
                f"{_WHERE}: batch {index}'s shard {shard} {problem}: running batch {index} again and"
                " writing its shard anew",
                RecurrentHooksWarning,
                stacklevel=3,
            )
            record.unlink()
        elif shard.is_file() and shard_problem(shard) is None:
            _, metadata = read_header(shard)
            if metadata.get("request") == self.key:
                _same_batch(metadata.get("inputs"), digest, index, shard)
                self._claim_once()
                self._record(index, int(metadata["tokens"]), first_doc, docs, digest)
                return _Done(int(metadata["tokens"]), 0)
        tensors = self._run(rows)
        tokens = tensors["doc"].shape[0]
        metadata = {"request": self.key, "batch": str(index), "inputs": digest, "tokens": str(tokens)}
        if any(rows.documents):  # (the columns of the documents that start in this batch)
            metadata["documents"] = json.dumps(rows.documents, sort_keys=True)
        self._claim_once()
        try:
            size, sha256 = write_shard(shard, tensors, metadata, self.ranks.rank)
        except OSError as error:
            add_note(
                error,
                f"{_WHERE}: writing batch {index}'s shard {shard} failed; the shards written before it are"
                " complete on disk: call rh.harvest again with the same arguments to go on",
            )
            raise
        return _Done(tokens, self._record(index, tokens, first_doc, docs, digest, size, sha256))

    def _record(
        self,
        index: int,
        tokens: int,
        first_doc: int,
        docs: int,
        digest: str,
        size: int | None = None,
        sha256: str | None = None,
    ) -> int:
        """The shard's record, which marks it complete (its size and SHA-256 read from the file if not given)."""
        shard = self.shard(index)
        size = shard.stat().st_size if size is None else size
        write_json(
            shard.with_suffix(".json"),
            {
                "batch": index,
                "file": f"shards/{shard.name}",
                "docs": [first_doc, docs],
                "tokens": tokens,
                "bytes": size,
                "sha256": file_digest(shard) if sha256 is None else sha256,
                "inputs": digest,
            },
            self.ranks.rank,
        )
        return size

    def _run(self, rows: Rows) -> dict[str, Tensor]:
        """The batch's forward under a watch: each mixer's kept values at its non-pad tokens, by name, with every
        token's doc, position and id, and the values' statistics (`stats`)."""
        ids, mask = rows.ids, rows.mask
        device = _device(self.model)
        inputs = {"input_ids": ids.to(device)} | ({} if mask is None else {"attention_mask": mask.to(device)})
        with torch.no_grad(), watch(self.model, **self.watch) as w:
            _refuse_left_padding(w.mixers, mask, rows.first_doc)
            self.model(**inputs, **self.forward_kwargs)
        real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()  # [batch, seq]
        tensors = {"doc": rows.doc[real], "position": rows.position[real], "token": ids[real].to(torch.int64)}
        for mixer, (name, _) in _mixer_names(self.model, w.mixers, w.layers).items():
            if len(mixer.calls) != 1:
                raise Unavailable(
                    f"{_WHERE}: {mixer} ran {len(mixer.calls)} calls in one forward; a harvest keeps the"
                    " values of one call per mixer and forward"
                )
            values = None
            for what in self.keep:
                if what in KEEPABLE:
                    value = getattr(mixer, what)
                else:
                    values = mixer.values() if values is None else values
                    value = values[what]
                for part, tensor in parts_of(value):
                    if tuple(tensor.shape[:2]) != tuple(ids.shape):
                        raise Unavailable(
                            f"{_WHERE}: {mixer}'s {what} is {tuple(tensor.shape)}, not [batch, seq, ...]"
                            f" for a batch of {tuple(ids.shape)}"
                        )
                    # [tokens, ...]: without padding a view of every token, else a copy of the real ones
                    tensor = tensor.flatten(0, 1) if mask is None else tensor[real.to(tensor.device)]
                    if self.dtype is not None and tensor.is_floating_point():
                        tensor = tensor.to(self.dtype)
                    tensors[f"{name}/{what}" + (f".{part}" if part else "")] = tensor.detach().cpu().contiguous()
        return tensors | shard_stats(tensors, [name for name in tensors if name not in _COLUMNS])

    def records(self, batches: int) -> list[dict[str, Any]]:
        """The records of batches 0..batches-1, once every rank is done; refused: a batch without one (a rank
        stopped), or batches on disk past the last one this call passed (a shorter request than the harvest's)."""
        shards = self.out / "shards"
        beyond = sorted(
            int(path.stem) for path in shards.glob("*.json") if path.stem.isdigit() and int(path.stem) >= batches
        )
        if beyond:
            raise InvalidValue(
                f"{_WHERE}: {self.out} holds batches up to {beyond[-1]} (shards {beyond[0]:06d} to"
                f" {beyond[-1]:06d} on disk), but this call passed {batches}: pass every batch of the"
                " harvest (it resumes with the same batches in the same order), or another out"
            )
        records = []
        for index in range(batches):
            saved = _read_record(self.shard(index).with_suffix(".json"))
            if saved is None:
                raise RecurrentHooksError(
                    f"{_WHERE}: batch {index} has no shard in {shards} (a rank stopped?): call"
                    " rh.harvest again with the same arguments to finish"
                )
            records.append(saved)
        return records

    def finish(self, batches: int, records: list[dict[str, Any]]) -> None:
        """The manifest, once every batch is on disk (rank 0, after the others are done)."""
        self._claim_once()
        values: dict[str, Any] = {}
        if records:  # (every shard holds every value: the first one's header says their dtypes and shapes)
            tensors, _ = read_header(self.shard(0))
            values = {
                name: {"dtype": str(dtype).removeprefix("torch."), "shape": shape[1:]}
                for name, (dtype, shape) in tensors.items()
                if name not in _COLUMNS and not name.startswith(STATS)
            }
        config = getattr(self.model, "config", None)
        write_json(
            self.out / "manifest.json",
            {
                "request": self.request,
                "model_config": None if config is None else json.loads(config.to_json_string()),
                "mixers": self.mixers,
                "values": values,
                "shards": records,
                "batches": batches,
                "tokens": sum(r["tokens"] for r in records),
                "docs": sum(r["docs"][1] for r in records),
                "stats": write_stats(self.out, [self.out / r["file"] for r in records], self.ranks.rank),
                "columns": list(_COLUMNS),  # (per token, in every shard: a harvest before "token" has none)
            },
        )
        for leftover in (self.out / "shards").glob(f".*.rank{self.ranks.rank}{PARTIAL}"):
            leftover.unlink(missing_ok=True)


def _checked_keep(keep: Any) -> tuple[str, ...]:
    names = (keep,) if isinstance(keep, str) else tuple(keep) if isinstance(keep, Iterable) else None
    if not names or not all(isinstance(name, str) for name in names) or len(set(names)) != len(names):
        raise InvalidValue(
            f"{_WHERE}: expected keep= distinct names (as ('states',) or ('states', 'key')), got {keep!r}"
        )
    io = [name for name in names if name in KERNEL_IO]
    if io:
        raise InvalidValue(
            f"{_WHERE}: keep={io[0]!r} is not a per-token value: name the values to keep (as 'key',"
            " 'beta', 'output': the mixer's VALUES)"
        )
    return names


def _check_keep(mixer: Any, keep: tuple[str, ...]) -> None:
    memories = [name for name, memory in KEEPABLE.items() if memory in mixer.MEMORIES]
    for name in keep:
        if name not in memories and name not in mixer.VALUES:
            raise InvalidValue(
                f"{_WHERE}: keep={name!r}, but {mixer} has no such memory or value: it keeps"
                f" {tuple(memories)} and the values {tuple(mixer.VALUES)}"
            )


def _mixer_names(model: nn.Module, mixers: list[Any], layers: frozenset[int] | None) -> dict[Any, tuple[str, str]]:
    """The harvested mixers (those of `layers`), each with its name in the files and its module path: its decoder
    layer ("3") where that layer has one mixer, else its module path (with "#k" for the k-th mixer of a module)."""
    path_of = {id(module): path for path, module in model.named_modules()}
    chosen = [m for m in mixers if layers is None or m.layer in layers]
    per_layer = [m.layer for m in chosen]
    names: dict[Any, tuple[str, str]] = {}
    for mixer in chosen:
        path = path_of.get(id(mixer.module), "")
        same_module = [m for m in chosen if m.module is mixer.module]
        if mixer.layer is not None and per_layer.count(mixer.layer) == 1:
            names[mixer] = (str(mixer.layer), path)
        else:
            names[mixer] = (path + (f"#{same_module.index(mixer)}" if len(same_module) > 1 else ""), path)
    return names


def _describe(fn: Any) -> str:
    """What identifies a reduction in a request: its qualified name (a probe: its factors' digest too)."""
    if isinstance(fn, Probe):
        digest = hashlib.sha256()
        for factor in (fn.a, fn.b):
            digest.update(factor.detach().cpu().contiguous().numpy().tobytes())
        return f"{fn!r} sha256:{digest.hexdigest()[:16]}"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _request(
    model: nn.Module,
    keep: tuple[str, ...],
    reduce: Mapping[str, Any],
    mixers: Mapping[str, Any],
    dtype: torch.dtype | None,
) -> dict[str, Any]:
    """What identifies a harvest: the model (its class, config and weights digests) and what is kept."""
    config = getattr(model, "config", None)
    config_json = "" if config is None else config.to_json_string()
    described = {
        memory: ({str(k): _describe(f) for k, f in fn.items()} if isinstance(fn, Mapping) else _describe(fn))
        for memory, fn in reduce.items()
    }
    return {
        "format": FORMAT,
        "model": {
            "class": type(model).__name__,
            "config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
            "weights_sha256": weights_digest(model),
        },
        "keep": list(keep),
        "reduce": described,
        "mixers": sorted(mixers),
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
    }


def weights_digest(model: nn.Module) -> str:
    """A digest of the model's weights: every tensor's name, dtype and shape and up to 1,024 of its values, evenly
    spaced (reading every byte of a large model would cost more than a short harvest; a fine-tune changes them all).
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        if tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        flat = sample_indices(tensor.numel(), _SAMPLED).to(tensor.device)
        picked = tensor.detach()[torch.unravel_index(flat, tensor.shape)]  # (no copy of a non-contiguous tensor)
        digest.update(picked.reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def sample_indices(count: int, samples: int) -> Tensor:
    """`min(count, samples)` indices evenly spaced over `range(count)`, from 0 to `count - 1`: int64 `i * (count - 1)
    // (n - 1)`, exact at any size (float32 indices, as `torch.linspace` gives, round past the end above 2^24)."""
    n = min(count, samples)
    if n <= 1:
        return torch.zeros(n, dtype=torch.long)
    return torch.arange(n, dtype=torch.long) * (count - 1) // (n - 1)


def _claim(out: pathlib.Path, request: dict[str, Any]) -> bool:
    """Whether `out`'s request.json is this request's (False: there is none yet, or another request's that wrote no
    file besides it, which this one replaces); another request with files on disk is refused."""
    path = out / "request.json"
    if not path.is_file():
        return False
    try:
        saved = json.loads(path.read_text())
    except ValueError:
        saved = {}
    if saved == request:
        return True
    shards = out / "shards"
    files = sorted(shards.glob("*.json")) + sorted(shards.glob("*.safetensors")) if shards.is_dir() else []
    if not files and not (out / "manifest.json").exists():
        return False  # (a call refused after writing its request, by an earlier release: nothing of it to keep)
    differ = []
    for key in sorted(set(saved) | set(request)):
        mine, theirs = request.get(key), saved.get(key)
        if isinstance(mine, dict) and isinstance(theirs, dict):  # (the model, the tokenizer, the text arguments)
            differ += [f"{key} {k}" for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        elif mine != theirs:
            differ.append(key if key != "model" else "model class")
    raise InvalidValue(
        f"{_WHERE}: {out} holds another harvest, whose request differs from this call's in:"
        f" {', '.join(differ)} ({path}; {len(files)} files in shards/): pass another out, or remove it"
    )


def _read_record(path: pathlib.Path) -> dict[str, Any] | None:
    """A shard's record, or None where there is none (or one that does not parse: its shard is written anew)."""
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except ValueError:
        return None
    fields = {"batch", "file", "docs", "tokens", "bytes", "sha256", "inputs"}
    return saved if isinstance(saved, dict) and fields <= set(saved) else None


def _same_batch(saved: Any, digest: str, index: int, where: pathlib.Path) -> None:
    if saved != digest:
        raise InvalidValue(
            f"{_WHERE}: batch {index} is not the batch harvested into {where} (its input ids or mask"
            " differ): a harvest resumes by batch number, so pass the same batches in the same order,"
            " or another out"
        )


def _refuse_left_padding(mixers: Sequence[Any], mask: Tensor | None, first_doc: int) -> None:
    """Refuse a row with a pad before a real token where a mixer's kind lets the pads into its memory
    (`LEFT_PADDING` other than "masked"): the row's values would not be the row's own."""
    if mask is None:
        return
    before = (mask == 0) & (mask.flip(1).cumsum(1).flip(1) > 0)  # a pad with a real token after it
    if not bool(before.any()):
        return
    for mixer in mixers:
        how = type(mixer).LEFT_PADDING
        if how != "masked":
            row, position = before.nonzero()[0].tolist()
            why = type(mixer).LIMITS.get("left padding", PADDING[how])
            raise Unavailable(
                f"{_WHERE}: doc {first_doc + row} has a pad at position {position} before a real token,"
                f" and {mixer} does not mask pads ({why}): pad its batches on the right"
            )


def _check_batches(batches: Any) -> None:
    """`batches` is an iterable of batches, not one batch (a tokenizer's `BatchEncoding`, a dict, a tensor)."""
    if isinstance(batches, Mapping):
        raise InvalidValue(
            f"{_WHERE}: expected batches= an iterable of batches, got one batch (a"
            f" {type(batches).__name__} with keys {sorted(map(str, batches))}): wrap it in a list,"
            " [batch]"
        )
    if isinstance(batches, Tensor):
        raise InvalidValue(
            f"{_WHERE}: expected batches= an iterable of batches, got one tensor of shape"
            f" {tuple(batches.shape)}: pass [ids] for one batch, or ids.split(batch_size)"
        )
    if not isinstance(batches, Iterable) or isinstance(batches, (str, bytes)):
        raise InvalidValue(
            f"{_WHERE}: expected batches= an iterable of batches (dicts with input_ids and"
            f" attention_mask, or id tensors), got {type(batches).__name__}"
        )


def _vocabulary(model: nn.Module) -> int | None:
    """How many token ids the model's input embedding takes (None where it has none to ask)."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    count = getattr(embeddings, "num_embeddings", None)
    return count if isinstance(count, int) else getattr(getattr(model, "config", None), "vocab_size", None)


def _as_batch(batch: Any, index: int, pad_id: int | None, vocab: int | None = None) -> tuple[Tensor, Tensor | None]:
    """A batch's ids `[batch, seq]` and its mask (None: no padding); bad batches refused."""
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise InvalidValue(
                f"{_WHERE}: batch {index}: expected a dict with 'input_ids' (and 'attention_mask'),"
                f" got keys {sorted(map(str, batch))}"
            )
        ids, mask = batch["input_ids"], batch.get("attention_mask")
    else:
        ids, mask = batch, None
    if (
        not isinstance(ids, Tensor)
        or ids.dim() not in (1, 2)
        or ids.is_floating_point()
        or ids.is_complex()
        or ids.dtype == torch.bool
    ):
        got = f"a {ids.dtype} tensor of shape {tuple(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
        raise InvalidValue(
            f"{_WHERE}: batch {index}: expected input ids as an integer tensor [batch, seq] (or a dict"
            f" with input_ids and attention_mask), got {got}"
        )
    if ids.numel() == 0:
        raise InvalidValue(
            f"{_WHERE}: batch {index}: expected at least one token, got input ids of shape {tuple(ids.shape)}"
        )
    if isinstance(mask, Tensor) and mask.dim() == 1 and ids.dim() == 1:
        mask = mask.reshape(1, -1)
    ids = ids.reshape(1, -1) if ids.dim() == 1 else ids
    ids = ids.cpu()
    if vocab is not None and not bool(((ids >= 0) & (ids < vocab)).all()):
        row, position = ((ids < 0) | (ids >= vocab)).nonzero()[0].tolist()
        raise InvalidValue(
            f"{_WHERE}: batch {index}: expected token ids in [0, {vocab}) (the model's vocabulary),"
            f" got {int(ids[row, position])} at row {row}, position {position}"
        )
    if mask is not None:
        if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(ids.shape):
            got = f"shape {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
            raise InvalidValue(
                f"{_WHERE}: batch {index}: expected attention_mask of the ids' shape {tuple(ids.shape)}, got {got}"
            )
        mask = mask.cpu()
        other = (mask != 0) & (mask != 1)
        if bool(other.any()):
            row, position = other.nonzero()[0].tolist()
            raise InvalidValue(
                f"{_WHERE}: batch {index}: expected attention_mask of 0s (pads) and 1s, got"
                f" {mask[row, position].item()} at row {row}, position {position}"
            )
    elif pad_id is not None and bool((ids == pad_id).any()):
        row, position = (ids == pad_id).nonzero()[0].tolist()
        raise InvalidValue(
            f"{_WHERE}: batch {index} holds the pad token id {pad_id} (config.pad_token_id) at row"
            f" {row}, position {position}, and no attention_mask: pass {{'input_ids': ids,"
            " 'attention_mask': mask}} (0 at pad tokens; ones where the id is a real token)"
        )
    return ids, mask


def _check_inputs(
    batches: Any, tokenizer: Any, context: Any, packing: Any, text_column: Any, batch_size: Any
) -> TextRequest | None:
    """The text arguments checked (None: `batches` are batches of token ids, checked)."""
    if tokenizer is None:
        if context is not None:
            raise InvalidValue(
                f"{_WHERE}: context={context!r} is for texts: pass tokenizer= too (batches of token ids are"
                " harvested as they come)"
            )
        _check_batches(batches)
        return None
    if isinstance(batches, (str, bytes, Mapping, Tensor)) or not isinstance(batches, Iterable):
        raise InvalidValue(
            f"{_WHERE}: with tokenizer=, expected batches= the texts, an iterable of strings or of rows (a"
            f" datasets.Dataset), got {type(batches).__name__}"
            + (": wrap one text in a list" if isinstance(batches, str) else "")
        )
    return TextRequest.check(tokenizer, context, packing, text_column, batch_size)


def _checked_rows(batch: Any, index: int, first_doc: int, pad_id: int | None, vocab: int | None) -> Rows:
    """Batch `index` as rows: a text batch's (`text_rows`) checked against the model's vocabulary, or a batch of
    ids with its documents numbered from `first_doc` and its other keys as their columns."""
    if isinstance(batch, Rows):
        mask = torch.ones_like(batch.ids) if batch.mask is None else batch.mask  # (a pad id may be a real token)
        _as_batch({"input_ids": batch.ids, "attention_mask": mask}, index, pad_id, vocab)
        return batch
    ids, mask = _as_batch(batch, index, pad_id, vocab)
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    docs = torch.arange(first_doc, first_doc + ids.shape[0]).unsqueeze(1).expand_as(ids)
    positions = real.long().cumsum(1) - 1
    documents = _row_columns(batch, index, ids.shape[0], first_doc)
    return Rows(ids, mask, docs.where(real, -1), positions.where(real, -1), first_doc, documents)


def _row_columns(batch: Any, index: int, rows: int, first_doc: int) -> list[dict[str, Any]]:
    """A batch's keys besides input_ids and attention_mask, one value per row: each row's (document's) columns."""
    columns: list[dict[str, Any]] = [{} for _ in range(rows)]
    if not isinstance(batch, Mapping):
        return columns
    single = isinstance(batch["input_ids"], Tensor) and batch["input_ids"].dim() == 1
    for key, value in batch.items():
        if key in ("input_ids", "attention_mask"):
            continue
        if not isinstance(key, str):
            raise InvalidValue(f"{_WHERE}: batch {index}: expected its keys strings, got the key {key!r}")
        if single:
            values = [value]
        elif isinstance(value, (Tensor, Sequence)) and not isinstance(value, (str, bytes)) and len(value) == rows:
            values = list(value)
        else:
            size = len(value) if isinstance(value, Sized) and not isinstance(value, (str, bytes)) else "no"
            raise InvalidValue(
                f"{_WHERE}: batch {index}: expected its key {key!r} to hold one value per row ({rows} rows), got"
                f" a {type(value).__name__} of {size} values: a harvest keeps a batch's other keys per document,"
                " so pass per-row values, or drop the key"
            )
        for row, item in enumerate(values):
            columns[row][key] = jsonable(item, key, f"batch {index}, doc {first_doc + row}")
    return columns


def _digest(rows: Rows) -> str:
    """What identifies a batch on a resume: its ids, mask, documents and positions, and its documents' columns."""
    digest = hashlib.sha256(f"{tuple(rows.ids.shape)}".encode() + rows.ids.to(torch.int64).numpy().tobytes())
    if rows.mask is not None:
        digest.update(rows.mask.to(torch.int8).numpy().tobytes())
    digest.update(rows.doc.contiguous().numpy().tobytes() + rows.position.contiguous().numpy().tobytes())
    digest.update(json.dumps(rows.documents, sort_keys=True).encode())
    return digest.hexdigest()


def _device(model: nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _size(count: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"
