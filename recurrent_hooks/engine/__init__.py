"""The engine: what every kind shares, and nothing of any kind or study.

- `watch` (`Watch`, `watch`, `register_state_hook`, `support`): the context managers a researcher types;
- `mixer` (`RecurrentMixer`): the user's handle on one mixer (its readings, hooks and writes), and the base class
  of the kinds; `kind` (`Kind`): the declaration a kind fills in, class constants and class adapters, which
  `RecurrentMixer` inherits; `call_state` (`CallState`, `Plan`): the per-call state a handle owns (the call
  counter, the running call's record, what each kernel call wants), driven by dispatch;
- `calls` (`Call`, `KernelCall`, `Memory`): the record of each call, and what was kept;
- `dispatch`: which mixer a kernel call belongs to, and how the call runs (the bound kernel, segments, blocks,
  the token loop); `strategies` and `blocks`: the path a busy call takes, by cost; `adjoint`: every state kept
  with gradients on, chunk-wise forward and the kind's adjoint recurrence backward;
- `patching`: the undo stack that rebinds kernel names and restores them; `threads`: per-thread state;
- `compiled`: torch.compile support (the custom ops a graph runs, and `TracedCallState`, the per-call state's
  interface as tracing implements it);
- `families` (`Family`, `MixerClass`, `Unsupported`, `REGISTRY`): the row type of a family and the registry that
  holds the rows `recurrent_hooks/registry.py` adds, with lookups built lazily (so rows added at run time count);
- `kernels` (`Kernel`, `Role`, `Site`, `Segments`), `parts`, `loops`, `arguments`, `errors`: the declarations and
  helpers the kinds build on.

The engine imports no kind (`recurrent_hooks.kinds`), no study (`recurrent_hooks.studies`) and not the registry
(tests/test_layout.py checks it). Its modules are internal: the public names are in `recurrent_hooks`.
"""
