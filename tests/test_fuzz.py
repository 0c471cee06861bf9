"""A short fuzzing run of the wire (scripts/fuzz_frames.py's targets and checks, with hypothesis
choosing the inputs): frames, every message kind and every codec's decode end in a result or one
expected one-line refusal, quickly, within their limits. The script runs 10^5 inputs with atheris."""

import importlib.util
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pfusion.net.framing import FrameError
from tests.frames import raw_frame

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_frames.py"


def _load():
    spec = importlib.util.spec_from_file_location("fuzz_frames", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fuzz = _load()


class HypothesisDraws(fuzz.Draws):
    def __init__(self, data):
        self.data = data

    def int(self, low: int, high: int) -> int:
        return self.data.draw(st.integers(low, high))

    def bytes(self, most: int) -> bytes:
        return self.data.draw(st.binary(max_size=most))


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzzed_frames_messages_and_tensors(data):
    fuzz.one_input(HypothesisDraws(data))


def test_known_hostile_inputs():
    """Inputs the fuzzer found, kept: a list as a frame's kind, a zero-size tensor whose other
    dimensions overflow int64, and a top-k frame declaring 2**29 values."""
    with pytest.raises(FrameError, match="carries no body"):
        fuzz.check_frame(raw_frame({"kind": ["step"]}, bytes(4)))
    for spec, body in [
        ({"codec": "none", "dtype": "float32", "shape": [0, 1 << 40, 1 << 40], "parts": [0]}, b""),
        ({"codec": "topk", "dtype": "float32", "shape": [1 << 29], "k": 1 << 8, "parts": [1024, 1024]}, bytes(2048)),
    ]:
        with pytest.raises(fuzz.codecs.CodecError):
            fuzz.check_codec(spec, body)
    with pytest.raises(fuzz.RequestError, match="kind"):
        fuzz.check_header({"kind": ["step"]})
