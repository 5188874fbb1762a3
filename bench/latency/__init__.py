"""`promptlang bench latency`: time to first token, baseline against cached, by length.

The files: results.py (options and records), run.py (run_latency over the lengths),
sweep.py (one length: the document, the rounds, the tiers), decode.py (decode against
transformers' generate), goals.py (the latency goals), tables.py (sections, plot, JSON).
This file re-exports their names: `from promptlang.bench import latency`.

The prompt is a system turn, one document module of about L tokens (filler sentences
from qa.py with one fact in the middle) and a short uncached question about the fact.
For each L, in one process, with the same question tokens everywhere:

  baseline  the same tokens at positions 0..N-1, one full prefill, no reuse
  cold      the first cached request; it encodes the module first (`encode`: its cost)
  device    the module in the store's memory tier. An untimed request without the document
            runs before each timed one, so the pooled request buffer no longer holds the
            module and the timed request copies its KV out of the store (or reads it in place)
  held      the cached request repeated back to back: the request buffer still holds the
            module, nothing is copied (what a prefix cache gets on a hit)
  host      a store whose entries live in its host tier (`host_tier=True`, device budget 0).
            On CUDA that is pinned memory copied to the GPU per request; on a CPU it is the
            same RAM as the device tier, so only the tier's bookkeeping differs
  disk      a store on the same folder with its memory tiers emptied before each request:
            every unit is read from its file and its checksum verified. The kernel is first
            asked to drop the files' cached pages (posix_fadvise DONTNEED); it honours that
            for clean pages of ordinary file systems, not on tmpfs

The goals rest on `samples` rounds per length, declared before the run: each round
takes one floor measurement (the chosen sgemm's rate and the copy bandwidth), one
device-tier request and one baseline pass, in an order that rotates from round to round.
A ratio (cached / floor, baseline / cached) is computed per round, and a goal is judged
once, on the median of those ratios; their spread (min-max, IQR, n) is printed with it.
Each round also compares the two sides' greedy first tokens: for this prefix-shaped
prompt they must agree, and the largest logit difference per length is printed.

TTFT runs from the call to the first picked token (`LLM.open` to the argmax of its
logits for the rounds, `Result.timings.first_token` for held, host and disk, each the
median of `repeats` requests).

Break-even: with encode cost E, baseline TTFT b and cached (device) TTFT c, n requests
cost E + n*c with the cache and n*b without, so the cache pays for itself from
n = ceil(E / (b - c)) requests on, the request that pays E included; never if c >= b.

The floor is docs/DESIGN.md's: max(FLOPs of the uncached tokens / matmul rate, (weights +
cached KV bytes) / copy bandwidth), per round (floor.py says how the rates are taken).
At the goal length the decode speed is compared with transformers' own `generate()` on a
stock copy of the model (its default attention), the two sides' runs interleaved.
"""

# every name of the benchmark, from the file that owns it
from promptlang.bench.latency.results import (DOC_MODULE, DECODE_QUESTION, FIT_RANGE, TIERS,
                                              AGREE_GOAL, LatencyOptions, Agreement, Point,
                                              DecodeComparison, LatencyReport)
from promptlang.bench.latency.sweep import (document, build_schema, build_prompt,
                                            timed_first_token, rotated)
from promptlang.bench.latency.run import run_latency
from promptlang.bench.latency.goals import exponents, latency_goals, agreement_goal
from promptlang.bench.latency.tables import sections, plot, to_json
