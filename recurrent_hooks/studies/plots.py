"""Figures for what the library measures: a patching sweep, state norms, an effective-attention map, top contexts.

    from recurrent_hooks import plots
    fig = plots.sweep_heatmap(sweep, tokens=["The", " cat", ...])   # layers x positions
    fig.savefig("sweep.png")

matplotlib is an optional extra (`pip install recurrent_hooks[plots]`), imported when a function runs;
`top_contexts_html` (an `rh.top_contexts` result as an HTML string) needs none.
Every other function returns a `matplotlib.figure.Figure` made without pyplot, so nothing is shown and no
global figure state is touched; pass `ax=` to draw into an existing Axes (its figure is returned).
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..engine.declare.memory_parts import parts_of
from ..engine.errors import InvalidValue

_INSTALL = "pip install recurrent_hooks[plots]"


def _axes(ax: Any, size: tuple[float, float]) -> tuple[Any, Any]:
    """(figure, axes): `ax`'s own, or a new pyplot-free Figure with one Axes."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(f"recurrent_hooks.plots needs matplotlib, an optional extra: {_INSTALL}") from error
    if ax is not None:
        return ax.figure, ax
    figure = Figure(figsize=size, layout="constrained")
    return figure, figure.subplots()


def _matrix(value: Any, where: str) -> Tensor:
    if not isinstance(value, Tensor) or value.dim() != 2:
        got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
        raise InvalidValue(f"{where}: expected a 2-D tensor, got {got}")
    return value.detach().to("cpu", torch.float64)


def _labels(tokens: Sequence[str] | None, positions: Sequence[int], where: str) -> list[str]:
    if tokens is None:
        return [str(p) for p in positions]
    tokens = list(tokens)
    if len(tokens) == len(positions):
        return [str(t) for t in tokens]
    if positions and len(tokens) > max(positions):
        return [str(tokens[p]) for p in positions]
    raise InvalidValue(
        f"{where}: expected one token string per position ({len(positions)}) or per prompt token, got {len(tokens)}"
    )


def _ticks(ax: Any, axis: str, labels: list[str], rotate: bool) -> None:
    step = max(1, len(labels) // 64)  # at most about 64 labels on an axis
    ticks = list(range(0, len(labels), step))
    if axis == "x":
        ax.set_xticks(ticks, [labels[i] for i in ticks], rotation=90 if rotate else 0, fontsize="small")
    else:
        ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize="small")


def sweep_heatmap(
    sweep: Any,
    tokens: Sequence[str] | None = None,
    *,
    normalized: bool = False,
    ax: Any = None,
    title: str | None = None,
    cmap: str = "RdBu_r",
) -> Any:
    """A `patching_sweep` result as a heatmap: recurrent layers (rows) x positions (columns).

    `sweep` is an `rh.Sweep` (or a 2-D tensor `[layers, positions]`); `tokens`, optional, labels the
    columns: one string per swept position, or one per prompt token. `normalized=True` plots
    `sweep.normalized()` (0: no effect, 1: the clean metric restored). The colour scale is centred on
    the corrupt baseline (or on 0 for a tensor).
    """
    where = "plots.sweep_heatmap"
    if isinstance(sweep, Tensor):
        values, layers, positions, centre = _matrix(sweep, where), None, None, 0.0
    elif hasattr(sweep, "values") and hasattr(sweep, "normalized"):
        values = _matrix(sweep.normalized() if normalized else sweep.values, where)
        layers, positions = sweep.layers, sweep.positions
        centre = 0.0 if normalized else float(sweep.corrupt)
    else:
        raise InvalidValue(f"{where}: expected an rh.Sweep or a 2-D tensor, got {type(sweep).__name__}")
    layers = list(layers) if layers is not None else list(range(values.shape[0]))
    positions = list(positions) if positions is not None else list(range(values.shape[1]))
    figure, ax = _axes(ax, (max(4.0, 0.22 * len(positions) + 2), max(2.0, 0.4 * len(layers) + 1.2)))
    span = float((values - centre).abs().max()) or 1.0
    image = ax.imshow(
        values.numpy(), aspect="auto", cmap=cmap, vmin=centre - span, vmax=centre + span, interpolation="nearest"
    )
    figure.colorbar(image, ax=ax, label="normalized metric" if normalized else "metric")
    _ticks(ax, "x", _labels(tokens, positions, where), rotate=tokens is not None)
    _ticks(ax, "y", [str(layer) for layer in layers], rotate=False)
    ax.set_xlabel("position patched after")
    ax.set_ylabel("layer")
    memory = getattr(sweep, "memory", None)  # an rh.Sweep's: "memory", "state" or "window"
    ax.set_title(title if title is not None else f"patching sweep{f' ({memory})' if isinstance(memory, str) else ''}")
    return figure


def state_norms(watch: Any, *, row: int = 0, ax: Any = None, title: str | None = None) -> Any:
    """The norm of each recurrent layer's state after every token of every call, one line per layer.

    `watch` is a `rh.Watch` (or a list of its mixers) whose block kept states (`keep=("states",)`). Calls
    follow each other on the x axis (the prompt's tokens, then one point per decode step), with a dotted
    line where each call after the first begins. `row` picks the batch row. A state of several parts
    (`STATE_TYPE`, e.g. RWKV's `WkvState`) is measured as all its parts together.
    """
    where = "plots.state_norms"
    mixers = list(getattr(watch, "mixers", watch)) if not isinstance(watch, Tensor) else None
    if not mixers:
        raise InvalidValue(f"{where}: expected a rh.Watch (or its mixers) that kept states, got {type(watch).__name__}")
    figure, ax = _axes(ax, (7.0, 3.2))
    starts: list[int] = []
    for mixer in mixers:
        norms, starts = [], []
        for call in mixer.calls:
            parts = [part for _, part in parts_of(call.states)]  # raises rh.Unavailable when states were not kept
            batch = parts[0].shape[0]
            if not -batch <= row < batch:
                raise InvalidValue(f"{where}: expected row in 0..{batch - 1}, got row={row}")
            starts.append(sum(len(n) for n in norms))
            per_part = [part[row].detach().flatten(1).double().norm(dim=1).cpu() for part in parts]  # seq each
            # a state of several parts (`STATE_TYPE`): the norm of all its parts together
            norms.append(per_part[0] if len(per_part) == 1 else torch.stack(per_part).norm(dim=0))
        ax.plot(torch.cat(norms).numpy(), label=f"layer {mixer.layer}")
    for start in starts[1:]:
        ax.axvline(start - 0.5, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("token (prompt, then decode steps)" if len(starts) > 1 else "token")
    ax.set_ylabel("state norm")
    ax.legend(fontsize="small")
    ax.set_title(title if title is not None else "recurrent state norm")
    return figure


def attention_map(
    matrix: Tensor,
    tokens: Sequence[str] | None = None,
    *,
    ax: Any = None,
    title: str | None = None,
    cmap: str = "viridis",
) -> Any:
    """An effective-attention map: `matrix[t, s]`, how much token t reads from token s, as an image.

    `matrix` is any 2-D tensor `[targets, sources]`; `tokens`, optional, labels both axes (one string
    per token; a non-square map labels the sources with the first ones and the targets with the last).
    """
    where = "plots.attention_map"
    values = _matrix(matrix, where)
    targets, sources = values.shape
    figure, ax = _axes(ax, (max(3.5, 0.2 * sources + 2), max(3.0, 0.2 * targets + 1.5)))
    image = ax.imshow(values.numpy(), aspect="auto", cmap=cmap, interpolation="nearest")
    figure.colorbar(image, ax=ax)
    if tokens is not None:
        tokens = list(tokens)
        if len(tokens) < max(targets, sources):
            raise InvalidValue(f"{where}: expected at least {max(targets, sources)} token strings, got {len(tokens)}")
        _ticks(ax, "x", [str(t) for t in tokens[:sources]], rotate=True)
        _ticks(ax, "y", [str(t) for t in tokens[len(tokens) - targets :]], rotate=False)
    ax.set_xlabel("source token s")
    ax.set_ylabel("target token t")
    ax.set_title(title if title is not None else "effective attention")
    return figure


def top_contexts_html(
    result: Any,
    values: Sequence[Sequence[float]] | None = None,
    *,
    scale: float | None = None,
    title: str | None = None,
) -> str:
    """An `rh.top_contexts` result as HTML (a string; no matplotlib): one line per context, each context token a
    `<span class="token">` shaded by its value (red above 0, blue below, the strongest at `scale`, by default the
    largest magnitude shown), with the value in its `data-value` and `title` (shown on hover); the ranked token is
    also `class="token top"`, in bold.

        html = plots.top_contexts_html(top)                  # shaded by fn at each context token (top[i].values)
        pathlib.Path("top.html").write_text(html)            # or IPython.display.HTML(html) in a notebook

    `values`: other values to shade by, one list per context of one per context token (default: the result's own).
    """
    import html

    where = "plots.top_contexts_html"
    contexts = list(getattr(result, "contexts", []))
    if not hasattr(result, "contexts"):
        raise InvalidValue(f"{where}: expected an rh.TopContexts (rh.top_contexts's result), got {type(result)}")
    shades = [list(c.values) for c in contexts] if values is None else [list(v) for v in values]
    if len(shades) != len(contexts) or any(len(v) != len(c.tokens) for v, c in zip(shades, contexts)):
        expected = [len(c.tokens) for c in contexts]
        got = [len(v) for v in shades]
        raise InvalidValue(f"{where}: expected values= one per context token ({expected} per context), got {got}")
    if scale is None:
        scale = max((abs(float(v)) for row in shades for v in row), default=0.0) or 1.0
    elif not scale > 0:
        raise InvalidValue(f"{where}: expected scale= a number > 0, got {scale!r}")
    lines = []
    for context, row in zip(contexts, shades):
        words = [str(t) for t in context.tokens] if context.strings is None else list(context.strings)
        spans = []
        for i, (word, value) in enumerate(zip(words, row)):
            value = float(value)
            alpha = min(abs(value) / scale, 1.0)
            colour = f"rgba(220,40,40,{alpha:.3f})" if value >= 0 else f"rgba(40,80,220,{alpha:.3f})"
            text = html.escape(word.replace("\n", "\\n"), quote=True)
            if context.strings is None:
                text += " "  # ids: a space after each
            top = " top" if i == context.center else ""
            weight = "font-weight:bold;text-decoration:underline;" if top else ""
            spans.append(
                f'<span class="token{top}" data-value="{value!r}" title="{value:.6g}"'
                f' style="background:{colour};{weight}white-space:pre">{text}</span>'
            )
        head = f"#{context.rank} {context.value:.4g} (doc {context.doc}, position {context.position})"
        before, after = ("&hellip; " if context.cut_before else ""), (" &hellip;" if context.cut_after else "")
        lines.append(
            f'<div class="context"><span class="head" style="color:#666;font-size:smaller">{html.escape(head)}</span> '
            f"{before}{''.join(spans)}{after}</div>"
        )
    heading = f"<h3>{html.escape(title)}</h3>" if title else ""
    return f'<div class="top-contexts" style="font-family:monospace;line-height:1.6">{heading}{"".join(lines)}</div>'
