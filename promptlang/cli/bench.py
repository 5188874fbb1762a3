"""`promptlang bench`: the benchmarks' command lines (the benchmarks are promptlang.bench).

    promptlang bench latency  [--lengths 256,512,...] [--samples S] [--repeats R]
                              [--decode-tokens N] [--decode-samples D] [--goal-length L]
                              [--rag-docs N] [--rag-k K] [--rag-requests R]
                              [--rag-recompute POLICY]
    promptlang bench memory
    promptlang bench accuracy [--items N] [--kinds single,cross,...] [--docs-per-item D]
                              [--doc-words W] [--max-new-tokens N] [--seed S]
                              [--recompute SPEC,...] [--recompute-rules cached,isolate]
                              [--no-scaffold] [--no-isolate] [--no-bf16] [--workers N]
                              [--cost-tokens N] [--cost-repeats R]
                              [--resamples B]
    promptlang bench serve    [--clients 1,4,16,32] [--requests N] [--max-tokens N]
    promptlang bench structured  (decode time with and without a JSON Schema constraint)
    promptlang bench compute  (bfloat16 compute against float32, on one adapter)
    promptlang bench plan     (compile --plan's estimates against a real encode)
    promptlang bench contention  (decode and a cached question beside a busy neighbour)
    promptlang bench peers    [--model FILE.gguf] [--gguf FILE]  (beside llama.cpp and
                              transformers' full prefill, on the same GGUF)
    promptlang bench cluster  [--replicas N] [--cluster-docs N] [--cluster-k K]
                              [--cluster-requests R] [--cluster-clients C]
                              [--routers pow2,prefix,affinity] [--memory-share F]
                              (routers on a local Ray Serve cluster; the `cluster` extra)
    promptlang bench scaling  [--costs FILE] (project 2-64 replicas, 1e3-1e6 modules)
    promptlang bench all      (latency, memory, accuracy: one model load, one folder,
                              one report.md)

Every command takes --quick (tiny sizes, for tests), --out DIR (default bench-out/),
--model PATH_OR_ID (default: the embedded SmolLM2-135M), --dtype float32|bfloat16|auto
(the model's passes of many new tokens: runtime/model/compute.py) and --no-progress. Tables go
to stdout, progress bars to stderr; the folder gets NAME.csv, NAME.json, NAME.md (and
latency.png, rag.csv, rag.json, accuracy.png, accuracy-items.json). Each PASS/FAIL goal
line is printed whether it passes or not; `latency` and `all` exit with 1 when the cached
and baseline first tokens disagree (a correctness check, not a speed goal).
The parser is built here; each command hands the parsed options and the command as typed to
promptlang.bench.run, imported when the command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from promptlang.cli import numerics

DEFAULT_OUT = "bench-out"


def register(subparsers: Any) -> None:
    from promptlang.bench.settings import DEFAULT_RECOMPUTE

    bench = subparsers.add_parser(
        "bench", help="measure latency, KV memory and accuracy of cached prompts",
        description="Benchmarks that reproduce the Prompt Cache paper's claims on this "
                    "machine. Each prints its tables and writes CSV/JSON into --out.")
    bench.set_defaults(group_parser=bench)
    commands = bench.add_subparsers(title="commands", metavar="COMMAND")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quick", action="store_true",
                        help="tiny sizes (seconds, for tests); the numbers mean little")
    common.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                        help=f"folder for the raw numbers and plots (default {DEFAULT_OUT}/)")
    common.add_argument("--model", metavar="PATH_OR_ID",
                        help="a local transformers model or a GGUF file (default: the "
                             "embedded SmolLM2-135M)")
    common.add_argument("--no-progress", action="store_true", help="no progress bars")
    common.add_argument("--threads", type=_positive, metavar="N",
                        help="torch threads (default: torch's choice, one per core)")
    numerics.add_approximations(common)

    latency = argparse.ArgumentParser(add_help=False)
    latency.add_argument("--lengths", type=_int_list, metavar="N,N,...",
                         help="document lengths in tokens (default "
                              "256,512,1024,2048,4096,6400,8000)")
    latency.add_argument("--samples", type=_positive, metavar="S",
                         help="interleaved rounds of (floor, cached request, baseline) per "
                              "length; the goals are judged on them (default 5)")
    latency.add_argument("--repeats", type=_positive, metavar="R",
                         help="timed requests per held, host and disk tier and length "
                              "(default 5)")
    latency.add_argument("--decode-tokens", type=_at_least_two, metavar="N",
                         help="tokens for the decode comparison (default 32)")
    latency.add_argument("--decode-samples", type=_positive, metavar="D",
                         help="interleaved decode runs on each side (default 5)")
    latency.add_argument("--goal-length", type=_positive, metavar="L",
                         help="the length the goals are checked at (default 6400)")
    latency.add_argument("--rag-docs", type=_positive, metavar="N",
                         help="documents of the RAG workload (default 8, ~700 tokens each)")
    latency.add_argument("--rag-k", type=_positive, metavar="K",
                         help="documents per RAG request (default 4)")
    latency.add_argument("--rag-requests", type=_non_negative, metavar="R",
                         help="timed RAG requests (default 12; 0 skips the RAG section)")
    latency.add_argument("--rag-recompute", type=_policy, metavar="POLICY",
                         help="promptlang's recompute policy in the RAG section (default "
                              "none: documents as encoded apart; tuned: the model's seam "
                              "adapter, from promptlang tune)")

    accuracy = argparse.ArgumentParser(add_help=False)
    accuracy.add_argument("--items", type=_positive, metavar="N",
                          help="items per question kind (default 10)")
    accuracy.add_argument("--kinds", type=_kinds, metavar="K,K,...",
                          help="question kinds (default single,cross,dependent,needle,"
                               "same-shape,argument)")
    accuracy.add_argument("--docs-per-item", type=_positive, metavar="D",
                          help="documents per item (default 4)")
    accuracy.add_argument("--doc-words", type=_positive, metavar="W",
                          help="words per document (default: 60, or 300 for needle)")
    accuracy.add_argument("--max-new-tokens", type=_positive, metavar="N",
                          help="answer length cap (default 32: room for a sentence)")
    accuracy.add_argument("--seed", type=int, metavar="S", help="item seed (default 0)")
    accuracy.add_argument("--recompute", type=_recompute_list, metavar="SPEC,SPEC,...",
                          help="recompute policies, each adding the settings cached+SPEC and "
                               "isolate+SPEC: exact, seams, first:K, query:K, deviation:F, "
                               "ape[:T[:S]] or tuned (the model's seam adapter), the four "
                               "before tuned optionally +primed, or primed alone; "
                               "'none' for no such settings (default "
                               + ",".join(DEFAULT_RECOMPUTE) + ")")
    accuracy.add_argument("--recompute-rules", type=_rules, metavar="RULE,...",
                          help="the cached rules the policies apply to: cached (guaranteed "
                               "context), isolate (default both)")
    accuracy.add_argument("--no-scaffold", dest="scaffold", action="store_false", default=None,
                          help="leave out the scaffold setting")
    accuracy.add_argument("--no-isolate", dest="isolate", action="store_false", default=None,
                          help="leave out the isolate settings (the paper's rule, and "
                               "isolate+SPEC)")
    accuracy.add_argument("--no-bf16", dest="store16", action="store_false", default=None,
                          help="leave out the cached-bf16 setting (cached, bfloat16 store)")
    accuracy.add_argument("--workers", type=_positive, metavar="N",
                          help="answer the items in N processes, each loading the model and "
                               "running --threads torch threads (default: this process's "
                               "threads / N); default 1")
    accuracy.add_argument("--cost-tokens", type=_non_negative, metavar="N",
                          help="prompt length of the recompute cost section "
                               "(default 6000; 0 skips it and the recompute cost goal)")
    accuracy.add_argument("--cost-repeats", type=_positive, metavar="R",
                          help="timed warm requests per setting in the cost section (default 3)")
    accuracy.add_argument("--resamples", type=_positive, metavar="B",
                          help="bootstrap resamples of the items for the paired intervals "
                               "(default 2000)")

    serve = argparse.ArgumentParser(add_help=False)
    serve.add_argument("--clients", type=_int_list, metavar="N,N,...",
                       help="concurrent clients per level (default 1,4,16,32)")
    serve.add_argument("--requests", type=_positive, metavar="N",
                       help="requests per client per level (default 4)")
    serve.add_argument("--max-tokens", type=_positive, metavar="N",
                       help="new tokens per request (default 32)")
    serve.add_argument("--llama-server", action="store_true", default=None,
                       help="then the same load (1, 4 and 16 clients) on llama-cpp-python's "
                            "OpenAI server, when installed (the [peers] extra and its server "
                            "dependencies)")

    cluster = argparse.ArgumentParser(add_help=False)
    cluster.add_argument("--replicas", type=_positive, metavar="N",
                         help="engine replicas (default 2)")
    cluster.add_argument("--cluster-docs", type=_positive, metavar="N",
                         help="documents in the RAG schema (default 24)")
    cluster.add_argument("--cluster-k", type=_positive, metavar="K",
                         help="documents per request (default 3)")
    cluster.add_argument("--cluster-requests", type=_positive, metavar="R",
                         help="requests per router (default 96)")
    cluster.add_argument("--cluster-clients", type=_positive, metavar="C",
                         help="concurrent streams (default 4)")
    cluster.add_argument("--routers", type=_routers, metavar="R,R,...",
                         help="routers to compare, in order (default pow2,prefix,affinity)")
    cluster.add_argument("--memory-share", type=float, metavar="F",
                         help="each replica's memory tier, as a share of all the documents' "
                              "KV (default 0.6)")

    scaling = argparse.ArgumentParser(add_help=False)
    scaling.add_argument("--costs", metavar="FILE",
                         help="the cluster.json whose measured costs drive the projection "
                              "(default OUT/cluster.json)")

    peers = argparse.ArgumentParser(add_help=False)
    peers.add_argument("--gguf", metavar="FILE",
                       help="the GGUF llama.cpp loads (default: the --model GGUF, else the "
                            "default model's own)")

    for name, parents, func, short, text in (
            ("latency", [common, latency], _handler("latency"),
             "time to first token, baseline vs cached",
             "Time to first token, baseline against cached, over prompt length, with "
             "modules in the device, host and disk tiers; encode cost, break-even, the "
             "machine's floor, the decode comparison, the first-token agreement check, "
             "the latency goals, and a RAG workload (k of N documents per request) "
             "against a prefix-cache policy on the same engine."),
            ("memory", [common], _handler("memory"), "KV bytes per token",
             "KV bytes per token: the model's, its store's in 32 and 16 bits, and a table "
             "of well-known models' shapes."),
            ("accuracy", [common, accuracy], _handler("accuracy"),
             "exact match with and without caching",
             "Exact match and answer-in-output (a distractor's answer first counts as "
             "wrong) on synthetic multi-document QA: baseline, "
             "cached (guaranteed context), cached from a bfloat16 store, cached (isolate), "
             "scaffold, and both cached rules with each --recompute policy; agreement with "
             "the baseline; the gold answer's teacher-forced log-probability and the "
             "first-token KL from the baseline, each setting against the baseline with "
             "paired bootstrap intervals; the TTFT of "
             "every setting at ~6k tokens, accuracy.png and the recompute cost goal."),
            ("serve", [common, serve], _handler("serve"), "the OpenAI server under load",
             "promptlang serve's API on 127.0.0.1 under 1, 4, 16 and 32 concurrent "
             "`openai` clients (streaming; RAG through the promptlang field and plain "
             "chat): TTFT p50/p99, time per token, aggregate tokens/s, requests lost, "
             "answers equal to the request served alone, and the serving goals."),
            ("structured", [common], _handler("structured"),
             "decode cost of a JSON Schema constraint",
             "Greedy decoding of one prompt with and without a JSON Schema constraint "
             "(llguidance's token masks), interleaved rounds: time per token, the overhead "
             "and its goal (<= 10%), and the time of one mask."),
            ("peers", [common, peers], _handler("peers"),
             "beside llama.cpp (llama-cpp-python) and transformers",
             "The same token ids through promptlang, llama.cpp (llama-cpp-python, in a "
             "process of its own, when installed) and transformers' full prefill: a ~6.4k "
             "document with new questions (llama.cpp's prefix hit), decode at that "
             "context, and RAG k of N documents; the peers goals."),
            ("cluster", [common, cluster], _handler("cluster"),
             "routers compared on a local Ray Serve cluster",
             "A RAG workload (k of N documents) served by engine replicas on a local Ray "
             "Serve cluster, once per router (Ray's power of two choices, Ray Serve LLM's "
             "prefix-cache router, promptlang's module affinity): hits by tier, TTFT "
             "p50/p99, requests/s, requests lost; and the per-request costs the scaling "
             "projection uses. Needs the `cluster` extra."),
            ("scaling", [common, scaling], _handler("scaling"),
             "project hit rates and TTFT to 64 replicas and 1e6 modules",
             "A simulation of the routers (the module-affinity rule itself, and random "
             "choice) over 2 to 64 replicas and 1e3 to 1e6 distinct modules with LRU "
             "memory tiers and a shared disk tier of finite bandwidth, driven by the costs "
             "`bench cluster` measured (docs/SCALING.md)."),
            ("compute", [common], _handler("compute"),
             "bfloat16 compute against float32 (CPUs with AMX or AVX512-BF16)",
             "The model's passes of many new tokens in bfloat16 (load's compute=) against "
             "float32 on one adapter, in one run: a new RAG combination under exact "
             "(and transformers' float32 prefill of the same tokens), a cold encode of a "
             "~6.4k-token module, decode at that context; first-token agreement and "
             "|delta log-prob| between the two; the bfloat16 goals."),
            ("plan", [common], _handler("plan"),
             "compile --plan's estimates against a real encode",
             "A RAG Jinja2 template compiled at a few document lengths: the cache plan's KV "
             "bytes and encode seconds (compile --plan) against what an empty store holds "
             "after encoding the schema and the median encode time; the plan goals."),
            ("contention", [common], _handler("contention"),
             "decode and a cached question beside a busy neighbour process",
             "Decode and a new question over a ~6k-token cached module, alone and beside "
             "one other process spinning on a core, with the kernels' thread count adapting "
             "to the cores others hold and fixed at torch's; the goals (<= 2.5x alone)."),
            ("all", [common, latency, accuracy], _handler("all"),
             "latency, memory and accuracy into one folder",
             "memory, latency and accuracy in one run (about 20 minutes on 2 cores at the "
             "defaults), into one folder with a report.md of every table.")):
        command = commands.add_parser(name, parents=parents, help=short, description=text)
        command.set_defaults(func=func, bench=name)


def _handler(name: str):
    """The command `bench NAME`: promptlang.bench.run's runner, given the command as typed."""
    def handle(args: argparse.Namespace) -> int:
        from promptlang.bench import run

        return run.COMMANDS[name](args, command_line(args))
    return handle


# --- argument types ---------------------------------------------------------------------

def _at_least(minimum: int, name: str):
    """An argparse type: an integer >= minimum (argparse names `name` in its own errors)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = name
    return parse


_non_negative = _at_least(0, "non-negative integer")
_positive = _at_least(1, "positive integer")
_at_least_two = _at_least(2, "integer >= 2")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive token counts, got {text!r}")
    return tuple(sorted(set(values)))


def _recompute_list(text: str) -> tuple[str, ...]:
    """Comma-separated recompute policies, canonical and without duplicates; "none"
    alone: no recompute settings."""
    from promptlang.bench.settings import normalize_specs
    from promptlang.errors import RecomputeSpecError

    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("need at least one policy (or 'none')")
    try:
        specs = normalize_specs(parts)
    except RecomputeSpecError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not specs and parts != ["none"]:
        raise argparse.ArgumentTypeError(f"{text!r} names no recompute policy: use 'none' "
                                         "alone for no recompute settings")
    return specs


def _routers(text: str) -> tuple[str, ...]:
    routers = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [r for r in routers if r not in ("pow2", "prefix", "affinity")]
    if not routers or unknown:
        raise argparse.ArgumentTypeError(f"routers are pow2, prefix and affinity, got {text!r}")
    return routers


def _policy(text: str) -> str:
    """One recompute policy, as canonical text."""
    from promptlang.errors import RecomputeSpecError
    from promptlang.runtime.recompute.policy import Recompute

    try:
        return str(Recompute.parse(text))
    except RecomputeSpecError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _rules(text: str) -> tuple[str, ...]:
    rules = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [r for r in rules if r not in ("cached", "isolate")]
    if unknown or not rules:
        raise argparse.ArgumentTypeError(f"unknown rule(s) {unknown}: choose from cached, "
                                         "isolate")
    return rules


def _kinds(text: str) -> tuple[str, ...]:
    from promptlang.bench.qa import KINDS

    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"unknown kind(s) {unknown}: choose from "
                                         f"{', '.join(KINDS)}")
    return kinds


# store_false options: dest -> flag
_NEGATED = {"scaffold": "--no-scaffold", "store16": "--no-bf16", "isolate": "--no-isolate"}


def command_line(args: argparse.Namespace) -> str:
    """The command as typed, rebuilt from the parsed options that were given."""
    words = ["promptlang", "bench", args.bench]
    for dest, value in sorted(vars(args).items()):
        if dest in _NEGATED and value is False:
            words.append(_NEGATED[dest])
            continue
        if dest in ("func", "bench", "group_parser") or value is None or value is False:
            continue
        if (dest, value) in (("out", DEFAULT_OUT), ("dtype", "float32")):
            continue                                   # the defaults, as not typed
        flag = "--" + dest.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, tuple):
            words += [flag, ",".join(map(str, value)) or "none"]
        else:
            words += [flag, str(value)]
    return " ".join(words)
