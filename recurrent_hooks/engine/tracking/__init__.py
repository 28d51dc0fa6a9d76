"""The per-call bookkeeping a handle owns: the tracker (`tracker.CallTracker`: the call counter, the running call's
record, what each kernel call wants, made from a `policy.Request`), the records a call leaves (`records`: `Call`,
`KernelCall`, `Memory`, `Forward`), a registered hook or write as it runs (`hooks`), what is tracked per thread
(`threads`) and the same bookkeeping inside a compiled graph (`compiled`: the custom ops a graph runs)."""
