"""`promptlang tune`: learn a model's seam adapter by self-distillation, on this machine.

    promptlang tune [--model PATH] [--minutes N] [--seed S] [--resume] [--out DIR]
                    [--link-tokens T | --encode] [--same-shape SHARE] [--quote SHARE]
                    [--gapless SHARE] [--tail-as-served]
                    [SOURCE ...]

SOURCEs (PML schemas, folders of them, or Python files of @prompt functions) add their
cached modules' text to the documents the model writes itself; nothing is downloaded and
nothing needs labels. The adapter lands under the store's home, keyed to the model's
fingerprint (`promptlang cache ls` lists it), with the corpus and a log of every step.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

MAX_LINK_TOKENS = 256


def register(subparsers: Any) -> None:
    tune = subparsers.add_parser(
        "tune", help="learn the model's seam adapter (self-distillation, no labels)",
        description="Train a small adapter that lets the tokens after a request's cached "
                    "modules read modules encoded apart as the full prefill would: the "
                    "teacher is the model's own full prefill, the student the request as it "
                    "is served from cached modules, the loss their next-token KL. Training "
                    "text: the model's own writing and the cached modules of SOURCEs.")
    tune.add_argument("sources", nargs="*", metavar="SOURCE",
                      help="schema.pml files, folders of them, or app.py files of @prompt "
                           "functions whose modules join the training documents")
    tune.add_argument("--model", metavar="PATH",
                      help="transformers model folder or GGUF file (default: the embedded "
                           "SmolLM2-135M)")
    tune.add_argument("--minutes", type=float, default=60.0, metavar="N",
                      help="training budget in minutes (default 60; writing the corpus and "
                           "the final evaluation come on top)")
    tune.add_argument("--seed", type=int, default=0, metavar="S")
    tune.add_argument("--resume", action="store_true",
                      help="continue from the last checkpoint in the output folder")
    tune.add_argument("--written-docs", type=int, default=48, metavar="N",
                      help="documents the model writes for the corpus (default 48)")
    tune.add_argument("--rank", type=int, default=8, metavar="R", help="LoRA rank (default 8)")
    tune.add_argument("--link-tokens", type=int, default=0, metavar="T",
                      help="learned link tokens the tokens after the modules attend to, "
                           "beside the LoRA (default 0: the LoRA alone; docs/RECOMPUTE.md)")
    tune.add_argument("--encode", action="store_true",
                      help="the adapter also encodes the modules (Block-Attention's form): "
                           "their KV is then the adapter's, stored apart from the base "
                           "model's (docs/RECOMPUTE.md)")
    tune.add_argument("--replay", type=int, default=0, metavar="K",
                      help="steps on earlier samples after each new one (default 0; a new "
                           "sample costs several steps)")
    tune.add_argument("--answer-weight", type=float, default=1.0, metavar="W",
                      help="the loss's weight on the rows that predict the answer, against "
                           "1 on the question's (default 1)")
    tune.add_argument("--same-shape", type=float, default=0.0, metavar="SHARE",
                      help="the share of rounds (0-1) on same-shaped records: documents "
                           "that say the same things in the same words about different "
                           "places, told apart only by names and facts (default 0)")
    tune.add_argument("--quote", type=float, default=0.0, metavar="SHARE",
                      help="the share of rounds (0-1) whose request asks for a sentence of "
                           "an imported document by its first words, the answer that "
                           "sentence: rows that read the documents' own words (default 0)")
    tune.add_argument("--gapless", type=float, default=0.0, metavar="SHARE",
                      help="the share of rounds (0-1) whose schema holds only the documents "
                           "the request imports, so its positions have no gaps; otherwise "
                           "each document left out leaves one (default 0)")
    tune.add_argument("--tail-as-served", action="store_true",
                      help="a round with gaps trains the tokens after its documents right "
                           "after the last one, where `tuned` serves them; by default "
                           "after the gaps, where `none` serves them, which carried over "
                           "better to requests without gaps (docs/RECOMPUTE.md)")
    tune.add_argument("--out", metavar="DIR",
                      help="output folder (default: the home's adapters/<model fingerprint>)")
    tune.set_defaults(func=_tune)


def _tune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from promptlang.home import adapter_folder
    from promptlang.runtime import engine
    from promptlang.runtime.tune.train import TuneOptions, tune

    if args.minutes <= 0 or args.written_docs < 1 or args.rank < 1:
        print("promptlang tune: --minutes, --written-docs and --rank must be positive",
              file=sys.stderr)
        return 2
    if args.replay < 0 or not args.answer_weight > 0:
        print("promptlang tune: --replay must be >= 0 and --answer-weight > 0", file=sys.stderr)
        return 2
    if not 0 <= args.link_tokens <= MAX_LINK_TOKENS:
        print(f"promptlang tune: --link-tokens must be between 0 and {MAX_LINK_TOKENS}",
              file=sys.stderr)
        return 2
    if args.encode and args.link_tokens:
        print("promptlang tune: --encode takes no --link-tokens", file=sys.stderr)
        return 2
    if not all(0 <= share <= 1 for share in (args.same_shape, args.quote, args.gapless)):
        print("promptlang tune: --same-shape, --quote and --gapless must be between 0 and 1",
              file=sys.stderr)
        return 2
    schemas = []
    if args.sources:
        from promptlang.server.load import read_sources

        schemas, _ = read_sources(args.sources)
    llm = engine.load(args.model)
    out = Path(args.out) if args.out else adapter_folder(llm.adapter.weights_fingerprint)
    options = TuneOptions(minutes=args.minutes, seed=args.seed, resume=args.resume,
                          written_docs=args.written_docs, rank=args.rank,
                          replay=args.replay, answer_weight=args.answer_weight,
                          link_tokens=args.link_tokens, encodes=args.encode,
                          same_shape=args.same_shape, quote=args.quote,
                          gapless=args.gapless, tail_as_served=args.tail_as_served)
    bar = _Bar()
    writing = _Writing()
    try:
        report = tune(llm, out, options, schemas=schemas,
                      say=lambda line: print(line, file=sys.stderr), bar=bar,
                      writing=writing)
    except OSError as exc:                     # a full disk, a folder gone: no traceback
        bar.close()
        where = exc.filename or out
        print(f"promptlang tune: {where}: {exc.strerror or exc}; the last checkpoint in {out} "
              "is kept: `--resume` goes on from it", file=sys.stderr)
        return 1
    finally:
        writing.close()
        bar.close()
    e = report.evaluation
    print(f"{report.adapter_path}\n"
          f"steps {report.steps} in {report.seconds / 60:.1f} min; held-out KL {_gains(e)}")
    shaped = report.same_shape_evaluation
    if shaped is not None:
        print(f"held-out same-shaped records: KL {_gains(shaped)}")
    gapless = report.gapless_evaluation
    if gapless is not None:
        print(f"held-out combinations without gaps: KL {_gains(gapless)}")
    return 0


def _gains(e) -> str:
    """An evaluation's KL and answer gap, without the adapter and with it."""
    return (f"{e.kl_before:.4f} -> {e.kl_after:.4f} ({e.kl_recovered:.0%} removed); answer "
            f"log-prob gap {e.answer_gap_before:.3f} -> {e.answer_gap_after:.3f} nats")


class _Writing:
    """A progress bar on stderr while the model writes the corpus."""

    def __init__(self):
        self._bar = None

    def __call__(self, done: int, total: int) -> None:
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(total=total, unit="doc", file=sys.stderr,
                             desc="writing the corpus")
        self._bar.n = done
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class _Bar:
    """A progress bar on stderr: steps, the loss, minutes spent of the budget."""

    def __init__(self):
        self._bar = None

    def __call__(self, step: int, loss: float, seconds: float, budget: float) -> None:
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(total=round(budget / 60, 1), unit="min", file=sys.stderr,
                             desc="promptlang tune")
        self._bar.n = round(min(seconds, budget) / 60, 1)
        self._bar.set_postfix(step=step, loss=f"{loss:.4f}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def hint_when_untuned(llm, model: str | None) -> None:
    """On stderr, once per model (per home): how to tune a seam adapter, where the model
    `run` or `serve` loaded has none."""
    from promptlang.runtime.model.seam import tune_hint_once

    adapter = getattr(llm, "adapter", None)
    if adapter is None or getattr(llm, "seam", None) is not None:
        return
    hint = tune_hint_once(adapter.weights_fingerprint, model)
    if hint is not None:
        print(hint, file=sys.stderr)
