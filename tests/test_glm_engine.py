"""Tiny random-weight GLM targets (the real ``glm_moe_dsa`` / ``glm5_next`` architectures at toy size,
tests/glm_fixtures.py) captured end to end with ``capture run --target <folder>`` on the HF engine, every
stored tap checked against an independent reference forward.

The reference is the whole model's forward (``model(input_ids)``, not the decoder the engine calls) with
forward hooks on every decoder layer, one record at a time, no padding, in the run's dtype (bf16) and in
float32; ``glm5_next``'s 4 residual streams are reduced here by an explicit ``.mean(dim=1)`` of each ``[T, N, H]`` layer output (the
convention in capture.targets), and the reference checks that this convention is the model's own:
``lm_head(norm(mean(layer L-1)))`` reproduces the model's logits.

Random-weight GLM models are very sensitive to bf16: the DSA indexer's top-k and the MoE router are
discrete choices, and near-flat random logits tie. Measured on these fixtures, a bf16 forward of the
model itself against float32 has per-token cosine min 0.80 at the last layer of ``glm_moe_dsa`` (0.97 for
``glm5_next``). So the stored bf16 states are held to the bf16 reference (min cosine 0.9999) and the
definition is cross-checked in float32 (engine with dtype float32 vs the float32 reference, 1e-4),
with two records of different lengths in one ``forward`` call (the engine prefills GLM records one at a
time: padding changes their states in transformers, see the padding test).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import capture_cli
from glm_fixtures import build_fixture

pytestmark = pytest.mark.model  # tiny random-weight GLM targets, captured and run

LAYERS = (0, 1, 2, 3, 4)  # every layer of the 5-layer fixtures (glm5_next: KDA 0-2 and 4, MLA + indexer 3)
ROWS = [
    {"messages": [{"role": "user", "content": "What is the weather in Paris today?"},
                  {"role": "assistant", "content": None, "reasoning_content": "Let me think about this step by step.",
                   "tool_calls": [{"function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                  {"role": "tool", "content": "{\"temp\": 18, \"sky\": \"clear\"}"},
                  {"role": "assistant", "content": "It is 18 degrees and clear.", "reasoning_content": "Clear sky."}]},
    {"conversations": [{"from": "human", "value": "Hello! How can I help you? " * 3},
                       {"from": "gpt", "value": "The quick brown fox jumps over the lazy dog. " * 4}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6 times 7?"},
                  {"role": "assistant", "content": "42", "reasoning_content": "6 times 7 is 42."},
                  {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You are welcome."}]},
]


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


@pytest.fixture(scope="module", params=["glm_moe_dsa", "glm5_next"])
def fixture_dir(request, tmp_path_factory):
    return build_fixture(request.param, tmp_path_factory.mktemp(request.param) / "model")


@pytest.fixture(scope="module")
def captured(fixture_dir, tmp_path_factory):
    from shards.reader import iter_rows

    tmp = tmp_path_factory.mktemp("run")
    data = tmp / "glm.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp / "run"
    proc = capture_cli("run", "--target", str(fixture_dir), "--dataset", str(data), "--layers",
                       ",".join(map(str, LAYERS)), "--final", "post-norm", "--out", str(out), "--no-progress",
                       "--dtype", "bfloat16",  # the bf16 reference's arithmetic on any CPU
                       "--json", check=True)
    return json.loads(proc.stdout), list(iter_rows(out)), out


def make_reference(fixture_dir, dtype):
    """Reference forward: ``fn(ids) -> ({layer: [T, H]}, post-norm [T, H], logits [T, V])`` in ``dtype``."""
    from capture.engines.hf import load_causal_lm

    model = load_causal_lm(str(fixture_dir), dtype)
    layers = model.get_decoder().layers
    seen = {}
    for k, layer in enumerate(layers):
        layer.register_forward_hook(lambda _m, _i, out, k=k: seen.__setitem__(k, out[0] if isinstance(out, tuple) else out))

    @torch.inference_mode()
    def run(ids):
        seen.clear()
        out = model(input_ids=torch.as_tensor(np.asarray(ids, dtype=np.int64))[None], output_hidden_states=True)
        states = {}
        run.raw = {k: h[0] for k, h in seen.items()}  # [T, N, H] for glm5_next
        for k, h in seen.items():
            h = h[0]
            states[k] = h.mean(dim=1) if h.dim() == 3 else h  # [T, N, H] streams → [T, H]
        decoder = model.get_decoder()
        normed = decoder.norm(states[len(layers) - 1])
        # the convention is the model's own: the LM head on norm(reduced last layer) gives the model's logits
        torch.testing.assert_close(model.get_output_embeddings()(normed), out.logits[0])  # dtype's tolerance
        torch.testing.assert_close(normed, out.hidden_states[-1][0])
        return states, normed, out.logits[0]

    return run


@pytest.fixture(scope="module")
def reference(fixture_dir):
    return make_reference(fixture_dir, torch.float32)


@pytest.fixture(scope="module")
def reference_bf16(fixture_dir):
    return make_reference(fixture_dir, torch.bfloat16)


def test_every_tap_matches_reference(captured, reference_bf16, reference, fixture_dir):
    summary, rows, _ = captured
    assert len(rows) == len(ROWS) == summary["committed_rows"]
    worst, worst32 = {}, {}
    for row in rows:
        states, normed, logits = reference_bf16(row["input_ids"])
        states32, normed32, _ = reference(row["input_ids"])
        for k, ref, ref32 in [(f"tap_{k}", states[k], states32[k]) for k in LAYERS] + [("final", normed, normed32)]:
            got = row[k]
            assert got.dtype == torch.bfloat16 and got.shape == (len(row["input_ids"]), 64)
            worst[k] = min(worst.get(k, 1.0), _cos(got, ref).min().item())
            worst32[k] = min(worst32.get(k, 1.0), _cos(got, ref32).min().item())
        agree = (row["argmax"] == logits.argmax(-1).numpy()).mean()
        assert agree >= 0.95, agree  # same logits up to the LM head's matmul shape; bf16 ties may break apart
    # the run's bf16 states are the model's own bf16 forward (up to kernel threading: measured min 0.9999997)
    assert min(worst.values()) > 0.9999, worst
    print(f"\n{fixture_dir.parent.name}: stored bf16 vs bf16 reference min cosine {worst}; "
          f"vs float32 reference {dict((k, round(v, 4)) for k, v in worst32.items())}")


def test_glm_padding_changes_states_in_transformers(fixture_dir):
    """Why the HF engine never packs GLM records (UNBATCHED_ARCHITECTURES): the model's own
    right-padded batch gives the shorter record other states than its forward alone, in float32 (from
    the first layer in glm_moe_dsa; from the indexer layer 3 in glm5_next, here for a 30-token record
    padded to 40)."""
    from capture.engines.hf import UNBATCHED_ARCHITECTURES, load_causal_lm

    arch = json.loads((fixture_dir / "config.json").read_text())["model_type"]
    assert arch in UNBATCHED_ARCHITECTURES
    model = load_causal_lm(str(fixture_dir), torch.float32)
    n, width, layer = (40, 60, 1) if arch == "glm_moe_dsa" else (30, 40, 4)  # hidden_states[k + 1] = layer k
    a = torch.arange(100, 100 + n)
    batch = torch.stack([torch.arange(5, 5 + width), torch.cat([a, torch.zeros(width - n, dtype=torch.long)])])
    mask = (torch.arange(width) < torch.tensor([[width], [n]])).long()
    with torch.inference_mode():
        padded = model(input_ids=batch, attention_mask=mask, output_hidden_states=True).hidden_states[layer][1, :n]
        alone = model(input_ids=a[None], output_hidden_states=True).hidden_states[layer][0]
    if padded.dim() == 3:
        padded, alone = padded.mean(1), alone.mean(1)
    diff = (padded - alone).abs().max().item()
    assert diff > 1e-3, diff  # if this fails, transformers fixed it: drop the arch from UNBATCHED_ARCHITECTURES


def test_float32_engine_equals_reference(fixture_dir, reference):
    """Same definition, no bf16: the engine's float32 taps equal the reference to float precision, for
    two records of different lengths handed to one ``forward`` call."""
    from capture.engines.hf import HFEngine
    from capture.targets import make_taps, resolve_target

    target = resolve_target(str(fixture_dir))
    eng = HFEngine(str(fixture_dir), make_taps(target, LAYERS, "post-norm"),
                   dtype="float32")
    ids = [np.arange(5, 45, dtype=np.int32), np.arange(100, 160, dtype=np.int32)]
    for seq, cap in zip(ids, eng.forward(ids)):
        states, normed, logits = reference(seq)
        for k in LAYERS:
            torch.testing.assert_close(cap.states[f"tap_{k}"], states[k], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cap.states["final"], normed, rtol=1e-4, atol=1e-4)
        assert (cap.argmax == logits.argmax(-1).numpy()).all()
        # the comparison can fail: neighbouring layers, and for glm5_next any single stream, are off the stored
        # tap by 10x the tolerance or more (mHC has no predictable-model form: docs/conventions.md)
        for k in LAYERS[1:]:
            assert (states[k] - states[k - 1]).abs().max() > 1e-2, k
        if reference.raw[0].dim() == 3:  # measured: 2.1e-3 after layer 0 (the streams start as copies), more after
            for k in LAYERS:
                assert min((reference.raw[k][:, n] - states[k]).abs().max() for n in range(4)) > 1e-3, k


def test_run_header_records_glm_conventions(captured, fixture_dir):
    from shards.format import read_header
    from shards.reader import read_table, shard_paths

    _, rows, out = captured
    header = read_header(read_table(shard_paths(out)[0]).schema)
    arch = json.loads((fixture_dir / "config.json").read_text())["model_type"]
    assert header.target["architecture"] == arch
    assert ("stream_reduction" in header.taps) == (arch == "glm5_next")
    if arch == "glm5_next":
        assert header.taps["residual_streams"] == 4
    # the GLM template and its masks made it into the shards: the tool turn's row has supervised reasoning
    assert all(r["loss_mask"].any() for r in rows)


def test_regenerate_carries_reasoning_effort(fixture_dir, tmp_path):
    """``--responses regenerate --chat-template-kwarg reasoning_effort=high`` on the tiny target: the
    prompt carries the effort line and the earlier turn's reasoning, the generation prompt ends at
    <|assistant|>, and the loss mask is exactly the generated tail."""
    from shards.reader import iter_rows
    from transformers import AutoTokenizer

    data = tmp_path / "regen.jsonl"
    data.write_text(json.dumps({"messages": [
        {"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi.", "reasoning_content": "greet"},
        {"role": "user", "content": "6 times 7?"}, {"role": "assistant", "content": "42"}]}) + "\n")
    out = tmp_path / "run"
    capture_cli("run", "--target", str(fixture_dir), "--dataset", str(data), "--layers", "0,4", "--responses",
                "regenerate", "--max-new-tokens", "12", "--chat-template-kwarg", "reasoning_effort=high",
                "--out", str(out), "--no-progress", check=True)
    (row,) = list(iter_rows(out))
    tok = AutoTokenizer.from_pretrained(fixture_dir)
    ids, mask = row["input_ids"].tolist(), row["loss_mask"]
    start = int(mask.argmax())
    assert tok.decode(ids[:start]) == ("[gMASK]<sop><|system|>Reasoning Effort: High<|user|>Hello!<|assistant|>"
                                       "<think>greet</think>Hi.<|user|>6 times 7?<|assistant|>")
    assert mask[start:].all() and 1 <= len(ids) - start <= 12 and row["finish_reasons"][0] in ("stop", "length")
