"""What a model's mixers offer (`support`, `MixerSupport`, `available_of`), and process-wide rebinding of a family's
kernels (`route_kernels`).

Module contents:
- `support(model)`: per mixer, what the library can give and why not;
- `route_kernels(family, "torch" | "default")`: process-wide rebinding of a family's kernels to the library's token
  loops, or back to what transformers bound at import.
"""

import dataclasses
from types import ModuleType
from typing import Any

from torch import nn

from .binding.rebinding import bound_original, import_default, rebind_process_wide
from .binding.registry import layer_in_path, mixer_of, resolve_family, unsupported_of
from .binding.upstream import hub_module, torch_kernel
from .declare.kernels import KEEPABLE, KERNEL_IO, Role, Site
from .errors import InvalidValue, Unavailable
from .handle.kind import PADDING
from .handle.mixer import RecurrentMixer
from .paths import costs


def route_kernels(family: "str | ModuleType | nn.Module", to: str) -> None:
    """Bind a family's kernels process-wide: `"torch"` to the library's token loops, `"default"` back.

        recurrent_hooks.route_kernels("qwen3_5", "torch")    # every prompt now runs token by token
        recurrent_hooks.route_kernels(model, "default")      # what transformers bound at import

    Each kind may accept its own words too (`RecurrentMixer.ROUTES`): for gated DeltaNet and Kimi delta
    attention, "recurrent" means "torch" and "chunked" means "default".

    `family` is a family name, its transformers modeling module, or a model with mixers of one family.
    Unlike `watch`, nothing is undone automatically; refused while a watch or hook is active on the family.
    """
    if not isinstance(to, str):
        raise InvalidValue(f"route_kernels: expected to='torch' or to='default', got {to!r}")
    row = resolve_family(family)
    replacements = {}
    for mixer in row.classes:  # every mixer class of the family (inkling2: its static and dynamic convolutions)
        words = mixer.kind.ROUTES
        if to not in words:
            raise InvalidValue(f"route_kernels: expected to= one of {', '.join(map(repr, words))} for {row.name}"
                               f" ({mixer.kind.__name__}), got {to!r}")
        per_instance = [kernel.name for kernel in mixer.kind.KERNELS if kernel.site is Site.INSTANCE]
        if per_instance:
            raise Unavailable(f"route_kernels: {row.name}'s kernels ({', '.join(per_instance)}) are captured by"
                              " each module when the model is built, so there is nothing process-wide to reroute;"
                              " use watch")
        targets = {mixer.target(kernel): kernel for kernel in mixer.kind.KERNELS}
        if words[to] == "torch":
            replacements.update({target: kernel.loop for target, kernel in targets.items()})
        else:
            replacements.update({target: import_default(*target) for target in targets})
    rebind_process_wide(replacements)


@dataclasses.dataclass(frozen=True)
class MixerSupport:
    """What the library can give for one mixer of a model, and why not where it cannot."""

    path: str  # the module's name in the model, e.g. "model.layers.0.linear_attn"
    layer: int | None
    mixer_class: str
    family: str | None  # None: not a supported family
    kind: str | None  # the RecurrentMixer subclass
    available: tuple[str, ...]
    unavailable: dict[str, str]  # what cannot be had -> why
    notes: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        head = f"{self.path} ({self.mixer_class}, layer {self.layer}"
        head += f", {self.family} -> {self.kind})" if self.family else ")"
        lines = [head]
        if self.available:
            lines.append(f"  available: {', '.join(self.available)}")
        lines += [f"  unavailable: {what}: {why}" for what, why in self.unavailable.items()]
        lines += [f"  {what}: {note}" for what, note in self.notes.items()]
        return "\n".join(lines)


def available_of(kind: type[RecurrentMixer]) -> tuple[str, ...]:
    """What a kind's mixers offer: the keep names of its memories and of the kernel inputs and outputs, then values
    (if it declares any), writes and hooks."""
    return (*(name for name, memory in KEEPABLE.items() if memory in kind.MEMORIES), *KERNEL_IO,
            *(("values",) if kind.VALUES else ()), "writes", "hooks")


def _path_rule(module: nn.Module, segments: Any) -> str:
    """Which rule picks a busy prompt call's path by default, on the device and dtype of the module's weights."""
    fixed = "the fixed rule (segments for at most max(8, T / 32) stops, else the token loop)"
    if segments is None or segments.shape is None:
        return f"{fixed}: this kernel has no cost model"
    weight = next(module.parameters(), None)
    if weight is None:
        return fixed
    key = costs.calibration_key(weight.device, weight.dtype)
    if costs.costs_for(weight.device, weight.dtype) is None:
        return f"{fixed}: no calibration for {key} (benchmarks/paths.py --calibrate --write makes one)"
    return f"the cost model, calibrated for {key}"


def _described(bound: Any) -> str:
    """What an idle call of a kernel name runs: the pure-torch function's dotted name, and the wrapper it goes
    through if it is a kernels hub module."""
    function = torch_kernel(bound) if hub_module(bound) or not isinstance(bound, nn.Module) else type(bound)
    name = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"
    return f"{name} (through a kernels hub module)" if hub_module(bound) else name


_NOT_REORDERED = ("beam search's cache reorder does not move this kind's memory: each row continues its own row, not"
                  " its parent beam's, and call.reorder stays None")


def support(model: nn.Module) -> list[MixerSupport]:
    """Per recurrent mixer of `model`: what can be read and written, and why not where it cannot.

        for row in recurrent_hooks.support(model):
            print(row)

    Mixers of recurrent families the library does not handle are listed too, with the reason.
    """
    if not isinstance(model, nn.Module):
        raise InvalidValue(f"support: expected a torch.nn.Module (a transformers model), got {type(model).__name__}")
    rows = []
    for path, module in model.named_modules():
        name = type(module).__name__
        family = mixer_of(module)
        layer = getattr(module, "layer_idx" if family is None else family.kind.LAYER_ATTRIBUTE, layer_in_path(path))
        if family is None:
            if (unsupported := unsupported_of(module)) is not None:
                rows.append(MixerSupport(path, layer, name, None, None, (), {"everything": unsupported.reason}))
            continue
        kind = family.kind
        bound = {k.name: bound_original(*family.target(k, module)) for k in kind.KERNELS}
        available = available_of(kind)
        prompt = kind.kernel_for(Role.PROMPT)
        segments = prompt.segments
        notes = {
            "idle calls run": ", ".join(_described(fn) for fn in bound.values()),
            "a few tokens of a prompt": (f"the library's chunk-wise {prompt.name} in segments between them"
                                         if segments.kernel is not None else
                                         f"{prompt.name} in segments between them, or the token loop, by cost")
            if segments is not None
            else f"the library's {prompt.name}, with its fast computation between them" if prompt.stops
            else "the token loop (the prompt kernel does not run in segments: see the limits)",
            "every state of a prompt": ("chunk-wise, with gradients too (their backward by the adjoint recurrence)"
                                        if segments.adjoint is not None else
                                        "chunk-wise without gradients, the token loop with them")
            if segments is not None and segments.all_states is not None else "the token loop",
            "a reduction of every state": "the chunk-wise kernel's chunks, reduced as it forms them, without"
            " gradients; the token loop's with them" if segments is not None and segments.on_chunk
            else "the token loop's states, a chunk at a time",
            "a hook on every token": "chunk-wise blocks for a small state without gradients, else the token loop"
            if segments is not None and segments.blocks_below else "the token loop",
        }
        if segments is not None or prompt.stops:
            notes["path choice"] = _path_rule(module, segments)
        unavailable = {**kind.LIMITS, **family.family.limits}
        if not kind.REORDERED_BY_CACHE:  # the kind's own words if it has them (why the rows stay)
            unavailable.setdefault("beam search", _NOT_REORDERED)
        if kind.LEFT_PADDING != "masked":
            unavailable.setdefault("left padding", PADDING[kind.LEFT_PADDING])
        rows.append(MixerSupport(path, layer, name, family.name, kind.__name__, available, unavailable, notes))
    return rows
