"""transformers' own pure-torch kernels, reached by the library's one rule (`recurrent_hooks.extend.torch_kernel`):
the tests compare the library's loops with these."""

import importlib

from recurrent_hooks.extend import FAMILIES, torch_kernel


def transformers_kernel(family: str, name: str):
    """The pure-torch function behind `name` in `family`'s modeling module, as transformers bound it (under its
    hub-fallback wrapper in 5.24, its kernels hub module in 5.25); refused while a watch has it rebound."""
    module = importlib.import_module(
        FAMILIES[family].module_name if family in FAMILIES else f"transformers.models.{family}.modeling_{family}"
    )
    bound = getattr(module, name)
    assert not getattr(bound, "__recurrent_hooks__", False), f"{module.__name__}.{name} is rebound by a watch"
    return torch_kernel(bound)
