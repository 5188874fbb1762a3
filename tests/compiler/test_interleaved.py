"""gen() and select() in @prompt functions: the static part before the first generation
is cached, everything after it runs live on a session, and select is exact.

Compilation is checked with the word tokenizer alone; runs use a tiny random Llama."""

from __future__ import annotations

import pytest
import torch
import transformers

from promptlang.compiler import CompileError, gen, select
from promptlang.errors import PromptLangError
from promptlang.tokenizer import WordTokenizer

from tests.runtime.tiny import Words

from .support import load

VOCAB = 1000


PROGRAM = '''
    from promptlang import prompt, system, user, assistant, gen, select

    TRACE = []

    @prompt
    def review(code, strict: bool):
        """Reviews code."""
        with system():
            "You review code."
            if strict:
                " Be strict."
        with user():
            code
        with assistant():
            verdict = select("verdict", ["good", "bad"])
            TRACE.append(verdict)
            " because"
            gen("reason", max_tokens=3)
        if verdict == "bad":
            with user():
                f"Fix it: {verdict}"
            with assistant():
                fix = gen("fix", max_tokens=2)
        else:
            with user():
                "Thanks."
'''


def test_the_static_part_is_cached_and_the_rest_is_live():
    module = load(PROGRAM, "interleaved_review")
    review = module.review
    assert review.generates
    # the schema holds the cached text before the first select, nothing after it
    assert review.schema_pml() == (
        '<schema name="interleaved_review.review"><module name="review"><system>You review '
        'code.<module name="strict"> Be strict.</module></system><user></module></schema>')
    # a plain call returns the static part: the prompt up to the first generation
    static = review("x = 1", True)
    assert static.prompt_pml() == ('<prompt schema="interleaved_review.review"><review>'
                                   '<strict/></review>x = 1</user><assistant></prompt>')
    assert module.TRACE == []           # the body stopped at the first generation
    static.bind(WordTokenizer())        # and the binder accepts it


def test_text_after_a_generation_is_no_error_but_before_it_still_is():
    module = load('''
        from promptlang import prompt, gen, user, assistant

        @prompt
        def fine(q):
            """Doc."""
            "Static. "
            with user():
                q
            with assistant():
                gen("a", max_tokens=2)
            "Live text after the generation."
            for i in range(2):
                f"item {i}"
                gen(max_tokens=1)
        ''', "interleaved_fine")
    assert module.fine.schema_pml() == ('<schema name="interleaved_fine.fine"><module '
                                        'name="fine">Static. <user></module></schema>')
    with pytest.raises(CompileError) as error:
        load('''
            from promptlang import prompt, gen

            @prompt
            def wrong(q):
                """Doc."""
                q
                "This looks cached but follows an unbounded hole."
                gen("a")
            ''', "interleaved_wrong").wrong.schema
    assert [d.code for d in error.value.diagnostics] == ["PL203"]


def test_an_assigned_generation_ends_the_cached_part_and_other_gens_are_plain_calls():
    module = load('''
        from promptlang import prompt
        import promptlang as pl

        def select(options):             # not promptlang's: ordinary code
            return options[0]

        @prompt
        def assigned():
            """Doc."""
            "Before. "
            first = select(["a", "b"])
            "Still cached. "
            answer: str = pl.gen("answer")
            f"After: {answer}."
        ''', "interleaved_assigned")
    assert module.assigned.schema_pml() == (
        '<schema name="interleaved_assigned.assigned"><module name="assigned">Before. Still '
        'cached. </module></schema>')


def test_a_generation_inside_an_expression_is_an_error():
    with pytest.raises(CompileError) as error:
        load('''
            from promptlang import prompt, gen

            @prompt
            def inline():
                """Doc."""
                "Text. "
                if gen("x") == "yes":
                    "Yes."
            ''', "interleaved_inline").inline.schema
    assert [d.code for d in error.value.diagnostics] == ["PL110"]


def test_gen_and_select_refuse_to_run_outside_a_prompt_function_and_bad_arguments():
    with pytest.raises(PromptLangError, match="inside a @prompt function"):
        gen("x")
    with pytest.raises(PromptLangError, match="distinct"):
        select("x", ["a", "a"])
    with pytest.raises(PromptLangError, match="max_tokens"):
        gen("x", max_tokens=0)


# --- running programs on a model ------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(5)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.1)
    return model


@pytest.fixture
def llm(model):
    from promptlang.runtime.engine import LLM
    from promptlang.runtime.store import ModuleStore

    # memory only: what earlier runs left in the shared disk tier must not change the plan
    return LLM.from_model(model, Words(VOCAB, bos=True), store=ModuleStore(disk_budget_bytes=0))


def test_a_run_serves_the_static_part_cached_and_runs_the_body_live(llm):
    module = load(PROGRAM, "interleaved_run")
    module.TRACE.clear()
    with module.review.run(llm, "print(1)", True) as run:
        static = module.review("print(1)", True)
        bound = llm.bind(static, add_generation_prompt=False)
        assert run.prompt.doc == static.doc
        assert run.opening.cached_tokens + run.opening.prefill_tokens == \
            bound.cached_token_count + bound.uncached_token_count
        # "print(1)</user>..", and the seams of a combination not seen before (the default
        # recompute policy computes them again)
        assert run.opening.prefill_tokens == \
            bound.uncached_token_count + run.opening.recomputed_tokens
        assert module.TRACE == [run["verdict"]]    # the body saw the select's result
        assert set(run.variables) == ({"verdict", "reason", "fix"} if run["verdict"] == "bad"
                                      else {"verdict", "reason"})
        assert [t.kind for t in run.steps][:2] == ["select", "generate"]
        # the live text went into the session, in order, with each generation
        tail = run.text[len(bound.render()):]
        assert tail.startswith(run["verdict"] + " because" + run["reason"])
        assert ("Fix it: bad" in tail) == (run["verdict"] == "bad")
        assert ("Thanks." in tail) == (run["verdict"] == "good")
        assert run.ttft is not None and run.ttft > 0
        # each live step computed only its new tokens: nothing of the static part again
        reason = run.steps[1]
        assert reason.prefill_tokens == len(llm.tokenizer.encode(" because"))


def test_select_in_a_program_picks_the_highest_total_log_probability(llm, model):
    module = load('''
        from promptlang import prompt, select

        @prompt
        def pick(question):
            """Doc."""
            "Answer with one word. "
            question
            select("word", ["alpha beta", "gamma", "delta epsilon zeta"])
        ''', "interleaved_pick")
    with module.pick.run(llm, "Which word?") as run:
        choice = run.choices["word"]
        context = run.prompt.bind(llm.tokenizer).token_ids()
    # independently: one plain forward per option (one module, no gaps: the cached prefill
    # equals the plain one), log-softmax, summed over the option's tokens
    expected = []
    for option in choice.options:
        ids = llm.tokenizer.encode(option)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([context + ids])).logits[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        expected.append(sum(float(logprobs[len(context) - 1 + i, t])
                            for i, t in enumerate(ids)))
    assert list(choice.scores) == pytest.approx(expected, abs=1e-3)
    assert choice.index == max(range(3), key=lambda i: expected[i])
    assert run["word"] == choice.options[choice.index]


def test_baseline_and_cached_runs_agree_when_caching_changes_nothing(llm):
    module = load('''
        from promptlang import prompt, gen, user, assistant

        @prompt
        def chat(question):
            """Doc."""
            with user():
                "Please answer: "
                question
            with assistant():
                gen("answer", max_tokens=4)
            with user():
                "Shorter."
            with assistant():
                gen("short", max_tokens=3)
        ''', "interleaved_chat")
    cached = module.chat.run(llm, "why?")
    baseline = module.chat.runner(llm, baseline=True)("why?")
    assert baseline.opening.cached_tokens == 0 and cached.opening.cached_tokens > 0
    assert cached.variables == baseline.variables          # greedy, same tokens
    for run in (cached, baseline):
        assert [s.generated_tokens for s in run.steps] == [4, 3]
        run.close()


def test_a_generating_callee_and_an_exception_in_the_live_part(llm):
    module = load('''
        from promptlang import prompt, gen

        @prompt
        def ask():
            """Doc."""
            "Question: "
            gen("q", max_tokens=2)

        @prompt
        def outer(fail: bool):
            """Doc."""
            "Intro. "
            ask()
            " Answer:"
            a = gen("a", max_tokens=2)
            if fail:
                raise ValueError(a)
        ''', "interleaved_callee")
    assert module.outer.schema_pml() == (
        '<schema name="interleaved_callee.outer"><module name="outer">Intro. <module '
        'name="ask">Question: </module></module></schema>')
    with module.outer.run(llm, False) as run:
        assert list(run.variables) == ["q", "a"]
        assert run.text.endswith(run["q"] + " Answer:" + run["a"])
    free = len(llm.assembler._free)
    with pytest.raises(ValueError):
        module.outer.run(llm, True)
    assert len(llm.assembler._free) == free       # the failed run's buffer went back to the pool
