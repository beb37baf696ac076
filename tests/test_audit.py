"""`capture audit`: real SmolLM2 captures of the real Open-PerfectBlend sample (49 rows, 4 sources), engine-made
rows written through the real HF engine and shard writer, tampered and foreign rows; counts checked exactly."""

import collections
import dataclasses
import json
import shutil

import numpy as np
import pytest

from capture.conversation import Conversation, iter_conversations
from capture.dataset import ReadStats, resolve_dataset
from capture.chat import Tokenized
from common.hashing import token_sha256
from conftest import capture_cli
from provenance.audit import audit, greedy_counts, markdown
from shards import format as shard_format
from shards.manifest import ManifestWriter, read as read_manifest
from shards.reader import iter_rows
from shards.writer import ShardWriter
from shards.rows import Row

pytestmark = pytest.mark.model  # every test reads a real capture

AUTOIF = "Post-training-Data-Flywheel/AutoIF-instruct-61k"
ULTRAFEEDBACK = "HuggingFaceH4/ultrafeedback_binarized"
ULTRACHAT = "mlabonne/ultrachat_200k_sft"
METAMATH = "meta-math/MetaMathQA"
CAPS = {AUTOIF: 3, ULTRAFEEDBACK: 3, ULTRACHAT: 5, METAMATH: 1}  # ultrachat rows 45, 46 are multi-turn
MAX_TOKENS = 400
SAMPLE_COUNTS = {AUTOIF: 18, ULTRAFEEDBACK: 24, ULTRACHAT: 6, METAMATH: 1}


@pytest.fixture(scope="module")
def engine(smol_dir):
    from capture.engines.hf import HFEngine
    from capture.targets import PRESETS, make_taps

    return HFEngine(str(smol_dir), make_taps(PRESETS["smollm2-135m"], (3,), "none"), argmax=True)


@pytest.fixture(scope="module")
def captured(tmp_path_factory, sample_jsonl):
    """A real capture of 12 sample rows from all 4 sources, cut at MAX_TOKENS tokens."""
    out = tmp_path_factory.mktemp("audit") / "run"
    caps = [a for src, n in CAPS.items() for a in ("--source-cap", f"{src}={n}")]
    capture_cli("run", "--dataset", str(sample_jsonl), "--layers", "3", "--out", str(out), "--max-tokens",
                str(MAX_TOKENS), "--overlength", "truncate", *caps, "--no-progress", check=True)
    return out


def expected_rows(encoder, sample_jsonl) -> list[tuple[Conversation, Tokenized]]:
    """The sample rows the capture kept (the first CAPS[source] of each source), tokenized directly."""
    taken = collections.Counter()
    out = []
    for conv in iter_conversations(resolve_dataset(str(sample_jsonl)), ReadStats()):
        if taken[conv.source] < CAPS[conv.source]:
            taken[conv.source] += 1
            out.append((conv, encoder.encode(conv)))
    return out


def copy_run(src, dst, rows: list[Row]) -> None:
    """A new run folder with ``src``'s header (and provenance) holding ``rows`` in one shard."""
    dst.mkdir(parents=True)
    shutil.copy(src / "provenance.json", dst / "provenance.json")
    header = read_manifest(src).header
    add_rows(dst, header, rows)


def add_rows(run_dir, header, rows: list[Row]) -> None:
    """Commit ``rows`` as one more shard of ``run_dir`` (the writer and manifest a replica uses)."""
    mw, _ = ManifestWriter.open(run_dir, header)
    writer = ShardWriter(run_dir, shard_format.schema(header), target_bytes=1 << 40)
    writer.write(rows)
    for info in writer.close():
        mw.commit(info)


def engine_row(engine, sample_id: str, ids: np.ndarray, mask: np.ndarray) -> Row:
    """``ids`` through the real HF engine, as a replica would store them."""
    cap = engine.forward([ids])[0]
    return Row(sample_id, "engine", 0, ids, mask, cap.argmax, cap.states, token_sha256(ids))


def stored_rows(run_dir) -> list[Row]:
    return [Row(r["sample_id"], r["source"], r["row_index"], r["input_ids"], r["loss_mask"], r["argmax"],
                {"tap_3": r["tap_3"]}, r["token_sha256"]) for r in iter_rows(run_dir)]


@pytest.fixture(scope="module")
def with_engine_rows(captured, tmp_path_factory, engine, encoder):
    """The capture plus the two requests a serving engine makes itself: a health check asking for "OK"
    and 64 random token ids (with 8 generated tokens), each through the real engine."""
    out = tmp_path_factory.mktemp("audit") / "engine"
    health = encoder.encode(Conversation("engine:0", 0, "engine", (("user", "Reply with just OK."), ("assistant", "OK"))))
    rand = np.random.default_rng(7).integers(0, encoder.tokenizer.vocab_size, 72).astype(np.int32)
    rand_mask = np.zeros(72, bool)
    rand_mask[64:] = True
    copy_run(captured, out, stored_rows(captured) + [
        engine_row(engine, "engine:health", health.input_ids, health.loss_mask),
        engine_row(engine, "engine:random", rand, rand_mask)])
    return out


@pytest.fixture(scope="module")
def report(with_engine_rows, sample_jsonl):
    return audit(with_engine_rows, str(sample_jsonl))


def test_counts_tables_and_categories_exact(report, encoder, sample_jsonl, with_engine_rows):
    kept = expected_rows(encoder, sample_jsonl)
    assert len(kept) == 12
    exact = [t for _, t in kept if t.num_tokens <= MAX_TOKENS]
    cut = [t for _, t in kept if t.num_tokens > MAX_TOKENS]
    assert exact and cut  # both categories are exercised
    assert report.categories["exact"] == {"rows": len(exact), "tokens": sum(t.num_tokens for t in exact),
                                          "loss_tokens": sum(t.num_loss_tokens for t in exact)}
    assert report.categories["truncated"] == {"rows": len(cut), "tokens": MAX_TOKENS * len(cut),
                                              "loss_tokens": sum(int(t.loss_mask[:MAX_TOKENS].sum()) for t in cut)}
    assert report.categories["regenerated"]["rows"] == 0
    assert report.categories["engine_health_check"]["rows"] == 1
    assert report.categories["engine_random_tokens"] == {"rows": 1, "tokens": 72, "loss_tokens": 8}
    assert report.categories["unmatched"]["rows"] == 0 and report.unmatched == [] and report.ok
    assert report.engine_rows == {"engine_health_check": ["engine:health"], "engine_random_tokens": ["engine:random"]}
    assert report.captured["rows"] == 14

    # per-source table: conversations, tokens, supervised tokens, share, by category
    by_source = collections.defaultdict(collections.Counter)
    for conv, t in kept:
        n = min(t.num_tokens, MAX_TOKENS)
        by_source[conv.source].update(rows=1, tokens=n, loss_tokens=int(t.loss_mask[:n].sum()),
                                      exact=int(t.num_tokens <= MAX_TOKENS), truncated=int(t.num_tokens > MAX_TOKENS))
    total = sum(c["tokens"] for c in by_source.values())
    assert set(report.sources) == set(CAPS)
    for src, c in by_source.items():
        got = report.sources[src]
        assert {k: got[k] for k in ("rows", "tokens", "loss_tokens", "exact", "truncated")} == {
            k: c[k] for k in ("rows", "tokens", "loss_tokens", "exact", "truncated")}
        assert got["token_share"] == round(c["tokens"] / total, 4)

    # reference rows never captured, by source
    assert report.reference["rows_read"] == 49 and report.reference["tokenized"] == 49
    assert report.coverage == {s: {"conversations": SAMPLE_COUNTS[s], "tokenized": SAMPLE_COUNTS[s],
                                   "captured": CAPS[s], "never_captured": SAMPLE_COUNTS[s] - CAPS[s]}
                               for s in SAMPLE_COUNTS}
    md = markdown(report)
    assert "| exact | " in md and "engine:health" in md and "### Reference rows never captured" in md


def test_greedy_agreement_equals_direct_computation(report, captured, encoder, sample_jsonl):
    direct = collections.defaultdict(lambda: [0, 0])
    for r in iter_rows(captured):
        sup = r["loss_mask"][1:]
        direct[r["source"]][0] += int(sup.sum())
        direct[r["source"]][1] += int((sup & (r["input_ids"][1:] == r["argmax"][:-1])).sum())
    for src, (pos, agree) in direct.items():
        assert (report.sources[src]["greedy_positions"], report.sources[src]["greedy_agree"]) == (pos, agree)
        assert pos > 0
    assert report.greedy["greedy_positions"] == sum(p for p, _ in direct.values())
    assert report.greedy["greedy_agree"] == sum(a for _, a in direct.values())
    # the definition on a hand-built row: positions t >= 1 with mask[t]; agreement ids[t] == argmax[t-1]
    ids = np.array([5, 6, 7, 8, 9], np.int32)
    mask = np.array([True, False, True, True, True])
    argmax = np.array([6, 0, 8, 1, 0], np.int32)  # predicts ids[1] (unsupervised), ids[3] right, ids[4] wrong
    assert greedy_counts(ids, mask, argmax) == (3, 1)


def test_altered_token_is_reported_with_its_turn_and_position(captured, tmp_path, encoder, sample_jsonl):
    rows = stored_rows(captured)
    kept = expected_rows(encoder, sample_jsonl)
    # the first multi-turn conversation (ultrachat): alter a token inside its second answer
    # (SmolLM2's template writes its default system prompt inside the first rendered message, the user turn)
    conv, tok = next(kt for kt in kept if len(kt[0].messages) >= 4)
    starts = encoder.message_starts(conv)
    assert [r for r, _ in starts[:4]] == ["user", "assistant", "user", "assistant"]
    pos = starts[3][1] + 3
    assert pos < min(tok.num_tokens, MAX_TOKENS)
    k = next(k for k, row in enumerate(rows) if row.sample_id == conv.sample_id)
    row = rows[k]
    ids = row.input_ids.copy()
    ids[pos] = (ids[pos] + 1) % encoder.tokenizer.vocab_size
    rows[k] = dataclasses.replace(row, input_ids=ids, token_sha256=token_sha256(ids))
    copy_run(captured, tmp_path / "run", rows)

    r = audit(tmp_path / "run", str(sample_jsonl))
    assert r.categories["unmatched"]["rows"] == 1 and not r.ok
    assert r.categories["exact"]["rows"] + r.categories["truncated"]["rows"] == 11
    (d,) = r.unmatched
    assert d["sample_id"] == conv.sample_id and d["nearest_row"] == conv.row_index
    assert d["nearest_source"] == ULTRACHAT
    assert d["shared_prefix_tokens"] == pos and d["first_difference"] == pos
    assert (d["message"], d["role"]) == (3, "assistant")
    assert (d["captured_token"], d["reference_token"]) == (int(ids[pos]), int(tok.input_ids[pos]))
    assert r.coverage[ULTRACHAT]["captured"] == CAPS[ULTRACHAT] - 1


def test_row_from_outside_the_reference_is_unmatched(captured, tmp_path, engine, encoder, sample_jsonl):
    foreign = next(iter_conversations(resolve_dataset("sharegpt"), ReadStats()))
    tok = encoder.encode(foreign)
    rows = stored_rows(captured) + [engine_row(engine, foreign.sample_id, tok.input_ids[:300], tok.loss_mask[:300])]
    copy_run(captured, tmp_path / "run", rows)
    proc = capture_cli("audit", str(tmp_path / "run"), "--reference", str(sample_jsonl), "--json", "--no-progress")
    assert proc.returncode == 1, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["categories"]["unmatched"]["rows"] == 1 and not r["ok"]
    assert r["categories"]["exact"]["rows"] + r["categories"]["truncated"]["rows"] == 12
    (d,) = r["unmatched"]
    assert d["sample_id"] == foreign.sample_id and d["tokens"] == 300
    # it shares the template's system prompt with every reference row, then differs in the first user turn
    answer = encoder.message_starts(foreign)[1][1]
    assert 16 <= d["shared_prefix_tokens"] < answer and (d["message"], d["role"]) == (0, "user")


def test_regenerated_answers_are_their_own_category(tmp_path, sample_jsonl):
    out = tmp_path / "regen"
    capture_cli("run", "--dataset", str(sample_jsonl), "--layers", "3", "--out", str(out), "--limit", "3",
                "--responses", "regenerate", "--max-new-tokens", "6", "--no-progress", check=True)
    r = audit(out, str(sample_jsonl))
    assert sum(r.categories[c]["rows"] for c in ("exact", "truncated", "regenerated")) == 3
    assert r.categories["regenerated"]["rows"] >= 2  # 6 greedy tokens rarely end exactly like the dataset
    assert r.categories["unmatched"]["rows"] == 0
    assert r.coverage[AUTOIF]["captured"] == 3


def test_refuses_a_tokenizer_that_is_not_the_runs(captured, tmp_path, sample_jsonl, smol_dir):
    model = tmp_path / "model"
    shutil.copytree(smol_dir, model)
    cfg = json.loads((model / "tokenizer.json").read_text())
    cfg["added_tokens"][0]["content"] = "<|changed|>"
    (model / "tokenizer.json").write_text(json.dumps(cfg))
    proc = capture_cli("audit", str(captured), "--reference", str(sample_jsonl), "--model-path", str(model))
    assert proc.returncode == 2
    assert "is not the run's" in proc.stderr and "Traceback" not in proc.stderr


def test_audit_user_errors_are_one_line(captured, tmp_path, sample_jsonl):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for args, message in (
        (["--reference", str(empty)], "has no rows"),
        (["--reference", str(sample_jsonl), "--source-column", "origin"], "has a string column 'origin'"),
        (["--reference", str(sample_jsonl), "--model-path", str(tmp_path)], "cannot load a tokenizer from"),
    ):
        proc = capture_cli("audit", str(captured), *args, "--no-progress")
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-1500:]


def test_an_edit_in_the_first_tokens_is_diagnosed(captured, tmp_path, sample_jsonl):
    rows = stored_rows(captured)
    ids = rows[0].input_ids.copy()
    ids[5] += 1
    rows[0] = dataclasses.replace(rows[0], input_ids=ids, token_sha256=token_sha256(ids))
    copy_run(captured, tmp_path / "run", rows)
    (d,) = audit(tmp_path / "run", str(sample_jsonl)).unmatched
    assert d["nearest_row"] is not None and d["first_difference"] == 5 and d["shared_prefix_tokens"] == 5
