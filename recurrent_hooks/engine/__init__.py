"""The engine: what every kind shares, and nothing of any kind or study. Its rooms follow one watched forward, and
import one way, each from itself and the rooms above it in this list (tests/package/test_layout.py, `ROOMS`):

- `errors`, `tracing` (`compiling()`, the one place that asks whether torch.compile traces), `policy` (`Paths`,
  `Strategy` -- the one list of the paths a busy call can take -- `Choice`, `Policy`, `Request`: what a watch asks
  of a handle's calls);
- `declare/`: what a kind is written in (`kernels`: `Kernel`, `Role`, `Site`, `Segments`, the memory names;
  `memory_parts`; `loops`: the token loops' contract and toolkit; `effective`);
- `tracking/`: the per-call bookkeeping a handle owns (`tracker.CallTracker`, made from the handle's `Request`;
  `records`: `Call`, `KernelCall`, `Memory`, `Forward`; `hooks`; `threads`; `compiled`: the same inside a graph);
- `paths/`: how a busy call runs (`choose`, by the cost model of `costs` within the memory `budget`; one runner per
  path, `runners.RUNNERS`; `blocks`, `adjoint`, `backward`; `visitor`: what a path hands each token's memory to);
- `handle/`: the user's handle (`mixer.RecurrentMixer`, also the base class of the kinds; `kind.Kind`, the
  declaration a kind fills in; `adapter.KindAdapter`, the protocol the engine and the studies ask of a kind, as
  `kind.adapter`; `arguments`: checking what users hand the library);
- `binding/`: rebinding kernel names in transformers' modules (`rebinding`, the undo stack; `upstream`, the tested
  releases and the one rule that finds the pure-torch kernel behind a name; `registry`, the families' table);
- `dispatch/`: which forward a kernel call belongs to and what runs it (`tap`, the dispatcher bound in place of each
  kernel; `forwards`, the per-thread stack of running forwards; `takeover`, a study running a mixer's idle calls);
- the entry points: `attaching` (a handle's bindings, all or nothing), `watch` (`Watch`, `watch`), `standalone`
  (`register_state_hook`), `support` (`support`, `MixerSupport`, `route_kernels`).

The engine imports no kind (`recurrent_hooks.kinds`), no study (`recurrent_hooks.studies`) and not the registry's
rows (tests/package/test_layout.py checks it). Its modules are internal: the public names are in `recurrent_hooks` and
`recurrent_hooks.extend`; docs/architecture.md draws the rooms and traces one forward through them.
"""
