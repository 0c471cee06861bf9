"""Every codec round-trips within its documented bound; hostile descriptions are clear errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pfusion.net import codecs as c
from p2pfusion.net.framing import BadTensor
from tests.frames import frame_bytes, parse, raw_frame

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
SPECIALS = [0.0, -0.0, 1e-30, 3e4, 7e4, 1e38, float("nan"), float("inf"), -float("inf")]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(FLOATS))
    shape = draw(st.lists(st.integers(0, 70), min_size=0, max_size=3))
    scale = draw(st.sampled_from([1e-3, 1.0, 100.0]))
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16)))) * scale).to(dtype)
    flat = x.view(-1)
    for value in draw(st.lists(st.sampled_from(SPECIALS), max_size=4)):
        if flat.numel():
            flat[draw(st.integers(0, flat.numel() - 1))] = value
    return x


def round_trip(x, codec, k=None):
    packed = c.pack(x, codec, k)
    return packed, c.unpack(packed.spec, packed.body())


def check_specials(x, y):
    """NaN and +-inf arrive as sent, and the result has the input's dtype and shape."""
    assert y.dtype == x.dtype and y.shape == x.shape
    bad = ~torch.isfinite(x)
    assert torch.equal(torch.isnan(y), torch.isnan(x))
    assert torch.equal(y[bad & ~torch.isnan(x)], x[bad & ~torch.isnan(x)])
    return ~bad


def eps(dtype):
    return torch.finfo(dtype).eps / 2  # unit round-off


@settings(max_examples=80, deadline=None)
@given(tensors(), st.sampled_from([c.Codec.NONE, c.Codec.FLOAT16, c.Codec.BFLOAT16, c.Codec.INT8]))
def test_dense_codecs_within_bound(x, codec):
    _, y = round_trip(x, codec)
    ok = check_specials(x, y)
    x64, y64 = x.double()[ok], y.double()[ok]
    err = (y64 - x64).abs()
    info = torch.finfo(x.dtype)
    rounding = eps(x.dtype) * y64.abs() + info.tiny * info.eps / 2  # the cast back to x's dtype rounds once more
    if codec == c.Codec.NONE:
        assert torch.equal(y.view(-1).view(torch.uint8), x.view(-1).view(torch.uint8))
    elif codec == c.Codec.FLOAT16:
        small = x64.abs() <= c.FLOAT16_MAX
        assert (err[small] <= 2**-11 * x64.abs()[small] + 2**-24 + rounding[small]).all()
        assert (y64[~small].abs() >= c.FLOAT16_MAX * (1 - eps(x.dtype))).all()
    elif codec == c.Codec.BFLOAT16:
        assert (err <= 2**-8 * x64.abs() + 2**-133 + rounding).all()
    else:
        flat = x.float().reshape(-1).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        outlier = flat.abs() > c.OUTLIER_RMS * flat.pow(2).mean().sqrt()
        quantized = flat.masked_fill(outlier, 0.0).double()
        block_max = torch.nn.functional.pad(quantized.abs(), (0, -flat.numel() % c.BLOCK)).view(-1, c.BLOCK).amax(1)
        bound = (block_max.repeat_interleave(c.BLOCK)[: flat.numel()] / 254).masked_fill(outlier, 0.0)
        assert (err <= bound[ok.reshape(-1)] * (1 + 1e-5) + rounding).all()


@settings(max_examples=60, deadline=None)
@given(tensors(), st.floats(0.0, 1.0))
def test_topk_keeps_the_largest_exactly(x, density):
    k = max(int(density * x.numel()), c.min_topk(x.numel(), x.dtype))  # the fewest a frame may keep
    packed, y = round_trip(x, c.Codec.TOPK, int(density * x.numel()))
    index = c._view(packed.parts[0], 0, packed.parts[0].nbytes, torch.int32).long()
    assert index.numel() == k
    flat, out = x.reshape(-1), y.reshape(-1)
    kept = torch.zeros(flat.numel(), dtype=torch.bool)
    kept[index] = True
    assert torch.equal(out[kept].view(torch.int16 if x.dtype != torch.float32 else torch.int32),
                       flat[kept].view(torch.int16 if x.dtype != torch.float32 else torch.int32))
    assert (out[~kept] == 0).all()
    magnitude = flat.float().abs().nan_to_num(nan=float("inf"))
    if k and (~kept).any():
        assert magnitude[kept].min() >= magnitude[~kept].max()


def test_sparse_frames_of_large_tensors_still_decode():
    x = torch.randn(1, 1024, 1024)  # 4 MiB: past what a tiny frame may expand to
    for k in (0, 1):
        packed, y = round_trip(x, c.Codec.TOPK, k)
        assert packed.spec["k"] == c.min_topk(x.numel(), x.dtype) > 0
        assert (y != 0).sum() == packed.spec["k"]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(1, 6), st.floats(0.01, 0.5))
def test_error_feedback_loses_nothing_over_steps(n, steps, density):
    feedback = c.ErrorFeedback()
    inputs, received = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for step in range(steps):
        x = torch.randn(n, generator=torch.Generator().manual_seed(step))
        packed = feedback.pack(x, max(1, int(density * n)))
        inputs += x.double()
        received += c.unpack(packed.spec, packed.body()).double()
    torch.testing.assert_close(received + feedback.residual.double(), inputs, atol=1e-5, rtol=0)


def test_compressed_sizes():
    x = torch.randn(1, 128, 576)
    sizes = {codec: c.pack(x, codec, k=x.numel() // 10).nbytes for codec in c.Codec}
    assert sizes[c.Codec.NONE] == x.numel() * 4
    assert sizes[c.Codec.FLOAT16] == sizes[c.Codec.BFLOAT16] == x.numel() * 2
    assert sizes[c.Codec.NONE] / sizes[c.Codec.INT8] > 3.7
    assert sizes[c.Codec.TOPK] == (x.numel() // 10) * 8
    ids = torch.arange(10)
    assert c.pack(ids, c.Codec.INT8).spec["codec"] == "none"  # token ids are never compressed lossily


def frame(spec, body: bytes) -> bytes:
    return raw_frame({"kind": "step", "step": 7, "tensor": spec}, body)


@pytest.mark.parametrize("spec, body, message", [
    ({"codec": "zip", "dtype": "float32", "shape": [1], "parts": [4]}, bytes(4), "unknown codec"),
    ({"codec": "none", "dtype": "float32", "shape": [2], "parts": [4]}, bytes(4), "do not fit"),
    ({"codec": "none", "dtype": "float32", "shape": [True], "parts": [4]}, bytes(4), "shape"),
    ({"codec": "int8", "dtype": "float32", "shape": [4], "parts": [4, 4, 8, 8]}, bytes(24), "exception"),
    ({"codec": "int8", "dtype": "float32", "shape": [4], "parts": [4, 4, 8, 4]}, bytes(8) + b"\x7f" * 8 + bytes(4), "range"),
    ({"codec": "topk", "dtype": "float32", "shape": [4], "k": 9, "parts": [4, 4]}, bytes(8), "k must be"),
    ({"codec": "topk", "dtype": "float32", "shape": [4], "k": 1, "parts": [4, 4]}, b"\x09\x00\x00\x00" + bytes(4), "range"),
    ({"codec": "topk", "dtype": "float32", "shape": [1 << 28], "k": 1, "parts": [4, 4]}, bytes(8), "too large"),
    ({"codec": "int8", "dtype": "int64", "shape": [1], "parts": [1, 4, 0, 0]}, bytes(5), "does not apply"),
    ({"codec": "none", "dtype": "float32", "shape": [1], "parts": "x"}, bytes(4), "part sizes"),
    (["float32", [1]], bytes(4), "malformed"),
])
def test_hostile_descriptions_are_one_line_errors(spec, body, message):
    with pytest.raises(BadTensor, match=message) as info:
        parse(frame(spec, body))
    assert info.value.header["step"] == 7 and "\n" not in str(info.value)


def test_bare_tensor_frames_are_uncompressed():
    x = torch.randn(2, 3)
    header, y = parse(frame_bytes({"kind": "step"}, x))
    assert header == {"kind": "step"} and torch.equal(x, y)
