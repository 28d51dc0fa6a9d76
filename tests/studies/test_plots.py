"""recurrent_hooks.plots: every figure renders to a non-blank PNG; without matplotlib the error says what to install."""

import sys

import matplotlib
import matplotlib.image
import pytest
import torch
from _models import build, random_ids

import recurrent_hooks as rh
from recurrent_hooks import plots

matplotlib.use("Agg")


def rendered(figure, path):
    """Save `figure` as a PNG and check that it has more than one colour."""
    assert isinstance(figure, matplotlib.figure.Figure)
    figure.savefig(path)
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 50 and pixels.shape[1] > 50, pixels.shape
    assert pixels[..., :3].var() > 0, f"{path.name} is blank"


def test_the_sweep_heatmap_renders_with_and_without_token_labels(tmp_path):
    model = build("qwen3_5")
    clean, corrupt = random_ids(1, 8, seed=1), random_ids(1, 8, seed=2)
    sweep = rh.patching_sweep(model, clean[0], corrupt[0], lambda logits: logits[:, -1, 5], progress=False)
    tokens = [f"t{i}" for i in range(8)]
    rendered(plots.sweep_heatmap(sweep, tokens=tokens), tmp_path / "sweep.png")
    figure = plots.sweep_heatmap(sweep, normalized=True)
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == ["0", "2"]  # the recurrent layers
    rendered(figure, tmp_path / "normalized.png")
    rendered(plots.sweep_heatmap(sweep.values, title="a tensor"), tmp_path / "tensor.png")
    with pytest.raises(
        rh.InvalidValue,
        match=r"plots.sweep_heatmap: expected one token string per position \(8\)"
        r" or per prompt token, got 3",
    ):
        plots.sweep_heatmap(sweep, tokens=["a", "b", "c"])
    with pytest.raises(rh.InvalidValue, match=r"expected an rh.Sweep or a 2-D tensor, got list"):
        plots.sweep_heatmap([[1.0]])


def test_state_norms_render_over_the_prompt_and_the_decode_steps(tmp_path):
    model = build("qwen3_5")
    with rh.watch(model, keep=("states",)) as w:
        model.generate(random_ids(2, 8), max_new_tokens=4, do_sample=False, pad_token_id=0)
    figure = plots.state_norms(w, row=1)
    assert len(figure.axes[0].get_lines()) == len(w.mixers) + 3  # a line per layer, a divider per decode step
    rendered(figure, tmp_path / "norms.png")
    with rh.watch(model) as bare:
        model(random_ids(1, 8))
    with pytest.raises(rh.Unavailable, match=r"kept no states; pass keep=\('states',\)"):
        plots.state_norms(bare)


def test_the_attention_map_renders_a_2d_tensor(tmp_path):
    matrix = torch.tril(torch.rand(6, 6, generator=torch.Generator().manual_seed(0)))
    rendered(plots.attention_map(matrix, tokens=list("abcdef")), tmp_path / "attention.png")
    rendered(plots.attention_map(matrix[2:]), tmp_path / "rectangle.png")
    with pytest.raises(rh.InvalidValue, match=r"plots.attention_map: expected a 2-D tensor, got shape \(6,\)"):
        plots.attention_map(matrix[0])


def test_without_matplotlib_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import matplotlib.figure now raises ImportError
    with pytest.raises(ImportError, match=r"needs matplotlib, an optional extra: pip install recurrent_hooks\[plots\]"):
        plots.attention_map(torch.eye(3))
