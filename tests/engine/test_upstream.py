"""What the library takes from transformers: the tested range (declared once, checked against what is installed and
what pyproject.toml says), the one rule that finds the pure-torch kernel behind any wrapper, and the errors and
warnings when a release moved something."""

import functools
import importlib.metadata
import json
import pathlib
import re
import warnings

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids
from torch import nn

import recurrent_hooks as rh
from recurrent_hooks.engine.binding import upstream
from recurrent_hooks.extend import torch_kernel


def _hub_module(function):
    """A module made from a function the way kernels' `use_kernel_forward_from_hub` makes one (its class's forward
    closes over the function as `func`), built here so that the rule is tested whether or not kernels is installed."""

    def make(func):
        class Func(nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)

        return Func()

    return make(function)


def _pure(x, y=1.0):
    return x * y


def test_the_rule_unwraps_every_form_transformers_binds():
    @functools.wraps(_pure)
    def fallback(*args, **kwargs):  # use_kernel_func_from_hub_with_fallback's wrapper
        return _pure(*args, **kwargs)

    hub = _hub_module(fallback)  # 5.25: the wrapper inside a hub module
    assert torch_kernel(_pure) is _pure
    assert torch_kernel(fallback) is _pure
    assert torch_kernel(hub) is _pure
    assert torch_kernel(_hub_module(_pure)) is _pure
    partial = functools.partial(_pure, y=2.0)
    assert torch_kernel(partial) is partial  # a partial is a kernel of its own (xlstm's), not unwrapped
    assert upstream.is_kernel_like(hub) and upstream.is_kernel_like(partial) and not upstream.is_kernel_like(nn.Linear)
    with pytest.raises(
        rh.Unavailable,
        match=r"expected a kernels hub module made from a function .* got the module"
        r" Linear",
    ):
        torch_kernel(nn.Linear(2, 2))
    with pytest.raises(rh.Unavailable, match="expected a kernel .* got int"):
        torch_kernel(3)


def test_the_rule_finds_transformers_kernels_of_every_family_outside_and_inside_a_watch():
    """Every module-global kernel of every family is found as a plain function by the rule, and the same one while
    a watch has the name rebound (its dispatcher says what it replaced)."""
    model = build("mamba2")
    module = rh.FAMILIES["mamba2"].module()
    names = [kernel.name for kernel in rh.FAMILIES["mamba2"].kind.KERNELS]
    before = {name: torch_kernel(getattr(module, name)) for name in names}
    for name, function in before.items():
        assert isinstance(function, type(_pure)) and not hasattr(function, "__wrapped__"), name
    with rh.watch(model):
        for name in names:
            assert getattr(module, name).__recurrent_hooks__
            assert torch_kernel(getattr(module, name)) is before[name]
    for family in rh.FAMILIES.values():
        for kernel in family.kind.KERNELS:
            if kernel.site is rh.extend.Site.MODULE:
                assert callable(torch_kernel(getattr(family.module(), kernel.name))), (family.name, kernel.name)


def test_a_hub_module_is_rebound_in_its_own_class(monkeypatch):
    """Where transformers binds a hub module, the watch binds a module of the same class (kernels rebuilds a pickled
    model's own copies from the class of the name), and restores the very object on exit."""
    module = rh.FAMILIES["mamba2"].module()
    hub = _hub_module(torch_kernel(module.causal_conv1d_fn))
    monkeypatch.setattr(module, "causal_conv1d_fn", hub)
    model, ids = build("mamba2"), random_ids(1, 6)
    with torch.no_grad():
        plain = model(ids).logits
        with rh.watch(model, keep=("windows",)) as w:
            bound = module.causal_conv1d_fn
            assert type(bound) is type(hub) and bound is not hub and bound.__recurrent_hooks__
            watched = model(ids).logits
    assert module.causal_conv1d_fn is hub
    assert w.mixers[0].windows.shape[1] == 6
    assert torch.equal(plain, watched)
    notes = next(row for row in rh.support(model) if row.family).notes["idle calls run"]
    assert "modeling_mamba2.causal_conv1d_fn (through a kernels hub module)" in notes, notes


def test_a_module_of_another_layout_still_runs_watched(monkeypatch):
    """A kernel bound as a module the rule does not know (a future kernels layout): a watch still runs it, as a
    module of its class where the class can be made again, and only `torch_kernel` says it cannot see through."""
    module = rh.FAMILIES["mamba2"].module()
    scan = torch_kernel(module.mamba2_chunk_scan)

    class Wrapper(nn.Module):  # no closure named `func`: the function is an attribute
        def __init__(self):
            super().__init__()
            self.function = scan

        def forward(self, *args, **kwargs):
            return self.function(*args, **kwargs)

    monkeypatch.setattr(module, "mamba2_chunk_scan", Wrapper())
    model, ids = build("mamba2"), random_ids(1, 6)
    with torch.no_grad():
        plain = model(ids).logits
        with rh.watch(model, keep=("states",)) as w:
            assert type(module.mamba2_chunk_scan) is Wrapper and module.mamba2_chunk_scan.__recurrent_hooks__
            watched = model(ids).logits
    assert_close("watched logits (states kept: the library's chunk-wise states)", plain, watched, rtol=1e-5, atol=1e-6)
    assert w.mixers[0].states.shape[1] == 6
    with pytest.raises(rh.Unavailable, match="got the module .*Wrapper"):
        torch_kernel(module.mamba2_chunk_scan)


def test_a_kernel_that_vanished_is_named_with_the_version_and_the_range(monkeypatch):
    """A kernel name missing from the modeling module (jamba's `mamba_inner_fn` under 5.25, or a renamed kernel),
    or bound to something that is no kernel: the error names the family, the kernel, the installed transformers
    and the tested range; nothing stays rebound."""
    model = build("mamba")
    module = rh.FAMILIES["mamba"].module()
    monkeypatch.delattr(module, "mamba_selective_scan")
    with pytest.raises(
        rh.Unavailable,
        match=r"family 'mamba': transformers\.models\.mamba\.modeling_mamba has no"
        r" attribute 'mamba_selective_scan' under transformers \S+; the library is tested on"
        r" transformers >=5\.24,<5\.26",
    ):
        rh.watch(model).__enter__()
    monkeypatch.setattr(module, "mamba_selective_scan", 3, raising=False)
    with pytest.raises(rh.Unavailable, match=r"modeling_mamba binds int, not a kernel, to 'mamba_selective_scan'"):
        rh.watch(model).__enter__()


def test_the_optional_fused_kernel_may_be_absent():
    """jamba's fused `mamba_inner_fn` is gone in 5.25: a fused name is rebound where the module has it."""
    model, ids = build("jamba"), random_ids(1, 5)
    with torch.no_grad(), rh.watch(model, keep=("states",)) as w:
        model(ids)
    assert w.mixers[0].states.shape[1] == 5


def test_the_tested_range_is_one_fact():
    """pyproject.toml declares the range the library states; the installed release is in it (the suite runs on the
    releases it declares); the minors listed are those of the range."""
    requirement = next(r for r in importlib.metadata.requires("recurrent_hooks") if r.startswith("transformers"))
    declared = set(requirement.replace(" ", "").removeprefix("transformers").split(","))
    assert declared == set(upstream.TESTED_RANGE.split(",")), (requirement, upstream.TESTED_RANGE)
    low, high = (tuple(int(x) for x in bound.lstrip("<>=").split(".")) for bound in upstream.TESTED_RANGE.split(","))
    assert upstream.TESTED_MINORS == tuple((low[0], minor) for minor in range(low[1], high[1]))
    assert upstream.is_tested(), f"the suite runs on {upstream.installed_version()}, outside {upstream.TESTED_RANGE}"
    assert upstream.is_tested("5.24.0") and upstream.is_tested("5.25.1") and upstream.is_tested("5.25.0rc1")
    assert not upstream.is_tested("5.26.0") and not upstream.is_tested("5.23.2") and not upstream.is_tested("main")
    assert upstream.version_line("5.26.0") == "transformers 5.26.0: not tested (the tested range is >=5.24,<5.26)"
    assert upstream.version_line() == f"transformers {upstream.installed_version()}: tested (>=5.24,<5.26)"


def test_a_watch_under_an_untested_release_warns_once(monkeypatch):
    monkeypatch.setattr(upstream, "installed_version", lambda: "5.26.0")
    upstream.warn_if_untested.cache_clear()
    model, ids = build("mamba"), random_ids(1, 4)
    try:
        with pytest.warns(
            rh.RecurrentHooksWarning,
            match=r"tested on transformers >=5\.24,<5\.26; the installed"
            r" 5\.26\.0 is not in that range",
        ):
            with rh.watch(model):
                model(ids)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with rh.watch(model):
                model(ids)
    finally:
        upstream.warn_if_untested.cache_clear()


def test_the_support_command_prints_the_version_line(capsys):
    from recurrent_hooks.__main__ import main

    assert main(["support", "mamba"]) == 0
    assert capsys.readouterr().out.split("\n")[0] == upstream.version_line()
    assert main(["support", "mamba", "--json"]) == 0
    captured = capsys.readouterr()  # --json: the line on stderr, one object on stdout, which names the releases
    assert captured.err.strip() == upstream.version_line() and captured.out.lstrip().startswith("{")
    assert json.loads(captured.out)["versions"]["tested_range"] == upstream.TESTED_RANGE


# The torch APIs the package calls that a torch release introduced, with that release: the floor pyproject.toml
# declares must be at least the newest of them. Found by reading the package (the test checks each is still used,
# and that the installed torch has it); the suite itself runs on torch 2.13.
TORCH_APIS = {
    "torch.accelerator.synchronize": (2, 6),
    "torch.library.custom_op": (2, 4),
    "torch.compiler.is_compiling": (2, 3),
    "torch.sym_ite": (2, 1),
}
PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "recurrent_hooks"


def test_the_declared_torch_floor_has_every_api_the_package_calls():
    source = "\n".join(path.read_text() for path in PACKAGE.rglob("*.py"))
    for api, release in TORCH_APIS.items():
        assert api in source, f"{api} is no longer used: drop it from TORCH_APIS"
        owner, _, name = api.rpartition(".")
        assert hasattr(functools.reduce(getattr, owner.split(".")[1:], torch), name), f"torch has no {api}"
    requirement = next(r for r in importlib.metadata.requires("recurrent_hooks") if r.startswith("torch"))
    floor = tuple(int(x) for x in re.search(r">=\s*(\d+)\.(\d+)", requirement).groups())
    newest = max(TORCH_APIS.values())
    assert floor >= newest, f"pyproject declares {requirement}; the package calls APIs of torch {newest[0]}.{newest[1]}"
