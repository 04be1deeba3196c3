"""Per-row sampling parameters, logit warping and seeded per-row random draws.

The same warping (temperature, then top-k, then top-p) is applied to the
target's distribution p and to the draft's distribution q, as exact
speculative sampling requires. A row with temperature 0 is greedy: its
"distribution" is the one-hot of the argmax, which makes rejection sampling
reduce exactly to greedy verification for that row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speculative.grammar import Grammar

MIN_TEMPERATURE = 0.01
"""Smallest temperature above 0 (greedy): what vLLM clamps to; far smaller
ones overflow float32 (1e-45 turned logits into inf and probabilities into NaN)."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""Seeds ``torch.Generator.manual_seed`` accepts."""
REPETITION_PENALTY_RANGE = (0.01, 100.0)
"""Repetition penalties allowed (1: off); outside, penalised logits overflow."""
MAX_TOP_LOGPROBS = 20
"""Most likely tokens a generated token's log-probability may come with (OpenAI's bound)."""
LOGIT_BIAS_LIMIT = 100.0
"""A logit bias lies in [-100, 100] (OpenAI's bound: -100 bans a token, 100 all but forces it)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` means greedy; ``top_k == 0``,
    ``top_p == 1`` and ``min_p == 0`` disable those filters (``probabilities``);
    ``seed`` makes the row reproducible.
    Penalties (``speculative.penalties``): ``presence_penalty`` and
    ``frequency_penalty`` in [-2, 2] (0: off), ``repetition_penalty`` in
    ``REPETITION_PENALTY_RANGE`` (1: off). The bounds are what the engine
    computes safely; the API schema states the same ones. ``min_tokens``: the
    row's first ``min_tokens`` generated tokens are never one of
    ``suppressed`` (its stop tokens), in the target's and the draft's
    distribution alike, so speculation stays exact. ``logprobs``: also report,
    for each generated token, its log-probability under the target and the
    ``logprobs`` most likely tokens' (``speculative.logprobs``; None: off).
    ``prompt_logprobs``: the same for each prompt token after the first (an
    echoed completion's; None: off). ``logit_bias``: (token id, bias) pairs
    added to the row's logits before penalties and warping (``bias_logits``),
    in the target's and the draft's distribution alike; reported
    log-probabilities stay the model's own, as OpenAI's do. ``grammar``: the
    row's output stays within it (``speculative.grammar``; structured output)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    suppressed: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if self.grammar is not None and self.min_tokens:
            # A finished grammar allows only the end of text, which min_tokens would mask too.
            raise ValueError("a grammar and min_tokens cannot be combined")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token twice")
        for token, bias in self.logit_bias:
            if token < 0 or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {token}: {bias}")
        for name, top in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be in [{low}, {high}], got {self.repetition_penalty}")

    @property
    def penalized(self) -> bool:
        """True when any repetition penalty is on."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """True when this row decodes greedily."""
        return self.temperature == 0

    def suppressing(self, generated: int) -> bool:
        """True while this row, having generated ``generated`` tokens, still
        suppresses its stop tokens (``min_tokens``)."""
        return bool(self.suppressed) and generated < self.min_tokens


GREEDY = SamplingParams()


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of each distribution in ``logits`` [..., V] (the
    first one on ties, as ``argmax``). Half-precision logits are widened to
    float32 first: exact (same order, same ties), and torch's bf16 ``argmax``
    on a CPU is ~5x slower than float32's (185 against 38 us over SmolLM2's
    49k logits; docs/LOG.md), which a verify round pays twice."""
    return logits.float().argmax(dim=-1)


def probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Warped next-token distributions [B, n, V] from logits [B, n, V], one
    ``SamplingParams`` per row (greedy rows give one-hot argmax rows): the
    temperature, then ``min_p`` (tokens less likely than ``min_p`` times the
    most likely one drop out), then top-k and top-p, in vLLM's order (SGLang
    applies min-p last, which differs only when top-p is set too)."""
    vocab = logits.shape[-1]
    device = logits.device
    logits = logits.float()
    greedy = torch.tensor([p.greedy for p in params], device=device)
    temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    logits = logits / temperature[:, None, None]
    if any(p.min_p > 0 for p in params):
        logits = _filter_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    if bool((top_k < vocab).any() or (top_p < 1).any()):
        logits = _filter_top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, greedy_tokens(logits)[..., None], 1.0)
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs


def _filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set logits of tokens less likely than ``min_p`` [B] times their
    distribution's most likely token to -inf (compared in log space: log p_v -
    log p_max = logit_v - logit_max, so no softmax is needed)."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf (the most
    likely token always survives)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    remove = ranks >= top_k[:, None, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p.
    remove = remove | ((sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None, None])
    remove[..., 0] = False
    return logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


def make_generators(params: Sequence[SamplingParams], device: torch.device) -> list[torch.Generator]:
    """One generator per row: seeded from the row's seed, else from torch's global RNG
    (so ``torch.manual_seed`` makes a whole run reproducible)."""
    generators = []
    for p in params:
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        generators.append(torch.Generator(device=device).manual_seed(seed))
    return generators


def uniform_rows(generators: Sequence[torch.Generator], n: int, device: torch.device) -> torch.Tensor:
    """U[0, 1) draws [B, n], row i from generator i."""
    if n == 0:
        return torch.zeros(len(generators), 0, device=device)
    return torch.stack([torch.rand(n, generator=g, device=device) for g in generators])


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row from probs [B, V] (rows need not be normalised). A
    row with a single nonzero entry (a greedy row's one-hot) takes it without
    a draw."""
    tokens = probs.argmax(dim=-1)
    drawn = ((probs > 0).sum(dim=-1) > 1).nonzero().flatten()
    if len(drawn):
        u = uniform_rows([generators[row] for row in drawn.tolist()], 1, probs.device)
        tokens[drawn] = inverse_cdf(probs[drawn], u[:, 0])
    return tokens


def sample_positions(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row and position from probs [B, n, V] -> [B, n]."""
    return inverse_cdf(probs, uniform_rows(generators, probs.shape[1], probs.device))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each distribution ``probs`` [..., V] (unnormalised) that the
    uniform draw ``u`` [...] in [0, 1) falls on: the first whose running mass
    exceeds u x total, so a token of mass zero is never drawn. One cumulative
    sum and a binary search: ``multinomial`` over a 49k vocabulary cost ~1.6 ms
    a row and position on a CPU, a tenth of a SmolLM2 step (this: ~0.08 ms)."""
    cumulative = probs.float().cumsum(dim=-1)
    total = cumulative[..., -1:]
    tokens = torch.searchsorted(cumulative, u[..., None] * total, right=True).squeeze(-1)
    # u x total can round up to the total itself: the last token with mass, where the sum reaches it.
    return torch.minimum(tokens, (cumulative < total).sum(dim=-1))


def bias_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Logits [B, n, V] with each row's ``logit_bias`` added at every position
    (float32; ``logits`` itself when no row has one)."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
    for i in rows:
        tokens, biases = zip(*params[i].logit_bias, strict=True)
        logits[i, :, list(tokens)] += torch.tensor(biases, device=logits.device)
    return logits


def suppress_early(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generated: Sequence[int],
    depths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits [B, n, V] with each row's ``suppressed`` tokens at -inf where
    position j would be generated token ``generated[row] + depth_j`` (0-based)
    and that is still below the row's ``min_tokens``; ``depths`` [n] (a tree's
    ``DraftTree.depths``) default to j, a chain."""
    pairs = enumerate(zip(params, generated, strict=True))
    rows = [i for i, (p, done) in pairs if p.suppressing(done)]
    if not rows:
        return logits
    logits = logits.clone()
    depth = torch.arange(logits.shape[1]) if depths is None else depths.cpu()
    for i in rows:
        early = (depth < params[i].min_tokens - generated[i]).nonzero()
        logits[i, early.to(logits.device), list(params[i].suppressed)] = float("-inf")
    return logits
