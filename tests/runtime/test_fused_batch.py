"""Several requests in one fused pass (fused.py `forward_batch`, pl_decoder's requests): each
request's logits and new keys/values equal those of its own pass, so the linear layers can
read every weight once per step for a whole batch (batched serving).

The requests differ in past length and positions, one has several new tokens, two read
the same unit's tensors, and the shorter pasts sit in key blocks next to the longer ones."""

from __future__ import annotations

import pytest
import torch

from promptlang.runtime.fast import native
from promptlang.runtime.fast.fused import MAX_TOKENS, BatchRequest, FusedDecoder
from promptlang.runtime.fast.pieces import Piece

from .test_fused import TOL, VOCAB, tiny


@pytest.fixture(scope="module")
def decoder():
    if not native.available():
        pytest.skip("CPU kernels unavailable here")
    model = tiny("llama")
    found = FusedDecoder.of(model, "Llama")
    assert found is not None
    return found


def piece(layers, heads, n, d, seed) -> Piece:
    g = torch.Generator().manual_seed(seed)
    return Piece(torch.randn(layers, heads, n, d, generator=g),
                 torch.randn(layers, heads, n, d, generator=g))


def request(dec, pieces, tokens, start, seed, positioned=False):
    layers, heads, d = len(dec.layers), dec.kv_heads, dec.head_dim
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (tokens,), generator=g)
    positions = torch.arange(start, start + tokens)
    past = sum(p.keys.shape[2] for p in pieces)
    known = torch.arange(past, dtype=torch.int64) if positioned else None
    return BatchRequest(ids, positions, pieces, torch.zeros(layers, heads, tokens, d),
                        torch.zeros(layers, heads, tokens, d), torch.arange(tokens), known)


def alone(dec, r: BatchRequest):
    keys, values = torch.zeros_like(r.new_keys), torch.zeros_like(r.new_values)
    logits = dec.forward(r.input_ids, r.positions, r.pieces, keys, values, r.rows,
                         key_positions=r.key_positions, contexts=r.contexts)
    assert logits is not None
    return logits, keys, values


def batch_against_alone(dec, requests):
    """`forward_batch` of `requests` gives each request's own pass (logits, new keys and
    values); returns those passes."""
    expected = [alone(dec, r) for r in requests]
    got = dec.forward_batch(requests)
    assert got is not None and len(got) == len(requests)
    for r, logits, (want, keys, values) in zip(requests, got, expected):
        assert logits.shape == want.shape
        assert (logits - want).abs().max() < TOL
        assert (r.new_keys - keys).abs().max() < TOL
        assert (r.new_values - values).abs().max() < TOL
    return expected


@pytest.mark.parametrize("positioned", [False, True], ids=["all visible", "by position"])
def test_each_request_of_a_batch_gets_its_own_pass(decoder, positioned):
    layers, heads, d = len(decoder.layers), decoder.kv_heads, decoder.head_dim
    shared = piece(layers, heads, 150, d, 1)               # one unit read by two requests
    requests = [
        request(decoder, [piece(layers, heads, 300, d, 2)], 1, 300, 10, positioned),
        request(decoder, [shared, piece(layers, heads, 7, d, 3)], 1, 157, 11, positioned),
        request(decoder, [piece(layers, heads, 5, d, 4)], 3, 5, 12, positioned),
        request(decoder, [shared], 1, 150, 13, positioned),
    ]
    batch_against_alone(decoder, requests)


def test_a_batch_that_leaves_out_a_request_changes_the_others_not_at_all(decoder):
    """The test can fail: a token that saw another request's keys would differ."""
    layers, heads, d = len(decoder.layers), decoder.kv_heads, decoder.head_dim
    a = request(decoder, [piece(layers, heads, 40, d, 5)], 1, 40, 20)
    b = request(decoder, [piece(layers, heads, 60, d, 6)], 1, 60, 21)
    together = decoder.forward_batch([a, b])[0]
    first = decoder.forward_batch([a])[0]
    assert (together - first).abs().max() < TOL
    wrong = decoder.forward(a.input_ids, a.positions, a.pieces + b.pieces,
                            torch.zeros_like(a.new_keys), torch.zeros_like(a.new_values),
                            a.rows)
    assert (wrong - first).abs().max() > 1e-3           # seeing b's keys would show


def test_many_requests_with_more_pieces_than_one_pass_takes_and_mixed_visibility(decoder):
    """More pieces in all than one request may have (each request has its own tasks), rows
    of one request over several row blocks, and requests that mix the positional rule
    (recomputed tokens: past keys after them stay unseen) with plain decode steps."""
    layers, heads, d = len(decoder.layers), decoder.kv_heads, decoder.head_dim
    shared = piece(layers, heads, 33, d, 40)
    requests = []
    for i in range(17):
        pieces = [shared] + [piece(layers, heads, 3 + i % 5, d, 100 + 4 * i + k)
                             for k in range(3)]
        past = sum(p.keys.shape[2] for p in pieces)
        tokens = 34 if i == 5 else 1 + i % 2     # 34 tokens: 68 rows per KV head
        requests.append(request(decoder, pieces, tokens, past, 200 + i, positioned=i % 2 == 0))
    # recomputed tokens: positions 10..14, while the past holds keys at 0..9 and 20..29
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (5,), generator=g)
    known = torch.cat([torch.arange(10), torch.arange(20, 30)])
    requests.append(BatchRequest(ids, torch.arange(10, 15), [piece(layers, heads, 20, d, 8)],
                                 torch.zeros(layers, heads, 5, d), torch.zeros(layers, heads, 5, d),
                                 torch.arange(5), known))
    assert sum(len(r.pieces) for r in requests) >= native.MAX_PIECES
    assert sum(int(r.input_ids.shape[0]) for r in requests) <= MAX_TOKENS
    expected = batch_against_alone(decoder, requests)
    seen = alone(decoder, requests[-1]._replace(key_positions=None))[0]
    assert (seen - expected[-1][0]).abs().max() > 1e-3   # the later keys would show


def test_ape_requests_batch_with_plain_ones(decoder):
    """APE's contexts (recompute policy "ape") per request: a batch of requests with and
    without contexts gives each its own pass; different temperatures are not batched."""
    layers, heads, d = len(decoder.layers), decoder.kv_heads, decoder.head_dim
    shared = piece(layers, heads, 150, d, 1)
    ape = (0.8, 1.3)
    requests = [
        request(decoder, [piece(layers, heads, 20, d, 2), shared], 2, 170, 30)
        ._replace(contexts=([False, True], *ape)),
        request(decoder, [shared, piece(layers, heads, 9, d, 3)], 1, 159, 31),
        request(decoder, [piece(layers, heads, 30, d, 4), piece(layers, heads, 40, d, 5),
                          piece(layers, heads, 6, d, 6)], 1, 76, 32)
        ._replace(contexts=([False, True, True], *ape)),
    ]
    expected = batch_against_alone(decoder, requests)
    plain = alone(decoder, requests[0]._replace(contexts=None))[0]
    assert (plain - expected[0][0]).abs().max() > 1e-3          # the contexts show
    other = requests[2]._replace(contexts=([False, True, True], 0.5, 1.3))
    assert decoder.forward_batch([requests[0], other]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rows_of_requests_over_a_shared_unit_run_as_one_task(decoder, dtype):
    """Requests that read the same stored unit in place (a batched decode step of a served
    RAG workload) have their rows over it computed together (kernels.c attend_group): the
    same numbers as one task per request, bit for bit, and each request still its own pass.
    Units of 34 and 68 rows (prefills) pack with decode rows up to a task's 64."""
    layers, heads, d = len(decoder.layers), decoder.kv_heads, decoder.head_dim

    def stored(n, seed):
        p = piece(layers, heads, n, d, seed)
        return Piece(p.keys.to(dtype), p.values.to(dtype))

    docs = [stored(130, 50), stored(40, 51), stored(200, 52)]
    requests = []
    for i in range(12):
        mine = [docs[i % 3], docs[(i + 1) % 3]] if i % 4 else [docs[i % 3]]
        pieces = mine + [piece(layers, heads, 2 + i % 3, d, 300 + i)]
        past = sum(p.keys.shape[2] for p in pieces)
        tokens = {3: 17, 7: 34}.get(i, 1)
        requests.append(request(decoder, pieces, tokens, past, 400 + i))
    was = native.group_shared()
    try:
        native.group_shared(False)
        before = native.group_runs()
        apart = [t.clone() for t in decoder.forward_batch(requests)]
        kv_apart = [(r.new_keys.clone(), r.new_values.clone()) for r in requests]
        assert native.group_runs() == before
        native.group_shared(True)
        together = batch_against_alone(decoder, requests)
        assert native.group_runs() > before        # the grouped tasks ran
        got = decoder.forward_batch(requests)
    finally:
        native.group_shared(was)
    for r, a, b, (keys, values) in zip(requests, apart, got, kv_apart):
        assert torch.equal(a, b)
        assert torch.equal(r.new_keys, keys) and torch.equal(r.new_values, values)
    assert len(together) == len(requests)
