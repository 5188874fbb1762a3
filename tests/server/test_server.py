"""`promptlang serve` end to end: a real uvicorn server on a free loopback port, spoken to
with the `openai` client (and raw HTTP where a client would not send it). Every request has a
timeout and every loop a bound; the server only ever listens on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from promptlang.runtime.engine import LLM                     # noqa: E402
from promptlang.runtime.store import ModuleStore              # noqa: E402
from promptlang.server.app import create_app                  # noqa: E402
from promptlang.tokenizer import WordTokenizer                # noqa: E402

from tests.runtime.tiny import tiny_llama                      # noqa: E402

VOCAB = 1000
TIMEOUT = 60.0            # seconds for any one request
SCHEMA = """\
<schema name="docs">
  <system>You answer questions about the documents.</system>
  <module name="intro">An introduction of several words here.</module>
  <module name="guide">The guide covers <param name="topic" len="3"/> in depth.</module>
  <user>
</schema>
"""
PML = '<prompt schema="docs"><intro/><guide topic="parsing"/>Explain it.</user></prompt>'


class Server:
    """A uvicorn server for `app` on 127.0.0.1, on a thread; stopped by `stop()`."""

    def __init__(self, app, **options):
        self.config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                     lifespan="on", **options)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "none") -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, timeout=TIMEOUT,
                             max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(7, VOCAB)


def make_llm(model) -> LLM:
    """An engine whose store has no disk tier: nothing from other runs is served."""
    llm = LLM.from_model(model, WordTokenizer(VOCAB, bos=True),
                         store=ModuleStore(disk_budget_bytes=0))
    llm.add_schema(SCHEMA)
    return llm


@pytest.fixture(scope="module")
def served(model):
    llm = make_llm(model)
    server = Server(create_app(llm, model_name="tiny"))
    yield server, llm
    server.stop()


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    """POST `body` as JSON (or with `headers`); (status, the JSON answer)."""
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


# --- the API -------------------------------------------------------------------------------

def test_models_lists_the_one_model_served(served):
    server, _ = served
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert server.client().models.retrieve("tiny").id == "tiny"


def test_chat_completion_answers_with_usage_and_the_same_tokens_as_the_engine(served):
    server, llm = served
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say something about words."}]
    reply = server.client().chat.completions.create(model="tiny", messages=messages,
                                                    max_tokens=5, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 5 and reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    # the same request straight on the engine: the same text (greedy)
    from promptlang.server.prompts import ChatSchemas, parse_messages

    local = llm.generate(ChatSchemas(llm).prompt(parse_messages(messages)),
                         max_new_tokens=5, temperature=0)
    assert choice.message.content == local.text


def test_a_later_turn_reuses_the_earlier_messages_as_cached_tokens(served):
    server, _ = served
    client = server.client()
    history = [{"role": "system", "content": "You help with words."},
               {"role": "user", "content": "Tell me about the first document."}]
    first = client.chat.completions.create(model="tiny", messages=history, max_tokens=3,
                                           temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And the second one?"}]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=3,
                                            temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and second.usage.prompt_tokens > first.usage.prompt_tokens


def test_streamed_chat_sends_deltas_then_done_with_usage(served):
    server, _ = served
    stream = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Stream some words."}],
        max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 6
    whole = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Stream some words."}],
        max_tokens=6, temperature=0)
    assert text == whole.choices[0].message.content


def test_completions_stream_and_not(served):
    server, _ = served
    client = server.client()
    plain = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4,
                                      temperature=0)
    assert plain.object == "text_completion" and plain.usage.completion_tokens <= 4
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=4, temperature=0, stream=True))
    assert streamed == plain.choices[0].text


def test_pml_in_the_extension_field_is_served_from_cached_modules(served):
    server, llm = served

    def ask():
        return server.client().chat.completions.create(
            model="tiny", messages=[], max_tokens=4, temperature=0,
            extra_body={"promptlang": {"pml": PML}})
    first = ask()          # a new combination: guide, which missed intro, is recomputed
    local = llm.generate(PML, max_new_tokens=4, temperature=0)     # seen before: exact units
    again = ask()
    assert first.choices[0].message.content == again.choices[0].message.content == local.text
    assert again.usage.prompt_tokens_details.cached_tokens == local.cached_tokens > \
        first.usage.prompt_tokens_details.cached_tokens > 0
    assert again.usage.prompt_tokens == first.usage.prompt_tokens == \
        local.cached_tokens + local.prefill_tokens


def test_a_prompt_function_is_called_by_name(model):
    from promptlang import prompt, user

    @prompt
    def ask(topic: str):
        """Asks about a topic."""
        "Documents about many things.\n"
        with user():
            f"Tell me about {topic}."

    llm = make_llm(model)
    server = Server(create_app(llm, functions={"ask": ask}, model_name="tiny"))
    try:
        reply = server.client().chat.completions.create(
            model="tiny", messages=[], max_tokens=3, temperature=0,
            extra_body={"promptlang": {"function": "ask", "args": {"topic": "words"}}})
        assert reply.choices[0].message.content == llm.generate(
            ask(topic="words"), max_new_tokens=3, temperature=0).text
        with pytest.raises(openai.BadRequestError, match="unknown @prompt function 'nope'"):
            server.client().chat.completions.create(
                model="tiny", messages=[], extra_body={"promptlang": {"function": "nope"}})
    finally:
        server.stop()


# --- errors --------------------------------------------------------------------------------

def test_malformed_json_is_a_400_with_an_openai_error_object(served):
    server, _ = served
    status, body = post(server.url + "/v1/chat/completions", b'{"model": "tiny", "messa')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"


def test_pml_errors_are_400s_with_the_located_message(served):
    server, _ = served
    client = server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[], extra_body={
            "promptlang": {"pml": '<prompt schema="docs"><nowhere/>Hi</user></prompt>'}})
    assert "<request>:1:" in str(caught.value) and "nowhere" in str(caught.value)
    with pytest.raises(openai.BadRequestError, match="schema"):
        client.chat.completions.create(model="tiny", messages=[], extra_body={
            "promptlang": {"pml": '<prompt schema="missing">Hi</prompt>'}})
    with pytest.raises(openai.BadRequestError, match="exactly one of pml or function"):
        client.chat.completions.create(model="tiny", messages=[],
                                       extra_body={"promptlang": {}})


def test_a_prompt_longer_than_the_context_is_a_400(served):
    server, llm = served
    words = " ".join(["word"] * (llm.max_positions + 10))
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model="tiny", prompt=words, max_tokens=2)


def test_bad_fields_and_another_model_are_refused(served):
    server, _ = served
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model="tiny", n=2,
                                       messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", temperature=-1,
                                       messages=[{"role": "user", "content": "x"}])


def test_an_api_key_is_required_when_set(model):
    server = Server(create_app(make_llm(model), model_name="tiny", api_key="sekret"))
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").models.list()
        assert [m.id for m in server.client("sekret").models.list().data] == ["tiny"]
        with urllib.request.urlopen(server.url + "/health", timeout=TIMEOUT) as response:
            assert json.loads(response.read()) == {"status": "ok"}
    finally:
        server.stop()


class Gate:
    """Holds the engine thread inside a request until released (bounded wait)."""

    def __init__(self, llm):
        self.entered, self.release = threading.Event(), threading.Event()
        real = llm.start

        def held(*args, **kwargs):
            self.entered.set()
            self.release.wait(TIMEOUT)
            return real(*args, **kwargs)
        llm.start = held


def test_a_full_queue_answers_429(model):
    llm = make_llm(model)
    gate = Gate(llm)
    server = Server(create_app(llm, model_name="tiny", max_queue=1))
    body = json.dumps({"model": "tiny", "prompt": "one two", "max_tokens": 1}).encode()
    results: list = []
    try:
        threads = [threading.Thread(target=lambda: results.append(
            post(server.url + "/v1/completions", body))) for _ in range(2)]
        threads[0].start()
        assert gate.entered.wait(TIMEOUT)           # one running...
        threads[1].start()
        deadline = time.monotonic() + TIMEOUT       # ...and one waiting: the queue is full
        while server.server.config.app.state.promptlang.worker.queue_length < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status, error = post(server.url + "/v1/completions", body)
        assert status == 429 and error["error"]["type"] == "rate_limit_error"
        gate.release.set()
        for thread in threads:
            thread.join(TIMEOUT)
        assert sorted(status for status, _ in results) == [200, 200]
    finally:
        gate.release.set()
        server.stop()


def test_a_client_that_disconnects_mid_stream_frees_its_buffer(model):
    llm = make_llm(model)
    server = Server(create_app(llm, model_name="tiny"))
    try:
        state = server.server.config.app.state.promptlang
        stream = server.client().completions.create(model="tiny", prompt="go on and on",
                                                    max_tokens=400, temperature=0,
                                                    stream=True)
        next(iter(stream))
        stream.close()                                    # the client goes away
        deadline = time.monotonic() + TIMEOUT
        while state.worker.stats.cancelled < 1 or state.worker.busy:
            assert time.monotonic() < deadline, "the engine kept decoding for nobody"
            time.sleep(0.05)
        assert llm.assembler.in_use_bytes == 0            # the buffer is back in the pool
        reply = server.client().completions.create(model="tiny", prompt="again",
                                                   max_tokens=2)
        assert reply.usage.completion_tokens <= 2
    finally:
        server.stop()


def test_metrics_count_requests_tokens_and_cache_hits(served):
    server, _ = served
    server.client().chat.completions.create(model="tiny", messages=[], max_tokens=2,
                                            extra_body={"promptlang": {"pml": PML}})
    # the same completion twice: the second is served the first's prompt tail (PML's
    # argument is computed between cached modules, so its question leaves no tail)
    for _ in range(2):
        server.client().completions.create(model="tiny", prompt="tail of the prompt",
                                           max_tokens=2)
    with urllib.request.urlopen(server.url + "/metrics", timeout=TIMEOUT) as response:
        text = response.read().decode()
    assert 'promptlang_requests_total{endpoint="chat",status="200"}' in text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["promptlang_cached_tokens_total"] > 0
    assert values["promptlang_queue_length"] == 0
    assert values["promptlang_steps_total"] >= 1 and values["promptlang_engine_busy_seconds_total"] > 0
    assert sum(v for k, v in values.items() if k.startswith("promptlang_store_hits_total")) > 0
    assert values["promptlang_tail_hits_total"] >= 1
    assert values["promptlang_tail_reused_tokens_total"] >= values["promptlang_tail_hits_total"]
    assert values["promptlang_tail_bytes"] > 0


def test_the_server_binds_loopback_by_default():
    from promptlang.cli import build_parser
    from promptlang.server.load import DEFAULT_HOST

    args = build_parser().parse_args(["serve"])
    assert args.host == DEFAULT_HOST == "127.0.0.1" and args.port == 8000


def test_response_format_and_the_extensions_regex_constrain_the_answer(tiny_model_dir):
    pytest.importorskip("llguidance")
    from promptlang.runtime import engine

    llm = engine.load(str(tiny_model_dir), store=ModuleStore(disk_budget_bytes=0))
    llm.add_schema('<schema name="codes"><system>You write codes.</system></schema>')
    server = Server(create_app(llm, model_name="tiny"))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    ask = [{"role": "user", "content": "Reply in the format asked."}]
    try:
        client = server.client()
        reply = client.chat.completions.create(
            model="tiny", messages=ask, max_tokens=40, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "answer", "schema": schema}})
        value = json.loads(reply.choices[0].message.content)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
        anything = client.chat.completions.create(model="tiny", messages=ask, max_tokens=60,
                                                  temperature=0,
                                                  response_format={"type": "json_object"})
        text = anything.choices[0].message.content
        assert text.startswith("{")                  # cut or not, an object is being written
        if anything.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        coded = client.completions.create(model="tiny", prompt="x", max_tokens=10,
                                          temperature=0, extra_body={"promptlang": {
                                              "pml": '<prompt schema="codes">Code:</prompt>',
                                              "regex": "[A-Z]{3}"}})
        assert len(coded.choices[0].text) == 3 and coded.choices[0].text.isupper()
        with pytest.raises(openai.BadRequestError, match="bad regex"):
            client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={
                "promptlang": {"pml": '<prompt schema="codes">x</prompt>', "regex": "("}})
        with pytest.raises(openai.BadRequestError, match="response_format"):
            client.chat.completions.create(model="tiny", messages=ask,
                                           response_format={"type": "yaml"})
    finally:
        server.stop()


def test_load_schemas_reads_pml_files_folders_and_prompt_functions(model, tmp_path):
    from promptlang.errors import PromptLangError
    from promptlang.server.load import load_schemas

    folder = tmp_path / "schemas"
    folder.mkdir()
    (folder / "docs.pml").write_text(SCHEMA)
    (folder / "other.pml").write_text('<schema name="other"><system>Other.</system></schema>')
    app = tmp_path / "serve_app_mod.py"
    app.write_text("from promptlang import prompt, user\n\n"
                   "@prompt\n"
                   "def ask(topic: str):\n"
                   '    """Asks."""\n'
                   '    "Notes about things.\\n"\n'
                   "    with user():\n"
                   "        topic\n")
    llm = make_llm(model)
    functions = load_schemas(llm, [folder, app])
    assert set(functions) == {"ask"}
    assert llm.layout("other").schema.name == "other" and llm.layout("docs")
    (tmp_path / "prompt.pml").write_text(PML)
    with pytest.raises(PromptLangError, match="holds a prompt, not a schema"):
        load_schemas(llm, [tmp_path / "prompt.pml"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(PromptLangError, match="no .pml files"):
        load_schemas(llm, [tmp_path / "empty"])


def test_concurrent_requests_decode_together_and_answer_as_alone(model):
    """Continuous batching: requests that overlap share decode steps (one pass for all),
    and each answer is the one the request gets alone (greedy)."""
    from promptlang.runtime.fast import native

    if not native.available():
        pytest.skip("CPU kernels unavailable here: no fused batch")
    llm = make_llm(model)
    gate = Gate(llm)                     # hold the first request until all are queued
    server = Server(create_app(llm, model_name="tiny"))
    state = server.server.config.app.state.promptlang
    questions = [f"Question number {i} about the words here?" for i in range(4)]

    def ask(question):
        return server.client().chat.completions.create(
            model="tiny", max_tokens=16, temperature=0,
            messages=[{"role": "user", "content": question}]).choices[0].message.content
    try:
        answers: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, ask(questions[i])))
                   for i in range(4)]
        for thread in threads:
            thread.start()
        assert gate.entered.wait(TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while state.worker.queue_length < 3:               # the other three are waiting
            assert time.monotonic() < deadline
            time.sleep(0.02)
        gate.release.set()
        for thread in threads:
            thread.join(TIMEOUT)
        assert state.worker.stats.batched_steps > 0
        alone = {i: ask(q) for i, q in enumerate(questions)}   # one at a time now
        assert answers == alone
    finally:
        gate.release.set()
        server.stop()


# --- every client error is a 4xx error object, checked before any work is queued ------------

def engine_counts(server) -> tuple:
    stats = server.server.config.app.state.promptlang.worker.stats
    return stats.served, stats.failed, stats.cancelled, stats.steps


def assert_error(status: int, body: dict, expected: int, param: str | None = None) -> None:
    assert status == expected, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == ("server_error" if expected >= 500 else
                                     "invalid_request_error"), body
    if param is not None:
        assert body["error"]["param"] == param, body


BAD_FIELDS = [   # (endpoint, body, param): each a 400 that reaches no engine
    ("completions", {"prompt": "one two", "max_tokens": 400, "stream": True,
                     "stream_options": "x"}, "stream_options"),
    ("completions", {"prompt": "one two", "stream": True,
                     "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ("completions", {"prompt": "one two", "stream": "false"}, "stream"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "stream": 1}, "stream"),
    ("completions", {"prompt": "one two", "n": True}, "n"),
    ("completions", {"prompt": "one two", "max_tokens": True}, "max_tokens"),
    ("completions", {"prompt": "one two", "max_tokens": 2.5}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}],
              "max_completion_tokens": 0}, "max_completion_tokens"),
    ("completions", {"prompt": "one two", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "one two", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "one two", "seed": 1.5}, "seed"),
    ("completions", {"prompt": "one two", "stop": [1]}, "stop"),
    ("completions", {"prompt": "one two", "model": ["tiny"]}, "model"),
    ("completions", {"prompt": 7}, "prompt"),
    ("chat", {"messages": [{"role": "system", "content": "only a system turn"}]}, "messages"),
    ("chat", {"messages": [], "promptlang": {"pml": 3}}, "promptlang"),
    ("chat", {"messages": [], "promptlang": {"pml": PML, "recompute": "bogus"}}, "promptlang"),
    ("chat", {"messages": [], "promptlang": {"pml": PML, "regex": ""}}, "promptlang"),
    ("chat", {"messages": [], "promptlang": {"pml": PML, "regex": "a+"},
              "response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize("endpoint, body, param", BAD_FIELDS,
                         ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD_FIELDS)])
def test_a_bad_field_is_a_400_before_anything_is_queued(served, endpoint, body, param):
    server, _ = served
    before = engine_counts(server)
    status, answer = post(f"{server.url}/v1/{'chat/' if endpoint == 'chat' else ''}completions",
                          json.dumps(body).encode())
    assert_error(status, answer, 400, param)
    assert engine_counts(server) == before                    # no job reached the engine
    assert server.server.config.app.state.promptlang.worker.running == 0


def test_a_failure_after_the_job_is_queued_cancels_it(served, monkeypatch):
    """A fault between queueing and answering is a 500 error object, and the job is
    cancelled: it does not decode on to max_tokens for nobody."""
    from promptlang.server import app as app_module

    server, _ = served
    worker = server.server.config.app.state.promptlang.worker
    served_before, _, cancelled_before, _ = engine_counts(server)

    def broken():
        raise RuntimeError("a fault after the job was queued")
    monkeypatch.setattr(app_module.uuid, "uuid4", broken)
    for stream in (False, True):
        status, answer = post(server.url + "/v1/completions", json.dumps(
            {"prompt": "go on and on", "max_tokens": 400, "temperature": 0,
             "stream": stream}).encode())
        assert_error(status, answer, 500)
        assert answer["error"]["message"] == "internal error: RuntimeError"
    deadline = time.monotonic() + TIMEOUT
    while worker.stats.cancelled < cancelled_before + 2 or worker.running:
        assert time.monotonic() < deadline, "the jobs went on decoding"
        time.sleep(0.02)
    assert worker.stats.served == served_before


def test_a_fault_in_one_request_fails_it_alone_and_the_engine_goes_on(model, monkeypatch):
    """A request whose decoding raises gets a 500 error object; the engine thread lives on
    and counts nothing as running."""
    from promptlang.runtime.decoding.open_decode import Generation

    server = Server(create_app(make_llm(model), model_name="tiny"))
    worker = server.server.config.app.state.promptlang.worker
    try:
        real = Generation.delta

        def broken(self, text):
            raise RuntimeError("a fault while decoding")
        monkeypatch.setattr(Generation, "delta", broken)
        body = json.dumps({"prompt": "one two", "max_tokens": 3}).encode()
        status, answer = post(server.url + "/v1/completions", body)
        assert_error(status, answer, 500)
        assert worker._thread.is_alive() and worker.running == 0 and worker.stats.failed == 1
        monkeypatch.setattr(Generation, "delta", real)
        assert post(server.url + "/v1/completions", body)[0] == 200
    finally:
        server.stop()


def test_malformed_bodies_are_400s_not_500s(served):
    server, _ = served
    url = server.url + "/v1/chat/completions"
    hi = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", "application/json; charset=latin-1"):
        status, answer = post(url, hi, {"Content-Type": content_type})
        assert_error(status, answer, 400)
        assert "Content-Type" in answer["error"]["message"]
    assert post(url, hi, {"Content-Type": "application/json; charset=utf-8"})[0] == 200
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    shallow_but_too_deep = b'{"messages": ' + b"[" * 100 + b"]" * 100 + b"}"
    for body in (deep, shallow_but_too_deep, b"[" * 100_000 + b"]" * 100_000):
        status, answer = post(url, body)
        assert_error(status, answer, 400)
        assert "nested too deeply" in answer["error"]["message"]
    for body, param in [
            (b'{"messages": [{"role": "user", "content": "a \\ud800 b"}]}', "messages"),
            (b'{"messages": [{"role": "user", "content": [{"type": "text", '
             b'"text": "\\udfff"}]}]}', "messages"),
            (b'{"messages": [], "promptlang": {"pml": "<prompt schema=\\"docs\\">'
             b'<guide topic=\\"\\ud800\\"/></prompt>"}}', "promptlang"),
            (b'{"messages": [], "promptlang": {"function": "f", "args": {"x": "\\ud800"}}}',
             "promptlang"),
            (b'{"\\ud800": 1, "messages": []}', None)]:
        status, answer = post(url, body)
        assert_error(status, answer, 400, param)
        assert "surrogate" in answer["error"]["message"]
    status, answer = post(url, b'{"messages": [], "temperature": NaN}')
    assert_error(status, answer, 400)


def test_unknown_routes_and_methods_are_error_objects(served):
    server, _ = served
    status, answer = post(server.url + "/v1/nothing", b"{}")
    assert status == 404 and answer["error"]["type"] == "not_found_error"
    request = urllib.request.Request(server.url + "/v1/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=TIMEOUT)
    assert caught.value.code == 405 and "Allow" in caught.value.headers
    assert set(json.loads(caught.value.read())["error"]) == {"message", "type", "param", "code"}


def test_max_tokens_past_the_context_is_a_400(served):
    """As vLLM: prompt + max_tokens past the model's context is refused, not cut short."""
    server, llm = served
    limit = llm.max_positions
    url = server.url + "/v1/completions"
    before = engine_counts(server)
    status, answer = post(url, json.dumps({"prompt": "one two", "max_tokens": limit + 1}).encode())
    assert_error(status, answer, 400, "max_tokens")
    assert engine_counts(server) == before                      # refused before queueing
    status, answer = post(url, json.dumps({"prompt": "one two three",
                                           "max_tokens": limit - 2}).encode())
    assert_error(status, answer, 400, "max_tokens")
    assert f"context is {limit:,} tokens" in answer["error"]["message"]
    assert server.server.config.app.state.promptlang.worker.running == 0
    status, answer = post(url, json.dumps({"prompt": "one two", "max_tokens": 2}).encode())
    assert status == 200


def test_one_token_prompts_and_bad_text_with_the_default_tokenizer(tiny_model_dir):
    """The real default tokenizer: a one-token completion prompt ("hi") is served (token
    healing leaves a prompt's only token alone), and a lone surrogate, which its tokenizer
    cannot take, is a 400."""
    from promptlang.runtime import engine

    llm = engine.load(str(tiny_model_dir), store=ModuleStore(disk_budget_bytes=0))
    llm.add_schema('<schema name="s"><system>Notes.</system>'
                   '<module name="m"><param name="x" len="4"/></module></schema>')
    server = Server(create_app(llm, model_name="tiny"))
    try:
        client = server.client()
        for prompt in ("hi", "The", "a"):
            assert len(llm.tokenizer.encode(prompt)) == 1
            reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                              temperature=0)
            assert reply.usage.completion_tokens >= 1
            streamed = list(client.completions.create(model="tiny", prompt=prompt,
                                                      max_tokens=2, temperature=0,
                                                      stream=True))
            assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text
        url = server.url + "/v1/completions"
        for body in (b'{"prompt": "\\ud800"}',
                     b'{"prompt": "x", "promptlang": {"pml": "<prompt schema=\\"s\\">'
                     b'<m x=\\"\\ud800\\"/></prompt>"}}'):
            status, answer = post(url, body)
            assert_error(status, answer, 400)
        status, answer = post(server.url + "/v1/chat/completions",
                              b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
        assert_error(status, answer, 400)
        assert server.server.config.app.state.promptlang.worker.stats.failed == 0
    finally:
        server.stop()


# --- connections ---------------------------------------------------------------------------

def test_a_connection_that_sends_half_a_body_is_answered_408_and_closed(model):
    llm = make_llm(model)
    server = Server(create_app(llm, model_name="tiny", body_timeout=1.0))
    try:
        body = json.dumps({"prompt": "one two", "max_tokens": 1}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        began = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
            sock.sendall(head.encode() + body[:len(body) // 2])
            received = b""
            for _ in range(1000):                 # until the server closes the connection
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
                assert time.monotonic() - began < TIMEOUT
        assert time.monotonic() - began < 20
        status_line, _, rest = received.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 408"), received[:200]
        assert b"connection: close" in rest.lower()
        answer = json.loads(rest.partition(b"\r\n\r\n")[2])
        assert "did not arrive within 1 s" in answer["error"]["message"]
        assert server.server.config.app.state.promptlang.worker.stats.served == 0
    finally:
        server.stop()


def test_the_servers_connection_limits_are_uvicorns(model):
    from promptlang.server.load import LIMIT_CONCURRENCY, uvicorn_limits

    limits = uvicorn_limits()
    config = uvicorn.Config(create_app(make_llm(model)), **limits)
    assert config.limit_concurrency == LIMIT_CONCURRENCY and config.timeout_keep_alive == 5
    assert config.h11_max_incomplete_event_size == 16 << 10
    server = Server(create_app(make_llm(model), model_name="tiny"),
                    **uvicorn_limits(limit_concurrency=2, timeout_keep_alive=1))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as idle:
            began = time.monotonic()
            idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert idle.recv(65536).startswith(b"HTTP/1.1 200")
            with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as more:
                more.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert more.recv(65536).startswith(b"HTTP/1.1 503")   # 2 connections held
            for _ in range(1000):             # the idle keep-alive connection is closed
                if not idle.recv(65536):
                    break
            assert time.monotonic() - began < 20
    finally:
        server.stop()


def test_headers_that_trickle_in_past_the_deadline_get_408_and_the_connection_closes(model):
    """uvicorn arms no timer while a request's headers arrive (server/protocol.py): a
    client sending them a byte at a time is answered 408 once the header deadline passes,
    on a new connection and on a keep-alive one after its first response; other clients are
    served meanwhile, and headers past max_header_bytes are refused (h11 enforces it)."""
    from promptlang.server.load import uvicorn_limits

    server = Server(create_app(make_llm(model), model_name="tiny"),
                    **uvicorn_limits(header_timeout=1.0, timeout_keep_alive=30))
    try:
        def trickle(conn: socket.socket) -> bytes:
            began = time.monotonic()
            received = b""
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    break                              # closed on us: the deadline passed
                time.sleep(0.05)
                if time.monotonic() - began > 8:
                    break
            conn.settimeout(TIMEOUT)
            while chunk := conn.recv(65536):
                received += chunk
            assert time.monotonic() - began < 8
            return received

        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as slow:
            with urllib.request.urlopen(server.url + "/health", timeout=TIMEOUT) as response:
                assert response.status == 200          # others are served meanwhile
            received = trickle(slow)
        assert received.startswith(b"HTTP/1.1 408"), received[:200]
        assert b"did not arrive within 1 s" in received
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as kept:
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = kept.recv(65536)
            assert first.startswith(b"HTTP/1.1 200")
            assert trickle(kept).startswith(b"HTTP/1.1 408")
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as big:
            big.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (32 << 10)
                        + b"\r\n\r\n")
            assert big.recv(65536).startswith(b"HTTP/1.1 431")
    finally:
        server.stop()


def test_a_bounded_store_stays_under_its_budgets_over_many_distinct_chat_prefixes(model,
                                                                                  tmp_path):
    memory_budget = 24_000
    disk_budget = 48_000
    store = ModuleStore(device_budget_bytes=memory_budget, disk_dir=tmp_path / "kv",
                        disk_budget_bytes=disk_budget)
    llm = LLM.from_model(model, WordTokenizer(VOCAB, bos=True), store=store)
    server = Server(create_app(llm, model_name="tiny"))
    try:
        for i in range(30):
            words = " ".join(f"w{(i * 37 + j) % 900}" for j in range(40))
            server.client().chat.completions.create(
                model="tiny", max_tokens=1,
                messages=[{"role": "system", "content": f"note {i}: {words}"},
                          {"role": "user", "content": "go"}])
            on_disk = sum(p.stat().st_size for p in (tmp_path / "kv").glob("*.safetensors"))
            assert store.stats.device_bytes <= memory_budget
            assert on_disk <= disk_budget
        with urllib.request.urlopen(server.url + "/metrics", timeout=TIMEOUT) as response:
            text = response.read().decode()
    finally:
        server.stop()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['promptlang_store_evictions_total{tier="device"}'] > 0
    assert values['promptlang_store_evictions_total{tier="disk"}'] > 0
    assert values["promptlang_store_memory_budget_bytes"] == memory_budget
    assert 0 < values["promptlang_store_memory_bytes"] <= memory_budget


def test_a_body_of_megabytes_is_checked_off_the_event_loop_with_the_same_answers(
        served, monkeypatch):
    from promptlang.server import app as app_module

    server, _ = served
    threads = []
    original = app_module._decoded
    monkeypatch.setattr(app_module, "_decoded", lambda raw: threads.append(
        threading.current_thread().name) or original(raw))
    big = "word " * (app_module.OFF_LOOP_BYTES // 5 + 1)
    status, answer = post(server.url + "/v1/completions",
                          (json.dumps({"model": "tiny", "prompt": big})[:-1]).encode())
    assert status == 400 and "not valid JSON" in answer["error"]["message"]
    status, answer = post(server.url + "/v1/completions",
                          json.dumps({"model": "tiny", "prompt": big, "stream": "x"}).encode())
    assert status == 400 and answer["error"]["param"] == "stream"
    status, answer = post(server.url + "/v1/completions",
                          json.dumps({"model": "tiny", "prompt": "a b", "stream": "x"}).encode())
    assert status == 400 and answer["error"]["param"] == "stream"
    # the small body on the event loop's thread, the big ones on threads of their own
    assert threads == [threads[0], threads[1], server.thread.name]
    assert server.thread.name not in threads[:2]


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(tiny_model_dir, tmp_path,
                                                                   monkeypatch):
    from promptlang.runtime import engine

    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    llm = engine.load(tiny_model_dir, disk_budget_bytes=0)        # context: 1,024 tokens
    encoded = []
    original = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda text: encoded.append(len(text))
                        or original(text))
    server = Server(create_app(llm, model_name="tiny"))
    try:
        huge = "word " * 400_000                                    # 2 MB of text
        status, answer = post(server.url + "/v1/completions",
                              json.dumps({"model": "tiny", "prompt": huge}).encode())
        assert status == 400 and answer["error"]["param"] == "prompt"
        assert "this model's context is 1,024" in answer["error"]["message"]
        status, answer = post(server.url + "/v1/chat/completions", json.dumps(
            {"model": "tiny", "messages": [{"role": "user", "content": huge}]}).encode())
        assert status == 400 and answer["error"]["param"] == "messages"
        assert not any(n >= len(huge) for n in encoded)              # never tokenized
        status, _ = post(server.url + "/v1/completions",
                         json.dumps({"model": "tiny", "prompt": "a short one",
                                     "max_tokens": 2}).encode())
        assert status == 200
    finally:
        server.stop()


def test_long_texts_are_tokenized_before_the_engine_thread_takes_the_request(model,
                                                                           monkeypatch):
    """A request's long texts are tokenized on a request thread by a twin of the engine's
    tokenizer; the engine thread takes their ids and never tokenizes them itself, and texts
    that alone pass the context are a 400 before anything is queued."""
    from promptlang.tokenizer import PreparedIds

    llm = make_llm(model)
    server = Server(create_app(llm, model_name="tiny"))
    engine_tokenizer = llm.tokenizer
    assert isinstance(engine_tokenizer.prepared, PreparedIds)
    tokenized_long = []
    real = WordTokenizer.encode

    def spy(self, text):
        long = len(text) >= PreparedIds.MIN_CHARS
        kept = self is engine_tokenizer and text in engine_tokenizer.prepared
        if long and not kept:
            tokenized_long.append(("engine" if self is engine_tokenizer else "twin",
                                   threading.current_thread().name))
        return real(self, text)
    monkeypatch.setattr(WordTokenizer, "encode", spy)
    try:
        text = "abcdefghijklmnopqrstuvw " * 180             # 4,320 characters, 180 tokens
        status, answer = post(server.url + "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": text, "max_tokens": 1}).encode())
        assert status == 200, answer
        assert [who for who, _ in tokenized_long] == ["twin"]
        assert len(engine_tokenizer.prepared) == 0          # discarded once it was opened
        tokenized_long.clear()
        too_long = "wordwordword " * (llm.max_positions + 10)        # over 4,096 characters
        status, answer = post(server.url + "/v1/chat/completions", json.dumps(
            {"model": "tiny", "max_tokens": 1,
             "messages": [{"role": "user", "content": too_long}]}).encode())
        assert status == 400 and "context" in answer["error"]["message"]
        assert answer["error"]["param"] == "messages"
        assert [who for who, _ in tokenized_long] == ["twin"]
    finally:
        server.stop()
