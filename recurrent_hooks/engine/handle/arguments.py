"""Checking and normalizing what users hand the library: tokens, calls, per-row tokens, keep.

Every public entry point goes through these, so that a bool, a float or a 0-d tensor gets the same
answer (and the same message, naming what was expected, what arrived and where) everywhere.
"""

import dataclasses
import operator
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..declare.kernels import KEEPABLE, RENAMED_KEEP
from ..errors import InvalidValue, renamed


def as_index(value: Any, what: str, where: str) -> int:
    """`value` as a Python int: an int or an integer 0-d tensor; bools, floats and the rest raise InvalidValue."""
    if isinstance(value, bool) or (isinstance(value, Tensor) and value.dtype == torch.bool):
        raise InvalidValue(f"{where}: {what} must be an int, got the bool {value!r}")
    if isinstance(value, Tensor) and (value.dim() != 0 or value.is_floating_point() or value.is_complex()):
        raise InvalidValue(
            f"{where}: {what} must be an int or an integer 0-d tensor,"
            f" got a {value.dtype} tensor of shape {tuple(value.shape)}"
        )
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidValue(f"{where}: {what} must be an int, got {type(value).__name__} {value!r}") from None


def as_history(value: Any, where: str) -> int | None:
    """How many of its last calls' records each mixer of a watch keeps: None (every call's) or an int >= 1 (a numpy or
    0-d tensor integer is taken as the int it is); bools, floats and the rest raise InvalidValue."""
    if value is None:
        return None
    expected = f"{where}: expected history= None (keep every call's record) or a number of calls >= 1"
    if isinstance(value, bool) or (
        isinstance(value, Tensor) and (value.dim() != 0 or value.dtype == torch.bool or value.is_floating_point())
    ):
        raise InvalidValue(f"{expected}, got history={value!r} ({type(value).__name__})")
    try:
        count = operator.index(value)
    except TypeError:
        raise InvalidValue(f"{expected}, got history={value!r} ({type(value).__name__})") from None
    if count < 1:
        raise InvalidValue(f"{expected}, got history={count}")
    return count


def as_token_selection(value: Any, where: str, tokens: int | None) -> int | list[int]:
    """What a reader or writer of the memory after some tokens takes: an int (one token, returned as it is), or
    several, returned as a list: a list, tuple or range of ints, or a slice. `tokens` is the call's token count, by
    which a slice is resolved (None, for a write registered before its call runs: a slice with both bounds given
    and not negative, `slice(2, 5)`)."""
    if isinstance(value, slice):
        if tokens is not None:
            return list(range(*value.indices(tokens)))
        start, stop, step = value.start or 0, value.stop, 1 if value.step is None else value.step
        if (
            not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, stop, step))
            or min(start, stop) < 0
            or step < 1
        ):
            raise InvalidValue(
                f"{where}: expected a slice of tokens with a stop and no negative bound (the call's"
                f" length is not known when a write is registered; list the tokens instead), got"
                f" {value}"
            )
        return list(range(start, stop, step))
    if isinstance(value, (list, tuple, range)):
        if len(value) == 0:
            raise InvalidValue(f"{where}: expected at least one token, got an empty {type(value).__name__}")
        return [as_index(item, "token", where) for item in value]
    return as_index(value, "token", where)


def as_targets(value: Any, what: str, where: str) -> tuple[int, ...] | None:
    """Token positions: None (every token), an int, or a non-empty iterable of ints (negative: from the end)."""
    if value is None:
        return None
    if (
        isinstance(value, (str, bytes, float))
        or not isinstance(value, Iterable)
        or isinstance(value, Tensor)
        and value.dim() == 0
    ):
        return (as_index(value, what, where),)
    items = tuple(as_index(item, what, where) for item in value)
    if not items:
        raise InvalidValue(f"{where}: {what} must be an int, a non-empty iterable of ints or None, got {value!r}")
    return items


def as_calls(value: Any, where: str) -> "frozenset[int] | range | None":
    """Call targets: None (every call), an int, a non-empty iterable of ints, a `range` or a `slice` of
    calls (`slice(1, None)`: every decode step). Calls count from 0; negative calls are refused."""
    if value is None:
        return None
    if isinstance(value, (slice, range)):
        start, stop, step = value.start, value.stop, value.step
        start, step = (0 if start is None else start), (1 if step is None else step)
        stop = sys.maxsize if stop is None else stop
        if (
            not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop, step))
            or start < 0
            or stop < 0
            or step < 1
        ):
            raise InvalidValue(
                f"{where}: a slice of calls needs start >= 0, stop >= 0 or None and step >= 1, got call={value!r}"
            )
        if stop <= start:
            raise InvalidValue(f"{where}: call={value!r} targets no call")
        return range(start, stop, step)
    calls = as_targets(value, "call", where)
    if any(c < 0 for c in calls):
        raise InvalidValue(f"{where}: calls count from 0, got call={value!r}")
    return frozenset(calls)


def describe_calls(calls: "frozenset[int] | range | None") -> str:
    if calls is None:
        return "None"
    if isinstance(calls, range):
        stop = "None" if calls.stop == sys.maxsize else calls.stop
        return f"slice({calls.start}, {stop}, {calls.step})" if calls.step != 1 else f"slice({calls.start}, {stop})"
    return str(next(iter(calls))) if len(calls) == 1 else str(sorted(calls))


def describe_token(token: Any) -> str:
    if isinstance(token, Tensor) and token.dim() > 0:
        return f"<{'mask' if token.dtype == torch.bool else 'tokens'} {tuple(token.shape)}>"
    return repr(token)


@dataclasses.dataclass(frozen=True)
class RowTokens:
    """A write at a different token in each batch row: one token per row (negative: from the end), or a
    `[batch, seq]` mask of the tokens written in each row."""

    per_row: Tensor | None  # [batch] integer tokens
    mask: Tensor | None  # [batch, seq] bool
    tokens: tuple[int, ...]  # the tokens at which some row is written (what the write's hook targets)

    @classmethod
    def of(cls, token: Tensor, where: str) -> "RowTokens":
        if token.dtype == torch.bool:
            if token.dim() != 2:
                raise InvalidValue(f"{where}: a mask of tokens must be [batch, seq], got shape {tuple(token.shape)}")
            columns = token.any(0).nonzero().flatten().tolist()
            if not columns:
                raise InvalidValue(f"{where}: the mask of tokens selects no token")
            return cls(None, token.detach().cpu(), tuple(columns))
        if token.dim() != 1 or token.is_floating_point() or token.is_complex():
            raise InvalidValue(
                f"{where}: per-row tokens must be a 1-d integer tensor (one token per batch row)"
                f" or a [batch, seq] bool mask, got a {token.dtype} tensor of shape"
                f" {tuple(token.shape)}"
            )
        per_row = token.detach().cpu().long()
        return cls(per_row, None, tuple(sorted(set(per_row.tolist()))))

    def at(self, token: int, tokens: int, batch: int, where: str) -> Tensor:
        """The rows written at `token` of a call of `tokens` tokens: `[batch]` bool."""
        given = (self.per_row if self.per_row is not None else self.mask).shape[0]
        if given != batch:
            raise InvalidValue(f"{where}: per-row tokens for {given} rows, but the call has batch {batch}")
        if self.mask is not None:
            if self.mask.shape[1] != tokens:
                raise InvalidValue(f"{where}: a mask of {self.mask.shape[1]} tokens, but the call has {tokens}")
            return self.mask[:, token]
        valid = (self.per_row >= -tokens) & (self.per_row < tokens)
        return valid & (self.per_row % tokens == token)


def renamed_keep(keep: Any) -> Any:
    """`keep` with its former names (`RENAMED_KEEP`: "conv_states") replaced by the new ones, each with a
    `RecurrentHooksDeprecationWarning`; anything else is returned as it came (`normalize_keep` checks it)."""
    if isinstance(keep, str):
        keep = (keep,)
    names = keep.keys() if isinstance(keep, Mapping) else keep if isinstance(keep, Sequence) else ()
    old = [name for name in names if isinstance(name, str) and name in RENAMED_KEEP]
    if not old:
        return keep
    for name in old:
        renamed(f"watch: keep={name!r}", f"keep={RENAMED_KEEP[name]!r}", stacklevel=5)
    if isinstance(keep, Mapping):
        return {RENAMED_KEEP.get(name, name): positions for name, positions in keep.items()}
    return tuple(RENAMED_KEEP.get(name, name) for name in keep)


def normalize_keep(
    keep: Sequence[str] | Mapping[str, Iterable[int] | None],
) -> tuple[dict[str, tuple[int, ...] | None], frozenset[str]]:
    """`keep` as (memory -> kept token positions, None for every token; the kernel's tensors kept: "inputs",
    "outputs"). Names are checked against KEEPABLE (a former name warns: `renamed_keep`)."""
    keep = renamed_keep(keep)
    items = keep.items() if isinstance(keep, Mapping) else ((name, None) for name in keep)
    memories: dict[str, tuple[int, ...] | None] = {}
    kernel_io: set[str] = set()
    for name, positions in items:
        if name not in KEEPABLE:
            raise InvalidValue(f"watch: cannot keep {[name]}; keep takes names from {tuple(KEEPABLE)}")
        if KEEPABLE[name] is None:
            kernel_io.add(name)
        else:
            memories[KEEPABLE[name]] = as_targets(positions, f"keep[{name!r}]", "watch")
    return memories, frozenset(kernel_io)


def normalize_reduce(reduce: Any, memories: Mapping[str, Any], where: str = "watch") -> dict[str, Any]:
    """`reduce` as memory -> the function applied to each chunk of kept states (`{"states": fn}`; a bare
    callable reduces "states"). Each name must be one that `keep` keeps (`memories`: `normalize_keep`'s)."""
    if reduce is None:
        return {}
    if callable(reduce):
        reduce = {"states": reduce}
    if not isinstance(reduce, Mapping):
        raise InvalidValue(
            f"{where}: expected reduce= a mapping of kept names to functions (as {{'states':"
            f" lambda s: s.flatten(2).norm(dim=-1)}}) or a callable, got {type(reduce).__name__}"
        )
    out: dict[str, Any] = {}
    for name, fn in reduce.items():
        if isinstance(name, str) and name in RENAMED_KEEP:
            renamed(f"{where}: reduce={{{name!r}: ...}}", f"reduce={{{RENAMED_KEEP[name]!r}: ...}}", stacklevel=4)
            name = RENAMED_KEEP[name]
        if KEEPABLE.get(name) is None:
            raise InvalidValue(
                f"{where}: reduce={{{name!r}: ...}}: only kept memories can be reduced, from"
                f" {tuple(k for k, memory in KEEPABLE.items() if memory is not None)}"
            )
        if KEEPABLE[name] not in memories:
            raise InvalidValue(
                f"{where}: reduce={{{name!r}: ...}}, but keep does not keep {name!r}: add it to keep"
                f" (keep=({name!r},), or a mapping of the positions to reduce)"
            )
        if isinstance(fn, Mapping):  # one function per layer ({layer: rh.probe(...)})
            if not fn or any(
                isinstance(layer, bool) or not isinstance(layer, int) or not callable(each)
                for layer, each in fn.items()
            ):
                raise InvalidValue(
                    f"{where}: reduce[{name!r}] as a mapping must map layers (ints) to functions of a"
                    f" [batch, chunk, *state] tensor, got {fn!r}"
                )
            fn = dict(fn)
        elif not callable(fn):
            raise InvalidValue(
                f"{where}: reduce[{name!r}] must be a function of a [batch, chunk, *state] tensor (or"
                f" a mapping of layers to such functions), got {type(fn).__name__} {fn!r}"
            )
        out[KEEPABLE[name]] = fn
    return out


def reduce_of_layer(reduce: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """A mixer's reductions, memory -> function: `reduce`'s function of each memory, or its function for `layer`
    where it gives one per layer (a layer it does not name keeps that memory unreduced)."""
    out = {}
    for memory, fn in reduce.items():
        fn = fn.get(layer) if isinstance(fn, dict) else fn
        if fn is not None:
            out[memory] = fn
    return out


def as_keep_device(device: Any, where: str = "watch") -> torch.device | None:
    """`keep_device` as a `torch.device` this machine has (None: kept where the model computes them)."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)) or isinstance(device, bool):
        raise InvalidValue(
            f"{where}: expected keep_device= a device (as 'cpu' or 'cuda:0') or None, got"
            f" {type(device).__name__} {device!r}"
        )
    try:
        device = torch.device(device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError) as error:
        raise InvalidValue(
            f"{where}: keep_device={str(device)!r} is not a device this machine has"
            f" ({str(error).splitlines()[0] if str(error) else type(error).__name__})"
        ) from None
    return device
