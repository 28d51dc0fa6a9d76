"""A harvest's documents and their columns: `HarvestDataset.documents`.

A batch's keys other than `input_ids` and `attention_mask` (a per-row value each: `idx`, `labels`, ...) and a text
dataset's columns other than its text are kept per document, in the `documents` entry of the `__metadata__` of the
shard of the batch where the document starts (a JSON list, one dict per document: so covered by the shard's
SHA-256, and kept or written anew with it on a resume). A harvest without columns stores none.

    data.documents                   # Documents: len() documents
    data.documents[3]                # {"idx": 3, "label": 1}: document 3's columns
    data.documents.columns           # ("idx", "label")
    data.documents["label"]          # [0, 1, ...]: a column, one value per document (None where a doc lacks it)
"""

import json
import operator
import pathlib
from collections.abc import Sequence
from typing import Any

from ...engine.errors import InvalidValue
from .shards import read_header

__all__ = ["Documents", "read_documents"]


class Documents:
    """The documents of a harvest, in document id order, each a dict of its columns."""

    def __init__(self, rows: Sequence[dict[str, Any]]) -> None:
        self._rows = list(rows)
        self.columns = tuple(sorted({name for row in self._rows for name in row}))

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"Documents({len(self)} documents, columns {list(self.columns)})"

    def __getitem__(self, key: int | str) -> Any:
        """A document's columns (`documents[doc]`, a new dict) or a column (`documents[name]`, a list)."""
        if isinstance(key, str):
            if key not in self.columns:
                raise KeyError(f"Documents: no column {key!r}; the columns: {list(self.columns)}")
            return [row.get(key) for row in self._rows]
        try:
            doc = operator.index(key)
        except TypeError:
            raise InvalidValue(
                f"Documents: expected a document id (int) or a column name (str), got {type(key).__name__}"
            ) from None
        if not -len(self) <= doc < len(self):
            raise IndexError(f"Documents: document {doc} is out of range for {len(self)} documents")
        return dict(self._rows[doc])


def read_documents(out: pathlib.Path, manifest: dict[str, Any]) -> Documents:
    """The documents of the finished harvest in `out` (every shard's header read)."""
    rows: list[dict[str, Any]] = []
    for record in manifest["shards"]:
        first, count = record["docs"]
        _, metadata = read_header(out / record["file"])
        kept = json.loads(metadata["documents"]) if "documents" in metadata else [{}] * count
        if len(kept) != count or first != len(rows):
            raise InvalidValue(
                f"{out / record['file']}: expected the columns of documents {first} to {first + count - 1},"
                f" got {len(kept)} documents' (the shard does not match its record)"
            )
        rows += kept
    return Documents(rows)
