"""Records and messages that come from strangers, declared once and decoded strictly.

A wire type is a frozen dataclass: its annotations say what each field holds, `typing.Annotated`
adds the bounds (`Bound`, `Length`, `Check`), and an optional `check()` method states what relates
fields to each other. `decode_as` turns an untrusted map (a frame header, a DHT value) into the
type, or raises `WireError` naming the field and what it must be; `encode` turns one back into a map.

Decoding coerces nothing: an int field takes an int (not True, "3" or 3.9), a float field an int or
a finite float, a str field a str within its length, an Enum field one of its values, a tuple
field a list or tuple of exactly its items' types. Keys a type does not name are ignored (a newer
sender may add fields); a field without a default must be present. Each type's field decoders are
built once, on its first use: a step's header decodes and encodes in less time than hand-written
checks and `dataclasses.asdict` took together (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from p2pfusion.errors import RequestError

T = TypeVar("T")

MAX_PEER_KEY_BYTES = 800  # a peer's libp2p public key: an RSA-4096 one in libp2p's protobuf is about 550
MAX_PEER_SIG_BYTES = 512  # a signature by it (RSA-4096)


class WireError(RequestError):
    """An untrusted record or message does not hold what its type declares."""


@dataclass(frozen=True)
class Bound:
    """A number's inclusive range (None: unbounded that way)."""

    low: float | None = None
    high: float | None = None


@dataclass(frozen=True)
class Length:
    """How many characters, bytes or items a str, bytes, list or variable tuple holds."""

    high: int
    low: int = 0


@dataclass(frozen=True)
class Check:
    """A test of the value's content: `test(value)` must be true; `what` completes "must be ..."."""

    test: Callable[[Any], bool]
    what: str


Decoder = Callable[[Any, str], Any]
Encoder = Callable[[Any], Any]


def _fail(name: str, what: str) -> WireError:
    return WireError(f"field {name!r} must be {what}")


def _bounded(decoder: Decoder, bound: Bound) -> Decoder:
    low, high = bound.low, bound.high
    what = f"in {low if low is not None else '-inf'}..{high if high is not None else 'inf'}"

    def decode(value: Any, name: str) -> Any:
        value = decoder(value, name)
        if (low is not None and value < low) or (high is not None and value > high):
            raise _fail(name, what)
        return value

    return decode


def _sized(decoder: Decoder, length: Length) -> Decoder:
    def decode(value: Any, name: str) -> Any:
        value = decoder(value, name)
        if not length.low <= len(value) <= length.high:
            raise _fail(name, f"{length.low} to {length.high} long")
        return value

    return decode


def _checked(decoder: Decoder, check: Check) -> Decoder:
    def decode(value: Any, name: str) -> Any:
        value = decoder(value, name)
        if not check.test(value):
            raise _fail(name, check.what)
        return value

    return decode


def _int(value: Any, name: str) -> int:
    if type(value) is not int:
        raise _fail(name, "an integer")
    return value


def _float(value: Any, name: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise _fail(name, "a finite number")
    return float(value)


def _exactly(kind: type, what: str) -> Decoder:
    def decode(value: Any, name: str) -> Any:
        if type(value) is not kind:
            raise _fail(name, what)
        return value

    return decode


def _enum(*kinds: type[Enum]) -> Decoder:
    values = {member.value: member for kind in kinds for member in kind}
    what = "one of " + ", ".join(map(str, values))

    def decode(value: Any, name: str) -> Enum:
        try:
            return values[value]
        except (KeyError, TypeError):  # TypeError: an unhashable value (a list, a map)
            raise _fail(name, what) from None

    return decode


def _optional(inner: Decoder) -> Decoder:
    def decode(value: Any, name: str) -> Any:
        return None if value is None else inner(value, name)

    return decode


def _sequence(inner: Decoder, make: type) -> Decoder:
    def decode(value: Any, name: str) -> Any:
        if type(value) not in (list, tuple):
            raise _fail(name, "a list")
        return make(inner(item, name) for item in value)

    return decode


def _fixed(inners: list[Decoder]) -> Decoder:
    def decode(value: Any, name: str) -> tuple:
        if type(value) not in (list, tuple) or len(value) != len(inners):
            raise _fail(name, f"a list of {len(inners)} items")
        return tuple(inner(item, name) for inner, item in zip(inners, value))

    return decode


def _nested(kind: type) -> Decoder:
    def decode(value: Any, name: str) -> Any:
        return decode_as(kind, value, name)

    return decode


PLAIN = {int: _int, float: _float, bool: _exactly(bool, "true or false"), str: _exactly(str, "a string"),
         bytes: _exactly(bytes, "bytes")}


def _decoder(hint: Any) -> Decoder:
    """The decoder of a field annotated `hint`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        decoder = _decoder(args[0])
        for mark in args[1:]:
            if isinstance(mark, Bound):
                decoder = _bounded(decoder, mark)
            elif isinstance(mark, Length):
                decoder = _sized(decoder, mark)
            elif isinstance(mark, Check):
                decoder = _checked(decoder, mark)
        return decoder
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        if all(isinstance(a, type) and issubclass(a, Enum) for a in kept):
            decoder = _enum(*kept)
        elif len(kept) == 1:
            decoder = _decoder(kept[0])
        else:
            raise TypeError(f"a wire field may be X | None or a union of Enums, not {hint}")
        return decoder if len(kept) == len(args) else _optional(decoder)
    if origin is list:
        return _sequence(_decoder(args[0]), list)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _sequence(_decoder(args[0]), tuple)
        return _fixed([_decoder(a) for a in args])
    if isinstance(hint, type) and issubclass(hint, Enum):
        return _enum(hint)
    if dataclasses.is_dataclass(hint):
        return _nested(hint)
    if hint in PLAIN:
        return PLAIN[hint]
    raise TypeError(f"no wire decoder for {hint!r}")


def _encoder(hint: Any) -> Encoder | None:
    """How a field's value becomes plain data (None: it already is)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return _encoder(args[0])
    if origin in (typing.Union, types.UnionType):
        inner = _encoder(next(a for a in args if a is not type(None)))  # Enums of a union share theirs
        return None if inner is None else (lambda v: None if v is None else inner(v))
    if origin in (list, tuple):  # as lists: what msgpack reads back, and no serializer's tuple extension
        inners = [_encoder(a) for a in args if a is not Ellipsis]
        if all(i is None for i in inners):
            return None if origin is list else list
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return lambda v: [x if i is None else i(x) for i, x in zip(inners, v)]
        inner = inners[0] or (lambda x: x)
        return lambda v: [inner(x) for x in v]
    if isinstance(hint, type) and issubclass(hint, Enum):
        return lambda v: v.value
    if dataclasses.is_dataclass(hint):
        return encode
    return None


@dataclass(frozen=True)
class _Schema:
    fields: tuple[tuple[str, Decoder, bool], ...]  # (name, decoder, required)
    encoders: tuple[tuple[str, Encoder | None], ...]


_SCHEMAS: dict[type, _Schema] = {}


def _schema(kind: type) -> _Schema:
    schema = _SCHEMAS.get(kind)
    if schema is None:
        hints = typing.get_type_hints(kind, include_extras=True)
        fields = dataclasses.fields(kind)
        schema = _SCHEMAS[kind] = _Schema(
            tuple(
                (f.name, _decoder(hints[f.name]),
                 f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                for f in fields
            ),
            tuple((f.name, _encoder(hints[f.name])) for f in fields),
        )
    return schema


def decode_as(kind: type[T], raw: Any, where: str | None = None) -> T:
    """`raw` (an untrusted map) as a `kind`, or a WireError saying which field is wrong."""
    where = where or kind.__name__
    if type(raw) is not dict:
        raise WireError(f"{where} must be a map")
    values = {}
    for name, decoder, required in _schema(kind).fields:
        if name in raw:
            values[name] = decoder(raw[name], name)
        elif required:
            raise WireError(f"{where}: field {name!r} is missing")
    made = kind(**values)
    check = getattr(made, "check", None)
    if check is not None:
        check()
    return made


def encode(value: Any) -> dict[str, Any]:
    """A wire type's fields as plain data (what `decode_as` reads back)."""
    return {
        name: raw if encoder is None or raw is None else encoder(raw)
        for name, encoder in _schema(type(value)).encoders
        for raw in (getattr(value, name),)
    }
