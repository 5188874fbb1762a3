"""Study (not a test): causal attention over one long pass in bfloat16, torch's CPU flash
kernel against attention built from bfloat16 matmuls and against promptlang's
pl_causal (runtime/fast/kernels.c) in both dtypes, at the default model's shape.

    python tests/studies/attention_bf16.py [TOKENS] [BLOCK]

Query heads 9, key/value heads 3 (grouped), head size 64, as SmolLM2-135M. Times (median of
3) F.scaled_dot_product_attention(is_causal=True) in float32 and in bfloat16, and a blocked
form: each block of BLOCK queries takes its scores against the keys up to its end with one
bfloat16 matmul, a float32 softmax (the causal mask on its diagonal block), and a bfloat16
matmul with the values; and pl_causal in float32 and in bfloat16 (the grouped key/value
heads read as they are; bfloat16 on a CPU with AVX512-BF16).
Prints each one's seconds and its largest difference from the float32 result.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from promptlang.runtime.fast import native


def blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    """Causal attention of q [H, S, D] over k, v [H, S, D] (bfloat16), block by block."""
    heads, length, size = q.shape
    out = torch.empty_like(q)
    scale = size ** -0.5
    for start in range(0, length, block):
        end = min(start + block, length)
        scores = torch.matmul(q[:, start:end], k[:, :end].transpose(1, 2)).float() * scale
        rows = torch.arange(start, end)[:, None]
        cols = torch.arange(end)[None, :]
        scores.masked_fill_(cols > rows, float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(q.dtype)
        out[:, start:end] = torch.matmul(weights, v[:, :end])
    return out


def timed(run) -> tuple[float, torch.Tensor]:
    samples = []
    result = None
    for _ in range(3):
        began = time.perf_counter()
        result = run()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples), result


def main(tokens: int, block: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(9, tokens, 64)
    k3 = torch.randn(3, tokens, 64)
    v3 = torch.randn(3, tokens, 64)
    k = k3.repeat_interleave(3, dim=0)
    v = v3.repeat_interleave(3, dim=0)
    reference_s, reference = timed(lambda: F.scaled_dot_product_attention(
        q[None], k[None], v[None], is_causal=True)[0])
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    flash_s, flash = timed(lambda: F.scaled_dot_product_attention(
        qb[None], kb[None], vb[None], is_causal=True)[0])
    ours_s, ours = timed(lambda: blocked(qb, kb, vb, block))
    rows = [("sdpa bfloat16", flash_s, flash), ("blocked bf16 mm", ours_s, ours)]
    k3b, v3b = k3.bfloat16(), v3.bfloat16()
    if native.available() and native.causal_fits(q, k3, v3):
        rows.append(("pl_causal fp32", *timed(lambda: native.causal(q, k3, v3, 0.125))))
    if native.available() and native.causal_fits(qb, k3b, v3b):
        rows.append(("pl_causal bf16", *timed(lambda: native.causal(qb, k3b, v3b, 0.125))))
    print(f"tokens {tokens}, block {block}, torch threads {torch.get_num_threads()}")
    print(f"sdpa float32     {reference_s:8.3f} s")
    for name, seconds, out in rows:
        error = float((out.float() - reference).abs().max())
        print(f"{name:16s} {seconds:8.3f} s  {reference_s / seconds:5.2f}x float32  "
              f"max |diff| {error:.4f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7379,
         int(sys.argv[2]) if len(sys.argv) > 2 else 512)
