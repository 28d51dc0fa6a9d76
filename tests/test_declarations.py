"""A kind's declarations are what its kernels really receive and return.

`INPUTS`, `OUTPUTS`, `VALUES` and `STATE` name axes ("batch seq heads key_dim"); this file runs every family
of the kinds whose kernels are module globals through a prompt and a decode step and binds those names to
sizes, once per kernel call: each declared value must exist, have as many axes as declared, and an axis
name must have one size across the values of a call (and `seq` the call's token count). The kernel rows
themselves are checked too: roles, sites and the arguments they name.
"""

import inspect

import pytest
import torch

import recurrent_hooks as rh
from recurrent_hooks._kernels import FORWARD, Role, Site
from _models import FAMILIES as BUILDERS
from _models import PAD, build, random_ids

T = 7
KINDS = sorted({row.kind for row in rh.FAMILIES.values()}, key=lambda kind: kind.__name__)
MODULE_GLOBAL_FAMILIES = [name for name, row in rh.FAMILIES.items() if name in BUILDERS
                          and all(k.site is Site.MODULE for k in row.kind.KERNELS) and "state" in row.kind.MEMORIES]


class Axes:
    """Sizes bound to axis names over one kernel call; a second value with the same name must agree."""

    def __init__(self, where: str, seq: int):
        self.where, self.sizes = where, {"seq": seq}

    def bind(self, what: str, axes: str, value) -> None:
        names = axes.split()
        assert isinstance(value, torch.Tensor), f"{self.where}: {what} is {type(value).__name__}, declared ({axes})"
        assert value.dim() == len(names), \
            f"{self.where}: {what} has shape {tuple(value.shape)}, declared ({axes}): {len(names)} axes"
        for name, size in zip(names, value.shape):
            known = self.sizes.setdefault(name, size)
            assert known == size, f"{self.where}: {what} has {name}={size}, another value of the call has {known}"


@pytest.mark.parametrize("family", MODULE_GLOBAL_FAMILIES)
def test_inputs_outputs_values_and_state_are_what_the_kernels_see(family):
    model = build(family)
    with rh.watch(model, keep=("inputs", "outputs", "states")) as w, torch.no_grad():
        model.generate(random_ids(2, T), max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    kind = type(w.mixers[0])
    for mixer in w.mixers:
        found = set()
        for call in mixer.calls:
            for head, part in enumerate(call.parts):
                where = f"{mixer} call {call.index} ({part.kernel}{f', head {head}' if len(call.parts) > 1 else ''})"
                axes = Axes(where, call.tokens)
                decode = kind.kernel(part.kernel).role is Role.DECODE
                for name, declared in kind.INPUTS.items():
                    value = part.inputs.get(name)
                    # one value per name: a prompt's layout, or the decode kernel's where only it has the name
                    if isinstance(value, torch.Tensor) and (not decode or name not in prompt_inputs(mixer)):
                        axes.bind(f"input {name}", declared, value)
                        found.add(name)
                if not decode:
                    for name, declared in kind.OUTPUTS.items():
                        if part.output.get(name) is not None:
                            axes.bind(f"output {name}", declared, part.output[name])
                            found.add(name)
                    state = call.states[:, 0] if len(call.parts) == 1 else call.states[:, 0, :, head]
                    per_head = kind.STATE.split() if len(call.parts) == 1 else [
                        a for i, a in enumerate(kind.STATE.split()) if i != 1]
                    axes.bind("the state", " ".join(per_head), state)
            values = mixer.values(call.index)
            assert sorted(values) == sorted(kind.VALUES), f"{mixer} values(): {sorted(values)}, declared {sorted(kind.VALUES)}"
            value_axes = Axes(f"{mixer} values() of call {call.index}", call.tokens)
            for name, declared in kind.VALUES.items():
                value_axes.bind(f"value {name}", declared, values[name])
        missing = set(kind.INPUTS) | set(kind.OUTPUTS)
        missing -= found | {name for name in missing if _optional(mixer, name)}
        assert not missing, f"{mixer}: declared but never received or returned: {sorted(missing)}"


def prompt_inputs(mixer) -> set[str]:
    return set(mixer.calls[0].parts[0].inputs)


def _optional(mixer, name: str) -> bool:
    """A declared argument this family's mixer passes as None (e.g. Mamba's gate z when it applies it outside)."""
    return any(part.inputs.get(name, 0) is None or part.output.get(name, 0) is None
               for call in mixer.calls for part in call.parts)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_kernel_rows_are_consistent(kind):
    """Each memory has a prompt and a decode kernel; every argument a row names is one its loop takes."""
    for memory in kind.MEMORIES:
        prompt, decode = kind.kernel_for(Role.PROMPT, memory), kind.kernel_for(Role.DECODE, memory)
        assert prompt.memory == decode.memory == memory
    for kernel in kind.KERNELS:
        parameters = inspect.signature(kernel.loop).parameters
        assert "on_token" in parameters and parameters["on_token"].kind is inspect.Parameter.KEYWORD_ONLY, \
            f"{kind.__name__}.{kernel.name}: its loop takes no keyword-only on_token"
        named = list(kernel.state_arguments)  # one argument, or one per part of the state
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
    with pytest.raises(TypeError, match="needs an owner"):
        rh.Kernel(name="_rnn_scan", role="decode", loop=lambda: None, state_in=None, results=(), site=Site.CLASS)
    with pytest.raises(ValueError, match="'sideways' is not a valid Role"):
        rh.Kernel(name="k", role="sideways", loop=lambda: None, state_in=None, results=())
    with pytest.raises(KeyError, match="declares no decode kernel for its nothing"):
        rh.GatedDeltaNet.kernel_for("decode", "nothing")
