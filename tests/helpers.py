"""Plain builders shared by several test files (fixtures live in conftest.py, or in the one file that uses them).

Shard rows: small random tensors (hidden size ``H`` = 8, 5–40 tokens) under a run header for two taps
(``tap_1``, ``tap_3``) and a ``final`` column; :func:`write_run` writes and commits them like a capture.
Filter records: :func:`make_record` / :func:`make_prompt` build ``capture.chat`` records from plain lists.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from click.testing import CliRunner

import cli
from capture.chat import Prompt, Tokenized
from capture.conversation import Conversation, iter_conversations
from capture.dataset import ReadStats, resolve_dataset
from common.hashing import token_sha256
from shards import format as shard_format
from shards.format import RunHeader
from shards.manifest import ManifestWriter
from shards.run import MANIFEST
from shards.reader import iter_rows
from shards.writer import ShardInfo, ShardWriter
from shards.rows import Row

# --------------------------------------------------------------------------------------------------
# shard rows and runs (no model)

H = 8
COLUMNS = ["tap_1", "tap_3", "final"]
BIG = 1 << 40  # a target size no test reaches: the shard closes only on close()


def make_header(**overrides) -> RunHeader:
    h = shard_format.header(
        target={"name": "tiny", "source": "test", "revision": "0", "architecture": "none", "num_layers": 4},
        taps={"layers": [1, 3], "final": "post-norm", "tap_convention": "t", "final_convention": "f"},
        columns=list(COLUMNS),
        hidden_size=H,
        dtype="bfloat16",
        codec="bf16",
        argmax=True,
        chat_template="{{ messages }}",
        chat_template_sha256="a" * 64,
        tokenizer_sha256="b" * 64,
    )
    return h.replace(**overrides)


HEADER = make_header()
SCHEMA = shard_format.schema(HEADER)
# a regenerate-mode run header (finish_reasons per generated turn)
REGENERATED = make_header(responses={"mode": "regenerate", "policy": "every", "temperature": 0.0, "top_p": 1.0,
                                     "max_new_tokens": 16, "seed": 0, "stop_ids": [2], "chat_template_kwargs": {}})


def make_row(rng: np.random.Generator, index: int, tokens: int, source: str = "alpha", *,
             dataset: str = "d", incompressible: bool = False, header: RunHeader = HEADER) -> Row:
    ids = rng.integers(0, 50_000, tokens, dtype=np.int32)
    mask = rng.random(tokens) < 0.5
    mask[-1] = True  # at least one supervised token
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[header.dtype]
    states = {}
    for c in header.columns:
        if incompressible:  # uniformly random bits: zstd cannot shrink them
            states[c] = torch.randint(-(1 << 15), 1 << 15, (tokens, header.hidden_size), dtype=torch.int16,
                                      generator=gen).view(dtype)
        else:
            states[c] = (torch.randn(tokens, header.hidden_size, generator=gen) * 3).to(dtype)
    argmax = rng.integers(0, 50_000, tokens, dtype=np.int32) if header.argmax else None
    return Row(f"{dataset}:{index}", source, index, ids, mask, argmax, states, token_sha256(ids))


def make_rows(seed: int, n: int, start: int = 0, sources=("alpha", "beta")) -> list[Row]:
    rng = np.random.default_rng(seed)
    return [make_row(rng, start + i, int(rng.integers(5, 41)), sources[i % len(sources)]) for i in range(n)]


def write_run(run_dir: Path, batches: list[list[Row]], target_bytes: int = BIG, *, complete: bool = True,
              header: RunHeader = HEADER) -> list[ShardInfo]:
    """Write ``batches`` through one ShardWriter, commit every closed shard, optionally mark complete."""
    mw, _ = ManifestWriter.open(run_dir, header)
    writer = ShardWriter(run_dir, shard_format.schema(header), target_bytes=target_bytes)
    infos = []
    for batch in batches:
        for info in writer.write(batch):
            mw.commit(info)
            infos.append(info)
    for info in writer.close():
        mw.commit(info)
        infos.append(info)
    if complete:
        mw.complete({"rows": sum(i.rows for i in infos), "reason": "test"})
    return infos


def drafter_rows(n: int, tokens: int = 1024, hidden: int = 384, vocab: int = 4096, seed: int = 0,
                 dataset: str = "synthetic") -> tuple[RunHeader, list[Row]]:
    """(header, rows) of ``n`` random conversations a drafter trains on: ``tokens`` tokens (ids below
    ``vocab``; a 64-token prompt, then supervised and unsupervised stretches of 64), two taps of ``hidden``
    bf16 channels, no final state; sample ids ``{dataset}:{i}``. Row ``i`` is the same in every size (its own
    seed), so a larger set extends a smaller one."""
    header = make_header(hidden_size=hidden, columns=["tap_1", "tap_3"], taps={"layers": [1, 3], "final": None,
                                                                              "tap_convention": "t"})
    rows = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        ids = rng.integers(0, vocab, tokens, dtype=np.int32)
        mask = np.repeat(rng.random(tokens // 64 + 1) < 0.5, 64)[:tokens]  # supervised stretches of 64 tokens
        mask[:64], mask[-2:] = False, True  # a prompt of its own (drafter.data.prompt_key), then answers
        gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
        states = {c: torch.randn(tokens, hidden, generator=gen).bfloat16() for c in header.columns}
        argmax = rng.integers(0, vocab, tokens, dtype=np.int32)
        rows.append(Row(f"{dataset}:{i}", "synthetic", i, ids, mask, argmax, states, token_sha256(ids)))
    return header, rows


def drafter_target(out: Path, vocab: int = 4096, hidden: int = 384, seed: int = 0) -> Path:
    """A target folder whose tied ``embed_tokens`` (bf16 [vocab, hidden]) a drafter loads."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    embed = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed)).bfloat16()
    save_file({"model.embed_tokens.weight": embed}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    return out


def drafter_run(out: Path, n: int, tokens: int = 1024, hidden: int = 384, vocab: int = 4096, seed: int = 0,
                shard_bytes: int = 16 << 20, dataset: str = "synthetic") -> tuple[Path, Path]:
    """:func:`drafter_rows` committed as a complete run in ``out/run`` (shards of about ``shard_bytes``) and
    :func:`drafter_target` in ``out/target``. Returns (run folder, target folder)."""
    header, rows = drafter_rows(n, tokens, hidden, vocab, seed, dataset)
    run = out / "run"
    write_run(run, [rows[i:i + 8] for i in range(0, n, 8)], target_bytes=shard_bytes, header=header)
    return run, drafter_target(out / "target", vocab, hidden, seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def assert_row_equal(got: dict, row: Row) -> None:
    assert got["sample_id"] == row.sample_id
    assert got["source"] == row.source
    assert got["row_index"] == row.row_index
    np.testing.assert_array_equal(got["input_ids"], row.input_ids)
    assert got["input_ids"].dtype == np.int32
    np.testing.assert_array_equal(got["loss_mask"], row.loss_mask)
    assert got["loss_mask"].dtype == np.bool_
    np.testing.assert_array_equal(got["argmax"], row.argmax)
    assert got["num_tokens"] == len(row.input_ids)
    assert got["num_loss_tokens"] == int(row.loss_mask.sum())
    assert got["token_sha256"] == row.token_sha256
    for c, t in row.states.items():
        assert got[c].dtype == t.dtype and got[c].shape == t.shape
        assert torch.equal(got[c], t)
        assert torch.equal(bits(got[c]), bits(t))


def manifest_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / MANIFEST).read_text().splitlines()]


def rewrite_manifest(run_dir: Path, lines: list[dict]) -> None:
    (run_dir / MANIFEST).write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in lines))


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def invoke(*args: str):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def hand_written_shard(path: Path, metadata: dict | None) -> None:
    """A two-row Arrow stream with only a sample_id column and the given schema metadata."""
    schema = pa.schema([pa.field("sample_id", pa.string())], metadata=metadata)
    batch = pa.record_batch([pa.array(["d:0", "d:1"])], schema=schema)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        w.write_batch(batch)


# --------------------------------------------------------------------------------------------------
# a real run's rows, real conversations


def real_rows(run) -> list[Row]:
    """The run's rows as writer Rows (to write them again as another run would)."""
    return [Row(r["sample_id"], r["source"], r["row_index"], r["input_ids"], r["loss_mask"], r["argmax"],
                {c: r[c] for c in ("tap_3", "tap_15", "tap_27", "final")}, r["token_sha256"])
            for r in iter_rows(run)]


def multi_turn(n: int) -> list[Conversation]:
    convs = iter_conversations(resolve_dataset("sharegpt"), ReadStats())
    return list(itertools.islice((c for c in convs if sum(r == "assistant" for r, _ in c.messages) >= 2), n))


# --------------------------------------------------------------------------------------------------
# filter records (capture.chat.Tokenized / Prompt) from plain lists


def make_record(ids, mask=None, sample_id: str = "t:0", row_index: int = 0, source: str = "test") -> Tokenized:
    """A tokenized record: ``ids`` as int32, ``mask`` as bool (every token supervised when None)."""
    input_ids = np.asarray(ids, dtype=np.int32)
    loss_mask = np.ones(len(input_ids), dtype=np.bool_) if mask is None else np.asarray(mask, dtype=np.bool_)
    assert loss_mask.shape == input_ids.shape
    return Tokenized(sample_id, row_index, source, input_ids, loss_mask)


def make_prompt(*segments, sample_id: str = "p:0", row_index: int = 0, source: str = "test",
                turn_end: int = 2) -> Prompt:
    """A regenerate-mode prompt: one int32 segment per assistant turn to generate (``turns`` = len(segments))."""
    segs = tuple(np.asarray(s, dtype=np.int32) for s in segments)
    return Prompt(sample_id, row_index, source, segs, tuple([turn_end] * (len(segs) - 1)))


# --------------------------------------------------------------------------------------------------
# a model whose states are known exactly (issue 33 part 7)

PREDICTABLE_LAYERS = 6
PREDICTABLE_TOKEN = 100  # the token it always generates


def predictable_embedding(ids: np.ndarray, hidden: int = 64) -> np.ndarray:
    """The embedding of each token id: small integers that differ by token (so a state names its position)."""
    j = np.arange(hidden)
    return ((ids.astype(np.int64)[:, None] * (j + 1)) % 31 - 15).astype(np.float32)


def predictable_state(ids: np.ndarray, tap: int | str, hidden: int = 64, eps: float = 1e-5) -> np.ndarray:
    """``[T, H]`` float32: the state of :func:`predictable_model` after 0-based decoder layer ``tap`` (layer i
    adds 2 * (i + 1) to every channel: after layer k the sum is (k + 1)(k + 2)), or ``"pre-norm"`` / ``"post-norm"``
    (the last layer's output, then RMSNorm with weight 1)."""
    k = PREDICTABLE_LAYERS - 1 if isinstance(tap, str) else tap
    x = predictable_embedding(ids, hidden) + (k + 1) * (k + 2)
    if tap == "post-norm":
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x


def predictable_model(path: Path, tokenizer_dir: Path, hidden: int = 64) -> Path:
    """A llama model folder at ``path`` (``PREDICTABLE_LAYERS`` layers, ``hidden`` wide, bf16 safetensors,
    ``tokenizer_dir``'s tokenizer and chat template) whose every state is known: attention and MLP weights
    are zero, so decoder layer i adds its MLP's down-projection bias, 2 * (i + 1), to the residual stream;
    the embedding is :func:`predictable_embedding`; the LM head sends every position to token
    ``PREDICTABLE_TOKEN`` (never an end of turn: generation runs to its budget). Every value is a small
    integer, exact in bf16 arithmetic, so every engine must store exactly :func:`predictable_state`."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 49152
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden,
                         num_hidden_layers=PREDICTABLE_LAYERS, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=hidden // 2, max_position_embeddings=4096, rms_norm_eps=1e-5, mlp_bias=True,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         torch_dtype="bfloat16")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight.copy_(torch.from_numpy(predictable_embedding(np.arange(vocab), hidden)))
        for i, layer in enumerate(model.model.layers):
            layer.mlp.down_proj.bias.fill_(2.0 * (i + 1))
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight[PREDICTABLE_TOKEN].fill_(1.0)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    return path
