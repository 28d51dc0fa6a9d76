"""What a model's mixers offer (`support`, `MixerSupport`, `available_of`, `limits_of`, `LEGEND`, `versions`), and
process-wide rebinding of a family's kernels (`route_kernels`).

Module contents:
- `support(model)`: per mixer, what works, what works with a caveat and what is refused (`MixerSupport`);
- `available_of(kind)`, `limits_of(mixer_class)`: what a kind's mixers give, and every limit of a family's mixer
  class (its kind's `LIMITS`, its family's `limits`, beam search and left padding where the kind says so);
- `caveats_of(limits)`, `refused_of(limits)`: the limits split by their type (`declare.limits`: `Caveat`, `Refused`);
- `describe(head, works, limits, notes)`: the three sections as `support` prints them; `LEGEND`: what their words
  mean (`legend()` prints it under the table; docs/api.md has it); `versions()`: the releases `support --json` names;
- `route_kernels(family, "torch" | "default")`: process-wide rebinding of a family's kernels to the library's token
  loops, or back to what transformers bound at import.
"""

import dataclasses
import importlib.metadata
import textwrap
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import nn

from .binding.rebinding import bound_original, import_default, rebind_process_wide
from .binding.registry import MixerClass, layer_in_path, mixer_of, resolve_family, unsupported_of
from .binding.upstream import TESTED_RANGE, hub_module, installed_version, is_tested, torch_kernel
from .declare.kernels import KEEPABLE, KERNEL_IO, Role, Site
from .declare.limits import Caveat, Refused, error_names, is_refused
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
            raise InvalidValue(
                f"route_kernels: expected to= one of {', '.join(map(repr, words))} for {row.name}"
                f" ({mixer.kind.__name__}), got {to!r}"
            )
        per_instance = [kernel.name for kernel in mixer.kind.KERNELS if kernel.site is Site.INSTANCE]
        if per_instance:
            raise Unavailable(
                f"route_kernels: {row.name}'s kernels ({', '.join(per_instance)}) are captured by"
                " each module when the model is built, so there is nothing process-wide to reroute;"
                " use watch"
            )
        targets = {mixer.target(kernel): kernel for kernel in mixer.kind.KERNELS}
        if words[to] == "torch":
            replacements.update({target: kernel.loop for target, kernel in targets.items()})
        else:
            replacements.update({target: import_default(*target) for target in targets})
    rebind_process_wide(replacements)


# What the words of `support`'s output mean, in the order it prints them: term -> meaning. `python -m recurrent_hooks
# support` prints it under the table; scripts/doc_tables.py writes it into docs/api.md ("`rh.support(model)`").
LEGEND = {
    "family: MixerClass -> Kind": "a family (a transformers model type) and one of its mixer classes (the"
    " transformers module a watch attaches to), handled as the kind (the library's RecurrentMixer subclass that"
    " declares its kernels and memories, in recurrent_hooks.extend)",
    "path (MixerClass, layer N, family -> Kind)": "the same for one mixer module of a model: its path in the"
    " model, its class, its decoder layer, its family and kind",
    "works": "what a watch gives for this mixer (a caveat below may qualify it), among:",
    "states": "keep=('states',): the recurrent state after every token (mixer.states, mixer.state_after)",
    "windows": "keep=('windows',): the short convolution's window after every token (mixer.windows,"
    " mixer.window_after)",
    "inputs, outputs": "keep=('inputs', 'outputs'): each kernel call's named arguments and results (call.inputs,"
    " call.output)",
    "values": "mixer.values(): the per-token values the kind declares (its VALUES), from the kept inputs and outputs",
    "writes": "mixer.set_state_after, set_window_after, set_memory_after: replace a memory after a token, and the"
    " model continues from it",
    "hooks": "mixer.register_state_hook (or rh.register_state_hook without a watch): a function that sees, and may"
    " replace, the memory at each token",
    "works with a caveat": "it runs, but not as one might assume: the caveat says how (most are transformers' own"
    " behaviour, the same watched or not)",
    "refused": "it raises the errors named after 'raises': rh.* are the library's (rh.Unavailable: it cannot be"
    " had), the others transformers' or torch's, raised by their own code (the entry says whether a watch changes"
    " that)",
    "everything": "(a mixer class the library does not handle) a watch leaves it unwatched, and refuses a model with"
    " no supported mixer",
    "transformers": "what transformers does, said without a release, holds for every tested release (the range in"
    " the first line); what holds for one release names it",
}


def versions() -> dict[str, Any]:
    """The releases `support --json` names: this library (None when run from a source tree that is not installed),
    the installed transformers and torch, the transformers range the suite has passed on, and whether the installed
    transformers is in it."""
    try:
        library = importlib.metadata.version("recurrent_hooks")
    except importlib.metadata.PackageNotFoundError:
        library = None
    return {
        "recurrent_hooks": library,
        "transformers": installed_version(),
        "torch": torch.__version__,
        "tested_range": TESTED_RANGE,
        "transformers_tested": is_tested(),
    }


def caveats_of(limits: Mapping[str, str]) -> dict[str, str]:
    """The limits that work with a caveat (a `Caveat`, or a plain `str`: a kind written before the types)."""
    return {what: why for what, why in limits.items() if not is_refused(why)}


def refused_of(limits: Mapping[str, str]) -> dict[str, Refused]:
    """The limits that raise (`Refused`)."""
    return {what: why for what, why in limits.items() if is_refused(why)}


_WIDTH = 116  # the printed sections' width, wrapped under their indent


def _wrapped(text: str, indent: str) -> list[str]:
    return textwrap.wrap(
        text,
        _WIDTH,
        initial_indent=indent,
        subsequent_indent=indent + "    ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def describe(head: str, works: Sequence[str], limits: Mapping[str, str], notes: Mapping[str, str] | None = None) -> str:
    """A mixer as `support` prints it: the head line, then what works, what works with a caveat, what is refused
    (with what it raises) and, for a model's mixer, how its calls run (`LEGEND` says what the words mean)."""
    lines = [head]
    if works:
        lines += _wrapped(f"works: {', '.join(works)}", "  ")
    for title, section in (("works with a caveat", caveats_of(limits)), ("refused", refused_of(limits))):
        if section:
            lines.append(f"  {title}:")
            for what, why in section.items():
                raises = f" (raises {' or '.join(error_names(why))})" if is_refused(why) else ""
                lines += _wrapped(f"{what}{raises}: {why}", "    ")
    if notes:
        lines.append("  how calls run:")
        for what, note in notes.items():
            lines += _wrapped(f"{what}: {note}", "    ")
    return "\n".join(lines)


def legend() -> str:
    """`LEGEND` as `support` prints it under its table: the words of "works" (the terms between it and "works with a
    caveat") indented under it."""
    lines, terms = ["legend:"], list(LEGEND)
    words = terms[terms.index("works") + 1 : terms.index("works with a caveat")]
    for term, meaning in LEGEND.items():
        lines += _wrapped(f"{term}: {meaning}", "    " if term in words else "  ")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class MixerSupport:
    """What the library gives for one mixer of a model: what works, what works with a caveat, what is refused.

    `available` is what works (`works` is the same); `unavailable` is every limit, each a `Caveat` or a `Refused`
    (a `str`, its words), which `caveats` and `refused` split by type; `notes` say how its calls run.
    """

    path: str  # the module's name in the model, e.g. "model.layers.0.linear_attn"
    layer: int | None
    mixer_class: str
    family: str | None  # None: not a supported family
    kind: str | None  # the RecurrentMixer subclass
    available: tuple[str, ...]  # what works: keep names, values, writes, hooks (`LEGEND`)
    unavailable: dict[str, str]  # every limit, what -> why: a Caveat (works, with it) or a Refused (raises)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def works(self) -> tuple[str, ...]:
        """What works (`available`)."""
        return self.available

    @property
    def caveats(self) -> dict[str, str]:
        """What works with a caveat: what -> the caveat."""
        return caveats_of(self.unavailable)

    @property
    def refused(self) -> dict[str, Refused]:
        """What is refused: what -> why, each with `.errors`, the exceptions raised."""
        return refused_of(self.unavailable)

    @property
    def head(self) -> str:
        """The first line `support` prints for it: path (MixerClass, layer N, family -> Kind)."""
        where = f"{self.path} ({self.mixer_class}, layer {self.layer}"
        return where + (f", {self.family} -> {self.kind})" if self.family else ", not supported)")

    def __str__(self) -> str:
        return describe(self.head, self.available, self.unavailable, self.notes)


def available_of(kind: type[RecurrentMixer]) -> tuple[str, ...]:
    """What a kind's mixers offer: the keep names of its memories and of the kernel inputs and outputs, then values
    (if it declares any), writes and hooks."""
    return (
        *(name for name, memory in KEEPABLE.items() if memory in kind.MEMORIES),
        *KERNEL_IO,
        *(("values",) if kind.VALUES else ()),
        "writes",
        "hooks",
    )


_NOT_REORDERED = (
    "beam search's cache reorder does not move this kind's memory: each row continues its own row, not"
    " its parent beam's, and call.reorder stays None"
)


def limits_of(mixer: MixerClass) -> dict[str, str]:
    """Every limit of a family's mixer class, what -> a `Caveat` or a `Refused`: its kind's `LIMITS`, its family's
    `limits`, and, where the kind declares them without its own words, beam search (`REORDERED_BY_CACHE`) and left
    padding (`LEFT_PADDING`) in general ones."""
    kind = mixer.kind
    limits = {**kind.LIMITS, **mixer.family.limits}
    if not kind.REORDERED_BY_CACHE:
        limits.setdefault("beam search", Caveat(_NOT_REORDERED))
    if kind.LEFT_PADDING != "masked":
        limits.setdefault("left padding", Caveat(PADDING[kind.LEFT_PADDING]))
    return limits


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


def support(model: nn.Module) -> list[MixerSupport]:
    """Per recurrent mixer of `model`: what works, what works with a caveat, and what is refused (with the error).

        for row in recurrent_hooks.support(model):
            print(row)          # the three sections, and how its calls run
        row.refused             # what -> why, each with .errors

    Mixers of recurrent families the library does not handle are listed too, with the reason (refused: everything).
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
                reason = Refused(Unavailable, unsupported.reason)
                rows.append(MixerSupport(path, layer, name, None, None, (), {"everything": reason}))
            continue
        kind = family.kind
        bound = {k.name: bound_original(*family.target(k, module)) for k in kind.KERNELS}
        available = available_of(kind)
        prompt = kind.kernel_for(Role.PROMPT)
        segments = prompt.segments
        notes = {
            "idle calls run": ", ".join(_described(fn) for fn in bound.values()),
            "a few tokens of a prompt": (
                f"the library's chunk-wise {prompt.name} in segments between them"
                if segments.kernel is not None
                else f"{prompt.name} in segments between them, or the token loop, by cost"
            )
            if segments is not None
            else f"the library's {prompt.name}, with its fast computation between them"
            if prompt.stops
            else "the token loop (the prompt kernel does not run in segments)",
            "every state of a prompt": (
                "chunk-wise, with gradients too (their backward by the adjoint recurrence)"
                if segments.adjoint is not None
                else "chunk-wise without gradients, the token loop with them"
            )
            if segments is not None and segments.all_states is not None
            else "the token loop",
            "a reduction of every state": "the chunk-wise kernel's chunks, reduced as it forms them, without"
            " gradients; the token loop's with them"
            if segments is not None and segments.on_chunk
            else "the token loop's states, a chunk at a time",
            "a hook on every token": "chunk-wise blocks for a small state without gradients, else the token loop"
            if segments is not None and segments.blocks_below
            else "the token loop",
        }
        if segments is not None or prompt.stops:
            notes["path choice"] = _path_rule(module, segments)
        rows.append(MixerSupport(path, layer, name, family.name, kind.__name__, available, limits_of(family), notes))
    return rows
