"""A state hook without a `with` block: `register_state_hook(mixer_module, fn)`, live until its handle is removed.

One handle per module serves every standalone hook on it (`_STANDALONE`); the first hook attaches it
(`attaching.attach_handle`), and the last one removed (or the module's collection) releases its bindings.
"""

import contextlib
import weakref
from collections.abc import Iterable

from torch import nn
from torch.utils.hooks import RemovableHandle

from .attaching import attach_handle
from .binding.registry import FAMILIES, MixerClass, mixer_of
from .errors import InvalidValue
from .handle.mixer import RecurrentMixer, StateHook
from .policy import DEFAULT, Paths, Policy, checked_paths

_STANDALONE: "weakref.WeakKeyDictionary[nn.Module, RecurrentMixer]" = weakref.WeakKeyDictionary()


def register_state_hook(
    module: nn.Module,
    fn: StateHook,
    *,
    call: int | Iterable[int] | None = None,
    token: int | Iterable[int] | None = None,
    paths: Paths | None = None,
) -> RemovableHandle:
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
    given = None if paths is None else checked_paths(paths, "register_state_hook")
    row = mixer_of(module)
    if row is None:
        raise InvalidValue(
            f"register_state_hook: expected a recurrent mixer module (one of"
            f" {', '.join(cls for f in FAMILIES.values() for cls in f.mixers)}), got {type(module).__name__}"
        )
    mixer = _STANDALONE.get(module)
    if mixer is not None and given is not None and given != mixer.paths:
        raise InvalidValue(
            f"register_state_hook: the standalone hooks on {mixer} run with {mixer.paths}; got"
            f" paths={given}. Remove them first, or pass the same paths (or none)"
        )
    if mixer is None:
        mixer = _STANDALONE[module] = _attached(module, row, DEFAULT if given is None else given)
    try:
        return mixer.register_state_hook(fn, call=call, token=token)
    except BaseException:
        mixer.hook_removed()  # releases the kernels if this was to be the first hook
        raise


def _attached(module: nn.Module, row: MixerClass, paths: Paths) -> RecurrentMixer:
    """The handle of a module's standalone hooks, attached, and released when its last hook is removed (or when the
    module is collected)."""
    mixer = row.kind(module, row.name, history=False, restart_on_prompt=True, policy=Policy(paths))
    stack = contextlib.ExitStack()
    with stack:  # released again if attaching fails
        attach_handle(mixer, row, stack)
        stack.callback(mixer.mark_detached)
        releases = stack.pop_all()
    owner = weakref.ref(module)
    finalizer = weakref.finalize(module, releases.close)  # the module died with hooks on it

    def release() -> None:
        live = owner()
        if live is not None and _STANDALONE.get(live) is mixer:
            del _STANDALONE[live]
        finalizer.detach()
        releases.close()
        mixer.release_when_empty(None)  # this function refers to the mixer: a cycle once the mixer is released

    mixer.release_when_empty(release)
    return mixer
