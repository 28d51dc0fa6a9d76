"""A harvest's values in SAELens' cached-activations format, to train a sparse autoencoder on them with SAELens.

    data = rh.HarvestDataset("harvest/", layer=2, what="states")
    rh.export_saelens(data, "cache/", hook_name="blocks.2.states", context_size=128, head=0)
    # SAELens: LanguageModelSAERunnerConfig(use_cached_activations=True, cached_activations_path="cache/",
    #          hook_name="blocks.2.states", context_size=128, d_in=<the exported width>, ...)

The format is the one SAELens' `CacheActivationsRunner` writes and `ActivationsStore.load_cached_activation_dataset`
reads (SAELens 6): a Hugging Face `datasets.Dataset` saved with `save_to_disk`, one row per context of
`context_size` tokens, a column `hook_name` (`Array2D`, shape `(context_size, d_in)`, `dtype`) and a column
`token_ids` (a `Sequence` of `context_size` int32). Two more columns, `doc` and `position` (of the row's first
token; int64), say where each row comes from; SAELens reads only the first two. (Checked with sae-lens 6.54.12: its
`ActivationsStore` reads an export, `get_raw_llm_batch` and the training batches; its training runner still loads a
model, `model_name` or `override_model`, besides the cache.)

Rows never cross documents: each document's tokens, in position order, are cut into contexts of `context_size`;
what is left at a document's end (a document shorter than `context_size`: all of it) is dropped
(`short="drop"`, the default), or padded to a full context (`short="pad"`) with the token id `pad_token_id` and
zero values; SAELens drops tokens by id when it trains (`exclude_special_tokens`): give it `pad_token_id` among them.

Exported per token: the whole value flattened (`d_in` = the product of the per-token shape), one head (`head=h`:
the value's row `h` of its first axis, flattened), or `reduce(values) -> [n, d_in]` (a function of a batch of
values as `data.take` returns it: a tensor `[n, ...]`, or a dict of parts for a memory of several, which needs
`reduce`). It needs the `datasets` package: `pip install recurrent_hooks[saelens]`.
"""

import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ...engine.errors import InvalidValue
from ..contexts import token_ids
from .dataset import integer_argument

__all__ = ["export_saelens"]

_WHERE = "export_saelens"
_INSTALL = "pip install recurrent_hooks[saelens]"
_DTYPES = ("float16", "float32", "float64")  # (Arrow has no bfloat16)


def export_saelens(
    data: Any,
    path: str | os.PathLike,
    *,
    hook_name: str,
    context_size: int,
    head: int | None = None,
    reduce: Callable[[Any], Tensor] | None = None,
    short: str = "drop",
    pad_token_id: int | None = None,
    dtype: str = "float32",
    batch_size: int = 65536,
    progress: bool = True,
) -> Any:
    """Write one layer's values of `data` (an `rh.HarvestDataset`, or an object with `len`, `take`, `docs`,
    `positions`, `tokens`) to `path` (a new or empty directory) as SAELens' cached activations (the module
    docstring); returns the `datasets.Dataset` read back from `path`.

        rh.export_saelens(data, "cache/", hook_name="blocks.2.states", context_size=128)           # whole value
        rh.export_saelens(data, "cache/", hook_name="h", context_size=64, head=3)                  # one head
        rh.export_saelens(data, "cache/", hook_name="h", context_size=64, reduce=lambda v: v.flatten(2).norm(dim=2))

    Values are read `batch_size` tokens at a time and converted to `dtype` ("float32", SAELens' default, "float16"
    or "float64"). The rows are in document order, each document's contexts in position order. `progress=False`
    hides `datasets`' progress bars while it writes.
    """
    datasets = _datasets()
    context_size = integer_argument("context_size", context_size, 1, _WHERE)
    batch_size = integer_argument("batch_size", batch_size, 1, _WHERE)
    if head is not None:
        head = integer_argument("head", head, 0, _WHERE)
    if reduce is not None and not callable(reduce):
        raise InvalidValue(f"{_WHERE}: expected reduce= a function of a batch of values, got {type(reduce).__name__}")
    if short not in ("drop", "pad"):
        raise InvalidValue(f"{_WHERE}: expected short= 'drop' or 'pad', got {short!r}")
    if short == "pad" and pad_token_id is None:
        raise InvalidValue(f"{_WHERE}: short='pad' pads with the token id pad_token_id=: pass one")
    if dtype not in _DTYPES:
        raise InvalidValue(f"{_WHERE}: expected dtype= one of {list(_DTYPES)}, got {dtype!r}")
    if not isinstance(hook_name, str) or not hook_name or hook_name in ("token_ids", "doc", "position"):
        raise InvalidValue(f"{_WHERE}: expected hook_name= a column name other than token_ids, doc, position")
    path = pathlib.Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise InvalidValue(f"{_WHERE}: expected path= a new or empty directory, got {path}, which holds files")
    rows = _contexts(data, context_size, short == "pad")
    if not len(rows):
        raise InvalidValue(
            f"{_WHERE}: no context of {context_size} tokens: {len(data)} tokens, no document has {context_size}"
            " (pass a smaller context_size, or short='pad')"
        )
    tokens = token_ids(data, _WHERE, "SAELens' rows carry them")
    probe = _values(data, rows[0][rows[0] >= 0], head, reduce)  # (the width, and the checks, before any writing)
    features = datasets.Features(
        {
            hook_name: datasets.Array2D(shape=(context_size, probe.shape[1]), dtype=dtype),
            "token_ids": datasets.Sequence(datasets.Value("int32"), length=context_size),
            "doc": datasets.Value("int64"),
            "position": datasets.Value("int64"),
        }
    )
    docs, positions = torch.as_tensor(data.docs).long(), torch.as_tensor(data.positions).long()
    per_chunk = max(1, batch_size // context_size)
    chunks = [rows[i : i + per_chunk] for i in range(0, len(rows), per_chunk)]

    failed: list[BaseException] = []  # (datasets wraps what the generator raises: the export raises it as it is)

    def generate(chunks: list[Tensor]) -> Iterator[dict[str, Any]]:
        try:
            for chunk in chunks:
                values = _chunk_values(data, chunk, head, reduce, probe.shape[1], getattr(torch, dtype))
                ids = torch.where(chunk >= 0, tokens[chunk.clamp(min=0)], -1 if pad_token_id is None else pad_token_id)
                for row, first in enumerate(chunk[:, 0].tolist()):
                    yield {
                        hook_name: values[row],
                        "token_ids": ids[row].to(torch.int32).numpy(),
                        "doc": int(docs[first]),
                        "position": int(positions[first]),
                    }
        except BaseException as error:
            failed.append(error)
            raise

    existed = path.exists()
    path.mkdir(parents=True, exist_ok=True)
    bars = datasets.utils.logging
    shown = bars.is_progress_bar_enabled()
    if not progress:
        bars.disable_progress_bar()
    try:  # (written to a cache beside `path`, then saved to `path`: the cache is removed)
        with tempfile.TemporaryDirectory(prefix=".export-", dir=path.parent) as cache:
            written = datasets.Dataset.from_generator(
                generate, features=features, gen_kwargs={"chunks": chunks}, cache_dir=cache, keep_in_memory=False
            )
            written.save_to_disk(str(path))
            del written
    except BaseException:  # (a failed export leaves `path` as it found it: absent, or empty)
        for inside in path.iterdir():
            shutil.rmtree(inside) if inside.is_dir() else inside.unlink()
        if not existed:
            path.rmdir()
        if failed:
            raise failed[0] from None
        raise
    finally:
        if shown:
            bars.enable_progress_bar()
    return datasets.load_from_disk(str(path))


def _datasets() -> Any:
    try:
        import datasets.utils.logging  # (binds datasets)
    except ImportError as error:
        raise ImportError(f"{_WHERE} needs the `datasets` package, an optional extra: {_INSTALL}") from error
    return datasets


def _contexts(data: Any, size: int, pad: bool) -> Tensor:
    """The rows: `[rows, size]` dataset indices (-1 where padded), each row `size` consecutive tokens of one
    document, in (doc, position) order."""
    docs, positions = torch.as_tensor(data.docs).long(), torch.as_tensor(data.positions).long()
    if tuple(docs.shape) != (len(data),) or tuple(positions.shape) != (len(data),):
        raise InvalidValue(
            f"{_WHERE}: expected data.docs and data.positions of shape [{len(data)}] (len(data)), got"
            f" {list(docs.shape)} and {list(positions.shape)}"
        )
    by_position = torch.sort(positions, stable=True).indices
    order = by_position[torch.sort(docs[by_position], stable=True).indices]  # (doc, position) order
    sorted_docs, sorted_positions = docs[order], positions[order]
    counts = torch.unique_consecutive(sorted_docs, return_counts=True)[1]
    ends = torch.cumsum(counts, 0)
    begins = ends - counts
    # within a document, the positions must follow each other: a context is consecutive tokens
    steps = sorted_positions[1:] - sorted_positions[:-1]
    same = sorted_docs[1:] == sorted_docs[:-1]
    broken = same & (steps != 1)
    if broken.any():
        at = int(torch.nonzero(broken)[0])
        raise InvalidValue(
            f"{_WHERE}: doc {int(sorted_docs[at])} has positions {int(sorted_positions[at])} then"
            f" {int(sorted_positions[at + 1])}: expected each document's tokens at consecutive positions"
        )
    # each document's full contexts: its first token's place in `order` + j * size, j < count // size
    full = counts // size
    doc_of = torch.repeat_interleave(torch.arange(len(counts)), full)
    j = torch.arange(len(doc_of)) - torch.repeat_interleave(torch.cumsum(full, 0) - full, full)
    firsts, ends = begins[doc_of] + j * size, begins[doc_of] + (j + 1) * size
    if pad:  # and each document's rest, padded (-1: no item)
        rest = torch.nonzero(counts % size).flatten()
        doc_of = torch.cat([doc_of, rest])
        firsts, ends = (
            torch.cat([firsts, begins[rest] + full[rest] * size]),
            torch.cat([ends, begins[rest] + counts[rest]]),
        )
    places = firsts[:, None] + torch.arange(size)
    rows = torch.where(places < ends[:, None], order[places.clamp(max=max(len(order) - 1, 0))], -1)
    return rows[torch.sort(doc_of * (len(order) + 1) + firsts - begins[doc_of]).indices]  # by (doc, position)


def _chunk_values(
    data: Any, chunk: Tensor, head: int | None, reduce: Callable[[Any], Tensor] | None, width: int, dtype: torch.dtype
) -> Any:
    """The values of a chunk of rows (`[rows, size]` indices, -1 where padded): `[rows, size, width]` numpy, zero
    where padded."""
    flat = chunk.flatten()
    real = flat >= 0
    got = _values(data, flat[real], head, reduce)
    if got.shape[1] != width:
        first = int(flat[real][0])
        raise InvalidValue(
            f"{_WHERE}: expected reduce to return the same width for every token, {width} (the first token's), got"
            f" {got.shape[1]} for the {len(got)} tokens from item {first}"
        )
    values = torch.zeros(len(flat), width, dtype=dtype)
    values[real] = got.to(dtype)
    return values.reshape(*chunk.shape, width).numpy()


def _values(data: Any, indices: Tensor, head: int | None, reduce: Callable[[Any], Tensor] | None) -> Tensor:
    """The exported values of the items `indices`: `[n, d_in]`."""
    values = data.take(indices)
    n = len(indices)
    if isinstance(values, dict) and reduce is None:
        raise InvalidValue(
            f"{_WHERE}: the values are a memory of several parts ({sorted(values)}): pass reduce= a function of"
            " the dict of parts that returns [n, d_in] (e.g. one part flattened)"
        )
    if head is not None:
        if isinstance(values, dict):
            values = {part: _head(tensor, head, part) for part, tensor in values.items()}
        else:
            values = _head(values, head, None)
    if reduce is not None:
        values = reduce(values)
        if not isinstance(values, Tensor) or values.ndim != 2 or values.shape[0] != n:
            got = list(values.shape) if isinstance(values, Tensor) else type(values).__name__
            raise InvalidValue(f"{_WHERE}: expected reduce to return [{n}, d_in] for {n} tokens, got {got}")
    else:
        values = values.reshape(n, -1)
    if values.is_complex() or not (values.is_floating_point() or values.dtype in (torch.int32, torch.int64)):
        raise InvalidValue(f"{_WHERE}: expected real values to export, got {values.dtype}")
    return values.detach().cpu()


def _head(values: Tensor, head: int, part: str | None) -> Tensor:
    where = f" (part {part!r})" if part else ""
    if values.ndim < 2:
        raise InvalidValue(f"{_WHERE}: head={head}: the values{where} have no heads axis (per-token shape [])")
    if head >= values.shape[1]:
        raise InvalidValue(
            f"{_WHERE}: head={head} is out of range: the values{where} have {values.shape[1]} heads"
            f" (per-token shape {list(values.shape[1:])})"
        )
    return values[:, head]
