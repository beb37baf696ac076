"""Shared fixtures: the real embedded model (SmolLM2-135M-Instruct, converted once) and real data; the
CLI in this process or in its own; the lanes.

Lanes (markers, pyproject.toml): ``model`` (loads a real model or runs a capture), ``ray`` (starts or joins
Ray), ``vllm`` (starts vLLM). ``make test-fast`` runs everything else (``-m "not model and not ray and not
vllm"``) with ``CAPTURE_TEST_LANE=fast``, which fails a test that opens model weights, starts a Ray
cluster or imports vLLM without its marker. A test that uses ``smol_dir`` (every real-model fixture does)
is marked ``model`` here, one that uses ``local_ray`` or ``ray_cluster`` ``ray``.

``make test`` runs 2 pytest-xdist workers (``-n 2``); each session fixture (the Ray head, the shared runs) is made
once per worker, and a test file runs whole on one worker (:func:`pytest_xdist_make_scheduler`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# in-process CLI runs (capture_cli) get what capture_process gives its child: no progress bars in the output read
os.environ.setdefault("TQDM_DISABLE", "1")
# OpenMP threads that sleep when idle instead of spinning: the suite runs 2 xdist workers and their engines and
# Ray replicas on 2 cores, where libgomp's default spin-wait burns the CPU the other process needs (two test
# files side by side: 179 s spinning, 89 s passive; bench/test_suite.out). Read by libgomp when torch loads,
# so set before any import of torch; inherited by every process a test starts. Changes no arithmetic.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
LANES = ("model", "ray", "vllm")

if TYPE_CHECKING:
    from shards.writer import ShardInfo
    from shards.rows import Row

REPO = Path(__file__).resolve().parents[1]
RAY_BIN = str(Path(sys.executable).with_name("ray"))  # the venv's `ray` command
SHARED_SAMPLE = REPO.parent / "shared" / "data" / "open-perfectblend-sample.jsonl"


FIXTURE_LANES = {"smol_dir": "model", "local_ray": "ray", "ray_cluster": "ray"}  # a test using one (maybe through another fixture)


# `pytest -n 2` (pytest-xdist): one scope per test file, so a module's fixtures are made once, with test_topk.py
# beside test_vllm.py (both read the session's vllm_run). The longest scopes go first (SCOPE_SECONDS, measured), the
# rest by their number of tests, so that no long file starts last while the other worker idles. (xdist's own
# `--dist loadgroup` marks cannot do this on pytest 9: xdist 3.8 renames a node through an attribute pytest 9 no
# longer reads.)
XDIST_SCOPES = {"test_topk": "test_vllm"}
# worker-seconds per scope, `make test` 2026-12-07 (bench/test_suite.out); an order, not a budget
SCOPE_SECONDS = {"test_vllm": 215, "test_cluster": 150, "test_online": 150, "test_regenerate": 122, "test_drafter": 103,
                 "test_scale": 100, "test_run": 93, "test_conventions": 73, "test_export": 72, "test_check": 70,
                 "test_disk_full": 52, "test_drafter_online": 49}


def _scope(nodeid: str) -> str:
    module = Path(nodeid.split("::", 1)[0]).stem
    return XDIST_SCOPES.get(module, module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """For ``-n N`` alone (xdist's ``load``) and ``--dist loadfile``; any other ``--dist`` keeps xdist's own."""
    if config.getoption("dist") not in ("load", "loadfile"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScopes(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # the collection's order: pytest_collection_modifyitems

        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return FileScopes(config, log)


def pytest_collection_modifyitems(items) -> None:
    """Marks each test with the lanes of the fixtures it uses; orders the files longest first (SCOPE_SECONDS, then
    the number of tests), each file's tests in their own order. Every xdist worker orders its collection so,
    and FileScopes hands out the scopes in that order."""
    counts = collections.Counter(_scope(item.nodeid) for item in items)

    def longest_first(item) -> tuple:
        scope = _scope(item.nodeid)
        return -SCOPE_SECONDS.get(scope, 0), -counts[scope], scope

    items.sort(key=longest_first)  # stable: each file's tests keep their order
    for item in items:
        for fixture, lane in FIXTURE_LANES.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(getattr(pytest.mark, lane))


_FAST_LANE_VIOLATIONS: list[str] = []
_FAST_LANE_GUARD = False  # True once collection is over


def _fast_lane_audit(event: str, args: tuple) -> None:
    """An audit hook (``sys.addaudithook``) for ``make test-fast``: what only marked tests may do. A model is
    seen by the files Python opens for it (its config, tokenizer or GGUF under the capture cache; transformers
    reads safetensors outside Python's ``open``)."""
    if not _FAST_LANE_GUARD:
        return
    what = None
    if event == "open" and isinstance(args[0], (str, os.PathLike)) and (
            str(args[0]).startswith(_MODEL_CACHE) or str(args[0]).endswith(".gguf")):
        what = f"opens a model's files ({args[0]}): mark it model"
    elif event == "subprocess.Popen" and (any(n in str(args[0]) for n in ("gcs_server", "raylet"))
                                          or list(args[1])[1:3] == ["start", "--head"]):  # `ray start --head`
        what = "starts a Ray cluster: mark it ray"
    elif event == "subprocess.Popen" and list(args[1])[1:3] == ["-m", "cli"]:
        what = "runs the capture CLI in a process of its own: mark it model (or ray)"
    elif event == "import" and args[0] == "vllm":
        what = "imports vLLM: mark it vllm"
    if what is not None:
        _FAST_LANE_VIOLATIONS.append(what)
        raise RuntimeError(f"make test-fast: this test {what}")


if os.environ.get("CAPTURE_TEST_LANE") == "fast":
    from capture.targets import cache_dir

    _MODEL_CACHE = str(cache_dir() / "models")
    sys.addaudithook(_fast_lane_audit)


def pytest_collection_finish(session) -> None:
    global _FAST_LANE_GUARD
    _FAST_LANE_GUARD = True  # collection imports what it imports (test_vllm.py skips without vLLM)


@pytest.fixture(autouse=True)
def _fast_lane_check():
    """In the fast lane: fails the test that did what only a marked one may, in its body or in the set-up of
    a fixture it was the first to use (even where the error the audit hook raised was caught on the way)."""
    yield
    if _FAST_LANE_VIOLATIONS:
        what = _FAST_LANE_VIOLATIONS[0]
        _FAST_LANE_VIOLATIONS.clear()
        pytest.fail(f"make test-fast: this test {what}", pytrace=False)


def pytest_terminal_summary(terminalreporter) -> None:
    """Ends every run (``-q`` too) with the CPU it ran on: bf16 forwards are ~6x slower than float32 without
    native bf16, and CI's machines vary."""
    terminalreporter.write_line(_cpu_line())


def _cpu_line() -> str:
    """The CPU's model, cores, the kernels torch dispatches and what ``--dtype auto`` picks here."""
    import platform

    import torch

    from capture.engines import compute_dtype

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return (f"cpu: {model}, {os.cpu_count()} cores, torch {torch.__version__} dispatching "
            f"{torch.backends.cpu.get_cpu_capability()}; capture run --dtype auto computes bf16 targets in "
            f"{compute_dtype('auto', 'bfloat16')}")


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """bf16 safetensors folder of SmolLM2-135M-Instruct, converted from the wheel's GGUF once."""
    from capture.targets import PRESETS, model_dir

    return model_dir(PRESETS["smollm2-135m"])


@pytest.fixture(scope="session")
def encoder(smol_dir):
    from capture.chat import load_encoder

    return load_encoder(str(smol_dir))


@pytest.fixture(scope="session")
def sample_jsonl() -> Path:
    if not SHARED_SAMPLE.is_file():
        pytest.skip(f"the shared Open-PerfectBlend sample is not beside the repo ({SHARED_SAMPLE})")
    return SHARED_SAMPLE


def capture_process(*args: str, check: bool = False, timeout: float = 600,
                    env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real `capture` console script in a fresh process: for tests about a process (Ray replicas and
    clusters, vLLM's engine process, kills and signals). Everything else goes through :func:`capture_cli`."""
    env = {**os.environ, "TQDM_DISABLE": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"capture {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def capture_cli(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    """Run the `capture` command in this process (click's test runner) and answer as :func:`capture_process`
    does: exit code, stdout, and stderr with what the command logged at INFO (the CLI's own log format) and
    the traceback of an exception it did not handle. A one-replica HF capture runs its replica in this
    process (``--executor auto``), so no interpreter start or torch import is paid per call; commands that
    start Ray or vLLM belong in :func:`capture_process`."""
    import io
    import logging
    import traceback

    from click.testing import CliRunner

    from cli import main

    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if "-v" in args else logging.INFO)
    try:
        result = CliRunner().invoke(main, list(args))
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    stderr = result.stderr + logs.getvalue()
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    proc = subprocess.CompletedProcess(["capture", *args], result.exit_code, result.stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"capture {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def capture_inproc(*args: str):
    """Run the CLI in this process (click's runner) and return click's result (``exit_code``, ``stderr``)."""
    from click.testing import CliRunner

    from cli import main

    return CliRunner().invoke(main, list(args))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tagged_pids(tag: str, title: str | None = None) -> list[int]:
    """Processes whose environment carries ``CAPTURE_TEST_TAG=tag`` (and whose command line contains
    ``title``, e.g. Ray's process title ``ray::Replica.process`` while a unit runs)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            if f"CAPTURE_TEST_TAG={tag}".encode() not in (p / "environ").read_bytes():
                continue
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if title is None or title in cmd:
            out.append(int(p.name))
    return out


def kill_tagged(tag: str) -> None:
    """SIGKILL every process tagged ``tag`` and every descendant of one: Ray's raylet starts its dashboard
    and runtime-env agents without the tag in their environment, and an agent left without its raylet
    spins a core for minutes."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) if p.name.isdigit() else None
        except (OSError, IndexError, ValueError):
            continue
        if ppid is not None:
            children.setdefault(ppid, []).append(int(p.name))
    todo, doomed = tagged_pids(tag), set()
    while todo:
        pid = todo.pop()
        if pid not in doomed and pid != os.getpid():
            doomed.add(pid)
            todo += children.get(pid, [])
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def forget_ray_head(port: int) -> None:
    """Remove the address file `ray start` leaves in /tmp/ray when it names the head on ``port`` (`ray stop`
    would stop every Ray on the machine)."""
    current = Path("/tmp/ray/ray_current_cluster")
    try:
        if current.read_text().strip().endswith(f":{port}"):
            current.unlink()
    except OSError:
        pass


def start_ray_head(port: int, env: dict, *, num_cpus: int = 2,
                   dashboard_port: int | None = None) -> subprocess.CompletedProcess:
    """`ray start --head` on ``port`` with ``num_cpus`` CPUs, every other fixed default port picked free
    (another Ray on this machine may hold them); the dashboard and its job agent only when
    ``dashboard_port`` is given."""
    dashboard = (["--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port), "--include-dashboard",
                  "true"] if dashboard_port else ["--include-dashboard", "false"])
    return subprocess.run([RAY_BIN, "start", "--head", "--port", str(port), "--num-cpus", str(num_cpus), *dashboard,
                           *(a for flag in ("--ray-client-server-port", "--dashboard-agent-listen-port",
                                            "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                                            "--metrics-export-port") for a in (flag, str(free_port()))),
                           "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=180)


def start_ray_worker(address: str, env: dict, num_cpus: int, bind: tuple[Path, Path] | None = None
                     ) -> subprocess.CompletedProcess:
    """`ray start --address` of a worker node with ``num_cpus`` CPUs, its processes tagged as ``env`` says
    (``CAPTURE_TEST_TAG``: :func:`kill_tagged` takes the whole node down, raylet and workers, as a lost
    machine would). ``bind``: ``(source, target)``: the node's processes see folder ``source`` at path
    ``target`` (a mount namespace of its own: a node whose disk holds other files at the same path)."""
    cmd = [RAY_BIN, "start", "--address", address, "--num-cpus", str(num_cpus), "--disable-usage-stats"]
    if bind is not None:
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"',
               "sh", str(bind[0]), str(bind[1]), *cmd]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


@dataclasses.dataclass(frozen=True)
class RayCluster:
    address: str  # host:port of the head's GCS, what `--ray-address` takes
    env: dict[str, str]  # what a capture process that connects by address needs in its environment
    tag: str  # CAPTURE_TEST_TAG of the cluster's processes (its replicas included: they inherit the raylet's)
    dashboard: str | None = None  # the head's job API (http://host:port) when it runs one: `ray job submit --address`

    @contextlib.contextmanager
    def connect(self):
        """This process connected to the cluster (``ray.init``) for the ``with`` block, then disconnected
        (``ray.shutdown``): a process connected to Ray cannot fork DataLoader workers for later tests. Token
        authentication is turned on as Ray does when it finds a local cluster (the token in
        ``~/.ray/auth_token``), which also sets ``RAY_AUTH_MODE=token`` in ``os.environ``; the variable is
        put back afterwards, so the processes later tests start inherit nothing from this."""
        import ray
        from ray._private.authentication import authentication_token_setup

        before = os.environ.get("RAY_AUTH_MODE")
        try:
            authentication_token_setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
            ray.init(address=self.address, logging_level="ERROR")
            yield
        finally:
            ray.shutdown()
            if before is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = before


@pytest.fixture(scope="session")
def ray_cluster() -> RayCluster:
    """One Ray head for the session (`ray start --head`, this machine's CPUs, no dashboard), for the tests whose capture
    runs connect to it (``--ray-address``). A killed driver or trainer is fine (the cluster outlives its drivers),
    and so is a killed replica: the cluster is this xdist worker's, so while a test runs every replica on it
    (every process carrying :attr:`RayCluster.tag` titled ``ray::Replica``) is that test's. Connecting costs
    ~1 s where a local ``ray.init`` costs ~8 s with its shutdown; tests that kill a raylet or a node start
    their own Ray (tests/test_cluster.py). Token authentication as
    Ray sets it up for a local cluster: the token in ``~/.ray/auth_token`` (made if missing), so a trainer
    rank that attaches (shards.online) needs nothing in its environment, while a capture given an address
    needs ``RAY_AUTH_MODE=token`` (:attr:`RayCluster.env`). Its processes carry a tag of their own and are
    killed at the end of the session."""
    tag, port = uuid.uuid4().hex, free_port()
    token = subprocess.run([RAY_BIN, "get-auth-token", "--generate"], capture_output=True, text=True, timeout=120)
    assert token.returncode == 0, token.stderr[-3000:]
    env = {"RAY_AUTH_MODE": "token"}
    try:  # as many CPUs as a local ray.init gives a run (a replica's torch threads follow them)
        start = start_ray_head(port, {**os.environ, **env, "CAPTURE_TEST_TAG": tag}, num_cpus=os.cpu_count())
        assert start.returncode == 0, start.stderr[-3000:]
        yield RayCluster(f"127.0.0.1:{port}", env, tag)
    finally:
        kill_tagged(tag)
        forget_ray_head(port)


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A real tmpfs of ``size`` mounted at ``path`` (needs root; skips the test otherwise)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip(f"needs root to mount a {size} tmpfs for a disk-full test")
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot run mount for a disk-full test: {e}")
    if proc.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed (rc {proc.returncode}): {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False, timeout=30)  # Ray workers may still be exiting


def built_once(tmp_path_factory, name: str, build) -> Path:
    """Folder ``name``/run, made by ``build(run)`` once per test session: under `pytest -n N` every xdist worker
    gets the same folder (the first to take the lock builds it, the others wait and read it), so a captured run
    that tests on both workers read is captured once. For read-only runs (their tests write nothing into them)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-N/popen-gwK: pytest-N is this session's, shared by its workers
    folder = base / "built-once" / name
    folder.parent.mkdir(exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not (folder / "built").exists():  # not there, or left half-built by a worker that failed
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder / "run")
            (folder / "built").touch()
    return folder / "run"


@pytest.fixture(scope="session")
def reader_run(tmp_path_factory, smol_dir) -> Path:
    """A real run for the reader tests: the first 60 ShareGPT rows (~40 kept) through SmolLM2 (taps 3/15/27, post-norm final,
    argmax), truncated to 256 tokens, in several small shards (~20 s on 2 cores); built once (:func:`built_once`)."""
    return built_once(tmp_path_factory, "reader",
                      lambda out: capture_cli("run", *READER_RUN, "--out", str(out), check=True))


READER_RUN = ("--target", "smollm2-135m", "--dataset", "sharegpt", "--layers", "3,15,27", "--final", "post-norm",
              "--limit", "60", "--max-tokens", "256", "--overlength", "truncate", "--unit-tokens", "2048",
              "--shard-size", "2MiB", "--no-progress")  # reader_run's `capture run` arguments, less --out


@pytest.fixture(scope="session")
def prenorm_run(tmp_path_factory, smol_dir) -> Path:
    """A real run with the pre-norm final state (what speculators' trainer expects): the first 16 ShareGPT
    rows through SmolLM2, taps 3/15/27, ``--final pre-norm``, argmax, truncated to 256 tokens (~15 s); built once."""
    return built_once(tmp_path_factory, "prenorm", lambda out: capture_cli(
        "run", "--target", "smollm2-135m", "--dataset", "sharegpt", "--layers", "3,15,27", "--final", "pre-norm",
        "--limit", "16", "--max-tokens", "256", "--overlength", "truncate", "--out", str(out), "--no-progress",
        check=True))


@pytest.fixture(scope="session")
def vllm_run(tmp_path_factory, sample_jsonl, ray_cluster) -> tuple[Path, subprocess.CompletedProcess]:
    """`capture run --engine vllm` end to end, once for tests/test_vllm.py (states, header, prefix caching,
    self-check) and tests/test_topk.py (top-K against HF): vLLM-CPU eager in a Ray replica on the session's
    cluster, the first 6
    Open-PerfectBlend sample rows cut at 256 tokens, taps 3 and 15, the post-norm final state, top-32
    log-probabilities (prompt_logprobs 32 + 16, past vLLM's default max_logprobs of 20), prefix caching asked
    for (the engine overrides it). ~40-55 s: a process and a vLLM engine start (the driver imports vLLM too)."""
    out = tmp_path_factory.mktemp("vllm") / "run"
    proc = capture_process("run", "--engine", "vllm", "--dataset", str(sample_jsonl), "--limit", "6", "--layers",
                           "3,15", "--final", "post-norm", "--topk", "32", "--max-tokens", "256", "--overlength",
                           "truncate", "--out", str(out), "--max-model-len", "2048", "--vllm-arg",
                           "enforce_eager=true", "--vllm-arg", "enable_prefix_caching=true", "--json",
                           "--no-progress", "--ray-address", ray_cluster.address, env=ray_cluster.env, check=True)
    return out, proc


@pytest.fixture
def good_run(tmp_path) -> tuple[Path, list[ShardInfo], list[Row]]:
    """A complete run of three shards of three random rows (tests/helpers.py, no model): for the verify and
    manifest tests."""
    from helpers import make_rows, write_run

    run = tmp_path / "run"
    rows = make_rows(7, 9)
    infos = write_run(run, [rows[0:3], rows[3:6], rows[6:9]], target_bytes=1)  # one shard per batch
    assert [i.rows for i in infos] == [3, 3, 3]
    return run, infos, rows
