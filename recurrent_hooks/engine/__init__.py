"""The engine: what every kind shares, and nothing of any kind or study.

- `watch` (`Watch`, `watch`): the `with` block a researcher types; `standalone` (`register_state_hook`): a hook
  without one; `support` (`support`, `MixerSupport`, `route_kernels`): what a model's mixers offer, and
  process-wide rebinding; `attaching` (`attach_handle`): a handle's bindings, taken all or nothing;
- `policy` (`Paths`, `Strategy`, `Choice`, `Policy`, `Request`): the public policy, the paths (listed once, in
  `Strategy`'s docstring) and what a watch asks of a handle's calls;
- `mixer` (`RecurrentMixer`): the user's handle on one mixer (its readings, hooks and writes), and the base class
  of the kinds; `kind` (`Kind`): the declaration a kind fills in, class constants and class adapters, which
  `RecurrentMixer` inherits; `tracker` (`CallTracker`, `Plan`): the per-call bookkeeping a handle owns (the call
  counter, the running call's record, what each kernel call wants), made with the handle's `Request` and driven by
  dispatch;
- `hooks` (`Hook`): a registered state hook or write, as the handle's tracker runs it;
- `calls` (`Call`, `KernelCall`, `Memory`, `Forward`): the record of each call, what was kept, and what a forward is;
- `running`: the per-thread stack of running mixer forwards (which forward a kernel call belongs to);
- `dispatch`: the module tap and the dispatcher bound in place of each kernel: nothing wanted runs the bound
  kernel, a busy call its path's runner; `choose`: the path a busy call takes, from `costs` (the cost model and
  its calibrations, `costs.json`) within `memory` (the memory budget); `busy`: one runner per path (`RUNNERS`),
  with `blocks` and `adjoint` (every state kept with gradients on: chunk-wise forward, the kind's adjoint
  recurrence backward); `taking` (`Taker`): what a busy call keeps and hands over per memory;
- `effective` (`EffectiveAttention`): the effective-attention result the kinds build;
- `patching`: the undo stack that rebinds kernel names and restores them; `threads`: per-thread state;
- `compiled`: torch.compile support (the custom ops a graph runs, and `TracedCallTracker`, the tracker's
  interface as tracing implements it); `tracing.compiling()`: the one place that asks whether torch.compile traces;
- `families` (`Family`, `MixerClass`, `Unsupported`, `REGISTRY`): the row type of a family and the registry that
  holds the rows `recurrent_hooks/registry.py` adds, with lookups built lazily (so rows added at run time count);
- `kernels` (`Kernel`, `Role`, `Site`, `Segments`, `state_shape`), `parts`, `loops`, `arguments`, `errors`: the
  declarations and helpers the kinds build on; `strategies` only re-exports `costs.Shape` for the kinds.

The engine imports no kind (`recurrent_hooks.kinds`), no study (`recurrent_hooks.studies`) and not the registry
(tests/test_layout.py checks it). Its modules are internal: the public names are in `recurrent_hooks`.
"""
