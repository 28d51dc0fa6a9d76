"""What the library takes from transformers: the releases it is tested on, and the kernel behind a name.

Module contents:
- `TESTED_RANGE`, `TESTED_MINORS`: the transformers releases the suite has passed on (pyproject.toml declares the
  same range); `installed_version()`, `is_tested(version)`, `is_at_least(major, minor)`, `version_line()`,
  `warn_if_untested()` (once per process, at the first watch);
- `torch_kernel(bound)`: the pure-torch function behind what a modeling module binds to a kernel name, by one
  rule for every wrapper transformers puts around a kernel (below);
- `is_kernel_like(bound)`: whether an object can be what a mixer calls as a kernel;
- `hub_module(bound)`: whether it is a `kernels` hub module; `in_bound_form(dispatcher, original)`: the library's
  dispatcher in the form transformers bound (a hub module of the same class where it bound one, so that what reads
  the class of the name, as kernels' unpickler does, finds the class it expects); `wraps_kernel(original)`:
  `functools.wraps` for a dispatcher, with the pure-torch function's name and `__wrapped__` = `original`;
- `kernel_missing(family, kernel, where, found)`: the error for a kernel name that is not there, or not a kernel.

How transformers binds a kernel name (what `torch_kernel` unwraps, until none of these is left), one item a
case, read as "transformers release: what is bound to the name -> the pure-torch function":

- 5.24, or 5.25 without the `kernels` package: `use_kernel_func_from_hub_with_fallback`'s wrapper (a function
  made with `functools.wraps`) -> its `__wrapped__`;
- 5.25 (it requires `kernels`): a hub module: `use_kernel_forward_from_hub` turns the wrapper (or a plain function)
  into an `nn.Module` instance whose class's `forward` calls it -> the function its class's `forward` closes over
  (`func`), then as above;
- any: a plain function, a method, a `functools.partial` -> itself;
- any, in a watch: the library's dispatcher (`__recurrent_hooks__`) -> what was bound before it (`__wrapped__`),
  then as above.
"""

import functools
import re
import warnings
from collections.abc import Callable
from typing import Any

import transformers
from torch import nn

from ..errors import RecurrentHooksWarning, Unavailable

TESTED_MINORS = ((5, 24), (5, 25))  # (major, minor) of every transformers release the suite has passed on
TESTED_RANGE = ">=5.24,<5.26"  # the same, as pyproject.toml declares it
# the name of the function a hub module's class forward closes over (kernels' `_create_func_module`)
_HUB_FUNCTION = "func"


def installed_version() -> str:
    return transformers.__version__


def _minor(version: str) -> tuple[int, int] | None:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def is_tested(version: str | None = None) -> bool:
    """Whether `version` (default: the installed transformers) is a release the suite has passed on. A development
    or release-candidate build of a tested minor counts as tested (its kernels are that minor's)."""
    return _minor(installed_version() if version is None else version) in TESTED_MINORS


def is_at_least(major: int, minor: int) -> bool:
    """Whether the installed transformers is release `major.minor` or newer (for the facts a kind rests on that
    changed between tested releases; each use says which fact)."""
    installed = _minor(installed_version())
    return installed is not None and installed >= (major, minor)


def version_line(version: str | None = None) -> str:
    """`transformers 5.25.0: tested (>=5.24,<5.26)`, or `... : not tested (the tested range is ...)`."""
    version = installed_version() if version is None else version
    if is_tested(version):
        return f"transformers {version}: tested ({TESTED_RANGE})"
    return f"transformers {version}: not tested (the tested range is {TESTED_RANGE})"


@functools.cache
def warn_if_untested() -> None:
    """Warn once per process when the installed transformers is outside the tested range (called by `watch`)."""
    if not is_tested():
        warnings.warn(
            f"recurrent_hooks is tested on transformers {TESTED_RANGE}; the installed"
            f" {installed_version()} is not in that range: a kernel the library rebinds may have moved or"
            " changed (a kernel that is gone is named when a watch enters; one that changed is not seen)",
            RecurrentHooksWarning,
            stacklevel=3,
        )


def hub_module(bound: Any) -> bool:
    """Whether `bound` is a `kernels` hub module made from a function (`use_kernel_forward_from_hub`)."""
    return isinstance(bound, nn.Module) and _closed_over(type(bound).forward) is not None


def _closed_over(forward: Any) -> Callable[..., Any] | None:
    """The function named `func` that `forward` closes over (a hub module's class forward), or None."""
    code, closure = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
    if code is None or not closure or _HUB_FUNCTION not in code.co_freevars:
        return None
    found = closure[code.co_freevars.index(_HUB_FUNCTION)].cell_contents
    return found if callable(found) else None


def torch_kernel(bound: Any) -> Callable[..., Any]:
    """The pure-torch function behind `bound`, what a modeling module binds to a kernel name (the table of the
    module docstring, applied until no wrapper is left).

        from recurrent_hooks.extend import torch_kernel
        torch_kernel(modeling_mamba2.mamba2_chunk_scan)   # transformers' own pure-torch chunked scan
    """
    seen = 0
    while True:
        seen += 1
        if seen > 32:
            raise Unavailable(f"torch_kernel: {bound!r} wraps more than 32 levels deep (a cycle of __wrapped__?)")
        if isinstance(bound, nn.Module):
            inner = _closed_over(type(bound).forward)
            if inner is None:
                raise Unavailable(
                    f"torch_kernel: expected a kernels hub module made from a function (its class's"
                    f" forward closing over {_HUB_FUNCTION!r}), got the module"
                    f" {type(bound).__qualname__}"
                )
            bound = inner
        elif getattr(bound, "__wrapped__", None) is not None and callable(bound.__wrapped__):
            bound = bound.__wrapped__
        elif callable(bound):
            return bound
        else:
            raise Unavailable(
                f"torch_kernel: expected a kernel (a function, a method, a partial or a kernels hub"
                f" module), got {type(bound).__name__}"
            )


def wraps_kernel(original: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`functools.wraps` for a function bound in place of `original`: the pure-torch kernel's name, module and
    docstring (a hub module has none of its own), and `__wrapped__` = `original`, what was bound before."""

    def wrap(dispatcher: Callable[..., Any]) -> Callable[..., Any]:
        named = original
        if isinstance(original, nn.Module):  # its function's name; a module of another layout: its class's
            try:
                named = torch_kernel(original)
            except Unavailable:
                named = type(original)
        functools.update_wrapper(dispatcher, named, updated=() if isinstance(named, type) else ("__dict__",))
        dispatcher.__wrapped__ = original
        return dispatcher

    return wrap


def in_bound_form(dispatcher: Callable[..., Any], original: Any) -> Any:
    """`dispatcher` as what to bind in place of `original`: itself, or, where `original` is a kernels hub module, a
    new module of the same class whose `forward` is `dispatcher` (kernels rebuilds a pickled model's own hub modules
    as `type(modeling_module.<name>)()`: inside a watch that must still be the hub module's class)."""
    if not isinstance(original, nn.Module):
        return dispatcher
    try:
        module = type(original)()
    except Exception:  # a module of another layout, which cannot be made again from nothing: the function
        return dispatcher
    module.forward = dispatcher
    module.__wrapped__ = original
    module.__recurrent_hooks__ = True
    return module


def is_kernel_like(bound: Any) -> bool:
    """Whether `bound` can be the kernel a mixer calls: callable, and not a class (a module of a layout this
    module does not know is callable: a watch runs it; only `torch_kernel` needs its function)."""
    return callable(bound) and not isinstance(bound, type)


def kernel_missing(family: str, kernel: str, where: str, found: Any) -> Unavailable:
    """The error for a family's kernel name that is not bound (`found` is None) or not bound to a kernel."""
    what = "has no attribute" if found is None else f"binds {type(found).__qualname__}, not a kernel, to"
    return Unavailable(
        f"family {family!r}: {where} {what} {kernel!r} under transformers {installed_version()};"
        f" the library is tested on transformers {TESTED_RANGE}, where it is a kernel:"
        " install a release in that range, or see README, 'Tests', to run the suite on another"
    )
