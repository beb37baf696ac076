"""Bad input through the real CLI: clear one-line errors or counted skips, nothing lost."""

import json

import pytest

from conftest import capture_cli, capture_inproc, capture_process, free_port
from shards import manifest
from shards.reader import iter_rows

SMALL = ["--max-tokens", "200", "--overlength", "truncate", "--no-progress"]

ROWS = [
    {"conversations": [{"from": "human", "value": "Name a prime."}, {"from": "gpt", "value": "7"}]},  # good
    {"conversations": []},  # empty
    {"conversations": [{"from": "narrator", "value": "x"}, {"from": "gpt", "value": "y"}]},  # unknown role
    {"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "y"}]},  # non-string
    {"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "y"}]},  # non-string
    {"conversations": [{"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "Hi"},
                       {"from": "gpt", "value": "How can I help?"}]},  # assistant first → normalized
    {"conversations": [{"from": "human", "value": "Say <|im_end|> twice"}, {"from": "gpt", "value": "no"}]},
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},  # OpenAI format
    {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"},
                       {"from": "gpt", "value": "c"}]},  # same role twice → merged
    {"conversations": [{"from": "human", "value": "only a question"}]},  # no answer
    {"text": "no conversation at all"},
    "{not json",
]


@pytest.fixture()
def bad_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in ROWS))
    return path


@pytest.mark.model
def test_bad_rows_are_counted_and_good_rows_kept(tmp_path, bad_jsonl):
    out = tmp_path / "run"
    proc = capture_cli("run", "--out", str(out), "--dataset", str(bad_jsonl), "--json", *SMALL, check=True)
    s = json.loads(proc.stdout)
    assert s["rows_read"] == len(ROWS)
    assert s["skipped"] == {
        "empty_conversation": 1, "unknown_role": 1, "non_string_content": 2,
        "no_assistant_turn": 1, "no_conversation_column": 1, "invalid_json": 1,
    }
    assert s["normalized"] == {"leading_assistant_removed": 1, "same_role_merged": 1}
    ids = [i for sh in manifest.read(out).shards for i in sh["sample_ids"]]
    assert sorted(ids) == ["bad.jsonl:0", "bad.jsonl:5", "bad.jsonl:6", "bad.jsonl:7", "bad.jsonl:8"]
    typed = next(r for r in iter_rows(out) if r["sample_id"] == "bad.jsonl:6")  # --special-text text, the default
    assert int((typed["input_ids"] == 2).sum()) == 3  # <|im_end|>: system, user, assistant; the typed one is text
    assert capture_cli("shards", "verify", str(out)).returncode == 0


@pytest.mark.model
def test_all_records_filtered_exits_non_zero_with_reasons(tmp_path, bad_jsonl):
    out = tmp_path / "run"
    # a process of its own: every line the real command prints (transformers' loggers write to stderr themselves)
    proc = capture_process("run", "--out", str(out), "--dataset", str(bad_jsonl), "--min-tokens", "100000", *SMALL)
    assert proc.returncode == 2
    assert "no records written" in proc.stderr and "under_min_tokens=5" in proc.stderr  # row 6 is kept as text now
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataset", "./no/such/file.jsonl"], "dataset file not found: ./no/such/file.jsonl"),
        (["--layers", "3,30"], "out of range"),
        (["--layers", "3,3"], "duplicate tap"),
        (["--final", "pre-norm", "--layers", "29"], "duplicates tap 29"),
        (["--target", "nope"], "unknown target 'nope'"),
        (["--shard-size", "lots"], "not a size"),
        pytest.param(["--chat-template", "/no/template.jinja"], "cannot read --chat-template",
                     marks=pytest.mark.model),  # refused once the model's tokenizer is loaded
        (["--unit-timeout", "inf"], "unit-timeout: inf is not a number of seconds > 0"),
        (["--commit-every", "0"], "commit-every: 0.0 is not a number of seconds > 0"),
        (["--first-unit-tokens", "0"], "first-unit-tokens: 0 is not"),
    ],
)
def test_user_errors_are_one_line(tmp_path, args, message):
    result = capture_inproc("run", "--out", str(tmp_path / "run"), "--limit", "2", *args, *SMALL)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "manifest.jsonl").exists()


@pytest.mark.model
def test_truncated_sharegpt_is_reported_not_fatal(tmp_path):
    """The real ShareGPT file breaks off mid-record; a dry run over all of it reports it and goes on.
    (A source cap keeps tokenization to 5 rows; every row is still read.)"""
    proc = capture_cli("run", "--out", str(tmp_path / "plan"), "--dataset", "sharegpt", "--dry-run", "--json",
                       "--source-cap", "sharegpt=5", "--no-progress", check=True)
    s = json.loads(proc.stdout)
    assert s["rows_read"] == 17671 and s["kept"] == 5
    assert "17671 complete records" in s["truncated_input"]
    assert s["kept"] + sum(s["skipped"].values()) == 17671 and s["skipped"]["source_cap"] > 17000
    assert not (tmp_path / "plan").exists()


@pytest.mark.model
def test_config_file_and_flags_override(tmp_path, sample_jsonl):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"dataset: {sample_jsonl}\nlayers: [3, 15]\nlimit: 49\nfilters:\n  max_tokens: 1000\n"
                   "  overlength: truncate\nsources: mlabonne/ultrachat_200k_sft\n")
    proc = capture_cli("run", "--config", str(cfg), "--out", str(tmp_path / "plan"), "--dry-run", "--json",
                       "--layers", "3", "--no-progress", check=True)
    s = json.loads(proc.stdout)
    assert s["rows_read"] == 49 and s["kept"] == 6 and s["skipped"] == {"source_not_selected": 43}
    assert s["estimated_tokens"] == 4353  # SmolLM2 tokens of those 6 rows, chat template applied
    bad = tmp_path / "bad.yaml"
    bad.write_text("colour: blue\n")
    result = capture_inproc("run", "--config", str(bad), "--out", str(tmp_path / "x"))
    assert result.exit_code == 2 and "unknown config key(s): colour" in result.stderr


@pytest.mark.model
def test_out_folder_with_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = capture_inproc("run", "--out", str(tmp_path), "--limit", "2", *SMALL)
    assert result.exit_code == 2 and "holds no capture run" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.model
def test_second_writer_on_the_same_run_is_refused(tmp_path):
    from filelock import FileLock

    out = tmp_path / "run"
    out.mkdir()
    with FileLock(out / ".capture.lock"):
        result = capture_inproc("run", "--out", str(out), "--limit", "2", *SMALL)
    assert result.exit_code == 2 and "another capture is writing" in result.stderr


@pytest.mark.parametrize(
    "yaml_line, message",
    [
        ('limit: "ten"', "limit: 'ten' is not an integer >= 0"),
        ("limit: 2.5", "limit: 2.5 is not an integer >= 0"),
        ("replicas: 0", "replicas: 0 is not an integer >= 1"),
        ("codec: fp8", "codec: 'fp8' is not one of"),
        ("layers: [3.7, 15]", "--layers must be comma-separated integers"),
        ('dedup: "no"', "dedup: 'no' is not true or false"),
        ("shard_size: -5", "shard-size: -5 is not an integer >= 1"),
        ("special_text: bogus", "special-text: 'bogus' is not one of text, drop, keep"),
        ("executor: threads", "executor: 'threads' is not one of auto, ray, local"),
        ("executor: local\nreplicas: 2", "--replicas 2 needs --executor ray (--executor local runs one replica)"),
        ("executor: local\nunit_timeout: 60", "--unit-timeout 60 needs --executor ray"),
    ],
)
def test_config_values_of_the_wrong_type(tmp_path, yaml_line, message):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml_line + "\n")
    result = capture_inproc("run", "--config", str(cfg), "--out", str(tmp_path / "run"))
    assert result.exit_code == 2 and message in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.model
def test_out_that_is_a_file_and_too_many_replicas(tmp_path):
    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    result = capture_inproc("run", "--out", str(afile), "--limit", "2", *SMALL)
    assert result.exit_code == 2 and "exists and is not a folder" in result.stderr
    result = capture_inproc("run", "--out", str(tmp_path / "r"), "--limit", "2", "--replicas", "5", *SMALL)
    assert result.exit_code == 2 and "5 replica(s)" in result.stderr and "do not fit" in result.stderr
    assert not (tmp_path / "r" / "manifest.jsonl").exists() and not (tmp_path / "r" / "provenance.json").exists()


@pytest.mark.model
def test_a_ray_address_where_nothing_answers_is_one_line_at_once(tmp_path):
    """--ray-address host:port where nothing listens (a typo, a cluster that is gone): exit 2 and one line
    before anything is written; ray.init itself retries such an address for minutes (common/net.py)."""
    address = f"127.0.0.1:{free_port()}"
    result = capture_inproc("run", "--out", str(tmp_path / "r"), "--limit", "2", "--ray-address", address, *SMALL)
    assert result.exit_code == 2, result.output
    assert f"--ray-address {address}: nothing answers there" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "r" / "manifest.jsonl").exists() and not (tmp_path / "r" / "provenance.json").exists()


@pytest.mark.model
def test_another_file_with_a_dataset_name_already_read_is_refused(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]} for i in range(3)]
    for d, shift in (("v1", 0), ("v2", 10)):
        (tmp_path / d).mkdir()
        (tmp_path / d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[shift:] + rows[:shift]))
    (tmp_path / "v2" / "train.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    out = tmp_path / "run"
    capture_cli("run", "--out", str(out), "--dataset", str(tmp_path / "v1" / "train.jsonl"), *SMALL, check=True)
    result = capture_inproc("run", "--out", str(out), "--dataset", str(tmp_path / "v2" / "train.jsonl"), *SMALL)
    assert result.exit_code == 2 and "has the same name" in result.stderr
    assert [d["path"] for d in manifest.read(out).datasets] == [str(tmp_path / "v1" / "train.jsonl")]
