"""The per-link codec choice, as a pure function: no network."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pfusion.net.compression import (
    AUTO,
    GREEDY_SAFE,
    MIN_DENSITY,
    Codec,
    CodecChoice,
    LinkSpeed,
    Purpose,
    choose_codec,
    parse_compression,
    transfer_seconds,
)

MBIT = 1e6 / 8
LOOPBACK = LinkSpeed(rtt=2e-4, bytes_per_second=6e8)
LAN_1G = LinkSpeed(rtt=5e-4, bytes_per_second=1000 * MBIT)
HOME_100M = LinkSpeed(rtt=0.02, bytes_per_second=100 * MBIT)
HOME_10M = LinkSpeed(rtt=0.04, bytes_per_second=10 * MBIT)
ONE_TOKEN, PREFILL, BATCH = 576 * 4, 128 * 576 * 4, 4 * 128 * 576 * 4


def test_fast_links_send_raw_and_slow_links_compress():
    for payload in (ONE_TOKEN, PREFILL, BATCH):
        assert choose_codec(LOOPBACK, payload).codec == Codec.NONE
        assert choose_codec(None, payload, Purpose.TRAINING).codec == Codec.NONE  # unmeasured: lossless
    assert choose_codec(HOME_100M, BATCH).codec == Codec.FLOAT16
    assert choose_codec(HOME_100M, ONE_TOKEN).codec == Codec.NONE  # would save 0.1 ms: not worth an error
    assert choose_codec(HOME_10M, ONE_TOKEN).codec == Codec.FLOAT16  # saves 0.9 ms a hop
    assert choose_codec(HOME_10M, PREFILL).codec == Codec.FLOAT16
    assert choose_codec(HOME_10M, BATCH, Purpose.TRAINING).codec == Codec.INT8
    assert choose_codec(HOME_100M, BATCH, Purpose.TRAINING).codec == Codec.INT8


@given(st.sampled_from([LOOPBACK, LAN_1G, HOME_100M, HOME_10M]), st.integers(0, 1 << 24), st.floats(1e-3, 10))
def test_inference_never_takes_a_codec_that_changes_greedy_tokens(link, payload, budget):
    assert choose_codec(link, payload, Purpose.INFERENCE, budget=budget).codec in GREEDY_SAFE


@given(st.sampled_from([LOOPBACK, LAN_1G, HOME_100M, HOME_10M]), st.integers(1, 1 << 24))
def test_a_lossy_choice_always_saves_time(link, payload):
    choice = choose_codec(link, payload, Purpose.TRAINING)
    if choice.codec != Codec.NONE:
        assert transfer_seconds(choice.codec, payload, link) < transfer_seconds(Codec.NONE, payload, link)


def test_topk_only_on_links_too_slow_for_the_budget():
    budget = 0.2  # seconds this step may spend on the link
    assert choose_codec(HOME_100M, BATCH, Purpose.TRAINING, budget=budget).codec == Codec.INT8  # int8 fits
    choice = choose_codec(HOME_10M, BATCH, Purpose.TRAINING, budget=budget)
    assert choice.codec == Codec.TOPK
    entries = BATCH // 4
    assert MIN_DENSITY * entries <= choice.k < entries
    # k is what the link carries within the budget: a tighter budget or a slower link keeps fewer
    slower = LinkSpeed(0.04, 5 * MBIT)
    assert choose_codec(slower, BATCH, Purpose.TRAINING, budget=budget).k <= choice.k
    assert choose_codec(HOME_10M, BATCH, Purpose.TRAINING, budget=0.15).k <= choice.k
    assert choose_codec(HOME_10M, BATCH, Purpose.TRAINING, budget=0.5).codec == Codec.INT8  # fits again
    # never below the density where training starts to suffer
    assert choose_codec(LinkSpeed(1.0, 1000), BATCH, Purpose.TRAINING, budget=0.01).k >= MIN_DENSITY * entries


def test_forced_codec_wins():
    assert choose_codec(LOOPBACK, BATCH, forced=Codec.INT8) == CodecChoice(Codec.INT8)
    assert choose_codec(HOME_10M, BATCH, forced=Codec.NONE) == CodecChoice(Codec.NONE)
    assert choose_codec(None, 4000, forced=Codec.TOPK) == CodecChoice(Codec.TOPK, 100)


def test_parse_compression():
    assert parse_compression("auto") is AUTO and parse_compression("int8") is Codec.INT8
    with pytest.raises(ValueError, match="choose from auto, none, float16"):
        parse_compression("zstd")


def test_training_compresses_only_what_the_step_would_notice():
    """int8 saves a batch 6 ms on a gigabit link, which a hop computing for 0.5 s does not notice
    (only the gradients' precision would); on a 100 Mbit/s link it saves 70 ms, worth having."""
    gigabit = LinkSpeed(rtt=2e-4, bytes_per_second=125e6)
    assert choose_codec(gigabit, BATCH, Purpose.TRAINING).codec != Codec.NONE  # no step time known
    assert choose_codec(gigabit, BATCH, Purpose.TRAINING, budget=0.5).codec == Codec.NONE
    assert choose_codec(HOME_100M, BATCH, Purpose.TRAINING, budget=0.5).codec != Codec.NONE
