"""Metrics for the studies: functions of the logits that return one value per row, as `patching_sweep` and
`attribute` take them.

    metric = rh.metrics.logit_difference(answer, wrong)   # logits[:, -1, answer] - logits[:, -1, wrong]
    metric = rh.metrics.log_prob(answer)                  # log softmax of the last position, at the answer
    rh.attribute(model, clean, corrupt, metric)

Glossary (code name, shape):
    logits     [batch, seq, vocab]   what the model returns
    answer     int or [batch]        the token whose logit (or log-probability) is read: one for every row, or
                                     one per row (prompt pairs, each with its own answer)
    wrong      int or [batch]        the token the answer is compared with
    position   int or [batch]        the position read (default -1, the last), for every row or per row
    (result)   [batch]               one value per row, float32

The contract every study holds a metric to (`per_row`, one message for both studies): `metric(logits)` on logits
of `rows` rows returns
- a tensor of shape `[rows]`: one value per row, taken as it is;
- a 0-d tensor: one value for logits of one row; for logits of several rows the metric is called once per row,
  on `logits[r:r + 1]`, and the values stacked (so a metric written for one prompt serves a batch of them);
- anything else (another shape, a Python number, a list) is refused, naming what was expected and what came.
An exception the metric raises keeps its type and gains a note naming the study and the logits' shape.
"""

from typing import Any

import torch
from torch import Tensor

from ..engine.errors import InvalidValue, noted

__all__ = ["logit_difference", "log_prob"]


def per_row(metric: Any, logits: Tensor, where: str) -> Tensor:
    """`[rows]`: `metric(logits)` per row of `logits` (`[rows, seq, vocab]`), by the contract of the module
    docstring; `where` names the study in a refusal and in the note on what the metric raised."""
    rows = logits.shape[0]
    name = getattr(metric, "__qualname__", None) or repr(metric)
    with noted(lambda: f"raised in the metric {name} of {where}, on logits of shape {tuple(logits.shape)}"):
        value = metric(logits)
        if isinstance(value, Tensor) and value.dim() == 0 and rows > 1:
            value = torch.stack(
                [
                    _checked_value(metric(logits[r : r + 1]), 1, logits[r : r + 1], where).reshape(())
                    for r in range(rows)
                ]
            )
    return _checked_value(value, rows, logits, where)


def _checked_value(value: Any, rows: int, logits: Tensor, where: str) -> Tensor:
    if isinstance(value, Tensor) and (tuple(value.shape) == (rows,) or value.dim() == 0 and rows == 1):
        return value.reshape(rows)
    got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
    raise InvalidValue(
        f"{where}: expected metric(logits) to return one value per row, a tensor of shape ({rows},)"
        f" (or a 0-d tensor, the value of one row) for logits of shape {tuple(logits.shape)}, got {got}"
        " (docs/api.md, 'Metrics')"
    )


def for_rows(metric: Any, pairs: list[int] | None) -> Any:
    """The metric of a batch whose row r belongs to pair `pairs[r]` (None: the batch is the pairs as given):
    `metric.for_rows(pairs)` where it has that method (`rh.metrics`' do), else `metric.for_pair(n)` for rows of one
    pair n, else `metric` itself (a plain callable is one metric for every pair)."""
    if pairs is None:
        return metric
    rows, pair = getattr(metric, "for_rows", None), getattr(metric, "for_pair", None)
    if callable(rows):
        return rows(torch.tensor(pairs))
    return pair(pairs[0]) if callable(pair) else metric


def mixes_pairs(metric: Any) -> bool:
    """Whether one batch may hold rows of several pairs: not for a metric that knows only `for_pair`."""
    return callable(getattr(metric, "for_rows", None)) or not callable(getattr(metric, "for_pair", None))


class _Metric:
    """A metric of the logits, with the tokens and position it reads (its repr names them)."""

    def __init__(self, name: str, tokens: dict[str, Any], position: Any) -> None:
        self.name, self.position = name, _checked(position, "position", f"metrics.{name}")
        self.tokens = {key: _checked(value, key, f"metrics.{name}") for key, value in tokens.items()}

    def __repr__(self) -> str:
        shown = ", ".join(f"{key}={_shown(value)}" for key, value in {**self.tokens, "position": self.position}.items())
        return f"rh.metrics.{self.name}({shown})"

    def for_pair(self, pair: int) -> "_Metric":
        """The metric of pair `pair` alone (its entry of each per-row tensor, for every row): what
        `patching_sweep` measures that pair's cells with, whose rows are cells of one pair."""
        pick = lambda value: value if isinstance(value, int) else int(value[pair])  # noqa: E731
        return type(self)(self.name, {key: pick(value) for key, value in self.tokens.items()}, pick(self.position))

    def for_rows(self, pairs: Tensor) -> "_Metric":
        """The metric of a batch whose row r belongs to pair `pairs[r]` (each per-row tensor's entries at `pairs`):
        what `patching_sweep` measures a batch of several pairs' cells with."""
        pick = lambda value: value if isinstance(value, int) else value[pairs.to(value.device)]  # noqa: E731
        return type(self)(self.name, {key: pick(value) for key, value in self.tokens.items()}, pick(self.position))

    def _rows(self, logits: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The logits each row reads, `[batch, vocab]` float32, and the tokens, `[batch]` each."""
        where = repr(self)
        if not isinstance(logits, Tensor) or logits.dim() != 3:
            got = f"shape {tuple(logits.shape)}" if isinstance(logits, Tensor) else type(logits).__name__
            raise InvalidValue(f"{where}: expected logits [batch, seq, vocab], got {got}")
        batch, seq, vocab = logits.shape
        rows = torch.arange(batch, device=logits.device)
        position = _per_row(self.position, batch, logits.device, "position", where)
        if bool(((position < -seq) | (position >= seq)).any()):
            raise InvalidValue(f"{where}: a position outside the {seq} positions of the logits")
        tokens = {key: _per_row(value, batch, logits.device, key, where) for key, value in self.tokens.items()}
        for key, value in tokens.items():
            if bool(((value < 0) | (value >= vocab)).any()):
                raise InvalidValue(f"{where}: {key} outside the vocabulary of {vocab} tokens")
        return logits[rows, position % seq].float(), tokens


class _LogitDifference(_Metric):
    def __call__(self, logits: Tensor) -> Tensor:
        read, tokens = self._rows(logits)
        rows = torch.arange(read.shape[0], device=read.device)
        return read[rows, tokens["answer"]] - read[rows, tokens["wrong"]]


class _LogProb(_Metric):
    def __call__(self, logits: Tensor) -> Tensor:
        read, tokens = self._rows(logits)
        rows = torch.arange(read.shape[0], device=read.device)
        return read.log_softmax(-1)[rows, tokens["answer"]]


def logit_difference(answer: Any, wrong: Any, position: Any = -1) -> _LogitDifference:
    """`metric(logits)` = logits[row, position, answer] - logits[row, position, wrong], one value per row.

        metric = rh.metrics.logit_difference(answer=7, wrong=9)
        sweep = rh.patching_sweep(model, clean, corrupt, metric)

    `answer`, `wrong`, `position`: an int for every row, or a `[batch]` tensor (or list) of one per row."""
    return _LogitDifference("logit_difference", {"answer": answer, "wrong": wrong}, position)


def log_prob(answer: Any, position: Any = -1) -> _LogProb:
    """`metric(logits)` = log_softmax(logits[row, position])[answer], one value per row (in float32).

        metric = rh.metrics.log_prob(answer=7)
        result = rh.attribute(model, clean, corrupt, metric)

    `answer`, `position`: an int for every row, or a `[batch]` tensor (or list) of one per row."""
    return _LogProb("log_prob", {"answer": answer}, position)


def _checked(value: Any, name: str, where: str) -> int | Tensor:
    if isinstance(value, bool):
        raise InvalidValue(f"{where}: expected {name} as an int or a [batch] tensor of ints, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)):
        value = torch.tensor(value)
    if isinstance(value, Tensor) and value.dim() == 0 and not value.is_floating_point():
        return int(value)
    if not isinstance(value, Tensor) or value.dim() != 1 or value.is_floating_point() or value.dtype == torch.bool:
        got = f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)
        raise InvalidValue(f"{where}: expected {name} as an int or a [batch] tensor of ints, got {got}")
    return value.long()


def _per_row(value: int | Tensor, batch: int, device: torch.device, name: str, where: str) -> Tensor:
    if isinstance(value, int):
        return torch.full((batch,), value, dtype=torch.long, device=device)
    if value.shape[0] != batch:
        raise InvalidValue(
            f"{where}: {name} has {value.shape[0]} entries (one per row) but the logits have {batch} rows"
        )
    return value.to(device)


def _shown(value: int | Tensor) -> str:
    return (
        str(value)
        if isinstance(value, int)
        else f"[{', '.join(map(str, value.tolist()[:4]))}{', ...' if value.numel() > 4 else ''}]"
    )
