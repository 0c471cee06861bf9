"""The screened greedy head (float16 row by row, bfloat16 for many rows) gives exactly the float32
head's token, or defers to it."""

import asyncio

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import AutoModelForCausalLM, Gemma2Config

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.generate import screen as screening
from p2pfusion.client.generate.screen import ScreenedHead, final_norm, screened_head
from tests.conftest import COMMON, reference_model


def _full_argmax(weight: torch.Tensor, x: torch.Tensor) -> int:
    return int(nn.functional.linear(x, weight).argmax())


@settings(max_examples=200, deadline=None)
@given(
    vocab=st.integers(2, 300),
    hidden=st.integers(1, 96),
    near=st.integers(0, 40),  # rows made to nearly tie with the best one
    gap=st.sampled_from([0.0, 1e-7, 1e-5, 1e-3, 1e-2, 1e-1]),
    scale=st.sampled_from([1e-6, 1e-2, 1.0, 30.0, 1e3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_screened_token_is_the_float32_argmax_or_none(vocab, hidden, near, gap, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=generator) * 0.1
    x = torch.randn(hidden, generator=generator) * scale
    best = int((weight @ x).argmax())
    for row in torch.randint(0, vocab, (near,), generator=generator).tolist():
        if row != best:  # the same row, nudged along x: its logit ends `gap` (relative) away
            weight[row] = weight[best] * (1 - gap * torch.rand(1, generator=generator))
    token = ScreenedHead.of(weight).next_token(x)
    assert token is None or token == _full_argmax(weight, x)


@settings(max_examples=100, deadline=None)
@given(
    vocab=st.integers(2, 300),
    hidden=st.integers(1, 96),
    rows=st.integers(4, 12),
    near=st.integers(0, 40),
    gap=st.sampled_from([0.0, 1e-7, 1e-5, 1e-3, 1e-2, 1e-1]),
    scale=st.sampled_from([1e-6, 1e-2, 1.0, 30.0, 1e3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_many_rows_screened_in_bfloat16_give_the_float32_argmax_or_none(vocab, hidden, rows, near, gap, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=generator) * 0.1
    x = torch.randn(rows, hidden, generator=generator) * scale
    best = int((weight @ x[0]).argmax())
    for row in torch.randint(0, vocab, (near,), generator=generator).tolist():
        if row != best:  # rows nudged to nearly tie with the first input's best one
            weight[row] = weight[best] * (1 - gap * torch.rand(1, generator=generator))
    tokens = ScreenedHead.of(weight).next_tokens(x, bfloat16=True)
    assert all(token is None or token == _full_argmax(weight, row) for token, row in zip(tokens, x))


def test_rounding_that_reverses_the_order_in_bfloat16_still_gives_the_float32_token():
    half, ulp = 5, 2.0 ** -7  # bfloat16's spacing just above 1
    weight = torch.zeros(3, 2 * half)
    weight[0, :half] = 1 + 0.49 * ulp
    weight[1, half:] = 1 + 0.51 * ulp
    weight[2] = 0.5
    x = torch.cat([torch.ones(half), torch.full((half,), 1 - ulp / 2)]).expand(4, -1)
    screened = nn.functional.linear(x.bfloat16(), weight.bfloat16()).float()
    assert screened[0, 1] >= screened[0, 0] and _full_argmax(weight, x[0]) == 0
    assert ScreenedHead.of(weight).next_tokens(x, bfloat16=True) == [0] * 4


def test_a_bfloat16_kernel_that_does_not_sum_in_float32_is_not_trusted():
    """The check that guards the bfloat16 bound accepts the rounded exact products and rejects a
    kernel that rounds its running sum to bfloat16 (whatever this machine's own kernel does)."""
    generator = torch.Generator().manual_seed(0)
    screen = ScreenedHead.of(torch.randn(500, 576, generator=generator))
    screen.brain = screen.weight.bfloat16()
    low = torch.randn(4, 576, generator=generator).bfloat16()
    exact = (low.double() @ screen.brain.double().T).bfloat16()
    assert screen._sums_in_float32(low, exact)
    running = torch.zeros(4, 500, dtype=torch.bfloat16)
    for i in range(576):  # each product added to a bfloat16 sum
        running = running + low[:, i:i + 1] * screen.brain[:, i]
    assert not screen._sums_in_float32(low, running)
    wrong = ScreenedHead.of(screen.weight)
    wrong.sound[4] = False  # as if that kernel had been found here: many rows go in float32
    x = torch.randn(4, 576, generator=generator)
    assert wrong.next_tokens(x, bfloat16=True) == [_full_argmax(screen.weight, row) for row in x] and wrong.brain is None


def test_rounding_that_reverses_the_order_in_float16_still_gives_the_float32_token():
    """Row 0 rounds down in float16 and row 1 rounds up, on inputs weighted so that float16 ranks
    row 1 first while float32 ranks row 0 first: the screen must keep row 0 as a candidate."""
    half, ulp = 5, 2.0 ** -10  # float16's spacing just above 1
    weight = torch.zeros(3, 2 * half)
    weight[0, :half] = 1 + 0.49 * ulp
    weight[1, half:] = 1 + 0.51 * ulp
    weight[2] = 0.5
    x = torch.cat([torch.ones(half), torch.full((half,), 1 - ulp / 2)])
    screened = nn.functional.linear(x.half(), weight.half()).float()
    assert screened[1] > screened[0] and _full_argmax(weight, x) == 0
    assert ScreenedHead.of(weight).next_token(x) == 0


def test_exact_ties_and_inputs_float16_cannot_hold_go_to_the_full_head():
    weight = torch.randn(50, 16, generator=torch.Generator().manual_seed(0))
    weight[7] = weight[3]
    x = weight[3].clone()  # rows 3 and 7 share the best logit
    screen = ScreenedHead.of(weight)
    assert screen.next_token(x) is None
    other = weight[5] * 4  # a row of random weights need not be its own best match: ask the full head
    assert screen.next_tokens(torch.stack([x, other])) == [None, _full_argmax(weight, other)]  # a tie only the full head settles
    assert screen.next_token(torch.full((16,), 1e5)) is None
    assert screen.next_token(torch.full((16,), float("nan"))) is None


def test_many_near_ties_are_settled_by_their_own_float32_logits_and_too_many_by_the_full_head(monkeypatch):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(2000, 64, generator=generator) * 0.1
    x = torch.randn(8, 64, generator=generator)
    best = int((weight @ x[0]).argmax())
    for row in range(0, 2000, 4):  # 500 rows within bfloat16's reach of the best, 1e-3 below it in float32
        if row != best:
            weight[row] = weight[best] * (1 - 1e-3 * (1 + torch.rand(1, generator=generator)))
    head = ScreenedHead.of(weight)
    tokens = head.next_tokens(x, bfloat16=True)
    assert tokens[0] == best  # hundreds of candidates, each one's float32 logit computed
    assert all(token is None or token == _full_argmax(weight, row) for token, row in zip(tokens, x))
    monkeypatch.setattr(screening, "MAX_CANDIDATES", 100)
    assert head.next_tokens(x, bfloat16=True)[0] is None


def test_a_near_tie_is_judged_by_its_own_products_not_by_the_norms():
    # an input along one axis: sum|w_i x_i| is far below |w| |x|, so a gap under the norms' bound
    # is still too wide for any float32 summation order to close
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(50, 256, generator=generator) * 0.1
    x = torch.zeros(2, 256)
    x[:, 0] = 30.0
    weight[7, 0], weight[9, 0] = 1.0, 1.0 - 3.3e-4  # logits 30 and 30 - 0.01
    weight[9, 1:] = 5.0  # a row of large norm: the norms' bound (0.074) exceeds the gap, the products' (0.0018) does not
    screen = ScreenedHead.of(weight)
    assert screen.next_tokens(x) == [7, 7]
    weight[9, 0] = 1.0 - 1e-5  # a gap of 3e-4, within the products' own bound: only the full head can tell
    assert ScreenedHead.of(weight).next_tokens(x) == [None, None]


def test_screen_decides_almost_every_token_of_the_default_model_and_matches_transformers(default_model):
    """At every position of sampled text (varied contexts), the client's greedy token is
    transformers' own greedy choice, and the screen decides it on its own nearly always."""
    local = reference_model(default_model)
    client = RemoteCausalLM.build(default_model)
    ids = torch.tensor([client.encode("Tell me about the history of tea.", chat=True)])
    inputs = []  # what the final norm gets: the last peer's output, as the client receives it
    hook = local.model.norm.register_forward_hook(lambda _m, args, _out: inputs.append(args[0][:, -1:]))
    torch.manual_seed(0)
    with torch.no_grad():
        local.generate(ids, max_new_tokens=60, do_sample=True)
        hook.remove()
        expected = [int(local.lm_head(local.model.norm(hidden))[0, -1].argmax()) for hidden in inputs]

    async def one_by_one():
        return [await client.next_token(hidden, 0.0, None) for hidden in inputs]

    async def all_at_once():  # as many sessions asking together: one float32 product for all rows
        return list(await asyncio.gather(*(client.next_token(hidden, 0.0, None) for hidden in inputs)))

    assert asyncio.run(one_by_one()) == expected
    assert asyncio.run(all_at_once()) == expected
    screen = screened_head(client.head)
    decided = sum(screen.next_token(client.head.model.norm(hidden)[0, -1]) is not None for hidden in inputs)
    assert decided >= 0.9 * len(inputs)
    norm = final_norm(client.head)  # the norm module alone, where it is exactly the base model's forward
    assert norm is client.head.model.norm
    rows = torch.cat(inputs)
    assert torch.equal(norm(rows), client.head.base_model(inputs_embeds=rows).last_hidden_state)


def test_heads_that_are_not_a_plain_linear_map_are_not_screened():
    torch.manual_seed(0)
    capped = AutoModelForCausalLM.from_config(Gemma2Config(**COMMON, head_dim=16, final_logit_softcapping=0.5))
    assert screened_head(capped) is None
    plain = AutoModelForCausalLM.from_config(Gemma2Config(**COMMON, head_dim=16, final_logit_softcapping=None))
    assert screened_head(plain) is not None
    plain.lm_head = nn.Linear(COMMON["hidden_size"], COMMON["vocab_size"], bias=True)
    assert screened_head(plain) is None
