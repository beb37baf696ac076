"""shards.export and `capture export` on a real run (fixture ``reader_run``): the written files load back
with those projects' keys, shapes, dtypes and layer order, equal to the shard values bit for bit."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import types

import datasets
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import cli
from common.errors import CaptureError
from shards import format as shard_format
from shards import manifest as manifest_mod
from shards.export import export
from shards.manifest import ManifestWriter
from shards.reader import read_table, shard_paths
from shards.rows import state_tensor
from shards.stream import ShardStream
from shards.writer import ShardWriter
from helpers import HEADER, bits, make_rows, real_rows, write_run

TAPS = ("tap_3", "tap_15", "tap_27")


def stored(run) -> dict:
    """sample_id -> (table, row) of the run's shards."""
    out = {}
    for path in shard_paths(run):
        t = read_table(path)
        for i, sid in enumerate(t.column("sample_id").to_pylist()):
            out[sid] = (t, i)
    return out


def test_speculators_round_trip_through_the_cli(prenorm_run, tmp_path):
    out = tmp_path / "spec"
    res = CliRunner().invoke(cli.main, ["export", str(prenorm_run), str(out), "--format", "speculators",
                                        "--split", "heldout", "--heldout-fraction", "0.3", "--no-progress"])
    assert res.exit_code == 0, res.output
    record = json.loads((out / "export.json").read_text())
    held = ShardStream(prenorm_run, split="heldout", heldout_fraction=0.3).order()
    assert record["sample_ids"] == held and res.output.startswith(f"{out}: {len(held)} samples")
    assert [(t["slot"], t["tap"], t["vllm_aux_layer_id"], t["hf_hidden_states_index"], t["sglang_layer_id"])
            for t in record["taps"]] == [(0, 3, 4, 4, 3), (1, 15, 16, 16, 15), (2, 27, 28, 28, 27)]
    assert record["final"] == {"kind": "pre-norm", "from": "final"}
    assert record["trainers"]["speculators"]["target_layer_ids"] == [4, 16, 28]
    assert "speculators: --target-layer-ids 4,16,28" in res.output
    ds = datasets.load_from_disk(str(out))  # what speculators' ArrowDataset opens: tensors, not lists
    assert ds["sample_id"] == held and ds.format["type"] == "torch"
    rows = stored(prenorm_run)
    for i, sid in enumerate(held):
        t, r = rows[sid]
        f = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert set(f) == {"token_ids", "hidden_states"}
        n = t.column("num_tokens")[r].as_py()
        assert f["token_ids"].dtype == torch.int64 and f["token_ids"].tolist() == t.column("input_ids")[r].as_py()
        hs = f["hidden_states"]
        assert hs.dtype == torch.bfloat16 and hs.shape == (n, 4, 576)
        for slot, column in enumerate((*TAPS, "final")):
            assert torch.equal(bits(hs[:, slot]), bits(state_tensor(t, column, r)))
        assert torch.equal(ds[i]["input_ids"], f["token_ids"]) and ds[i]["seq_len"] == n
        assert ds[i]["loss_mask"].dtype == torch.bool and ds[i]["loss_mask"].tolist() == t.column("loss_mask")[r].as_py()

    again = CliRunner().invoke(cli.main, ["export", str(prenorm_run), str(out), "--format", "speculators"])
    assert again.exit_code == 2 and "not empty" in again.output


def test_speculators_takes_the_pre_norm_state_from_tap_l_minus_1(tmp_path):
    """A run without a pre-norm final but with a tap at layer L-1 (helpers' header: 4 layers, taps 1 and 3,
    post-norm final): slot 0 is tap 1, the last slot tap 3 (not repeated among the aux slots)."""
    run = tmp_path / "run"
    rows = make_rows(3, 4)
    write_run(run, [rows])
    summary = export(run, tmp_path / "out", "speculators")
    record = json.loads((tmp_path / "out" / "export.json").read_text())
    assert [t["tap"] for t in record["taps"]] == [1] and record["final"] == {"kind": "pre-norm", "from": "tap_3"}
    assert summary["trainers"]["speculators"]["target_layer_ids"] == [2]
    by_id = {r.sample_id: r for r in rows}
    for i, sid in enumerate(record["sample_ids"]):
        hs = load_file(str(tmp_path / "out" / "hidden_states" / f"hs_{i}.safetensors"))["hidden_states"]
        assert hs.shape == (by_id[sid].num_tokens, 2, HEADER.hidden_size)
        assert torch.equal(bits(hs[:, 0]), bits(by_id[sid].states["tap_1"]))
        assert torch.equal(bits(hs[:, 1]), bits(by_id[sid].states["tap_3"]))


def test_speculators_release_reads_the_export_and_its_teacher_is_the_targets_argmax(prenorm_run, reader_run,
                                                                                   smol_dir, tmp_path):
    """speculators 0.9 from PyPI: its ArrowDataset reads the export, its EAGLE-3 model's teacher
    ``verifier_lm_head(verifier_norm(last slot))`` reproduces the stored argmax, and one training step runs
    on CPU. The same teacher over a post-norm final (normed twice, what exports before this fix wrote) does
    not: the check can tell the two apart."""
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn
    from transformers import AutoConfig

    out = tmp_path / "spec"
    summary = export(prenorm_run, out, "speculators")
    ds = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise")
    assert len(ds) == summary["samples"]
    verifier = AutoConfig.from_pretrained(smol_dir)
    small = copy.deepcopy(verifier)
    small.num_hidden_layers = 1  # a one-layer draft; verifier weights (norm, lm_head) are the real target's
    model = Eagle3DraftModel.from_training_args(
        small, verifier_name_or_path=str(smol_dir), draft_vocab_size=verifier.vocab_size,
        target_layer_ids=summary["trainers"]["speculators"]["target_layer_ids"], norm_before_residual=False,
        ttt_steps=2, draft_attn_impl="eager")  # FlexAttention has no backward on CPU
    assert model.fc.in_features == 3 * 576

    def teacher(last: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model.verifier_lm_head(model.verifier_norm(last.float())).argmax(-1)

    rows = stored(prenorm_run)
    agree = total = 0
    for i, sid in enumerate(json.loads((out / "export.json").read_text())["sample_ids"]):
        item = ds[i]
        t, r = rows[sid]
        n = t.column("num_tokens")[r].as_py()
        assert item["hidden_states"].shape == (n, 3 * 576) and item["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(bits(item["verifier_last_hidden_states"]), bits(state_tensor(t, "final", r)))
        assert item["input_ids"].tolist() == t.column("input_ids")[r].as_py()
        argmax = torch.tensor(t.column("argmax")[r].as_py())
        agree += int((teacher(item["verifier_last_hidden_states"]) == argmax).sum())
        total += n
    assert agree / total >= 0.95, (agree, total)  # bf16 states: near-ties may flip (measured 98%)

    twice = stored(reader_run)  # post-norm final states, normed again by the teacher
    wrong = [(teacher(state_tensor(t, "final", r)) == torch.tensor(t.column("argmax")[r].as_py())).float().mean()
             for t, r in list(twice.values())[:8]]
    assert float(torch.stack(wrong).mean()) < 0.8

    collate = CollateFn(max_len=512, hidden_size=576, num_target_layers=3, dtype=torch.bfloat16,
                        preprocess=shift_batch)
    batch = collate([ds[0], ds[1]])
    model = model.to(torch.bfloat16)
    keys = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")
    _, loss, _ = model(**{k: batch[k] for k in keys}, ttt_steps=2, loss_config=resolve_loss_config("kl_div", "eager"))
    loss.backward()
    assert torch.isfinite(loss) and model.fc.weight.grad.abs().sum() > 0


def test_speculators_refuses_a_post_norm_only_run(reader_run, tmp_path):
    with pytest.raises(CaptureError, match="needs the pre-norm final state.*--final pre-norm"):
        export(reader_run, tmp_path / "x", "speculators")
    assert not (tmp_path / "x").exists()


def test_specforge_round_trip(reader_run, tmp_path):
    out = tmp_path / "sf"
    summary = export(reader_run, out, "specforge")
    order = ShardStream(reader_run).order()
    assert summary["samples"] == len(order) and summary["tokens"] == sum(
        s["tokens"] for s in manifest_mod.read(reader_run).shards)
    rows = stored(reader_run)
    for i, sid in enumerate(order):
        t, r = rows[sid]
        d = torch.load(out / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        assert set(d) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state", "hidden_states"}
        n = t.column("num_tokens")[r].as_py()
        assert d["input_ids"].dtype == torch.int64 and d["input_ids"].tolist() == t.column("input_ids")[r].as_py()
        assert d["loss_mask"].dtype == torch.int64 and d["loss_mask"].tolist() == [
            int(x) for x in t.column("loss_mask")[r].as_py()]
        aux = d["aux_hidden_state"]
        assert aux.dtype == torch.bfloat16 and aux.shape == (1, n, 3 * 576)
        for l, column in enumerate(TAPS):  # aux[..., l*H:(l+1)*H] is tap l in header order
            assert torch.equal(bits(aux[0, :, l * 576:(l + 1) * 576]), bits(state_tensor(t, column, r)))
        assert torch.equal(bits(d["hidden_states"]), bits(aux[0]))  # DFlash/DSpark's key, [T, L*H]
        assert d["hidden_state"].shape == (1, n, 576)
        assert torch.equal(bits(d["hidden_state"][0]), bits(state_tensor(t, "final", r)))
    # hidden_states shares aux_hidden_state's storage: the file holds the taps once
    f = out / "rows_0-2000" / "data_0.ckpt"
    n0 = stored(reader_run)[order[0]][0].column("num_tokens")[stored(reader_run)[order[0]][1]].as_py()
    assert f.stat().st_size < n0 * 4 * 576 * 2 + 64 * 1024


def test_specforge_release_reads_the_export_and_its_teacher_is_the_targets_argmax(reader_run, prenorm_run,
                                                                                 smol_dir, tmp_path):
    """specforge 0.2 from PyPI: its OfflineManifestReader lists the files, its EAGLE-3 and DFlash sample
    normalizers read them, and its TargetHead (lm_head alone, with the target's weights) over the shifted
    ``target`` reproduces the stored argmax. A pre-norm run is refused (its TargetHead has no norm)."""
    from safetensors import safe_open
    from specforge.data.preprocessing import process_offline_dflash_sample, process_offline_eagle3_sample
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    out = tmp_path / "sf"
    export(reader_run, out, "specforge", layers=[3, 15, 27])
    refs = OfflineManifestReader(str(out)).read()
    assert len(refs) == len(ShardStream(reader_run))
    head = TargetHead(str(smol_dir))
    with safe_open(str(smol_dir / "model.safetensors"), framework="pt") as f:  # tied: lm_head = embed_tokens
        head.fc.weight.data.copy_(f.get_tensor("model.embed_tokens.weight"))
    rows = stored(reader_run)
    order = json.loads((out / "export.json").read_text())["sample_ids"]
    agree = total = 0
    for ref in refs:
        raw = torch.load(ref.feature_store_uri[len("file://"):], weights_only=True)
        # the reader sorts paths as strings: file_index is its own count, the name holds our index
        i = int(ref.feature_store_uri.rsplit("data_", 1)[1].split(".")[0])
        t, r = rows[order[i]]
        eagle = process_offline_eagle3_sample(dict(raw), max_len=4096)
        assert eagle["hidden_state"].shape == (1, t.column("num_tokens")[r].as_py(), 3 * 576)
        ids, target, mask = head.preprocess(eagle["input_ids"], eagle["target"], eagle["loss_mask"])
        with torch.no_grad():
            logits = head(target.float())  # [1, T, V]; position t holds lm_head(final[t+1])
        argmax = torch.tensor(t.column("argmax")[r].as_py())
        agree += int((logits[0, :-1].argmax(-1) == argmax[1:]).sum())
        total += len(argmax) - 1
        dflash = process_offline_dflash_sample(dict(raw), max_len=4096)
        assert torch.equal(bits(dflash["hidden_states"][0]), bits(eagle["hidden_state"][0]))
    assert agree / total >= 0.95, (agree, total)
    with pytest.raises(CaptureError, match="specforge files need the post-norm final state"):
        export(prenorm_run, tmp_path / "pre", "specforge")


def test_specforge_warns_when_eagle3_cannot_take_the_taps(reader_run, tmp_path):
    res = CliRunner().invoke(cli.main, ["export", str(reader_run), str(tmp_path / "two"), "--format", "specforge",
                                        "--layers", "15,27", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "warning: SpecForge's EAGLE-3 draft takes exactly 3 aux layers; this export has 2" in res.output
    record = json.loads((tmp_path / "two" / "export.json").read_text())
    assert [t["tap"] for t in record["taps"]] == [15, 27] and record["warnings"]
    assert record["trainers"]["specforge"] == {**record["trainers"]["specforge"], "eagle3_ready": False,
                                               "eagle_aux_hidden_state_layer_ids": [15, 27]}
    d = torch.load(tmp_path / "two" / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    assert d["aux_hidden_state"].shape[-1] == 2 * 576
    bad = CliRunner().invoke(cli.main, ["export", str(reader_run), str(tmp_path / "bad"), "--format", "specforge",
                                        "--layers", "4"])
    assert bad.exit_code == 2 and "no tap(s) [4]" in bad.output
    dup = CliRunner().invoke(cli.main, ["export", str(reader_run), str(tmp_path / "dup"), "--format", "specforge",
                                        "--layers", "3,3,15"])
    assert dup.exit_code == 2 and "names a tap twice" in dup.output and not (tmp_path / "dup").exists()


def test_export_refuses_bad_input(reader_run, tmp_path):
    header = manifest_mod.read(reader_run).header
    header = header.replace(columns=list(TAPS), taps={**header.taps, "final": None})
    no_final = tmp_path / "no-final"
    mw, _ = ManifestWriter.open(no_final, header)
    sw = ShardWriter(no_final, shard_format.schema(header), target_bytes=1 << 40)
    rows = [dataclasses.replace(r, states={c: r.states[c] for c in TAPS}) for r in real_rows(reader_run)[:2]]
    sw.write(rows)
    mw.commit(sw.close()[0])
    with pytest.raises(CaptureError, match="need the post-norm final state.*stored no final state"):
        export(no_final, tmp_path / "x", "specforge")
    with pytest.raises(CaptureError, match="needs the pre-norm final state.*stored no final state"):
        export(no_final, tmp_path / "x", "speculators")
    with pytest.raises(CaptureError, match="unknown export format"):
        export(reader_run, tmp_path / "y", "eagle")
    res = CliRunner().invoke(cli.main, ["export", str(tmp_path / "nothing"), str(tmp_path / "z"), "--format", "specforge"])
    assert res.exit_code == 2 and "holds no capture run" in res.output


def test_speculators_reads_the_run_in_place_through_the_capture_backend(prenorm_run, smol_dir, tmp_path):
    """issue 32: `capture export --no-states` writes the index alone; speculators' own ArrowDataset with the
    `capture` hidden-states backend yields, item for item, bit for bit, what it yields from the exported
    files, and one training step of its EAGLE-3 draft runs on a batch from it. Refusals: other
    --target-layer-ids, a verifier with another tokenizer, an index whose run lost a sample."""
    from hs_connectors import HiddenStatesBackend
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    from shards.speculators import BACKEND, RunTransfer, check_trainer

    files, index = tmp_path / "files", tmp_path / "index"
    export(prenorm_run, files, "speculators")
    res = CliRunner().invoke(cli.main, ["export", str(prenorm_run), str(index), "--format", "speculators",
                                        "--no-states", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert not (index / "hidden_states").exists()
    size = sum(p.stat().st_size for p in index.rglob("*") if p.is_file())
    assert size * 20 < sum(p.stat().st_size for p in (files / "hidden_states").iterdir())  # the index is small

    args = types.SimpleNamespace(target_layer_ids=[4, 16, 28], verifier_name_or_path=str(smol_dir))
    transfer = HiddenStatesBackend.registry[BACKEND].from_train_args(args, str(index))
    from_files = ArrowDataset(max_len=4096, datapath=str(files), on_missing="raise")
    in_place = ArrowDataset(max_len=4096, datapath=str(index), transfer=transfer, on_missing="raise")
    assert len(in_place) == len(from_files) > 0 and in_place.approx_lengths == from_files.approx_lengths
    for i in range(len(from_files)):
        a, b = from_files[i], in_place[i]
        assert set(a) == set(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(bits(a[k]) if a[k].is_floating_point() else a[k],
                                                             bits(b[k]) if b[k].is_floating_point() else b[k]), (i, k)

    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.core import Eagle3DraftModel
    from transformers import AutoConfig

    verifier = AutoConfig.from_pretrained(smol_dir)
    small = copy.deepcopy(verifier)
    small.num_hidden_layers = 1
    model = Eagle3DraftModel.from_training_args(
        small, verifier_name_or_path=str(smol_dir), draft_vocab_size=verifier.vocab_size,
        target_layer_ids=transfer.target_layer_ids, norm_before_residual=False, ttt_steps=2, draft_attn_impl="eager")
    rows, agree, total = stored(prenorm_run), 0, 0
    for i, sid in enumerate(transfer.sample_ids):  # its teacher over the in-place last slot: the stored argmax
        t, r = rows[sid]
        with torch.no_grad():
            teacher = model.verifier_lm_head(model.verifier_norm(in_place[i]["verifier_last_hidden_states"].float()))
        agree += int((teacher.argmax(-1) == torch.tensor(t.column("argmax")[r].as_py())).sum())
        total += t.column("num_tokens")[r].as_py()
    assert agree / total >= 0.95, (agree, total)
    collate = CollateFn(max_len=512, hidden_size=576, num_target_layers=3, dtype=torch.bfloat16, preprocess=shift_batch)
    batch = collate([in_place[0], in_place[1]])
    model = model.to(torch.bfloat16)
    keys = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")
    _, loss, _ = model(**{k: batch[k] for k in keys}, ttt_steps=2, loss_config=resolve_loss_config("kl_div", "eager"))
    loss.backward()  # speculators' own training step on a batch read in place
    assert torch.isfinite(loss) and model.fc.weight.grad.abs().sum() > 0

    with pytest.raises(CaptureError, match=r"--target-layer-ids \[4, 16\] but the index holds the run's taps as vLLM ids \[4, 16, 28\]"):
        check_trainer(transfer, [4, 16], None)
    other = tmp_path / "tok"
    other.mkdir()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    tok.add_tokens(["<a-token-the-run-never-saw>"])
    tok.save_pretrained(other)
    with pytest.raises(CaptureError, match="has another tokenizer"):
        check_trainer(transfer, None, str(other))
    record = json.loads((index / "export.json").read_text())
    record["sample_ids"][0] = "not-in-the-run:0"
    (index / "export.json").write_text(json.dumps(record))
    with pytest.raises(CaptureError, match=r"no longer holds 1 sample\(s\) of this index, e.g. not-in-the-run:0"):
        RunTransfer(index)


def test_specforge_reads_the_run_in_place_through_stub_files_and_its_shim(reader_run, smol_dir, tmp_path):
    """issue 32: `capture export --format specforge --no-states` writes ~300-byte stubs; with the shim
    installed, SpecForge's own OfflineManifestReader lists them and its load_feature_file gives, file for
    file, bit for bit, the tensors of the exported files; its EAGLE-3 normalizer and TargetHead reproduce
    the stored argmax; its own EAGLE-3 training step on batches from the stubs gives, step for step, the
    losses and weights it gives on the exported files. Without the shim a stub is what it is (the shim changes
    nothing else)."""
    from safetensors import safe_open
    from specforge.data.preprocessing import process_offline_eagle3_sample
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.data_plane import feature_store
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    from shards.specforge import check_trainer, install

    files, stubs = tmp_path / "files", tmp_path / "stubs"
    export(reader_run, files, "specforge", layers=[3, 15, 27])
    res = CliRunner().invoke(cli.main, ["export", str(reader_run), str(stubs), "--format", "specforge", "--layers",
                                        "3,15,27", "--no-states", "--no-progress"])
    assert res.exit_code == 0, res.output
    names = sorted(p.relative_to(files) for p in files.rglob("*.ckpt"))
    assert names == sorted(p.relative_to(stubs) for p in stubs.rglob("*.ckpt"))
    assert max(p.stat().st_size for p in stubs.rglob("*.ckpt")) < 2048
    original = feature_store.load_feature_file
    assert "capture_in_place" in original(str(stubs / names[0]))  # no shim: a stub
    install()
    try:
        refs = OfflineManifestReader(str(stubs)).read()
        assert len(refs) == len(names)
        head = TargetHead(str(smol_dir))
        with safe_open(str(smol_dir / "model.safetensors"), framework="pt") as f:
            head.fc.weight.data.copy_(f.get_tensor("model.embed_tokens.weight"))
        rows, order = stored(reader_run), json.loads((stubs / "export.json").read_text())["sample_ids"]
        agree = total = 0
        for ref in refs:
            path = ref.feature_store_uri[len("file://"):]
            got = feature_store.load_feature_file(path)  # what its LocalFeatureStore calls
            want = torch.load(str(files / os.path.relpath(path, stubs)), weights_only=True)
            assert set(got) == set(want)
            for k in want:
                assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
                assert torch.equal(bits(got[k]) if got[k].is_floating_point() else got[k],
                                   bits(want[k]) if want[k].is_floating_point() else want[k]), (path, k)
            i = int(path.rsplit("data_", 1)[1].split(".")[0])
            t, r = rows[order[i]]
            eagle = process_offline_eagle3_sample(dict(got), max_len=4096)
            _, target, _ = head.preprocess(eagle["input_ids"], eagle["target"], eagle["loss_mask"])
            with torch.no_grad():
                logits = head(target.float())
            argmax = torch.tensor(t.column("argmax")[r].as_py())
            agree += int((logits[0, :-1].argmax(-1) == argmax[1:]).sum())
            total += len(argmax) - 1
        assert agree / total >= 0.95, (agree, total)
        with pytest.raises(CaptureError, match=r"aux_hidden_state_layer_ids \[3, 15\] but the stubs .* hold the run's taps \[3, 15, 27\]"):
            check_trainer(str(stubs), [3, 15], None)
        other = tmp_path / "tok"
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(smol_dir)
        tok.add_tokens(["<a-token-the-run-never-saw>"])
        tok.save_pretrained(other)
        with pytest.raises(CaptureError, match="has another tokenizer"):
            check_trainer(str(stubs), [3, 15, 27], str(other))
        check_trainer(str(stubs), [3, 15, 27], str(smol_dir))  # the run's own target and taps: fine
        # SpecForge's own EAGLE-3 training step (its loader, normalizer, collator, strategy, model) on batches
        # from the stubs: the same losses and draft weights, bit for bit, as on batches from the exported files
        from_stubs, from_files = specforge_steps(stubs, smol_dir, head), specforge_steps(files, smol_dir, head)
        assert from_stubs[0] == from_files[0] and all(torch.isfinite(torch.tensor(from_stubs[0])))
        assert from_stubs[0][2] < from_stubs[0][0]  # it learns: the first batch again, 2 steps later
        assert all(torch.equal(a, b) for a, b in zip(from_stubs[1], from_files[1]))
    finally:
        for name in ("feature_store", "offline_reader", "disagg_ingest", "disaggregated"):
            module = sys.modules.get(f"specforge.runtime.data_plane.{name}")
            if module is not None and hasattr(module, "load_feature_file"):
                module.load_feature_file = original


def specforge_steps(folder, smol_dir, head) -> tuple[list[float], list[torch.Tensor]]:
    """3 optimizer steps of SpecForge 0.2's offline EAGLE-3 training, built from its own parts as its trainer
    assembles them (specforge.algorithms.eagle3: OfflineManifestReader, LocalFeatureStore + FeatureDataLoader
    with the EAGLE-3 normalizer and collator, a 1-layer LlamaForCausalLMEagle3 draft in OnlineEagle3Model
    under Eagle3TrainStrategy with the frozen TargetHead, AdamW; in bf16 where this CPU computes it natively,
    else float32: emulated bf16 took 462 s on an AVX2-only CPU, bench/test_suite.out) on the folder's first 4 samples cut at 128
    tokens, 2 per batch: the first batch, the second, the first again. Its KL loss is a Triton kernel (GPU only); on CPU the step uses the same module's reference
    implementation, ``specforge.core.loss._compute_loss``. Returns the losses and the trained weights."""
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer, build_offline_reader
    from specforge.core import loss as specforge_loss
    from specforge.modeling.auto import AutoDraftModel
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.training.strategies.base import Eagle3TrainStrategy
    from transformers import AutoConfig, LlamaConfig

    from capture.engines import compute_dtype

    reference = specforge_loss._compute_loss._torchdynamo_orig_callable  # under its @torch.compile
    triton = eagle3_model.LogSoftmaxLoss
    eagle3_model.LogSoftmaxLoss = types.SimpleNamespace(apply=reference)
    try:
        refs = build_offline_reader(str(folder), run_id="t", ttt_length=2, max_len=128).read()[:4]
        loader = FeatureDataLoader(LocalFeatureStore(), refs=refs, batch_size=2, collate_fn=build_offline_collator(),
                                   per_sample_transform=build_offline_normalizer(128), ack=False)
        cfg = LlamaConfig(**{k: v for k, v in AutoConfig.from_pretrained(smol_dir).to_dict().items()
                             if k != "architectures"})
        cfg.update({"num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"],
                    "draft_vocab_size": cfg.vocab_size, "target_hidden_size": cfg.hidden_size})
        torch.manual_seed(0)
        draft = AutoDraftModel.from_config(cfg, attention_backend="sdpa")
        draft.load_embedding(str(smol_dir))
        draft.freeze_embedding()
        dtype = getattr(torch, compute_dtype("auto", "bfloat16"))
        model = eagle3_model.OnlineEagle3Model(draft_model=draft, length=2, attention_backend="sdpa").to(dtype)
        step = Eagle3TrainStrategy(model, target_head=head.to(dtype))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        losses = []
        first, second = loader
        for batch in (first, second, first):
            # the stored bf16 states, cast to a float32 model's dtype (a no-op in bf16)
            batch = dataclasses.replace(batch, tensors={k: v.to(dtype) if v.is_floating_point() else v
                                                         for k, v in batch.tensors.items()})
            out = step.forward_loss(batch)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.detach().item())
        return losses, [p.detach().clone() for p in model.parameters() if p.requires_grad]
    finally:
        eagle3_model.LogSoftmaxLoss = triton
