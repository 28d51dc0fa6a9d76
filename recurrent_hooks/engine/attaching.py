"""Attaching one handle, all or nothing: its module's tap, the `__call__` of its mixer classes, its kind's kernel names.

`attach_handle(mixer, family, stack)` takes the three bindings a handle needs (docs/architecture.md, step 1) and
registers each release on `stack`, so that a watch and a standalone hook release exactly what they took: the
mixer module's forward hooks (`tap.attach`), the mixer classes' `__call__` (`forwards.make_owner`: every forward
marks itself as running), and the kind's kernel names in the modeling module (`rebinding.acquire_kernels` with
`tap.make_dispatcher`). Bindings are reference-counted per (owner, name): a nested watch or a standalone hook
shares them, and the last user to leave restores them.
"""

import contextlib
import types
from typing import Any

from torch import nn

from .binding.rebinding import MISSING, acquire_kernels, bound_original, import_default
from .binding.registry import FAMILIES, MixerClass
from .binding.upstream import is_kernel_like, kernel_missing, warn_if_untested
from .declare.kernels import Kernel, Site
from .dispatch.forwards import make_owner
from .dispatch.tap import attach, make_dispatcher
from .handle.mixer import RecurrentMixer
from .paths import budget as memory
from .paths import costs


def attach_handle(mixer: RecurrentMixer, family: MixerClass, stack: contextlib.ExitStack) -> None:
    """Attach `mixer` and acquire its family's kernels, registering both releases on `stack`.

    The `__call__` of its mixer class (and of the other mixer classes of its modeling module, which may call
    the same kernels) is acquired too: each forward of an instance, watched or not, then tells the kernels whose
    forward is running (`forwards.make_owner`)."""
    costs.load_costs()  # the cost model's calibrations, read now rather than while torch.compile traces
    for device in {parameter.device for parameter in mixer.module.parameters()}:
        memory.note_device(device)  # (and the memory its default budget is a share of)
    warn_if_untested()
    module = family.module()
    classes = {
        type(mixer.module),
        *(
            cls
            for row in FAMILIES.values()
            if row.module_name == family.module_name
            for each in row.classes
            if isinstance(cls := getattr(module, each.mixer_class, None), type)
        ),
    }
    stack.callback(
        acquire_kernels([(cls, "__call__") for cls in sorted(classes, key=lambda c: c.__qualname__)], make_owner)
    )
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
    where = (
        family.module_name
        if kernel.site is Site.MODULE
        else f"{family.module_name}.{owner}"
        if kernel.site is Site.CLASS
        else f"the mixer module {type(mixer_module).__name__}{'.' if owner else ''}{owner}"
    )
    try:
        target = family.target(kernel, mixer_module)
    except (AttributeError, ImportError):
        raise kernel_missing(family.name, kernel.name, where, None) from None
    found = bound_original(*target)
    if not is_kernel_like(found):
        raise kernel_missing(family.name, kernel.name, where, None if found is MISSING else found)
    return target


def _acquire_bound_copies(
    mixer_module: nn.Module, kernel: Kernel, owner: type, kind: type[RecurrentMixer], stack: contextlib.ExitStack
) -> None:
    """Rebind, for the watch, the attributes of the mixer module that hold a class-attribute kernel already
    bound to it: a wrapper that replaced the module's `forward` keeps the original bound method on the
    instance (accelerate's offloading hooks store it as `_old_forward`) and calls it, so rebinding the class
    attribute alone would not reach its calls. Each becomes the kernel's dispatcher, bound to the module."""
    original = import_default(owner, kernel.name)

    def holds_kernel(value: Any) -> bool:  # the original bound to the module, or a watch's dispatcher for it
        func = getattr(value, "__func__", None)
        return (
            getattr(value, "__self__", None) is mixer_module
            and func is not None
            and (func is original or getattr(func, "__wrapped__", None) is original and _is_dispatcher(func))
        )

    names = [name for name, value in vars(mixer_module).items() if holds_kernel(value)]
    if not names:
        return
    dispatcher = make_dispatcher(kind)

    def bound(name: str, value: Any) -> Any:
        return types.MethodType(dispatcher(kernel.name, value.__func__), value.__self__)

    stack.callback(acquire_kernels([(mixer_module, name) for name in names], bound))


def _is_dispatcher(fn: Any) -> bool:
    return getattr(fn, "__recurrent_hooks__", False)
