"""The FlexAttention rows of the serving benchmarks compute the function they are timed beside: the
document mask over packed tokens equals attnx's varlen call, the dense decode row attnx's dense call.
(On the CPU with FlexAttention uncompiled: the masks and layouts are what is checked here.)"""
import pytest
import torch

import attnx
from benchmarks import flex_rows

pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.fixture
def eager_flex(monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex_rows, "_compiled", lambda: flex_attention)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [False, True])
def test_document_mask_matches_varlen(eager_flex, causal):
    gen = torch.Generator().manual_seed(3)
    lens = [5, 17, 1, 42]
    total, hq, hkv, d = sum(lens), 4, 2, 16
    q = torch.randn(total, hq, d, generator=gen)
    k, v = (torch.randn(total, hkv, d, generator=gen) for _ in range(2))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    want = attnx.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                           max_seqlen_k=max(lens), causal=causal)
    got = flex_rows.packed_out(flex_rows.flex_document(q, k, v, lens, causal)())
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_decode_row_matches_dense_call(eager_flex):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 8, 1, 16, generator=gen)
    k, v = (torch.randn(3, 2, 50, 16, generator=gen) for _ in range(2))
    torch.testing.assert_close(flex_rows.flex_decode(q, k, v)(), attnx.attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_a_failing_row_is_reported_not_raised(capsys):
    def broken():
        raise RuntimeError("no kernel")
    assert flex_rows._first_call(broken, "flex decode") is None
    assert "flex decode: RuntimeError: no kernel" in capsys.readouterr().out
