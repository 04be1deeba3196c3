"""How much context a generation needs: the one rule every engine, the API
and offline decoding apply.

A round verifies a whole block past the last committed token, so a request
needs room for its prompt, its new tokens and one block beyond them.
"""

from __future__ import annotations


class ContextLengthExceeded(ValueError):
    """A prompt plus the tokens asked for do not fit the model's context."""


def max_new_tokens_within(context_length: int, prompt_tokens: int, block_size: int) -> int:
    """The most new tokens a prompt of ``prompt_tokens`` may ask for."""
    return context_length - prompt_tokens - block_size


def check_context(context_length: int, prompt_tokens: int, max_new_tokens: int, block_size: int) -> None:
    """Raise ``ContextLengthExceeded`` unless the generation fits."""
    if max_new_tokens > max_new_tokens_within(context_length, prompt_tokens, block_size):
        raise ContextLengthExceeded(
            f"this model's maximum context length is {context_length} tokens; the prompt has {prompt_tokens} "
            f"tokens and {max_new_tokens} were requested for the completion (plus {block_size} for a draft block)"
        )
