"""Old public names kept as deprecated aliases of new ones, for the packages that rename.

This module owns the one way a gpipe package keeps a renamed public name working for a
while: a module-level ``__getattr__`` (:func:`deprecated_aliases`) that gives the new object
under the old name, with a :class:`DeprecationWarning` naming both. It must not know which
names any package renamed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

__all__ = ["deprecated_aliases"]


def deprecated_aliases(
    module: str, renamed: Mapping[str, str], namespace: Mapping[str, object]
) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``module`` (its ``__name__``): each old name of
    ``renamed`` gives the object that the new name has in ``namespace`` (the module's
    ``globals()``), with a :class:`DeprecationWarning`; any other name raises
    :class:`AttributeError`, as a module does.

    Example:
        >>> import warnings
        >>> lookup = deprecated_aliases("pkg", {"old": "new"}, {"new": 42})
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     lookup("old"), str(seen[0].message)
        (42, 'pkg.old is deprecated, use pkg.new')
    """

    def __getattr__(name: str) -> object:
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is deprecated, use {module}.{new}", DeprecationWarning, stacklevel=2
        )
        return namespace[new]

    return __getattr__
