"""Frames round-trip every supported tensor exactly, and reject truncated or hostile bytes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pfusion.errors import RequestError
from p2pfusion.net import messages as m
from p2pfusion.net.framing import FrameError
from tests.frames import frame_bytes, parse


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64]),
    st.lists(st.integers(0, 5), min_size=0, max_size=4),
    st.sampled_from([0.0, 1.5, float("nan"), float("inf"), -float("inf")]),
)
def test_tensor_round_trip(dtype, shape, fill):
    tensor = torch.randn(shape).to(dtype) if dtype != torch.int64 else torch.randint(-9, 9, shape)
    if tensor.numel() and dtype.is_floating_point:
        tensor.view(-1)[0] = fill
    header, out = parse(frame_bytes({"kind": "step", "step": 3}, tensor))
    assert header == {"kind": "step", "step": 3}
    assert out.dtype == dtype and out.shape == tensor.shape
    # compare bytes, so NaN payloads and signed zeros must survive too
    assert torch.equal(out.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_truncated_frames_are_errors():
    data = frame_bytes({"kind": "step", "step": 1}, torch.ones(2, 3))
    for cut in (3, 12, len(data) - 1):
        with pytest.raises(FrameError):
            parse(data[:cut])
    with pytest.raises(EOFError):
        parse(b"")


def test_lying_tensor_description_is_an_error():
    data = frame_bytes({"kind": "step", "step": 1}, torch.ones(2, 3))
    with pytest.raises(RequestError, match="do not fit"):
        parse(data.replace(b"\x92\x02\x03", b"\x92\x02\x04"))  # shape [2, 3] -> [2, 4]
    with pytest.raises(RequestError, match="dtype"):
        parse(data.replace(b"float32", b"float99"))


def test_messages_validate_fields():
    assert m.from_header(m.to_header(m.Open("s", 8, [m.Hop("p", ["127.0.0.1:5"], 0, 4)]))) == m.Open("s", 8, [m.Hop("p", ["127.0.0.1:5"], 0, 4)])
    for bad in ({"kind": "nope"}, {"kind": "open", "session_id": 1, "length": 8, "route": []},
                {"kind": "step", "step": "x"}, {"kind": "open", "session_id": "s", "length": 8, "route": [5]}):
        with pytest.raises(RequestError):
            m.from_header(bad)
