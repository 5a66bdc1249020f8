"""Skippable layers: a generator ``forward`` that stashes and pops skip tensors by name."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterable
from types import GeneratorType
from typing import Any, ClassVar

from torch import Tensor, nn

from ._namespace import DEFAULT_NAMESPACE, Namespace, SkipKey
from ._tracker import current_skip_tracker

__all__ = ["Pop", "Skippable", "Stash", "pop", "skippable", "stash"]


class Stash:
    """The command ``yield stash(name, tensor)`` hands to the skippable layer's driver.

    Made by :func:`stash`; public as a type, for a typed generator ``forward``:
    ``Generator[Stash | Pop, Tensor | None, Tensor]``.
    """

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Tensor | None) -> None:
        self.name = name
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"stash({self.name!r}, ...)"


class Pop:
    """The command ``yield pop(name)`` hands to the skippable layer's driver.

    Made by :func:`pop`; public as a type, like :class:`Stash`.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"pop({self.name!r})"


def stash(name: str, tensor: Tensor | None) -> Stash:
    """The command to stash a skip tensor, yielded from a skippable ``forward``.

    Args:
        name: the skip name, declared in ``@skippable(stash=[...])``.
        tensor: the tensor to pass to the layer that pops ``name``, or ``None`` for a
            skip connection that does not apply to this input.

    Raises:
        TypeError: ``name`` is not a string or ``tensor`` is neither a tensor nor None.

    Example:
        >>> @skippable(stash=["skip"])
        ... class Keep(nn.Module):
        ...     def forward(self, input):
        ...         yield stash("skip", input)
        ...         return input * 2
    """
    if not isinstance(name, str):
        raise TypeError(f"skip name must be a string (name: {name!r})")
    if tensor is not None and not isinstance(tensor, Tensor):
        raise TypeError(
            f"stash takes a tensor or None (name: {name!r}, tensor: {type(tensor).__name__})"
        )
    return Stash(name, tensor)


def pop(name: str) -> Pop:
    """The command to pop a skip tensor: ``tensor = yield pop(name)``.

    The ``yield`` evaluates to the tensor (or ``None``) stashed under ``name`` by an
    earlier layer.

    Raises:
        TypeError: ``name`` is not a string.

    Example:
        >>> @skippable(pop=["skip"])
        ... class Add(nn.Module):
        ...     def forward(self, input):
        ...         skip = yield pop("skip")
        ...         return input + skip
    """
    if not isinstance(name, str):
        raise TypeError(f"skip name must be a string (name: {name!r})")
    return Pop(name)


class Skippable(nn.Module):
    """The base of every class made by :func:`skippable`.

    ``isinstance(layer, Skippable)`` tells a skippable layer. The class attributes
    :attr:`stash_names` and :attr:`pop_names` list the declared names;
    :meth:`isolate` moves some of them into a :class:`Namespace`.
    """

    #: The names this class declares it stashes, in declaration order.
    stash_names: ClassVar[tuple[str, ...]] = ()
    #: The names this class declares it pops, in declaration order.
    pop_names: ClassVar[tuple[str, ...]] = ()
    # The user's generator forward (nn.Module's "missing forward" error until decorated).
    _generator_forward: ClassVar[Callable[..., Any]] = nn.Module.forward

    _skip_namespaces: dict[str, Namespace]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Set first, so that the decorated class's __init__ may already call isolate().
        self.__dict__["_skip_namespaces"] = {}
        super().__init__(*args, **kwargs)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Every class that defines a generator forward (the decorated class, or a subclass
        # of it) gets a driver of its own as the forward that nn.Module calls, so that
        # ``yield from super().forward(x)`` reaches the parent's generator.
        forward = cls.__dict__.get("forward")
        if forward is not None and not getattr(forward, "_skippable_driver", False):
            cls._generator_forward = forward
            cls.forward = _driver(forward)  # type: ignore[method-assign]

    def isolate(self, ns: Namespace, *, only: Iterable[str] | None = None) -> Skippable:
        """Move this layer's skip names (all, or those in ``only``) into ``ns``.

        In one sequential module a skip name may be stashed and popped once per
        namespace, so layers made from one class can be used several times, each pair in
        its own namespace.

        Args:
            ns: the namespace.

        Keyword Args:
            only: the names to isolate (default: every name this class declares).

        Returns:
            This layer, so calls chain.

        Raises:
            TypeError: ``ns`` is not a :class:`Namespace`, or ``only`` is a string.
            ValueError: ``only`` names a skip this class does not declare.

        Example:
            >>> @skippable(stash=["a", "b"])
            ... class Two(nn.Module):
            ...     def forward(self, x):
            ...         yield stash("a", x)
            ...         yield stash("b", x)
            ...         return x
            >>> ns_a, ns_b = Namespace(), Namespace()
            >>> layer = Two().isolate(ns_a, only=["a"]).isolate(ns_b, only=["b"])
            >>> layer.namespace_of("a") == ns_a, layer.namespace_of("b") == ns_b
            (True, True)
        """
        if not isinstance(ns, Namespace):
            raise TypeError(f"ns must be a Namespace (ns: {type(ns).__name__})")
        declared = (*self.stash_names, *self.pop_names)
        if only is None:
            names = list(declared)
        else:
            if isinstance(only, str):
                raise TypeError(f"only must be a list of skip names, not a string (only: {only!r})")
            names = list(only)
            unknown = [name for name in names if name not in declared]
            if unknown:
                raise ValueError(
                    f"only names skips that {type(self).__name__} does not declare "
                    f"(only: {names}, declared: {list(declared)})"
                )
        for name in names:
            self._skip_namespaces[name] = ns
        return self

    def namespace_of(self, name: str) -> Namespace:
        """The namespace of the skip ``name`` in this layer."""
        return self._skip_namespaces.get(name, DEFAULT_NAMESPACE)

    def stash_keys(self) -> list[SkipKey]:
        """``(namespace, name)`` of every skip this layer stashes."""
        return [(self.namespace_of(name), name) for name in self.stash_names]

    def pop_keys(self) -> list[SkipKey]:
        """``(namespace, name)`` of every skip this layer pops."""
        return [(self.namespace_of(name), name) for name in self.pop_names]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Drive the generator ``forward`` of the decorated class.

        Each ``yield stash(name, tensor)`` and ``yield pop(name)`` is served by the
        current skip tracker (see :func:`~gpipe_skip.use_skip_tracker`).

        Raises:
            RuntimeError: the generator yields a name the class does not declare, yields
                one twice, or returns without stashing or popping every declared name.
            TypeError: the generator yields something else than a stash or pop command.
        """
        return _drive_forward(self, type(self)._generator_forward, args, kwargs)

    def _drive(self, generator: Generator[Any, Any, Any]) -> Any:
        tracker = current_skip_tracker()
        stashed: set[str] = set()
        popped: set[str] = set()
        value: Tensor | None = None
        try:
            while True:
                try:
                    command = generator.send(value)
                except StopIteration as stop:
                    output = stop.value
                    break
                value = None
                if isinstance(command, Stash):
                    self._check_declared(command.name, "stash", self.stash_names, stashed)
                    tracker.stash((self.namespace_of(command.name), command.name), command.tensor)
                elif isinstance(command, Pop):
                    self._check_declared(command.name, "pop", self.pop_names, popped)
                    try:
                        value = tracker.pop((self.namespace_of(command.name), command.name))
                    except LookupError as error:
                        raise LookupError(f"{type(self).__name__}: {error}") from None
                else:
                    raise TypeError(
                        f"the forward of {type(self).__name__} yielded "
                        f"{type(command).__name__}; a skippable forward yields only "
                        "stash(name, tensor) and pop(name)"
                    )
        finally:
            generator.close()
        self._check_all_done(stashed, popped)
        return output

    def _check_declared(
        self, name: str, verb: str, declared: tuple[str, ...], done: set[str]
    ) -> None:
        cls = type(self).__name__
        if name not in declared:
            raise RuntimeError(
                f"the forward of {cls} yielded {verb}({name!r}) but {cls} does not declare "
                f"it (@skippable({verb}={list(declared)}))"
            )
        if name in done:
            raise RuntimeError(
                f"the forward of {cls} yielded {verb}({name!r}) twice; "
                f"each declared skip is {verb}ped once per call"
            )
        done.add(name)

    def _check_all_done(self, stashed: set[str], popped: set[str]) -> None:
        missing = [f"stash({n!r})" for n in self.stash_names if n not in stashed]
        missing += [f"pop({n!r})" for n in self.pop_names if n not in popped]
        if missing:
            raise RuntimeError(
                f"the forward of {type(self).__name__} returned without yielding "
                f"{', '.join(missing)}; every declared skip must be stashed and popped on "
                "every call (stash None for a skip that does not apply)"
            )


class _Driving(threading.local):
    """The skippable layers whose generator this thread is running."""

    def __init__(self) -> None:
        self.layers: set[int] = set()


_driving = _Driving()


def _drive_forward(
    layer: Skippable,
    generator_forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Call ``generator_forward`` and drive its generator, unless ``layer`` is driven.

    Inside a running generator of ``layer`` (``yield from super().forward(x)`` in a
    subclass), the call returns the generator itself, for the outer driver to serve.
    """
    result = generator_forward(layer, *args, **kwargs)
    if id(layer) in _driving.layers:
        return result
    if not isinstance(result, GeneratorType):
        layer._check_all_done(set(), set())
        return result
    _driving.layers.add(id(layer))
    try:
        return layer._drive(result)
    finally:
        _driving.layers.discard(id(layer))


def _driver(generator_forward: Callable[..., Any]) -> Callable[..., Any]:
    """The ``forward`` of a skippable class whose generator forward is ``generator_forward``."""

    def forward(self: Skippable, *args: Any, **kwargs: Any) -> Any:
        return _drive_forward(self, generator_forward, args, kwargs)

    forward.__doc__ = Skippable.forward.__doc__
    forward.__qualname__ = getattr(generator_forward, "__qualname__", "forward")
    forward._skippable_driver = True  # type: ignore[attr-defined]
    return forward


def _names(value: object, argument: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(f"{argument} must be a list of skip names ({argument}: {value!r})")
    names = tuple(value)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"{argument} must contain only strings ({argument}: {list(names)})")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"{argument} names a skip twice ({argument}: {list(names)})")
    return names


def skippable(
    stash: Iterable[str] = (), pop: Iterable[str] = ()
) -> Callable[[type[nn.Module]], type[Skippable]]:
    """Make a module class whose generator ``forward`` stashes and pops skip tensors.

    The decorated class is a subclass of both the original class and
    :class:`Skippable`, with the same name, parameters and ``state_dict`` keys. Its
    ``forward`` is a generator: ``yield stash(name, tensor)`` keeps a tensor for a later
    layer, ``tensor = yield pop(name)`` takes one stashed by an earlier layer. Every
    declared name must be stashed (or popped) exactly once per call; stash ``None`` for a
    connection that does not apply to an input.

    It also works as a plain function, ``skippable(stash=["x"])(MyModule)``, which some
    type checkers understand better than a class decorator.

    Args:
        stash: the names this class stashes.
        pop: the names this class pops.

    Raises:
        TypeError: ``stash`` or ``pop`` is not a list of strings, or the decorated object is
            not an :class:`~torch.nn.Module` subclass (or is already skippable).
        ValueError: a name appears twice, or in both ``stash`` and ``pop``.

    Example:
        >>> @skippable(stash=["1to3"])
        ... class Layer1(nn.Module):
        ...     def forward(self, input):
        ...         yield stash("1to3", input)
        ...         return input + 1
        >>> @skippable(pop=["1to3"])
        ... class Layer3(nn.Module):
        ...     def forward(self, input):
        ...         skip = yield pop("1to3")
        ...         return input + skip
        >>> import torch
        >>> model = nn.Sequential(Layer1(), nn.Identity(), Layer3())
        >>> model(torch.zeros(2))
        tensor([1., 1.])
    """
    stash_names = _names(stash, "stash")
    pop_names = _names(pop, "pop")
    both = [name for name in stash_names if name in pop_names]
    if both:
        raise ValueError(
            f"a skip name cannot be both stashed and popped by one class "
            f"(stash: {list(stash_names)}, pop: {list(pop_names)})"
        )

    def decorate(cls: type[nn.Module]) -> type[Skippable]:
        if not isinstance(cls, type) or not issubclass(cls, nn.Module):
            raise TypeError(f"skippable decorates nn.Module subclasses (cls: {cls!r})")
        if issubclass(cls, Skippable):
            raise TypeError(
                f"{cls.__name__} is already skippable; declare all its names in one "
                "@skippable(stash=..., pop=...)"
            )
        namespace = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "stash_names": stash_names,
            "pop_names": pop_names,
            "forward": cls.forward,  # the generator; __init_subclass__ puts a driver in front
        }
        return type(cls.__name__, (Skippable, cls), namespace)

    return decorate
