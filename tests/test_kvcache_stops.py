"""KV compaction (medusa_runtime.engines.kvcache) and stop handling (medusa_runtime.stops): pure functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from medusa_runtime.engines.kvcache import compaction_slots, fits, write_accepted
from medusa_runtime.errors import ContextOverflowError
from medusa_runtime.stops import apply_stops, find_stop_string


def _step_kv(nodes: int) -> np.ndarray:
    """[1, T, 2, 3] K or V whose every entry is its node index + 1 (so a copied slot is recognisable)."""
    return np.broadcast_to((np.arange(nodes) + 1.0)[None, :, None, None], (1, nodes, 2, 3)).copy()


@pytest.mark.parametrize("array", [np.asarray, torch.as_tensor], ids=["numpy", "torch"])
def test_write_accepted_compacts_into_next_slots(array):
    cache = array(np.full((1, 8, 2, 3), -1.0))
    new_len = write_accepted(cache, array(_step_kv(7)), 2, np.array([0, 2, 5]))
    assert new_len == 5
    got = np.asarray(cache)[0, :, 0, 0]
    np.testing.assert_array_equal(got, [-1, -1, 1, 3, 6, -1, -1, -1])  # slots 2..4 = nodes 0, 2, 5
    assert (np.asarray(cache)[0, 2:5] == np.asarray(cache)[0, 2:5, :1, :1]).all()  # whole [H_kv, D] copied


def test_write_accepted_fills_the_buffer_exactly():
    cache = np.zeros((1, 6, 2, 3))
    assert write_accepted(cache, _step_kv(4), 3, np.array([0, 1, 3])) == 6
    np.testing.assert_array_equal(cache[0, 3:, 0, 0], [1, 2, 4])


def test_write_accepted_refuses_overflow_and_leaves_cache_untouched():
    cache = np.zeros((1, 6, 2, 3))
    with pytest.raises(ContextOverflowError, match="3 accepted tokens do not fit: 4 of 6 cache slots"):
        write_accepted(cache, _step_kv(4), 4, np.array([0, 1, 2]))
    assert not cache.any()


def test_compaction_slots_and_fits():
    np.testing.assert_array_equal(compaction_slots(5, np.array([0, 7, 9]), 8), [5, 6, 7])
    assert compaction_slots(5, np.array([0, 7, 9]), 8).dtype == np.int64
    assert fits(10, 6, 16) and not fits(11, 6, 16)
    assert fits(0, 1, 1) and not fits(1, 1, 1)


@pytest.mark.parametrize(
    "step, generated, max_new, expected, reason",
    [
        ([1, 2, 3], 0, 10, [1, 2, 3], None),
        ([1, 9, 3], 0, 10, [1], "stop"),  # EOS mid-path: EOS itself not emitted, rest dropped
        ([9, 2], 4, 10, [], "stop"),  # EOS first
        ([1, 2, 8], 0, 10, [1, 2], "stop"),  # every EOS id counts
        ([1, 2, 3], 8, 10, [1, 2], "length"),  # budget reached inside the path
        ([1, 2, 3], 7, 10, [1, 2, 3], "length"),  # budget reached exactly at the path's end
        ([1, 2, 9], 8, 10, [1, 2], "length"),  # budget reached before the EOS would be seen
        ([1, 9], 9, 10, [1], "length"),
        ([4, 5], 0, 0, [], "length"),
        ([], 3, 10, [], None),
    ],
)
def test_apply_stops(step, generated, max_new, expected, reason):
    res = apply_stops(step, generated=generated, max_new_tokens=max_new, eos_token_ids=[9, 8])
    assert res.tokens == expected
    assert res.finish_reason == reason


def test_apply_stops_is_token_by_token():
    """Cutting one long step equals feeding its tokens one at a time."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        step = rng.integers(0, 6, size=rng.integers(1, 6)).tolist()
        generated, max_new = int(rng.integers(0, 5)), int(rng.integers(0, 8))
        one_by_one, reason = [], None
        for tok in step:
            r = apply_stops([tok], generated=generated + len(one_by_one), max_new_tokens=max_new, eos_token_ids=[5])
            one_by_one += r.tokens
            if r.finish_reason:
                reason = r.finish_reason
                break
        res = apply_stops(step, generated=generated, max_new_tokens=max_new, eos_token_ids=[5])
        assert (res.tokens, res.finish_reason) == (one_by_one, reason)


def test_find_stop_string():
    assert find_stop_string("hello world. bye", ["bye", "."]) == 11
    assert find_stop_string("hello world", ["xyz", ""]) == -1
    assert find_stop_string("a.b.c", ["."], start=2) == 3
