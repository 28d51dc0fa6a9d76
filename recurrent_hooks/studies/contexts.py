"""The tokens of a harvest where a function of its values is largest, each with its document around it.

    data = rh.HarvestDataset("harvest/", layer=2, what="states")
    top = rh.top_contexts(data, lambda v: v.flatten(1).norm(dim=1), k=20, width=8, tokenizer=tok)
    print(top)                      # rank, value, doc, position, "... the [cat] sat ..."
    top[0].value, top[0].doc, top[0].position, top[0].token, top[0].tokens, top[0].values
    html = recurrent_hooks.plots.top_contexts_html(top)   # the contexts, each token shaded by fn's value at it

`fn` is called on what `data.take(indices)` returns for a batch of indices (a tensor `[n, ...]`, or a dict of parts
for a memory of several) and returns one number per token, `[n]`; a function that returns several features per token,
`[n, f]`, is read at one of them, `feature=j`. The whole dataset is read in batches of `batch_size` tokens, in
index order, keeping only the best `k` so far (memory: `k` values and one batch, besides the int64 columns `docs`,
`positions`, `tokens`); ties are broken by the lowest index.
Each context is the tokens of the same document within `width` positions of the token (never another document's),
read from `data.docs`, `data.positions` and `data.tokens`; `fn` is evaluated at every context token too, so each
context carries its values (the HTML shades by them).
"""

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ..engine.errors import InvalidValue, RecurrentHooksError, Unavailable
from .harvest.dataset import integer_argument

__all__ = ["top_contexts", "TopContexts", "Context"]

_WHERE = "top_contexts"


@dataclasses.dataclass(frozen=True)
class Context:
    """One token of a `TopContexts` and the tokens of its document around it.

    `value`, `index` (in the dataset), `doc`, `position`, `token` (its id) describe the token; `tokens`, `positions`,
    `indices`, `values` (fn at each) describe its context in position order, the token at `tokens[center]`;
    `strings` are the context's tokens decoded (None without a tokenizer). `cut_before` / `cut_after`: the document
    has tokens before / after the context that `width` left out.
    """

    rank: int
    value: float
    index: int
    doc: int
    position: int
    token: int
    center: int
    tokens: list[int]
    positions: list[int]
    indices: list[int]
    values: list[float]
    strings: list[str] | None
    cut_before: bool
    cut_after: bool

    def text(self, mark: tuple[str, str] = ("[", "]"), separator: str | None = None) -> str:
        """The context as one line, the token between `mark`s: `... the [cat] sat ...` (`...` where the document goes
        on). Decoded strings are joined as they are (a token's own spaces separate words), ids with spaces."""
        words = [str(t) for t in self.tokens] if self.strings is None else [_printable(s) for s in self.strings]
        if separator is None:
            separator = " " if self.strings is None else ""
        words[self.center] = f"{mark[0]}{words[self.center]}{mark[1]}"
        line = separator.join(words)
        return f"{'... ' if self.cut_before else ''}{line}{' ...' if self.cut_after else ''}"


@dataclasses.dataclass(frozen=True)
class TopContexts:
    """What `rh.top_contexts` returns: `contexts`, best first (`result[0]`, `len(result)`, `for c in result`).

    `str(result)` and `result.table()` are a plain-text table; `result.values` / `result.indices` are tensors of the
    ranked values and dataset indices; `recurrent_hooks.plots.top_contexts_html(result)` is an HTML rendering.
    """

    contexts: list[Context]
    k: int
    width: int
    largest: bool
    feature: int | None = None

    def __len__(self) -> int:
        return len(self.contexts)

    def __getitem__(self, rank: int) -> Context:
        return self.contexts[rank]

    def __iter__(self) -> Iterator[Context]:
        return iter(self.contexts)

    @property
    def values(self) -> Tensor:
        """The ranked values, float64 `[len(self)]`."""
        return torch.tensor([c.value for c in self.contexts], dtype=torch.float64)

    @property
    def indices(self) -> Tensor:
        """The ranked tokens' dataset indices, int64 `[len(self)]`."""
        return torch.tensor([c.index for c in self.contexts], dtype=torch.long)

    def table(self) -> str:
        """A plain-text table: rank, value, doc, position and the context with the token marked."""
        head = ("rank", "value", "doc", "position", "context")
        rows = [(str(c.rank), f"{c.value:.6g}", str(c.doc), str(c.position), c.text()) for c in self.contexts]
        widths = [max(len(row[i]) for row in [head, *rows]) for i in range(4)]
        lines = [
            "  ".join([*(cell.rjust(w) for cell, w in zip(row[:4], widths)), row[4]]).rstrip() for row in [head, *rows]
        ]
        order = "largest" if self.largest else "smallest"
        feature = "" if self.feature is None else f", feature {self.feature}"
        return "\n".join([f"top {len(self)} contexts ({order}{feature}, width {self.width})", *lines])

    def __str__(self) -> str:
        return self.table()


def top_contexts(
    data: Any,
    fn: Callable[[Any], Tensor],
    k: int = 20,
    width: int = 8,
    tokenizer: Any = None,
    batch_size: int = 4096,
    largest: bool = True,
    *,
    feature: int | None = None,
) -> TopContexts:
    """The `k` tokens of `data` (an `rh.HarvestDataset`, or any object with `len`, `take`, `docs`, `positions` and
    `tokens`) where `fn` of their values is largest (smallest with `largest=False`), each with the `width` tokens
    before and after it in its own document (the module docstring).

        top = rh.top_contexts(data, lambda v: v[:, 3].flatten(1).norm(dim=1), k=10, tokenizer=tokenizer)
        top = rh.top_contexts(data, lambda v: v.flatten(1) @ directions, feature=5)   # [n, f]: feature 5

    - `fn`: a batch of values (`data.take(indices)`) -> one number per token `[n]`, or `[n, f]` with `feature=`.
    - `tokenizer`: decodes the context tokens, each as the text it adds to the decoded context (`decode`), else
      `convert_ids_to_tokens`.
    Raises `InvalidValue` for `k < 1`, `width < 0`, `batch_size < 1`, or `fn` returning another shape or NaN (naming
    the batch), and `Unavailable` for a dataset without token ids (`data.tokens`).
    """
    k, width = integer_argument("k", k, 1, _WHERE), integer_argument("width", width, 0, _WHERE)
    batch_size = integer_argument("batch_size", batch_size, 1, _WHERE)
    if feature is not None:
        feature = integer_argument("feature", feature, 0, _WHERE)
    tokens = token_ids(data)
    docs, positions = torch.as_tensor(data.docs).long(), torch.as_tensor(data.positions).long()
    total = len(data)
    for name, column in (("docs", docs), ("positions", positions), ("tokens", tokens)):
        if tuple(column.shape) != (total,):
            raise InvalidValue(
                f"{_WHERE}: expected data.{name} of shape [{total}] (len(data)), got {list(column.shape)}"
            )
    kept_values = torch.zeros(0, dtype=torch.float64)
    kept_indices = torch.zeros(0, dtype=torch.long)
    for start in range(0, total, batch_size):
        indices = torch.arange(start, min(start + batch_size, total))
        values = _evaluate(fn, data, indices, feature, f"batch {start // batch_size} (items {start}..{indices[-1]})")
        # the kept indices are all lower than the batch's and sorted by (value, index): a stable sort of the two
        # together ranks by value, then by the lowest index
        values, indices = torch.cat([kept_values, values]), torch.cat([kept_indices, indices])
        order = torch.sort(values, descending=largest, stable=True).indices[:k]
        kept_values, kept_indices = values[order], indices[order]
    contexts = _contexts(data, fn, feature, kept_values, kept_indices, docs, positions, tokens, width, batch_size)
    if tokenizer is not None:
        contexts = [dataclasses.replace(c, strings=_decode(tokenizer, c.tokens)) for c in contexts]
    return TopContexts(contexts, k, width, largest, feature)


def token_ids(data: Any, where: str = _WHERE, why: str = "the contexts are read from them") -> Tensor:
    """`data.tokens` as int64 `[len(data)]`, or `Unavailable` naming what is missing and `why` it is needed, and
    `InvalidValue` for ids that are not integers of one per item (`where`: the caller, for messages)."""
    try:
        tokens = getattr(data, "tokens", None)
    except RecurrentHooksError as error:  # (a reader that raises Unavailable for a harvest without tokens)
        raise Unavailable(f"{where}: the dataset has no token ids: {error}") from error
    if tokens is None:
        raise Unavailable(
            f"{where}: the dataset ({type(data).__name__}) has no token ids (`data.tokens`, int64 [len(data)]): {why};"
            " harvest with token ids kept, or pass a dataset that has them"
        )
    tokens = torch.as_tensor(tokens)
    if (
        tuple(tokens.shape) != (len(data),)
        or tokens.is_floating_point()
        or tokens.is_complex()
        or tokens.dtype == torch.bool
    ):
        raise InvalidValue(
            f"{where}: expected data.tokens integer ids [{len(data)}], got {tokens.dtype} {tokens.shape}"
        )
    return tokens.long()


def _evaluate(fn: Callable[[Any], Tensor], data: Any, indices: Tensor, feature: int | None, where: str) -> Tensor:
    """`fn` at the items `indices`: float64 `[len(indices)]` on the CPU, checked."""
    out = fn(data.take(indices))
    n = len(indices)
    if not isinstance(out, Tensor):
        raise InvalidValue(f"{_WHERE}: expected fn to return a tensor [{n}], got {type(out).__name__} for {where}")
    shape = list(out.shape)
    if feature is None and shape != [n]:
        hint = " (several features per token: pass feature=)" if len(shape) == 2 and shape[0] == n else ""
        raise InvalidValue(
            f"{_WHERE}: expected fn to return [{n}] (one number per token), got {shape} for {where}{hint}"
        )
    if feature is not None:
        if len(shape) != 2 or shape[0] != n:
            raise InvalidValue(
                f"{_WHERE}: with feature= expected fn to return [{n}, features], got {shape} for {where}"
            )
        if feature >= shape[1]:
            raise InvalidValue(f"{_WHERE}: feature={feature} is out of range: fn returned {shape[1]} features")
        out = out[:, feature]
    if out.is_complex():
        raise InvalidValue(f"{_WHERE}: expected fn to return real numbers, got {out.dtype} for {where}")
    out = out.detach().to("cpu", torch.float64)
    if torch.isnan(out).any():
        first = int(indices[torch.isnan(out)][0])
        raise InvalidValue(f"{_WHERE}: fn returned NaN for {where}, first at item {first}")
    return out


def _contexts(
    data: Any,
    fn: Callable[[Any], Tensor],
    feature: int | None,
    values: Tensor,
    indices: Tensor,
    docs: Tensor,
    positions: Tensor,
    tokens: Tensor,
    width: int,
    batch_size: int,
) -> list[Context]:
    """Each ranked token's context: the tokens of its document within `width` positions, in position order."""
    if not len(indices):
        return []
    # the items in (doc, position) order, and each item's place in it
    by_position = torch.sort(positions, stable=True).indices
    order = by_position[torch.sort(docs[by_position], stable=True).indices]
    place = torch.empty_like(order)
    place[order] = torch.arange(len(order))
    windows = []
    for index in indices.tolist():
        at, doc, position = int(place[index]), int(docs[index]), int(positions[index])
        low, high = max(at - width, 0), min(at + width + 1, len(order))
        near = order[low:high]
        inside = (docs[near] == doc) & ((positions[near] - position).abs() <= width)
        windows.append(near[inside])
    # fn at every context token, read once each
    every = torch.unique(torch.cat(windows))
    at_every = torch.cat(
        [
            _evaluate(fn, data, every[s : s + batch_size], feature, f"the context tokens {s}..")
            for s in range(0, len(every), batch_size)
        ]
    )
    value_of = dict(zip(every.tolist(), at_every.tolist()))
    contexts = []
    for rank, (value, index, window) in enumerate(zip(values.tolist(), indices.tolist(), windows)):
        doc, first, last = int(docs[index]), int(place[window[0]]), int(place[window[-1]])
        contexts.append(
            Context(
                rank=rank,
                value=value,
                index=index,
                doc=doc,
                position=int(positions[index]),
                token=int(tokens[index]),
                center=window.tolist().index(index),
                tokens=tokens[window].tolist(),
                positions=positions[window].tolist(),
                indices=window.tolist(),
                values=[value_of[i] for i in window.tolist()],
                strings=None,
                cut_before=first > 0 and int(docs[order[first - 1]]) == doc,
                cut_after=last + 1 < len(order) and int(docs[order[last + 1]]) == doc,
            )
        )
    return contexts


def _decode(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token of `ids` as the text it adds to the decoded context, with the space before it where the tokenizer
    puts one (what `decode(ids[:i + 1])` adds to `decode(ids[:i])`: word-level tokenizers join their words with
    spaces, byte-level ones carry their own); `tokenizer.convert_ids_to_tokens(ids)` where it cannot decode."""
    ids = [int(i) for i in ids]
    if hasattr(tokenizer, "decode"):
        texts = [str(tokenizer.decode(ids[:end])) for end in range(len(ids) + 1)]
        if all(longer.startswith(shorter) for shorter, longer in zip(texts, texts[1:])):
            return [longer[len(shorter) :] for shorter, longer in zip(texts, texts[1:])]
        return [str(tokenizer.decode([i])) for i in ids]  # (a decoder that rewrites earlier text: each token alone)
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return [str(s) for s in tokenizer.convert_ids_to_tokens(ids)]
    raise InvalidValue(
        f"{_WHERE}: expected tokenizer= an object with decode or convert_ids_to_tokens, got {type(tokenizer).__name__}"
    )


def _printable(text: str) -> str:
    return text.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
