"""Disk per 1M conversations of 1,600 tokens for GLM-5.3 (hidden 6144, taps 5,19,33,47,61,75), at each
codec's ratio measured on real states (shards.codecs.RATIO, from bench/codecs.out).

    python bench/disk_model.py
"""

from shards import codecs

HIDDEN, TAPS, TOKENS = 6144, 6, 1_000_000 * 1_600
IDS_MASK_ARGMAX = 4 + 1 + 4  # bytes per token outside the states (mask bits are padded to a byte here)

print(f"GLM-5.3, hidden {HIDDEN}, per 1M conversations x 1,600 tokens = {TOKENS / 1e9:.1f}G tokens (TB = 1e12 B)")
print()
print("| codec | ratio | 6 taps: KB/token | 6 taps: TB | 6 taps + final: KB/token | 6 taps + final: TB |")
print("|---|---|---|---|---|---|")
for codec in ("raw bf16", *codecs.CODECS):
    ratio = 1.0 if codec == "raw bf16" else codecs.RATIO[codec]
    cells = []
    for columns in (TAPS, TAPS + 1):
        per_token = columns * HIDDEN * 2 * ratio + IDS_MASK_ARGMAX
        cells += [f"{per_token / 1e3:.1f}", f"{per_token * TOKENS / 1e12:.1f}"]
    print(f"| {codec} | {ratio:.2f}x | " + " | ".join(cells) + " |")
