"""How one table of operations becomes the methods of two clients, typed for each.

`operations.py` builds calls; a client only runs them. The descriptors here (`Operation`, `Listing`,
`Streaming`) sit on `Operations`, the base of both clients, and bind a builder to the client it is read from:
on a `SyncRunner` (`Client`) the method returns the result, on an `AsyncRunner` (`AsyncClient`) a coroutine of
it; a listing is an iterator or an async iterator, a stream an `EventStream` or an `AsyncEventStream`. The
builder's parameters (a `ParamSpec`) and docstring are the method's, so a type checker and `help()` see
`client.get_job(job_id: str) -> Job` and `await aclient.get_job(job_id: str) -> Job` from one definition.

Arguments are checked when the method is called (a bad spec raises InvalidArgument before anything is sent; for
the async client, when the coroutine is awaited); a listing's or stream's first request goes out when it is
first iterated.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, Generic, NoReturn, ParamSpec, TypeVar, overload

from .errors import SdkError
from .wire import Call, Paging, StreamCall

if TYPE_CHECKING:
    from .streaming import AsyncEventStream, EventStream

P = ParamSpec("P")
T = TypeVar("T")


class SyncRunner:
    """What `Client` implements: run a call, a listing, a stream; raise a failure (`_raise`: connection.py's,
    through the client's `failed`)."""

    def _raise(self, error: SdkError) -> NoReturn:
        raise error

    def _run(self, call: Call[T]) -> T:
        raise NotImplementedError

    def _pages(self, paging: Paging[T]) -> Iterator[T]:
        raise NotImplementedError

    def _stream(self, call: StreamCall[T]) -> EventStream[T]:
        raise NotImplementedError


class AsyncRunner:
    """What `AsyncClient` implements."""

    def _raise(self, error: SdkError) -> NoReturn:
        raise error

    async def _run(self, call: Call[T]) -> T:
        raise NotImplementedError

    def _pages(self, paging: Paging[T]) -> AsyncIterator[T]:
        raise NotImplementedError

    def _stream(self, call: StreamCall[T]) -> AsyncEventStream[T]:
        raise NotImplementedError


class _Descriptor(Generic[P, T]):
    def __init__(self, build: Callable[P, T]) -> None:
        self.build = build
        self.name = build.__name__
        self.__doc__ = build.__doc__

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self.name = name

    def _wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        method.__name__ = method.__qualname__ = self.name
        method.__doc__ = self.build.__doc__
        # help() and inspect.signature show the builder's parameters (what it returns is the method's own).
        method.__signature__ = self.signature  # type: ignore[attr-defined]
        return method

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.build).replace(return_annotation=inspect.Signature.empty)


class Operation(_Descriptor[P, Call[T]]):
    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Operation[P, T]: ...
    @overload
    def __get__(self, obj: SyncRunner, owner: type[Any]) -> Callable[P, T]: ...
    @overload
    def __get__(self, obj: AsyncRunner, owner: type[Any]) -> Callable[P, Coroutine[Any, Any, T]]: ...

    def __get__(self, obj: SyncRunner | AsyncRunner | None, owner: type[Any]) -> Any:
        if obj is None:
            return self
        return self._wrap(_coroutine(obj, self.build) if isinstance(obj, AsyncRunner) else _function(obj, self.build))


def _built(runner: SyncRunner | AsyncRunner, build: Callable[..., T], args: Any, kwargs: Any) -> T:
    """The builder's call; an argument it refuses (InvalidArgument, before anything is sent) is raised as the
    client raises every failure."""
    try:
        return build(*args, **kwargs)
    except SdkError as error:
        runner._raise(error)


def _function(runner: SyncRunner, build: Callable[..., Call[Any]]) -> Callable[..., Any]:
    def method(*args: Any, **kwargs: Any) -> Any:
        return runner._run(_built(runner, build, args, kwargs))

    return method


def _coroutine(runner: AsyncRunner, build: Callable[..., Call[Any]]) -> Callable[..., Any]:
    async def method(*args: Any, **kwargs: Any) -> Any:
        return await runner._run(_built(runner, build, args, kwargs))

    return method


class Listing(_Descriptor[P, Paging[T]]):
    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Listing[P, T]: ...
    @overload
    def __get__(self, obj: SyncRunner, owner: type[Any]) -> Callable[P, Iterator[T]]: ...
    @overload
    def __get__(self, obj: AsyncRunner, owner: type[Any]) -> Callable[P, AsyncIterator[T]]: ...

    def __get__(self, obj: SyncRunner | AsyncRunner | None, owner: type[Any]) -> Any:
        if obj is None:
            return self
        build, pages = self.build, obj._pages

        def method(*args: Any, **kwargs: Any) -> Any:
            return pages(_built(obj, build, args, kwargs))

        return self._wrap(method)


class Streaming(_Descriptor[P, StreamCall[T]]):
    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Streaming[P, T]: ...
    @overload
    def __get__(self, obj: SyncRunner, owner: type[Any]) -> Callable[P, EventStream[T]]: ...
    @overload
    def __get__(self, obj: AsyncRunner, owner: type[Any]) -> Callable[P, AsyncEventStream[T]]: ...

    def __get__(self, obj: SyncRunner | AsyncRunner | None, owner: type[Any]) -> Any:
        if obj is None:
            return self
        build, stream = self.build, obj._stream

        def method(*args: Any, **kwargs: Any) -> Any:
            return stream(_built(obj, build, args, kwargs))

        return self._wrap(method)
