"""Trip planning (Prompt Cache paper, Fig. 8): a parameterised plan.

    python examples/trip_planning.py [--fast]

The duration is a parameter of at most 4 tokens (`MaxTokens(4)`): its slot is reserved
in the cached module and the argument is computed per request. The destination is a
union of one module per city, with what the planner knows about it. Then the plan is
generated, and `select` asks whether the trip fits a small budget (exact scoring of
"yes" and "no", not sampling).
"""

from __future__ import annotations

from typing import Annotated

from _shared import fast_mode, model, report_ttft

from promptlang import MaxTokens, assistant, gen, prompt, select, system, user


@prompt
def trip(duration: Annotated[str, MaxTokens(4)], city: str, max_tokens: int):
    """A day-by-day plan for `duration` in `city`."""
    with system():
        "You are a travel agent. You plan realistic trips, day by day, with one line per day.\n"
    with user():
        f"Plan a trip lasting {duration}.\n"
        match city:
            case "tokyo":
                ("Destination: Tokyo. Highlights: Senso-ji temple in Asakusa, the Tsukiji "
                 "outer market, Shibuya crossing, teamLab digital art, a day trip to Nikko "
                 "or Kamakura. Trains are fast; buy a Suica card.\n")
            case "paris":
                ("Destination: Paris. Highlights: the Louvre (book ahead), a walk along the "
                 "Seine to Notre-Dame, Montmartre at sunset, the Musee d'Orsay, a day trip "
                 "to Versailles. The metro reaches everything.\n")
            case "rome":
                ("Destination: Rome. Highlights: the Colosseum and Forum, the Vatican "
                 "Museums, Trastevere in the evening, the Pantheon, a day trip to Ostia "
                 "Antica. Walk the centre; it is compact.\n")
        "Write the plan."
    with assistant():
        gen("plan", max_tokens=max_tokens)
    with user():
        "Can this trip be done on a small budget? Answer yes or no."
    with assistant():
        select("budget", ["yes", "no"])


def main(llm=None, fast: bool | None = None) -> dict:
    fast = fast_mode(fast)
    llm = model(llm)
    duration, city = "3 days", "paris"
    max_tokens = 4 if fast else 120
    llm.encode(trip.schema)
    with trip.run(llm, duration, city, max_tokens) as run:
        with trip.runner(llm, baseline=True)(duration, city, max_tokens) as baseline:
            print(f"{duration} in {city}:\n{run['plan'].strip()}")
            choice = run.choices["budget"]
            print(f"small budget? {run['budget']} (log-probabilities: "
                  + ", ".join(f"{o} {s:.2f}" for o, s in zip(choice.options, choice.scores))
                  + ")")
            report_ttft(run.ttft, baseline.ttft, opening=run.opening,
                        baseline_opening=baseline.opening)
            return {"answer": run["plan"], "budget": run["budget"], "choice": choice,
                    "cached_ttft": run.ttft, "baseline_ttft": baseline.ttft,
                    "cached_tokens": run.opening.cached_tokens,
                    "prefill_tokens": run.opening.prefill_tokens,
                    "baseline_prefill_tokens": baseline.opening.prefill_tokens,
                    "steps": [(s.kind, s.prefill_tokens) for s in run.steps],
                    "modules": [m[-1] for m in llm.bind(run.prompt).modules if m]}


if __name__ == "__main__":
    main()
