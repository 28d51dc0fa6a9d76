"""What the library tracks per thread: the mixer forwards running in it, and whether user hook code runs.

A kernel call belongs to the innermost mixer forward running in its own thread (each pushes its entry
in its class's `__call__` and pops it on the way out: `forwards.make_owner`), and is handled if that forward is
watched; code inside a user's hook runs kernels untouched (`user_code`). `in_backward` tells autograd's recomputes
(checkpointing) apart.
"""

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ..tracing import compiling


def in_backward() -> bool:
    """Whether this thread runs inside an autograd backward pass (where checkpointing recomputes forwards)."""
    if compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class _ThreadState(threading.local):
    """What the library tracks per thread: the mixer forwards running in it, and whether user hook code runs."""

    def __init__(self) -> None:
        self.running: list[Any] = []  # the `forwards.Running` entries of the mixer forwards, innermost last
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


@functools.cache
def _threads_per_caller() -> bool:
    """Whether torch's intra-op threads are OpenMP's: `set_num_threads` then sets the calling thread's count only
    (OpenMP's nthreads is per thread), so that another thread's forward keeps its own."""
    return "OpenMP" in torch.__config__.parallel_info()


@contextlib.contextmanager
def loop_threads(count: int | None, device: torch.device) -> Iterator[None]:
    """Run a path with per-token steps on `device` at `count` intra-op threads (`Paths.loop_threads`; None:
    torch's setting).

    Each step's ops are one token's: split over several threads, each op's fork and join costs about what it
    saves, and a thread another process holds stalls every op (measured: docs/performance.md, "Performance, third
    round"). The hooks the
    loop calls run at that setting too. Changed only on a CPU, with OpenMP's threads (per calling thread), outside a
    compiled graph; the caller's setting is back on the way out."""
    if count is None or device.type != "cpu" or compiling() or not _threads_per_caller():
        yield
        return
    outer = torch.get_num_threads()
    if outer == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(outer)
