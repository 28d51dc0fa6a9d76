"""What the library tracks per thread: the mixer forwards running in it, and whether user hook code runs.

A kernel call belongs to the innermost mixer forward running in its own thread (each pushes its entry
in its class's `__call__` and pops it on the way out: `dispatch.make_owner`), and is handled if that forward is
watched; code inside a user's hook runs kernels untouched (`user_code`). `in_backward` tells autograd's recomputes (checkpointing) apart.
"""

import contextlib
import functools
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


@functools.cache
def _threads_per_caller() -> bool:
    """Whether torch's intra-op threads are OpenMP's: `set_num_threads` then sets the calling thread's count only
    (OpenMP's nthreads is per thread), so that another thread's forward keeps its own."""
    return "OpenMP" in torch.__config__.parallel_info()


ONE_THREAD_BELOW = 65_536  # state elements below which a token loop's ops run faster on one thread (measured, CPU, 2
# threads against 1: gated DeltaNet's loop 1.34x slower on 2 at 32,768 elements, 0.79x at 65,536; Mamba-2's 1.52x at
# 24,576, 1.11x at 49,152, 0.98x at 98,304)


def threads_for(setting: int | str | None, state_elements: int | None) -> int | None:
    """The intra-op threads a token loop runs at (`Paths.loop_threads`; None: torch's setting)."""
    if setting != "auto":
        return setting  # type: ignore[return-value]
    return 1 if state_elements is not None and state_elements < ONE_THREAD_BELOW else None


@contextlib.contextmanager
def loop_threads(count: int | None, device: torch.device) -> Iterator[None]:
    """Run a token loop on `device` at `count` intra-op threads (`threads_for`; None: torch's setting).

    A loop's ops are one token's: on a small state each op's fork and join over several threads costs more than its
    share of the work, and a thread another process holds stalls every op (docs/performance.md, "Performance,
    third round"). The hooks the loop calls run at that setting too (a hook's ops are one token's as well). Changed
    only on a CPU, with OpenMP's threads (per calling thread), outside a compiled graph."""
    if count is None or device.type != "cpu" or torch.compiler.is_compiling() or not _threads_per_caller():
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


