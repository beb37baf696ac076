"""shards.raydata: the Ray Data datasource over a real SmolLM2 run, against the torch reader."""

import pytest
import ray
import torch

from common.errors import CaptureError
from shards import manifest as manifest_mod
from shards.raydata import read_run, samples
from shards.stream import ShardStream

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def local_ray(ray_cluster):
    """This process connected to the session's Ray cluster for the module (conftest.ray_cluster)."""
    with ray_cluster.connect():
        yield


def by_id(items):
    return {s["sample_id"]: s for s in items}


@pytest.mark.parametrize("split", ["all", "heldout"])
def test_ray_dataset_rows_equal_the_torch_reader(reader_run, local_ray, split):
    header = manifest_mod.read(reader_run).header
    ds = read_run(reader_run, split=split, heldout_fraction=0.3)
    got = by_id(s for t in ds.iter_batches(batch_format="pyarrow", batch_size=7) for s in samples(t, header))
    want = by_id(ShardStream(reader_run, split=split, heldout_fraction=0.3))
    assert sorted(got) == sorted(want) and len(want) > (30 if split == "all" else 3)
    for sid, w in want.items():
        g = got[sid]
        assert sorted(g) == sorted(w)
        for k in ("input_ids", "loss_mask", "argmax"):
            assert torch.equal(g[k], w[k])
        for k in ("taps", "final"):  # bf16, compared bit for bit
            assert g[k].dtype == w[k].dtype == torch.bfloat16
            assert torch.equal(g[k].view(torch.int16), w[k].view(torch.int16))
    if split == "all":
        assert ds.count() == sum(s["rows"] for s in manifest_mod.read(reader_run).shards)


def test_not_a_run_is_one_clear_error(tmp_path, local_ray):
    with pytest.raises(CaptureError, match="holds no capture run"):
        read_run(tmp_path)
