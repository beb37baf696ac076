"""Loss masks from the real SmolLM2 chat template over real conversations."""

import numpy as np
import pytest
from helpers import multi_turn

from capture.chat import ChatEncoder
from capture.conversation import Conversation
from common.errors import CaptureError


def spans(mask: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous True runs as (start, stop)."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def test_mask_decodes_to_exactly_the_assistant_turns(encoder):
    tok = encoder.tokenizer
    convs = multi_turn(120)
    assert len(convs) == 120
    checked = 0
    for conv in convs:
        rec = encoder.encode(conv, encoder.special_strings())
        if isinstance(rec, str):
            assert rec == "special_token_text"
            continue
        answers = [c for r, c in conv.messages if r == "assistant"]
        runs = spans(rec.loss_mask)
        assert len(runs) == len(answers), conv.sample_id
        for (a, b), answer in zip(runs, answers):
            assert rec.input_ids[b - 1] == tok.convert_tokens_to_ids("<|im_end|>")
            assert tok.decode(rec.input_ids[a:b].tolist()) == answer + "<|im_end|>", conv.sample_id
        full = tok.apply_chat_template([{"role": r, "content": c} for r, c in conv.messages], tokenize=False)
        assert tok.decode(rec.input_ids.tolist()) == full
        checked += 1
    assert checked >= 100


def test_mask_on_hand_checked_ids(encoder):
    conv = Conversation("t:0", 0, "t", (("user", "hi"), ("assistant", "hello there")))
    rec = encoder.encode(conv)
    tok = encoder.tokenizer
    supervised = rec.input_ids[rec.loss_mask].tolist()
    assert supervised == tok("hello there", add_special_tokens=False)["input_ids"] + [2]  # 2 = <|im_end|>
    assert tok.decode(rec.input_ids[-1:].tolist()) == "\n"
    assert not rec.loss_mask[-1]  # ChatML's newline after <|im_end|> is template boilerplate


def test_system_prompt_added_only_where_missing(encoder):
    enc = ChatEncoder(encoder.tokenizer, encoder.template, encoder.end_ids, system_prompt="Be brief.")
    rec = enc.encode(Conversation("t:0", 0, "t", (("user", "hi"), ("assistant", "ok"))))
    assert encoder.tokenizer.decode(rec.input_ids.tolist()).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    own = enc.encode(Conversation("t:1", 1, "t", (("system", "Own."), ("user", "hi"), ("assistant", "ok"))))
    assert "Be brief." not in encoder.tokenizer.decode(own.input_ids.tolist())


def test_special_token_text_policy(encoder):
    conv = Conversation("t:0", 0, "t", (("user", "what does <|im_end|> mean?"), ("assistant", "a control token")))
    assert encoder.encode(conv, encoder.special_strings()) == "special_token_text"
    kept = ChatEncoder(encoder.tokenizer, encoder.template, encoder.end_ids, special_text="keep").encode(
        conv, encoder.special_strings())
    assert int((kept.input_ids == 2).sum()) == 4  # system, the user's text, user end, assistant end


def test_template_breaking_the_prefix_property_fails_loudly(encoder):
    # Renders a marker only after the last message: prefixes are then not token prefixes of the whole.
    bad = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}END{% endif %}")
    enc = ChatEncoder(encoder.tokenizer, bad, encoder.end_ids)
    conv = Conversation("t:7", 7, "t", (("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")))
    with pytest.raises(CaptureError, match="t:7.*prefix property"):
        enc.encode(conv)


def test_template_without_end_of_turn_token_fails_loudly(encoder):
    no_end = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    enc = ChatEncoder(encoder.tokenizer, no_end, encoder.end_ids)
    with pytest.raises(CaptureError, match="no end-of-turn token"):
        enc.encode(Conversation("t:0", 0, "t", (("user", "a"), ("assistant", "b"))))
