"""Weight-only quantization of a float checkpoint: `load(path, quantize="q4_1" | "q8_0")`.

Every decoder linear weight of a Llama-family model is quantized to GGUF blocks by the
`gguf` package's own quantizer (Q4_1: blocks of 32 weights d * q + m, q 4-bit; Q8_0:
d * q, q 8-bit) and then REPLACED by its blocks' dequantized values, so the model from
then on *is* the quantized model: transformers' own forward, the oracle and the baseline
compute with exactly the numbers the kernels read from the blocks (fast/fused.py checks
each block set against its weight, bit for bit). The LM head (and the embedding, when the
two are tied) becomes Q8_0 under both schemes, as in the default model's GGUF.

It runs before the adapter fingerprints the weights (runtime/model/fingerprint.py), so KV
stored for the float model is never served to the quantized one. Its cost in answers is
the quantization's, measured against the float model in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import hashlib
import sys
import warnings

import torch
from tqdm import tqdm

from promptlang.errors import ModelError

SCHEMES = {"q4_1": 4, "q8_0": 8}      # name -> block kind (fast/fused.py attach_blocks)

# the decoder layers' linear weights, by their names in a Llama-family layer
LINEARS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
           "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
           "mlp.down_proj.weight")


def checked_scheme(scheme: str | None, name_or_path, dtype: torch.dtype) -> str | None:
    """`scheme` if `load` can apply it to the model `name_or_path` at `dtype`, else a
    clear error (before anything is loaded)."""
    from promptlang.runtime.model.loading import gguf_source

    if scheme is None:
        return None
    if scheme not in SCHEMES:
        raise ModelError(f"quantize must be one of {', '.join(SCHEMES)} (or None: the "
                         f"checkpoint's own weights), not {scheme!r}")
    if dtype != torch.float32:
        raise ModelError(f"quantize={scheme!r} needs dtype=torch.float32, not {dtype}")
    if gguf_source(name_or_path) is not None:
        raise ModelError(f"quantize={scheme!r} is for float checkpoints: a GGUF model (the "
                         "default one included) is served from its own blocks")
    return scheme


def attach(decoder, blocks, scheme: str) -> None:
    """Have the fused layers (fast/fused.py FusedDecoder) read `blocks` (linear weights of
    `scheme`'s kind, LM head Q8_0 or None): `quantize_model`'s, or a GGUF's as stored."""
    linears, head = blocks
    decoder.attach_blocks(linears, SCHEMES[scheme])
    if head is not None:
        decoder.attach_q8_head(head)


# The block kinds (fast/native.py KINDS) a GGUF's linear weights are served from as stored, on
# every CPU the kernels run on: Q4_1, Q5_0, Q8_0 and the K-quants, their weights made in
# registers (256- or 512-bit) by a pass of 1-3 rows and a group of 4 rows at a time into a
# buffer by a longer one. A pass gives the same numbers either way (the blocks hold the float
# copy's values, and the tiles sum in the float tiles' order).
GGUF_SERVED = frozenset({4, 6, 8, 12, 13, 14})


def serve_numerics(adapter, source, dtype, scheme: str | None, blocks, bf16_attention: bool,
                   int8_linears: bool, record=None) -> None:
    """What `load` gives the adapter's fused layers (if it has them): `quantize_model`'s
    blocks under `scheme`, else the GGUF `source`'s own (float32 only; source None: none),
    kept without their float32 copies (FusedDecoder.drop_float_copies), then the opt-in
    approximations -- bf16 attention products, int8 linear layers (which
    replace the blocks: fast/fused.py attach_int8), each with a warning where the CPU lacks
    them. KV computed with an approximation is not the model's: the adapter's fingerprint
    (the store's key) then names the approximations too, so it is stored apart.
    `record`: the converted copy's LoadRecord (load_record.py), which keeps which of the
    GGUF's blocks equal its float weights, per version of the kernels, so that a later
    load does not read every float weight again to compare."""
    from promptlang.runtime.fast import native
    from promptlang.runtime.model.loading import quantized_blocks

    decoder = adapter.fast.decoder
    if decoder is None:
        return
    if blocks is not None:
        attach(decoder, blocks, scheme)
    elif source is not None and dtype == torch.float32:
        linears, head = quantized_blocks(source, adapter.model.config)
        served = {where: pair for where, pair in linears.items() if pair[0] in GGUF_SERVED}
        key = f"blocks_equal:{native.kernels_version()}"
        known = record.get(key) if record is not None else None
        checks = dict(known) if isinstance(known, dict) else {}
        decoder.attach_blocks(served, kind=None, checks=checks)    # each weight its own type
        if head is not None:
            decoder.attach_q8_head(head, checks=checks)
        if record is not None and checks != known:
            record.put(key, checks)
    approximations = []
    decoder.bf16_attention = bool(bf16_attention)
    if bf16_attention and native.products_available("bf16"):
        approximations.append("bf16-attention")
    elif bf16_attention:
        warnings.warn("promptlang: bf16_attention needs AVX512_BF16; the attention stays "
                      "float32", RuntimeWarning, stacklevel=3)
    if int8_linears and decoder.attach_int8():
        approximations.append("int8-linears")
    elif source is not None and blocks is None and dtype == torch.float32:
        decoder.drop_float_copies()        # the GGUF's blocks are the weights' only copy
    elif int8_linears:
        warnings.warn("promptlang: int8_linears needs the CPU kernels and layer widths that "
                      "are multiples of 64; the linear layers stay as they were",
                      RuntimeWarning, stacklevel=3)
    if approximations:
        named = f"{adapter.fingerprint}+{'+'.join(approximations)}".encode()
        adapter.fingerprint = hashlib.sha256(named).hexdigest()[:32]


def quantize_model(hf_model: torch.nn.Module, scheme: str
                   ) -> tuple[dict[tuple[int, str], torch.Tensor], torch.Tensor | None]:
    """Quantize `hf_model`'s weights in place (module docstring). Returns the linear
    weights' blocks, {(layer index, name in LINEARS): [rows, k / 32 * bytes] uint8}, and
    the LM head's Q8_0 blocks (None where its width is not a multiple of 32)."""
    from gguf import GGMLQuantizationType

    kind = SCHEMES[scheme]
    layers = getattr(getattr(hf_model, "model", None), "layers", None)
    head = getattr(hf_model, "lm_head", None)
    if layers is None or not isinstance(head, torch.nn.Linear):
        raise ModelError(f"quantize={scheme!r} serves Llama-family models (decoder layers "
                         f"with q/k/v/o and gate/up/down projections); "
                         f"{type(hf_model).__name__} is not one")
    qtype = GGMLQuantizationType.Q4_1 if kind == 4 else GGMLQuantizationType.Q8_0
    linears = {}
    bar = tqdm(total=len(layers), desc=f"promptlang: quantizing to {scheme}", unit="layer",
               file=sys.stderr, leave=False, disable=None)   # None: only on a terminal
    with torch.no_grad(), bar:
        for index, layer in enumerate(layers):
            for name in LINEARS:
                weight = _parameter(layer, name)
                blocks = None if weight is None else _replace(weight, qtype)
                if blocks is not None:
                    linears[(index, name)] = blocks
            bar.update(1)
        head_blocks = _replace(head.weight, GGMLQuantizationType.Q8_0)
    if not linears:
        raise ModelError(f"quantize={scheme!r}: {type(hf_model).__name__} has no float32 "
                         "linear weights whose width is a multiple of 32")
    return linears, head_blocks


def _parameter(layer: torch.nn.Module, name: str) -> torch.Tensor | None:
    path, _, attribute = name.rpartition(".")
    try:
        module = layer.get_submodule(path)
    except AttributeError:
        return None
    weight = getattr(module, attribute, None)
    return weight if isinstance(weight, torch.Tensor) else None


def _replace(weight: torch.Tensor, qtype) -> torch.Tensor | None:
    """The blocks of `weight` [rows, k] (k % 32 == 0, else None and nothing changes); the
    weight now holds their dequantized values."""
    from gguf import quants

    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % 32:
        return None
    blocks = quants.quantize(weight.detach().cpu().numpy(), qtype)
    values = quants.dequantize(blocks, qtype).astype("float32").reshape(tuple(weight.shape))
    weight.copy_(torch.from_numpy(values))
    return torch.from_numpy(blocks).contiguous()
