"""`pytest --device`: the option's plumbing, and each kind's model on the device against its float64 CPU reference.

The plumbing (tests/helpers/_device.py, tests/conftest.py): `build` and `random_ids` put what they make on
`_models.DEVICE`; `--device cpu` is the suite without the option; a test marked `cpu_only` is skipped off the CPU with
its reason shown; a device this machine lacks is refused before anything runs, by name. The parity: one family per kind,
its model on the device (float32, and bfloat16) in an idle watch and keeping states at a few positions against the same
weights in float64 on the CPU, unwatched and watched. On a GPU with flash-linear-attention installed transformers
binds fla's kernels, so this is where the idle path and the segments path over them meet the torch kernels' maths.
"""

import pathlib
import subprocess
import sys

import _device
import _models
import pytest
import torch
from _models import build, random_ids

import recurrent_hooks as rh
from recurrent_hooks.engine.declare.memory_parts import parts_of

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _pytest(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_build_and_random_ids_put_the_model_and_ids_on_the_device(monkeypatch, pytestconfig):
    """`_models.DEVICE` is the device `--device` names; set to another (meta here: every machine has it), it is
    where `build` puts every parameter and buffer and `random_ids` its ids."""
    assert _models.DEVICE == _device.resolve(pytestconfig.getoption("--device"))
    on_cpu = random_ids(2, 5, seed=3).cpu()
    monkeypatch.setattr(_models, "DEVICE", torch.device("meta"))
    model = build("qwen3_5")
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    assert {t.dtype for t in model.parameters()} == {torch.float32} and not model.training
    ids = random_ids(2, 5, seed=3)
    assert ids.device.type == "meta" and ids.shape == on_cpu.shape and ids.dtype == torch.long


def test_a_device_this_machine_lacks_is_refused_by_name():
    with pytest.raises(pytest.UsageError, match=r"--device bogus: not a device torch knows"):
        _device.resolve("bogus")
    assert _device.resolve("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert _device.resolve("cuda") == torch.device("cuda", torch.cuda.current_device())
        return
    with pytest.raises(pytest.UsageError, match=r"--device cuda: this machine has no CUDA device"):
        _device.resolve("cuda")


@pytest.mark.cpu_only(reason="the marker's own check: it runs under --device cpu and is skipped under another")
def test_a_cpu_only_test_runs_on_the_cpu():
    assert _models.DEVICE.type == "cpu"


@pytest.mark.full  # pytest in four child processes: a minute on 2 cores
@pytest.mark.cpu_only(reason="runs pytest in child processes on the CPU: what it checks is the option's plumbing")
def test_device_cpu_is_the_suite_without_the_option_and_cpu_only_tests_skip_elsewhere():
    """`--device cpu` collects the same tests as no option; off the CPU (meta) a `cpu_only` test is skipped with
    its reason shown; on a machine without CUDA, `--device cuda` stops pytest before it collects, naming it."""
    if not torch.cuda.is_available():
        run = _pytest("--device", "cuda", "--collect-only", "-q", "tests/package/test_device.py")
        assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
        assert "--device cuda: this machine has no CUDA device" in run.stderr, run.stderr
    files = ["tests/package/test_device.py", "tests/kinds/test_contract.py"]
    plain, on_cpu = (_pytest("--collect-only", "-q", *extra, *files) for extra in ([], ["--device", "cpu"]))
    assert plain.returncode == on_cpu.returncode == 0, plain.stdout[-2000:] + on_cpu.stdout[-2000:]
    ids = [line for line in plain.stdout.splitlines() if "::" in line]
    assert ids and ids == [line for line in on_cpu.stdout.splitlines() if "::" in line]
    elsewhere = _pytest(
        "--device", "meta", "-rs", "-q", "tests/package/test_device.py::test_a_cpu_only_test_runs_on_the_cpu"
    )
    assert elsewhere.returncode == 0 and "1 skipped" in elsewhere.stdout, elsewhere.stdout[-2000:]
    assert "CPU only, not run on meta: the marker's own check" in elsewhere.stdout, elsewhere.stdout[-2000:]


# -- parity with the float64 CPU reference ------------------------------------------------------------------------

# ||got - reference|| / ||reference|| at most this, per dtype: float32 leaves room for TF32 convolutions (on by
# default in cuDNN) and fused kernels' orders of summation; bfloat16's is its rounding over a few layers
RELATIVE = {torch.float32: 2e-3, torch.bfloat16: 5e-2}
POSITIONS = [3, 8, 12]


def _relative(got, reference) -> float:
    got, reference = got.detach().to("cpu", torch.float64), reference.detach().to(torch.float64)
    return float((got - reference).norm() / reference.norm().clamp_min(1e-30))


def _memory_after(mixer, token):
    """The state after `token`, or the conv window where the kind carries only one (a short convolution)."""
    try:
        return mixer.state_after(token)
    except rh.Unavailable:
        return mixer.window_after(token)


def _run(model, ids):
    """The logits unwatched, in an idle watch, and in a watch keeping the memories at `POSITIONS`; those memories."""
    with torch.no_grad():
        plain = model(ids).logits
        with rh.watch(model):
            idle = model(ids).logits
        with rh.watch(model, keep={"states": POSITIONS, "windows": POSITIONS}) as w:
            kept = model(ids).logits
    states = {(i, t): _memory_after(m, t) for i, m in enumerate(w.mixers) for t in POSITIONS}
    return plain, idle, kept, states


def _reference(family, ids):
    """`_run` of build's weights on the CPU in float64; in float32 where the model does not run in float64 (the MoE
    experts' grouped matrix products take float32, bfloat16 and float16 only; inkling2_loop makes a float32
    tensor of its own)."""
    torch.manual_seed(0)
    try:
        return _run(_models.FAMILIES[family]().to(torch.float64).eval(), ids)
    except RuntimeError:
        torch.manual_seed(0)
        return _run(_models.FAMILIES[family]().eval(), ids)


@pytest.mark.one_per_kind
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", list(rh.FAMILIES))
def test_the_model_on_the_device_meets_its_float64_cpu_reference(family, dtype):
    """The unwatched model within `RELATIVE` of the reference; the watched ones within that or 4 x the unwatched
    model's own error (the token loops round otherwise than fused kernels: tests/kinds/test_dtypes.py); the memories
    kept within `RELATIVE`."""
    model = build(family).to(dtype)
    ids = random_ids(2, 13)
    try:
        with torch.no_grad():
            model(ids)
    except RuntimeError as error:
        pytest.skip(f"transformers' own {dtype} forward of {family} fails: {str(error).splitlines()[0][:120]}")
    got, expected = _run(model, ids), _reference(family, ids.cpu())
    plain = _relative(got[0], expected[0])
    assert plain <= RELATIVE[dtype], f"{family} {dtype} on {_models.DEVICE}: the plain logits off by {plain:.2g}"
    bound = max(RELATIVE[dtype], 4 * plain)
    for name, g, e in zip(("idle watch's logits", "logits keeping states"), got[1:3], expected[1:3]):
        assert _relative(g, e) <= bound, f"{family} {dtype} on {_models.DEVICE}: {name} off by {_relative(g, e):.2g}"
    bound = RELATIVE[dtype]
    assert got[3].keys() == expected[3].keys()
    for key, value in got[3].items():
        for (part, g), (_, e) in zip(parts_of(value), parts_of(expected[3][key])):
            error = _relative(g, e)
            assert error <= bound, (
                f"{family} {dtype} on {_models.DEVICE}: mixer {key[0]}'s state {part} after"
                f" token {key[1]} off by {error:.2g}"
            )
