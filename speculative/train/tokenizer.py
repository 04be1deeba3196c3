"""Byte-level BPE tokenizer for the bundled target, with the chat and DFlash
special tokens and a ChatML chat template (the format Qwen models use)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|MASK|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, MASK)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chat_text(prompt: str, response: str | None = None) -> str:
    """A one-turn conversation in the template's format (the assistant turn left
    open when ``response`` is None)."""
    text = f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n"
    return text if response is None else f"{text}{response}{IM_END}\n"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts``; special tokens get the first ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers' __init__ is unannotated
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        bos_token=None,
        additional_special_tokens=[IM_START, MASK],
        chat_template=CHAT_TEMPLATE,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: Path) -> None:
    """Write the tokenizer (tokenizer.json, config, chat template) into ``path``."""
    tokenizer.save_pretrained(str(path))
