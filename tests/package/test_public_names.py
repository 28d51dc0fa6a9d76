"""The public names: every name in `recurrent_hooks.__all__` is importable; `recurrent_hooks.extend` exports the
declarations and every kind of the registry with its state type, no name but FAMILIES is in both `__all__`, and the
kinds that `recurrent_hooks` holds too are the extension namespace's objects. (The former names, which warn, are in
test_names.py.)"""

import recurrent_hooks as rh


def test_public_names_are_importable():
    for name in rh.__all__:
        assert getattr(rh, name) is not None, name


def test_the_extension_namespace_has_the_declarations_and_the_kinds_are_in_both():
    import recurrent_hooks.extend as extend

    for name in extend.__all__:
        assert getattr(extend, name) is not None, name
    assert not set(extend.__all__) & set(rh.__all__) - {"FAMILIES"}, "a name is public twice"
    for name in ("RecurrentMixer", "Kernel"):
        assert getattr(rh, name) is getattr(extend, name), name
    # every kind of the registry (and its state type) is in the extension namespace, by an explicit import that type
    # checkers see; recurrent_hooks keeps the kinds code written before that namespace finds there
    kinds = {cls.kind for row in rh.FAMILIES.values() for cls in row.classes}
    for value in kinds | {kind.STATE_TYPE for kind in kinds if kind.STATE_TYPE is not None}:
        name, module = value.__name__, value.__module__.removeprefix("recurrent_hooks")
        line = f"`from {module} import {name} as {name}`"
        assert getattr(extend, name, None) is value and name in extend.__all__, (
            f"recurrent_hooks.extend does not export {name}: add {line} and {name!r} to its __all__"
        )
    for name in ("GatedDeltaNet", "KimiDeltaAttention", "SelectiveScan", "PerHeadSelectiveScan", "Mamba2StateSpace"):
        assert getattr(rh, name) is getattr(extend, name), name
    # the kinds' former names (StateSpace, LinearAttention) warn: tests/package/test_names.py
