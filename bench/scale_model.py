"""Scale model: GLM-5.3 (TP8 on one 8x B300 node per replica) over 1.69M conversations of ~1,600 tokens.

    python bench/scale_model.py

Nothing here is measured on a B300; the inputs are stated with their sources:

* Prefill throughput. The published figure closest to this target: SGLang on GB200 NVL72, DeepSeek-V3/R1
  (671B total, 37B active; MLA + MoE like GLM-5.3), 2,000-token inputs, BF16 attention + FP8 MoE:
  **18,471 input tokens/s per GPU** (LMSYS blog, "Deploying DeepSeek on GB200 NVL72 with PD and Large
  Scale EP (Part II)", 2025-09-25). B300 has the GB200's FP8 dense rate per GPU (its gain is FP4), so
  the figure carries over per GPU. GLM-5.3 activates ~40B parameters per token (GLM-5: 744B total, 40B
  active), so scale by 37/40. That figure used large-scale expert parallelism and prefill/decode
  disaggregation across nodes; a TP8 vLLM replica on one node is slower, so the model brackets it:
  *optimistic* = the published figure scaled, *conservative* = a third of it.
* Capture overhead: vLLM's extract path ran at 0.98x of plain prefill here (bench/vllm_capture.out).
* Stored bytes: 6 taps (GLM-5.3 preset: 5,19,33,47,61,75, no final) x hidden 6144 x 2 bytes, at each
  codec's measured ratio, plus ids, mask and argmax (9 bytes/token) (bench/codecs.out).
* Compression: one core encodes bf16-split at 615 MB/s of raw bf16 and fp8-e4m3 at 1,329 MB/s, bf16
  (zstd-3) at 1,084 MB/s (bench/codecs.out, this machine's cores; server cores are similar or faster).
* Online (capture.online: rows over Ray, no disk): the producer:trainer node ratio is the published one
  of the closest public run, RedHat's GLM-5.2 DSpark drafter (speculators over Mooncake): 9 vLLM
  producer nodes for 6 trainer nodes, so a trainer node consumes what 1.5 producer nodes capture.
  Nothing here measures a trainer node; the implied consumption follows from that ratio. The object
  store holds at most (queue_units x ranks + 2 x replicas + 1) unit payloads (capture.online), each
  unit_tokens (default 32,768) x the codec's bytes per token.
"""

from __future__ import annotations

from harness import header

CONVERSATIONS = 1_690_000
TOKENS_PER_CONVERSATION = 1_600
GPUS_PER_REPLICA = 8
PUBLISHED_PREFILL_PER_GPU = 18_471  # tokens/s, DeepSeek-V3/R1, GB200, BF16 attention + FP8 MoE
ACTIVE_SCALE = 37 / 40  # DeepSeek-V3 active params / GLM-5.3 active params
CAPTURE_OVERHEAD = 0.98
TAPS, HIDDEN = 6, 6144
SCALARS = 9  # int32 id + bool mask + int32 argmax per token
PRODUCERS_PER_TRAINER = 9 / 6  # RedHat GLM-5.2 DSpark: 9 vLLM producer nodes, 6 trainer nodes
UNIT_TOKENS, QUEUE_UNITS = 32_768, 2  # capture's defaults (RunConfig.unit_tokens, capture.online.start)
CODECS = {  # ratio vs raw bf16, encode MB/s of raw bf16 per core (bench/codecs.out)
    "bf16": (0.782, 1_084),
    "bf16-split": (0.687, 615),
    "fp8-e4m3": (0.430, 1_329),
}


CASES = (("optimistic", 1.0), ("conservative", 1 / 3))  # fraction of the published prefill rate


def node_rate(fraction: float) -> float:
    """Captured tokens/s of one TP8 node at ``fraction`` of the published prefill rate (module docstring)."""
    return PUBLISHED_PREFILL_PER_GPU * ACTIVE_SCALE * fraction * GPUS_PER_REPLICA * CAPTURE_OVERHEAD


def main() -> None:
    header()
    tokens = CONVERSATIONS * TOKENS_PER_CONVERSATION
    raw_per_token = TAPS * HIDDEN * 2
    print(f"GLM-5.3, {TAPS} taps x hidden {HIDDEN}: {raw_per_token / 1e3:.1f} KB/token raw bf16; "
          f"{CONVERSATIONS:,} conversations x {TOKENS_PER_CONVERSATION:,} tokens = {tokens / 1e9:.2f}G tokens")
    print()
    print("| case | tokens/s per node (8 GPUs) | hours for the corpus, 1 node | raw state GB/s | codec | "
          "written GB/s | encode cores |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for case, fraction in CASES:
        rate = node_rate(fraction)
        raw = rate * raw_per_token
        for codec, (ratio, mbps) in CODECS.items():
            written = rate * (raw_per_token * ratio + SCALARS)
            print(f"| {case} | {rate:,.0f} | {tokens / rate / 3600:,.1f} | {raw / 1e9:,.2f} | {codec} | "
                  f"{written / 1e9:,.2f} | {raw / (mbps * 1e6):,.1f} |")
    print()
    print("| codec | KB/token on disk | TB per 1M conversations | TB for the corpus |")
    print("|---|---:|---:|---:|")
    for codec, (ratio, _) in {"raw bf16": (1.0, 0), **CODECS}.items():
        per_token = raw_per_token * ratio + SCALARS
        print(f"| {codec} | {per_token / 1e3:,.1f} | {per_token * 1e6 * TOKENS_PER_CONVERSATION / 1e12:,.1f} | "
              f"{per_token * tokens / 1e12:,.1f} |")
    print()
    print("Online (no disk): per producer node (one TP8 replica) feeding trainer ranks over Ray; object store "
          f"bound for 1 replica and 8 trainer ranks at unit_tokens {UNIT_TOKENS:,}, queue_units {QUEUE_UNITS}")
    print()
    print("| case | codec | network GB/s per producer node | trainer tokens/s per node (9:6) | "
          "trainer nodes per producer node | object store GB, bound |")
    print("|---|---|---:|---:|---:|---:|")
    for case, fraction in CASES:
        rate = node_rate(fraction)
        for codec, (ratio, _) in CODECS.items():
            per_token = raw_per_token * ratio + SCALARS
            units = QUEUE_UNITS * 8 + 2 * 1 + 1
            print(f"| {case} | {codec} | {rate * per_token / 1e9:,.2f} | {rate * PRODUCERS_PER_TRAINER:,.0f} | "
                  f"{1 / PRODUCERS_PER_TRAINER:.2f} | {units * UNIT_TOKENS * per_token / 1e9:,.1f} |")


if __name__ == "__main__":
    main()
