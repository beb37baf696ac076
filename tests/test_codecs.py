"""Codec round trips on real SmolLM2 hidden states: lossless codecs bit-exact, lossy ones within their
stated bound (``Codec.bound``) at every value, outlier channels included; a damaged cell of every codec
is an error; recode between every pair of codecs keeps rows, ids and masks."""

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

    from capture.conversation import iter_conversations
    from capture.dataset import ReadStats, resolve_dataset
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


LOSSY = [c for c in codecs.CODECS if not codecs.LOSSLESS[c]]


@pytest.mark.parametrize("codec", LOSSY)
def test_lossy_codecs_within_their_bound_on_real_states(codec, real_states):
    """Every value of every real tap (|h| up to ~1,000s in SmolLM2's outlier channels) within the bound;
    the outlier channels (median |h| over 20x the tensor's) in particular; the decoded dtype and shape."""
    bound = codecs.REGISTRY[codec].bound
    outliers = 0
    for x in real_states:
        y = codecs.decode(codec, codecs.encode(codec, x, check="xxh3_64"), *x.shape, check="xxh3_64")
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        err, b = (y.float() - x.float()).abs(), bound(x.float())
        assert bool((err <= b).all()), float((err - b).max())
        med = x.float().abs().median(dim=0).values
        big = med > 20 * med.median()
        outliers += int(big.sum())
        assert bool((err[:, big] <= b[:, big]).all())
    assert outliers > 0  # the case the block scales exist for is in these states


def test_codecs_keep_nan_and_inf_where_they_can_store_them():
    """bf16-m3 rounds patterns, never turning a NaN into a number or a number into NaN."""
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0, 3.0e38, -0.0]], dtype=torch.bfloat16)
    y = codecs.decode("bf16-m3", codecs.encode("bf16-m3", x), 1, 6)
    assert torch.isnan(y[0, 0]) and y[0, 1] == float("inf") and y[0, 2] == -float("inf") and y[0, 3] == 1.0
    assert torch.equal(y[0, 5].view(torch.int16), x[0, 5].view(torch.int16))


def test_ratios_on_real_states(real_states):
    """Sizes against raw bf16 on these real states (bench/codecs.out has the full table)."""
    raw = sum(x.numel() * 2 for x in real_states)
    size = {c: sum(len(codecs.encode(c, x)) for x in real_states) / raw for c in codecs.CODECS}
    assert size["bf16-split"] < size["bf16"] < 0.85
    assert size["bf16-split"] <= 0.72
    assert size["fp8-e4m3"] <= 0.45
    assert size["int6-b32"] < size["fp8-e4m3"] and size["int4-b32"] < size["fp4-b32"] <= 0.26


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_a_damaged_cell_of_every_codec_is_an_error(codec, real_states):
    """A cut cell fails; with a checksum (XXH3-64 from format 1.4, CRC-32 in 1.3) a flipped bit anywhere fails
    too, also in bytes no zstd frame covers (bf16-split's low bytes, fp8's scales)."""
    x = real_states[0][:40]
    for check, size in (("xxh3_64", 8), ("crc32", 4)):
        cell = codecs.encode(codec, x, check=check)
        assert torch.equal(codecs.decode(codec, cell, *x.shape, check=check).view(torch.int16),
                           codecs.decode(codec, cell[:-size], *x.shape).view(torch.int16))
        with pytest.raises((ValueError, zstandard.ZstdError)):
            codecs.decode(codec, cell[:-size - 3], *x.shape)
        for at in (0, 5, len(cell) // 2, len(cell) - 10, len(cell) - 2):
            damaged = bytearray(cell)
            damaged[at] ^= 0x04
            with pytest.raises(codecs.CellError, match=f"fails its {check}"):
                codecs.decode(codec, bytes(damaged), *x.shape, check=check)
    with pytest.raises(ValueError, match="unknown cell check 'md5'"):
        codecs.encode(codec, x, check="md5")


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_decode_into_a_tap_slice_of_a_sample(codec, real_states):
    """``out=sample[:, l]`` gets the same bits ``decode`` returns, the other taps' slices are untouched, and an
    ``out`` of another shape or dtype is refused (the stream decodes every tap straight into its slice)."""
    x = real_states[0]
    t, h = x.shape
    cell = codecs.encode(codec, x, check="xxh3_64")
    want = codecs.decode(codec, cell, t, h, check="xxh3_64")
    sample = torch.full((t, 3, h), 1.5, dtype=torch.bfloat16)
    got = codecs.decode(codec, cell, t, h, check="xxh3_64", out=sample[:, 1])
    assert got.data_ptr() == sample[:, 1].data_ptr()
    assert torch.equal(sample[:, 1].view(torch.int16), want.view(torch.int16))
    assert bool((sample[:, 0] == 1.5).all()) and bool((sample[:, 2] == 1.5).all())
    with pytest.raises(ValueError, match="out must be a"):
        codecs.decode(codec, cell, t, h, out=torch.empty(t, h + 1, dtype=torch.bfloat16)[:, :h + 1])
    with pytest.raises(ValueError, match="out must be a"):
        codecs.decode(codec, cell, t, h, out=torch.empty(t, h, dtype=torch.float16))
    one = codecs.encode(codec, x[:1])
    for bad in (torch.zeros(1, 2 * h, dtype=torch.bfloat16)[:, ::2],  # one token, H strided
                torch.zeros(1, h, dtype=torch.bfloat16).expand(t, h)):  # rows on top of each other
        with pytest.raises(ValueError, match="out must be a"):
            codecs.decode(codec, one if bad.shape[0] == 1 else cell, bad.shape[0], h, out=bad)


def test_int4_packs_two_codes_a_byte_from_format_1_5_with_the_same_bits(real_states):
    """Packed int4-b32 cells (format 1.5 on: CellLayout.packed) hold two codes a byte, unpacked ones (1.4)
    one a byte; both cells decode to the same bits: the compiled nibble pass (shards.kernels) against
    torch's bf16 ``codes * scales`` of the 1.4 cell, on real states; also where the pass cannot run (a
    block with a non-finite scale, H not a multiple of 32, rows at odd positions, float16 output)."""
    def content(cell):
        return zstandard.frame_content_size(cell)

    inf_row = real_states[1].clone()
    inf_row[3, 40] = float("inf")  # its block's scale is inf: that cell decodes through torch
    cases = [(x, None) for x in real_states] + [(inf_row, None), (real_states[0][:, :100], None),
                                                (real_states[2], "odd")]
    for x, where in cases:
        t, h = x.shape
        nb = -(-h // 32)
        new, old = codecs.encode("int4-b32", x), codecs.encode("int4-b32", x, packed=False)
        assert (content(new), content(old)) == (2 * t * nb + 16 * t * nb, 2 * t * nb + 32 * t * nb)
        assert codecs.encode("int4-b32", x, packed=True) == new
        ref = codecs.decode("int4-b32", old, t, h)
        if where == "odd":  # a [T, H] view whose rows start at odd positions: the 16-bit pass
            got = codecs.decode("int4-b32", new, t, h, out=torch.empty(t, 3, h + 1, dtype=torch.bfloat16)[:, 1, :h])
        else:
            got = codecs.decode("int4-b32", new, t, h)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
        half = codecs.decode("int4-b32", new, t, h, torch.float16)
        assert torch.equal(half.view(torch.int16), ref.to(torch.float16).view(torch.int16))
    # the non-finite block stays non-finite (the inf scale makes its codes NaN), never a number
    assert not bool(torch.isfinite(codecs.decode("int4-b32", codecs.encode("int4-b32", inf_row), *inf_row.shape)[3, 40]))


def test_codec_refuses_a_dtype_it_cannot_store():
    from common.errors import CaptureError

    with pytest.raises(CaptureError, match="codec bf16-m3 stores bfloat16 states, not float16"):
        codecs.check("bf16-m3", "float16")
    assert codecs.check("int4-b32", "float16") == "int4-b32"


def test_recode_round_trip(tmp_path, real_states):
    """A bf16-split run → fp8-e4m3 → bf16: ids unchanged, states within FP8 error, then bit-exact copies."""
    from common.hashing import token_sha256
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


def test_recode_between_every_pair_keeps_rows_ids_and_masks(tmp_path, real_states):
    """Each codec's copy of a 2-row run of real states, recoded into every other codec: sample ids, token
    ids, loss masks and hashes equal the source's; the states equal the source copy's decoded states
    bit for bit when the target is lossless, within the target's bound otherwise; verify passes."""
    from common.hashing import token_sha256
    from shards import format as shard_format
    from shards.manifest import ManifestWriter
    from shards.reader import iter_rows
    from shards.recode import recode
    from shards.rows import Row
    from shards.verify import verify
    from shards.writer import ShardWriter

    cols = ["tap_3", "tap_15", "tap_29"]
    src = tmp_path / "src"
    header = shard_format.header(
        target={"name": "t"}, taps={"layers": [3, 15, 29], "final": "none"}, columns=cols, hidden_size=576,
        dtype="bfloat16", codec="bf16-split", argmax=False, chat_template="", chat_template_sha256="",
        tokenizer_sha256="")
    manifest, _ = ManifestWriter.open(src, header)
    writer = ShardWriter(src, shard_format.schema(header), 1 << 30)
    rows = []
    for i in range(2):
        states = {c: x[:64] for c, x in zip(cols, real_states[3 * i: 3 * i + 3])}
        ids = np.arange(64, dtype=np.int32) + 7 * i
        mask = np.arange(64) % (i + 2) == 0
        rows.append(Row(f"d:{i}", "s", i, ids, mask, None, states, token_sha256(ids)))
    for info in writer.write(rows) + writer.close():
        manifest.commit(info)
    manifest.complete({"total_rows": 2})
    copies = {c: tmp_path / c for c in codecs.CODECS}
    for codec, path in copies.items():
        recode(src, path, codec)
    for a in codecs.CODECS:
        source = list(iter_rows(copies[a]))
        for b in codecs.CODECS:
            if a == b:
                continue
            out = tmp_path / f"{a}-to-{b}"
            assert recode(copies[a], out, b)["rows"] == 2
            assert verify(out).ok
            for want, got, orig in zip(source, iter_rows(out), rows):
                assert got["sample_id"] == want["sample_id"] == orig.sample_id
                np.testing.assert_array_equal(got["input_ids"], orig.input_ids)
                np.testing.assert_array_equal(got["loss_mask"], orig.loss_mask)
                assert got["token_sha256"] == orig.token_sha256
                for c in cols:
                    if codecs.LOSSLESS[b]:
                        assert torch.equal(got[c].view(torch.int16), want[c].view(torch.int16))
                    else:
                        x = want[c].float()
                        assert bool(((got[c].float() - x).abs() <= codecs.REGISTRY[b].bound(x)).all())
