"""The RAG workload of `bench latency`: the request plan, the prefix-cache policy's
longest-prefix logic, the request-order token sequence, and the policy on a tiny model
(reusing a prefix gives the logits of a full prefill of the same tokens)."""

import pytest
import torch

from promptlang.errors import PromptLangError
from promptlang.bench import rag
from promptlang.runtime.engine import LLM
from tests.runtime.tiny import tiny_llama


def test_plan_is_deterministic_for_a_seed_and_differs_across_seeds():
    assert rag.plan_requests(8, 4, 12, seed=1) == rag.plan_requests(8, 4, 12, seed=1)
    assert rag.plan_requests(8, 4, 12, seed=1) != rag.plan_requests(8, 4, 12, seed=2)


def test_plan_varies_combinations_and_orders_and_labels_each_truthfully():
    plan = rag.plan_requests(8, 4, 12)
    assert len({frozenset(r.docs) for r in plan}) >= 5           # varying combinations
    assert {r.kind for r in plan} == set(rag.KINDS)
    for j, request in enumerate(plan):
        assert len(request.docs) == len(set(request.docs)) == 4
        assert all(0 <= i < 8 for i in request.docs) and request.question_of in request.docs
        earlier = [r.docs for r in plan[:j]]
        if request.kind == "repeat":
            assert request.docs in earlier
        elif request.kind == "reordered":
            assert request.docs not in earlier
            assert any(set(d) == set(request.docs) for d in earlier)
        else:
            assert all(set(d) != set(request.docs) for d in earlier)
    assert plan[0].kind == "new"


def test_a_repeated_order_asks_a_new_question_while_one_is_left():
    plan = rag.plan_requests(8, 4, 12)
    for j, request in enumerate(plan):
        if request.kind == "repeat":
            asked = {r.question_of for r in plan[:j] if r.docs == request.docs}
            assert request.question_of not in asked


def test_plan_falls_back_when_no_new_set_is_left():
    # 2 of 2 documents: one set only; later "new" requests become reorders or repeats
    plan = rag.plan_requests(2, 2, 6)
    assert plan[0].kind == "new" and all(r.kind != "new" for r in plan[1:])
    assert {r.docs for r in plan} == {(0, 1), (1, 0)}
    with pytest.raises(ValueError):
        rag.plan_requests(3, 4, 2)


def test_options_reject_more_documents_per_request_than_exist():
    with pytest.raises(PromptLangError, match="--rag-k"):
        rag.RagOptions(docs=3, k=4).check()


def test_common_prefix_counts_leading_equal_tokens_only():
    assert rag.common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert rag.common_prefix([1, 2], [1, 2, 3]) == 2
    assert rag.common_prefix([5], [1]) == 0
    assert rag.common_prefix([], [1]) == 0


def test_longest_prefix_picks_the_kept_sequence_sharing_most():
    kept = [[1, 2, 3], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7]]
    assert rag.longest_prefix(kept, [1, 2, 3, 4, 5, 9]) == (1, 5)
    assert rag.longest_prefix(kept, [1, 2, 8]) == (0, 2)          # ties: the earliest
    assert rag.longest_prefix(kept, [9, 1, 2]) == (None, 0)
    assert rag.longest_prefix([], [1]) == (None, 0)


@pytest.fixture
def engine(default_tokenizer):
    model = tiny_llama(0, 49152, max_positions=1024)      # the default tokenizer's vocabulary
    return LLM.from_model(model, default_tokenizer)


def texts_and_schema(engine):
    texts = [f"Document {i} says that the {w} harbour opens at {i + 5} o'clock."
             for i, w in enumerate(("old", "new", "north"))]
    return texts, engine.add_schema(rag.build_schema(texts))


def test_request_order_puts_the_documents_in_the_requests_order(engine):
    texts, _ = texts_and_schema(engine)
    bound = engine.bind(rag.build_prompt([2, 0], "When does it open?"))
    in_order = rag.request_order_ids(bound, [2, 0])
    schema_order = rag.request_order_ids(bound, [0, 2])
    assert schema_order == bound.token_ids()                       # positions' order
    assert sorted(in_order) == sorted(schema_order) and in_order != schema_order
    tok = engine.tokenizer
    text = tok.decode(in_order)
    assert text.index("Document 2") < text.index("Document 0") < text.index("Question:")
    assert text.index(rag.qa.SYSTEM_PROMPT) < text.index("Document 2")


def test_prefix_policy_reuses_the_longest_prefix_and_matches_a_full_prefill(engine):
    texts, _ = texts_and_schema(engine)
    cache = rag.PrefixCache(engine)
    first = rag.request_order_ids(engine.bind(rag.build_prompt([0, 1], "When?")), [0, 1])
    second = rag.request_order_ids(engine.bind(rag.build_prompt([0, 2], "Where?")), [0, 2])
    assert cache.serve(first).reused == 0                          # nothing kept yet
    served = cache.serve(second)
    assert served.reused == rag.common_prefix(first, second) > 0
    full = cache.serve(second, reuse=False, keep=False)
    assert full.reused == 0 and len(cache.kept) == 2               # the full pass is not kept
    torch.testing.assert_close(served.logits, full.logits, atol=1e-4, rtol=0)
    again = cache.serve(second)                                    # all but the last token
    assert again.reused == len(second) - 1
    torch.testing.assert_close(again.logits, full.logits, atol=1e-4, rtol=0)


def test_run_rag_measures_every_request_three_ways(engine):
    options = rag.RagOptions(docs=3, k=2, requests=4, doc_tokens=40)
    report = rag.run_rag(engine, options, progress=False)
    assert [s.request for s in report.samples] == rag.plan_requests(3, 2, 4)
    for sample in report.samples:
        assert min(sample.promptlang, sample.prefix, sample.full) > 0
        assert sample.prefix_agrees                                # same tokens, exact reuse
        assert sample.cached_tokens > 0 and sample.reused > 0      # seen documents
    assert set(report.by_kind()) == {"new", "reordered", "repeat", "all"}
    rows = rag.sections(report)[0].rows
    assert [r["kind"] for r in rows] == ["new", "reordered", "repeat", "all"]
    assert rows[-1]["n"] == 4
    assert len(report.rows()) == 4 and report.rows()[0]["full_over_promptlang"] > 0


def test_run_rag_reports_a_schema_too_long_for_the_model(engine):
    report = rag.run_rag(engine, rag.RagOptions(docs=3, k=2, requests=1, doc_tokens=600),
                         progress=False)
    assert report.samples == [] and "positions" in report.skipped
    assert "not measured" in rag.sections(report)[0].lines[0]
