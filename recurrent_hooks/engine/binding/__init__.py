"""Rebinding kernel names in transformers' modeling modules: the reference-counted undo stack that rebinds and
restores them (`rebinding`), the one rule that finds the pure-torch kernel behind a name and the releases the library
is tested on (`upstream`), and the registry of families with its lookups (`registry`; the rows themselves are
`recurrent_hooks/registry.py`'s)."""
