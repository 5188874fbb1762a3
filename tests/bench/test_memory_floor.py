"""KV bytes per token, model shapes, and the floor formula, against hand-computed numbers."""

import pytest
from transformers import FalconConfig, GPT2Config, LlamaConfig

from promptlang.bench import floor, memory
from promptlang.bench.shapes import PUBLISHED, ModelShape, shape_from_config


def test_default_model_caches_46080_bytes_per_token_in_float32():
    assert memory.kv_bytes_per_token(PUBLISHED["SmolLM2-135M"], 4) == 46_080


def test_llama2_7b_caches_half_a_mebibyte_per_token_in_float16():
    assert memory.kv_bytes_per_token(PUBLISHED["Llama-2-7B"], 2) == 524_288


def test_grouped_and_multi_query_attention_shrink_the_cache():
    assert memory.kv_bytes_per_token(PUBLISHED["Llama-2-70B"], 2) == 80 * 2 * 8 * 128 * 2
    assert memory.kv_bytes_per_token(PUBLISHED["Falcon-7B"], 2) == 32 * 2 * 1 * 64 * 2


def test_kv_bytes_from_transformers_configs():
    smol = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                       num_key_value_heads=3, intermediate_size=1536, vocab_size=49152)
    assert memory.kv_bytes_per_token(smol) == 46_080
    # no num_key_value_heads: one KV head per attention head; head_dim = hidden / heads
    gpt2 = GPT2Config(n_layer=12, n_embd=768, n_head=12)
    assert memory.kv_bytes_per_token(gpt2, 2) == 12 * 2 * 12 * 64 * 2
    # Falcon: multi-query keeps one KV head; the new decoder architecture num_kv_heads
    assert shape_from_config(FalconConfig(multi_query=True)).kv_heads == 1
    assert shape_from_config(FalconConfig(multi_query=False)).kv_heads == 71
    assert shape_from_config(FalconConfig(new_decoder_architecture=True,
                                          num_kv_heads=8)).kv_heads == 8


def test_published_shapes_add_up_to_the_advertised_parameter_counts():
    billions = {name: shape.parameter_count() / 1e9 for name, shape in PUBLISHED.items()}
    assert billions["SmolLM2-135M"] == pytest.approx(0.135, rel=0.01)
    assert billions["Qwen2.5-0.5B"] == pytest.approx(0.494, rel=0.01)
    assert billions["Llama-2-7B"] == pytest.approx(6.74, rel=0.01)
    assert billions["Llama-2-13B"] == pytest.approx(13.0, rel=0.01)
    assert billions["Llama-2-70B"] == pytest.approx(69.0, rel=0.01)
    assert billions["Llama-3-8B"] == pytest.approx(8.03, rel=0.01)
    assert billions["Mistral-7B"] == pytest.approx(7.24, rel=0.01)


def test_memory_table_has_every_model_and_prints_every_paper_figure_beside_ours():
    rows = memory.memory_rows()
    assert [r["model"] for r in rows] == list(PUBLISHED)
    smol = rows[0]
    assert (smol["bytes/token fp16"], smol["bytes/token fp32"]) == (23_040, 46_080)
    assert set(memory.PAPER_TABLE2) <= set(PUBLISHED)
    table = memory.memory_table()
    assert "46,080" in table and "524,288" in table
    lines = table.splitlines()
    ours_at = lines[0].index(memory.OURS_MIB)
    paper_end = lines[0].index(memory.PAPER_HEADER) + len(memory.PAPER_HEADER)
    for line in lines[2:]:
        model = line.split()[0]
        paper_cell = line[ours_at:paper_end].split()       # ours, then the paper's
        mib = memory.kv_bytes_per_token(PUBLISHED[model], 2) / 2**20
        assert paper_cell[0] == f"{mib:.4f}"
        # the paper's figure as printed ("2.5" stays "2.5"), n/a where it has none
        assert paper_cell[1] == memory.PAPER_TABLE2.get(model, "n/a")


PAPER = {name: float(printed) for name, printed in memory.PAPER_TABLE2.items()}


def _mib_fp16(shape: ModelShape) -> float:
    return memory.kv_bytes_per_token(shape, 2) / 2**20


@pytest.mark.parametrize("name", ["BERT-base", "Falcon-RW-1B", "Llama-2-7B", "Llama-2-13B",
                                  "MPT-30B"])
def test_paper_figures_of_multi_head_models_are_our_fp16_size(name):
    shape = PUBLISHED[name]
    assert shape.kv_heads == shape.heads
    # the paper prints MiB cut to two decimals: 0.0352 -> 0.03, 0.1875 -> 0.18
    assert PAPER[name] <= _mib_fp16(shape) < PAPER[name] + 0.01
    assert memory.memory_rows({name: shape})[0]["paper vs ours"] == "agrees"


@pytest.mark.parametrize("name, every_heads", [("Llama-2-70B", 64), ("Falcon-40B", 128),
                                               ("Falcon-180B", 232)])
def test_paper_figures_of_gqa_models_count_k_v_for_all_heads(name, every_heads):
    shape = PUBLISHED[name]
    assert shape.kv_heads == 8 and shape.heads == every_heads
    all_heads = ModelShape(name, shape.layers, shape.hidden, shape.heads, shape.heads,
                           shape.head_dim, shape.intermediate, shape.vocab)
    assert PAPER[name] <= _mib_fp16(all_heads) < PAPER[name] + 0.01
    assert _mib_fp16(shape) * every_heads / 8 == _mib_fp16(all_heads)   # ours is smaller
    assert not PAPER[name] <= _mib_fp16(shape) < PAPER[name] + 0.01
    note = memory.memory_rows({name: shape})[0]["paper vs ours"]
    assert note.startswith(f"all {every_heads} heads: ") and "GQA" in note


def test_paper_figures_are_cut_not_rounded_and_keyed_by_paper_rows():
    assert memory.reads_as(0.03515625, "0.03") and not memory.reads_as(0.03515625, "0.04")
    assert memory.reads_as(1.875, "1.87") and memory.reads_as(2.5, "2.5")
    assert memory.reads_as(0.5, "0.50") and not memory.reads_as(0.4999, "0.50")
    assert memory.PAPER_TABLE2 == {"BERT-base": "0.03", "Falcon-RW-1B": "0.18",
                                   "Llama-2-7B": "0.50", "Llama-2-13B": "0.78",
                                   "MPT-30B": "1.31", "Falcon-40B": "1.87",
                                   "Llama-2-70B": "2.5", "Falcon-180B": "4.53"}
    lines = memory.paper_lines(memory.memory_rows())
    assert any("2311.04934v2" in line and "16-bit" in line for line in lines)
    assert any("Llama-2-70B 8x, Falcon-40B 16x, Falcon-180B 29x" in line for line in lines)


def test_paper_models_shapes_follow_their_configs():
    bert, falcon_1b, mpt, falcon_40b, falcon_180b = (
        PUBLISHED[n] for n in ("BERT-base", "Falcon-RW-1B", "MPT-30B", "Falcon-40B",
                               "Falcon-180B"))
    # head_dim = hidden / heads everywhere; MPT's 7168 / 64 = 112
    for shape in (bert, falcon_1b, mpt, falcon_40b, falcon_180b):
        assert shape.head_dim * shape.heads == shape.hidden
    # falcon-rw-1b: no multi-query, no new decoder architecture -> num_kv_heads (32);
    # Falcon-40B/180B: new decoder architecture, num_kv_heads 8
    assert shape_from_config(FalconConfig(
        hidden_size=2048, num_attention_heads=32, num_hidden_layers=24, num_kv_heads=32,
        multi_query=False, new_decoder_architecture=False)).kv_heads == falcon_1b.kv_heads
    assert shape_from_config(FalconConfig(
        hidden_size=14848, num_attention_heads=232, num_hidden_layers=80, num_kv_heads=8,
        new_decoder_architecture=True)).kv_heads == falcon_180b.kv_heads == 8
    # roughly their nominal sizes (a typo in layers or hidden would be far off; tied or
    # untied embeddings, norms and biases are within the tolerance)
    billions = {n: PUBLISHED[n].parameter_count() / 1e9
                for n in ("BERT-base", "Falcon-RW-1B", "MPT-30B", "Falcon-40B", "Falcon-180B")}
    assert billions["BERT-base"] == pytest.approx(0.110, rel=0.05)
    assert billions["Falcon-RW-1B"] == pytest.approx(1.3, rel=0.05)
    assert billions["MPT-30B"] == pytest.approx(30, rel=0.05)
    assert billions["Falcon-40B"] == pytest.approx(40, rel=0.05)
    assert billions["Falcon-180B"] == pytest.approx(180, rel=0.05)


def test_floor_is_compute_or_memory_whichever_takes_longer():
    # 1e9 FLOPs at 1e10 FLOP/s = 0.1 s; 3e8 bytes at 1e9 B/s = 0.3 s
    assert floor.floor_seconds(1e9, 2e8, 1e8, rate=1e10, bandwidth=1e9) == pytest.approx(0.3)
    assert floor.floor_seconds(1e10, 2e8, 1e8, rate=1e10, bandwidth=1e9) == pytest.approx(1.0)


def test_prefill_flops_on_a_hand_computed_shape():
    shape = ModelShape("toy", layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4,
                       intermediate=16, vocab=10)
    per_layer = 8 * 4 * (2 * 2 + 2 * 1) + 3 * 8 * 16            # 192 + 384 = 576
    assert shape.linear_params_per_layer() == per_layer
    # 3 new tokens after 5 cached ones see 6 + 7 + 8 = 21 keys
    expected = 2 * 3 * 2 * per_layer + 2 * 1 * 8 * 10 + 4 * 2 * 2 * 4 * 21
    assert floor.prefill_flops(shape, n_new=3, n_context=5) == expected
    # every new token's logits: 3 rows of the LM head instead of 1
    assert floor.prefill_flops(shape, 3, 5, logits_tokens=3) == expected + 2 * 2 * 8 * 10


def test_prefill_flops_grow_linearly_in_context_for_a_fixed_question():
    shape = PUBLISHED["SmolLM2-135M"]
    a, b, c = (floor.prefill_flops(shape, 14, ctx) for ctx in (1000, 2000, 3000))
    assert b - a == pytest.approx(c - b)
    assert b - a == 4 * 30 * 9 * 64 * 14 * 1000


def test_measured_machine_numbers_are_positive_and_finite():
    machine = floor.measure_machine([(64, 64, 64, "square")], copy_bytes=1 << 20,
                                    seconds=0.01, repeats=1)
    assert 0 < machine.matmul_flops_per_s < float("inf")
    assert 0 < machine.copy_bytes_per_s < float("inf")
    assert machine.threads >= 1
    assert machine.sgemm == "64x64x64 (square)"


def test_workload_shapes_are_the_models_prefill_matmuls():
    shapes = floor.workload_shapes(PUBLISHED["SmolLM2-135M"], rows=2048)
    assert [(m, k, n) for m, k, n, _ in shapes] == [(2048, 576, 576), (2048, 576, 1536),
                                                    (2048, 1536, 576)]
    candidates = floor.candidate_shapes(PUBLISHED["SmolLM2-135M"])
    assert [c[:3] for c in candidates[:2]] == list(floor.SQUARE_SHAPES)
    assert candidates[2:] == floor.workload_shapes(PUBLISHED["SmolLM2-135M"])


def test_best_sgemm_keeps_the_fastest_shape_and_every_measurement(monkeypatch):
    # the rate of a shape is made up here: the floor must take the best, not the first
    monkeypatch.setattr(floor, "sgemm_rate", lambda m, k, n, seconds: float(m * 10 + n))
    best, measured = floor.best_sgemm([(1, 1, 1, "a"), (9, 1, 2, "b"), (3, 1, 1, "c")])
    assert (best.name, best.what, best.flops_per_s) == ("9x1x2", "b", 92.0)
    assert [s.name for s in measured] == ["1x1x1", "9x1x2", "3x1x1"]


def test_floor_sampler_measures_both_rates_each_call():
    sampler = floor.FloorSampler(floor.Sgemm(32, 32, 32, 1.0), copy_bytes=1 << 16,
                                 seconds=0.001, copies=1)
    samples = [sampler.sample() for _ in range(2)]
    assert len(samples) == 2
    assert all(rate > 0 and bandwidth > 0 for rate, bandwidth in samples)


def test_module_weight_bytes_counts_tied_weights_once():
    import torch

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    assert floor.module_weight_bytes(model) == 10 * 4 * 4
