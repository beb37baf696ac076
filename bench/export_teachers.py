"""Recorded check of each export's teacher: do the released trainers, reading `capture export` files,
build the target's own next-token distribution?

Captures the same ShareGPT rows twice with SmolLM2 (`--final pre-norm` and `--final post-norm`, taps
3/15/27, argmax stored), exports the first for speculators and the second for SpecForge, and builds each
trainer's teacher exactly as its released package does:

- speculators 0.9: ``verifier_lm_head(verifier_norm(hidden_states[:, -1]))`` (``Eagle3DraftModel`` with
  the target's norm and lm_head loaded by its own ``load_verifier_weights``), over ``ArrowDataset`` items;
- SpecForge 0.2: ``TargetHead`` (lm_head alone) over ``process_offline_eagle3_sample``'s shifted ``target``.

For each it prints how often the teacher's argmax equals the target's stored greedy token, and the same
for the wrong convention (the final state the other trainer gets): a post-norm state in speculators' slot
(normed twice, what exports before issue 14 wrote) and a pre-norm state as SpecForge's ``hidden_state``
(never normed; the exporter now refuses both). ``KL`` is the mean KL(correct teacher || wrong teacher) in
nats per supervised token.

    .venv/bin/python bench/export_teachers.py --limit 60 > bench/export_teachers.out
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from harness import capture_run, header, smollm2, workdir


def capture(out: Path, final: str, limit: int) -> str:
    return capture_run("--target", "smollm2-135m", "--dataset", "sharegpt", "--limit", str(limit), "--layers",
                       "3,15,27", "--final", final, "--max-tokens", "1024", "--overlength", "truncate", "--out",
                       str(out), "--no-progress")[1]


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    p = torch.log_softmax(p_logits.float(), -1)
    q = torch.log_softmax(q_logits.float(), -1)
    return (p.exp() * (p - q)).sum(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=60)
    args = ap.parse_args()
    header()

    from safetensors import safe_open
    from specforge.data.preprocessing import process_offline_eagle3_sample
    from specforge.modeling.target.target_head import TargetHead
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.data import ArrowDataset
    from transformers import AutoConfig

    from shards.export import export
    from shards.stream import ShardStream

    smol = smollm2()
    tmp = workdir("export-teachers-")
    t0 = time.time()
    cmds = [capture(tmp / "pre", "pre-norm", args.limit), capture(tmp / "post", "post-norm", args.limit)]
    print(f"# export teachers, SmolLM2-135M, ShareGPT first {args.limit} rows ({time.time() - t0:.0f} s to capture)")
    for c in cmds:
        print(f"    {c}")

    verifier = AutoConfig.from_pretrained(smol)
    small = copy.deepcopy(verifier)
    small.num_hidden_layers = 1
    model = Eagle3DraftModel.from_training_args(small, verifier_name_or_path=str(smol), draft_vocab_size=verifier.vocab_size,
                                                norm_before_residual=False, ttt_steps=1, target_layer_ids=[4, 16, 28],
                                                draft_attn_impl="eager")
    head = TargetHead(str(smol))
    with safe_open(str(smol / "model.safetensors"), framework="pt") as f:
        head.fc.weight.data.copy_(f.get_tensor("model.embed_tokens.weight"))

    def spec_teacher(x):
        return model.verifier_lm_head(model.verifier_norm(x.float()))

    def forge_teacher(x):
        return head(x.float())

    stream = {name: {s["sample_id"]: s for s in ShardStream(tmp / name)} for name in ("pre", "post")}
    rows = []
    with torch.no_grad():
        # speculators: the export's last slot (pre-norm), and the post-norm state of the same token
        export(tmp / "pre", tmp / "spec", "speculators")
        ds = ArrowDataset(max_len=8192, datapath=str(tmp / "spec"), on_missing="raise")
        ids = json.loads((tmp / "spec" / "export.json").read_text())["sample_ids"]
        good = bad = n = 0
        div = 0.0
        for i, sid in enumerate(ids):
            item = ds[i]
            argmax = stream["pre"][sid]["argmax"]
            mask = stream["pre"][sid]["loss_mask"]
            right = spec_teacher(item["verifier_last_hidden_states"])[mask]
            wrong = spec_teacher(stream["post"][sid]["final"])[mask]
            good += int((right.argmax(-1) == argmax[mask]).sum())
            bad += int((wrong.argmax(-1) == argmax[mask]).sum())
            div += float(kl(right, wrong).sum())
            n += int(mask.sum())
        rows.append(("speculators 0.9", "pre-norm (export)", good / n, "post-norm (normed twice)", bad / n, div / n, n))

        # SpecForge: the export's hidden_state (post-norm), and the pre-norm state of the same token
        export(tmp / "post", tmp / "sf", "specforge")
        ids = json.loads((tmp / "sf" / "export.json").read_text())["sample_ids"]
        good = bad = n = 0
        div = 0.0
        for path in sorted((tmp / "sf").glob("rows_*/data_*.ckpt")):
            sid = ids[int(path.stem.split("_")[1])]
            eagle = process_offline_eagle3_sample(torch.load(path, weights_only=True), max_len=8192)
            _, target, _ = head.preprocess(eagle["input_ids"], eagle["target"], eagle["loss_mask"])
            argmax = stream["post"][sid]["argmax"][1:]  # target[t] = final[t+1]: the prediction of token t+2
            mask = stream["post"][sid]["loss_mask"][1:]
            right = forge_teacher(target[0, :-1])[mask]
            wrong = forge_teacher(stream["pre"][sid]["final"][1:])[mask]
            good += int((right.argmax(-1) == argmax[mask]).sum())
            bad += int((wrong.argmax(-1) == argmax[mask]).sum())
            div += float(kl(right, wrong).sum())
            n += int(mask.sum())
        rows.append(("specforge 0.2", "post-norm (export)", good / n, "pre-norm (never normed)", bad / n, div / n, n))

    print()
    print("| trainer | final state given | teacher = target argmax | wrong convention | teacher = argmax | KL nats/token | supervised tokens |")
    print("|---|---|---|---|---|---|---|")
    for name, given, g, wrong, b, d, n in rows:
        print(f"| {name} | {given} | {g:.2%} | {wrong} | {b:.2%} | {d:.2f} | {n:,} |")


if __name__ == "__main__":
    main()
