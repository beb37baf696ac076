"""Self-distillation (`--responses regenerate`): real SmolLM2 answers on real ShareGPT conversations."""

import itertools
import json

import numpy as np
import pytest
import torch

from conftest import capture_cli, capture_inproc
from helpers import multi_turn
from shards import manifest
from shards.reader import iter_rows, read_table

IM_END = 2  # SmolLM2's <|im_end|>: its EOS and ChatML's end-of-turn token
# Real ShareGPT rows: 1, 2 and 18 run past 16 new tokens; SmolLM2 answers 24 in 12 tokens; 41 (6 turns) and 13 (5)
# get a first answer that ends within 32 tokens. How many later answers also end within 32 tokens differs between
# CPUs (bf16 kernels with and without AVX-512 BF16 flip near-tied greedy choices), so no test counts on it.
NEAR_TIE = 0.5  # logits: greedy choices this close may flip between bf16 kernels of different batch shapes
LAST_ROWS = ("sharegpt:1", "sharegpt:2", "sharegpt:18", "sharegpt:24", "sharegpt:41")
EVERY_ROWS = ("sharegpt:13", "sharegpt:41")


def sharegpt(ids) -> list:
    from capture.conversation import iter_conversations
    from capture.dataset import ReadStats, resolve_dataset

    convs = itertools.islice(iter_conversations(resolve_dataset("sharegpt"), ReadStats()), 60)
    return [c for c in convs if c.sample_id in ids]


def write_jsonl(path, convs) -> None:
    """The conversations as an OpenAI-format file (row i = convs[i])."""
    path.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in conv.messages]}) + "\n"
                            for conv in convs))


def spans(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


@pytest.fixture(scope="module")
def engine(smol_dir):
    """The hf engine in the arithmetic ``capture run --dtype auto`` picks here (float32 on a CPU without native
    bf16: emulated bf16 took 327 s of this module on an AVX2-only CPU, bench/test_suite.out)."""
    from capture.engines import compute_dtype
    from capture.engines.hf import HFEngine
    from capture.targets import PRESETS, make_taps

    return HFEngine(str(smol_dir), make_taps(PRESETS["smollm2-135m"], (3,), "none"), argmax=False,
                    dtype=compute_dtype("auto", "bfloat16"), state_dtype="bfloat16")


@pytest.fixture(scope="module")
def model(engine):
    """The plain HF model (the engine's hooks keep nothing outside engine.forward)."""
    return engine.model


def greedy(model, prompt: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """A plain, unbatched HF greedy generate of one prompt, cut after the first EOS."""
    with torch.inference_mode():
        out = model.generate(torch.from_numpy(prompt.astype(np.int64))[None], max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=[IM_END], pad_token_id=IM_END)
    new = out[0, len(prompt):].numpy()
    stop = np.flatnonzero(new == IM_END)
    return new[: stop[0] + 1] if stop.size else new


def test_last_turn_greedy_run(tmp_path, encoder, model):
    """`capture run --responses regenerate`: stored ids = the encoder's prompt + exactly SmolLM2's greedy answer."""
    convs = sharegpt(LAST_ROWS)
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, convs)
    out = tmp_path / "run"
    args = ["run", "--out", str(out), "--dataset", str(data), "--layers", "3,15", "--responses", "regenerate",
            "--max-new-tokens", "16", "--chat-template-kwarg", "reasoning_effort=high", "--batch-tokens", "1",
            "--no-progress", "--json"]  # --dtype auto: the reference's arithmetic (the engine fixture's)
    s = json.loads(capture_cli(*args, check=True).stdout)
    assert s["committed_rows"] == len(convs) and not s["skipped"] and not s["rejected"]
    assert capture_cli("shards", "verify", str(out)).returncode == 0
    header = manifest.read(out).header
    assert header.responses == {"mode": "regenerate", "policy": "last", "temperature": 0.0, "top_p": 1.0,
                                   "max_new_tokens": 16, "seed": 0, "stop_ids": [IM_END],
                                   "chat_template_kwargs": {"reasoning_effort": "high"}}

    rows = {r["sample_id"]: r for r in iter_rows(out)}
    reasons = []
    for i, conv in enumerate(convs):
        row = rows[f"rows.jsonl:{i}"]
        prompt = encoder.encode_prompt(conv, "last").segments[0]
        answer = greedy(model, prompt, 16)
        np.testing.assert_array_equal(row["input_ids"], np.concatenate([prompt, answer]))
        np.testing.assert_array_equal(row["loss_mask"], np.arange(len(row["input_ids"])) >= len(prompt))
        reasons += row["finish_reasons"]
        assert row["finish_reasons"] == ["stop" if answer[-1] == IM_END else "length"]
        # The prompt ends with the last user turn and the generation prompt; earlier answers are the dataset's.
        text = encoder.tokenizer.decode(prompt)
        assert text.endswith(conv.messages[-2][1] + "<|im_end|>\n<|im_start|>assistant\n")
        assert all(c in text for r, c in conv.messages[:-1])
        # States of the stored ids: bit-exact against a plain HF forward (one record per forward), rounded to
        # the run's bf16 as the engine rounds a float32 forward's (a no-op for a bf16 one).
        with torch.inference_mode():
            ref = model(torch.from_numpy(row["input_ids"].astype(np.int64))[None], output_hidden_states=True)
        for k in (3, 15):
            assert torch.equal(row[f"tap_{k}"], ref.hidden_states[k + 1][0].to(torch.bfloat16))
        np.testing.assert_array_equal(row["argmax"], ref.logits[0].argmax(-1).numpy())
    assert {"stop", "length"} <= set(reasons)  # row 24's answer ends at 12 tokens, rows 1, 2 and 18 run on

    # Regenerate parameters are part of the run identity: the same settings resume (a dry run finds every row
    # committed), another budget against this folder is refused.
    same = capture_inproc(*args, "--dry-run")
    assert same.exit_code == 0, same.stderr
    assert json.loads(same.stdout)["already_committed"] == len(convs) and json.loads(same.stdout)["kept"] == 0
    other = capture_inproc(*[a if a != "16" else "17" for a in args])
    assert other.exit_code == 2 and "different responses" in other.stderr


def test_every_turn_is_conditioned_on_the_targets_own_answers(tmp_path, smol_dir, encoder, model):
    """`--regenerate-policy every` through a replica: each answer is the target's, followed by the next user
    turn; decoded, the record is the template's rendering of the conversation with the generated answers."""
    from capture.config import RunConfig
    from capture.plan import prepare
    from capture.replica import Replica

    cfg = RunConfig(out=str(tmp_path / "run"), layers=(3,), responses="regenerate", regenerate_policy="every",
                    max_new_tokens=32)
    prep = prepare(cfg)
    convs = sharegpt(EVERY_ROWS)
    prompts = [prep.encoder.encode_prompt(c, "every") for c in convs]
    (tmp_path / "run").mkdir()
    replica = Replica(prep.model_dir, prep.taps, prep.header, str(tmp_path / "run"), shard_size=2**30,
                      batch_tokens=1, threads=None, codec_threads=1, engine=prep.engine)  # --dtype auto's arithmetic
    replica.start()
    result = replica.process(prompts)
    shards = result.shards + replica.finish()
    assert not result.rejected and sum(s.rows for s in shards) == len(convs)
    table = read_table(tmp_path / "run" / shards[0].path)
    tok = encoder.tokenizer
    for i, (conv, prompt) in enumerate(zip(convs, prompts)):
        j = table["sample_id"].to_pylist().index(conv.sample_id)
        ids = table["input_ids"][j].values.to_numpy()
        mask = table["loss_mask"][j].values.to_numpy(zero_copy_only=False)
        reasons = table["finish_reasons"][j].as_py()
        answers = [ids[a:b] for a, b in spans(mask)]
        assert len(answers) == len(reasons) >= 2 and reasons[:-1] == ["stop"] * (len(reasons) - 1)
        # Built from the segments and answers; each answer the target's greedy continuation of what precedes it.
        pos = 0
        for k, answer in enumerate(answers):
            seg = prompt.segments[k]
            np.testing.assert_array_equal(ids[pos:pos + len(seg)], seg)
            pos += len(seg)
            np.testing.assert_array_equal(answer, greedy(model, ids[:pos], 32))
            pos += len(answer)
        assert pos == len(ids)
        # Every answer but the last ends with <|im_end|> and is followed by the next user turn.
        user_turns = [c for r, c in conv.messages if r == "user"]
        for k, answer in enumerate(answers[:-1]):
            assert answer[-1] == IM_END
            assert tok.decode(prompt.segments[k + 1]) == (
                f"\n<|im_start|>user\n{user_turns[k + 1]}<|im_end|>\n<|im_start|>assistant\n")
        # A check, not the construction: the template's rendering with the generated answers as text.
        texts = [tok.decode(a[:-1] if r == "stop" else a) for a, r in zip(answers, reasons)]
        messages, n = [], 0
        for role, content in conv.messages:
            if role == "assistant":
                if n == len(texts) - 1:
                    break
                content, n = texts[n], n + 1
            messages.append({"role": role, "content": content})
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.decode(ids) == rendered + tok.decode(answers[-1])


def test_left_padded_batch_generates_what_each_prompt_generates_alone(encoder, engine, model):
    """HFEngine.generate: one left-padded batch of prompts of different lengths, greedy, cut after the first stop
    id. Each answer equals the unbatched generate of its prompt up to where the two first differ, and they may
    differ only at a near-tie: bf16 kernels of another batch shape move logits by a bf16 step or two (on an
    AVX-512/AMX CPU two of these five answers flip at a gap of 0.06 and 0.125 logits; on AVX2 none did)."""
    from capture.engines.base import Sampling

    prompts = [encoder.encode_prompt(c, "last").segments[0] for c in sharegpt(LAST_ROWS)]
    assert len({len(p) for p in prompts}) == len(prompts)
    got = engine.generate(prompts, Sampling(max_new_tokens=16), [IM_END])
    identical = 0
    for prompt, gen in zip(prompts, got):
        alone = greedy(model, prompt, 16)
        n = min(len(alone), len(gen.token_ids))
        differ = np.flatnonzero(alone[:n] != gen.token_ids[:n])
        if not differ.size:
            np.testing.assert_array_equal(gen.token_ids, alone)
            identical += 1
        else:
            j = int(differ[0])
            with torch.inference_mode():
                ctx = torch.from_numpy(np.concatenate([prompt, alone[:j]]).astype(np.int64))[None]
                logits = model(ctx).logits[0, -1].float()
            assert float(logits[alone[j]] - logits[gen.token_ids[j]]) <= NEAR_TIE, (len(prompt), j)
        assert gen.token_ids.dtype == np.int32
        assert gen.finish_reason == ("stop" if gen.token_ids[-1] == IM_END else "length")
        assert gen.finish_reason == "stop" or len(gen.token_ids) == 16
    assert {g.finish_reason for g in got} == {"stop", "length"} and identical >= len(prompts) // 2
    sampled = Sampling(temperature=0.8, top_p=0.9, max_new_tokens=16, seed=3)
    again = [engine.generate(prompts[:2], sampled, [IM_END]) for _ in range(2)]
    assert all(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(*again))  # seeded per call


def test_prompt_segments_rebuild_the_dataset_encoding(encoder):
    """With the dataset's answers spliced in, the segments give exactly the dataset-mode ids (real multi-turn rows)."""
    tok = encoder.tokenizer
    checked = 0
    for conv in multi_turn(40):
        rec = encoder.encode(conv, encoder.special_strings())
        if isinstance(rec, str):
            continue
        prompt = encoder.encode_prompt(conv, "every")
        answers = [c for r, c in conv.messages if r == "assistant"]
        assert prompt.turns == len(answers) and prompt.turn_ends == (IM_END,) * (len(answers) - 1)
        answer_ids = [tok(a, add_special_tokens=False)["input_ids"] + [IM_END] for a in answers]
        ids = np.concatenate([part for seg, a in zip(prompt.segments, answer_ids) for part in (seg, a)])
        mask = np.concatenate([m for seg, a in zip(prompt.segments, answer_ids)
                               for m in (np.zeros(len(seg), bool), np.ones(len(a), bool))])
        np.testing.assert_array_equal(rec.input_ids[: len(ids)], ids)
        np.testing.assert_array_equal(rec.loss_mask[: len(ids)], mask)
        last = encoder.encode_prompt(conv, "last")  # the prompt of the last answer, earlier answers the dataset's
        assert last.turns == 1
        np.testing.assert_array_equal(last.segments[0], rec.input_ids[: spans(rec.loss_mask)[-1][0]])
        checked += 1
    assert checked >= 35


THINK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and enable_thinking is defined and not enable_thinking %}"
    "{{ '<think></think>\\n' }}{% endif %}{{ message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>\\n' }}{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_the_template(tmp_path, smol_dir, sample_jsonl):
    """`--chat-template-kwarg enable_thinking=false` changes what a template that uses it renders, in both modes."""
    from capture.chat import load_encoder

    template = tmp_path / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    plain = load_encoder(str(smol_dir), chat_template_file=str(template))
    off = load_encoder(str(smol_dir), chat_template_file=str(template), template_kwargs=(("enable_thinking", False),))
    conv = sharegpt(("sharegpt:24",))[0]
    tok = plain.tokenizer
    assert tok.decode(off.encode_prompt(conv).segments[0]) == tok.decode(plain.encode_prompt(conv).segments[0]) + (
        "<think></think>\n")
    think = tok("<think></think>\n", add_special_tokens=False)["input_ids"]
    assert off.encode(conv).num_tokens == plain.encode(conv).num_tokens + len(think)

    def planned(*extra):
        r = capture_inproc("run", "--out", str(tmp_path / "plan"), "--dataset", str(sample_jsonl), "--limit", "5",
                           "--chat-template", str(template), "--dry-run", "--json", *extra)
        assert r.exit_code == 0, r.stderr
        return json.loads(r.stdout)

    base, kw = planned(), planned("--chat-template-kwarg", "enable_thinking=false")
    assert kw["kept"] == base["kept"] == 5
    assert kw["estimated_tokens"] > base["estimated_tokens"]


def test_filters_before_generation_count_prompts(tmp_path, encoder):
    """Dry runs: the prompt plus the generation budget must fit the context; --max-tokens (drop) drops prompts
    already too long; the estimate is the prompt tokens plus the whole budget."""
    convs = sharegpt(LAST_ROWS)
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, convs)
    lengths = [len(encoder.encode_prompt(c, "last").segments[0]) for c in convs]

    def planned(*extra):
        r = capture_inproc("run", "--out", str(tmp_path / "plan"), "--dataset", str(data), "--responses",
                           "regenerate", "--dry-run", "--json", *extra)
        assert r.exit_code == 0, r.stderr
        return json.loads(r.stdout)

    p = planned("--max-new-tokens", "100")
    assert p["kept"] == len(convs) and p["estimated_tokens"] == sum(lengths) + 100 * len(convs)
    assert planned("--max-new-tokens", str(8192 - min(lengths)))["skipped"] == {"over_context": len(convs) - 1}
    cut = sorted(lengths)[2]
    p = planned("--max-tokens", str(cut))
    assert p["skipped"] == {"over_max_tokens": sum(n > cut for n in lengths)} and p["kept"] == 3


@pytest.mark.parametrize("args, message", [
    (["--responses", "regenerate", "--temperature", "-1"], "temperature: -1.0 is not a number >= 0"),
    (["--responses", "regenerate", "--regenerate-policy", "bogus"], "regenerate-policy: 'bogus' is not one of last, every"),
    (["--responses", "regenerate", "--top-p", "0"], "top-p: 0.0 is not a number in (0, 1]"),
    (["--responses", "regenerate", "--max-new-tokens", "0"], "max-new-tokens: 0 is not an integer >= 1"),
    (["--responses", "bogus"], "responses: 'bogus' is not one of dataset, regenerate"),
    (["--temperature", "0.7"], "--temperature applies only to --responses regenerate"),
    (["--chat-template-kwarg", "enable_thinking"], "--chat-template-kwarg wants KEY=VALUE"),
    (["--chat-template-kwarg", "tokenize=true"], "chat-template-kwarg: 'tokenize' is not a template variable"),
])
def test_bad_regenerate_settings_are_one_line(tmp_path, args, message):
    result = capture_inproc("run", "--out", str(tmp_path / "run"), "--limit", "2", *args)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_budget_stops_generating_what_the_length_filter_cuts(encoder, engine):
    """With a max-tokens budget, a conversation stops before an answer that would start past it: the
    filtered record is the same as after generating every turn (truncate and drop), for fewer tokens."""
    from capture.engines.base import Sampling
    from capture.regenerate import regenerate
    from filters import FilterConfig, apply_filters

    prompts = [encoder.encode_prompt(c, "every") for c in sharegpt(EVERY_ROWS)]
    sampling = Sampling(max_new_tokens=32)
    generated = {"full": [], "budget": []}
    # batch_tokens=1: each prompt alone, so a batch's composition never changes a greedy answer
    full = regenerate(engine, prompts, sampling, [IM_END], batch_tokens=1, on_batch=generated["full"].append)
    assert all(len(r.finish_reasons) >= 2 for r in full)  # a first answer that stopped, then at least one more
    for prompt, a in zip(prompts, full):
        # the budget ends with the first answer: the second one would start past it
        budget = int(np.flatnonzero(np.diff(a.loss_mask.astype(np.int8)) == -1)[0]) + 1
        assert a.num_tokens > budget
        b = regenerate(engine, [prompt], sampling, [IM_END], batch_tokens=1, on_batch=generated["budget"].append,
                       budget=budget)[0]
        assert len(b.finish_reasons) == 1
        for policy in ("truncate", "drop"):
            cfg = FilterConfig(max_tokens=budget, overlength=policy)
            (ra, why_a), (rb, why_b) = apply_filters(a, cfg, set()), apply_filters(b, cfg, set())
            assert why_a == why_b
            if policy == "truncate":
                np.testing.assert_array_equal(ra.input_ids, rb.input_ids)
                np.testing.assert_array_equal(ra.loss_mask, rb.loss_mask)
                assert ra.finish_reasons == rb.finish_reasons == a.finish_reasons[:1]
            else:
                assert why_a == "over_max_tokens"
    assert sum(generated["budget"]) < sum(generated["full"])
    # a prompt already past the budget is not answered at all: the filter drops it either way
    short = len(prompts[0].segments[0]) - 1
    tokens = []
    none = regenerate(engine, prompts[:1], sampling, [IM_END], batch_tokens=1, on_batch=tokens.append, budget=short)
    assert tokens == [] and none[0].num_loss_tokens == 0 and none[0].finish_reasons == ()
    for policy in ("truncate", "drop"):
        cfg = FilterConfig(max_tokens=short, overlength=policy)
        assert apply_filters(none[0], cfg, set())[1] == apply_filters(full[0], cfg, set())[1] != None
