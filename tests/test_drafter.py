"""The drafter: acceptance length, anchors and labels, bigram baseline on hand-built cases; what a block
may see (causality, window); held-out sets kept apart from training; training, checkpoints and the CLI
on small real SmolLM2 captures."""

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

import helpers
from conftest import REPO, built_once, capture_cli, capture_inproc, free_port
from drafter import blocks, checkpoint, data, evaluate, metrics
from drafter.config import TrainConfig
from drafter.model import Drafter, ModelConfig
from drafter.train import block_loss, evaluate_checkpoint, prepare, train
from shards.reader import iter_rows
from shards.stream import ShardStream


def test_acceptance_length_stops_at_first_miss_and_at_invalid_positions():
    labels = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    pred = torch.tensor([[5, 6, 7, 8],   # all 4 accepted
                         [5, 6, 0, 8],   # miss at 2: the hit at 3 does not count
                         [0, 6, 7, 8],   # first miss: 0
                         [5, 6, 7, 8],   # block valid for 2 positions only (end of the assistant turn)
                         [5, 0, 7, 8]])
    valid = torch.ones(5, 4, dtype=torch.bool)
    valid[3, 2:] = False
    assert metrics.acceptance_length(pred, labels, valid).tolist() == [4, 2, 0, 2, 1]
    score = metrics.Score()
    score.add(pred, labels, valid)
    s = score.as_dict()
    assert s["blocks"] == 5
    assert s["accept_len"] == 9 / 5 and s["accept_len_with_bonus"] == 9 / 5 + 1
    assert s["first_token_acc"] == 4 / 5
    assert s["position_acc"] == [4 / 5, 4 / 5, 3 / 4, 4 / 4]  # among valid positions, not conditioned
    assert "by_lookup_match" not in s
    split = metrics.Score()
    split.add(pred, labels, valid, matched=torch.tensor([True, False, False, True, True]))
    assert split.as_dict()["by_lookup_match"] == {"share": 3 / 5, "accept_len_matched": 7 / 3,
                                                 "accept_len_unmatched": 2 / 2}


def test_heldout_is_the_sha256_rule():
    for sid in ("sharegpt:0", "sharegpt:17", "x"):
        value = int.from_bytes(hashlib.sha256(sid.encode()).digest()[:8], "big") / 2**64
        assert data.heldout(sid, 0.1) == (value < 0.1)
        assert not data.heldout(sid, 0.0) and data.heldout(sid, 1.0)
    share = sum(data.heldout(f"sharegpt:{i}", 0.1) for i in range(10000)) / 10000
    assert 0.09 < share < 0.11


def _seq(sid, ids, mask, F=6):
    ids = torch.tensor(ids)
    return {"sample_id": sid, "source": "s", "input_ids": ids, "loss_mask": torch.tensor(mask, dtype=torch.bool),
            "argmax": ids + 100, "feats": torch.arange(len(ids) * F, dtype=torch.float32).view(-1, F).bfloat16(),
            "prompt_key": data.prompt_key(ids, torch.tensor(mask, dtype=torch.bool))}


def test_anchors_and_block_labels_follow_dflash():
    s = _seq("a", [10, 11, 12, 13, 14, 15], [0, 1, 1, 1, 0, 1])
    # a needs x_a and x_{a+1} supervised: 3 is followed by an unsupervised token, 5 is the last
    anchors = blocks.valid_anchors(s["loss_mask"])
    assert anchors.tolist() == [1, 2]
    labels, valid = blocks.block_targets(s, anchors, 4)  # slots 1, 2, 3
    assert valid.tolist() == [[True, True, False], [True, False, False]]
    # slot j of anchor a: argmax[a+j-1], the target's greedy choice for x_{a+j}
    assert labels.tolist() == [[111, 112, 0], [112, 0, 0]]
    ds, _ = blocks.block_targets(s, anchors, 4, labels="dataset")
    assert ds.tolist() == [[12, 13, 0], [13, 0, 0]]
    with pytest.raises(ValueError):
        blocks.block_targets(s, anchors, 4, labels="greedy")

    t = _seq("b", [20, 21, 22, 23], [0, 1, 1, 1])
    b = blocks.make_batch([s, t], [anchors, torch.tensor([1])], 4)
    assert b.anchors.tolist() == [[1, 2], [1, -1]]
    assert b.feats.shape == (2, 3, 6)  # cut after the last anchor (position 2)
    assert torch.equal(b.feats[0], s["feats"][:3]) and torch.equal(b.feats[1], t["feats"][:3])
    assert b.ids.tolist() == [[10, 11, 12], [20, 21, 22]]
    short = blocks.make_batch([t, s], [torch.tensor([1]), torch.tensor([4])], 4)  # t padded to 5 positions
    assert short.ids.tolist() == [[20, 21, 22, 23, 0], [10, 11, 12, 13, 14]] and not short.feats[0, 4].any()
    assert b.labels[1, 0].tolist() == [121, 122, 0] and not b.valid[1, 1].any()


def test_train_rows_and_train_anchors_keep_the_shortest_prefix():
    # conversations with 3, 1, 4 and 2 valid anchors (anchor a: loss_mask[a] and loss_mask[a+1])
    masks = [[0, 1, 1, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1, 1, 0], [0, 1, 1, 1]]
    rows = [(f"s{i}", np.arange(len(m)), np.array(m), np.arange(len(m)) + 1) for i, m in enumerate(masks)]
    each = lambda **kw: data.scan_rows(rows, 4, 16, **kw).anchors_each.tolist()  # noqa: E731
    assert each() == [3, 1, 4, 2]
    assert each(anchor_limit=4) == [3, 1] and each(anchor_limit=5) == [3, 1, 4]  # until they hold N
    assert each(anchor_limit=4, limit=1) == [3] and each(limit=3) == [3, 1, 4]  # whichever ends first
    skip = data.scan_rows(rows, 4, 16, anchor_limit=4, exclude={"sample_ids": np.array([data.id_hash("s0")],
                          dtype=np.uint64), "prompt_keys": np.zeros(0, dtype=np.uint64)})
    assert skip.anchors_each.tolist() == [1, 4] and skip.removed == 1  # a held-out row does not count


def test_heldout_anchors_subsample_evenly_and_split():
    assert [r.tolist() for r in evaluate.select_anchors([8, 4])] == [list(range(8)), list(range(4))]
    # global anchors 0, 3, 6, 9 of 12 (8 in the first conversation, 4 in the second)
    assert [r.tolist() for r in evaluate.select_anchors([8, 4], limit=4)] == [[0, 3, 6], [1]]
    assert [r.tolist() for r in evaluate.select_anchors([8, 0, 4], limit=4)] == [[0, 3, 6], [], [1]]
    anchors = blocks.valid_anchors(torch.tensor([0] + [1] * 9, dtype=torch.bool))  # 1 … 8
    assert [r.tolist() for r in blocks.rows_of(anchors, 3)] == [[1, 2, 3], [4, 5, 6], [7, 8]]


def test_anchors_are_drawn_per_conversation_and_epoch():
    mask = torch.tensor([0] * 3 + [1] * 40, dtype=torch.bool)
    a = data.pick_anchors(mask, 8, 0, 0, "x:1")
    assert len(a) == 8 and a.tolist() == sorted(set(a.tolist())) and all(3 <= i < 42 for i in a.tolist())
    assert torch.equal(a, data.pick_anchors(mask, 8, 0, 0, "x:1"))  # any process, any rank, a resume
    assert not torch.equal(a, data.pick_anchors(mask, 8, 0, 1, "x:1"))  # another epoch
    assert not torch.equal(a, data.pick_anchors(mask, 8, 0, 0, "x:2"))  # another conversation
    assert not torch.equal(a, data.pick_anchors(mask, 8, 1, 0, "x:1"))  # another seed
    assert data.pick_anchors(mask, 64, 0, 0, "x:1").tolist() == list(range(3, 42))  # fewer than k: all


def _tiny_model(window=2048, B=4, lookup=0):
    torch.manual_seed(0)
    V, H = 50, 6
    cfg = ModelConfig(num_taps=1, hidden_size=H, vocab_size=V, d_model=16, n_layers=2, n_heads=2, block_size=B,
                      window=window, lookup=lookup)
    return Drafter(cfg, torch.randn(V, H), torch.randn(V, H)).eval()


def test_a_block_sees_only_the_window_before_its_anchor_and_its_own_token():
    T = 12
    ids = torch.randint(0, 50, (1, T))
    feats = torch.randn(1, T, 6).bfloat16()
    a = 7

    def out(model, feats, ids):
        batch = blocks.Batch(feats, ids, torch.tensor([[a]]), torch.zeros(1, 1, 3, dtype=torch.long),
                             torch.ones(1, 1, 3, dtype=torch.bool))
        with torch.no_grad():
            return model(batch)

    model = _tiny_model()
    base = out(model, feats, ids)
    assert base.shape == (1, 1, 3, 16)  # [S, M, B-1, d]
    later = feats.clone()
    later[0, a:] = torch.randn(T - a, 6).bfloat16()  # the target's states at a and after: unknown at serving
    assert torch.equal(out(model, later, ids), base)
    other = ids.clone()
    other[0, :a] = (other[0, :a] + 1) % 50  # tokens before a reach the block only through the states
    other[0, a + 1:] = (other[0, a + 1:] + 1) % 50
    assert torch.equal(out(model, feats, other), base)
    before = feats.clone()
    before[0, a - 1] += 1
    assert not torch.allclose(out(model, before, ids), base)
    anchor = ids.clone()
    anchor[0, a] = (anchor[0, a] + 1) % 50
    assert not torch.allclose(out(model, feats, anchor), base)

    narrow = _tiny_model(window=3)  # sees a-3 … a-1 only
    base = out(narrow, feats, ids)
    far = feats.clone()
    far[0, : a - 3] = torch.randn(a - 3, 6).bfloat16()
    assert torch.equal(out(narrow, far, ids), base)
    near = feats.clone()
    near[0, a - 3] += 1
    assert not torch.allclose(out(narrow, near, ids), base)


def test_the_lookup_input_is_the_copy_of_known_tokens_only():
    model = _tiny_model(lookup=2)
    ids = [7, 1, 2, 3, 4, 5, 1, 2, 9, 9, 9]  # at a = 7 the bigram (1, 2) last ended at 2: the copy is 3 4 5
    s = {"input_ids": torch.tensor(ids), "loss_mask": torch.ones(11, dtype=torch.bool),
         "argmax": torch.zeros(11, dtype=torch.long), "feats": torch.randn(11, 6).bfloat16()}
    batch = blocks.make_batch([s], [torch.tensor([3, 7])], 4, lookup=2)
    assert batch.lookup.tolist() == [[[-1, -1, -1], [3, 4, 5]]]  # at 3, (2, 3) never occurred before
    with torch.no_grad():
        base = model(batch)
        after = {**s, "input_ids": torch.tensor(ids[:8] + [0, 0, 0])}  # tokens after the anchor: unknown
        assert torch.equal(model(blocks.make_batch([after], [torch.tensor([3, 7])], 4, lookup=2)), base)
        moved = {**s, "input_ids": torch.tensor([7, 1, 2, 8, 4, 5, 1, 2, 9, 9, 9])}  # another copied token
        changed = model(blocks.make_batch([moved], [torch.tensor([3, 7])], 4, lookup=2))
    assert not torch.allclose(changed[0, 1], base[0, 1])
    # the copy logit: a learned bonus on the copied token's score only, none where nothing matched
    with torch.no_grad():
        bonus = model.logits(base, batch.lookup) - model.logits(base)
        gate = model.copy(base)[..., 0]
    assert not bonus[0, 0].any()
    for j, tok in enumerate([3, 4, 5]):
        want = torch.zeros(50)
        want[tok] = gate[0, 1, j]
        assert torch.allclose(bonus[0, 1, j], want, atol=1e-6)


def test_rows_of_one_batch_do_not_see_each_other():
    model = _tiny_model()
    s = {"input_ids": torch.randint(0, 50, (10,)), "loss_mask": torch.ones(10, dtype=torch.bool),
         "argmax": torch.randint(0, 50, (10,)), "feats": torch.randn(10, 6).bfloat16()}
    t = {k: v.clone() for k, v in s.items()}
    t["feats"] = torch.randn(10, 6).bfloat16()
    with torch.no_grad():
        alone = model(blocks.make_batch([s], [torch.tensor([3, 5])], 4))
        both = model(blocks.make_batch([s, t], [torch.tensor([3, 5]), torch.tensor([2, 4, 6])], 4))
        # a pad anchor beside real ones changes nothing either
        padded = model(blocks.make_batch([s, t], [torch.tensor([3, 5]), torch.tensor([6])], 4))
    assert torch.allclose(both[0, :2], alone[0], atol=1e-5) and torch.allclose(padded[0, :2], alone[0], atol=1e-5)


def test_prompt_keys_and_disjoint_sets():
    a = _seq("sharegpt:1", [1, 2, 3, 4, 5], [0, 0, 1, 1, 1])
    regen = _seq("sharegpt:1", [1, 2, 9, 9], [0, 0, 1, 1])  # same prompt, the target's answer
    dup = _seq("sharegpt:77", [1, 2, 8, 8, 8], [0, 0, 1, 1, 1])  # another row, the same prompt
    other = _seq("sharegpt:2", [1, 3, 4, 5], [0, 0, 1, 1])
    assert a["prompt_key"] == regen["prompt_key"] == dup["prompt_key"] != other["prompt_key"]
    assert a["prompt_key"] == hashlib.sha256(np.array([1, 2], dtype="<i4").tobytes()).hexdigest()[:16]
    held = data.fingerprint([regen])
    assert [s["sample_id"] for s in (a, dup, other) if not data.seen(s, held)] == ["sharegpt:2"]
    prints = data.fingerprint([other])
    assert data.seen(other, prints) and not data.seen(a, prints)
    assert data.seen(_seq("elsewhere:5", [1, 3, 7], [0, 0, 1]), prints)  # same prompt tokens, other id


def test_bigram_baseline_on_hand_built_counts():
    V = 6
    ids = torch.tensor([1, 1, 1, 2, 2, 3, 3])
    greedy = torch.tensor([2, 2, 4, 3, 1, 5, 4])  # 1→2 twice, 1→4 once; 2: 3 and 1 tie; 3: 5 and 4 tie
    table = metrics.fit_bigram(ids, greedy, torch.arange(7), V)
    # ties go to the smaller id; tokens never seen map to the most frequent greedy token (2)
    assert table.tolist() == [2, 2, 1, 4, 2, 2]
    assert metrics.bigram_draft(table, torch.tensor([1, 3]), 3).tolist() == [[2, 1, 2], [4, 2, 1]]
    # only the given positions count (fallback: greedy tokens 4 and 3 tie at one count, 3 is smaller)
    assert metrics.fit_bigram(ids, greedy, torch.tensor([2, 3]), V).tolist() == [3, 4, 3, 3, 3, 3]


def test_lookup_baseline_copies_what_followed_the_latest_match():
    ids = torch.tensor([5, 1, 2, 3, 4, 1, 2, 9, 1, 2])
    drafts = metrics.lookup_draft(ids, torch.tensor([2, 6, 9]), 5, n=2)
    # 2: (1, 2) never seen before; 6: (1, 2) last ended at 2, so 3 4 1 2 follow; 9: it last ended at 6,
    # and only 9 1 2 are known after it: the copy repeats with period 3
    assert drafts.tolist() == [[-1, -1, -1, -1], [3, 4, 1, 2], [9, 1, 2, 9]]
    assert metrics.lookup_draft(ids, torch.tensor([6]), 3, n=1).tolist() == [[3, 4]]  # token 2 last at 2
    every = metrics.lookup_draft(ids, torch.arange(10), 5, n=2)  # position 0 ends no bigram
    assert every[0].tolist() == [-1] * 4 and every[6].tolist() == [3, 4, 1, 2] and every[9].tolist() == [9, 1, 2, 9]


def _capture(out, *extra):
    # one HF replica in this process (--executor auto); the online test's Ray replicas must give the same rows
    capture_cli("run", "--target", "smollm2-135m", "--layers", "3,15,27",
                "--max-tokens", "256", "--overlength", "truncate", "--no-progress", "--out", str(out), *extra,
                check=True)
    return out


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, smol_dir):
    """24 ShareGPT rows through SmolLM2 (``_capture``'s settings); --topk 8: the KL option trains on the stored
    top-K, everything else ignores it. Built once (conftest.built_once): tests/test_drafter_online.py reads it too."""
    return built_once(tmp_path_factory, "drafter-small",
                      lambda out: _capture(out, "--dataset", "sharegpt", "--limit", "24", "--topk", "8"))


def test_adapter_matches_the_reader(small_run):
    rows = list(iter_rows(small_run))
    samples = list(data.load_samples(small_run))
    assert [s["sample_id"] for s in samples] == [r["sample_id"] for r in rows]
    for row, s in zip(rows[:3], samples):
        T = len(row["input_ids"])
        assert s["feats"].shape == (T, 3 * 576) and s["feats"].dtype == torch.bfloat16
        for i, k in enumerate((3, 15, 27)):
            x = row[f"tap_{k}"].float()
            want = (x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()).bfloat16()
            assert torch.allclose(s["feats"][:, i * 576:(i + 1) * 576].float(), want.float(), rtol=1e-2, atol=1e-2)
        assert s["input_ids"].dtype == torch.long and s["loss_mask"].dtype == torch.bool
        assert s["argmax"].tolist() == row["argmax"].tolist()
        first = int(np.flatnonzero(row["loss_mask"])[0])
        assert s["prompt_key"] == hashlib.sha256(row["input_ids"][:first].astype("<i4").tobytes()).hexdigest()[:16]
    held = [s["sample_id"] for s in data.load_samples(small_run, "heldout", 0.25)]
    train_ids = [s["sample_id"] for s in data.load_samples(small_run, "train", 0.25)]
    assert sorted(held + train_ids) == sorted(r["sample_id"] for r in rows) and held and train_ids
    assert all(data.heldout(sid, 0.25) for sid in held)


def _cfg(run, out, **kw):
    base = dict(run=str(run), out=str(out), steps=40, anchors_per_step=64, anchors_per_seq=16, lr=2e-3,
                warmup_steps=5, heldout_fraction=0.25, eval_anchors=512, d_model=64, progress=False, workers=0)
    return TrainConfig(**{**base, **kw})


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _epochs(out):
    """epoch → [(rank, sample_id)] in the order samples.jsonl says they were trained, and the last epoch
    every rank finished (an epoch is complete once every rank trained on the next one)."""
    by_epoch, last = {}, {}
    for entry in _jsonl(out / "samples.jsonl"):
        for rank, epoch, sid in entry["samples"]:
            by_epoch.setdefault(epoch, []).append((rank, sid))
            last[rank] = max(last.get(rank, 0), epoch)
    return by_epoch, min(last.values()) - 1


def test_training_lowers_loss_and_checkpoint_round_trips(small_run, tmp_path):
    cfg = _cfg(small_run, tmp_path / "a")
    result = train(cfg)
    before, after = result["fixed_loss"]
    assert after < before - 0.5, result["fixed_loss"]
    assert result["drafter"]["blocks"] == result["bigram"]["blocks"] == result["lookup"]["blocks"] \
        == result["untrained"]["blocks"] > 100
    assert len(result["drafter"]["position_acc"]) == cfg.block_size - 1
    assert result["data"]["precision"] == evaluate.resolve_precision("auto") in ("bfloat16", "float32")  # this CPU's
    # the hybrid is lookup's draft where lookup has a match, the drafter's elsewhere: the same split,
    # lookup's score on the matched anchors, the drafter's on the others
    look, drafter, hybrid = (result[k]["by_lookup_match"] for k in ("lookup", "drafter", "hybrid"))
    assert 0 < look["share"] == drafter["share"] == hybrid["share"] < 1
    assert hybrid["accept_len_matched"] == look["accept_len_matched"] > 0 and look["accept_len_unmatched"] == 0
    assert hybrid["accept_len_unmatched"] == drafter["accept_len_unmatched"]
    # commit takes lookup's block only where it matched (and the drafter chose its slot-1 token): elsewhere
    # it is the drafter; the oracle takes the better of the two per block, so no choice beats it
    commit, oracle = result["commit"], result["oracle"]
    assert commit["by_lookup_match"]["accept_len_unmatched"] == drafter["accept_len_unmatched"]
    assert oracle["by_lookup_match"]["accept_len_unmatched"] == drafter["accept_len_unmatched"]
    assert oracle["accept_len"] >= max(result[k]["accept_len"] for k in ("drafter", "lookup", "hybrid", "commit"))
    assert oracle["by_lookup_match"]["accept_len_matched"] > look["accept_len_matched"]
    rows = list(iter_rows(small_run))
    assert result["data"]["train"]["conversations"] + result["data"]["heldout"]["conversations"] \
        + result["data"]["overlap_removed"] == len(rows)
    lines = _jsonl(tmp_path / "a" / "metrics.jsonl")
    assert [e["model"] for e in lines if e["kind"] == "eval"] == ["untrained", "bigram", "lookup", "drafter", "hybrid",
                                                                    "commit", "oracle"]
    assert [e["step"] for e in lines if e["kind"] == "train"] == [10, 20, 30, 40]
    assert (tmp_path / "a" / "checkpoints" / "latest").read_text().strip() == "step-00000040"

    # Streamed epochs: each complete epoch trains every train conversation exactly once, in its own order.
    s = prepare(cfg)
    held = {r["sample_id"] for r in rows if data.heldout(r["sample_id"], 0.25)}
    trainable = {r["sample_id"] for r in rows} - held
    by_epoch, complete = _epochs(tmp_path / "a")
    assert complete >= 2 and len(_jsonl(tmp_path / "a" / "samples.jsonl")) == 40
    for e in range(complete + 1):
        ids = [sid for _, sid in by_epoch[e]]
        assert len(ids) == len(set(ids)) == s.train.conversations and set(ids) <= trainable
    assert [sid for _, sid in by_epoch[0]] != [sid for _, sid in by_epoch[1]]  # reshuffled each epoch

    # Reloaded: bit-exact tensors, saved again bit-exact, the same held-out metrics.
    model, meta = checkpoint.load(tmp_path / "a")
    saved = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert set(saved) == set(model.state_dict()) and "vocab" in saved and "embed" not in saved
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    checkpoint.save(model, {k: v for k, v in meta.items() if k != "model"}, s.train.prints, tmp_path / "b")
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()
    again = evaluate_checkpoint(tmp_path / "a", str(small_run))
    assert again["skipped_trained_on"] == 0 and again["conversations"] == result["data"]["heldout"]["conversations"]
    assert {k: again[k] for k in result["drafter"]} == result["drafter"]
    assert meta["taps"] == ["tap_3", "tap_15", "tap_27"] and meta["train"]["seed"] == 0
    # scoring on rows it was trained on is refused: each one is skipped
    everything = evaluate_checkpoint(tmp_path / "a", str(small_run), split="all")
    assert everything["skipped_trained_on"] == s.train.conversations + s.train.removed
    assert everything["conversations"] == result["data"]["heldout"]["conversations"]

    # The same seed, read by 2 DataLoader workers: the same rows in the same steps, the same drafter bit for bit.
    same = train(dataclasses.replace(cfg, out=str(tmp_path / "c"), workers=2))
    assert (tmp_path / "c" / "samples.jsonl").read_bytes() == (tmp_path / "a" / "samples.jsonl").read_bytes()
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()
    assert same["drafter"] == result["drafter"] and same["untrained"] == result["untrained"]


@pytest.fixture(scope="module")
def held_run(tmp_path_factory, smol_dir):
    """Rows 0-3 with regenerated answers (no top-K): the same prompts as 4 rows of small_run."""
    return _capture(tmp_path_factory.mktemp("drafter") / "held", "--dataset", "sharegpt", "--limit", "4",
                    "--responses", "regenerate", "--max-new-tokens", "8")


def test_heldout_run_drops_shared_prompts_from_training(small_run, held_run, tmp_path):
    cfg = _cfg(small_run, tmp_path / "d", heldout_run=str(held_run), steps=5)
    s = prepare(cfg)
    held_rows = list(iter_rows(held_run))
    assert s.held.conversations == len(held_rows) and s.train.removed >= len(held_rows)
    assert s.train.conversations + s.train.removed == len(list(iter_rows(small_run)))
    assert not set(s.held.prints["sample_ids"].tolist()) & set(s.train.prints["sample_ids"].tolist())
    assert not set(s.held.prints["prompt_keys"].tolist()) & set(s.train.prints["prompt_keys"].tolist())
    result = train(cfg)
    assert result["data"]["heldout"]["conversations"] == len(held_rows)
    trained = {sid for entry in _jsonl(tmp_path / "d" / "samples.jsonl") for _, _, sid in entry["samples"]}
    assert not trained & {r["sample_id"] for r in held_rows}
    score = evaluate_checkpoint(tmp_path / "d", str(held_run), split="all")
    assert score["skipped_trained_on"] == 0 and score["accept_len"] == result["drafter"]["accept_len"]

    # train_rows: only the first 5 train conversations (manifest order) are trained on, and kept as trained
    few = train(dataclasses.replace(cfg, out=str(tmp_path / "few"), train_rows=5, steps=8))
    trained = {sid for entry in _jsonl(tmp_path / "few" / "samples.jsonl") for _, _, sid in entry["samples"]}
    kept = dict(np.load(tmp_path / "few" / "train_set.npz"))
    assert few["data"]["train"]["conversations"] == 5 and len(kept["sample_ids"]) == 5
    assert {data.id_hash(sid) for sid in trained} == set(kept["sample_ids"].tolist())


def test_loss_weights_and_kl_term_on_a_hand_built_batch():
    model = _tiny_model(B=3)
    s = {"input_ids": torch.randint(0, 50, (8,)), "loss_mask": torch.ones(8, dtype=torch.bool),
         "argmax": torch.randint(0, 50, (8,)), "feats": torch.randn(8, 6).bfloat16(),
         "topk_ids": torch.randint(0, 50, (8, 4)), "topk_logprobs": torch.log_softmax(torch.randn(8, 4), -1)}
    batch = blocks.make_batch([s], [torch.tensor([2, 4])], 3, topk=True)
    with torch.no_grad():
        logp = torch.log_softmax(model.logits(model(batch)), -1)  # [1, 2, 2, V]
        ce = -logp.gather(-1, batch.labels[..., None])[..., 0]
        w = torch.tensor([1.0, float(np.exp(-1 / 2))])
        assert torch.allclose(block_loss(model, batch, 2.0), (ce * w).sum() / (2 * w.sum()), atol=1e-5)
        teacher = torch.softmax(batch.topk_logprobs, -1)
        soft = -(teacher * logp.gather(-1, batch.topk_ids)).sum(-1)
        want = ((ce + 0.5 * soft) * w).sum() / (2 * w.sum())
        assert torch.allclose(block_loss(model, batch, 2.0, kl_weight=0.5), want, atol=1e-5)


def test_kl_option_lowers_its_loss_and_round_trips(small_run, tmp_path):
    first = data.prepare(next(iter(ShardStream(small_run, split="train", heldout_fraction=0.25))))
    assert first["topk_ids"].shape == (len(first["input_ids"]), 8)
    assert torch.equal(first["topk_ids"][:, 0], first["argmax"])  # the stored top-1 is the argmax
    cfg = _cfg(small_run, tmp_path / "kl", kl_weight=1.0)
    result = train(cfg)
    before, after = result["fixed_loss"]
    assert after < before - 0.5, result["fixed_loss"]
    again = evaluate_checkpoint(tmp_path / "kl", str(small_run))
    assert {k: again[k] for k in result["drafter"]} == result["drafter"]
    assert json.loads((tmp_path / "kl" / "config.json").read_text())["train"]["kl_weight"] == 1.0
    # the KL term changes the training: another drafter than the cross-entropy one of the same seed
    ce = train(dataclasses.replace(cfg, out=str(tmp_path / "ce"), kl_weight=0.0))
    assert ce["fixed_loss"][0] < before  # the same fixed anchors, without the KL term


def test_cli_train_eval_and_user_errors(small_run, held_run, tmp_path):
    conf = tmp_path / "drafter.yaml"
    conf.write_text(yaml.safe_dump({"run": str(small_run), "steps": 3, "anchors_per_step": 16, "anchors_per_seq": 8,
                                    "heldout_fraction": 0.25, "eval_anchors": 64, "d_model": 32}))
    res = capture_inproc("drafter", "train", "--config", str(conf), "--out", str(tmp_path / "d"), "--lr", "0.002",
                         "--no-progress", "--json")
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert set(out) >= {"untrained", "bigram", "drafter", "fixed_loss", "data"}
    meta = json.loads((tmp_path / "d" / "config.json").read_text())
    assert meta["train"]["lr"] == 0.002 and meta["train"]["steps"] == 3  # flag over YAML
    res = capture_inproc("drafter", "eval", str(tmp_path / "d"), "--run", str(small_run), "--json")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["accept_len"] == out["drafter"]["accept_len"]
    bad = capture_inproc("drafter", "eval", str(tmp_path / "d"), "--run", str(small_run), "--split", "train")
    assert bad.exit_code == 2 and "the drafter was trained on them" in bad.stderr

    conf.write_text(yaml.safe_dump({"run": str(small_run), "stepz": 3}))
    bad = capture_inproc("drafter", "train", "--config", str(conf), "--out", str(tmp_path / "e"))
    assert bad.exit_code == 2 and "unknown drafter config key(s): stepz" in bad.stderr
    bad = capture_inproc("drafter", "train", "--run", str(tmp_path), "--out", str(tmp_path / "e"))
    assert bad.exit_code == 2 and "holds no capture run" in bad.stderr
    conf.write_text(yaml.safe_dump({"run": str(small_run), "steps": "many"}))
    bad = capture_inproc("drafter", "train", "--config", str(conf), "--out", str(tmp_path / "e"))
    assert bad.exit_code == 2 and "steps: expected int" in bad.stderr
    bad = capture_inproc("drafter", "train", "--run", str(held_run), "--out", str(tmp_path / "e"), "--kl-weight", "1")
    assert bad.exit_code == 2 and "stores no top-K logits" in bad.stderr
    bad = capture_inproc("drafter", "train", "--run", str(small_run), "--out", str(tmp_path / "e"), "--block-size", "1")
    assert bad.exit_code == 2 and "block_size must be at least 2" in bad.stderr
    bad = capture_inproc("drafter", "train", "--follow", "--run", str(small_run), "--heldout-run", str(held_run),
                         "--out", str(tmp_path / "f"), "--train-anchors", "100")
    assert bad.exit_code == 2 and "--train-rows/--train-anchors pick rows of a finished run" in bad.stderr
    assert not (tmp_path / "f").exists()


def _train_args(run, out, *extra):
    return ["drafter", "train", "--run", str(run), "--out", str(out), "--steps", "60", "--anchors-per-step", "32",
            "--anchors-per-seq", "16", "--heldout-fraction", "0.25", "--eval-anchors", "256", "--d-model", "64",
            "--warmup-steps", "5", "--checkpoint-every", "4", "--no-progress", *extra]


def _kill_after_a_checkpoint(args: list[str], out, env: dict | None = None) -> dict:
    """Run the CLI with ``args`` in a process of its own, SIGKILL it once ``out`` has a training checkpoint;
    that checkpoint's state.json."""
    proc = subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env or {**os.environ, "TQDM_DISABLE": "1"})
    latest = out / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the trainer ended before its first checkpoint"
    return json.loads((out / "checkpoints" / latest.read_text().strip() / "state.json").read_text())


def test_a_killed_trainer_resumes_with_every_row_once_and_the_same_drafter(small_run, held_run, tmp_path):
    """SIGKILL a real trainer process after a checkpoint, mid-epoch; the same command finishes the run:
    the rows of each step, the log and the drafter are those of a run never stopped (2 DataLoader workers)."""
    ref = capture_cli(*_train_args(small_run, tmp_path / "ref", "--workers", "2"))
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "killed"
    killed_at = _kill_after_a_checkpoint(_train_args(small_run, out, "--workers", "2"), out)
    latest = out / "checkpoints" / "latest"
    assert 4 <= killed_at["step"] < 60 and not (out / "model.safetensors").exists()
    by_epoch, _ = _epochs(tmp_path / "ref")
    assert killed_at["streams"][0]["position"] not in (0, len(by_epoch[0]))  # mid-epoch
    again = capture_cli(*_train_args(small_run, out, "--workers", "2"))
    assert again.returncode == 0, again.stderr
    assert (out / "samples.jsonl").read_bytes() == (tmp_path / "ref" / "samples.jsonl").read_bytes()
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "ref" / "model.safetensors").read_bytes()
    strip = lambda path: [{k: v for k, v in e.items() if k not in ("seconds", "waited_s", "train_seconds")}  # noqa: E731
                          for e in _jsonl(path / "metrics.jsonl")]
    assert strip(out) == strip(tmp_path / "ref")
    # the finished drafter is not trained again; another world size or other settings are refused in one line
    done = capture_cli(*_train_args(small_run, out))
    assert done.returncode == 2 and "already holds a trained drafter" in done.stderr
    partial = tmp_path / "partial"
    (partial / "checkpoints").mkdir(parents=True)
    os.symlink(out / "checkpoints" / latest.read_text().strip(), partial / "checkpoints" / "step-00000060")
    (partial / "checkpoints" / "latest").write_text("step-00000060\n")
    other = capture_cli(*_train_args(small_run, partial, "--lr", "0.01"))
    assert other.returncode == 2 and "trained with other settings (lr)" in other.stderr.splitlines()[-1]
    other = capture_cli(*_train_args(held_run, partial))
    assert other.returncode == 2 and "trained with other settings (run)" in other.stderr.splitlines()[-1]


def _torchrun(*args, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "cli", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1", **(env or {})})


def test_two_ranks_read_disjoint_rows_whose_union_is_one_ranks_epoch(small_run, tmp_path):
    """torchrun, 2 real processes (gloo): each rank trains on its own rows of each epoch, their union is the
    epoch of a 1-rank run, every step has rows of both ranks, and one checkpoint and one drafter are written."""
    one = capture_cli(*_train_args(small_run, tmp_path / "one", "--steps", "24", "--workers", "0"))
    assert one.returncode == 0, one.stderr
    conf = tmp_path / "two.yaml"  # torchrun's own parser would take --run for its --run-path
    conf.write_text(yaml.safe_dump({"run": str(small_run)}))
    args = _train_args(small_run, tmp_path / "two", "--steps", "24", "--workers", "1")
    two = _torchrun("drafter", "train", "--config", str(conf), *args[4:])
    assert two.returncode == 0, two.stderr[-3000:]
    single, complete_one = _epochs(tmp_path / "one")
    ranks, complete_two = _epochs(tmp_path / "two")
    assert complete_two >= 1
    for e in range(complete_two + 1):
        mine = {r: [sid for rank, sid in ranks[e] if rank == r] for r in (0, 1)}
        assert mine[0] and mine[1] and not set(mine[0]) & set(mine[1])
        assert sorted(mine[0] + mine[1]) == sorted(sid for _, sid in single[0])
    steps = _jsonl(tmp_path / "two" / "samples.jsonl")
    assert [e["step"] for e in steps] == list(range(1, 25))
    assert all(sorted({r for r, _, _ in e["samples"]}) == [0, 1] for e in steps)  # both ranks in every step
    state = json.loads((tmp_path / "two" / "checkpoints" / "step-00000024" / "state.json").read_text())
    assert [s["rank"] for s in state["streams"]] == [0, 1] and state["world_size"] == 2
    assert (tmp_path / "two" / "model.safetensors").exists()
    # resuming with another world size is one line
    (tmp_path / "two" / "model.safetensors").rename(tmp_path / "two" / "kept.safetensors")
    alone = capture_cli(*_train_args(small_run, tmp_path / "two", "--steps", "24"))
    assert alone.returncode == 2 and "saved by 2 rank(s), this trainer has 1" in alone.stderr


PEAK_RSS = """
import resource, sys
from cli import main
try:
    main(sys.argv[1:], standalone_mode=False)
finally:
    print("peak_rss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def peak_rss_mib(*args: str) -> float:
    """Run the CLI in a fresh process (no DataLoader worker: every decode in it); its peak resident MiB."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}  # nothing an earlier test set
    proc = subprocess.run([sys.executable, "-c", PEAK_RSS, *args], cwd=REPO, capture_output=True, text=True,
                          env={**env, "TQDM_DISABLE": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stderr.split("peak_rss_kib")[-1].split()[0]) / 1024


@pytest.mark.model  # no model: trainings in processes of their own, the slow lane
def test_memory_does_not_grow_with_the_run(tmp_path):
    """The same training on a run 4x larger (1.5 MiB of states a conversation: 48 vs 192 MiB of feats held,
    had the trainer kept them) peaks within 1.2x the resident memory; bench/trainer_memory.out: 8x."""
    peaks = {}
    for n in (32, 128):
        run, target = helpers.drafter_run(tmp_path / str(n), n)
        peaks[n] = peak_rss_mib("drafter", "train", "--run", str(run), "--target-dir", str(target), "--out",
                                str(tmp_path / f"d{n}"), "--steps", "12", "--anchors-per-step", "64",
                                "--anchors-per-seq", "16", "--d-model", "32", "--eval-anchors", "256",
                                "--heldout-fraction", "0.2", "--workers", "0", "--no-progress")
        result = _jsonl(tmp_path / f"d{n}" / "metrics.jsonl")
        assert result[0]["train"]["conversations"] + result[0]["heldout"]["conversations"] == n
    assert peaks[128] < 1.2 * peaks[32], peaks


@pytest.mark.model  # no model: a trainer in a process of its own, the slow lane
def test_follow_trains_on_shards_as_they_are_committed_and_resumes_after_a_kill(tmp_path):
    """`drafter train --follow`: a real trainer process reads a run this test is still writing (tail mode),
    steps before the run completes, is SIGKILLed after a checkpoint and resumed by the same command: every row
    of the run is trained on exactly once, no row of the held-out run, and the acks are by stream position."""
    import threading

    from shards import live
    from shards.manifest import ManifestWriter
    from shards.run import as_location
    from shards.writer import ShardWriter

    held, target = helpers.drafter_run(tmp_path / "held", 6, tokens=256, hidden=64, vocab=512, dataset="held")
    header, rows = helpers.drafter_rows(48, tokens=256, hidden=64, vocab=512, seed=1)
    run, out = tmp_path / "live", tmp_path / "d"
    mw, _ = ManifestWriter.open(run, header)
    writer = ShardWriter(run, helpers.shard_format.schema(header), target_bytes=1)  # a shard a write
    go, done = threading.Event(), {}

    def capture():  # 4 rows a commit; after 3 commits it waits for the test (the trainer is being killed)
        for i in range(0, len(rows), 4):
            if i == 12:
                go.wait(300)
            for info in writer.write(rows[i:i + 4]):
                mw.commit(info)
            time.sleep(0.3)
        for info in writer.close():
            mw.commit(info)
        done["at"] = time.time()
        mw.complete({"rows": len(rows), "reason": "test"})

    thread = threading.Thread(target=capture)
    thread.start()
    args = ["drafter", "train", "--follow", "--run", str(run), "--heldout-run", str(held), "--target-dir", str(target),
            "--out", str(out), "--steps", "1000", "--anchors-per-step", "32", "--anchors-per-seq", "16", "--d-model",
            "32", "--vocab-warmup", "4", "--checkpoint-every", "2", "--eval-anchors", "256", "--workers", "0",
            "--no-progress"]
    try:
        at = _kill_after_a_checkpoint(args, out)
        go.set()
        assert at["streams"][0]["position"] >= 2 * at["step"] and "done" not in done  # killed mid-run
        acks = live.read(as_location(run), "tail")  # none yet when the kill came between checkpoint and ack
        assert all(a.position <= at["streams"][0]["position"] for a in acks)
        started = time.time()
        again = subprocess.run([sys.executable, "-m", "cli", *args, "--json"], cwd=REPO, capture_output=True,
                               text=True, timeout=600, env={**os.environ, "TQDM_DISABLE": "1"})
    finally:
        go.set()
        thread.join()
    assert again.returncode == 0, again.stderr[-3000:]
    result = json.loads(again.stdout)
    assert started + result["first_step_s"] < done["at"]  # stepping before the run completed
    trained = [sid for e in _jsonl(out / "samples.jsonl") for _, _, sid in e["samples"]]
    assert len(trained) == len(set(trained)) and set(trained) <= {r.sample_id for r in rows}
    assert len(trained) >= len(rows) - 1  # per_step 2: the last row may be left over
    assert result["data"]["heldout"]["conversations"] == 6 and result["drafter"]["blocks"] > 0
    acks = live.read(as_location(run), "tail")  # by stream position, what --retain deletes by
    assert acks and acks[-1].position == json.loads((out / "checkpoints" / (out / "checkpoints" / "latest")
                                                    .read_text().strip() / "state.json").read_text())["streams"][0]["position"]


def test_a_full_disk_a_second_trainer_and_a_damaged_checkpoint_are_one_line(tmp_path):
    import shutil

    from filelock import FileLock

    from conftest import small_disk

    run, target = helpers.drafter_run(tmp_path / "r", 12, tokens=256, hidden=64, vocab=512)
    args = ["drafter", "train", "--run", str(run), "--target-dir", str(target), "--steps", "4", "--anchors-per-step",
            "32", "--anchors-per-seq", "16", "--d-model", "32", "--eval-anchors", "128", "--heldout-fraction", "0.25",
            "--checkpoint-every", "2", "--workers", "0", "--no-progress"]
    with small_disk(tmp_path / "disk", "96k") as disk:  # the metrics fit, a checkpoint does not
        full = capture_cli(*args, "--out", str(disk / "d"))
        assert full.returncode == 2 and "cannot write the checkpoint of step 2" in full.stderr
        assert "no earlier checkpoint" in full.stderr and "Traceback" not in full.stderr
        assert not list((disk / "d" / "checkpoints").glob(".*tmp"))  # no partial checkpoint left on the full disk
    (tmp_path / "busy").mkdir()
    with FileLock(str(tmp_path / "busy" / ".drafter.lock")):  # another trainer's
        busy = capture_cli(*args, "--out", str(tmp_path / "busy"))
    assert busy.returncode == 2 and "another trainer is writing" in busy.stderr
    assert capture_cli(*args, "--out", str(tmp_path / "ok")).returncode == 0
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "ok" / "checkpoints", damaged / "checkpoints")
    step = damaged / "checkpoints" / (damaged / "checkpoints" / "latest").read_text().strip()
    os.truncate(step / "model.safetensors", 100)
    bad = capture_cli(*args, "--out", str(damaged))
    assert bad.returncode == 2 and "not a readable training checkpoint" in bad.stderr and "Traceback" not in bad.stderr
    os.truncate(tmp_path / "ok" / "model.safetensors", 100)
    bad = capture_cli("drafter", "eval", str(tmp_path / "ok"), "--run", str(run))
    assert bad.returncode == 2 and "not a drafter checkpoint" in bad.stderr and "Traceback" not in bad.stderr
