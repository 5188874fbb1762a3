"""Routing keys read from request bodies without the model (promptlang/server/routing.py)."""

from __future__ import annotations

from promptlang.pml.parser import parse_schema
from promptlang.server.routing import SchemaBook, route

SCHEMA = parse_schema("""
<schema name="docs">
  <system>Answer from the documents.</system>
  <module name="d0">Document zero is about cats.</module>
  <module name="d1">Document one is about dogs and owls.</module>
  <module name="d2">Document two.<module name="notes">Its notes.</module></module>
  <union><module name="en">In English.</module><module name="fr">En français.</module></union>
  <module name="city">The city is <param name="place" len="8"/>.</module>
</schema>""")
BOOK = SchemaBook([SCHEMA])


def pml(body: str) -> dict:
    return {"promptlang": {"pml": f'<prompt schema="docs">{body}</prompt>'}}


def test_a_module_has_one_key_whatever_its_order_and_neighbours():
    first = route(pml("<d0/><d1/>Which one?"), False, BOOK)
    second = route(pml("<d1/><d2/><d0/>Another question"), True, BOOK)
    assert set(first.modules) == {"", "d0", "d1"}
    assert set(second.modules) == {"", "d0", "d1", "d2"}
    for path in ("", "d0", "d1"):
        assert first.modules[path] == second.modules[path]
    assert len({key for key, _ in second.modules.values()}) == 4
    # weights: the module's own text, in characters (a stand-in for its KV bytes)
    assert first.modules["d1"][1] == len("Document one is about dogs and owls.")
    assert first.keys == {key: weight for key, weight in first.modules.values()}


def test_nested_modules_union_members_and_arguments():
    found = route(pml('<d2><notes/></d2><fr/><city place="Oslo"/>'), False, BOOK)
    assert set(found.modules) == {"", "d2", "d2/notes", "fr", "city"}
    assert found.modules["d2"][1] == len("Document two.")         # its child is its own unit
    other = route(pml('<city place="Rome"/>'), False, BOOK)
    assert other.modules["city"] == found.modules["city"]         # arguments are per request
    assert "Oslo" in found.prompt and found.prompt.index("Document two.") \
        < found.prompt.index("Its notes.")


def test_chat_messages_keep_their_keys_from_turn_to_turn():
    system = {"role": "system", "content": "Be brief."}
    turn1 = [system, {"role": "user", "content": "Hello"}]
    turn2 = turn1 + [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "?"}]
    first, second = route({"messages": turn1}, True, BOOK), route({"messages": turn2}, True, BOOK)
    assert set(first.modules) == {""}                 # the last message is new text
    assert set(second.modules) == {"", "m0", "m1"}
    assert second.modules[""] == first.modules[""]
    other = route({"messages": [{"role": "system", "content": "Be long."}] + turn2[1:]},
                  True, BOOK)
    assert other.modules["m0"] != second.modules["m0"]   # a message's KV depends on before it
    assert second.prompt == "Be brief.HelloHi.?"


def test_what_the_replica_will_refuse_routes_nowhere():
    for body in ({"promptlang": {"pml": "<prompt schema='docs'><d0/>"}},   # unclosed
                 {"promptlang": {"pml": '<prompt schema="other"><d0/></prompt>'}},
                 {"promptlang": {"function": "unknown"}},
                 {"messages": "not a list"}, ["not", "an", "object"]):
        assert route(body, True, BOOK).modules == {}
    assert route({"prompt": "plain text"}, False, BOOK).prompt == "plain text"
    assert route({"prompt": "plain text"}, False, BOOK).modules == {}


def test_a_prompt_function_routes_by_its_compiled_schema(tmp_path):
    from promptlang.server.load import read_sources

    app = tmp_path / "routing_app_mod.py"
    app.write_text("from promptlang import prompt, user\n\n"
                   "@prompt\n"
                   "def ask(topic: str, long: bool = False):\n"
                   '    """Asks."""\n'
                   '    "Notes about things.\\n"\n'
                   "    if long:\n"
                   '        "Answer at length, with examples and sources.\\n"\n'
                   "    with user():\n"
                   "        topic\n")
    schemas, functions = read_sources([app])
    book = SchemaBook(schemas, functions)
    short = route({"promptlang": {"function": "ask", "args": {"topic": "owls"}}}, True, book)
    long = route({"promptlang": {"function": "ask", "args": {"topic": "bats", "long": True}}},
                 True, book)
    assert short.modules and set(short.modules) < set(long.modules)
    assert all(long.modules[path] == short.modules[path] for path in short.modules)
    assert "Answer at length" in long.prompt and "Answer at length" not in short.prompt
