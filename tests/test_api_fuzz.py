"""Schema fuzzing: requests generated from the service's own OpenAPI spec
(valid and invalid ones) never produce a 5xx, and errors keep the OpenAI shape."""

import asyncio

import httpx2
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from live import make_server


@pytest.fixture(scope="module")
def live_url(model):
    live, _ = make_server(model)
    with live as url:
        yield url


def test_no_server_errors(live_url):
    """Every operation of the spec, 40 generated cases each (schemathesis'
    strategies driven by hypothesis directly, without its pytest plugin)."""
    schema = schemathesis.openapi.from_url(live_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call(timeout=60)
            assert response.status_code < 500, (case.path, response.text)
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"]

        check()


SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "repetition_penalty",
)
INNOCENTS = (
    {"model": "target", "prompt": [5, 6, 7], "max_tokens": 16, "temperature": 0},
    {"model": "target", "prompt": [9, 10], "max_tokens": 16, "temperature": 0.9, "top_k": 40, "seed": 5},
)


def post_together(url: str, bodies: list[dict]) -> list:
    async def main():
        async with httpx2.AsyncClient(base_url=url, timeout=60) as client:  # the bound on every request
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for body in bodies))

    return asyncio.run(main())


def check_beside_innocents(url: str, sampling: dict, alone: list[str]) -> None:
    """Send a request with ``sampling`` next to the innocent ones: it is answered
    (200) or refused naming its field (400) within the bound, and the innocent
    requests decode exactly what they decode ``alone``."""
    body = {"model": "target", "prompt": [11, 12, 13], "max_tokens": 16, **sampling}
    first, *innocents = post_together(url, [body, *INNOCENTS])
    assert first.status_code in (200, 400), (body, first.text)
    if first.status_code == 400:
        assert first.json()["error"]["param"] in SAMPLING_FIELDS, (body, first.text)
    assert [r.json()["choices"][0]["text"] for r in innocents] == alone, body


@pytest.fixture(scope="module")
def innocents_alone(live_url) -> list[str]:
    return [r.json()["choices"][0]["text"] for r in post_together(live_url, list(INNOCENTS))]


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.8, "seed": 2**64},
        {"temperature": 0.8, "seed": -(2**63) - 1},
        {"temperature": 0.8, "top_k": 2**63},
        {"temperature": 1e-45},
        {"temperature": 0.8, "repetition_penalty": 1e-45},
        {"temperature": 0.8, "repetition_penalty": 1e30},
        {"temperature": 0.8, "top_p": 1e-300},
    ],
)
def test_values_that_once_broke_the_step(live_url, innocents_alone, sampling):
    check_beside_innocents(live_url, sampling, innocents_alone)


def test_any_sampling_parameters_leave_other_requests_alone(live_url, innocents_alone):
    """Sampling parameters drawn from the whole domain the API schema accepts."""
    operation = schemathesis.openapi.from_url(live_url + "/openapi.json")["/v1/completions"]["POST"]

    @given(case=operation.as_strategy(schemathesis.GenerationMode.POSITIVE))
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case):
        sampling = {key: value for key, value in case.body.items() if key in SAMPLING_FIELDS}
        check_beside_innocents(live_url, sampling, innocents_alone)

    check()
