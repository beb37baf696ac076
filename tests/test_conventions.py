"""Every engine's layer indexing, final state and positions, checked cell by cell on a model whose states
are known exactly (issue 33 part 7; vLLM tests its own extraction the same way, on a dummy model whose
layer i writes a known value). tests/helpers.predictable_model: decoder layer i adds 2 * (i + 1), the
embedding names the token, every value an integer exact in bf16, so the state after layer k at position t
is embedding(ids[t]) + (k + 1)(k + 2) and a wrong layer, stream, row or position is a wrong number.

Through `capture run` into shards, read back: the HF engine, vLLM's extract path and vLLM's hooks path;
taps given out of order (--layers 4,1,3); the final state pre- and post-norm; conversations of mixed
lengths in one batch (offsets); three sharing a long system prompt (prefix sharing: prefix caching asked
for); one longer than vLLM's max_num_batched_tokens (chunked prefill); and self-distillation, whose last
generated token has a state only because the capture prefills the whole conversation again."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import PREDICTABLE_TOKEN, predictable_model, predictable_state

from conftest import capture_cli, capture_process
from shards import manifest
from shards.reader import iter_rows

pytestmark = pytest.mark.model  # SmolLM2's tokenizer and template
TAPS = (4, 1, 3)  # out of order on purpose
REGENERATE = ("--responses", "regenerate", "--max-new-tokens", "5", "--temperature", "0")
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def _text(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


@pytest.fixture(scope="module")
def predictable(tmp_path_factory, smol_dir):
    """(model folder, dataset): 6 conversations of mixed lengths, 3 that share a ~300-token system prompt,
    one ~700 tokens long."""
    root = tmp_path_factory.mktemp("predictable")
    model = predictable_model(root / "model", smol_dir)
    system = _text(250, 99)
    rows = [{"conversations": [{"from": "human", "value": _text(5 + 17 * i, i)}, {"from": "gpt", "value": _text(3 + 9 * i, 50 + i)}]}
            for i in range(6)]
    rows += [{"conversations": [{"from": "system", "value": system}, {"from": "human", "value": _text(8, 70 + i)},
                                {"from": "gpt", "value": _text(6, 80 + i)}]} for i in range(3)]
    rows.append({"conversations": [{"from": "human", "value": _text(600, 7)}, {"from": "gpt", "value": _text(40, 8)}]})
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data


def check_run(out, final: str, taps=TAPS) -> int:
    """Assert every stored cell of the run equals the predictable model's state; returns the rows checked."""
    m = manifest.read(out)
    assert set(m.header.tap_layers) == set(taps)
    rows = list(iter_rows(out))
    for row in rows:
        ids = row["input_ids"]
        for k in taps:
            got = row[f"tap_{k}"].float().numpy()
            assert np.array_equal(got, predictable_state(ids, k)), (row["sample_id"], k,
                                                                     np.argwhere(got != predictable_state(ids, k))[:3])
        want = predictable_state(ids, final)
        got = row["final"].float().numpy()
        if final == "pre-norm":
            assert np.array_equal(got, want), row["sample_id"]
        else:  # RMSNorm's arithmetic in bf16: within bf16's rounding of values near 1
            assert np.allclose(got, want, rtol=2**-6, atol=2**-6), (row["sample_id"], np.abs(got - want).max())
    return len(rows)


def run_args(model, data, out, final: str, *extra: str) -> list[str]:
    return ["run", "--target", str(model), "--dataset", str(data), "--layers", ",".join(map(str, TAPS)), "--final",
            final, "--out", str(out), "--max-tokens", "2048", "--no-progress", "--json", *extra]


def test_hf_engine_stores_every_known_cell(predictable, tmp_path):
    model, data = predictable
    for final in ("pre-norm", "post-norm"):
        out = tmp_path / final
        capture_cli(*run_args(model, data, out, final, "--engine", "hf", "--batch-tokens", "1024"), check=True)
        assert check_run(out, final) == 10


def test_hf_self_distillation_has_the_last_generated_tokens_state(predictable, tmp_path):
    model, data = predictable
    out = tmp_path / "regen"
    capture_cli(*run_args(model, data, out, "post-norm", "--engine", "hf", *REGENERATE), check=True)
    assert check_run(out, "post-norm") == 10
    for row in iter_rows(out):
        answer = row["input_ids"][row["loss_mask"]]
        assert answer.tolist() == [PREDICTABLE_TOKEN] * 5, row["sample_id"]  # ran to its budget, no end token
        assert row["input_ids"][-1] == PREDICTABLE_TOKEN  # the last generated token is the last position stored


@pytest.mark.vllm
@pytest.mark.parametrize("path, final, mode", [("extract", "post-norm", REGENERATE), ("hooks", "pre-norm", ())],
                         ids=["extract-self-distillation", "hooks-dataset-answers"])
def test_vllm_paths_store_every_known_cell(predictable, tmp_path, ray_cluster, path, final, mode):
    """Chunked prefill (64 tokens a step: the long row takes ~11), prefix caching asked for (the engine must
    keep it off or give every token's state), the rows of mixed lengths in one unit; on the extract path the
    answers are generated by vLLM first (the states of the whole conversation, its last token included)."""
    model, data = predictable
    out = tmp_path / path
    capture_process(*run_args(model, data, out, final, "--engine", "vllm", "--vllm-path", path, "--max-model-len",
                              "2048", "--vllm-arg", "max_num_batched_tokens=64", "--vllm-arg",
                              "enable_prefix_caching=true", "--vllm-arg", "enforce_eager=true", "--self-check", "0",
                              "--ray-address", ray_cluster.address, *mode), env=ray_cluster.env, check=True)
    assert check_run(out, final) == 10
    if mode:
        assert all(r["input_ids"][r["loss_mask"]].tolist() == [PREDICTABLE_TOKEN] * 5 for r in iter_rows(out))
