"""The latency report as sections (text and Markdown), the TTFT plot (matplotlib, the
`bench` extra) and the JSON of every number, raw samples included.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from promptlang.bench.report import Section, plot_ttft
from promptlang.bench.latency.results import LatencyReport, TIERS
from promptlang.bench.latency.goals import exponents


def sections(report: LatencyReport, tokenizer=None) -> list[Section]:
    """The report's tables and lines, for the terminal and for Markdown. `tokenizer`
    (optional) shows the agreement table's tokens as text."""
    o = report.options
    points = report.points
    ttft = [{"prompt tokens": p.prompt_tokens, "cached": p.cached_tokens,
             "baseline": p.median("baseline"), "cold": p.cold, "device": p.median("device"),
             "held": p.median("held"), "host": p.median("host"), "disk": p.median("disk"),
             "speedup": round(p.speedup.median, 1),
             "speedup min-max": f"{p.speedup.low:.1f}-{p.speedup.high:.1f}",
             "floor": p.floor, "x floor": round(p.x_floor.median, 2),
             "x floor min-max": f"{p.x_floor.low:.2f}-{p.x_floor.high:.2f}"} for p in points]
    costs = [{"cached tokens": p.cached_tokens, "encode s": p.encode,
              "disk write s": p.disk_write, "baseline s": p.median("baseline"),
              "cached s": p.median("device"), "break-even requests": p.break_even,
              "MiB (fp32)": round(p.cached_tokens * report.kv_bytes_per_token / 2**20, 1)}
             for p in points]
    floors = [{"cached tokens": p.cached_tokens, "uncached tokens": p.uncached_tokens,
               "GFLOP": round(p.flops / 1e9, 2), "compute ms": p.floor_compute * 1e3,
               "memory ms": p.floor_memory * 1e3, "floor ms": p.floor * 1e3,
               "cached ms": p.median("device") * 1e3,
               "min ms": p.best("device") * 1e3,
               "cached / floor": round(p.x_floor.median, 2),
               "IQR": f"{p.x_floor.q1:.2f}-{p.x_floor.q3:.2f}",
               "n": p.x_floor.n} for p in points]
    m = report.machine
    floor_lines = [
        f"floor = max(FLOPs / matmul rate, (weights {report.weight_bytes / 2**20:,.0f} MiB + "
        f"cached KV) / copy bandwidth), per round: each of the {o.samples} rounds of a "
        f"length measures the rates once, beside its cached request and baseline pass; "
        f"medians shown (over the run: {m['matmul_gflops']} GFLOP/s, "
        f"{m['copy_gb_per_s']} GB/s)",
        f"matmul rate: a {m.get('matmul_sgemm', '')} sgemm, the fastest sustained one "
        "of: " + ", ".join(f"{s.name} {s.what} {s.flops_per_s / 1e9:.1f} GFLOP/s"
                           for s in report.sgemms)]
    for p in points:
        if p.device_torch:
            ours = p.median("device")
            torch_only = p.median("device_torch")
            floor_lines.append(
                f"at {p.cached_tokens:,} cached tokens, the same device-tier requests on "
                f"PyTorch's kernels alone (runtime/fast/kernels.c off): {torch_only * 1e3:.1f} ms "
                f"(min {p.best('device_torch') * 1e3:.1f}) = {torch_only / p.floor:.2f}x the "
                f"median floor; with the kernels {ours * 1e3:.1f} ms, "
                f"{torch_only / ours:.2f}x faster")
    k_cached, k_baseline, span = exponents(points)
    lines = [f"baseline, device and the floor: {o.samples} interleaved rounds per length "
             f"(medians, ratios per round); held, host, disk: {o.repeats} requests each "
             f"(median); seconds; model {report.model}",
             "cold: the first cached request, encoding included; device: the module in the "
             "store's memory (read in place from 256 tokens on, else copied into the request "
             "buffer); held: the request buffer still holds it; host: the store's host tier; "
             "disk: read and verified from its file"]
    if report.skipped:
        lines.append(f"skipped (longer than the model's context): "
                     f"{', '.join(map(str, report.skipped))}")
    text = (lambda t: repr(tokenizer.decode([t]))) if tokenizer is not None else str
    agree = [{"cached tokens": p.cached_tokens, "rounds": p.agreement.samples,
              "same first token": "yes" if p.agreement.agrees else
              f"NO ({p.agreement.disagreements} differ)",
              "max |logit diff|": p.agreement.max_logit_diff,
              "baseline token": text(p.agreement.baseline_token)
              if p.agreement.baseline_token is not None else None,
              "cached token": text(p.agreement.cached_token)
              if p.agreement.cached_token is not None else None} for p in points]
    fit = [f"cached TTFT ~ length^{k_cached:.2f}, baseline ~ length^{k_baseline:.2f} "
           f"(least squares in log-log over {span}, on the medians)"
           if k_cached is not None else span]
    out = [Section("Time to first token (s)", ttft, lines),
           Section("Cached against baseline: the first token", agree,
                   ["the greedy first token of the device-tier request and of the baseline "
                    "pass of the same round; the prompt is prefix-shaped, so they must agree "
                    "(the last round's tokens shown)"], float_format="{:.3g}"),
           Section("Encode cost and break-even", costs,
                   ["break-even requests: the smallest n with encode + n x cached <= "
                    "n x baseline, i.e. ceil(encode / (baseline - cached)); the request that "
                    "pays for the encoding counts as one of the n"]),
           Section("Cached TTFT against the floor", floors, floor_lines,
                   float_format="{:.4g}"),
           Section("Growth with length", (), fit)]
    d = report.decode
    if d is not None:
        out.append(Section("Decode with the long context cached", (), [
            f"{d.tokens} greedy tokens after {d.context_tokens:,} context tokens, "
            f"{len(d.ours)} runs on each side, interleaved: promptlang "
            f"{statistics.median(d.ours) * 1e3:.1f} ms/token, transformers generate() "
            f"{statistics.median(d.hf) * 1e3:.1f} ms/token ({d.hf_attention} attention, "
            f"stock model); ratio per pair {d.ratio.describe()}",
            f"transformers generate() time to first token on the same prompt: "
            f"{d.hf_ttft:.2f} s"]))
    out.append(Section("Goals", (), [str(g) for g in report.goals]))
    return out


def plot(report: LatencyReport, path, note: str = "") -> Path:
    """TTFT against prompt length, log-log, every tier and the floor; `note` is
    appended to the title (e.g. that the run was a quick one)."""
    xs = [p.prompt_tokens for p in report.points]
    series = {"baseline": (xs, [p.median("baseline") for p in report.points])}
    for tier in TIERS:
        series[f"cached: {tier}"] = (xs, [p.median(tier) for p in report.points])
    series["floor"] = (xs, [p.floor for p in report.points])
    return plot_ttft(path, series, title=f"Time to first token, {report.model}{note}",
                     dashed=("floor",))


def to_json(report: LatencyReport) -> dict[str, Any]:
    """Everything, raw samples included."""
    from dataclasses import asdict

    return {"model": report.model, "machine": report.machine, "options": asdict(report.options),
            "weight_bytes": report.weight_bytes,
            "kv_bytes_per_token": report.kv_bytes_per_token, "seconds": report.seconds,
            "skipped": report.skipped,
            "sgemm_candidates": [asdict(s) | {"name": s.name} for s in report.sgemms],
            "points": [{**asdict(p), **p.row(), "floors": p.floors(),
                        "x_floor": asdict(p.x_floor), "speedup_spread": asdict(p.speedup)}
                       for p in report.points],
            "decode": None if report.decode is None else
            {**asdict(report.decode), "ratio": asdict(report.decode.ratio)},
            "goals": [asdict(g) | {"verdict": g.verdict} for g in report.goals]}
