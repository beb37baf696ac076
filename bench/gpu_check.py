"""The prepared GPU check (run by ``bench/gpu_check.sh``; one NVIDIA GPU, no network, a few minutes).

Builds three random-weight targets from configs (no download): a SmolLM2-sized llama (30 layers, hidden
576; the tiny byte-level tokenizer of tests/glm_fixtures.py, vocabulary 512) and the tiny GLM fixtures
(``glm_moe_dsa``: MLA + DSA indexer + MoE; ``glm5_next``: KDA + MLA, 4 residual streams). For each:

1. ``capture run --device DEVICE`` (the HF engine on the GPU, in process) over synthetic conversations;
2. ``capture shards check`` of its rows against a float32 HF forward on the CPU (provenance/check.py);
   for the GLM fixtures also against a bf16 one, which decides: their discrete routing (MoE top-k, the DSA
   indexer's top-k) flips between arithmetics on random weights (on this CPU, float32 against the bf16
   capture: per-token cosine min 0.59-0.90), so only their own arithmetic tells a wrong tensor from a
   flipped route;

then, for the llama, tokens/s of the capture engine (hooks, argmax, states copied to the CPU) against a
plain forward (``model(ids).logits.argmax(-1)``) of the same records on the same device, one record per
forward, median of 3 interleaved passes. ``--device cpu`` runs the same on a CPU (how it is tested here).

    python bench/gpu_check.py [--device cuda] [--work DIR] [--conversations 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from harness import REPO, encoded, interleaved, workdir

sys.path.insert(0, str(REPO / "tests"))  # glm_fixtures


def llama_folder(out: Path) -> Path:
    """A SmolLM2-135M-shaped llama with seeded random bf16 weights, the fixtures' tokenizer and GLM chat
    template (its end-of-turn ids in the generation config, as the GLM fixtures)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from glm_fixtures import VOCAB, build_tokenizer

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok = build_tokenizer()
    tok.save_pretrained(out)
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]  # as GLM's
    GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id).save_pretrained(out)
    return out


def conversations(path: Path, n: int) -> Path:
    """``n`` synthetic ShareGPT-style conversations of ~100-1,500 tokens (the fixtures' sentences)."""
    from glm_fixtures import _CORPUS

    rows = []
    for i in range(n):
        turns = []
        for t in range(1 + i % 3):
            q = " ".join(_CORPUS[(i + t + j) % len(_CORPUS)] for j in range(1 + (i * 7 + t) % 6))
            a = " ".join(_CORPUS[(i * 3 + t + j) % len(_CORPUS)] for j in range(2 + (i * 5 + t) % 9))
            turns += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        rows.append({"conversations": turns})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def capture_and_check(name: str, folder: Path, data: Path, work: Path, device: str, layers: tuple,
                      references: tuple[str, ...], argmax: bool) -> dict:
    """Capture ``folder`` on ``device``, then ``shards check`` against each reference dtype on the CPU; the
    verdict is the last reference's."""
    import capture
    from provenance.check import check, markdown

    out = work / f"run-{folder.name}"
    t = time.perf_counter()
    s = capture.run(capture.RunConfig(out=str(out), target=str(folder), dataset=str(data), layers=layers,
                                      final="post-norm", device=device, argmax=argmax, progress=False))
    seconds = time.perf_counter() - t
    print(f"\n## {name}: {s.committed_rows} rows, {s.committed_tokens:,} tokens captured on {device} in "
          f"{seconds:.1f} s (engine {s.timings['engine']:.1f} s)")
    for dtype in references:
        report = check(out, rows=4, dtype=dtype)
        print("\n" + markdown(report))
    return {"name": name, "ok": report.ok, "rows": s.committed_rows, "tokens": s.committed_tokens}


def throughput(folder: Path, data: Path, device: str, passes: int = 3) -> None:
    """Capture engine vs plain forward, tokens/s on ``device`` (module docstring)."""
    from transformers import AutoModelForCausalLM

    from capture.engines.hf import HFEngine
    from capture.targets import make_taps, resolve_target

    ids = [r.input_ids for _, r in encoded(folder, data) if not isinstance(r, str)]
    tokens = sum(len(x) for x in ids)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    engine = HFEngine(str(folder), make_taps(resolve_target(str(folder)), (3, 15, 27), "post-norm"),
                      device_map=device if device == "cuda" else None)
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()

    def run_plain():
        with torch.inference_mode():
            for x in ids:
                plain(torch.from_numpy(np.asarray(x, dtype=np.int64))[None].to(device)).logits[0].argmax(-1).cpu()
        sync()

    def run_capture():
        engine.forward(ids[:1])  # one record per forward, as the engine does for every batch
        for x in ids[1:]:
            engine.forward([x])
        sync()

    run_plain(), run_capture()  # warm-up: kernels, allocator (each ends synchronized)
    times, _ = interleaved({"plain forward": run_plain, "capture engine": run_capture}, passes)
    rate = {k: tokens / statistics.median(v) for k, v in times.items()}
    print(f"\n## throughput on {device}: {len(ids)} records, {tokens:,} tokens, one record per forward, "
          f"median of {passes} interleaved passes\n")
    print("| path | tokens/s |\n|---|---|")
    for k, v in rate.items():
        print(f"| {k} | {v:,.0f} |")
    print(f"\ncapture / plain forward: {rate['capture engine'] / rate['plain forward']:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--work", type=Path)
    ap.add_argument("--conversations", type=int, default=24)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); --device cpu runs it on the CPU")
    from glm_fixtures import build_fixture

    work = workdir("gpu-check-", args.work)
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"# gpu_check on {where}: torch {torch.__version__}, work {work}")
    data = conversations(work / "conversations.jsonl", args.conversations)
    llama = llama_folder(work / "llama-smollm2-sized")
    # random weights: near-uniform logits make argmax a coin toss between near-ties, so no argmax here
    results = [capture_and_check("llama (SmolLM2-sized, random)", llama, data, work, args.device, (3, 15, 27),
                                 ("float32",), argmax=False)]
    for arch in ("glm_moe_dsa", "glm5_next"):
        # discrete routing (MoE top-k, the DSA indexer's top-k) flips between arithmetics on random tiny
        # weights: a float32 reference is printed, the verdict is against the capture's own (bf16)
        folder = build_fixture(arch, work / arch)
        results.append(capture_and_check(f"{arch} (tiny, random)", folder, data, work, args.device, (1, 2, 3),
                                         ("float32", "bfloat16"), argmax=True))
    throughput(llama, data, args.device)
    print("\n" + ("OK: every run passed shards check" if all(r["ok"] for r in results)
                  else "FAILED: " + ", ".join(r["name"] for r in results if not r["ok"])))
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
