"""A generation's text as its tokens arrive, for anything that streams it (the CLI, the Python API)."""

from __future__ import annotations


class TextPieces:
    """What each new token adds to the text. A token that ends inside a multi-byte character adds
    nothing yet: the character comes whole with a later token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        added, self.text = text[len(self.text):], text
        return added

    def keep(self, count: int) -> str:
        """Keep only the first `count` tokens (verification withdrew the rest); their text, as the
        pieces `add` gave for them."""
        tokens, self.tokens, self.text = self.tokens[:count], [], ""
        return "".join(self.add(token) for token in tokens)

    def rest(self) -> str:
        """What the text still lacks once the tokens end (an incomplete character, as it is)."""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        added, self.text = text[len(self.text):], text
        return added
