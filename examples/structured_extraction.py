"""Structured extraction: fill a pydantic model from a document served from cached modules.

    python examples/structured_extraction.py [--fast]

The company profiles are the members of one union (a `match` in the @prompt function), so
each is encoded once and served from the cache; the extraction is a `gen()` constrained to
the JSON Schema of the `Company` model (structured generation through llguidance), so the
answer always parses into a `Company`, whatever the model writes. The run is compared with
the same program served without reuse.
"""

from typing import Literal      # no `from __future__ import annotations`: pydantic reads them

import pydantic
from _shared import fast_mode, model, report_ttft

from promptlang import assistant, gen, prompt, system, user


class Company(pydantic.BaseModel):
    """What the extraction fills in."""

    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=40)
    founded: int = pydantic.Field(ge=1800, le=2030)
    city: str = pydantic.Field(max_length=30)
    industry: Literal["software", "food", "energy", "transport", "other"]


@prompt
def extract(profile: str, max_tokens: int):
    """Reads one company profile into a Company record."""
    with system():
        "Extract the company's record from the profile as JSON.\n\nProfile:\n"
        match profile:
            case "tidewater":
                """
                Tidewater Analytics was founded in 2011 in Lisbon by two former ferry
                engineers. The company writes scheduling software for ports and shipping
                lines; its planner now routes container cranes in eleven harbours. It has
                about three hundred employees and opened an office in Rotterdam in 2019.
                """
            case "bramble":
                """
                Bramble & Rye is a bakery chain that started in 1962 as a single shop in
                Leeds. It bakes sourdough and rye loaves in a central bakery at night and
                delivers them to forty shops across the north of England before dawn. The
                founder's granddaughter runs it today.
                """
            case "northwind":
                """
                Northwind Kinetics builds small wind turbines for farms and islands. It was
                founded in Aalborg in 1998 and sold its ten-thousandth turbine in 2021. Its
                blades are made of recycled fibre, and it services every turbine it sells.
                """
    with user():
        "Give the record."
    with assistant():
        gen("record", json_schema=Company, max_tokens=max_tokens)


def main(llm=None, fast: bool | None = None) -> dict:
    fast = fast_mode(fast)
    llm = model(llm)
    max_tokens = 60 if fast else 80
    llm.encode(extract.schema)                       # every profile, once: the cache is warm
    records = {}
    for profile in ("tidewater", "bramble", "northwind"):
        with extract.run(llm, profile, max_tokens) as run:
            value = run["record"]
            records[profile] = Company.model_validate(value) if isinstance(value, dict) \
                else None
            print(f"{profile}: {records[profile] or '(incomplete: ' + str(value) + ')'}")
    with extract.run(llm, "northwind", max_tokens) as run:
        with extract.runner(llm, baseline=True)("northwind", max_tokens) as baseline:
            report_ttft(run.ttft, baseline.ttft, opening=run.opening,
                        baseline_opening=baseline.opening)
            return {"records": records, "cached_ttft": run.ttft, "baseline_ttft": baseline.ttft,
                    "cached_tokens": run.opening.cached_tokens,
                    "prefill_tokens": run.opening.prefill_tokens,
                    "baseline_prefill_tokens": baseline.opening.prefill_tokens,
                    "complete": [t.complete for t in run.steps]}


if __name__ == "__main__":
    main()
