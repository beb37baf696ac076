"""Tiny random-weight GLM fixtures: the real architectures (transformers' ``glm_moe_dsa`` and ``glm5_next``)
at toy size, with a small byte-level BPE tokenizer that carries GLM's special tokens and the packaged GLM
chat template (``capture/templates/glm.jinja``), saved as local model folders that ``capture run --target
<folder>`` takes.

Shapes kept from the published configs: ``glm_moe_dsa`` = MLA attention with the DSA sparse indexer on every
layer, dense first layers then routed + shared experts, one MTP layer in the config (not built by HF);
``glm5_next`` = linear-attention (KDA) layers with every 4th layer MLA + indexer, dense first 3 then MoE,
``hc_mult`` = 4 residual streams. Sizes are toy (hidden 64, 5 layers, 8 experts); ``index_topk`` is
smaller than the test sequences, so the sparse selection really drops positions.
"""

from __future__ import annotations

import json
from pathlib import Path

GLM_SPECIALS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>",
    "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>",
)
VOCAB = 512  # model vocabulary (tokenizer: 256 bytes + merges + specials, below this)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the weather in Paris today?",
    "Let me think about this step by step. The answer is 42, because 6 times 7 is 42.",
    "get_weather city Paris unit celsius {\"temp\": 18, \"sky\": \"clear\"} It is 18 degrees and clear.",
    "Hello! How can I help you? Reasoning Effort: Low High Max # Tools You may call one or more functions.",
]


def glm_template() -> str:
    from importlib.resources import files

    return files("capture").joinpath("templates/glm.jinja").read_text(encoding="utf-8")


def build_tokenizer():
    """A ``PreTrainedTokenizerFast``: byte-level BPE (256 bytes + merges learned on a few sentences, so any
    text encodes without unknowns) plus GLM's special tokens as added special tokens, with the GLM
    template. EOS ``<|endoftext|>``, pad ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(GLM_SPECIALS), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=[s for s in GLM_SPECIALS if s != "<|endoftext|>"])
    fast.chat_template = glm_template()
    assert len(fast) <= VOCAB
    return fast


def _moe_dsa_config(layers: int):
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=2, first_k_dense_replace=2,
        num_nextn_predict_layers=1, max_position_embeddings=4096, tie_word_embeddings=False)


def _next_config(layers: int):
    from transformers import Glm5NextConfig

    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16, index_topk=8,
        index_head_dim=16, index_n_heads=2, index_kpool=4, linear_head_dim=16, linear_num_heads=4, hc_mult=4,
        pad_token_id=0, max_position_embeddings=4096)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    return Glm5NextConfig(text_config=text, vision_config=vision)


ARCHITECTURES = {"glm_moe_dsa": _moe_dsa_config, "glm5_next": _next_config}


def build_fixture(arch: str, out: Path, *, layers: int = 5, seed: int = 0) -> Path:
    """Save a seeded random ``arch`` model (``glm_moe_dsa`` | ``glm5_next``), the tiny tokenizer and a
    generation config (EOS ids ``<|endoftext|>``, ``<|user|>``, ``<|observation|>``, as GLM's) to ``out``;
    bf16 weights. Returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Glm5NextForConditionalGeneration

    tok = build_tokenizer()
    config = ARCHITECTURES[arch](layers)
    torch.manual_seed(seed)
    if arch == "glm5_next":
        model = Glm5NextForConditionalGeneration(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(torch.bfloat16).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id).save_pretrained(out)
    (out / "capture-fixture.json").write_text(json.dumps({"arch": arch, "layers": layers, "seed": seed}))
    return out
