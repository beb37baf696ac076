"""Disk per 1M conversations of 1,600 tokens for GLM-5.3 (hidden 6144, taps 5,19,33,47,61,75) and
GLM-5.3-Flash (hidden 4096, taps 5,14,24,33,42), their preset taps with and without the final state, at
each codec's ratio measured on real SmolLM2 states (shards.codecs.RATIO, see shards/codecs.py).

    python bench/disk_model.py
"""

from harness import header
from capture.targets import PRESETS
from shards import codecs

TOKENS = 1_000_000 * 1_600
IDS_MASK_ARGMAX = 4 + 1 + 4  # bytes per token outside the states (mask bits are padded to a byte here)

header()
print(f"per 1M conversations x 1,600 tokens = {TOKENS / 1e9:.1f}G tokens (TB = 1e12 B)")
for name in ("glm-5.3", "glm-5.3-flash"):
    t = PRESETS[name]
    taps = len(t.default_taps)
    print(f"\n{name}: hidden {t.hidden_size}, taps {','.join(map(str, t.default_taps))}\n")
    print(f"| codec | ratio | {taps} taps: KB/token | {taps} taps: TB | {taps} taps + final: KB/token "
          f"| {taps} taps + final: TB |")
    print("|---|---|---|---|---|---|")
    for codec in ("raw bf16", *sorted(codecs.CODECS, key=lambda c: -codecs.RATIO[c])):
        ratio = 1.0 if codec == "raw bf16" else codecs.RATIO[codec]
        cells = []
        for columns in (taps, taps + 1):
            per_token = columns * t.hidden_size * 2 * ratio + IDS_MASK_ARGMAX
            cells += [f"{per_token / 1e3:.1f}", f"{per_token * TOKENS / 1e12:.1f}"]
        print(f"| {codec} | {ratio:.2f}x | " + " | ".join(cells) + " |")
