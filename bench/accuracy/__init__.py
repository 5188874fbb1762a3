"""`promptlang bench accuracy`: what modular encoding costs in answers, and what
selective recompute wins back at what TTFT.

The files: settings (../settings.py: the settings' names and defaults), results.py (options
and records), run.py (run_accuracy), answer.py (one item under every setting, greedy
decoding with drafts), scores.py (scores, paired comparisons, recovery, the goal), cost.py
(the recompute cost at ~6k tokens), tables.py (tables, sections, plot, JSON). This file
re-exports their names: `from promptlang.bench import accuracy; accuracy.run_accuracy(...)`.

Every item of the synthetic QA set (qa.py: single-document lookup, cross-document
bridge, a pronoun-dependent second document, a needle in long filler, same-shape
documents about people with a job and a town) is answered
greedily under every setting, each document a module of its own:

  baseline       the same tokens at positions 0..N-1, full causal attention, no reuse
  cached         the default rule, guaranteed context: a document attends to itself and
                 the schema text before it, never to the other documents
  cached+SPEC    the same cached documents, with the recompute policy SPEC applied per
                 request (runtime/recompute/): "first:K" recomputes the first K cached
                 tokens of every unit that missed something (EPIC's LegoLink),
                 "deviation:F" the fraction F of those candidate tokens whose layer-1 KV
                 deviates most from a full pass (in the spirit of CacheBlend), "exact"
                 every candidate (the full prefill's answer), "ape" none, but the
                 request's tokens attend to the documents as APE's parallel contexts
  cached-bf16    cached, from a bfloat16 store (half the KV bytes; read in place by the fused
                 layers of Llama-family models, else widened to float32 when a request
                 assembles them): what the 16-bit store costs in answers
  isolate        the paper's rule: a document attends only to itself
  isolate+SPEC   isolated documents with SPEC applied
  scaffold       the item's documents in one scaffold, encoded jointly (full attention among
                 them): what the paper offers when modules must see each other

The specs come from `AccuracyOptions.recompute` (`--recompute`), the rules they apply to
from `recompute_rules` (`--recompute-rules`); `scaffold=False` (`--no-scaffold`) leaves the
scaffold setting out and `store16=False` (`--no-bf16`) the cached-bf16 one. Every setting
of one rule reads the same module encodings (one store per rule), so a recompute setting
costs only its own per-request work. The explicit "none"
for cached/isolate/scaffold keeps them free of any default policy of the LLM or schema.
`run_accuracy(..., workers=N)` (`--workers`) shares the items among N processes.

Reported per setting and question kind: exact match (qa.exact_match: the answer's words
open the normalized output), answer in output (qa.answer_in_output: the answer occurs as
whole words in the generated text, up to `max_new_tokens` = 32 by default, room for a
sentence: small models answer in sentences, "The occupation of X is a nurse"; an output
where another person's value for the asked attribute, a distractor answer, comes first or
alone counts as wrong, and as "distracted"), agreement with the baseline (the same
generated token ids), the mean TTFT (encoding included where a setting encodes: each
item's prompt is used once) and the mean number of recomputed tokens.

Per item and setting two quantities need no decoding luck: the gold answer's
teacher-forced log-probability (its tokens, `llm.tokenizer.encode(answer)`, fed after the
setting's own prefill into the request's own KV buffer through the engine's prefill, the
call that verifies decoding drafts; summed, and per token) and KL(baseline || setting) of
the next-token distribution at the first generated position. Per setting and kind, every
metric is compared with the baseline item by item: the mean difference with a paired
bootstrap 95% interval (metrics.py: `resamples` resamples of the items, seed
`bootstrap_seed`), and the mean KL with its interval.

Each item has a schema of its own, so positions start at 0 for every item and the only
difference between the settings is what the document tokens attend to.

Decoding is greedy and exact, but cheap: a setting's answer usually repeats most of the
tokens another setting already produced ("The occupation of Cyprian Hargrove is a ..."),
and answers copy spans of the question and the documents, so the answers decoded before
it, or else the prompt's continuation of the last tokens (prompt lookup), serve as drafts.
The model checks a draft in one pass over its tokens and keeps the longest prefix that
greedy decoding itself would have picked (speculative decoding with the model as its own
verifier): the same tokens as one token at a time, up to float rounding on exact
near-ties, at a few passes per answer instead of one per token.

Recovery. For a recompute setting S and a metric m on a question kind, the gap is
m(baseline) - m(cached) and the recovery (m(S) - m(cached)) / gap; with no gap (<= 0) there
is nothing to recover and the goal says so instead of passing. Its interval is the paired
bootstrap one of the ratio (metrics.recovery_interval).

Recompute cost at ~6k tokens (`cost_tokens`): one dependent item scaled up to about that many
tokens in `cost_docs` document modules plus its question; the baseline full-prefill TTFT
(`cost_baseline_repeats` requests) and, per setting, the warm TTFT (the units already
encoded by an untimed request per setting before any timed request; median of
`cost_repeats` requests taken round robin over the settings), all with one new token
(`Result.timings.first_token`).

The recompute goal: a recompute setting (cached+SPEC or isolate+SPEC, each measured
against the cached gap) that is at least 10x faster than the baseline at ~6k tokens
recovers at least half of the cached-versus-baseline gap on the dependent items, judged by
answer-in-output (GOAL_METRIC; exact match and the gold log-prob are reported beside it:
the default model answers in sentences, so its exact match is near zero under every
setting). It is judged on intervals, not on point estimates: with k settings fast enough,
each recovery interval is taken at the Bonferroni level 1 - 0.05/k (picking the best of
k is part of the test), and the goal passes when the best one's low end is >= 50%.
"""

# every name of the benchmark, from the file that owns it
from promptlang.bench import metrics, qa
from promptlang.bench.settings import (BASE_SETTINGS, DEFAULT_RECOMPUTE, DESCRIPTIONS,
                                       QUICK_RECOMPUTE, RECOMPUTE_RULES, SETTINGS, STORE16,
                                       normalize_specs, settings, split_setting)
from promptlang.bench.accuracy.results import (STORE_BUDGET, COST_STORE_BUDGET, GOAL_KIND,
                                               GOAL_METRIC, GOAL_RECOVERY, GOAL_SPEEDUP,
                                               GOAL_NAME, METRIC_NAMES, AccuracyOptions, Answer,
                                               ItemResult, Score, Comparison, CostPoint,
                                               CostReport, AccuracyReport, wilson_interval)
from promptlang.bench.accuracy.answer import (_rule_llms, _requests, gold_ids, _answer, Decoded,
                                              teacher_forced, LOOKUP_TOKENS, greedy_answer)
from promptlang.bench.accuracy.run import make_items, run_accuracy, _Quiet
from promptlang.bench.accuracy.scores import (score, PER_ITEM, item_values, compare, Recovery,
                                              recovery, recompute_settings, recovery_goal)
from promptlang.bench.accuracy.seams import (SEAM_NAME, SEAM_NATS, SEAM_POINTS, SEAM_SPEEDUP,
                                             seam_goals)
from promptlang.bench.accuracy.cost import seen_before, cost_item, measure_cost
from promptlang.bench.accuracy.tables import (accuracy_table, recovery_table, paired_table,
                                              nats_recovery_table, settings_table, cost_table,
                                              store16_effect, sections, plot, to_json)
