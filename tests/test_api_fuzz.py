"""Schema fuzzing: requests generated from the service's own OpenAPI spec
(valid and invalid ones) never produce a 5xx, and errors keep the OpenAI shape."""

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
