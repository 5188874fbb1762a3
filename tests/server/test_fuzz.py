"""`promptlang serve` fuzzed: hypothesis sends every path of the app's own OpenAPI schema
bodies built from the API's fields: well-formed requests, well-formed ones with fields
replaced by values of every JSON type, any fields, and bytes that are not JSON, with any
Content-Type; no answer may be a 5xx, and afterwards `/health` and a normal
request still answer. Loopback only; the run is bounded in examples and each request in
time, and the values that would decode long are kept small (max_tokens <= 4 when valid).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.test_server import PML, TIMEOUT, Server, make_llm, model  # noqa: F401

pytest.importorskip("uvicorn")

from promptlang.server.app import create_app                  # noqa: E402

EXAMPLES = 200

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                    st.floats(allow_nan=False), st.text(max_size=40),
                    st.sampled_from(["", "x", "\u0000", "user", "system", "assistant",
                                     "tiny", "json_object", "text", "exact", "none",
                                     "ape", "tuned", "first:3", PML]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), json_values),
     "content": st.one_of(st.text(max_size=60), json_values)}), max_size=4)
small_tokens = st.one_of(st.integers(1, 4), json_values)
FIELDS = {
    "model": st.one_of(st.just("tiny"), json_values),
    "messages": st.one_of(messages, json_values),
    "prompt": st.one_of(st.text(min_size=1, max_size=60), json_values),
    "max_tokens": small_tokens, "max_completion_tokens": small_tokens,
    "temperature": json_values, "top_p": json_values, "seed": json_values, "n": json_values,
    "stop": json_values, "stream": json_values,
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": json_values}),
                                json_values),
    "response_format": st.one_of(st.fixed_dictionaries({"type": json_values,
                                                        "json_schema": json_values}),
                                 json_values),
    "promptlang": st.one_of(st.fixed_dictionaries({}, optional={
        "pml": st.one_of(st.just(PML), json_values), "recompute": json_values,
        "regex": json_values, "grammar": json_values, "schema": json_values,
        "function": json_values, "args": json_values}), json_values),
}
OPTIONS = {"stream": st.booleans(), "temperature": st.floats(0, 2), "top_p": st.floats(0, 1),
           "seed": st.integers(0, 2 ** 31), "stop": st.one_of(
               st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3)),
           "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
           "promptlang": st.fixed_dictionaries({}, optional={"recompute": st.sampled_from(
               ["exact", "none", "seams", "first:2", "ape"])})}
valid_chat = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.integers(1, 4),
     "messages": st.lists(st.fixed_dictionaries({
         "role": st.sampled_from(["system", "user", "assistant"]),
         "content": st.text(min_size=1, max_size=40)}), min_size=1, max_size=3)},
    optional=OPTIONS)
valid_completion = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.integers(1, 4),
     "prompt": st.text(min_size=1, max_size=60)}, optional=OPTIONS)
# a well-formed request with up to two fields replaced by anything
mutated = st.tuples(st.one_of(valid_chat, valid_completion),
                    st.dictionaries(st.sampled_from(sorted(FIELDS)), json_values,
                                    max_size=2)).map(lambda pair: {**pair[0], **pair[1]})
bodies = st.one_of(
    st.one_of(valid_chat, valid_completion, mutated).map(lambda d: json.dumps(d).encode()),
    st.fixed_dictionaries({}, optional=FIELDS).map(lambda d: json.dumps(d).encode()),
    st.dictionaries(st.text(max_size=12), json_values, max_size=5).map(
        lambda d: json.dumps(d).encode()),
    st.binary(max_size=200))
content_types = st.sampled_from(["application/json", "application/json; charset=utf-8",
                                 "text/plain", "", "application/x-www-form-urlencoded"])


def _request(url: str, method: str, body: bytes | None, content_type: str) -> int:
    headers = {"Content-Type": content_type} if content_type else {}
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        error.read()
        return error.code


@pytest.fixture(scope="module")
def fuzzed(model):                                     # noqa: F811 - the shared fixture
    llm = make_llm(model)
    app = create_app(llm, model_name="tiny")
    operations = [(path.replace("{name}", "tiny"), method.upper())
                  for path, item in app.openapi()["paths"].items() for method in item]
    server = Server(app)
    yield server, operations
    server.stop()


def test_the_schema_lists_the_api(fuzzed):
    _, operations = fuzzed
    assert {("/v1/chat/completions", "POST"), ("/v1/completions", "POST"),
            ("/v1/models", "GET"), ("/health", "GET")} <= set(operations)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_no_request_gets_a_5xx(fuzzed, data):
    server, operations = fuzzed
    path, method = data.draw(st.sampled_from(operations))
    body = data.draw(bodies) if method == "POST" else None
    status = _request(server.url + path, method, body, data.draw(content_types))
    assert status < 500, (path, method, body)


def test_the_server_still_answers_after_the_fuzzing(fuzzed):
    server, _ = fuzzed
    assert _request(server.url + "/health", "GET", None, "") == 200
    body = json.dumps({"model": "tiny", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hello there"}]}).encode()
    assert _request(server.url + "/v1/chat/completions", "POST", body,
                    "application/json") == 200
