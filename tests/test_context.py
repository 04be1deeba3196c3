"""One context-length rule: the API's default max_tokens, both engines and
offline decoding draw the same boundary (prompt + new tokens + one block)."""

import asyncio

import pytest
from test_engine import collect

from service.engine import GenerateRequest, InvalidRequestError, NativeEngine
from speculative.context import ContextLengthExceeded, check_context, max_new_tokens_within
from speculative.decode import DecodeConfig, spec_generate


def test_the_boundary():
    assert max_new_tokens_within(100, 30, 4) == 66
    check_context(100, 30, 66, 4)
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 100"):
        check_context(100, 30, 67, 4)


def test_engine_and_offline_decoding_share_it(pair):
    target, draft, tokenizer = pair
    prompt, block = (5,) * 100, draft.block_size
    fits = max_new_tokens_within(target.context_length, len(prompt), block)
    engine = NativeEngine(target, draft, tokenizer)
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(collect(engine, GenerateRequest("x", prompt, fits + 1)))
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "max_tokens")
    with pytest.raises(ContextLengthExceeded):
        spec_generate(target, draft, [list(prompt)], DecodeConfig(block_size=block, max_new_tokens=fits + 1))
    engine.start()
    try:
        deltas, ids, _ = asyncio.run(collect(engine, GenerateRequest("y", prompt, fits)))
    finally:
        engine.stop()
    assert len(ids) == fits and deltas[-1].finish_reason == "length"
