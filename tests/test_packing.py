"""Packed rows in one process: the packer's rows, and document-masked attention (plain and block by block,
both kernels) against each document's own causal attention, forward and backward."""

import pytest
import torch

from hetero.data.digits import IGNORE_INDEX
from hetero.data.packing import PackingError, next_token_document, pack_rows, padded_rows, stack_rows, useful_fraction
from hetero.kernels.attention import causal_attention
from hetero.kernels.block_attention import block_backward, block_forward, merge_blocks
from hetero.kernels.documents import EMPTY, Documents, document_errors, document_positions
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.model import GPT


def texts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 50, (n + 1,), generator=gen) for n in lengths]


def test_packer_fills_rows_in_stream_order_and_pads_the_tail():
    docs = [next_token_document(t) for t in texts([5, 6, 4, 9, 3])]
    rows = list(pack_rows(docs, 12))
    assert [row.sources for row in rows] == [[0, 1], [2], [3, 4]]
    batch = stack_rows(rows)
    assert batch["documents"][0].tolist() == [0] * 5 + [1] * 6 + [2]
    assert batch["documents"][1].tolist() == [0] * 4 + [1] * 8
    assert batch["labels"][1, 4:].eq(IGNORE_INDEX).all() and batch["tokens"][1, 4:].eq(0).all()
    assert torch.equal(batch["tokens"][0, 5:11], docs[1]["tokens"]) and torch.equal(batch["labels"][2, 9:], docs[4]["labels"])
    assert useful_fraction(batch) == pytest.approx(27 / 36)
    assert useful_fraction(stack_rows(list(padded_rows(docs, 12)))) == pytest.approx(27 / 60)


def test_a_document_longer_than_a_row_is_refused_or_split_as_documented():
    docs = [next_token_document(t) for t in texts([4, 30])]
    with pytest.raises(PackingError, match=r"document 1 holds 30 positions, more than a row's llm\.model\.seq_len=12; "
                                           r"raise llm\.model\.seq_len.*overflow='split'"):
        list(pack_rows(docs, 12, field_name="llm.model.seq_len"))
    rows = list(pack_rows(docs, 12, overflow="split"))
    assert [row.used for row in rows] == [4, 12, 12, 6] and [row.sources for row in rows] == [[0], [1], [1], [1]]
    assert torch.equal(torch.cat([r.parts[0]["tokens"] for r in rows[1:]]), docs[1]["tokens"])


def test_positions_restart_per_document_and_ids_must_rise():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    assert document_errors(ids) == []
    assert "row 1 falls from 2 to 1 at position 3" in document_errors(torch.tensor([[0, 0, 0, 0], [0, 1, 2, 1]]))[0]


def per_document(q, k, v, ids):
    """Each row's documents through plain causal attention on their own, stitched back."""
    out = torch.zeros_like(q)
    for row in range(q.shape[0]):
        for doc in ids[row].unique():
            at = torch.nonzero(ids[row] == doc).flatten()
            span = slice(int(at[0]), int(at[-1]) + 1)
            out[row : row + 1, :, span] = causal_attention(q[row : row + 1, :, span], k[row : row + 1, :, span],
                                                           v[row : row + 1, :, span])
    return out


IDS = torch.tensor([[0] * 5 + [1] * 9 + [2] * 2, [0] * 8 + [1] * 8, [0, 1, 1, 1] + [2] * 12])  # (3, 16)


def qkv(seed=0, heads=4, kv_heads=2):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h, 16, 8, generator=gen, dtype=torch.float64).requires_grad_() for h in (heads, kv_heads, kv_heads)]


def grads_of(fn, tensors, upstream):
    out = fn(*tensors)
    return out.detach(), torch.autograd.grad(out, tensors, upstream)


def test_masked_attention_equals_each_document_on_its_own():
    q, k, v = qkv()
    upstream = torch.randn(3, 4, 16, 8, dtype=torch.float64)
    want, want_grads = grads_of(lambda q, k, v: per_document(q, k, v, IDS), (q, k, v), upstream)
    got, got_grads = grads_of(lambda q, k, v: causal_attention(q, k, v, Documents(IDS, q.device)), (q, k, v), upstream)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernel", ["flash", "math"])
@pytest.mark.parametrize("chunk", [2, 4, 8])
def test_block_by_block_attention_with_documents_equals_each_document_on_its_own(kernel, chunk):
    """Queries chunk by chunk against every key chunk at or before them, blocks classified by the document
    ids (skipped, plain, masked), merged, and each block's backward from the merged output: the ring's
    and the all-gather's arithmetic, in one process. fp32 (the CPU flash kernel's dtype here)."""
    q, k, v = (t.detach().float().requires_grad_() for t in qkv(1))
    documents = Documents(IDS, q.device)
    upstream = torch.randn(3, 4, 16, 8)
    want, want_grads = grads_of(lambda q, k, v: per_document(q, k, v, IDS), (q, k, v), upstream)
    kinds = set()
    with torch.no_grad():
        outs, merged = [], []
        for i in range(16 // chunk):
            queries, parts = slice(i * chunk, (i + 1) * chunk), []
            for j in range(i + 1):
                keys = slice(j * chunk, (j + 1) * chunk)
                mask = documents.block(queries, keys, i == j, q.dtype)
                kinds.add("empty" if mask is EMPTY else "plain" if mask is None else "masked")
                if mask is not EMPTY:
                    parts.append(block_forward(q[:, :, queries], k[:, :, keys], v[:, :, keys], i == j, kernel, mask))
            merged.append(merge_blocks(parts))
            outs.append(merged[-1][0])
        out = torch.cat(outs, 2)
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for i in range(16 // chunk):
            queries = slice(i * chunk, (i + 1) * chunk)
            for j in range(i + 1):
                keys = slice(j * chunk, (j + 1) * chunk)
                mask = documents.block(queries, keys, i == j, q.dtype)
                if mask is EMPTY:
                    continue
                gq, gk, gv = block_backward(upstream[:, :, queries], q[:, :, queries], k[:, :, keys], v[:, :, keys],
                                            *merged[i], i == j, kernel, mask)
                grads[0][:, :, queries] += gq
                grads[1][:, :, keys] += gk
                grads[2][:, :, keys] += gv
    if chunk < 8:
        assert kinds == {"empty", "plain", "masked"}
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_packed_gpt_row_equals_its_documents_run_alone():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          ffn_hidden_size=64, seq_len=16)).double()
    tokens = torch.randint(0, 64, (3, 16))
    documents = Documents(IDS, tokens.device)
    packed = model(tokens, documents.positions(), documents=documents)
    for row in range(3):
        for doc in IDS[row].unique():
            at = torch.nonzero(IDS[row] == doc).flatten()
            alone = model(tokens[row : row + 1, at])
            torch.testing.assert_close(packed[row : row + 1, at], alone, rtol=1e-10, atol=1e-12)
