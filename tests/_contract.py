"""The per-kind adapters of the contract suite (tests/test_contract.py), as data.

The contract is one set of promises every (family, mixer class) keeps: a write after token t changes only the
tokens after t and what the model carries on, a replacing hook is a write, the whole memory written from another
run makes a layer continue as in that run, the gradient reaches a kept memory, gradient checkpointing repeats a
call rather than counting a new one. What differs between kinds is said here, one `Adapter` a kind:

- how to make a write value (`perturb`: a different valid memory of the same shape) and scale one (`scale`);
- where the model carries a memory after a forward (`carried`: the Cache, a module attribute, the `state=` list);
- what a call started from (`window_in`; the state's is read from the kernel's declared `state_in`);
- tolerances and thresholds (`later`: how much the later logits must move; `early`: how close the earlier ones
  stay) and quirks (`batch`, `grad_use_cache`, `per_token_windows`, `whole_memory_model`, ...).

A `Case` is one (family, mixer class): its kind, its adapter and which mixers of a watch are its.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

import recurrent_hooks as rh
from _models import _minimax, build
from recurrent_hooks.engine.parts import map_parts, parts_of
from recurrent_hooks.extend import MatrixLSTM, MLSTMState, WkvState

T = 13  # not a multiple of anything
READ = {"state": "state_after", "window": "window_after"}
WRITE = {"state": "set_state_after", "window": "set_window_after"}
STACK = {"state": "states", "window": "windows"}  # memory -> its keep name and the mixer's per-token stack


# -- write values ---------------------------------------------------------------------------------------------------


def perturbation(value, seed=1):
    """value + noise of the value's scale (a tensor, or every part of a state of several parts, one generator)."""
    gen = torch.Generator().manual_seed(seed)
    return map_parts(lambda part: part + torch.randn(part.shape, generator=gen, dtype=torch.float32).to(part.dtype)
                     * (part.abs().max() + 1), value)


def perturbed_wkv(state, seed=1):
    """A different valid WKV state: num and den scaled per channel (den stays positive), max shifted (the token
    shift, a tensor: `perturbation`)."""
    if not isinstance(state, WkvState):
        return perturbation(state, seed)
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(state.num.shape, generator=gen) * 3 + 0.2
    return WkvState(state.num * scale, state.den * scale, state.max + torch.randn(state.max.shape, generator=gen))


def halve(value):
    return map_parts(lambda part: part * 0.5, value)


def halve_mlstm(state):
    """C and n halved, the stabiliser m (a log scale) kept."""
    return MLSTMState(state.C * 0.5, state.n * 0.5, state.m)


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


def lightning_state(out, mixer, memory):
    cached = out.cache.get_linear_cache(mixer.layer)
    return {"the cache": cached, "the forward's final_state": mixer.calls[-1].output["final_state"]}


def mlstm_state(out, mixer, memory):
    return {"the cache": MLSTMState(*out.cache.rnn_state[mixer.layer])}


def wkv_memory(out, mixer, memory):
    """RWKV has no Cache: the model's `state` list ([1] the shifts, [2:5] num, den, max), layers on axis 2."""
    if memory == "state":
        return {"the model's state": WkvState(*(s[:, :, mixer.layer] for s in out.state[2:5]))}
    return {"the model's state": out.state[1][:, :, mixer.layer]}


def rg_lru_memory(out, mixer, memory):
    """RecurrentGemma keeps its memory on the block, not in the cache (`rg_lru.recurrent_states`, `conv1d_state`)."""
    module = mixer.module
    return {"the module": module.rg_lru.recurrent_states if memory == "state" else module.conv1d_state}


# -- what a call started from -------------------------------------------------------------------------------------------


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


def wkv_shift_in(mixer, call):
    return mixer.calls[call].conv.inputs["state"][1][:, :, mixer.layer]


# -- the adapters ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Adapter:
    """How the contract reads one kind. Defaults: the kinds whose memory lives in transformers' Cache."""

    perturb: Callable = perturbation
    scale: Callable = halve  # a replacing hook's change
    carried: Callable | None = cache_state  # (out, mixer, memory) -> {where: the value the model carries on}
    window_in: Callable | None = conv_input  # the window a call started from; None: read it off the shift
    state_in: Callable = state_in  # the state a call started from
    batch: int = 2  # of every generate (rwkv decodes right with batch 1 only, a transformers bug)
    early: dict = dataclasses.field(default_factory=lambda: dict(rtol=1e-5, atol=1e-5))  # logits at tokens <= t
    decode_early: dict | None = None  # logits of calls <= k after a decode write (default: `early`)
    later: float = 1e-6  # how much a write must move the logits after it
    # whether a write must move the logits of every later token ("every") or of some ("some": a window forgets)
    state_reach: str = "every"
    window_reach: str = "some"
    window_tokens: tuple = (5,)
    grad_use_cache: bool | None = None  # the use_cache of a differentiated forward (None: the default)
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


_GDN_LIKE = Adapter()
_LIGHTNING = Adapter(carried=lightning_state, window_in=None, recomputes_once=True,
                     whole_memory_model=lambda: _minimax(linear_first=True),
                     whole_memory_tol=dict(rtol=1e-4, atol=1e-6), whole_memory_early=dict(rtol=0, atol=0))
_MLSTM = Adapter(carried=mlstm_state, window_in=None, scale=halve_mlstm, later=1e-3, grad_use_cache=False,
                 grad_parts=("C",), recomputes_once=True, whole_memory_tol=dict(rtol=1e-5, atol=1e-6),
                 finite_difference=(), split_tol=dict(rtol=1e-5, atol=1e-5, relative=True))
_WKV = Adapter(perturb=perturbed_wkv, carried=wkv_memory, window_in=wkv_shift_in, batch=1, grad_use_cache=False,
               window_tokens=(5, T - 1), split_tol=dict(rtol=1e-5, atol=1e-6),
               recomputes_once=True, finite_difference=("state", "window"), whole_memory_tol=dict(rtol=1e-5, atol=1e-6))
_RG_LRU = Adapter(carried=rg_lru_memory, window_in=None, window_reach="every", recomputes_once=True,
                  finite_difference=("state", "window"),
                  whole_memory_tol=dict(rtol=1e-5, atol=1e-6))
_SHORT_CONV = Adapter(early=dict(rtol=1e-6, atol=1e-7), decode_early=dict(rtol=0, atol=0), window_tokens=(0, 5, T - 1),
                      grad_tol=dict(rtol=1e-5, atol=1e-8), finite_difference=(),
                      whole_memory_tol=dict(rtol=0, atol=0))
# The dynamic convolutions of the keys and values feed full attention: a window write at a decode step moves the
# tiny random model's later logits (about 0.3) by about 1e-6 (inkling2_loop: 9.2e-7 and 1.0e-6 at calls 3 and 4,
# on transformers 5.24 and 5.25), while the calls before it stay equal bit for bit (decode_early).
_DYNAMIC_CONV = dataclasses.replace(_SHORT_CONV, later=1e-7)
# zaya's CCA: one forward updates both memories, the q/k window and the one-token value delay (the state)
_ZAYA = Adapter(state_in=lambda mixer, call: mixer.calls[call].conv.inputs["delay"])
ADAPTERS = {
    rh.CompressedConvolutionalAttention: _ZAYA,
    rh.GatedDeltaNet: _GDN_LIKE, rh.KimiDeltaAttention: _GDN_LIKE, rh.SelectiveScan: _GDN_LIKE,
    rh.PerHeadSelectiveScan: _GDN_LIKE, rh.Mamba2StateSpace: _GDN_LIKE,
    rh.LightningAttention: _LIGHTNING, MatrixLSTM: _MLSTM, rh.WeightedKeyValue: _WKV,
    rh.RealGatedLinearRecurrence: _RG_LRU,
    rh.ShortConvolution: _SHORT_CONV, rh.LoopedShortConvolution: _SHORT_CONV,
    rh.DynamicShortConvolution: _DYNAMIC_CONV,
}


def adapter_of(kind) -> Adapter:
    for cls in kind.__mro__:
        if cls in ADAPTERS:
            return ADAPTERS[cls]
    raise KeyError(f"no contract adapter for the kind {kind.__name__}: add a row to tests/_contract.py ADAPTERS")


@dataclasses.dataclass(frozen=True)
class Case:
    """One (family, mixer class) of the registry."""

    family: str
    mixer_class: str
    kind: type

    @property
    def adapter(self) -> Adapter:
        return adapter_of(self.kind)

    @property
    def id(self) -> str:
        return self.family if self.mixer_class == rh.FAMILIES[self.family].mixer_class else \
            f"{self.family}-{self.mixer_class}"

    def mixers(self, w):
        """The watch's mixers of this mixer class, in module order (a looped module: one a pass)."""
        return [m for m in w.mixers if type(m.module).__name__ == self.mixer_class]

    def first(self, w):
        return self.mixers(w)[0]


def cases(covered=lambda case: True) -> list[Case]:
    """Every (family, mixer class) of the registry, in its order, where `covered(case)`. A kind without an adapter is
    not left out: its cases fail where they ask for `case.adapter` (and tests/test_contract.py says which kind)."""
    rows = [(name, cls.mixer_class, cls.kind) for name, row in rh.FAMILIES.items() for cls in row.classes]
    return [case for case in (Case(*row) for row in rows) if covered(case)]


def norm(value) -> float:
    return sum(float(part.detach().norm()) ** 2 for _, part in parts_of(value)) ** 0.5


def whole_memory_model(case: Case):
    builder = case.adapter.whole_memory_model
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
