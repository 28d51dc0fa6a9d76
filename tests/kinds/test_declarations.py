"""A kind's declarations are what its kernels really receive and return.

`INPUTS`, `OUTPUTS`, `VALUES`, `STATE` and `CONV_STATE` name axes ("batch seq heads key_dim"); this file
runs every family through a prompt (batch 2) and two decode steps (batch 1) and binds those names to sizes,
once per kernel call: each declared value must exist, have as many axes as declared, and an axis name must
have one size across the values of a call (`seq` the call's token count, a number that size). A
declaration may end with a comment after two spaces; a tuple of tensors is declared "(...), each <axes>".
The kernel rows themselves are checked too: roles, sites and the arguments they name.
"""

import importlib
import inspect

import pytest
import torch
from _models import FAMILIES as BUILDERS
from _models import PAD, build, random_ids
from _upstream import transformers_kernel

import recurrent_hooks as rh
from recurrent_hooks.engine.declare.kernels import CONV_MEMORY, FORWARD, STATE_MEMORY, Role, Site
from recurrent_hooks.engine.declare.memory_parts import map_parts, parts_of
from recurrent_hooks.extend import KindAdapter

T = 7
KINDS = sorted({kind for row in rh.FAMILIES.values() for kind in row.mixers.values()}, key=lambda kind: kind.__name__)
FAMILIES = [name for name in rh.FAMILIES if name in BUILDERS]


class Axes:
    """Sizes bound to axis names over one kernel call; a second value with the same name must agree."""

    def __init__(self, where: str, seq: int):
        self.where, self.sizes = where, {"seq": seq}

    def bind(self, what: str, declared: str, value) -> None:
        axes = declared.split("  ")[0].strip()  # the axes, before a comment
        if isinstance(value, (tuple, list)):  # "(num, den, max), each batch channels"
            assert ", each " in axes, f"{self.where}: {what} is a {type(value).__name__}, declared ({declared})"
            for i, part in enumerate(value):
                self.bind(f"{what}[{i}]", axes.split(", each ")[1], part)
            return
        names = axes.split()
        assert isinstance(value, torch.Tensor), f"{self.where}: {what} is {type(value).__name__}, declared ({axes})"
        assert value.dim() == len(names), (
            f"{self.where}: {what} has shape {tuple(value.shape)}, declared ({axes}): {len(names)} axes"
        )
        for name, size in zip(names, value.shape):
            known = int(name) if name.isdigit() else self.sizes.setdefault(name, size)
            assert known == size, f"{self.where}: {what} has {name}={size}, another value of the call has {known}"


def _runs(family):
    """The calls of every mixer over a batch-2 prompt and a batch-1 generate (rwkv decodes right at batch 1 only)."""
    model = build(family)
    with rh.watch(model, keep=("inputs", "outputs", "states", "windows")) as prompt, torch.no_grad():
        model(random_ids(2, T))
    with rh.watch(model, keep=("inputs", "outputs", "states", "windows")) as decode, torch.no_grad():
        model.generate(random_ids(1, T), max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    return model, [*prompt.mixers, *decode.mixers]  # the model too: values() may read its module's weights


def _kernel_calls(mixer, call):
    """The kernel calls of `call` that INPUTS and OUTPUTS describe: those of the kind's first memory."""
    return call.kernel_calls if type(mixer).MEMORIES[0] == STATE_MEMORY else [call.conv]


def _per_head(declared: str) -> str:
    """A per-head kernel's state: the declared state without its heads axis (axis 1)."""
    return " ".join(a for i, a in enumerate(declared.split()) if i != 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_outputs_values_and_memories_are_what_the_kernels_see(family):
    model, mixers = _runs(family)
    found: dict[type, set] = {}  # per kind (a family may have mixers of two kinds: inkling2)
    for mixer in mixers:
        kind = type(mixer)
        found.setdefault(kind, set())
        prompt_inputs = set(_kernel_calls(mixer, mixer.calls[0])[0].inputs)
        for call in mixer.calls:
            parts = _kernel_calls(mixer, call)
            for head, part in enumerate(parts):
                where = f"{mixer} call {call.index} ({part.kernel}{f', head {head}' if len(parts) > 1 else ''})"
                axes = Axes(where, call.tokens)
                decode = kind.kernel(part.kernel).role is Role.DECODE
                for name, declared in kind.INPUTS.items():
                    value = part.inputs.get(name)
                    # one layout per name: a prompt's, or the decode kernel's where only it has the name
                    if value is not None and (not decode or name not in prompt_inputs):
                        axes.bind(f"input {name}", declared, value)
                        found[kind].add(name)
                if not decode:
                    for name, declared in kind.OUTPUTS.items():
                        if part.output.get(name) is not None:
                            axes.bind(f"output {name}", declared, part.output[name])
                            found[kind].add(name)
                if STATE_MEMORY in kind.MEMORIES and kind.MEMORIES[0] == STATE_MEMORY:
                    first = call.states if len(parts) == 1 else map_parts(lambda s: s[:, :, head], call.states)
                    for (name, state), (_, one) in zip(parts_of(call.states), parts_of(first)):
                        declared = kind.STATE if isinstance(kind.STATE, str) else kind.STATE[name]
                        declared = declared if len(parts) == 1 else _per_head(declared)
                        axes.bind(f"the state{f' part {name}' if name else ''}", declared, one[:, 0])
            if CONV_MEMORY in kind.MEMORIES:
                window = Axes(f"{mixer} call {call.index} (conv window)", call.tokens)
                window.bind("the conv window", kind.CONV_STATE, call.windows[:, 0])
            values = mixer.values(call.index)
            assert sorted(values) == sorted(kind.VALUES), (
                f"{mixer} values(): {sorted(values)}, declared {sorted(kind.VALUES)}"
            )
            value_axes = Axes(f"{mixer} values() of call {call.index}", call.tokens)
            for name, declared in kind.VALUES.items():
                value_axes.bind(f"value {name}", declared, values[name])
    for kind, names in found.items():
        of_kind = [mixer for mixer in mixers if type(mixer) is kind]
        missing = set(kind.INPUTS) | set(kind.OUTPUTS)
        missing -= names | {name for name in missing if _passed_as_none(of_kind, name)}
        assert not missing, f"{family} ({kind.__name__}): declared but never received or returned: {sorted(missing)}"


def _passed_as_none(mixers, name: str) -> bool:
    """A declared argument this family's mixer passes as None (e.g. Mamba's gate z when it applies it outside)."""
    return any(
        part.inputs.get(name, 0) is None or part.output.get(name, 0) is None
        for mixer in mixers
        for call in mixer.calls
        for part in _kernel_calls(mixer, call)
    )


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_kernel_rows_are_consistent(kind):
    """Each memory has a prompt and a decode kernel; every argument a row names is one its loop takes."""
    for memory in kind.MEMORIES:
        prompt, decode = kind.kernel_for(Role.PROMPT, memory), kind.kernel_for(Role.DECODE, memory)
        assert prompt.memory == decode.memory == memory
    for kernel in kind.KERNELS:
        parameters = inspect.signature(kernel.loop).parameters
        assert "on_token" in parameters and parameters["on_token"].kind is inspect.Parameter.KEYWORD_ONLY, (
            f"{kind.__name__}.{kernel.name}: its loop takes no keyword-only on_token"
        )
        # a kind that maps a call's arguments itself (its adapter's `kernel_arguments`: a whole forward recording
        # the state it read from the cache) may name its memory by the recorded name
        maps = type(kind.adapter).kernel_arguments is not KindAdapter.kernel_arguments
        named = list(kernel.state_arguments) if not maps else []
        if isinstance(kernel.seq, tuple):
            named.append(kernel.seq[0])
        if kernel.seq == FORWARD:
            assert "tokens" in parameters, f"{kernel.name} counts the forward's tokens but takes no tokens="
        if kernel.segments is not None:
            named += [*kernel.segments.per_token, kernel.segments.state_in, kernel.segments.final_flag]
        for name in named:
            assert name in parameters, f"{kind.__name__}.{kernel.name} names {name!r}, which its loop does not take"
        assert kind.kernel(kernel.name) is kernel


def test_a_kernel_row_is_checked_when_declared():
    with pytest.raises(TypeError, match="owner"):  # whose method it is, is the family's: its row's `owners`
        rh.Kernel(
            name="_rnn_scan",
            role="decode",
            loop=lambda: None,
            state_in=None,
            results=(),
            site=Site.CLASS,
            owner="RecurrentGemmaRglru",
        )
    with pytest.raises(ValueError, match="'sideways' is not a valid Role"):
        rh.Kernel(name="k", role="sideways", loop=lambda: None, state_in=None, results=())
    with pytest.raises(KeyError, match="declares no decode kernel for its nothing"):
        rh.GatedDeltaNet.kernel_for("decode", "nothing")


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _positional(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in _POSITIONAL]


def _upstream_kernels(family: str, row) -> list[tuple[rh.Kernel, object]]:
    """Each kernel of the family that transformers defines as a module global or a class attribute (`Site.CLASS`,
    on its row's owner), with transformers' function."""
    module = importlib.import_module(row.module_name)
    found = {}
    for mixer in row.classes:
        for kernel in mixer.kind.KERNELS:
            if kernel.site is Site.MODULE and hasattr(module, kernel.name):
                found[kernel.name] = (kernel, transformers_kernel(family, kernel.name))
            elif kernel.site is Site.CLASS and hasattr(owner := getattr(module, mixer.owner(kernel)), kernel.name):
                found[f"{owner.__name__}.{kernel.name}"] = (kernel, getattr(owner, kernel.name))
    return list(found.values())


def test_every_kernels_loop_takes_transformers_arguments_in_their_order():
    """A loop is called as the modeling code calls transformers' kernel, and the engine binds the call's arguments
    by the loop's signature: its positional parameters begin with those of the pure-torch kernel it stands in for
    (read from transformers, every module-level and class-attribute kernel of every family: the one declaration the
    loops are checked against; a class attribute's loop takes `self` as the method does)."""
    checked, wrong = 0, []
    for family, row in rh.FAMILIES.items():
        for kernel, function in _upstream_kernels(family, row):
            upstream, ours = _positional(function), _positional(kernel.loop)
            checked += 1
            if ours[: len(upstream)] != upstream:
                wrong.append(f"{family}: {kernel.name}: transformers {upstream}, the loop {ours}")
    assert checked > 60 and not wrong, wrong or f"only {checked} kernels checked"
