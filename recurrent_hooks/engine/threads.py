"""What the library tracks per thread: the mixer forwards running in it, and whether user hook code runs.

A kernel call belongs to the innermost mixer forward running in its own thread (each pushes its entry
in its class's `__call__` and pops it on the way out: `dispatch.make_owner`), and is handled if that forward is
watched; code inside a user's hook runs kernels untouched (`user_code`). `in_backward` tells autograd's recomputes (checkpointing) apart.
"""

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch


def in_backward() -> bool:
    """Whether this thread runs inside an autograd backward pass (where checkpointing recomputes forwards)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class _ThreadState(threading.local):
    """What the library tracks per thread: the mixer forwards running in it, and whether user hook code runs."""

    def __init__(self) -> None:
        self.running: list[Any] = []  # the `dispatch._Running` entries of the mixer forwards, innermost last
        self.in_hook = 0  # depth of user hook calls: forwards and kernels they run are not watched


THREAD = _ThreadState()


@contextlib.contextmanager
def user_code() -> Iterator[None]:
    """Run a user's hook: a model it runs (this one or another) is not watched, and its kernels run untouched."""
    THREAD.in_hook += 1
    try:
        yield
    finally:
        THREAD.in_hook -= 1


