"""Renamed keywords: a public keyword that got a new name keeps its old one for a
while, accepted with a :class:`DeprecationWarning` that names the new one
(CONTRIBUTING.md, "Names").

Imports nothing from geocomm: any module may use it.
"""

from __future__ import annotations

import argparse
import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["DeprecatedOption", "renamed_keywords"]


def renamed_keywords(**renames: str) -> Callable[[F], F]:
    """Decorate a function (or ``__init__``) whose keywords ``old`` were renamed to
    ``new`` (``renamed_keywords(old="new")``): a call with ``old=`` warns and passes
    the value as ``new=``; a call with both is a :class:`TypeError`."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(
                            f"{function.__qualname__}() got both {old}= and {new}= (use {new}=)"
                        )
                    warnings.warn(
                        f"{function.__qualname__}(): {old}= is deprecated, use {new}=",
                        DeprecationWarning,
                        stacklevel=2,
                    )
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        wrapper.__renamed_keywords__ = dict(renames)  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


class DeprecatedOption(argparse.Action):
    """An argparse action for the old name of a renamed option (pass
    ``help=argparse.SUPPRESS`` and the new option's ``dest``): stores the value and
    warns that the new option replaces it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        new = next(
            (
                a.option_strings[0]
                for a in parser._actions
                if a.dest == self.dest and a is not self and a.option_strings
            ),
            self.dest,
        )
        warnings.warn(f"{option_string} is deprecated, use {new}", DeprecationWarning, stacklevel=2)
        setattr(namespace, self.dest, values)
