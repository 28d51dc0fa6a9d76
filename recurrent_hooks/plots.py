"""Figures of sweeps, state norms and attention maps: `recurrent_hooks.studies.plots`, by its public name.

from recurrent_hooks import plots
fig = plots.sweep_heatmap(sweep)
"""

from .studies.plots import attention_map as attention_map
from .studies.plots import state_norms as state_norms
from .studies.plots import sweep_heatmap as sweep_heatmap

__all__ = ["sweep_heatmap", "state_norms", "attention_map"]
