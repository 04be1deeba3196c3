"""Log-probabilities of generated tokens, as OpenAI's ``logprobs`` reports them.

Every emitted token was scored by the target in the verify forward that
committed it: a committed path's slot s holds the target's distribution after
the exact prefix up to s, which is the one plain decoding would compute for
the token after it. So the log-probabilities of speculative decoding's output
are the target's own, whichever path or block produced it. They are the raw
model's (``log_softmax`` of the logits, before temperature, top-k / top-p and
penalties), as vLLM reports by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the ``k`` most likely tokens' (``top``, most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """For ``tokens[j]`` scored by ``logits[j]`` ([n, V], the target's logits
    after the prefix before it): its log-probability and the ``top`` best."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    best = logprobs.topk(top, dim=-1) if top else None
    return [
        TokenLogprob(
            token,
            value,
            tuple(zip(best.indices[j].tolist(), best.values[j].tolist(), strict=True)) if best is not None else (),
        )
        for j, (token, value) in enumerate(zip(tokens, chosen, strict=True))
    ]
