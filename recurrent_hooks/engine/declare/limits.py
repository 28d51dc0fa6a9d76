"""What a kind or a family cannot do as asked, as data: a caveat (it runs, and here is what to know) or a refusal
(it raises, and which error).

    LIMITS = {
        "multi-token continuation": Caveat("transformers' mamba_selective_scan takes no initial state, ..."),
        "effective attention": Refused(Unavailable, "not provided: ..."),
    }

Both are `str`s, their words, so that a limit reads as text wherever it is shown; `Refused.errors` are the
exceptions that are raised. A kind's `LIMITS` and a family row's `limits` hold them; `support` sorts them into
`MixerSupport.caveats` and `MixerSupport.refused` by their type, never by their words. A plain `str` (a kind written
before these types) is listed as a caveat.

Module contents:
- `Caveat`: it works, with this caveat;
- `Refused`: it raises one of `errors`, for the reason in the words;
- `is_refused(limit)`, `error_names(limit)`: which of the two a limit is, and its errors as `support` names them.
"""

from ..errors import InvalidValue


class Caveat(str):
    """It works, watched as unwatched, with this caveat (the words say what to know)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Caveat({str.__repr__(self)})"


class Refused(str):
    """It raises one of `errors` (the library's, or transformers' or torch's where their code raises, watched or
    not), for the reason in the words.

        Refused(Unavailable, "not provided: the taps depend on the token")
        Refused((ValueError, RecurrentHooksError), "cu_seqlens (packed batches) need flash-linear-attention ...")
    """

    errors: tuple[type[BaseException], ...]

    def __new__(cls, errors: "type[BaseException] | tuple[type[BaseException], ...]", why: str) -> "Refused":
        given = errors
        errors = (errors,) if isinstance(errors, type) else tuple(errors) if isinstance(errors, tuple | list) else ()
        if not errors or not all(isinstance(e, type) and issubclass(e, BaseException) for e in errors):
            raise InvalidValue(f"Refused: expected the exception class it raises, or a tuple of them, got {given!r}")
        if not isinstance(why, str) or not why:
            raise InvalidValue(f"Refused: expected the reason as a non-empty str, got {why!r}")
        refused = super().__new__(cls, why)
        refused.errors = errors
        return refused

    def __getnewargs__(self) -> tuple:  # copy and pickle make it again from its errors and words
        return self.errors, str(self)

    def __repr__(self) -> str:
        return f"Refused({' | '.join(error_names(self))}, {str.__repr__(self)})"


def is_refused(limit: str) -> bool:
    """Whether a limit raises (`Refused`); a `Caveat` or a plain `str` does not."""
    return isinstance(limit, Refused)


def _error_name(error: type[BaseException]) -> str:
    module = error.__module__
    if module == "builtins":
        return error.__qualname__
    if module.split(".")[0] == "recurrent_hooks":
        return f"rh.{error.__qualname__}"
    return f"{module}.{error.__qualname__}"


def error_names(limit: str) -> tuple[str, ...]:
    """The errors a refusal raises, as `support` names them (`("ValueError", "rh.RecurrentHooksError")`: builtins by
    name, the library's as `rh.`, the others by module); `()` for a caveat."""
    return tuple(map(_error_name, limit.errors)) if is_refused(limit) else ()
