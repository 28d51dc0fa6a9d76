"""Figures of sweeps, state norms and attention maps, and top contexts as HTML: `recurrent_hooks.studies.plots`,
by its public name.

from recurrent_hooks import plots
fig = plots.sweep_heatmap(sweep)
"""

from .studies.plots import attention_map as attention_map
from .studies.plots import state_norms as state_norms
from .studies.plots import sweep_heatmap as sweep_heatmap
from .studies.plots import top_contexts_html as top_contexts_html

__all__ = ["sweep_heatmap", "state_norms", "attention_map", "top_contexts_html"]
