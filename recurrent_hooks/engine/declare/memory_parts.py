"""A memory of several named parts, handled as one value.

Most kinds carry their state as one tensor. Some carry several tensors of different shapes that only make
sense together (the mLSTM's matrix memory C, normalizer n and stabilizer m). Such a kind declares a
`typing.NamedTuple` of tensors as its `STATE_TYPE` and `STATE` as a mapping part name -> axes; its token
loop hands `on_token` one of those tuples, and everything the engine does to a state (keep it, read it
through a leaf for gradients, check a replacement, write rows of it, stack it over tokens or heads) it
does part by part through the functions here. A one-tensor state goes through them unchanged.

Module contents:
- `is_parts(value)`: a NamedTuple state, as opposed to one tensor.
- `map_parts(fn, *states)`: `fn` on each part (on the tensor itself for a one-tensor state), rebuilt in the
  state's type.
- `parts_of(state)`: `(name, tensor)` pairs (`("", tensor)` for a one-tensor state).
- `rebuild(like, tensors)`: a state of `like`'s type from its parts' tensors.
- `stack_parts(states, dim)`: `torch.stack` part by part.
- `not_a_tensor(value, declared, like)`: what is wrong with a state whose parts are not all tensors, or None.
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

State = Any  # a Tensor, or a NamedTuple of Tensors


def is_parts(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def map_parts(fn: Callable[..., Tensor], *states: State) -> State:
    first = states[0]
    if not is_parts(first):
        return fn(*states)
    return type(first)(*(fn(*parts) for parts in zip(*states)))


def parts_of(state: State) -> list[tuple[str, Tensor]]:
    if not is_parts(state):
        return [("", state)]
    return list(zip(type(state)._fields, state))


def rebuild(like: State, tensors: Sequence[Tensor]) -> State:
    """A state of `like`'s type from its parts' tensors, in order."""
    return type(like)(*tensors) if is_parts(like) else tensors[0]


def stack_parts(states: Sequence[State], dim: int) -> State:
    return map_parts(lambda *parts: torch.stack(parts, dim=dim), *states)


def axes_of(declared: "str | dict[str, str]", part: str) -> str:
    """The declared axes of one part (`declared` is a kind's `STATE`: one string, or part name -> axes)."""
    return declared if isinstance(declared, str) else declared.get(part, "?")


def describe(declared: "str | dict[str, str]") -> str:
    if isinstance(declared, str):
        return declared
    return "; ".join(f"{name}: {axes}" for name, axes in declared.items())


def not_a_tensor(value: State, declared: "str | dict[str, str]", like: State | None = None) -> str | None:
    """What is wrong with a state of several parts some of which are not tensors (None: every part is one):
    the first such part, what it is, and the tensor expected (its shape when `like`, the state it replaces,
    is given; else its declared axes)."""
    if not is_parts(value):
        return None
    expected = dict(parts_of(like)) if like is not None and is_parts(like) else {}
    for name, part in parts_of(value):
        if not isinstance(part, Tensor):
            want = (
                f"a Tensor of shape {tuple(expected[name].shape)} ({expected[name].dtype})"
                if name in expected
                else "a Tensor"
            )
            return f"part {name!r} is a {type(part).__name__}, expected {want} (axes: {axes_of(declared, name)})"
    return None
