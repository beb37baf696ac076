"""filters.length (FilterConfig, apply_filters, filter_prompt) on small hand-built records: which record is kept,
which is dropped and with which reason, what truncation leaves, and what dedup adds to ``seen``. No model. Fast."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import pytest
from helpers import make_prompt, make_record

import filters.length
from common.errors import CaptureError
from common.hashing import token_sha256
from filters import FilterConfig, apply_filters, filter_prompt

# The reasons in the order apply_filters checks them (the module docstring's table, top to bottom).
ORDER = ["over_context", "over_max_tokens", "under_min_tokens", "under_min_loss_tokens", "no_loss_tokens", "duplicate"]


def sha(ids) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


# --------------------------------------------------------------------------------------------------
# apply_filters


def test_no_filter_keeps_the_record_as_is():
    rec = make_record([5, 6, 7], [False, True, True])
    seen: set[str] = set()
    got, reason = apply_filters(rec, FilterConfig(), seen, context_len=None)
    assert reason is None and got is rec
    assert seen == set()  # no dedup: nothing recorded


def test_dedup_drops_the_second_identical_record_and_keeps_different_ones():
    cfg = FilterConfig(dedup=True)
    first = make_record([1, 2, 3], [False, True, True], sample_id="d:0")
    same = make_record([1, 2, 3], [True, True, True], sample_id="d:1")  # same tokens, another mask and id
    other = make_record([1, 2, 4], [False, True, True], sample_id="d:2")
    assert first.token_sha256 == sha([1, 2, 3]) == token_sha256(np.array([1, 2, 3], dtype=np.int32))
    seen: set[str] = set()

    assert apply_filters(first, cfg, seen) == (first, None)
    assert seen == {sha([1, 2, 3])}
    assert apply_filters(same, cfg, seen) == (None, "duplicate")
    assert seen == {sha([1, 2, 3])}
    assert apply_filters(other, cfg, seen) == (other, None)
    assert seen == {sha([1, 2, 3]), sha([1, 2, 4])}


def test_dedup_against_hashes_already_committed():
    rec = make_record([9, 9, 9])
    seen = {sha([9, 9, 9])}  # e.g. from the manifest of the run being resumed
    assert apply_filters(rec, FilterConfig(dedup=True), seen) == (None, "duplicate")
    assert seen == {sha([9, 9, 9])}


def test_without_dedup_both_identical_records_are_kept():
    cfg = FilterConfig()
    a = make_record([1, 2, 3], sample_id="d:0")
    b = make_record([1, 2, 3], sample_id="d:1")
    seen: set[str] = set()
    assert apply_filters(a, cfg, seen) == (a, None)
    assert apply_filters(b, cfg, seen) == (b, None)
    assert seen == set()


def test_min_loss_tokens_bound():
    cfg = FilterConfig(min_loss_tokens=3)
    under = make_record([1, 2, 3, 4, 5], [False, False, False, True, True])
    at = make_record([1, 2, 3, 4, 5], [False, False, True, True, True])
    assert (under.num_loss_tokens, at.num_loss_tokens) == (2, 3)
    assert apply_filters(under, cfg, set()) == (None, "under_min_loss_tokens")
    assert apply_filters(at, cfg, set()) == (at, None)


def test_min_tokens_bound():
    cfg = FilterConfig(min_tokens=4)
    assert apply_filters(make_record([1, 2, 3]), cfg, set()) == (None, "under_min_tokens")
    at = make_record([1, 2, 3, 4])
    assert apply_filters(at, cfg, set()) == (at, None)
    assert apply_filters(make_record([1, 2, 3]), FilterConfig(min_tokens=0), set())[1] is None


def test_max_tokens_drop():
    cfg = FilterConfig(max_tokens=5, overlength="drop")
    assert apply_filters(make_record([1, 2, 3, 4, 5, 6]), cfg, set()) == (None, "over_max_tokens")
    at = make_record([1, 2, 3, 4, 5])
    got, reason = apply_filters(at, cfg, set())
    assert reason is None and got is at


def test_max_tokens_truncate_keeps_exactly_the_prefix():
    ids = [11, 12, 13, 14, 15, 16, 17, 18]
    mask = [False, False, True, True, False, True, True, True]
    rec = make_record(ids, mask, sample_id="d:7", row_index=7, source="src")
    full_hash = rec.token_sha256  # cached on the long record
    got, reason = apply_filters(rec, FilterConfig(max_tokens=5, overlength="truncate"), set())
    assert reason is None
    assert got.num_tokens == 5 and got.num_loss_tokens == 2
    assert got.input_ids.dtype == np.int32 and got.loss_mask.dtype == np.bool_
    assert got.input_ids.tolist() == [11, 12, 13, 14, 15]
    assert got.loss_mask.tolist() == [False, False, True, True, False]
    assert (got.sample_id, got.row_index, got.source, got.finish_reasons) == ("d:7", 7, "src", None)
    assert got.token_sha256 == sha([11, 12, 13, 14, 15]) != full_hash  # the hash of what is kept
    assert rec.num_tokens == 8  # the input record is left alone
    # at the bound: nothing cut
    at = make_record(ids[:5], mask[:5])
    assert apply_filters(at, FilterConfig(max_tokens=5, overlength="truncate"), set()) == (at, None)


def test_context_len_drop_and_truncate():
    rec = make_record(list(range(1, 11)))  # 10 tokens
    assert apply_filters(rec, FilterConfig(), set(), context_len=9) == (None, "over_context")
    assert apply_filters(rec, FilterConfig(), set(), context_len=10) == (rec, None)
    got, reason = apply_filters(rec, FilterConfig(overlength="truncate"), set(), context_len=7)
    assert reason is None and got.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7] and got.loss_mask.tolist() == [True] * 7
    # both limits with truncate: the shorter one wins
    got, _ = apply_filters(rec, FilterConfig(max_tokens=4, overlength="truncate"), set(), context_len=7)
    assert got.input_ids.tolist() == [1, 2, 3, 4]
    got, _ = apply_filters(rec, FilterConfig(max_tokens=8, overlength="truncate"), set(), context_len=6)
    assert got.input_ids.tolist() == [1, 2, 3, 4, 5, 6]


def test_truncated_before_the_first_answer_has_no_loss_tokens():
    rec = make_record([1, 2, 3, 4, 5, 6], [False, False, False, True, True, True])
    cfg = FilterConfig(max_tokens=3, overlength="truncate")
    assert apply_filters(rec, cfg, set()) == (None, "no_loss_tokens")
    assert apply_filters(rec, FilterConfig(overlength="truncate"), set(), context_len=3) == (None, "no_loss_tokens")
    got, reason = apply_filters(rec, FilterConfig(max_tokens=4, overlength="truncate"), set())
    assert reason is None and got.loss_mask.tolist() == [False, False, False, True]


def test_no_loss_tokens_without_any_filter():
    rec = make_record([1, 2, 3], [False, False, False])
    assert apply_filters(rec, FilterConfig(), set()) == (None, "no_loss_tokens")


def test_reason_order_is_the_documented_one():
    _, header, body, _ = re.split(r"^=+ +=+$", filters.length.__doc__, flags=re.M)  # the reason table
    assert header.split() == ["reason", "meaning"]
    assert [line.split()[0] for line in body.strip().splitlines()] == ORDER


@pytest.mark.parametrize("ids, mask, cfg, context_len, seen, expected", [
    # over_context before over_max_tokens (10 tokens, both limits exceeded)
    (list(range(10)), None, FilterConfig(max_tokens=5), 8, set(), "over_context"),
    # over_max_tokens before under_min_tokens (drop policy)
    (list(range(10)), None, FilterConfig(max_tokens=5, min_tokens=20), None, set(), "over_max_tokens"),
    # under_min_tokens is checked after truncation
    (list(range(10)), None, FilterConfig(max_tokens=5, min_tokens=6, overlength="truncate"), None, set(),
     "under_min_tokens"),
    # under_min_tokens before under_min_loss_tokens
    ([1, 2, 3], [False, False, True], FilterConfig(min_tokens=4, min_loss_tokens=2), None, set(), "under_min_tokens"),
    # under_min_loss_tokens before no_loss_tokens
    ([1, 2, 3], [False, False, False], FilterConfig(min_loss_tokens=1), None, set(), "under_min_loss_tokens"),
    # no_loss_tokens before duplicate
    ([1, 2, 3], [False, False, False], FilterConfig(dedup=True), None, {sha([1, 2, 3])}, "no_loss_tokens"),
    # every rule at once: the first one
    (list(range(10)), [False] * 10, FilterConfig(min_tokens=20, max_tokens=5, min_loss_tokens=3, dedup=True), 8,
     {sha(list(range(10)))}, "over_context"),
])
def test_one_record_violating_several_rules_gets_the_first_reason(ids, mask, cfg, context_len, seen, expected):
    before = set(seen)
    assert apply_filters(make_record(ids, mask), cfg, seen, context_len) == (None, expected)
    assert seen == before  # a dropped record adds no hash


def test_a_record_dropped_for_another_reason_adds_no_hash():
    seen: set[str] = set()
    cfg = FilterConfig(dedup=True, min_tokens=5)
    assert apply_filters(make_record([1, 2, 3]), cfg, seen) == (None, "under_min_tokens")
    assert seen == set()
    kept = make_record([1, 2, 3, 4, 5])
    assert apply_filters(kept, cfg, seen) == (kept, None) and seen == {sha([1, 2, 3, 4, 5])}


# --------------------------------------------------------------------------------------------------
# FilterConfig


def test_filter_config_defaults_and_valid_values():
    cfg = FilterConfig()
    assert (cfg.min_tokens, cfg.max_tokens, cfg.min_loss_tokens, cfg.overlength, cfg.dedup) == (
        None, None, None, "drop", False)
    cfg = FilterConfig(min_tokens=0, max_tokens=0, min_loss_tokens=0, overlength="truncate", dedup=True)
    assert (cfg.min_tokens, cfg.max_tokens, cfg.min_loss_tokens) == (0, 0, 0)


@pytest.mark.parametrize("kwargs, message", [
    ({"min_tokens": -1}, "min-tokens: -1 is not an integer >= 0"),
    ({"max_tokens": -5}, "max-tokens: -5 is not an integer >= 0"),
    ({"min_loss_tokens": -1}, "min-loss-tokens: -1 is not an integer >= 0"),
    ({"max_tokens": True}, "max-tokens: True is not an integer >= 0"),
    ({"min_tokens": False}, "min-tokens: False is not an integer >= 0"),
    ({"min_loss_tokens": 1.5}, "min-loss-tokens: 1.5 is not an integer >= 0"),
    ({"min_tokens": "10"}, "min-tokens: '10' is not an integer >= 0"),
    ({"overlength": "cut"}, "overlength: 'cut' is not one of drop, truncate"),
    ({"overlength": None}, "overlength: None is not one of drop, truncate"),
    ({"dedup": 1}, "dedup: 1 is not true or false"),
])
def test_filter_config_refuses_bad_values(kwargs, message):
    with pytest.raises(CaptureError) as e:
        FilterConfig(**kwargs)
    assert str(e.value) == message


# --------------------------------------------------------------------------------------------------
# filter_prompt (regenerate mode, before generation)


def test_filter_prompt_over_context_counts_max_new_tokens_per_turn():
    two_turns = make_prompt([1, 2, 3, 4, 5, 6], [7, 8, 9, 10])  # 10 fixed tokens, 2 turns
    one_turn = make_prompt([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # 10 fixed tokens, 1 turn
    assert (two_turns.num_tokens, two_turns.turns, one_turn.num_tokens, one_turn.turns) == (10, 2, 10, 1)
    cfg = FilterConfig()
    assert filter_prompt(two_turns, cfg, set(), 20, 5) is None  # 10 + 2 * 5 = 20 fits exactly
    assert filter_prompt(two_turns, cfg, set(), 19, 5) == "over_context"
    assert filter_prompt(one_turn, cfg, set(), 19, 5) is None  # 10 + 5 = 15
    assert filter_prompt(one_turn, cfg, set(), 14, 5) == "over_context"
    assert filter_prompt(two_turns, cfg, set(), None, 10_000) is None  # no context limit known
    # always dropped, whatever the overlength policy: the engine cannot generate past the context
    assert filter_prompt(two_turns, FilterConfig(overlength="truncate"), set(), 19, 5) == "over_context"


def test_filter_prompt_over_max_tokens_only_with_drop():
    p = make_prompt([1, 2, 3, 4, 5, 6], [7, 8, 9, 10])  # 10 fixed tokens
    assert filter_prompt(p, FilterConfig(max_tokens=9), set(), None, 16) == "over_max_tokens"
    assert filter_prompt(p, FilterConfig(max_tokens=10), set(), None, 16) is None  # the answers are checked later
    assert filter_prompt(p, FilterConfig(max_tokens=9, overlength="truncate"), set(), None, 16) is None
    # over_context first
    assert filter_prompt(p, FilterConfig(max_tokens=9), set(), 20, 16) == "over_context"


def test_filter_prompt_ignores_the_filters_that_need_answers():
    p = make_prompt([1, 2, 3])
    assert filter_prompt(p, FilterConfig(min_tokens=100, min_loss_tokens=50), set(), None, 8) is None


def test_filter_prompt_duplicates():
    a = make_prompt([1, 2, 3], [4, 5], sample_id="p:0")
    same = make_prompt([1, 2, 3], [4, 5], sample_id="p:1")
    other = make_prompt([1, 2, 3], [4, 6], sample_id="p:2")
    assert a.token_sha256 == sha([1, 2, 3, 4, 5])  # the concatenated segments
    cfg = FilterConfig(dedup=True)
    seen: set[str] = set()
    assert filter_prompt(a, cfg, seen, None, 8) is None
    assert seen == {sha([1, 2, 3, 4, 5])}
    assert filter_prompt(same, cfg, seen, None, 8) == "duplicate"
    assert filter_prompt(other, cfg, seen, None, 8) is None
    assert seen == {sha([1, 2, 3, 4, 5]), sha([1, 2, 3, 4, 6])}
    # without dedup: both kept, nothing recorded
    plain: set[str] = set()
    assert filter_prompt(a, FilterConfig(), plain, None, 8) is None
    assert filter_prompt(same, FilterConfig(), plain, None, 8) is None
    assert plain == set()
    # a prompt dropped for its length adds no hash; over_context comes before duplicate
    seen2 = {sha([1, 2, 3, 4, 5])}
    assert filter_prompt(same, cfg, seen2, 6, 8) == "over_context"
    long = make_prompt([7, 7, 7, 7])
    assert filter_prompt(long, cfg, seen2, 6, 8) == "over_context" and seen2 == {sha([1, 2, 3, 4, 5])}
