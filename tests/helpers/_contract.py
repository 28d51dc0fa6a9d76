"""How the contract suite (tests/kinds/test_contract.py) reads each kind, as data: the `ContractReading`, its
defaults, the cases.

The contract is one set of promises every (family, mixer class) keeps: a write after token t changes only the
tokens after t and what the model carries on, a replacing hook is a write, the whole memory written from another
run makes a layer continue as in that run, the gradient reaches a kept memory, gradient checkpointing repeats a
call rather than counting a new one. What differs between kinds is a `ContractReading` (this module's defaults fit a
kind whose memory is in transformers' Cache), which a kind's own test file declares where it needs other values
(`CONTRACT = {Kind: ContractReading(...)}` in tests/kinds/test_<the kind's module>.py, found by `reading_of`):

- how to make a write value (`perturb`: a different valid memory of the same shape) and scale one (`scale`);
- where the model carries a memory after a forward (`carried`: the Cache, a module attribute, the `state=` list);
- what a call started from (`window_in`; the state's is read from the kernel's declared `state_in`);
- tolerances and thresholds (`later`: how much the later logits must move; `early`: how close the earlier ones
  stay) and quirks (`batch`, `grad_use_cache`, `window_tokens`, `whole_memory_model`, ...).

A `Case` is one (family, mixer class): its kind, its reading and which mixers of a watch are its. Adding a kind
touches no line here.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import sys
from typing import Callable

import torch
from _models import build

import recurrent_hooks as rh
from recurrent_hooks.engine.declare.memory_parts import map_parts, parts_of

T = 13  # not a multiple of anything
KIND_TESTS = pathlib.Path(__file__).resolve().parents[1] / "kinds"  # tests/kinds/test_<kind module>.py
READ = {"state": "state_after", "window": "window_after"}
WRITE = {"state": "set_state_after", "window": "set_window_after"}
STACK = {"state": "states", "window": "windows"}  # memory -> its keep name and the mixer's per-token stack


# -- write values ---------------------------------------------------------------------------------------------------


def perturbation(value, seed=1):
    """value + noise of the value's scale (a tensor, or every part of a state of several parts, one generator)."""
    gen = torch.Generator().manual_seed(seed)
    return map_parts(
        lambda part: (
            part
            + torch.randn(part.shape, generator=gen, dtype=torch.float32).to(part.device, part.dtype)
            * (part.abs().max() + 1)
        ),
        value,
    )


def halve(value):
    return map_parts(lambda part: part * 0.5, value)


# -- where a memory is carried after a forward ----------------------------------------------------------------------


def _cache_of(out):
    return out.past_key_values


def cache_state(out, mixer, memory):
    """The Cache's recurrent state / conv window of the mixer's layer (and state index, where a layer has several
    windows: inkling; a looped layer's pass: its cache layer)."""
    layer, index = mixer.cache_index or (mixer.layer, getattr(mixer.module, "conv_idx", 0))
    cache = _cache_of(out)
    if memory == "state":
        return {"the cache": cache.get_recurrent_state(layer)}
    return {"the cache": cache.get_conv_state(layer, state_idx=index) if index else cache.get_conv_state(layer)}


# -- what a call started from --------------------------------------------------------------------------------------


def state_in(mixer, call):
    """The state call `call` started from, as its kernel received it (heads stacked for per-head mixers; a state of
    several parts rebuilt as the kind's state type)."""
    record = mixer.calls[call]
    name = type(mixer).kernel(record.kernel).state_in
    kind = type(mixer)

    def one(inputs):
        value = tuple(inputs[n] for n in name) if isinstance(name, tuple) else inputs[name]
        return kind.STATE_TYPE(*value) if isinstance(value, (tuple, list)) else value

    states = [one(part.inputs) for part in record.kernel_calls]
    return states[0] if len(states) == 1 else torch.stack(states, dim=1)


def conv_input(mixer, call):
    return mixer.calls[call].conv.inputs["conv_state"]


# -- the readings ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ContractReading:
    """How the contract reads one kind. Defaults: the kinds whose memory lives in transformers' Cache."""

    perturb: Callable = perturbation
    scale: Callable = halve  # a replacing hook's change
    carried: Callable | None = cache_state  # (out, mixer, memory) -> {where: the value the model carries on}
    window_in: Callable | None = conv_input  # the window a call started from; None: read it off the shift
    state_in: Callable = state_in  # the state a call started from
    batch: int = 2  # of every generate and one-token forward (rwkv decodes right with batch 1 only: transformers')
    loop_atol: float = 1e-5  # how far the token loops may round from transformers' kernels (0: bit for bit)
    input_grad: tuple = (1e-4, 1e-7)  # (rtol, atol) of the input gradient through the token loops vs plain backward
    # the lengths at which the logits of a grad-mode forward that keeps every memory are checked in the parity test
    # (every family's are at T, in the input-gradient test): every length where grad mode takes a path of its own
    grad_parity: tuple = ()
    early: dict = dataclasses.field(default_factory=lambda: dict(rtol=1e-5, atol=1e-5))  # logits at tokens <= t
    decode_early: dict | None = None  # logits of calls <= k after a decode write (default: `early`)
    later: float = 1e-6  # how much a write must move the logits after it
    # whether a write must move the logits of every later token ("every") or of some ("some": a window forgets)
    state_reach: str = "every"
    window_reach: str = "some"
    window_tokens: tuple = (5,)
    # the use_cache of a differentiated forward (None: the default; False: transformers' own backward through a cached
    # forward fails, see the kind's LIMITS)
    grad_use_cache: bool | None = None
    grad_tol: dict = dataclasses.field(default_factory=lambda: dict(rtol=1e-4, atol=1e-7))
    finite_difference: tuple = ("state",)  # the memories whose gradient predicts a small change along it
    grad_parts: tuple | None = None  # the parts of a state whose checkpointed gradient is compared (None: all)
    recomputes_once: bool = False  # a checkpointed forward recomputes a hooked call exactly once
    # split invariance: the memories of prompt + decode steps against one long prompt; `relative`: atol is a
    # fraction of the memory's largest entry (an mLSTM state's rounding is relative to its scale)
    split_tol: dict = dataclasses.field(default_factory=lambda: dict(rtol=1e-4, atol=1e-6))
    whole_memory_model: Callable | None = None  # the model of the whole-memory identity (None: the family's)
    whole_memory_tol: dict = dataclasses.field(default_factory=lambda: dict(rtol=1e-4, atol=1e-6))
    whole_memory_early: dict | None = None  # the layer's outputs up to t after the write (default: whole_memory_tol)


def reading_of(kind) -> ContractReading:
    """The reading a kind's test file declares (`CONTRACT`, a mapping kind -> `ContractReading`, in
    tests/kinds/test_<the kind's module>.py), for the kind or the nearest base it extends; else the default,
    `ContractReading()`: a kind whose memory lives in transformers' Cache and keeps the defaults' tolerances needs
    none."""
    for cls in kind.__mro__:
        if cls is rh.RecurrentMixer:
            break
        module = f"test_{cls.__module__.rsplit('.', 1)[-1]}"
        if (KIND_TESTS / f"{module}.py").is_file():
            if str(KIND_TESTS) not in sys.path:  # pytest puts it there when it collects a kind's tests; a run of
                sys.path.append(str(KIND_TESTS))  # other folders' tests only does not
            contract = getattr(importlib.import_module(module), "CONTRACT", {})
            if cls in contract:
                return contract[cls]
    return ContractReading()


@dataclasses.dataclass(frozen=True)
class Case:
    """One (family, mixer class) of the registry."""

    family: str
    mixer_class: str
    kind: type

    @property
    def reading(self) -> ContractReading:
        return reading_of(self.kind)

    @property
    def id(self) -> str:
        return (
            self.family
            if self.mixer_class == rh.FAMILIES[self.family].mixer_class
            else f"{self.family}-{self.mixer_class}"
        )

    def mixers(self, w):
        """The watch's mixers of this mixer class, in module order (a looped module: one a pass)."""
        return [m for m in w.mixers if type(m.module).__name__ == self.mixer_class]

    def first(self, w):
        return self.mixers(w)[0]


def cases(covered=lambda case: True) -> list[Case]:
    """Every (family, mixer class) of the registry, in its order, where `covered(case)`: no kind is left out (one
    without a reading of its own is read with the defaults, and fails where they do not fit it)."""
    rows = [(name, cls.mixer_class, cls.kind) for name, row in rh.FAMILIES.items() for cls in row.classes]
    return [case for case in (Case(*row) for row in rows) if covered(case)]


# the family that stands for its kind in the tests that run one family per kind (gated DeltaNet: qwen3_5, the
# library's first target, not the registry's first row)
STANDS_FOR_ITS_KIND = ("qwen3_5",)


def one_family_per_kind(holds: Callable[[type], bool] = lambda kind: True) -> list[str]:
    """One family for each kind of the registry (a family's first mixer class's) where `holds(kind)`, in the
    registry's order: `STANDS_FOR_ITS_KIND`'s, or the first family of the kind."""
    chosen: dict[type, str] = {}
    for name in [*STANDS_FOR_ITS_KIND, *rh.FAMILIES]:
        kind = rh.FAMILIES[name].kind
        if holds(kind):
            chosen.setdefault(kind, name)
    order = list(rh.FAMILIES)
    return sorted(chosen.values(), key=order.index)


def in_segments(kind) -> bool:
    """The kind's prompt kernel runs in segments (chunk-wise maths): gated DeltaNet, Kimi, Mamba-1, Mamba-2."""
    return kind.kernel_for("prompt").segments is not None


def norm(value) -> float:
    return sum(float(part.detach().norm()) ** 2 for _, part in parts_of(value)) ** 0.5


def whole_memory_model(case: Case):
    builder = case.reading.whole_memory_model
    if builder is None:
        return build(case.family)
    torch.manual_seed(0)
    return builder().eval()


def family_fixtures(families, builder=build):
    """The `family` fixture (one param a family) and a `model` fixture (a fresh `builder(family)` a test), for a kind's
    test file: `family, model = family_fixtures(FAMILIES)`."""
    import pytest

    @pytest.fixture(params=families)
    def family(request):
        return request.param

    @pytest.fixture
    def model(family):
        return builder(family)

    return family, model
