"""Every message kind and record type, and a direct connection's hello, round-tripped and attacked
as strangers would send them.

Instances are drawn from each type's own declaration (its annotations and their bounds), sent the
way the wire sends them (msgpack in a frame header; hivemind's serializer for DHT values), and
must come back equal. Then each field in turn gets a value of the wrong kind (True or "3" for an
int, NaN for a float, a number for a string, a name no Enum has, ...), and decoding must refuse it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum

import pytest
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pfusion.dht import records as r
from p2pfusion.dht.validation import _decode
from p2pfusion.errors import RequestError
from p2pfusion.net import messages as m
from p2pfusion.net import run_messages as t
from p2pfusion.net.framing import _decode_header, encode as frame
from p2pfusion.net.receipts import Evidence, Receipt, ReceiptCert
from p2pfusion.net.transport import Hello
from p2pfusion.net.wire import Bound, Check, Length, WireError, decode_as, encode
from tests.receipts import fault as signed_fault

MESSAGE_TYPES = sorted({*m.MESSAGES.values(), *t.MESSAGES.values()}, key=lambda cls: cls.kind)
RECORD_TYPES = [r.PeerRecord, r.UnreachableReport, r.FaultReport, r.ModelEntry]
ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
# strings whose content a Check constrains, drawn as that content
CONTENT = {
    r.PeerId: st.text(ALNUM, min_size=1, max_size=r.MAX_ID_LENGTH),
    r.ModelKey: st.text(ALNUM + "-_.", min_size=1, max_size=r.MAX_KEY_LENGTH),
    r.FormatName: st.sampled_from(["float32", "bfloat16", "int8", "int4"]),
    t.RunName: st.text(ALNUM + "-_.", min_size=1, max_size=t.MAX_RUN_NAME),
    t.StateKind: st.sampled_from(t.STATE_KINDS),
}


# types whose fields must agree with each other the way only signing makes them: real ones
_REPORTS = [signed_fault(), signed_fault("QmAccused")]
MADE = {
    r.FaultReport: st.sampled_from(_REPORTS),
    Evidence: st.sampled_from([report.evidence for report in _REPORTS]),
    Receipt: st.sampled_from([report.evidence.receipt for report in _REPORTS]),
    ReceiptCert: st.sampled_from([report.evidence.cert for report in _REPORTS]),
}


def _marks(hint) -> tuple[object, list]:
    if typing.get_origin(hint) is typing.Annotated:
        return typing.get_args(hint)[0], list(hint.__metadata__)
    return hint, []


def strategy(hint) -> st.SearchStrategy:
    """Values a field annotated `hint` may hold, within its bounds."""
    if hint in CONTENT:
        return CONTENT[hint]
    base, marks = _marks(hint)
    bound = next((mark for mark in marks if isinstance(mark, Bound)), Bound())
    length = next((mark for mark in marks if isinstance(mark, Length)), None)
    checks = [mark for mark in marks if isinstance(mark, Check)]
    # lists stay short; strings and bytes may fill their bound
    sizes = {} if length is None else {"min_size": length.low, "max_size": max(length.low, min(length.high, 4))}
    chars = {} if length is None else {"min_size": length.low, "max_size": min(length.high, 64)}
    origin, args = typing.get_origin(base), typing.get_args(base)
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        options = [st.sampled_from([member for kind in kept for member in kind])] if all(
            isinstance(a, type) and issubclass(a, Enum) for a in kept) else [strategy(kept[0])]
        return st.one_of(*options, st.none()) if len(kept) < len(args) else options[0]
    if origin is list:
        return st.lists(strategy(args[0]), **{"max_size": 3, **sizes})
    if origin is tuple and args[-1] is Ellipsis:
        return st.lists(strategy(args[0]), **{"max_size": 3, **sizes}).map(tuple)
    if origin is tuple:
        return st.tuples(*(strategy(a) for a in args))
    if isinstance(base, type) and issubclass(base, Enum):
        return st.sampled_from(list(base))
    if dataclasses.is_dataclass(base):
        return instances(base)
    if base is int:
        return st.integers(int(bound.low if bound.low is not None else -2**40), int(bound.high if bound.high is not None else 2**40))
    if base is float:
        low = bound.low if bound.low is not None else -1e12
        return st.floats(low, bound.high if bound.high is not None else 1e12, allow_nan=False)
    if base is bool:
        return st.booleans()
    if base is bytes:
        return st.binary(**{"max_size": 16, **chars})
    text = st.text(ALNUM + " -:/.", **{"max_size": 20, **chars})
    return text.filter(lambda value: all(c.test(value) for c in checks)) if checks else text


def _valid(value) -> bool:
    try:
        getattr(value, "check", lambda: None)()
        return True
    except WireError:
        return False


def instances(cls) -> st.SearchStrategy:
    if cls in MADE:
        return MADE[cls]
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: strategy(hints[f.name]) for f in dataclasses.fields(cls)}
    return st.builds(cls, **fields).filter(_valid)


def over_the_wire(header: dict) -> dict:
    """A header as the peer at the other end reads it."""
    _, packed, *_ = frame(header)
    return _decode_header(packed)


def through_the_dht(value: dict) -> dict:
    """A DHT value as another node's validator reads it."""
    return _decode(MSGPackSerializer.dumps(value))


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.kind)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_every_message_kind_round_trips(cls, data):
    table = m.MESSAGES if m.MESSAGES.get(cls.kind) is cls else t.MESSAGES
    message = data.draw(instances(cls))
    assert m.from_header(over_the_wire(m.to_header(message)), table) == message


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hello=instances(Hello))
def test_a_hello_round_trips(hello):
    assert decode_as(Hello, over_the_wire(encode(hello))) == hello


@pytest.mark.parametrize("cls", RECORD_TYPES, ids=lambda cls: cls.__name__)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_every_record_type_round_trips(cls, data):
    record = data.draw(instances(cls))
    value = through_the_dht(record.to_value())
    back = cls.from_value(record.key, value) if cls is r.ModelEntry else cls.from_value(value)
    assert back == record


def wrong_values(hint) -> list:
    """Values of the wrong kind for a field annotated `hint` (None is right for an optional one)."""
    base, _ = _marks(hint)
    origin, args = typing.get_origin(base), typing.get_args(base)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        kept = [a for a in args if a is not type(None)]
        base, _ = _marks(kept[0]) if len(kept) == 1 else (kept[0], [])
        origin = typing.get_origin(base)
    wrong = [] if optional else [None]
    if origin in (typing.Union, types.UnionType):  # a union of Enums
        return wrong + ["no-such-value", 3, [1]]
    if base is int:
        return wrong + [True, "3", 3.9, float("nan"), [3]]
    if base is float:
        return wrong + [float("nan"), float("inf"), "1.0", True, [1.0]]
    if base is bool:
        return wrong + [1, "true"]
    if base is str:
        return wrong + [3, b"text", ["text"], {"a": 1}]
    if base is bytes:
        return wrong + ["text", 3, [1, 2]]
    if isinstance(base, type) and issubclass(base, Enum):
        return wrong + ["no-such-value", 3, ["inference"]]
    if origin in (list, tuple):
        return wrong + ["x", 3, {"a": 1}]
    if dataclasses.is_dataclass(base):
        return wrong + ["x", 3, [1]]
    raise AssertionError(f"no wrong values for {hint}")


@pytest.mark.parametrize("cls", [*MESSAGE_TYPES, *RECORD_TYPES, Hello], ids=lambda cls: getattr(cls, "kind", cls.__name__))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_a_field_of_the_wrong_kind_is_refused(cls, data):
    good = encode(data.draw(instances(cls)))
    hints = typing.get_type_hints(cls, include_extras=True)
    for field in dataclasses.fields(cls):
        for bad in wrong_values(hints[field.name]):
            with pytest.raises(WireError, match=field.name):
                decode_as(cls, {**good, field.name: bad})


def test_no_coercion_of_what_looks_like_a_number():
    record = r.PeerRecord("m", "p", [], 0, 4, r.PeerState.ONLINE, 1.0, None, "cpu").to_value()
    for start in ("0", 0.0, False, 0.9):
        assert r.PeerRecord.from_value({**record, "start": start}) is None
    assert r.PeerRecord.from_value({**record, "network_rate": 1}).network_rate == 1.0  # an int is a number
    with pytest.raises(WireError, match="missing"):
        m.from_header({"kind": "step"})
    with pytest.raises(RequestError, match="unknown message kind"):
        m.from_header({"kind": ["step"]})
