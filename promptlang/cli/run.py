"""`promptlang run`: answer a prompt with cached modules.

    promptlang run SCHEMA.pml PROMPT.pml [--model PATH] [--max-new-tokens N] [--baseline]
                   [--isolate] [--recompute POLICY] [--temperature T] [--seed S]
                   [--stream] [--regex PATTERN | --json-schema FILE | --grammar FILE]

Prints the answer on stdout and the timing breakdown on stderr. The runtime (torch) is
imported when the command runs, not when the parser is built.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from promptlang.cli import numerics
from promptlang.cli.tune import hint_when_untuned


def register(subparsers: Any) -> None:
    run = subparsers.add_parser(
        "run", help="answer a prompt with cached modules",
        description="Serve PROMPT (a <prompt> file) against SCHEMA (a <schema> file): cached "
                    "modules come from the KV store (encoded on first use), the rest is "
                    "computed. Prints the answer, then the timing breakdown on stderr.")
    run.add_argument("schema", metavar="SCHEMA.pml")
    run.add_argument("prompt", metavar="PROMPT.pml")
    run.add_argument("--model", metavar="PATH",
                     help="transformers model folder (default: the embedded SmolLM2-135M)")
    numerics.add(run)
    run.add_argument("--max-new-tokens", type=int, default=256, metavar="N")
    run.add_argument("--baseline", action="store_true",
                     help="no reuse: the same tokens at positions 0..N-1, for comparison")
    run.add_argument("--isolate", action="store_true",
                     help="each module attends only to itself (the paper's rule); give "
                          "--recompute none with it, or the default exact recomputes it all")
    run.add_argument("--recompute", metavar="POLICY", default=None,
                     help="cached tokens to compute again: exact, seams, none, first:K, query:K, "
                          "deviation:F, ape[:T[:S]] or tuned (the model's seam adapter: "
                          "promptlang tune), each but exact, seams and tuned optionally +primed "
                          "(default: the schema's recompute attribute, else exact: every cached "
                          "token that missed a request token, answers as the full prefill's; see "
                          "docs/RECOMPUTE.md)")
    run.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help="0 (default) is greedy")
    run.add_argument("--seed", type=int, default=None, metavar="S")
    run.add_argument("--stream", action="store_true", help="print text as it is generated")
    shape = run.add_mutually_exclusive_group()
    shape.add_argument("--regex", metavar="PATTERN",
                       help="the answer matches this regular expression")
    shape.add_argument("--json-schema", metavar="FILE",
                       help="the answer is JSON valid under the JSON Schema in FILE")
    shape.add_argument("--grammar", metavar="FILE",
                       help="the answer is in the language of the Lark grammar in FILE")
    run.set_defaults(func=_run)


def load_parts(steps: dict[str, float]) -> str:
    """ " (file 0.3, weights 1.1, ...)": where a load's time went, or "" if not recorded."""
    if not steps:
        return ""
    return " (" + ", ".join(f"{name} {seconds:.1f}" for name, seconds in steps.items()) + ")"


def _run(args: argparse.Namespace) -> int:
    from promptlang.errors import DocumentKindError
    from promptlang.inputs import read_text
    from promptlang.pml import nodes
    from promptlang.pml.parser import parse_file
    from promptlang.runtime import engine

    schema = parse_file(args.schema)
    prompt = parse_file(args.prompt)
    if not isinstance(schema, nodes.Schema):
        raise DocumentKindError(f"{args.schema} holds a prompt, not a schema", schema.span)
    if not isinstance(prompt, nodes.PromptDoc):
        raise DocumentKindError(f"{args.prompt} holds a schema, not a prompt", prompt.span)
    for warning in (*schema.warnings, *prompt.warnings):
        print(warning, file=sys.stderr)
    started = time.perf_counter()
    llm = engine.load(args.model, isolate=args.isolate, **numerics.load_options(args))
    loaded = time.perf_counter() - started
    hint_when_untuned(llm, args.model)
    llm.add_schema(schema)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   seed=args.seed, baseline=args.baseline, recompute=args.recompute)
    if args.regex is not None:
        options["regex"] = args.regex
    if args.json_schema is not None:
        options["json_schema"] = read_text(args.json_schema)
    if args.grammar is not None:
        options["grammar"] = read_text(args.grammar)
    if args.stream:
        stream = llm.generate(prompt, stream=True, **options)
        for delta in stream:
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        result = stream.result
    else:
        result = llm.generate(prompt, **options)
        print(result.text)
    mode = "baseline" if args.baseline else ("isolate" if args.isolate else "cached")
    print(f"[{mode}] {len(result.token_ids)} tokens, finish: {result.finish_reason}; "
          f"prefill {result.prefill_tokens} tokens ({result.recomputed_tokens} recomputed), "
          f"cached {result.cached_tokens} ({result.exact_units} units exact, "
          f"{result.approximate_tokens} tokens encoded apart from what precedes them"
          f"{f', {result.primed_units} primed' if result.primed_units else ''}); "
          f"model load {loaded:.1f} s{load_parts(llm.load_steps)}", file=sys.stderr)
    if result.complete is not None:
        print(f"[{mode}] the answer is {'a whole' if result.complete else 'an INCOMPLETE'} "
              f"output of the constraint", file=sys.stderr)
    print(f"[{mode}] {result.timings}", file=sys.stderr)
    return 0
