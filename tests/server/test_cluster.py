"""promptlang on Ray Serve (promptlang/server/cluster.py, router.py): a local cluster on
127.0.0.1 with 2 engine replicas of the default model, driven over HTTP.

Skipped only where Ray Serve is not installed (the `cluster` extra; CI installs it). Every
request loop is bounded in count and has a client timeout. The kill test is the last to use
the cluster: it leaves Serve starting a replacement replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import socket
import time

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e "
                                        "'.[cluster]' (CI installs it)")

from promptlang.server.cluster import (ATTEMPT_HEADER, REPLICA_HEADER,  # noqa: E402
                                       Call, ClusterConfig, EngineReplica, asgi_messages,
                                       build_app)
from promptlang.server.routing import SchemaBook, route  # noqa: E402

DOCS = 6
TIMEOUT = 180.0           # seconds, any one request
LONG = "Write out every item of document {doc}, one per line, word for word."


def schema_text() -> str:
    docs = "\n".join(
        f'  <module name="d{i}">Document {i}: ' + " ".join(
            f"Item {j} of document {i} is the number {i * 7 + j}." for j in range(8))
        + "</module>" for i in range(DOCS))
    return f'<schema name="docs">\n  <system>Answer from the documents.</system>\n{docs}\n</schema>\n'


def pml_body(docs, max_tokens: int = 6, stream: bool = False,
             question: str = "What is item 3 of document {doc}?") -> dict:
    refs = "".join(f"<d{d}/>" for d in docs)
    question = f"<user>{question.format(doc=docs[0])}</user><assistant>"
    return {"model": "promptlang", "prompt": "", "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, "promptlang": {"pml": f'<prompt schema="docs">{refs}{question}'
                                                    "</prompt>"}}


@pytest.fixture(scope="module")
def schemas(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cluster-schemas")
    (folder / "docs.pml").write_text(schema_text())
    return folder


def test_cluster_settings_are_checked(tmp_path):
    from promptlang.errors import PromptLangError

    config = ClusterConfig.from_args({"store": str(tmp_path), "replicas": "3",
                                      "schemas": "a.pml,b.py", "imbalanced_threshold": "2.5"})
    assert (config.replicas, config.schemas, config.imbalanced_threshold) \
        == (3, ["a.pml", "b.py"], 2.5)
    for bad, message in (({"store": "x", "replica": 2}, "unknown cluster setting"),
                         ({"replicas": 2}, "store=FOLDER"),
                         ({"store": "x", "replicas": "two"}, "not a number"),
                         ({"store": "x", "router": "random"}, "router must be one of"),
                         ({"store": "x", "replicas": 0}, "at least 1")):
        with pytest.raises(PromptLangError, match=message):
            ClusterConfig.from_args(bad)


def completion_call(replica, schemas, body: dict):
    """The ingress's routing of `body` (a /v1/completions request) and a coroutine function
    running it on `replica`'s app in this process (the ASGI bridge): its messages."""
    found = route(body, False, SchemaBook([_parsed(schemas)]))
    call = Call("POST", "/v1/completions", [("content-type", "application/json")],
                json.dumps(body).encode(), found.modules, found.prompt)

    async def collect():
        return [message async for message in asgi_messages(replica.app, call, "r1")]
    return found, collect


def test_a_replica_runs_the_server_app_and_reports_the_modules_it_holds(schemas, tmp_path):
    """In this process, outside Ray: the ASGI bridge and the routing report."""
    budget = 64 << 20
    replica = EngineReplica({"store": str(tmp_path / "kv"), "schemas": [str(schemas)],
                             "replicas": 1, "threads": 2, "device_budget_bytes": budget})
    found, collect = completion_call(replica, schemas, pml_body([1, 0]))
    try:
        messages = asyncio.run(collect())
        (kind, status, headers), *chunks = messages
        assert (kind, status) == ("start", 200) and (REPLICA_HEADER, "r1") in headers
        answer = json.loads(b"".join(chunk for _, chunk, _ in chunks))
        assert answer["promptlang"]["units"] == {"encoded": 3}       # system, d1, d0
        stats = replica.record_routing_stats()
        held, capacity = stats["held"], stats["capacity"]
        assert held == found.keys
        units = {key for keys, _ in replica._held.values() for key in keys}
        stored = sum(replica.llm.store.memory_bytes(key) for key in units)
        assert len(units) == 3 and stored > 0
        # the memory budget in the ingress's weight units, at the bytes per weight held
        assert capacity == pytest.approx(budget * sum(held.values()) / stored)
        replica.llm.store.clear(tiers=["device", "host"])             # evicted: not held
        assert replica.record_routing_stats()["held"] == {}
        again = json.loads(b"".join(c for _, c, _ in asyncio.run(collect())[1:]))
        assert again["promptlang"]["units"] == {"disk": 3}           # the shared disk tier
        assert again["choices"][0]["text"] == answer["choices"][0]["text"]
    finally:
        replica.app.state.promptlang.worker.close()


def _parsed(schemas):
    from promptlang.pml.parser import parse_file

    return parse_file(schemas / "docs.pml")


# --- a local Ray Serve cluster -------------------------------------------------------------

class Cluster:
    def __init__(self, port: int, store):
        self.port, self.store = port, store

    def post(self, path: str, body: dict) -> tuple[int, dict, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT)
        try:
            conn.request("POST", path, body=json.dumps(body).encode(),
                         headers={"content-type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, \
                json.loads(data)
        finally:
            conn.close()

    def ask(self, docs, **options) -> tuple[str, dict]:
        replica, answer, _ = self.ask_counted(docs, **options)
        return replica, answer

    def ask_counted(self, docs, **options) -> tuple[str, dict, int]:
        """(the replica that answered, the answer, the ingress's attempts)."""
        status, headers, answer = self.post("/v1/completions", pml_body(docs, **options))
        assert status == 200, answer
        return headers[REPLICA_HEADER], answer, int(headers.get(ATTEMPT_HEADER, 1))


@pytest.fixture(scope="module")
def cluster(schemas, tmp_path_factory):
    import ray
    from ray import serve

    store = tmp_path_factory.mktemp("cluster-store")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"store": str(store), "schemas": [str(schemas)], "replicas": 2,
                             "threads": 1, "stats_period_s": 0.5}),
                  name="promptlang", route_prefix="/")
        yield Cluster(port, store)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_the_cluster_serves_the_openai_api(cluster):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.port}/v1", api_key="none",
                           timeout=TIMEOUT, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["promptlang"]
    chat = client.chat.completions.create(
        model="promptlang", messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=5, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 5
    body = pml_body([2, 3])
    pieces = list(client.completions.create(
        model="promptlang", prompt="", max_tokens=6, temperature=0, stream=True,
        extra_body={"promptlang": body["promptlang"]}))
    streamed = "".join(p.choices[0].text for p in pieces if p.choices)
    _, whole = cluster.ask([2, 3])
    assert streamed == whole["choices"][0]["text"] and streamed
    with pytest.raises(openai.BadRequestError, match="<request>:1:"):
        client.completions.create(model="promptlang", prompt="", max_tokens=2,
                                  extra_body={"promptlang": {"pml": "<prompt schema='docs'>"}})


def test_requests_follow_the_replica_holding_their_modules(cluster):
    first, answer = cluster.ask([0, 1])
    assert answer["promptlang"]["units"].get("device", 0) < 3     # not held before
    time.sleep(1.5)                                               # a routing report or two
    again, answer = cluster.ask([1, 0, 4])                        # 2 of its 3 documents
    assert again == first
    other, answer = cluster.ask([5, 4, 3])
    assert other != first                       # mostly new modules: the other replica
    for docs, where in (([0, 1], first), ([3, 5], other), ([4, 1, 0], first)):
        replica, answer = cluster.ask(docs)
        assert replica == where, docs
        assert answer["promptlang"]["units"].get("encoded", 0) == 0


def test_load_imbalance_outweighs_affinity(cluster):
    """12 long requests for modules one replica holds, sent 0.1 s apart: past the imbalance
    threshold (4 queued) some go to the other replica. Each answer must take its whole
    160 tokens for the requests to pile up: the short question's answer ends after 15
    tokens whatever `max_tokens` says, so each was answered in ~0.1 s and the holder's queue
    rarely passed the threshold (all 12 went to it in some runs); the question asking for
    every item of the document runs to `max_tokens` (checked below)."""
    holder, _ = cluster.ask([0, 1])

    def ask(i: int) -> tuple[str, int]:
        time.sleep(0.1 * i)
        replica, answer = cluster.ask([0, 1], max_tokens=160, question=LONG)
        return replica, answer["usage"]["completion_tokens"]

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        served = list(pool.map(ask, range(12)))
    assert all(tokens == 160 for _, tokens in served), served
    replicas = [replica for replica, _ in served]
    assert replicas.count(holder) >= 4 and replicas.count(holder) < 12, replicas


def test_killing_a_replica_mid_load_loses_no_request(cluster):
    """Eight requests of up to 160 tokens, most for the victim's modules; the victim is
    killed 1 s in, while it is still decoding them (with 32 tokens each, as this test asked
    before, a faster engine had answered all eight within the second and nothing was sent
    again)."""
    import ray
    from ray.serve._private.common import DeploymentID, ReplicaID

    from promptlang.runtime.store import ModuleStore

    victim, _ = cluster.ask([0, 1])
    replica = ReplicaID(victim, DeploymentID(name="promptlang-engine", app_name="promptlang"))
    actor = ray.get_actor(replica.to_full_id_str(), namespace="serve")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        asks = [pool.submit(cluster.ask_counted, docs, max_tokens=160, question=LONG)
                for docs in ([0, 1], [1, 0], [0, 1, 2], [2, 3], [4, 5], [1, 0], [0, 1],
                             [3, 2])]
        time.sleep(1.0)
        ray.kill(actor, no_restart=True)
        served = [ask.result(timeout=TIMEOUT) for ask in asks]     # raises on any loss
    assert all(answer["choices"][0]["text"] for _, answer, _ in served)
    assert any(replica != victim for replica, _, _ in served)     # the survivor answered
    # some had reached the victim, and were sent again by the ingress
    assert max(attempts for _, _, attempts in served) >= 2, (victim, [(r, a, x["usage"]) for r, x, a in served])
    store = ModuleStore(disk_dir=cluster.store, device_budget_bytes=0)
    entries = store.entries()
    assert entries and all(store.get(entry.key) is not None for entry in entries)
    assert store.stats.corrupt_files == 0


def test_the_documented_serve_config_builds(monkeypatch):
    """examples/serve-cluster.yaml: its import path is build_app and its args are valid."""
    import importlib
    import pathlib

    import yaml

    root = pathlib.Path(__file__).resolve().parents[2]
    config = yaml.safe_load((root / "examples" / "serve-cluster.yaml").read_text())
    (app,) = config["applications"]
    module, _, name = app["import_path"].partition(":")
    assert getattr(importlib.import_module(module), name) is build_app
    settings = ClusterConfig.from_args(app["args"])
    assert settings.router == "affinity" and config["http_options"]["host"] == "127.0.0.1"
    monkeypatch.chdir(root)
    from promptlang.server.load import read_sources

    schemas, _ = read_sources(settings.schemas)            # what the replicas will load
    assert schemas


def test_a_replica_reports_the_primed_entries_it_served(schemas, tmp_path):
    """Under a "+primed" policy a module after another is served its primed entry: that is
    the store key the routing report must name (the plain one was never encoded)."""
    replica = EngineReplica({"store": str(tmp_path / "kv"), "schemas": [str(schemas)],
                             "replicas": 1, "threads": 2})
    body = pml_body([0, 1])
    body["promptlang"]["recompute"] = "primed"
    found, collect = completion_call(replica, schemas, body)
    try:
        (kind, status, _), *_ = asyncio.run(collect())
        assert (kind, status) == ("start", 200)
        held = replica.record_routing_stats()["held"]
        assert held == found.keys
        units = {key for keys, _ in replica._held.values() for key in keys}
        assert len(units) == 3 and all(replica.llm.store.memory_bytes(k) > 0 for k in units)
    finally:
        replica.app.state.promptlang.worker.close()


def test_two_replicas_keep_their_shared_folder_within_the_disk_budget(schemas, tmp_path):
    """Two replicas on one folder with a disk budget: each trims the folder, counting the
    other's files too, so the folder never holds more than the budget; units evicted from
    disk are encoded again and answer the same."""
    folder = tmp_path / "kv"
    budget = 6 << 20
    config = {"store": str(folder), "schemas": [str(schemas)], "replicas": 2, "threads": 1,
              "disk_budget_bytes": budget}
    replicas = [EngineReplica(config), EngineReplica(config)]

    def folder_bytes() -> int:
        return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())

    answers = {}
    try:
        for step in range(2 * DOCS):           # bounded: each document pair twice
            docs = [step % DOCS, (step + 1) % DOCS]
            replica = replicas[step % 2]
            _, collect = completion_call(replica, schemas, pml_body(docs))
            (kind, status, _), *chunks = asyncio.run(collect())
            assert (kind, status) == ("start", 200)
            text = json.loads(b"".join(c for _, c, _ in chunks))["choices"][0]["text"]
            assert answers.setdefault(tuple(docs), text) == text
            assert 0 < folder_bytes() <= budget, step
        evicted = sum(r.llm.store.stats.disk_evictions for r in replicas)
        assert evicted > 0                     # the budget was reached and held
        assert all(r.llm.store.stats.disk_evictions > 0 for r in replicas)
    finally:
        for replica in replicas:
            replica.app.state.promptlang.worker.close()
