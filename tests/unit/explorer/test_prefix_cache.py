"""The hf engine's prefix cache (services/explorer/serving/engines/prefix_cache.py), worked by hand on
small tensors whose values name their positions, so a slice taken from the wrong place shows."""

from __future__ import annotations

import pytest
import torch

from services.explorer.serving.engines.prefix_cache import PrefixCache, common_prefix_len

LAYERS = 2


def kv(tokens: list[int], layer_offset: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (1, 1 head, len, 2): keys hold the token id, values its negation (plus the layer)."""
    t = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 1, -1, 2)
    return [(t + layer + layer_offset, -t - layer - layer_offset) for layer in range(LAYERS)]


def nbytes(n: int) -> int:
    return LAYERS * 2 * n * 2 * 4  # layers x (k, v) x tokens x head_dim x float32


def test_common_prefix_len():
    import numpy as np

    a = np.array([1, 2, 3, 4])
    assert common_prefix_len(a, np.array([1, 2, 3, 4, 5])) == 4
    assert common_prefix_len(a, np.array([1, 2, 9, 4])) == 2
    assert common_prefix_len(a, np.array([7])) == 0
    assert common_prefix_len(a, np.array([], dtype=np.int64)) == 0


def test_the_longest_shared_run_over_entries_is_returned_sliced_to_it():
    c = PrefixCache(max_bytes=1 << 20, min_tokens=3)
    c.store(None, [1, 2, 3, 4, 5, 6], kv([1, 2, 3, 4, 5, 6]))
    c.store(None, [1, 2, 3, 9, 9], kv([1, 2, 3, 9, 9]))
    m, layers = c.lookup(None, [1, 2, 3, 4, 5, 7, 8])  # shares 5 with the first entry, 3 with the second
    assert m == 5 and len(layers) == LAYERS
    for layer, (k, v) in enumerate(layers):
        assert k.shape == (1, 1, 5, 2) and k[0, 0, :, 0].tolist() == [t + layer for t in (1, 2, 3, 4, 5)]
        assert torch.equal(v, -k)
    assert (c.hits, c.tokens_reused) == (1, 5)
    assert c.lookup(None, [1, 2, 8]) == (0, None)  # a run of 2 < min_tokens
    assert c.lookup(None, [5, 1, 2, 3]) == (0, None)  # a shared run must start at the first token
    assert (c.hits, c.tokens_reused) == (1, 5)


def test_entries_are_per_adapter_and_dropped_with_it():
    c = PrefixCache(max_bytes=1 << 20, min_tokens=2)
    c.store("a-v1", [1, 2, 3], kv([1, 2, 3], layer_offset=100))
    assert c.lookup(None, [1, 2, 3, 4]) == (0, None)  # keys and values depend on the adapter
    assert c.lookup("a-v2", [1, 2, 3, 4]) == (0, None)
    m, layers = c.lookup("a-v1", [1, 2, 3, 4])
    assert m == 3 and layers[0][0][0, 0, 0, 0].item() == 101
    c.drop_adapter("a-v1")
    assert len(c) == 0 and c.bytes == 0 and c.lookup("a-v1", [1, 2, 3, 4]) == (0, None)


def test_an_extending_entry_replaces_the_one_it_extends_and_a_held_one_is_not_stored_again():
    c = PrefixCache(max_bytes=1 << 20, min_tokens=2)
    c.store(None, [1, 2, 3], kv([1, 2, 3]))
    c.store(None, [1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))  # the conversation went on
    assert len(c) == 1 and c.bytes == nbytes(5)
    assert c.holds(None, [1, 2, 3, 4]) and c.holds(None, [1, 2, 3, 4, 5]) and not c.holds(None, [1, 2, 3, 4, 5, 6])
    assert not c.holds("other", [1, 2, 3]) and c.peek(None, [1, 2, 3, 9]) == 3 and c.hits == 0  # peeking takes nothing
    c.store(None, [1, 2, 3, 4], kv([1, 2, 3, 4]))  # already held within the longer one
    assert len(c) == 1 and c.bytes == nbytes(5)
    c.store(None, [1, 2, 7], kv([1, 2, 7]))  # a branch: both kept
    assert len(c) == 2 and c.bytes == nbytes(8)
    assert c.lookup(None, [1, 2, 3, 4, 5, 6])[0] == 5 and c.lookup(None, [1, 2, 7, 7])[0] == 3


def test_the_budget_drops_the_least_recently_used_first():
    c = PrefixCache(max_bytes=nbytes(10), min_tokens=2)
    c.store(None, [1, 1, 1, 1], kv([1, 1, 1, 1]))
    c.store(None, [2, 2, 2, 2], kv([2, 2, 2, 2]))
    assert c.lookup(None, [1, 1, 1, 1, 0])[0] == 4  # the first entry is now the most recently used
    c.store(None, [3, 3, 3, 3], kv([3, 3, 3, 3]))  # 12 tokens > 10: the least recently used (2s) goes
    assert c.lookup(None, [2, 2, 2, 0]) == (0, None)
    assert c.lookup(None, [1, 1, 1, 0])[0] == 3 and c.lookup(None, [3, 3, 3, 0])[0] == 3
    assert c.bytes == nbytes(8) <= c.max_bytes
    c.store(None, list(range(20, 31)), kv(list(range(20, 31))))  # larger than the whole budget: not kept
    assert len(c) == 2 and c.bytes == nbytes(8)
    c.store(None, [1] * 11, kv([1] * 11))  # extends the 1s but cannot be held: the 1s stay
    assert len(c) == 2 and c.lookup(None, [1, 1, 1, 1, 0])[0] == 4


def test_a_stored_entry_owns_its_tensors_and_a_mismatch_is_refused():
    c = PrefixCache(max_bytes=1 << 20, min_tokens=2)
    layers = [(k.contiguous(), v.contiguous()) for k, v in kv([1, 2, 3])]
    c.store(None, [1, 2, 3], layers)
    layers[0][0].zero_()
    assert c.lookup(None, [1, 2, 3, 4])[1][0][0][0, 0, 0, 0].item() == 1  # unchanged by the caller's buffers
    with pytest.raises(ValueError, match="cover 3 positions, not the 4 tokens"):
        c.store(None, [1, 2, 3, 4], kv([1, 2, 3]))
    off = PrefixCache(max_bytes=0)
    off.store(None, [1, 2, 3], kv([1, 2, 3]))
    assert not off.enabled and len(off) == 0 and off.lookup(None, [1, 2, 3, 4]) == (0, None)
