"""The public entry points: `watch`, `register_state_hook`, `route_kernels` and `support`.

Module contents:
- `Watch` / `watch(model, keep=...)`: a context manager that attaches a `RecurrentMixer` to every
  supported mixer of a model and rebinds its family's kernels for the duration of the block.
- `register_state_hook(mixer_module, fn)`: a state hook without a `with` block, live until its handle
  is removed (the forward-hook workflow).
- `route_kernels(family, "torch" | "default")`: process-wide rebinding of a family's kernels to the
  library's token loops, or back to what transformers bound at import.
- `support(model)`: per mixer, what the library can give and why not.
"""

import contextlib
import dataclasses
import functools
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .errors import InvalidValue, RecurrentHooksError, RecurrentHooksWarning, Unavailable, renamed
from .arguments import as_index, as_keep_device, normalize_keep, normalize_reduce, reduce_of_layer, renamed_keep
from .calls import Memory
from .kind import PADDING
from .dispatch import attach, make_dispatcher
from .running import make_owner
from . import strategies
from .strategies import Paths
from .kernels import KEEPABLE, KERNEL_IO, Kernel, Role, Site
from .mixer import RecurrentMixer, StateHook, detach, hook_removed
from .tracker import Policy
from .patching import (MISSING, Transient, UndoStack, acquire_kernels, bound_original, import_default,
                       rebind_process_wide)
from .upstream import hub_module, is_kernel_like, kernel_missing, torch_kernel, warn_if_untested
from .families import FAMILIES, MixerClass, mixer_of, resolve_family, unsupported_of


def _mixer_modules(model: nn.Module) -> list[tuple[str, nn.Module, MixerClass]]:
    return [(path, m, row) for path, m in model.named_modules() if (row := mixer_of(m)) is not None]


def _layer_in_path(path: str) -> int | None:
    """The decoder layer a module's path names: its last integer part ("model.layers.3.temporal_block" -> 3)."""
    numbers = [int(part) for part in path.split(".") if part.isdigit()]
    return numbers[-1] if numbers else None


def _attach_with_kernels(mixer: RecurrentMixer, family: MixerClass, stack: contextlib.ExitStack) -> None:
    """Attach `mixer` and acquire its family's kernels, registering both releases on `stack`.

    The `__call__` of its mixer class (and of the other mixer classes of its modeling module, which may call
    the same kernels) is acquired too: each forward of an instance, watched or not, then tells the kernels whose
    forward is running (`running.make_owner`)."""
    strategies.load_costs()  # the cost model's calibrations, read now rather than while torch.compile traces
    for device in {parameter.device for parameter in mixer.module.parameters()}:
        strategies.note_device(device)  # (and the memory its default budget is a share of)
    warn_if_untested()
    module = family.module()
    classes = {type(mixer.module), *(cls for row in FAMILIES.values() if row.module_name == family.module_name
                                     for each in row.classes
                                     if isinstance(cls := getattr(module, each.mixer_class, None), type))}
    stack.callback(acquire_kernels([(cls, "__call__") for cls in sorted(classes, key=lambda c: c.__qualname__)],
                                   make_owner))
    stack.callback(attach(mixer))
    targets = [_kernel_target(family, kernel, mixer.module) for kernel in family.kind.KERNELS]
    targets += [(module, name) for name in family.kind.FUSED if is_kernel_like(getattr(module, name, None))]
    stack.callback(acquire_kernels(targets, make_dispatcher(family.kind)))
    for kernel in family.kind.KERNELS:
        if kernel.site is Site.CLASS:
            _acquire_bound_copies(mixer.module, kernel, family.target(kernel)[0], family.kind, stack)


def _kernel_target(family: MixerClass, kernel: Kernel, mixer_module: nn.Module) -> tuple[Any, str]:
    """Where `kernel` is bound for `mixer_module`, checked to be there and to hold a kernel (a transformers release
    that moved or renamed it is named in the error, with the tested range, instead of failing deep in a forward)."""
    owner = family.owner(kernel)
    where = (family.module_name if kernel.site is Site.MODULE else f"{family.module_name}.{owner}"
             if kernel.site is Site.CLASS else f"the mixer module {type(mixer_module).__name__}{'.' if owner else ''}"
             f"{owner}")
    try:
        target = family.target(kernel, mixer_module)
    except (AttributeError, ImportError):
        raise kernel_missing(family.name, kernel.name, where, None) from None
    found = bound_original(*target)
    if not is_kernel_like(found):
        raise kernel_missing(family.name, kernel.name, where, None if found is MISSING else found)
    return target


def _acquire_bound_copies(mixer_module: nn.Module, kernel: Kernel, owner: type, kind: type[RecurrentMixer],
                          stack: contextlib.ExitStack) -> None:
    """Rebind, for the watch, the attributes of the mixer module that hold a class-attribute kernel already
    bound to it: a wrapper that replaced the module's `forward` keeps the original bound method on the
    instance (accelerate's offloading hooks store it as `_old_forward`) and calls it, so rebinding the class
    attribute alone would not reach its calls. Each becomes the kernel's dispatcher, bound to the module."""
    original = import_default(owner, kernel.name)

    def holds_kernel(value: Any) -> bool:  # the original bound to the module, or a watch's dispatcher for it
        func = getattr(value, "__func__", None)
        return getattr(value, "__self__", None) is mixer_module and func is not None and (
            func is original or getattr(func, "__wrapped__", None) is original and _is_dispatcher(func))

    names = [name for name, value in vars(mixer_module).items() if holds_kernel(value)]
    if not names:
        return
    dispatcher = make_dispatcher(kind)

    def bound(name: str, value: Any) -> Any:
        return types.MethodType(dispatcher(kernel.name, value.__func__), value.__self__)

    stack.callback(acquire_kernels([(mixer_module, name) for name in names], bound))


def _is_dispatcher(fn: Any) -> bool:
    return getattr(fn, "__recurrent_hooks__", False)


def _no_mixer_message(model: nn.Module) -> str:
    unsupported = sorted({f"{row.mixer_class} ({row.reason})" for m in model.modules()
                          if (row := unsupported_of(m)) is not None})
    message = (f"{type(model).__name__} contains no recurrent mixer of a supported family"
               f" (supported: {', '.join(FAMILIES)})")
    if unsupported:
        message += f"; it has {', '.join(unsupported)}"
    return message


def _reorder_recorder(mixers: list[RecurrentMixer], patches: UndoStack) -> Callable[[object], None]:
    """For the mixers of one watch: a function that, the first time a cache is seen, wraps its
    `reorder_cache` (beam search) to tell the mixers how its rows moved; `patches` undoes the wrapping."""
    caches: weakref.WeakSet = weakref.WeakSet()

    def saw_cache(cache: object) -> None:
        if cache in caches or not callable(getattr(cache, "reorder_cache", None)):
            return
        caches.add(cache)
        reorder = cache.reorder_cache

        @functools.wraps(reorder)
        def reorder_cache(beam_idx: Tensor, *args: object, **kwargs: object) -> object:
            for mixer in mixers:
                mixer.tracker.reordered(beam_idx)
            return reorder(beam_idx, *args, **kwargs)

        patches.set_instance_attribute(cache, "reorder_cache", Transient(reorder_cache, reorder))

    return saw_cache


def _forget_cache_recorder(mixers: list[RecurrentMixer]) -> None:
    for mixer in mixers:
        mixer.tracker.saw_cache = None


class Watch:
    """A `with` block in which every supported recurrent mixer of `model` can be read and written per token.

        with recurrent_hooks.watch(model, keep=("states",)) as w:
            model(input_ids)
        w.mixers[0].states          # [batch, seq, heads, key_dim, value_dim]: the state after every token
        w.mixer(2).calls[0].inputs  # the mixer of decoder layer 2: its first call's kernel arguments
        w.mixer("model.layers.2.linear_attn")   # the same mixer, by its module path

    On entry the family's kernel names are rebound (module globals of its transformers modeling module),
    and so is its mixer classes' `__call__` (each forward marks itself as running: what kernel calls belong
    to), and each mixer module gets forward hooks; on exit, also on an exception and when nested, exactly
    the previous objects are bound again and the module hooks are removed. Hooks and
    writes registered on `w.mixers[i]` live until the block ends; what the mixers kept stays readable.
    Like every PyTorch hook, the block's effects are global: the model is changed for anyone who calls
    it inside the block.

    `keep` names what to keep of every call, and a watch keeps nothing else: "states" (the state after
    every token), "windows" (the convolution window after every token), "inputs" and "outputs" (the
    kernel's arguments and results, by reference; `values()` needs both). A mapping keeps some tokens
    only (`{"states": [4, -1]}`). Each call's metadata (`call.kernel`, `call.tokens`, `call.index`) is
    always there: each `Call` is the record of one forward, and what it holds beyond that is what was kept.
    `record=True` is the former spelling of keeping "inputs" and "outputs" (it warns).

    At real sizes: `keep_device="cpu"` moves each kept state there as it is kept (a model on a GPU keeps its
    states in host memory; with gradients on, kept states are refused on another device, reductions keep their
    graph), and `reduce={"states": fn}` keeps `fn(states)` instead of the states, `fn` taking a chunk of kept
    tokens' states `[batch, chunk, *state]` and returning `[batch, chunk, ...]` (a per-token norm:
    `lambda s: s.flatten(2).norm(dim=-1)`): `mix.states` is then the stacked reductions, `state_after(t)`
    the reduction at t, and at most one chunk of states is held at a time. The chunk may be a view of the kernel's
    buffer, which its next chunk overwrites: `fn` reads it and must not keep it, or a view of it (a result that is
    the chunk, or a view of it, is copied).

    The block sees the forwards of the thread that entered it; a model run inside a hook, or a model
    that is not watched, runs its kernels untouched. Writes aimed at calls that never ran (a generation
    that stopped early) give one `RecurrentHooksWarning` on exit; hooks aimed at them are not an error.
    Kept positions outside every call a mixer saw (`{"states": [100]}` on 12 tokens) give another.

    What it costs: a call nothing is asked of runs the kernel bound before the watch. A busy call takes
    the path a cost model of its shapes finds cheapest: that kernel in segments between the tokens asked
    for, every state computed chunk-wise (without gradients), a hook on every token fed by chunk-wise
    blocks (small states, without gradients), or the token loop (docs/performance.md). `paths` (a `Paths`) sets
    how: `Paths(rule="loop")` runs every busy call through the token loop, `Paths(rule="fixed")` takes the rule
    without a cost model, `Paths(force="segments")` takes that path wherever a call can; each kernel call's
    `path` says which it took.
    """

    def __init__(self, model: nn.Module, keep: Sequence[str] | Mapping[str, Iterable[int] | None] = (),
                 record: bool = False, paths: Paths | None = None, keep_device: "str | torch.device | None" = None,
                 reduce: "Mapping[str, Callable[[Any], Any]] | Callable[[Any], Any] | None" = None,
                 layers: Iterable[int] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidValue(f"watch: expected a torch.nn.Module (a transformers model), got {type(model).__name__}")
        self.paths = _checked_paths(paths, "watch")
        if not isinstance(record, bool):
            raise InvalidValue(f"watch: expected record=True or record=False, got record={record!r}")
        if record:
            renamed("watch(record=True)", "watch(keep=('inputs', 'outputs'))", stacklevel=4)
        if not isinstance(keep, (str, Sequence, Mapping)):
            raise InvalidValue(f"watch: expected keep as a tuple of names or a mapping of names to tokens,"
                               f" got {type(keep).__name__}")
        keep = renamed_keep(keep)  # a former name warns once, here
        memories, _ = normalize_keep(keep)  # checked here, before anything is acquired
        self.keep_device = as_keep_device(keep_device)
        self.reduce = normalize_reduce(reduce, memories)
        self.layers = _checked_layers(layers)
        keep = (keep,) if isinstance(keep, str) else dict(keep) if isinstance(keep, Mapping) else tuple(keep)
        self.model = model
        self.keep = keep
        self.record = record
        # what each mixer keeps: `keep`, plus the kernels' inputs and outputs for record=True
        self._kept = ({**dict.fromkeys(KERNEL_IO), **keep} if isinstance(keep, dict)
                      else (*KERNEL_IO, *keep)) if record else keep
        self.mixers: list[RecurrentMixer] = []
        self._by_path: dict[str, RecurrentMixer] = {}  # module path -> its (first) mixer, in module order
        self._stack: contextlib.ExitStack | None = None

    def __repr__(self) -> str:
        state = "active" if self._stack is not None else "inactive"
        mixers = ", ".join(f"layer {m.layer}: {len(m.calls)} calls" for m in self.mixers)
        return f"Watch({type(self.model).__name__}, {state}, keep={self.keep}, mixers=[{mixers}])"

    def _kept_by(self, layer: int | None) -> Any:
        """What the mixer of decoder layer `layer` keeps: `keep`, or nothing if `layers` leaves it out."""
        return self._kept if self.layers is None or layer in self.layers else ()

    def _check_layers(self, found: list) -> None:
        if self.layers is None:
            return
        recurrent = sorted({layer for layer in (_layer_in_path(path) for path, _, _ in found) if layer is not None})
        unknown = sorted(self.layers - set(recurrent))
        if unknown:
            raise Unavailable(f"watch: layers={sorted(self.layers)}, but layers {unknown} have no recurrent mixer;"
                              f" recurrent layers: {recurrent}")

    def mixer(self, layer: int | str) -> RecurrentMixer:
        """The mixer of decoder layer `layer` (the transformers `layer_idx`; the first one, in module order,
        where a layer has several, as inkling's four convolution windows), or of the module at a path as
        `model.named_modules()` names it.

            w.mixer(0)                                # by layer
            w.mixer("model.layers.0.linear_attn")     # by module path
        """
        if isinstance(layer, str):
            if layer not in self._by_path:
                raise Unavailable(f"Watch.mixer: no recurrent mixer at module path {layer!r}; the mixer paths"
                                  f" are {list(self._by_path)}" + ("" if self._by_path else " (enter the watch first)"))
            return self._by_path[layer]
        layer = as_index(layer, "layer", "Watch.mixer")
        for mixer in self.mixers:
            if mixer.layer == layer:
                return mixer
        raise Unavailable(f"no recurrent mixer at layer {layer}; recurrent layers: {[m.layer for m in self.mixers]}")

    def memory_after(self, token: int, call: int | None = None) -> dict[int, Memory]:
        """The whole memory (state and conv window) after `token` of every mixer, by layer.

        Needs `keep=("states", "windows")`; pass the result to another watch's `set_memory_after`.
        A model with several mixers per layer (inkling's four windows) has no memory per layer: use
        `w.mixers[i].memory_after` there.
        """
        one_mixer_per_layer(self.mixers, "Watch.memory_after")
        return {mixer.layer: mixer.memory_after(token, call) for mixer in self.mixers}

    def set_memory_after(self, token: int, memories: Mapping[int, Memory], call: int = 0
                         ) -> list[RemovableHandle]:
        """Write each layer's whole memory after `token` of call `call` (the activation-patching move).

            with rh.watch(model, keep=("states", "windows")) as a:
                model(run_a)
            with rh.watch(model) as b:
                b.set_memory_after(7, a.memory_after(7))   # every recurrent layer continues as in run A
                model(run_b)
        """
        if not isinstance(memories, Mapping):
            raise InvalidValue(f"Watch.set_memory_after: expected a mapping of layer -> Memory (as memory_after"
                               f" returns), got {type(memories).__name__}")
        one_mixer_per_layer(self.mixers, "Watch.set_memory_after")
        unknown = sorted(set(memories) - {mixer.layer for mixer in self.mixers})
        if unknown:
            raise Unavailable(f"set_memory_after: no recurrent mixer at layers {unknown};"
                              f" recurrent layers: {[m.layer for m in self.mixers]}")
        return [self.mixer(layer).set_memory_after(token, memory, call) for layer, memory in memories.items()]

    def __enter__(self) -> "Watch":
        if self._stack is not None:
            raise RecurrentHooksError("this watch is active already: enter a new watch(model) instead")
        found = _mixer_modules(self.model)
        if not found:
            raise Unavailable(_no_mixer_message(self.model))
        thread = threading.get_ident()
        self._check_layers(found)
        rows = sorted(((row.kind(m, row.name, keep=self._kept_by(_layer_in_path(path)), thread=thread,
                                 layer=_layer_in_path(path), cache_index=index), row)
                       for path, m, row in found for index in row.kind._instances(m, self.model)),
                      key=lambda pair: (pair[0].layer is None, pair[0].layer or 0))
        mixers = [mixer for mixer, _ in rows]
        paths = {path: next(mixer for mixer in mixers if mixer.module is m) for path, m, _ in found}
        for mixer in mixers:  # the policy its calls run by, a value the tracker hands down
            mixer.tracker.policy = Policy(self.paths, self.keep_device, reduce_of_layer(self.reduce, mixer.layer))
        stack = contextlib.ExitStack()
        try:  # all or nothing: a failure releases what was acquired so far
            for mixer, row in rows:
                _attach_with_kernels(mixer, row, stack)
                stack.callback(detach, mixer)
        except BaseException:
            stack.close()
            raise
        instance_patches = UndoStack()
        stack.callback(instance_patches.undo)
        saw_cache = _reorder_recorder(mixers, instance_patches)
        for mixer in mixers:
            mixer.tracker.saw_cache = saw_cache
        stack.callback(_forget_cache_recorder, mixers)  # it refers to the mixers: a cycle once the block is over
        self.mixers, self._stack, self._by_path = mixers, stack, paths
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
        if exc_type is None:
            problems = [p for mixer in self.mixers for p in mixer.unapplied()]
            if problems:
                shown = "; ".join(problems[:_WRITES_SHOWN])
                more = f"; and {len(problems) - _WRITES_SHOWN} more" if len(problems) > _WRITES_SHOWN else ""
                warnings.warn(f"{len(problems)} write{'s' if len(problems) != 1 else ''} never ran: {shown}{more}."
                              " The calls they target did not happen: generation may have stopped early (EOS or"
                              " max_new_tokens)", RecurrentHooksWarning, stacklevel=2)
            unkept = [p for mixer in self.mixers for p in mixer.unkept()]
            if unkept:
                shown = "; ".join(unkept[:_WRITES_SHOWN])
                more = f"; and {len(unkept) - _WRITES_SHOWN} more mixers" if len(unkept) > _WRITES_SHOWN else ""
                warnings.warn(f"{shown}{more}. Positions count from each call's first token (negative: from its"
                              " last)", RecurrentHooksWarning, stacklevel=2)


_WRITES_SHOWN = 2  # writes named in the warning about writes that never ran


def _checked_layers(layers: Any) -> frozenset[int] | None:
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise InvalidValue(f"watch: expected layers= decoder layer indices (as [0, 2]) or None, got {layers!r}")
    return frozenset(as_index(layer, "layers", "watch") for layer in layers)


def _checked_paths(paths: Any, where: str) -> Paths:
    if paths is None:
        return strategies.DEFAULT
    if not isinstance(paths, Paths):
        raise InvalidValue(f"{where}: expected paths= a recurrent_hooks.Paths (as Paths(rule='loop')) or None, got"
                           f" {type(paths).__name__} {paths!r}")
    return paths


def one_mixer_per_layer(mixers: Sequence[RecurrentMixer], method: str) -> None:
    """Refuse, for `method`, a model whose layers hold several watched mixers (a memory per layer is ambiguous)."""
    layers = [mixer.layer for mixer in mixers]
    shared = sorted({layer for layer in layers if layers.count(layer) > 1})
    if shared:
        raise Unavailable(f"{method}: layers {shared} have several mixers each"
                          f" ({', '.join(str(m) for m in mixers if m.layer == shared[0])}), so a memory per"
                          " layer would be ambiguous; read and write each mixer's own (w.mixers[i].memory_after,"
                          " w.mixers[i].set_memory_after)")


def watch(model: nn.Module, keep: Sequence[str] | Mapping[str, Iterable[int] | None] = (),
          record: bool = False, paths: Paths | None = None, keep_device: "str | torch.device | None" = None,
          reduce: "Mapping[str, Callable[[Any], Any]] | Callable[[Any], Any] | None" = None,
          layers: Iterable[int] | None = None) -> Watch:
    """Watch every supported recurrent mixer of `model` for the duration of a `with` block.

        with recurrent_hooks.watch(model, keep=("states",)) as w:
            w.mixers[1].set_state_after(4, value)          # call 0 (the prompt): tokens 5.. continue from value
            h = w.mixers[1].register_state_hook(fn)        # fn(mixer, call, token, state) at every token
            out = model.generate(ids, max_new_tokens=8)    # call 0 is the prompt, call k decode step k
        w.mixers[0].states                                  # the state after every token of the last call

    See `Watch` for what happens on entry and exit and for `paths` (how busy calls run: `Paths`), and
    docs/concepts.md for calls, tokens and writes.
    """
    return Watch(model, keep, record, paths, keep_device, reduce, layers)


_STANDALONE: "weakref.WeakKeyDictionary[nn.Module, RecurrentMixer]" = weakref.WeakKeyDictionary()


def register_state_hook(module: nn.Module, fn: StateHook, *, call: int | Iterable[int] | None = None,
                        token: int | Iterable[int] | None = None, paths: Paths | None = None) -> RemovableHandle:
    """Register `fn(mixer, call, token, state)` on a mixer module, without a `with` block.

        h = recurrent_hooks.register_state_hook(model.model.layers[0].linear_attn, fn)
        model(ids); model.generate(ids, max_new_tokens=4)   # fn runs at every token until removed
        h.remove()                                          # the last handle removed restores the kernels

    Calls are counted from each prompt: a call that starts from no cached state is call 0 again, so in
    every `generate` the prompt is call 0 and decode step k is call k, as inside a fresh `watch`. The
    hook contract (return None or a replacement state) is that of `RecurrentMixer.register_state_hook`.
    Like a torch module hook, it fires in every thread that runs the module, and a handle dropped without
    `remove()` leaves the hook in place; the kernels are released when the last hook is removed or when
    the module is garbage-collected.

    `paths` (a `Paths`, as for `watch`) is the policy of every standalone hook on the module: the first hook's
    (None: the default, or the one already set) until all are removed; another one while hooks are live is an
    error.
    """
    given = None if paths is None else _checked_paths(paths, "register_state_hook")
    row = mixer_of(module)
    if row is None:
        raise InvalidValue(
            f"register_state_hook: expected a recurrent mixer module (one of"
            f" {', '.join(cls for f in FAMILIES.values() for cls in f.mixers)}), got {type(module).__name__}"
        )
    mixer = _STANDALONE.get(module)
    if mixer is not None and given is not None and given != mixer.paths:
        raise InvalidValue(f"register_state_hook: the standalone hooks on {mixer} run with {mixer.paths}; got"
                           f" paths={given}. Remove them first, or pass the same paths (or none)")
    if mixer is None:
        mixer = row.kind(module, row.name, history=False, restart_on_prompt=True)
        mixer.tracker.policy = Policy(strategies.DEFAULT if given is None else given)
        stack = contextlib.ExitStack()
        with stack:  # released again if attaching fails
            _attach_with_kernels(mixer, row, stack)
            stack.callback(detach, mixer)
            releases = stack.pop_all()
        owner = weakref.ref(module)
        finalizer = weakref.finalize(module, releases.close)  # the module died with hooks on it

        def release() -> None:
            live = owner()
            if live is not None and _STANDALONE.get(live) is mixer:
                del _STANDALONE[live]
            finalizer.detach()
            releases.close()
            mixer._on_empty = None  # this function refers to the mixer: a cycle once the mixer is released

        mixer._on_empty = release
        _STANDALONE[module] = mixer
    try:
        return mixer.register_state_hook(fn, call=call, token=token)
    except BaseException:
        hook_removed(mixer)  # releases the kernels if this was to be the first hook
        raise


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
    key = strategies.calibration_key(weight.device, weight.dtype)
    if strategies.costs_for(weight.device, weight.dtype) is None:
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
        layer = getattr(module, "layer_idx" if family is None else family.kind.LAYER_ATTRIBUTE, _layer_in_path(path))
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
