"""A chat assistant: a persona-and-rules system module, then a multi-turn conversation.

    python examples/chat_agent.py [--fast]

`persona` is a @prompt function whose persona (a union) and rules (optional modules)
are cached. The conversation runs on a `Session`: each user message and reply is added
to the session's KV, so turn N+1 computes only its own new tokens - never the persona
again, never an earlier turn. The last turn's time to first token is compared with
computing the whole conversation from scratch with no reuse (`session.replay`).
"""

from __future__ import annotations

import time

from _shared import fast_mode, model, report_ttft

from promptlang import prompt, system

MESSAGES = ["Hi! Can you help me plan a small vegetable garden?",
            "What should I plant first in spring?",
            "How often should I water the seedlings?"]


@prompt
def persona(name: str, concise: bool, safety: bool):
    """The assistant's persona and its house rules."""
    with system():
        match name:
            case "sage":
                "You are Sage, a calm gardening expert who explains the reasons behind advice.\n"
            case "sunny":
                "You are Sunny, a cheerful helper who keeps things simple and encouraging.\n"
        "Rules:\n"
        if concise:
            "- Answer in at most three sentences.\n"
        if safety:
            "- Never recommend chemical pesticides; suggest natural remedies instead.\n"
        "- If you are unsure, say so.\n"


def main(llm=None, fast: bool | None = None, messages: list[str] | None = None) -> dict:
    fast = fast_mode(fast)
    llm = model(llm)
    messages = messages or MESSAGES
    max_tokens = 4 if fast else 80
    system_prompt = persona("sage", concise=True, safety=True)
    llm.encode(system_prompt.schema)
    turns, replies = [], []
    with llm.session(system_prompt) as session:
        for number, message in enumerate(messages, 1):
            session.user(message).open_role("assistant")
            if number == len(messages):                   # the same state, from scratch
                started = time.perf_counter()
                with session.replay(baseline=True) as scratch:
                    first = scratch.generate(1)
                    baseline_ttft = first.started_at + first.timings.first_token - started
                    scratch_tokens = scratch.opening.prefill_tokens + first.prefill_tokens
            turn = session.generate(max_tokens)          # ends at the model's end of turn
            session.close_role("assistant")
            turns.append(turn)
            replies.append(turn.text.strip())
            print(f"user: {message}\nSage: {turn.text.strip()}\n"
                  f"   [computed {turn.prefill_tokens} new tokens, first token after "
                  f"{turn.timings.first_token * 1000:.0f} ms]")
        print(f"turn {len(messages)}: {turns[-1].prefill_tokens} new tokens computed | from "
              f"scratch with no reuse: {scratch_tokens}")
        report_ttft(turns[-1].timings.first_token, baseline_ttft,
                    f"turn {len(messages)} time to first token")
        return {"answer": replies[-1], "replies": replies, "turns": turns,
                "cached_ttft": turns[-1].timings.first_token, "baseline_ttft": baseline_ttft,
                "scratch_tokens": scratch_tokens,
                "opening": session.opening, "length": session.length,
                "text": session.text}


if __name__ == "__main__":
    main()
