"""The offline corpus: real text, deterministic sampling keyed by position."""

from __future__ import annotations

import torch

from ds_swift.data.corpus import ByteTokenizer, load_corpus


def test_corpus_is_text_and_sampling_is_keyed_by_position(tmp_path) -> None:
    c = load_corpus(max_bytes=300_000, cache_dir=tmp_path)
    assert len(c) > 100_000
    text = ByteTokenizer().decode(c.tokens[:2000])
    assert " the " in text  # English prose, not noise
    a_in, a_lab = c.batch(seed=1, iteration=7, micro_batch=3, batch_size=4, seq_len=32)
    b_in, _ = c.batch(seed=1, iteration=7, micro_batch=3, batch_size=4, seq_len=32)
    other, _ = c.batch(seed=1, iteration=7, micro_batch=2, batch_size=4, seq_len=32)
    assert a_in.shape == (4, 32) and a_in.dtype == torch.int64
    assert torch.equal(a_in, b_in)
    assert not torch.equal(a_in, other)
    assert torch.equal(a_in[:, 1:], a_lab[:, :-1])  # labels are the next tokens
    # the cache gives the same corpus back
    assert load_corpus(max_bytes=300_000, cache_dir=tmp_path).digest == c.digest
