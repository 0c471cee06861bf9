"""A tiny random model with a tokenizer and a chat template, for tests of the text-level client (the
CLI, chat, the tokenizer property): one character per token, so text and tokens map one to one."""

from __future__ import annotations

import shutil
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from p2pfusion.models.source import ModelSource, resolve_model

SPECIALS = ["<unk>", "<s>", "<|im_end|>"]  # ids 0, 1, 2: LlamaConfig's default bos and eos are 1 and 2
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def char_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    chars += [chr(0xC0 + i) for i in range(vocab_size - len(SPECIALS) - len(chars))]  # every id decodes
    vocab = {token: i for i, token in enumerate(SPECIALS + chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>")
    fast.chat_template = TEMPLATE
    return fast


def with_chat_tokenizer(source: ModelSource, folder: Path) -> ModelSource:
    """A copy of a tiny model's folder with a character tokenizer and a chat template."""
    shutil.copytree(source.folder, folder)
    char_tokenizer(256).save_pretrained(folder)
    return resolve_model(str(folder))
