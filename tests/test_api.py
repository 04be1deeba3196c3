"""The HTTP API against a live uvicorn server on loopback, with the official
``openai`` client (and raw HTTP where the client cannot send the bad input)."""

import asyncio
import concurrent.futures
import json
import re
import threading
import time

import httpx2
import openai
import pytest
import torch
from faults import FaultySession
from live import make_server, wait_until
from prometheus_client.parser import text_string_to_metric_families

from service.api.responses import ChatCompletion, Completion, ErrorResponse, Model, ModelList
from service.metrics import Metrics, batch_bucket
from speculative.chat import user_prompt_ids
from speculative.decode import DecodeConfig, spec_generate
from speculative.grammar import Grammar, compiler_for
from speculative.sampling import GREEDY, SamplingParams
from speculative.session import DecodeSession, RoundStats


@pytest.fixture(scope="module")
def server(model):
    live, engine = make_server(model)
    with live as url:
        yield url, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def greedy_text(model, text_prompt_ids, n, sampling=GREEDY):
    _, target, _, tokenizer = model
    ids = spec_generate(target, None, [text_prompt_ids], DecodeConfig(1, n, (0, 2)), sampling).tokens[0]
    return tokenizer.decode(ids, skip_special_tokens=True), ids


def test_chat_completion_equals_offline_greedy(model, client):
    tokenizer = model[3]
    reply = client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=20, temperature=0
    )
    expected, ids = greedy_text(model, user_prompt_ids(tokenizer, ["def add(a, b):"])[0], 20)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == ("stop" if ids[-1] in (0, 2) else "length")
    assert reply.usage.completion_tokens == len(ids)
    assert reply.usage.prompt_tokens == len(user_prompt_ids(tokenizer, ["def add(a, b):"])[0])
    assert reply.model_extra["speculative"]["verify_rounds"] >= 1


def test_logprobs_are_the_targets_for_every_token_streamed_or_not(model, client):
    """Chat ``logprobs`` with ``top_logprobs``: one entry per generated token,
    the target's log-probability after the exact prefix (as a full forward over
    the output computes it) and its top tokens, named by their text and bytes;
    streamed, the chunks carry the same entries."""
    _, target, _, tokenizer = model
    prompt = user_prompt_ids(tokenizer, ["def add(a, b):"])[0]
    kwargs = dict(model="target", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=12)
    reply = client.chat.completions.create(temperature=0, logprobs=True, top_logprobs=3, **kwargs)
    content = reply.choices[0].logprobs.content
    _, ids = greedy_text(model, prompt, 12)
    assert len(content) == reply.usage.completion_tokens == len(ids)
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for j, entry in enumerate(content):
        assert entry.token == tokenizer.decode([ids[j]]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(reference[j, ids[j]].item(), abs=1e-3)
        top = reference[j].topk(3).indices.tolist()
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in top]
    chunks = list(client.chat.completions.create(temperature=0, logprobs=True, top_logprobs=3, stream=True, **kwargs))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert client.chat.completions.create(temperature=0, **kwargs).choices[0].logprobs is None


def test_completion_logprobs_name_tokens_with_offsets(client):
    reply = client.completions.create(model="target", prompt="import os\n", max_tokens=10, temperature=1.0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == reply.usage.completion_tokens
    # Up to logprobs + 1 entries: the chosen token is always named (OpenAI's rule).
    assert all(len(top) <= 3 and top[token] == lp for token, lp, top in zip(*listed(logprobs), strict=True))
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:j])) for j in range(len(logprobs.tokens))]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="target", prompt="x", logprobs=6)
    assert info.value.body["param"] == "logprobs"


def listed(logprobs):
    return logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs


def test_echo_scores_the_prompt_as_lm_eval_asks(model, client):
    """``echo`` with ``logprobs``, as lm-evaluation-harness's loglikelihood tasks
    send it (token-id prompts in a batch, max_tokens 1, or 0 for the prompt
    alone): each choice's text starts with its prompt, and its log-probabilities
    with the prompt's tokens, the first unscored, the others the target's after
    the exact prefix; streamed, the first chunk carries the same."""
    _, target, _, tokenizer = model
    texts = ["import os\nimport sys\n", "def add(a, b):\n    return"]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    for max_tokens in (1, 0):
        reply = client.completions.create(
            model="target", prompt=prompts, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1
        )
        assert reply.usage.completion_tokens == max_tokens * len(prompts)
        for choice, prompt, text in zip(reply.choices, prompts, texts, strict=True):
            tokens, token_logprobs, top = listed(choice.logprobs)
            assert choice.text.startswith(text) and len(tokens) == len(prompt) + max_tokens
            assert tokens[: len(prompt)] == [tokenizer.decode([t]) for t in prompt]
            assert token_logprobs[0] is None and top[0] is None
            with torch.no_grad():
                logits = target.model(torch.tensor([prompt])).logits[0, :-1]
            reference = torch.log_softmax(logits.float(), dim=-1)
            for j, token in enumerate(prompt[1:]):
                assert token_logprobs[j + 1] == pytest.approx(reference[j, token].item(), abs=1e-3)
                best = reference[j].argmax().item()
                assert top[j + 1][tokenizer.decode([best])] == pytest.approx(reference[j, best].item(), abs=1e-3)
            assert choice.logprobs.text_offset == [sum(map(len, tokens[:j])) for j in range(len(tokens))]
        if max_tokens == 0:
            assert [c.text for c in reply.choices] == texts and {c.finish_reason for c in reply.choices} == {"length"}
    whole = client.completions.create(
        model="target", prompt=texts[1], max_tokens=6, temperature=0, echo=True, logprobs=2
    )
    chunks = list(
        client.completions.create(
            model="target", prompt=texts[1], max_tokens=6, temperature=0, echo=True, logprobs=2, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [listed(c.choices[0].logprobs) for c in chunks if c.choices[0].logprobs]
    assert [x for part in streamed for x in part[0]] == whole.choices[0].logprobs.tokens
    assert [x for part in streamed for x in part[1]] == whole.choices[0].logprobs.token_logprobs


def test_echo_without_logprobs_puts_the_prompt_before_the_completion(model, client):
    tokenizer = model[3]
    prompt_ids = tokenizer("import json\n", add_special_tokens=False)["input_ids"]
    expected, _ = greedy_text(model, prompt_ids, 8)
    for prompt in ("import json\n", prompt_ids):
        reply = client.completions.create(model="target", prompt=prompt, max_tokens=8, temperature=0, echo=True, n=2)
        assert [c.text for c in reply.choices] == ["import json\n" + expected] * 2
        assert reply.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="target", prompt="x", max_tokens=0)


def test_completions_with_text_and_token_prompts(model, client):
    tokenizer = model[3]
    prompt_ids = tokenizer("import json\n", add_special_tokens=False)["input_ids"]
    expected, _ = greedy_text(model, prompt_ids, 12)
    by_text = client.completions.create(model="target", prompt="import json\n", max_tokens=12, temperature=0)
    by_ids = client.completions.create(model="target", prompt=prompt_ids, max_tokens=12, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text == expected


def test_penalties_reach_the_decoder(model, client):
    prompt_ids = model[3]("import json\n", add_special_tokens=False)["input_ids"]
    penalties = dict(presence_penalty=0.5, frequency_penalty=1.5)
    expected, _ = greedy_text(model, prompt_ids, 24, [SamplingParams(repetition_penalty=1.4, **penalties)])
    reply = client.completions.create(
        model="target",
        prompt=prompt_ids,
        max_tokens=24,
        temperature=0,
        **penalties,
        extra_body={"repetition_penalty": 1.4},
    )
    assert reply.choices[0].text == expected != greedy_text(model, prompt_ids, 24)[0]


def test_logit_bias_reaches_the_decoder(model, client):
    """OpenAI's ``logit_bias``: -100 on the token greedy decoding opens with and
    +5 on another gives what offline decoding with the same bias gives, and a
    different text."""
    prompt_ids = model[3]("import json\n", add_special_tokens=False)["input_ids"]
    plain_text, plain_ids = greedy_text(model, prompt_ids, 16)
    bias = {str(plain_ids[0]): -100, "17": 5}
    expected, ids = greedy_text(model, prompt_ids, 16, [SamplingParams(logit_bias=((plain_ids[0], -100), (17, 5)))])
    reply = client.completions.create(model="target", prompt=prompt_ids, max_tokens=16, temperature=0, logit_bias=bias)
    assert reply.choices[0].text == expected != plain_text
    assert ids[0] != plain_ids[0]
    chat = client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": "x"}], max_tokens=4, temperature=0, logit_bias={"17": 100}
    )
    assert chat.choices[0].message.content == model[3].decode([17] * 4)


def test_min_p_reaches_the_decoder(model, client):
    """``min_p`` 1 keeps only the most likely token: sampling at T = 1 then gives the greedy text."""
    prompt_ids = model[3]("import json\n", add_special_tokens=False)["input_ids"]
    expected, _ = greedy_text(model, prompt_ids, 16)
    kwargs = dict(model="target", prompt=prompt_ids, max_tokens=16, temperature=1.0, seed=7)
    assert client.completions.create(**kwargs, extra_body={"min_p": 1.0}).choices[0].text == expected
    assert client.completions.create(**kwargs).choices[0].text != expected  # T = 1 alone strays here


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}


def test_response_format_gives_json_that_follows_the_schema_streamed_or_not(model, client):
    """A ``json_schema`` response format: the reply parses and follows the
    schema, streamed alike, and is what offline decoding under the same grammar
    gives; ``json_object`` opens an object the same way."""
    _, target, _, tokenizer = model
    prompt_ids = user_prompt_ids(tokenizer, ["Is the sky blue?"])[0]
    grammars = compiler_for(tokenizer, target.vocab_size)
    formats = {
        Grammar.json_schema(ANSWER_SCHEMA): {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": ANSWER_SCHEMA},
        },
        Grammar.json_schema({"type": "object"}): {"type": "json_object"},
    }
    for grammar, response_format in formats.items():
        config, sampling = DecodeConfig(1, 40, (0, 2)), [SamplingParams(grammar=grammar)]
        ids = spec_generate(target, None, [prompt_ids], config, sampling, grammars=grammars).tokens[0]
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        kwargs = dict(
            model="target",
            messages=[{"role": "user", "content": "Is the sky blue?"}],
            max_tokens=40,
            temperature=0,
            response_format=response_format,
        )
        reply = client.chat.completions.create(**kwargs).choices[0].message.content
        streamed = "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
        )
        assert reply == streamed == expected and reply.startswith("{")
    answer = json.loads(
        client.chat.completions.create(**{**kwargs, "response_format": formats[Grammar.json_schema(ANSWER_SCHEMA)]})
        .choices[0]
        .message.content
    )
    assert set(answer) == {"ok", "tag"} and isinstance(answer["ok"], bool) and answer["tag"] in ("red", "green", "blue")


def test_structured_outputs_choice_and_regex_are_kept(client):
    """vLLM's ``structured_outputs``: a choice answers one of the strings as
    written, a regex's answer matches it whole."""
    kwargs = dict(
        model="target", messages=[{"role": "user", "content": "Pick a colour."}], max_tokens=20, temperature=0
    )
    for stream in (False, True):
        choice = {"structured_outputs": {"choice": ["red sky", "green (dark)", "blue"]}}
        reply = client.chat.completions.create(stream=stream, extra_body=choice, **kwargs)
        text = "".join(c.choices[0].delta.content or "" for c in reply) if stream else reply.choices[0].message.content
        assert text in ("red sky", "green (dark)", "blue")
    pattern = r"[0-9]{3}-[a-z]{2}"
    text = client.chat.completions.create(extra_body={"structured_outputs": {"regex": pattern}}, **kwargs)
    assert re.fullmatch(pattern, text.choices[0].message.content)


def test_streaming_matches_non_streaming_and_reports_usage(client):
    kwargs = dict(model="target", messages=[{"role": "user", "content": "class Stack:"}], max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_n_choices_greedy_repeat_one_reply_and_seeded_ones_repeat_the_single_seeded_replies(model, client):
    """Each choice is its own request: greedy choices are the offline greedy
    reply, and with a seed, choice i is the reply a single request with seed + i
    gets; the prompt counts once in ``usage``."""
    tokenizer = model[3]
    kwargs = dict(model="target", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=12)
    greedy = client.chat.completions.create(n=3, temperature=0, **kwargs)
    expected, ids = greedy_text(model, user_prompt_ids(tokenizer, ["def add(a, b):"])[0], 12)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert [c.message.content for c in greedy.choices] == [expected] * 3
    assert greedy.usage.completion_tokens == 3 * len(ids)
    assert greedy.usage.prompt_tokens == len(user_prompt_ids(tokenizer, ["def add(a, b):"])[0])
    sampled = client.chat.completions.create(n=4, temperature=1.0, seed=5, **kwargs)
    texts = [c.message.content for c in sampled.choices]
    singles = [client.chat.completions.create(temperature=1.0, seed=5 + i, **kwargs) for i in range(4)]
    assert texts == [r.choices[0].message.content for r in singles]
    assert len(set(texts)) > 1


def test_batched_prompts_get_their_own_choices_as_if_sent_alone(model, client):
    """A batch of prompts (text or token ids) gets n choices each, at index
    prompt * n + choice, each the reply that prompt gets alone (the same seeds);
    ``usage`` counts every prompt once."""
    tokenizer = model[3]
    texts = ["import json\n", "class Point:"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    kwargs = dict(model="target", max_tokens=10, temperature=1.0, seed=11)
    for prompt in (texts, ids):
        batch = client.completions.create(prompt=prompt, n=2, **kwargs)
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        alone = [client.completions.create(prompt=p, n=2, **kwargs) for p in prompt]
        assert [c.text for c in batch.choices] == [c.text for reply in alone for c in reply.choices]
        assert batch.usage.prompt_tokens == sum(map(len, ids))
        assert batch.usage.completion_tokens == sum(reply.usage.completion_tokens for reply in alone)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(prompt=["a", ""], **kwargs)
    assert info.value.body["param"] == "prompt"


def test_n_streamed_choices_interleave_with_their_index(client):
    kwargs = dict(model="target", prompt="import os\n", max_tokens=16, temperature=1.0, seed=3)
    whole = client.completions.create(n=2, **kwargs)
    chunks = list(client.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)]
    assert streamed == [c.text for c in whole.choices]
    finishes = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(f.index for f in finishes) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_beyond_capacity_is_400_and_choices_are_admitted_all_or_none(model):
    # 40 ms steps keep the first request (>= 375 rounds, 15 s) running throughout.
    live, engine = make_server(model, step_cost=lambda batch, block: 0.04, max_batch_size=1, max_waiting=1)
    body = {"model": "target", "prompt": "x", "max_tokens": 1500, "stream": True, "temperature": 0}
    with live as url, httpx2.stream("POST", url + "/v1/completions", json=body, timeout=30) as busy:
        lines = busy.iter_lines()  # keep a reference: a dropped iterator closes the response
        assert next(lines).startswith("data:")
        too_many = httpx2.post(url + "/v1/completions", json={**body, "stream": False, "n": 3}, timeout=30)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        # Room for one more request: the second choice is refused, and the first, queued, leaves the queue.
        refused = httpx2.post(url + "/v1/completions", json={**body, "stream": False, "n": 2}, timeout=30)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        assert (engine.stats().running, engine.stats().waiting) == (1, 0)


def test_a_request_abandoned_while_queued_leaves_the_queue(model):
    """A client that gives up while its request waits for a batch place: the
    request leaves the queue then, not when a place frees (it is never prefilled)."""
    # 40 ms steps keep the first request (>= 375 rounds) running for 15 s at least.
    live, engine = make_server(model, step_cost=lambda batch, block: 0.04, max_batch_size=1, max_waiting=1)
    body = {"model": "target", "prompt": "x", "max_tokens": 1500, "stream": True, "temperature": 0}
    with live as url, httpx2.stream("POST", url + "/v1/completions", json=body, timeout=30) as busy:
        lines = busy.iter_lines()  # keep a reference: a dropped iterator closes the response
        assert next(lines).startswith("data:")
        with pytest.raises(httpx2.TimeoutException):
            httpx2.post(url + "/v1/completions", json={**body, "stream": False, "n": 1}, timeout=1.0)
        wait_until(lambda: engine.stats().waiting == 0, seconds=10)
        assert engine.stats().running == 1


def test_disconnecting_from_n_streamed_choices_frees_every_slot(server):
    url, engine = server
    body = {"model": "target", "prompt": "x", "max_tokens": 1500, "stream": True, "temperature": 0, "n": 3}
    with httpx2.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                break  # first chunk seen: hang up
    wait_until(lambda: engine.stats().running == 0 and len(engine.session) == 0)


def test_concurrent_requests_match_sequential_ones(server, client):
    prompts = [f"def f{i}(x):" for i in range(6)]
    alone = [
        client.chat.completions.create(
            model="target", messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0
        )
        .choices[0]
        .message.content
        for p in prompts
    ]

    async def together():
        aclient = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)
        replies = await asyncio.gather(
            *(
                aclient.chat.completions.create(
                    model="target", messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0
                )
                for p in prompts
            )
        )
        return [r.choices[0].message.content for r in replies]

    assert asyncio.run(together()) == alone


def test_models_health_ready(server, client):
    assert [m.id for m in client.models.list().data] == ["target"]
    assert client.models.retrieve("target").id == "target"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found"
    assert httpx2.get(server[0] + "/health").json() == {"status": "ok"}
    assert httpx2.head(server[0] + "/health").status_code == 200
    assert httpx2.get(server[0] + "/ready").status_code == 200


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(extra_body={"frobnicate": 1}), "frobnicate"),
        (dict(n=129), "n"),
        (dict(temperature=5), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_logprobs=2), None),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
        (dict(max_tokens=3, extra_body={"min_tokens": 4}), "min_tokens"),
        (dict(extra_body={"min_p": 1.5}), "min_p"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "x"}}}),
            "response_format",
        ),
        (dict(response_format={"type": "json_object"}, extra_body={"min_tokens": 2}), None),
        (dict(response_format={"type": "yaml"}), "response_format.type"),
        (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
        (dict(extra_body={"structured_outputs": {"grammar": "root ::= x"}}), "structured_outputs.grammar"),
        (dict(extra_body={"structured_outputs": {"regex": "("}}), "structured_outputs"),
        (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a"}}), None),
        (dict(logit_bias={"5": 101}), "logit_bias"),
        (dict(logit_bias={"five": 1}), "logit_bias"),
        (dict(logit_bias={"99999999": 1}), "logit_bias"),
    ],
)
def test_bad_fields_are_400_with_openai_shape(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="target", messages=[{"role": "user", "content": "x"}], **kwargs)
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error" and error["message"]
    if param:
        assert error["param"] == param


def test_unknown_model_invalid_json_and_context_overflow(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"
    raw = httpx2.post(
        server[0] + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="target", prompt="x " * 3000, max_tokens=10)
    assert info.value.body["code"] == "context_length_exceeded"


def test_wrong_api_key_is_401(model):
    live, _ = make_server(model, api_key="secret")
    with live as url:
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="secret", max_retries=0)
        assert good.models.list().data[0].id == "target"


def test_disconnect_mid_stream_frees_the_slot(server):
    url, engine = server
    # Greedy: this tiny model runs on for 1500 tokens without a stop token.
    body = {
        "model": "target",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 1500,
        "stream": True,
        "temperature": 0,
    }
    with httpx2.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                break  # first chunk seen: hang up
    for _ in range(300):
        if engine.stats().running == 0 and len(engine.session) == 0:
            break
        time.sleep(0.01)
    assert engine.stats().running == 0 and len(engine.session) == 0
    metrics = httpx2.get(url + "/metrics").text
    assert 'dflash_requests_total{finish_reason="abort"}' in metrics


def test_full_queue_is_429_with_retry_after(model):
    # 10 ms steps keep the first request (>= 375 rounds) running while the second arrives.
    live, _ = make_server(model, step_cost=lambda batch, block: 0.01, max_batch_size=1, max_waiting=0)
    body = {"model": "target", "prompt": "x", "max_tokens": 1500, "stream": True, "temperature": 0}
    with live as url, httpx2.stream("POST", url + "/v1/completions", json=body, timeout=30) as busy:
        assert busy.status_code == 200
        lines = busy.iter_lines()  # keep a reference: a dropped iterator closes the response
        assert next(lines).startswith("data:")
        refused = httpx2.post(url + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"


def test_metrics_count_steps_tokens_and_requests(server, client):
    url, _ = server
    client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": "m"}], max_tokens=8, temperature=0
    )
    samples = metric_samples(url)

    def value(name, **labels):
        return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("dflash_verify_steps_total", block_size="4") > 0
    assert value("dflash_requests_total", finish_reason="length") >= 1
    assert value("dflash_generation_tokens_total") >= 8
    assert value("dflash_draft_tokens_total") == sum(
        value("dflash_verified_tokens_per_position_total", position=str(k)) for k in (1, 2, 3)
    )
    for k in (1, 2, 3):
        assert value("dflash_accepted_tokens_per_position_total", position=str(k)) <= value(
            "dflash_verified_tokens_per_position_total", position=str(k)
        )
    assert value("dflash_time_to_first_token_seconds_count") >= 1
    assert value("dflash_running_requests") == 0
    assert value("dflash_step_seconds_count", block_size="4", batch_bucket="1") > 0


def test_alternates_and_lookup_are_counted_beside_accepted_tokens():
    metrics = Metrics()
    # Four rows at b4: one accepted two chain drafts, one an alternate, one nothing, and one
    # accepted one chain draft while its lookup path committed five tokens (four beyond the draft).
    stats = RoundStats(4, 4, [3, 2, 1, 6], [3, 1, 0], [4, 4, 4], 0.001, 0.02, branches_taken=1, lookup_accepted=4)
    metrics.observe_step(stats, 0.021)
    value = metrics.registry.get_sample_value
    assert value("dflash_branch_accepted_tokens_total", {"block_size": "4"}) == 1
    assert value("dflash_lookup_accepted_tokens_total", {"block_size": "4"}) == 4
    assert value("dflash_accepted_tokens_total", {"block_size": "4"}) == 8  # 2 + 1 + 0 + 5
    assert value("dflash_step_output_tokens_total", {"block_size": "4", "batch_bucket": "4-7"}) == 12
    # The per-position counters stay the draft's own: 4 of 12 drafted tokens.
    accepted = sum(value("dflash_accepted_tokens_per_position_total", {"position": str(k)}) for k in (1, 2, 3))
    assert accepted / value("dflash_draft_tokens_total", {"block_size": "4"}) == 4 / 12


def test_batch_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 7, 8, 63, 64, 500)] == [
        "1",
        "2-3",
        "2-3",
        "4-7",
        "4-7",
        "8-15",
        "32-63",
        "64+",
        "64+",
    ]


def test_load_sweep_direct_engine_baseline(model, server, tmp_path, capsys):
    from bench.load import main as load
    from speculative.checkpoint import save_draft

    save_draft(model[2], tmp_path / "draft")
    load(
        [
            "--url",
            server[0],
            "--concurrency",
            "1",
            "--requests",
            "2",
            "--max-tokens",
            "6",
            "--direct-target",
            str(model[0] / "target"),
            "--direct-draft",
            str(tmp_path / "draft"),
        ]
    )
    levels = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["levels"]
    assert [level["mode"] for level in levels] == ["direct engine", "http"]
    assert all(level["output_tokens_per_s"] > 0 for level in levels)


def test_load_sweep_against_the_live_server(server, capsys):
    from bench.load import main as load

    load(
        [
            "--url",
            server[0],
            "--concurrency",
            "1",
            "3",
            "--requests",
            "3",
            "--max-tokens",
            "8",
            "--repetition-penalty",
            "1.3",
            "--dataset",
            "mtbench",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["dataset"] == "mtbench"
    assert [level["concurrency"] for level in summary["levels"]] == [1, 3]
    assert {level["mode"] for level in summary["levels"]} == {"http"}
    for level in summary["levels"]:
        assert level["requests"] == 3 and level["output_tokens_per_s"] > 0
        assert level["ttft_p50_s"] > 0 and level["acceptance_length"] >= 1


def test_load_sweep_reports_what_long_prompts_cost_the_other_streams(server, capsys):
    from bench.load import main as load

    level_args = ["--concurrency", "1", "--requests", "2", "--max-tokens", "24"]
    load(["--url", server[0], *level_args, "--long-prompt-words", "60", "--long-max-tokens", "5"])
    lines = capsys.readouterr().out.strip().splitlines()
    (level,) = json.loads(lines[-1])["levels"]
    assert level["requests"] == 2 and level["long_requests"] >= 1
    assert 0 < level["long_output_tokens"] <= 5 * level["long_requests"]
    assert level["long_prompt_tokens"] > 60 and level["long_ttft_p50_s"] > 0
    assert level["itl_max_s"] >= level["itl_p99_s"] > 0
    assert "long-prompt requests" in lines[-2]


def test_admin_policy_endpoint(model):
    closed, _ = make_server(model)
    with closed as url:
        assert httpx2.get(url + "/admin/policy").status_code == 403
    live, engine = make_server(model, admin_key="root")
    with live as url:
        assert httpx2.get(url + "/admin/policy", headers={"authorization": "Bearer nope"}).status_code == 401
        auth = {"authorization": "Bearer root"}
        assert httpx2.get(url + "/admin/policy", headers=auth).json() == {"min_batch": [1], "block_sizes": [4]}
        new = {"min_batch": [1, 4], "block_sizes": [4, 1]}
        assert httpx2.post(url + "/admin/policy", json=new, headers=auth).json() == new
        assert engine.policy.block_size(5) == 1 and engine.policy.block_size(2) == 4
        paired = {"min_batch": [1, 4], "block_sizes": [4, 1], "alternates": [1, 2]}  # a controller trial
        assert httpx2.post(url + "/admin/policy", json=paired, headers=auth).json() == paired
        assert [engine.policy.block_size(5, turn) for turn in range(3)] == [1, 2, 1]
        too_big = httpx2.post(url + "/admin/policy", json={**paired, "alternates": [9, 1]}, headers=auth)
        assert too_big.status_code == 400 and engine.policy.alternates == (1, 2)
        too_big = httpx2.post(url + "/admin/policy", json={"min_batch": [1], "block_sizes": [9]}, headers=auth)
        assert too_big.status_code == 400 and engine.policy.block_size(1) == 4
        unsorted = httpx2.post(url + "/admin/policy", json={"min_batch": [2], "block_sizes": [2]}, headers=auth)
        assert unsorted.status_code == 400


def test_in_process_controller_runs_and_exports_its_decisions(model):
    from service.cli import in_process_controller
    from service.config import ServeSettings

    root = model[0]
    live, engine = make_server(model)
    metrics = live.server.config.app.state.metrics
    loop = in_process_controller(engine, metrics, ServeSettings(target=root / "target", draft=None))
    assert loop.state.estimates.baseline is not None  # its counters start with it: the first scrape counts
    with live as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for _ in range(3):
            client.completions.create(model="target", prompt="x", max_tokens=40, temperature=0)
            loop.tick()
        text = httpx2.get(url + "/metrics").text
    assert "dflash_controller_decisions_total 3.0" in text
    assert 'dflash_controller_block_size{bucket="1"}' in text


def test_a_pushed_policy_is_refused_while_the_in_process_controller_runs(model):
    live, engine = make_server(model, controller=True, admin_key="k")
    with live as url:
        auth = {"authorization": "Bearer k"}
        before = httpx2.get(url + "/admin/policy", headers=auth).json()
        pushed = httpx2.post(url + "/admin/policy", json={"min_batch": [1], "block_sizes": [1]}, headers=auth)
        assert pushed.status_code == 409 and pushed.json()["error"]["code"] == "controller_active"
        assert engine.policy.to_dict() == before


def metric_samples(url: str) -> list:
    """Every sample the server at ``url`` exports on /metrics."""
    return [s for f in text_string_to_metric_families(httpx2.get(url + "/metrics").text) for s in f.samples]


def metric_values(url: str, name: str, label: str) -> dict[str, float]:
    return {s.labels[label]: s.value for s in metric_samples(url) if s.name == name}


def test_every_finish_reason_and_refusal_is_counted(model):
    """length, stop and error on both the streaming and the non-streaming
    path each count once under their own reason (a streamed length once
    counted as abort); refusals count by reason."""
    live, engine = make_server(model)
    _, target, draft, _ = model
    engine.session = FaultySession(target, draft, fail_prefill=lambda _, prompts: prompts[0][0] == 299)
    with live as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        text = client.completions.create(model="target", prompt=[5, 6, 7], max_tokens=12, temperature=0)
        stop = text.choices[0].text[3:6]
        for stream in (False, True):
            calls = {
                "length": dict(prompt=[5, 6, 7], max_tokens=5),
                "stop": dict(prompt=[5, 6, 7], stop=stop),
                "error": dict(prompt=[299, 6, 7], max_tokens=5),
            }
            for reason, kwargs in calls.items():
                body = {"model": "target", "temperature": 0, "max_tokens": 12, "stream": stream, **kwargs}
                response = httpx2.post(url + "/v1/completions", json=body, timeout=30)
                if reason == "error" and not stream:
                    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
                    continue
                events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
                finish = (
                    events[-1]["error"]["type"]
                    if stream and reason == "error"
                    else (events[-1] if stream else response.json())["choices"][0]["finish_reason"]
                )
                assert finish == ("server_error" if reason == "error" else reason), response.text
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="target", prompt="x", temperature=0.001)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-9", prompt="x")
        wait_until(lambda: sum(metric_values(url, "dflash_requests_total", "finish_reason").values()) == 7)
        assert metric_values(url, "dflash_requests_total", "finish_reason") == {"length": 3, "stop": 2, "error": 2}
        assert metric_values(url, "dflash_refused_requests_total", "reason") == {"invalid": 1, "not_found": 1}


def test_a_body_past_the_limit_is_413_before_parsing_and_the_server_serves_on(model):
    """``max_request_bytes``: a declared body past the limit and a chunked one
    that grows past it are 413 in the OpenAI shape, counted as refusals; a
    chunked body within it is served as if sent whole."""
    live, _ = make_server(model, max_request_bytes=2048)
    with live as url:
        endpoint = url + "/v1/completions"
        small = json.dumps({"model": "target", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}).encode()
        big = json.dumps({"model": "target", "prompt": "x " * 2000, "max_tokens": 4}).encode()

        def chunked(body: bytes):
            yield from (body[i : i + 500] for i in range(0, len(body), 500))

        declared = httpx2.post(endpoint, content=big, headers={"content-type": "application/json"}, timeout=30)
        streamed = httpx2.post(endpoint, content=chunked(big), headers={"content-type": "application/json"}, timeout=30)
        for refused in (declared, streamed):
            assert refused.status_code == 413, refused.text
            assert refused.json()["error"]["code"] == "request_too_large"
            assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
        whole = httpx2.post(endpoint, content=small, headers={"content-type": "application/json"}, timeout=30)
        pieces = httpx2.post(endpoint, content=chunked(small), headers={"content-type": "application/json"}, timeout=30)
        assert whole.status_code == pieces.status_code == 200
        assert whole.json()["choices"][0]["text"] == pieces.json()["choices"][0]["text"]
        assert metric_values(url, "dflash_refused_requests_total", "reason") == {"too_large": 2}


def test_streams_preempted_to_keep_the_slot_budget_get_the_offline_text(model):
    """Four streamed completions under a 150-slot budget: the first prefill is
    held until all four are in the engine, so they decode together; as they grow
    the latest are preempted and resumed (counted in
    ``dflash_preemptions_total``), and each stream's text is still the offline
    greedy text."""
    live, engine = make_server(model, max_batch_slots=150)
    _, target, draft, _ = model
    release = threading.Event()

    class HeldFirstPrefill(DecodeSession):
        def add(self, keys, prompts, sampling):
            release.wait(60)
            return super().add(keys, prompts, sampling)

    engine.session = HeldFirstPrefill(target, draft)
    prompts = [[5 + i, 40, 41, 42, 43] for i in range(4)]
    with live as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        def stream(prompt):
            chunks = client.completions.create(model="target", prompt=prompt, max_tokens=40, temperature=0, stream=True)
            return "".join(chunk.choices[0].text for chunk in chunks)

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(stream, prompt) for prompt in prompts]
            in_engine = ("dflash_running_requests", "dflash_waiting_requests")
            wait_until(lambda: sum(metric_value(url, name) for name in in_engine) == len(prompts))
            release.set()
            texts = [future.result() for future in futures]
        preemptions = metric_value(url, "dflash_preemptions_total")
    assert preemptions >= 1
    for prompt, text in zip(prompts, texts, strict=True):
        assert text == greedy_text(model, prompt, 40)[0]


def metric_value(url: str, name: str) -> float:
    return sum(s.value for s in metric_samples(url) if s.name == name)


class EncodingThreads:
    """A tokenizer that records which threads encode text."""

    def __init__(self, inner) -> None:
        self.inner, self.threads = inner, set()

    def __call__(self, *args, **kwargs):
        self.threads.add(threading.current_thread())
        return self.inner(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.threads.add(threading.current_thread())
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_prompts_are_tokenized_off_the_event_loop(model):
    root, target, draft, tokenizer = model
    recording = EncodingThreads(tokenizer)
    live, _ = make_server((root, target, draft, recording))
    with live as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        client.completions.create(model="target", prompt="def f(x):", max_tokens=2)
        client.chat.completions.create(model="target", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert recording.threads and live.thread not in recording.threads


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["a\udfffb"]}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
    ],
)
def test_strict_types_and_valid_unicode(server, body, param):
    # json.dumps writes ASCII: a lone surrogate travels as its \u escape, as clients send it.
    raw = json.dumps({"model": "target", **body})
    response = httpx2.post(
        server[0] + "/v1/chat/completions", content=raw, timeout=30, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_assistant_message_may_have_null_content(client):
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "y"},
    ]
    reply = client.chat.completions.create(model="target", messages=messages, max_tokens=3)
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_openapi_documents_the_responses_actually_sent(server):
    """No 422 anywhere (invalid requests are 400 with the OpenAI error body);
    every inference route documents its errors; real bodies fit the documented
    models."""
    url = server[0]
    spec = httpx2.get(url + "/openapi.json").json()
    assert "422" not in json.dumps(spec) and "HTTPValidationError" not in json.dumps(spec)
    for path in ("/v1/chat/completions", "/v1/completions"):
        documented = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "429", "503"} <= set(documented)
        assert documented["429"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    chat = {"model": "target", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    for body in (chat, {**chat, "logprobs": True, "top_logprobs": 2}):
        ChatCompletion.model_validate(httpx2.post(url + "/v1/chat/completions", json=body, timeout=30).json())
    text = {"model": "target", "prompt": "x", "max_tokens": 3}
    for body in (text, {**text, "logprobs": 2}):
        Completion.model_validate(httpx2.post(url + "/v1/completions", json=body, timeout=30).json())
    ModelList.model_validate(httpx2.get(url + "/v1/models").json())
    Model.model_validate(httpx2.get(url + "/v1/models/target").json())
    ErrorResponse.model_validate(httpx2.post(url + "/v1/completions", json={**text, "n": 129}, timeout=30).json())


def test_ignore_eos_reaches_the_engine_as_no_stop_tokens(model):
    """(The tiny target never ends its text, so the engine's view is checked.)"""
    live, engine = make_server(model)
    seen = []
    generate = engine.generate

    def recording(request):
        seen.append(request.stop_token_ids)
        return generate(request)

    engine.generate = recording
    with live as url:
        body = {"model": "target", "prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0}
        for ignore_eos in (False, True):
            reply = httpx2.post(url + "/v1/completions", json={**body, "ignore_eos": ignore_eos}, timeout=30).json()
            assert reply["usage"]["completion_tokens"] == 40
    assert seen[0] == live.server.config.app.state.stop_ids != () and seen[1] == ()
