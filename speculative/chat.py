"""Chat prompts and stop tokens from a transformers tokenizer, in one place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, with the
    assistant turn opened."""
    # tokenize=False: the template renders to one string.
    text = cast(str, tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False))
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def user_prompt_ids(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    """One single-turn user conversation per text."""
    return [chat_ids(tokenizer, [{"role": "user", "content": text}]) for text in texts]


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """End of turn and end of text both end a generation."""
    return tuple(sorted({i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}))
