"""Text in: documents tokenized in batches, packed into contexts of `context` tokens or kept one to a row.

    rows = text_rows(texts, tokenizer, TextRequest(context=128, packing=True, text_column="text", batch_size=8))

`texts` is an iterable of strings, or of dicts (a `datasets.Dataset` or `IterableDataset`'s rows): the text in
`text_column`, the other columns kept per document (`Rows.documents`). Every document is tokenized without the
tokenizer's own special tokens (the tokenizer's batch call, `_CHUNK` documents at a time), then given one
separator: the tokenizer's bos at its start where the tokenizer has a bos token, else its eos at its end (a tokenizer
with neither is refused for packing; unpacked, a document is then its tokens only). The separator is a token of its
document (a bos is its position 0).

- `packing=True`: the documents' tokens, one after another, cut into contexts of exactly `context` tokens (a
  context may hold the end of one document and the start of the next; the model sees both, as in pretraining);
  the last context, partial, is padded on the right (its pads masked: no token is dropped), which needs the
  tokenizer's pad token.
- `packing=False`: one document per row, truncated at `context` tokens; a batch's rows padded on the right to its
  longest (masked), which needs the tokenizer's pad token where lengths differ.

Each token's document id (the documents' running number, from 0) and position in its document come with it.
Refused, naming the document: a text that is not a string, an empty text, a row without `text_column` (the columns
it has named), a column value that is not JSON (a string, number, bool, None, or lists and dicts of them).

Module contents: `TextRequest` (the arguments, checked), `Rows` (one forward's rows, as the harvest writes them),
`text_rows`, `tokenizer_identity` (what identifies a tokenizer in a harvest's request), `jsonable`.
"""

import dataclasses
import hashlib
import itertools
import json
import operator
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from ...engine.errors import InvalidValue

__all__ = ["TextRequest", "Rows", "text_rows", "tokenizer_identity", "jsonable"]

_WHERE = "harvest"
_CHUNK = 256  # documents per call of the tokenizer


@dataclasses.dataclass(frozen=True)
class Rows:
    """One forward's rows: ids and mask `[rows, seq]`, each token's document id and position in it (-1 at pads),
    and the columns of the documents that start in these rows (documents `first_doc`, `first_doc + 1`, ...)."""

    ids: Tensor
    mask: Tensor | None
    doc: Tensor
    position: Tensor
    first_doc: int
    documents: list[dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class TextRequest:
    """`rh.harvest`'s text arguments, checked (`check`) before anything runs."""

    context: int
    packing: bool
    text_column: str
    batch_size: int

    @classmethod
    def check(cls, tokenizer: Any, context: Any, packing: Any, text_column: Any, batch_size: Any) -> "TextRequest":
        if not callable(tokenizer) or not hasattr(tokenizer, "convert_ids_to_tokens"):
            raise InvalidValue(
                f"{_WHERE}: expected tokenizer= a transformers tokenizer (as AutoTokenizer.from_pretrained(...)'s),"
                f" got {type(tokenizer).__name__}"
            )
        if _integer(context) is None or context < 2:
            raise InvalidValue(
                f"{_WHERE}: expected context= the tokens per row, an integer of at least 2, got {context!r}"
            )
        if _integer(batch_size) is None or batch_size < 1:
            raise InvalidValue(f"{_WHERE}: expected batch_size= rows per forward, an integer >= 1, got {batch_size!r}")
        if not isinstance(packing, bool):
            raise InvalidValue(f"{_WHERE}: expected packing= True or False, got {packing!r}")
        if not isinstance(text_column, str):
            raise InvalidValue(f"{_WHERE}: expected text_column= a column name (a str), got {text_column!r}")
        if packing and _separator(tokenizer)[0] is None:
            raise InvalidValue(
                f"{_WHERE}: packing=True needs a separator between documents, and {type(tokenizer).__name__} has"
                " neither a bos nor an eos token: set tokenizer.eos_token, or pass packing=False"
            )
        return cls(int(context), packing, text_column, int(batch_size))

    def described(self, tokenizer: Any) -> dict[str, Any]:
        """What identifies the text arguments in a harvest's request."""
        return {**dataclasses.asdict(self), "separator": _separator(tokenizer)[0]}


def _integer(value: Any) -> int | None:
    try:
        return None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        return None


def _separator(tokenizer: Any) -> tuple[str | None, int | None]:
    """("bos", id) where the tokenizer has a bos token, else ("eos", id), else (None, None)."""
    for name in ("bos", "eos"):
        token = getattr(tokenizer, f"{name}_token_id", None)
        if isinstance(token, int):
            return name, token
    return None, None


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What identifies a tokenizer: its class, vocabulary size, a SHA-256 of its whole definition (a fast
    tokenizer's tokenizer.json; else its vocabulary), its bos, eos and unk tokens and their ids. Not its pad token:
    pads are masked and never harvested, so a harvest refused for want of one resumes once one is set."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        content = backend.to_str()
    else:
        content = json.dumps(sorted(tokenizer.get_vocab().items()))
    special = {
        name: str(getattr(tokenizer, name, None))
        for name in ("bos_token", "eos_token", "unk_token")
        if getattr(tokenizer, name, None) is not None
    }
    ids = {f"{name}_id": getattr(tokenizer, f"{name}_id", None) for name in special}
    return {
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "sha256": hashlib.sha256(content.encode()).hexdigest(),
        "special_tokens": {**special, **ids},
    }


def jsonable(value: Any, name: str, where: str) -> Any:
    """`value` as JSON keeps it (a tensor or numpy array as nested lists); refused naming `name` and `where`."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as error:
        raise InvalidValue(
            f"{_WHERE}: {where}: the column {name!r} holds a {type(value).__name__}, which a harvest cannot keep"
            f" ({error}): pass strings, numbers, bools, None, or lists and dicts of them, or drop the column"
        ) from None
    return value


def _documents(texts: Iterable[Any], column: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each document's text and its other columns, checked."""
    names = getattr(texts, "column_names", None)
    if isinstance(names, list) and column not in names:  # (a datasets.Dataset: said before any row is read)
        raise InvalidValue(f"{_WHERE}: text_column={column!r} is not a column of the texts; their columns: {names}")
    for index, row in enumerate(texts):
        columns: dict[str, Any] = {}
        if isinstance(row, Mapping):
            if column not in row:
                raise InvalidValue(
                    f"{_WHERE}: document {index} has no column {column!r} (text_column=); its columns:"
                    f" {sorted(map(str, row))}"
                )
            where = f"document {index}"
            columns = {str(key): jsonable(value, str(key), where) for key, value in row.items() if key != column}
            row = row[column]
        if not isinstance(row, str):
            raise InvalidValue(f"{_WHERE}: expected document {index}'s text a str, got {type(row).__name__}")
        if not row:
            raise InvalidValue(
                f"{_WHERE}: document {index}'s text is empty: a harvest keeps every document, so drop empty"
                " ones first (as dataset.filter(lambda row: row['text']))"
            )
        yield row, columns


def _tokenized(tokenizer: Any, texts: Iterable[Any], column: str) -> Iterator[tuple[list[int], dict[str, Any]]]:
    """Each document's token ids (with its separator) and columns, tokenized `_CHUNK` documents at a time."""
    where, separator = _separator(tokenizer)
    documents = _documents(texts, column)
    start = 0
    while chunk := list(itertools.islice(documents, _CHUNK)):
        encoded = tokenizer([text for text, _ in chunk], add_special_tokens=False)["input_ids"]
        for offset, (ids, (_, columns)) in enumerate(zip(encoded, chunk)):
            ids = [separator, *ids] if where == "bos" else [*ids, separator] if where == "eos" else list(ids)
            if not ids:
                raise InvalidValue(
                    f"{_WHERE}: document {start + offset}'s text tokenizes to no token (and the tokenizer has no"
                    " bos or eos to mark it): drop it, or give the tokenizer an eos token"
                )
            yield ids, columns
        start += len(chunk)


def text_rows(texts: Iterable[Any], tokenizer: Any, request: TextRequest) -> Iterator[Rows]:
    """The rows of every forward (module docstring)."""
    documents = _tokenized(tokenizer, texts, request.text_column)
    if request.packing:
        yield from _packed(documents, tokenizer, request)
    else:
        yield from _unpacked(documents, tokenizer, request)


def _packed(
    documents: Iterator[tuple[list[int], dict[str, Any]]], tokenizer: Any, request: TextRequest
) -> Iterator[Rows]:
    size = request.context * request.batch_size
    ids: list[int] = []
    docs: list[int] = []
    positions: list[int] = []
    columns: list[dict[str, Any]] = []
    first = 0
    for doc, (tokens, kept) in enumerate(documents):
        ids += tokens
        docs += [doc] * len(tokens)
        positions += range(len(tokens))
        columns.append(kept)
        while len(ids) >= size:
            starting = columns[: _started(docs[:size], first)]
            yield _rows(ids[:size], docs[:size], positions[:size], request.context, first, starting, None)
            first += len(starting)
            del columns[: len(starting)], ids[:size], docs[:size], positions[:size]
    if ids:
        pad = _pad_id(tokenizer, first)
        yield _rows(ids, docs, positions, request.context, first, columns, pad)


def _started(docs: list[int], first: int) -> int:
    """How many documents from `first` on start in a run of tokens whose document ids are `docs`."""
    return max(0, docs[-1] - first + 1)


def _rows(
    ids: list[int],
    docs: list[int],
    positions: list[int],
    context: int,
    first: int,
    columns: list[dict[str, Any]],
    pad: int | None,
) -> Rows:
    """Packed tokens as rows of `context` (the last padded with `pad`, masked, where it is partial)."""
    short = -len(ids) % context
    mask = None
    if short:
        mask = torch.ones(len(ids) + short, dtype=torch.long)
        mask[len(ids) :] = 0
        mask = mask.reshape(-1, context)
    shaped = [
        torch.tensor(values + [fill] * short, dtype=torch.long).reshape(-1, context)
        for values, fill in ((ids, pad), (docs, -1), (positions, -1))
    ]
    return Rows(shaped[0], mask, shaped[1], shaped[2], first, list(columns))


def _pad_id(tokenizer: Any, first_doc: int) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if not isinstance(pad, int):
        raise InvalidValue(
            f"{_WHERE}: the rows from document {first_doc} on need padding, and {type(tokenizer).__name__} has no"
            " pad token: set one (as tokenizer.pad_token = tokenizer.eos_token; pads are masked)"
        )
    return pad


def _unpacked(
    documents: Iterator[tuple[list[int], dict[str, Any]]], tokenizer: Any, request: TextRequest
) -> Iterator[Rows]:
    first = 0
    while batch := list(itertools.islice(documents, request.batch_size)):
        rows = [tokens[: request.context] for tokens, _ in batch]
        longest = max(map(len, rows))
        mask = None
        pad = 0
        if any(len(row) < longest for row in rows):
            pad = _pad_id(tokenizer, first)
            mask = torch.tensor([[1] * len(row) + [0] * (longest - len(row)) for row in rows], dtype=torch.long)
        ids = torch.tensor([row + [pad] * (longest - len(row)) for row in rows], dtype=torch.long)
        docs = torch.arange(first, first + len(rows)).unsqueeze(1).expand(-1, longest).clone()
        positions = torch.arange(longest).expand(len(rows), -1).clone()
        if mask is not None:
            docs[mask == 0] = -1
            positions[mask == 0] = -1
        yield Rows(ids, mask, docs, positions, first, [kept for _, kept in batch])
        first += len(rows)
