"""The drafter: acceptance length, anchors and labels, bigram baseline on hand-built cases; training,
checkpoints and the CLI on a small real SmolLM2 capture."""

import dataclasses
import hashlib
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import capture_cli, capture_inproc
from drafter import blocks, data, metrics
from drafter.config import TrainConfig
from drafter.train import evaluate_checkpoint, load_checkpoint, load_data, save_checkpoint, train
from shards.reader import iter_rows


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


def test_heldout_is_the_sha256_rule():
    for sid in ("sharegpt:0", "sharegpt:17", "x"):
        value = int.from_bytes(hashlib.sha256(sid.encode()).digest()[:8], "big") / 2**64
        assert data.heldout(sid, 0.1) == (value < 0.1)
        assert not data.heldout(sid, 0.0) and data.heldout(sid, 1.0)
    share = sum(data.heldout(f"sharegpt:{i}", 0.1) for i in range(10000)) / 10000
    assert 0.09 < share < 0.11


def _hand_batch():
    # two samples: lengths 6 and 4
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 0, 1, 1, 1], dtype=torch.bool)
    samples = []
    for sid, ids, m in (("a", [10, 11, 12, 13, 14, 15], mask[:6]), ("b", [20, 21, 22, 23], mask[6:])):
        T = len(ids)
        samples.append({"sample_id": sid, "source": "s", "input_ids": torch.tensor(ids), "loss_mask": m,
                        "argmax": torch.tensor(ids) + 100, "taps": torch.zeros(T, 2, 3, dtype=torch.bfloat16)})
    return data.pack(samples)


def test_pack_and_anchors_only_where_token_and_successor_are_supervised():
    b = _hand_batch()
    assert b["cu_seqlens"].tolist() == [0, 6, 10] and b["cu_seqlens"].dtype == torch.int32
    assert b["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert b["taps"].shape == (10, 2, 3) and b["sample_ids"] == ["a", "b"]
    # row 3 (mask 1) is followed by an unsupervised token; row 5 is the last of sample a (row 6 is b's
    # first); row 9 is the last row.
    anchors = blocks.valid_anchors(b["loss_mask"], b["position_ids"])
    assert anchors.tolist() == [1, 2, 7, 8]

    labels, valid = blocks.block_targets(b, anchors, 3)
    assert valid.tolist() == [[True, True, False], [True, False, False], [True, True, False], [True, False, False]]
    # block position j of anchor a: argmax[a+j] (the target's greedy choice for x_{a+j+1})
    assert labels.tolist() == [[111, 112, 0], [112, 0, 0], [121, 122, 0], [122, 0, 0]]
    ds, _ = blocks.block_targets(b, anchors, 3, labels="dataset")
    assert ds.tolist() == [[12, 13, 0], [13, 0, 0], [22, 23, 0], [23, 0, 0]]

    index, keep = blocks.context_window(torch.tensor([2, 7]), b["position_ids"], 3)
    assert index.tolist() == [[0, 1, 2], [7, 6, 7]] and keep.tolist() == [[True, True, True], [False, True, True]]


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


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter") / "run"
    # --ray-address local: always a fresh local Ray instance (a stale /tmp/ray/ray_current_cluster left by
    # another process on a shared machine otherwise makes ray.init() try to join a dead cluster)
    capture_cli("run", "--ray-address", "local", "--target", "smollm2-135m", "--dataset", "sharegpt",
                "--layers", "3,15,27", "--limit", "24", "--max-tokens", "256", "--overlength", "truncate", "--no-progress",
                "--out", str(out), check=True)
    return out


def test_adapter_matches_the_reader(small_run):
    rows = list(iter_rows(small_run))
    samples = list(data.load_samples(small_run))
    assert [s["sample_id"] for s in samples] == [r["sample_id"] for r in rows]
    for row, s in zip(rows[:3], samples):
        T = len(row["input_ids"])
        assert s["taps"].shape == (T, 3, 576) and s["taps"].dtype == torch.bfloat16
        for i, k in enumerate((3, 15, 27)):
            assert torch.equal(s["taps"][:, i], row[f"tap_{k}"])
        assert s["input_ids"].dtype == torch.long and s["loss_mask"].dtype == torch.bool
        assert s["argmax"].tolist() == row["argmax"].tolist()
    held = [s["sample_id"] for s in data.load_samples(small_run, "heldout", 0.25)]
    train_ids = [s["sample_id"] for s in data.load_samples(small_run, "train", 0.25)]
    assert sorted(held + train_ids) == sorted(r["sample_id"] for r in rows) and held and train_ids
    assert all(data.heldout(sid, 0.25) for sid in held)


def test_training_lowers_loss_and_checkpoint_round_trips(small_run, tmp_path):
    d = load_data(str(small_run), 0.25)
    cfg = TrainConfig(run=str(small_run), out=str(tmp_path / "a"), steps=40, anchors_per_step=64, lr=2e-3,
                      warmup_steps=5, heldout_fraction=0.25, eval_anchors=512, progress=False)
    result = train(cfg, d)
    before, after = result["fixed_loss"]
    assert after < before - 0.5, result["fixed_loss"]
    assert result["drafter"]["blocks"] == result["bigram"]["blocks"] == result["untrained"]["blocks"] > 100
    lines = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [e["model"] for e in lines if e["kind"] == "eval"] == ["untrained", "bigram", "drafter"]
    assert [e["step"] for e in lines if e["kind"] == "train"] == [10, 20, 30, 40]

    # Reloaded: bit-exact tensors, saved again bit-exact, the same held-out metrics.
    model, meta = load_checkpoint(tmp_path / "a")
    saved = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert set(saved) == set(model.state_dict()) and "vocab" in saved and "embed" not in saved
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    save_checkpoint(model, cfg, d, tmp_path / "b")
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()
    again = evaluate_checkpoint(tmp_path / "a", str(small_run))
    assert again == {"split": "heldout", **result["drafter"]}
    assert meta["taps"] == ["tap_3", "tap_15", "tap_27"] and meta["train"]["seed"] == 0

    # The same seed gives the same untrained drafter and the same run.
    same = train(dataclasses.replace(cfg, out=str(tmp_path / "c")), d)
    assert same["drafter"] == result["drafter"] and same["untrained"] == result["untrained"]


def test_cli_train_eval_and_user_errors(small_run, tmp_path):
    conf = tmp_path / "drafter.yaml"
    conf.write_text(yaml.safe_dump({"run": str(small_run), "steps": 3, "anchors_per_step": 16,
                                    "heldout_fraction": 0.25, "eval_anchors": 64}))
    res = capture_inproc("drafter", "train", "--config", str(conf), "--out", str(tmp_path / "d"), "--lr", "0.002",
                         "--no-progress", "--json")
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert set(out) >= {"untrained", "bigram", "drafter", "fixed_loss"}
    meta = json.loads((tmp_path / "d" / "config.json").read_text())
    assert meta["train"]["lr"] == 0.002 and meta["train"]["steps"] == 3  # flag over YAML
    res = capture_inproc("drafter", "eval", str(tmp_path / "d"), "--run", str(small_run), "--json")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["accept_len"] == out["drafter"]["accept_len"]

    conf.write_text(yaml.safe_dump({"run": str(small_run), "stepz": 3}))
    bad = capture_inproc("drafter", "train", "--config", str(conf), "--out", str(tmp_path / "e"))
    assert bad.exit_code == 2 and "unknown drafter config key(s): stepz" in bad.stderr
    bad = capture_inproc("drafter", "train", "--run", str(tmp_path), "--out", str(tmp_path / "e"))
    assert bad.exit_code == 2 and "holds no capture run" in bad.stderr
    conf.write_text(yaml.safe_dump({"run": str(small_run), "steps": "many"}))
    bad = capture_inproc("drafter", "train", "--config", str(conf), "--out", str(tmp_path / "e"))
    assert bad.exit_code == 2 and "steps: expected int" in bad.stderr
