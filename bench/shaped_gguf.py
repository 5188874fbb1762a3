"""A GGUF of a real model's shapes and quantization types, with random weights, for `bench peers
--model`: what the speed, memory and load measurements depend on is the tensors' shapes and
types, not their values, and no model can be downloaded here.

    python -m promptlang.bench.shaped_gguf OUT.gguf [--shape qwen2.5-0.5b] [--seed S]

The one shape: Qwen2.5-0.5B-Instruct (qwen2: 24 layers, hidden 896, 14 query and 2 KV heads
of 64, MLP 4864, q/k/v biases, tied embeddings, a 151,936-token vocabulary), with the tensor
types llama.cpp's quantizer gives it for Q4_K_M (`llama_tensor_get_type`): Q4_K, or Q6_K for
the attention's V and the MLP's down projection in the layers it gives more bits (the first
and last eighth, and every third between); a row that is not whole 256-weight super-blocks
(896 weights) takes the fallback (Q4_K -> Q5_0, Q6_K -> Q8_0), and the tied embedding, the
output matrix's type, Q6_K, falls back to Q8_0. The tokenizer is the default model's (its
vocabulary padded with unused tokens to the shape's size), so the file loads in llama.cpp,
transformers and promptlang alike. Weights are random blocks with small float16 scales:
answers are meaningless, every pass's arithmetic is the real model's.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int
    context: int
    rope_theta: float


SHAPES = {"qwen2.5-0.5b": Shape("qwen2", 24, 896, 14, 2, 4864, 151936, 32768, 1000000.0)}
QK_K = 256
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K for V and the down projection."""
    return (layer < layers // 8 or layer >= 7 * layers // 8
            or (layer - layers // 8) % 3 == 2)


def q4_k_m_type(name: str, layer: int, layers: int, columns: int) -> str:
    """The tensor type of weight `name` (a GGUF name's part: attn_q, ffn_down, ...)."""
    wanted = "Q6_K" if name in ("attn_v", "ffn_down") and more_bits(layer, layers) else "Q4_K"
    if name == "token_embd":
        wanted = "Q6_K"
    return wanted if columns % QK_K == 0 else FALLBACK[wanted]


def random_blocks(qtype, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] uint8 of random blocks of `qtype` whose float16 scales are small."""
    import gguf

    per_block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * (columns // per_block), nbytes), dtype=np.uint8)
    offsets = {"Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}[qtype.name]
    for offset in offsets:
        scales = rng.uniform(-0.002, 0.002, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write(path: Path, shape: Shape, seed: int = 0) -> None:
    """The GGUF of `shape` at `path` (see the module doc)."""
    import gguf

    from promptlang import default_model

    source = gguf.GGUFReader(str(default_model.default_gguf_path()))
    fields = source.fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8")
              for i in fields["tokenizer.ggml.tokens"].data]
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0])
             for i in fields["tokenizer.ggml.token_type"].data]
    if len(tokens) > shape.vocab:
        raise ValueError(f"the default tokenizer's {len(tokens)} tokens exceed the shape's "
                         f"vocabulary of {shape.vocab}")
    padding = shape.vocab - len(tokens)
    tokens += [f"<unused{i}>" for i in range(padding)]
    types += [gguf.TokenType.UNUSED] * padding
    merges = [bytes(fields["tokenizer.ggml.merges"].parts[i]).decode("utf-8")
              for i in fields["tokenizer.ggml.merges"].data]

    def scalar(key: str) -> int:
        return int(fields[key].parts[fields[key].data[0]][0])

    head_dim = shape.hidden // shape.heads
    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_name(f"random-{shape.arch}-shaped")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.inter)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_tokenizer_model(bytes(fields["tokenizer.ggml.model"].parts[-1]).decode())
    writer.add_tokenizer_pre(bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode())
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(scalar("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(scalar("tokenizer.ggml.eos_token_id"))
    writer.add_pad_token_id(scalar("tokenizer.ggml.padding_token_id"))
    writer.add_chat_template(bytes(fields["tokenizer.chat_template"].parts[-1]).decode())
    rng = np.random.default_rng(seed)
    kv = shape.kv_heads * head_dim

    def weight(name: str, layer: int, rows: int, columns: int, gguf_name: str) -> None:
        qtype = getattr(gguf.GGMLQuantizationType, q4_k_m_type(name, layer, shape.layers,
                                                                columns))
        writer.add_tensor(gguf_name, random_blocks(qtype, rows, columns, rng), raw_dtype=qtype)

    def floats(gguf_name: str, size: int, mean: float) -> None:
        values = (mean + 0.02 * rng.standard_normal(size)).astype(np.float32)
        writer.add_tensor(gguf_name, values)

    weight("token_embd", 0, shape.vocab, shape.hidden, "token_embd.weight")
    floats("output_norm.weight", shape.hidden, 1.0)
    for i in range(shape.layers):
        floats(f"blk.{i}.attn_norm.weight", shape.hidden, 1.0)
        floats(f"blk.{i}.ffn_norm.weight", shape.hidden, 1.0)
        for name, rows, columns in (("attn_q", shape.hidden, shape.hidden),
                                    ("attn_k", kv, shape.hidden), ("attn_v", kv, shape.hidden),
                                    ("attn_output", shape.hidden, shape.hidden),
                                    ("ffn_gate", shape.inter, shape.hidden),
                                    ("ffn_up", shape.inter, shape.hidden),
                                    ("ffn_down", shape.hidden, shape.inter)):
            weight(name, i, rows, columns, f"blk.{i}.{name}.weight")
        if shape.arch == "qwen2":
            for name, size in (("attn_q", shape.hidden), ("attn_k", kv), ("attn_v", kv)):
                floats(f"blk.{i}.{name}.bias", size, 0.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m promptlang.bench.shaped_gguf",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write(args.out, SHAPES[args.shape], args.seed)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
