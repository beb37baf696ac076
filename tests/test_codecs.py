"""Codec round trips on real SmolLM2 hidden states (lossless bit-exact; FP8 within the stated error)."""

import numpy as np
import pyarrow as pa
import pytest
import torch
import zstandard

from shards import codecs


@pytest.fixture(scope="module")
def real_states(smol_dir, encoder):
    """Taps 3, 15, 29 of two real ShareGPT conversations (300 + 200 tokens): outliers included."""
    import itertools

    from capture.data import ReadStats, iter_conversations, resolve_dataset
    from capture.engines.hf import HFEngine
    from capture.targets import PRESETS, make_taps

    engine = HFEngine(str(smol_dir), make_taps(PRESETS["smollm2-135m"], (3, 15, 29), "none"), argmax=False)
    convs = itertools.islice(iter_conversations(resolve_dataset("sharegpt"), ReadStats()), 2)
    ids = [encoder.encode(c).input_ids[:n] for c, n in zip(convs, (300, 200))]
    return [t for cap in (engine.forward([x])[0] for x in ids) for t in cap.states.values()]


@pytest.mark.parametrize("codec", ["bf16", "bf16-split"])
def test_lossless_codecs_are_bit_exact(codec, real_states):
    for x in real_states:
        cell = codecs.encode(codec, x)
        y = codecs.decode(codec, pa.py_buffer(cell), *x.shape)
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        assert torch.equal(y.view(torch.int16), x.view(torch.int16))  # every bit, NaN-safe


def test_lossless_on_fp16_and_special_values():
    x = torch.tensor([[0.0, -0.0, 1e-8, 65504.0], [float("inf"), -float("inf"), 3.14, -2.5]], dtype=torch.float16)
    for codec in ("bf16", "bf16-split"):
        y = codecs.decode(codec, codecs.encode(codec, x), 2, 4, torch.float16)
        assert torch.equal(y.view(torch.int16), x.view(torch.int16))


def test_fp8_within_stated_error_with_per_token_scales(real_states):
    cos = torch.nn.functional.cosine_similarity
    mins, means = [], []
    for x in real_states:
        cell = codecs.encode("fp8-e4m3", x)
        t, h = x.shape
        scales = np.frombuffer(cell[: 4 * t], dtype="<f4")
        np.testing.assert_allclose(scales, x.float().abs().amax(dim=1).numpy() / 448.0, rtol=1e-6)
        y = codecs.decode("fp8-e4m3", cell, t, h)
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        c = cos(x.float(), y.float(), dim=-1)
        mins.append(float(c.min()))
        means.append(float(c.mean()))
        # the largest value of every token survives to e4m3 precision (3 mantissa bits: <= 6.25% error)
        amax_in, amax_out = x.float().abs().amax(1), y.float().abs().amax(1)
        assert torch.all((amax_out - amax_in).abs() <= 0.0625 * amax_in + 1e-6)
    assert min(mins) >= 0.999 and np.mean(means) >= 0.9995, (min(mins), np.mean(means))


def test_ratios_on_real_states(real_states):
    raw = sum(x.numel() * 2 for x in real_states)
    size = {c: sum(len(codecs.encode(c, x)) for x in real_states) / raw for c in codecs.CODECS}
    assert size["bf16-split"] < size["bf16"] < 0.85
    assert size["bf16-split"] <= 0.72
    assert size["fp8-e4m3"] <= 0.45


def test_corrupt_cells_raise():
    x = torch.randn(5, 8).to(torch.bfloat16)
    for codec in codecs.CODECS:
        cell = codecs.encode(codec, x)
        with pytest.raises((ValueError, zstandard.ZstdError)):
            codecs.decode(codec, cell[:-3], 5, 8)


def test_recode_round_trip(tmp_path, real_states):
    """A bf16-split run → fp8-e4m3 → bf16: ids unchanged, states within FP8 error, then bit-exact copies."""
    from capture.hashing import token_sha256
    from conftest import capture_inproc
    from shards import format as shard_format
    from shards.manifest import ManifestWriter
    from shards.reader import iter_rows
    from shards.writer import ShardWriter
    from shards.rows import Row

    src = tmp_path / "src"
    header = shard_format.header(
        target={"name": "t"}, taps={"layers": [3, 15, 29], "final": "none"}, columns=["tap_3", "tap_15", "tap_29"],
        hidden_size=576, dtype="bfloat16", codec="bf16-split", argmax=False, chat_template="", chat_template_sha256="",
        tokenizer_sha256="")
    manifest, _ = ManifestWriter.open(src, header)
    writer = ShardWriter(src, shard_format.schema(header), 1 << 30)
    rows = []
    for i in range(2):
        states = dict(zip(["tap_3", "tap_15", "tap_29"], real_states[3 * i : 3 * i + 3]))
        t = states["tap_3"].shape[0]
        ids = np.arange(t, dtype=np.int32)
        rows.append(Row(f"d:{i}", "s", i, ids, np.ones(t, dtype=bool), None, states, token_sha256(ids)))
    for info in writer.write(rows) + writer.close():
        manifest.commit(info)
    manifest.complete({"total_rows": 2})

    fp8, back = tmp_path / "fp8", tmp_path / "back"
    for a, b, codec in ((src, fp8, "fp8-e4m3"), (fp8, back, "bf16")):
        result = capture_inproc("shards", "recode", str(a), str(b), "--codec", codec)
        assert result.exit_code == 0, result.output
        assert "recoded 2 rows" in result.stdout
        assert capture_inproc("shards", "verify", str(b)).exit_code == 0
    original, lossy, copy = (list(iter_rows(d)) for d in (src, fp8, back))
    cos = torch.nn.functional.cosine_similarity
    for o, l, c in zip(original, lossy, copy):
        assert o["sample_id"] == l["sample_id"] == c["sample_id"]
        np.testing.assert_array_equal(o["input_ids"], c["input_ids"])
        for col in ("tap_3", "tap_15", "tap_29"):
            assert torch.equal(o[col], rows[int(o["sample_id"][-1])].states[col])
            assert cos(o[col].float(), l[col].float(), dim=-1).min() >= 0.999
            assert torch.equal(l[col], c[col])
    again = capture_inproc("shards", "recode", str(src), str(fp8), "--codec", "fp8-e4m3")
    assert "recoded 0 rows" in again.stdout and "(2 already there)" in again.stdout
    clash = capture_inproc("shards", "recode", str(src), str(fp8), "--codec", "bf16")
    assert clash.exit_code == 2 and "different codec" in clash.stderr
