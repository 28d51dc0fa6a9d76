"""The user's handle on one mixer: `RecurrentMixer` (`mixer`: readings, hooks, writes, and the base class of the
kinds), the declaration a kind fills in (`kind.Kind`: class constants, and its adapter, `adapter.KindAdapter`: the
protocol the engine and the studies call as `kind.adapter`) and the checking of what users hand the library
(`arguments`: tokens, calls, keep). A handle is built with its request and never reached from
below: the tracker holds the kind and where the mixer is, not the handle."""
