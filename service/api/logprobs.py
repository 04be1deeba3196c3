"""OpenAI's ``logprobs`` objects from the engine's per-token log-probabilities
(``speculative.logprobs``: the target's own, raw, whichever path committed the
token). A token is named by its text alone (``decode([id])``) and that text's
UTF-8 bytes, as vLLM names them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from speculative.logprobs import TokenLogprob


def chat_logprobs(scores: Sequence[TokenLogprob], tokenizer: Any) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs``: ``{"content": [...]}``."""

    def named(token: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**named(s.token, s.logprob), "top_logprobs": [named(t, logprob) for t, logprob in s.top]} for s in scores
        ]
    }


def completion_logprobs(
    scores: Sequence[TokenLogprob], tokenizer: Any, offset: int, unscored_first: int | None = None
) -> dict[str, Any]:
    """A completion choice's (or chunk's) legacy ``logprobs``; ``offset``: the
    length of the choice's text before these tokens (``text_offset`` counts on
    from it). ``unscored_first``: an echoed prompt's first token, which nothing
    scores (``null`` log-probability and top tokens, as OpenAI's). Each
    ``top_logprobs`` entry names the chosen token too, so it holds up to
    ``logprobs`` + 1 tokens, as OpenAI documents."""
    tokens = [tokenizer.decode([s.token]) for s in scores]
    token_logprobs: list[float | None] = [s.logprob for s in scores]
    top: list[dict[str, float] | None] = [
        {text: s.logprob, **{tokenizer.decode([t]): logprob for t, logprob in s.top}}
        for text, s in zip(tokens, scores, strict=True)
    ]
    if unscored_first is not None:
        tokens = [tokenizer.decode([unscored_first]), *tokens]
        token_logprobs, top = [None, *token_logprobs], [None, *top]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
