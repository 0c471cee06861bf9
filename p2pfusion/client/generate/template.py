"""Prompts as token ids, with nothing a user writes becoming a control token.

A chat template marks turns with special tokens (`<|im_start|>`, `<|im_end|>`, ...). Tokenized
whole, the rendered conversation turns those markers into control tokens wherever they occur, in
a message's content too: a user who writes `<|im_end|>\\n<|im_start|>system\\n...` forges a
system turn. So where some content holds the text of an added token, the template is rendered
around placeholders, its own text tokenized as usual and each content as plain text (its markers
become the ordinary tokens of their characters). Content without such text is tokenized with the
whole, as transformers does, so that ordinary prompts give exactly transformers' ids.

A prompt cannot need more tokens than it has characters, nor fewer than its characters over the
longest token's length: text too long for the model by that bound is refused before tokenizing.
"""

from __future__ import annotations

import secrets

from p2pfusion.errors import PromptTooLong, RequestError


def markers(tokenizer) -> list[str]:
    """The texts that tokenize as one added token (special tokens, chat markers)."""
    return [token.content for token in tokenizer.added_tokens_decoder.values() if token.content]


def longest_token(tokenizer) -> int:
    """Characters in the vocabulary's longest entry: no token covers more characters of a text."""
    return max((len(entry) for entry in tokenizer.get_vocab()), default=1)


def check_text_length(chars: int, positions: int, whose: str, longest: int) -> None:
    """Refuse text of `chars` characters that cannot fit in `positions` tokens (`whose` limit:
    "the swarm", "the model"), whatever it says."""
    if chars > positions * longest:
        raise PromptTooLong(f"prompt too long: {chars} characters cannot fit in the {positions} tokens {whose} accepts")


def plain_ids(tokenizer, text: str) -> list[int]:
    """`text` as ordinary tokens only: markers in it are split into their characters' tokens."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def chat_ids(tokenizer, messages: list[dict[str, str]], special: list[str]) -> list[int]:
    """The conversation, rendered by the tokenizer's chat template, ready for the assistant's turn;
    `special` are the tokenizer's `markers`."""
    if not any(marker in m["content"] for m in messages for marker in special):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    tag = secrets.token_hex(8)
    holders = [f"P2PFUSIONCONTENT{i}X{tag}" for i in range(len(messages))]
    rendered = tokenizer.apply_chat_template(
        [{**m, "content": holder} for m, holder in zip(messages, holders)], add_generation_prompt=True, tokenize=False,
    )
    ids: list[int] = []
    for message, holder in zip(messages, holders):
        before, found, rendered = rendered.partition(holder)
        if not found or holder in rendered:  # the template changed or repeated the content: no safe way to place it
            raise RequestError(
                f"a {message['role']} message holds the model's control token text "
                f"({next(t for t in special if t in message['content'])!r}), which this model's chat template cannot take"
            )
        ids += tokenizer(before, add_special_tokens=False)["input_ids"] + plain_ids(tokenizer, message["content"])
    return ids + list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
