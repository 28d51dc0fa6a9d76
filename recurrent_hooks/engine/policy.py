"""How busy calls run and what a handle's calls keep, as asked: the public `Paths`, the path names, the request.

Module contents:
- `Strategy`: the paths a busy call can run by (its docstring is the one list of them; other docstrings point
  there), with `LABELS`, the names a call records; `Choice`: one call's path, its stops and its tails;
- `Paths`: the policy a user passes (public: `recurrent_hooks.Paths`), its `RULES`; `DEFAULT`, the shipped one;
  `LOOP`, the token loop for every busy call; `Constants`, the cost model's constants a policy may bring;
- `Policy`, `Request`: what a watch (or a module's standalone hooks) asks of one handle's calls, a frozen value
  made with the handle and handed to its tracker (`tracker.CallTracker`).

The cost model that estimates each path is `costs`, the memory budget `budget`, the choice `choose` (all in `paths/`).
"""

import dataclasses
import enum
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .errors import InvalidValue


class Strategy(enum.Enum):
    """How a busy kernel call (one with hooks, writes or kept states) runs; `Paths` picks one, and each path has
    one runner (`runners.RUNNERS`). This is the one list of the paths; other docstrings point here.

    - `SEGMENTS` ("segments"): the kernel bound before the watch on the pieces between the stops (the tokens with
      hooks, writes or kept states), chaining the state through its `initial_state` argument; a kernel declared
      with `Kernel.stops` computes between its stops itself. With `Paths(tails=True)` a piece may end with a short
      token loop from its last chunk boundary to its stop (`Choice.tails`): a chunked kernel pads every call up
      to a multiple of its chunk, so a stop just past a boundary pays for a whole chunk;
    - `STATES` ("chunk-wise states"): the library's chunk-wise all-states kernel (`Segments.all_states`), when every
      state is kept: gradients off (with a hook at a few tokens, in segments around them), or on where the kind
      has an adjoint recurrence (`Segments.adjoint`, `paths.adjoint`: whole calls only);
    - `BLOCKS` ("blocks"): a hook at every token, gradients off, the states computed a block at a time by the
      all-states kernel (`blocks`), where `blocks.blocks_apply` allows it (a state of at most
      `Segments.blocks_below` elements);
    - `CHUNKS` ("chunk-wise reductions"): every busy plan reduces every state (`watch(reduce=...)`) and nothing
      else (no hook, no write, no state kept as it is), gradients off, not compiling: the all-states kernel runs
      once over the call and hands each of its chunks' states to the reductions (`Segments.on_chunk`), never
      holding every state;
    - `LOOP` ("token loop"): the library's token loop (`Kernel.loop`), the plans called after each token.

    A call nothing is asked of takes none of them: the kernel bound before the watch runs it ("bound kernel").
    Every path gives the token loop's results (within float rounding); only time and memory differ
    (docs/performance.md). A path's value is the word `Paths(force=...)` takes (the token loop's, "loop", is
    `Paths(rule="loop")`), its `label` (in parentheses above) the `KernelCall.path` a call records."""

    SEGMENTS = "segments"
    STATES = "states"
    BLOCKS = "blocks"
    CHUNKS = "chunks"
    LOOP = "loop"

    @property
    def label(self) -> str:
        """The path as a call records it (`KernelCall.path`; the names are listed in the class docstring)."""
        return LABELS[self.value]


LABELS = {
    "segments": "segments",
    "states": "chunk-wise states",
    "blocks": "blocks",
    "chunks": "chunk-wise reductions",
    "loop": "token loop",
}  # a path's value -> its label (`KernelCall.path`)


@dataclasses.dataclass(frozen=True)
class Choice:
    """How a busy call runs: its path, the tokens to stop at (sorted), whether every state is kept chunk-wise
    between them, and for SEGMENTS the token ranges `[start, end)` that the token loop runs instead of the
    bound kernel (each one from a piece's last chunk boundary to its end)."""

    path: Strategy
    stops: list[int]
    every_state: bool
    tails: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Constants:
    """Seconds per unit of each term of each path's cost (`kernel_terms`, `loop_terms`, `states_terms`)."""

    kernel: tuple[float, ...]
    loop: tuple[float, ...]
    states: tuple[float, ...]


_FORCED = tuple(strategy.value for strategy in Strategy if strategy is not Strategy.LOOP)  # `Paths(force=...)`
RULES = ("cost", "fixed", "loop")


@dataclasses.dataclass(frozen=True)
class Paths:
    """How a busy call (hooks, writes or kept states) picks its path: an argument of `watch` and
    `register_state_hook`.

        with rh.watch(model, keep=("states",), paths=rh.Paths(rule="loop")) as w:   # every busy call token by token
            model(ids)
        w.mixers[0].calls[0].kernel_calls[0].path      # "token loop": the path each kernel call took

    - `rule`: "cost" (the default: the cheapest path by a cost model of the call's shapes, calibrated per device
      type and dtype; a device without calibration takes the fixed rule), "fixed" (segments for at most
      max(8, T / 32) stops, the chunk-wise states when every state is kept, else the token loop), or "loop"
      (every busy call runs the library's token loop: the reference the other paths are checked against);
    - `force`: "segments", "states" (the chunk-wise all-states kernel), "blocks" or "chunks" (the all-states kernel's
      chunks handed to the reductions): taken wherever the call can take it (benchmarks, tests of a path), the rule
      deciding elsewhere;
    - `tails`: with the cost model, a piece of segments may end in a token loop from its last chunk boundary
      where the estimate says it pays (off: measured no gain above the noise, docs/performance.md);
    - `blocks_below`: the largest state (elements, batch included) a hook on every token runs in blocks at
      (None: each kernel's measured `Segments.blocks_below`);
    - `costs`: constants by kernel key ("delta rule", "ssd", "kimi delta") to use instead of the device's
      calibration (`Constants`, or a mapping with "kernel", "loop" and "states" lists as `costs.json` has them);
    - `memory_budget`: the bytes a busy call's path may hold on the call's device beyond what the kernel bound
      before the watch holds (`held_bytes`: the token loop's graph under autograd, the graphs of pieces padded to
      whole chunks, a block of states, the states of the chunk-wise states path before they go to `keep_device`); a
      path over it is not taken where one within it is available (the one holding least where none is). None (the
      default): a quarter of the device's memory (`DEFAULT_BUDGET_SHARE`; CUDA's `total_memory`, the host's
      physical memory for a CPU), `math.inf`: no limit. Forced paths (`force=`) and `rule="loop"` ignore it;
    - `loop_threads`: torch's intra-op threads while the paths with per-token steps (the token loop, and the
      chunk-wise reductions, which form large states token by token) run on a CPU, the loop's hooks included:
      1 (the default: each step's ops are too small to split; on a shared machine a thread another process holds
      stalls every one of them), a number, or None (torch's setting).

    Every path gives the token loop's results (within float rounding); only the time differs. Several handles
    busy in one call (a watch and a standalone hook on one module) take the path their policies agree on; if
    they differ, the token loop.
    """

    rule: str = "cost"
    force: "str | Strategy | None" = None
    tails: bool = False
    blocks_below: int | None = None
    costs: "Mapping[str, Any] | None" = None
    loop_threads: int | None = 1
    memory_budget: float | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise InvalidValue(f"Paths: expected rule= one of {', '.join(map(repr, RULES))}, got rule={self.rule!r}")
        force = self.force
        if isinstance(force, str) and force in _FORCED:
            object.__setattr__(self, "force", Strategy(force))
        elif force is not None and not (isinstance(force, Strategy) and force is not Strategy.LOOP):
            raise InvalidValue(
                f"Paths: expected force= None or one of {', '.join(map(repr, _FORCED))} (the token"
                f" loop is rule='loop'), got force={force!r}"
            )
        if self.rule == "loop" and self.force is not None:
            raise InvalidValue(
                f"Paths: rule='loop' runs every busy call through the token loop; it forces no"
                f" other path, got force={force!r}"
            )
        if not isinstance(self.tails, bool):
            raise InvalidValue(f"Paths: expected tails=True or tails=False, got tails={self.tails!r}")
        if self.blocks_below is not None and (
            isinstance(self.blocks_below, bool) or not isinstance(self.blocks_below, int) or self.blocks_below < 0
        ):
            raise InvalidValue(
                f"Paths: expected blocks_below= None or a number of state elements >= 0, got"
                f" blocks_below={self.blocks_below!r}"
            )
        if self.costs is not None:
            object.__setattr__(self, "costs", _as_constants(self.costs))
        threads = self.loop_threads
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 1
        ):
            raise InvalidValue(
                f"Paths: expected loop_threads= None or a number of threads >= 1, got loop_threads={threads!r}"
            )
        budget = self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not budget >= 0):
            raise InvalidValue(
                f"Paths: expected memory_budget= None (a quarter of the device's memory), a number of"
                f" bytes >= 0 or math.inf (no limit), got memory_budget={budget!r}"
            )
        # (a numpy integer or float is taken as the Python number it is)
        if threads is not None:
            object.__setattr__(self, "loop_threads", int(threads))
        if budget is not None:
            object.__setattr__(
                self, "memory_budget", int(budget) if isinstance(budget, numbers.Integral) else float(budget)
            )

    def __hash__(self) -> int:  # (costs is a dict)
        return hash(
            (
                self.rule,
                self.force,
                self.tails,
                self.blocks_below,
                None if self.costs is None else tuple(sorted(self.costs.items())),
                self.loop_threads,
                self.memory_budget,
            )
        )


def _as_constants(costs: Any) -> dict[str, Constants]:
    if not isinstance(costs, Mapping):
        raise InvalidValue(
            f"Paths: expected costs= a mapping of kernel keys (as 'delta rule', 'ssd') to Constants,"
            f" got {type(costs).__name__}"
        )
    out = {}
    for name, value in costs.items():
        if isinstance(value, Mapping) and {"kernel", "loop", "states"} <= set(value):
            value = Constants(*(tuple(float(c) for c in value[part]) for part in ("kernel", "loop", "states")))
        if not isinstance(value, Constants):
            raise InvalidValue(
                f"Paths: costs[{name!r}]: expected Constants or a mapping with 'kernel', 'loop' and"
                f" 'states' lists, got {value!r}"
            )
        out[name] = value
    return out


DEFAULT = Paths()
LOOP = Paths(rule="loop")


def checked_paths(paths: Any, where: str) -> Paths:
    """`paths` as given to `watch` or `register_state_hook` (None: `DEFAULT`), checked."""
    if paths is None:
        return DEFAULT
    if not isinstance(paths, Paths):
        raise InvalidValue(
            f"{where}: expected paths= a recurrent_hooks.Paths (as Paths(rule='loop')) or None, got"
            f" {type(paths).__name__} {paths!r}"
        )
    return paths


@dataclasses.dataclass(frozen=True)
class Policy:
    """How a handle's busy calls run and where what they keep goes, as its watch (or its standalone hooks) set it.

    - `paths`: how a busy call picks its path (`Paths`);
    - `keep_device`: where kept values go as they are kept (None: where the model computes them);
    - `reduce`: memory -> the function kept in place of its states, applied to chunks of them."""

    paths: Paths = DEFAULT
    keep_device: "torch.device | None" = None
    reduce: "dict[str, Callable[[Any], Any]]" = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Request:
    """What a watch (or a module's standalone hooks) asks of one handle's calls: made with the handle and handed to
    its tracker (`tracker.CallTracker`), which reads this value and never the handle.

    - `keep`: memory -> the token positions kept of every call (None: every token), as `arguments.normalize_keep`
      gives it;
    - `kernel_io`: which of the kernels' "inputs" and "outputs" are kept;
    - `policy`: how busy calls run and where kept values go (`Policy`);
    - `history`: the handle records its calls (False: a standalone hook's handle, which records none);
    - `restart_on_prompt`: a call that starts from no cached memory is call 0 again (standalone hooks);
    - `calls_kept`: how many of its last calls' records it keeps (`watch(history=...)`; None: every call's)."""

    keep: "Mapping[str, tuple[int, ...] | None]" = dataclasses.field(default_factory=dict)
    kernel_io: frozenset[str] = frozenset()
    policy: Policy = Policy()
    history: bool = True
    restart_on_prompt: bool = False
    calls_kept: int | None = None
