"""shards.hf on a real run (the session fixture ``reader_run``: SmolLM2, taps 3/15/27, post-norm final,
argmax): every row of ``hf_dataset(run, states=True)`` and of ``Dataset.from_file(shard)`` with the
``decoder(run)`` transform is bit-exact against ShardStream's sample for the same id; split filter;
layer subsets; errors."""

from __future__ import annotations

import datasets
import pytest
import torch
from helpers import bits

from common.errors import CaptureError
from shards import manifest as manifest_mod
from shards.format import FormatError
from shards.hf import Decoder, decoder, hf_dataset, run_header
from shards.stream import ShardStream

KEYS = {"sample_id", "source", "input_ids", "loss_mask", "argmax", "taps", "final"}


def assert_same(item: dict, sample: dict) -> None:
    """A decoded ``datasets`` item equals a ShardStream sample: same keys, dtypes, shapes and bits."""
    assert set(item) == set(sample)
    assert item["sample_id"] == sample["sample_id"] and item["source"] == sample["source"]
    for key in ("input_ids", "loss_mask", "argmax"):
        if key in sample:
            assert item[key].dtype == sample[key].dtype and torch.equal(item[key], sample[key]), key
    for key in ("taps", "final"):
        if key in sample:
            assert item[key].dtype == sample[key].dtype == torch.bfloat16
            assert item[key].shape == sample[key].shape and torch.equal(bits(item[key]), bits(sample[key])), key


@pytest.fixture(scope="module")
def stream_samples(reader_run) -> dict[str, dict]:
    return {s["sample_id"]: s for s in ShardStream(reader_run)}


def test_hf_dataset_states_decodes_every_row_bit_exact(reader_run, stream_samples):
    ds = hf_dataset(reader_run, states=True)  # the one line
    assert len(ds) == len(stream_samples) >= 30
    assert list(ds["sample_id"]) == ShardStream(reader_run).order()  # manifest order
    for i in range(len(ds)):
        item = ds[i]
        assert set(item) == KEYS
        assert_same(item, stream_samples[item["sample_id"]])
        n = item["input_ids"].shape[0]
        assert item["taps"].shape == (n, 3, 576) and item["final"].shape == (n, 576)
    batch = ds[2:5]  # a slice: a list per key
    assert [t.shape[0] for t in batch["taps"]] == [t.shape[0] for t in batch["input_ids"]]
    for j, sid in enumerate(batch["sample_id"]):
        assert torch.equal(bits(batch["taps"][j]), bits(stream_samples[sid]["taps"]))

    # a subset of taps in a chosen order, no final
    few = hf_dataset(reader_run, states=True, layers=[27, 3], final=False)
    item = few[0]
    assert "final" not in item
    assert torch.equal(bits(item["taps"]), bits(stream_samples[item["sample_id"]]["taps"][:, [2, 0]]))


def test_from_file_with_decoder_transform_bit_exact(reader_run, stream_samples):
    m = manifest_mod.read(reader_run)
    assert len(m.shards) >= 2
    seen = []
    for shard in m.shards:
        path = str(reader_run / shard["path"])
        raw = datasets.Dataset.from_file(path)
        assert set(raw.features) >= {"tap_3", "final"}  # opaque large_binary cells, header dropped
        ds = raw.with_transform(decoder(reader_run))
        for i in range(len(ds)):
            item = ds[i]
            assert set(item) == KEYS
            assert_same(item, stream_samples[item["sample_id"]])
            seen.append(item["sample_id"])
        # the header can come from the shard file itself too
        assert run_header(path) == m.header
        assert_same(raw.with_transform(decoder(path))[0], stream_samples[shard["sample_ids"][0]])
    assert seen == [s for shard in m.shards for s in shard["sample_ids"]]

    # only the columns the decoder reads, a layer subset
    dec = decoder(reader_run, layers=[15], final=False)
    assert isinstance(dec, Decoder) and dec.columns == ("sample_id", "source", "input_ids", "loss_mask", "argmax",
                                                         "tap_15")
    first = m.shards[0]
    item = datasets.Dataset.from_file(str(reader_run / first["path"])).with_transform(dec, columns=list(dec.columns))[0]
    assert set(item) == KEYS - {"final"}
    assert torch.equal(bits(item["taps"]), bits(stream_samples[item["sample_id"]]["taps"][:, [1]]))


def test_split_filter_matches_the_stream(reader_run, stream_samples):
    kw = dict(split="heldout", heldout_fraction=0.3)
    held = hf_dataset(reader_run, states=True, **kw)
    order = ShardStream(reader_run, **kw).order()
    assert 0 < len(held) < len(stream_samples)
    assert [held[i]["sample_id"] for i in range(len(held))] == order
    for i in range(len(held)):
        assert_same(held[i], stream_samples[held[i]["sample_id"]])
    train = hf_dataset(reader_run, states=True, split="train", heldout_fraction=0.3)
    train_ids = {train[i]["sample_id"] for i in range(len(train))}
    assert not train_ids & set(order) and train_ids | set(order) == set(stream_samples)


def test_errors_are_clear(reader_run, tmp_path):
    with pytest.raises(CaptureError, match=r"no tap\(s\) \[4\] in this run; it stored taps \[3, 15, 27\]"):
        decoder(reader_run, layers=[4])
    with pytest.raises(CaptureError, match=r"no tap\(s\) \[4\]"):
        hf_dataset(reader_run, states=True, layers=[3, 4])
    with pytest.raises(CaptureError, match="holds no capture run"):
        decoder(tmp_path)
    not_a_shard = tmp_path / "x.arrow"
    not_a_shard.write_bytes(b"not arrow")
    with pytest.raises(FormatError, match="cannot read a shard header"):
        decoder(not_a_shard)
    with pytest.raises(CaptureError, match="takes no columns"):
        hf_dataset(reader_run, states=True, columns=["sample_id"])
    with pytest.raises(CaptureError, match="pass states=True"):
        hf_dataset(reader_run, layers=[3])
    with pytest.raises(CaptureError, match="unknown split"):
        hf_dataset(reader_run, states=True, split="val")
    plain = hf_dataset(reader_run)  # no state columns: the transform says what is missing
    with pytest.raises(CaptureError, match=r"lacks column\(s\) \['tap_3', 'tap_15', 'tap_27', 'final'\]"):
        plain.with_transform(decoder(reader_run))[0]
