"""Personalised tutoring (Prompt Cache paper, Fig. 7): a learner profile made of unions.

    python examples/personalization.py [--fast]

The profile has four traits - grade, proficiency, learning style and assessment - and
each trait is a `match` in the @prompt function: a union of one module per value. Any
of the 4 x 3 x 4 x 3 = 144 profiles is served from the same 14 cached modules; only
the topic (after them, uncached) and the generated lesson are computed per request.
"""

from __future__ import annotations

from _shared import fast_mode, model, report_ttft

from promptlang import assistant, gen, prompt, system, user


@prompt
def tutor(grade: str, proficiency: str, style: str, assessment: str, topic: str,
          max_tokens: int):
    """A lesson plan for one learner profile and topic."""
    with system():
        "You are a patient tutor who writes short, concrete lesson plans.\n"
        "The learner:\n"
        match grade:
            case "elementary":
                "- is in elementary school (ages 6 to 10): use simple words and short sentences.\n"
            case "middle":
                "- is in middle school (ages 11 to 13): connect ideas to everyday life.\n"
            case "high":
                "- is in high school (ages 14 to 18): introduce proper terms and reasons.\n"
            case "college":
                "- is a college student: be precise and mention further reading.\n"
        match proficiency:
            case "beginner":
                "- is new to the subject: start from the basics and define every term.\n"
            case "intermediate":
                "- knows the basics: build on them with examples of growing difficulty.\n"
            case "advanced":
                "- is advanced: focus on subtle cases and open questions.\n"
        match style:
            case "visual":
                "- learns best from pictures, diagrams and colour-coded notes.\n"
            case "auditory":
                "- learns best by listening, discussing and explaining aloud.\n"
            case "kinesthetic":
                "- learns best by doing: experiments, models and movement.\n"
            case "reading":
                "- learns best from reading and writing summaries.\n"
        match assessment:
            case "quiz":
                "End the plan with a five-question quiz.\n"
            case "project":
                "End the plan with a small project the learner can finish in a day.\n"
            case "oral":
                "End the plan with three questions to answer aloud.\n"
    with user():
        f"Write a lesson plan about {topic}."
    with assistant():
        gen("plan", max_tokens=max_tokens)


def main(llm=None, fast: bool | None = None) -> dict:
    fast = fast_mode(fast)
    llm = model(llm)
    profile = dict(grade="middle", proficiency="beginner", style="visual", assessment="quiz")
    topic = "how plants make food from sunlight"
    max_tokens = 4 if fast else 150
    llm.encode(tutor.schema)                          # all 14 trait modules, once
    with tutor.run(llm, **profile, topic=topic, max_tokens=max_tokens) as run:
        with tutor.runner(llm, baseline=True)(**profile, topic=topic,
                                               max_tokens=max_tokens) as baseline:
            print(f"profile: {profile}\nlesson plan:\n{run['plan'].strip()}")
            report_ttft(run.ttft, baseline.ttft, opening=run.opening,
                        baseline_opening=baseline.opening)
            return {"answer": run["plan"], "cached_ttft": run.ttft,
                    "baseline_ttft": baseline.ttft, "cached_tokens": run.opening.cached_tokens,
                    "prefill_tokens": run.opening.prefill_tokens,
                    "baseline_prefill_tokens": baseline.opening.prefill_tokens,
                    "generated_tokens": run.steps[0].generated_tokens,
                    "modules": [m[-1] for m in llm.bind(run.prompt).modules if m]}


if __name__ == "__main__":
    main()
