"""How long a compiled vLLM engine takes to start here, and whether vLLM's compile cache is used.

    python bench/vllm_start.py            # run it twice: the second start reads the cache the first wrote
    VLLM_USE_AOT_COMPILE=1 python bench/vllm_start.py   # vLLM's own default on torch >= 2.10

One VLLMEngine (extract path, SmolLM2-135M from the capture cache, taps 0,3,15,29, the settings of
tests/test_vllm.py), then one 199-token prefill. Prints one line: the setting, start and forward seconds.
On CPU the engine defaults VLLM_USE_AOT_COMPILE=0 (capture/engines/vllm.py says why); setting it here wins.
"""

import os
import time

import numpy as np

from harness import header, smollm2, smollm2_taps
from capture.engines.vllm import VLLMEngine


def main() -> None:
    header(env=("VLLM_USE_AOT_COMPILE",))
    asked = os.environ.get("VLLM_USE_AOT_COMPILE", "unset")
    taps = smollm2_taps((0, 3, 15, 29), "post-norm")
    t0 = time.perf_counter()
    eng = VLLMEngine(str(smollm2()), taps, path="extract",
                     engine_args={"max_model_len": 2048, "max_num_batched_tokens": 128})
    t1 = time.perf_counter()
    eng.forward([np.arange(1, 200)])
    t2 = time.perf_counter()
    print(f"VLLM_USE_AOT_COMPILE={asked} (used: {os.environ['VLLM_USE_AOT_COMPILE']})  start {t1 - t0:.1f} s  "
          f"forward {t2 - t1:.1f} s")


if __name__ == "__main__":
    main()
