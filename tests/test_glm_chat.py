"""GLM chat format and loss mask on GLM-shaped conversations (multi-turn, reasoning, tool calls,
observations), with the tiny GLM tokenizer (tests/glm_fixtures.py) and the packaged template.

Expected strings are written by hand from the public GLM-5.x format (docs/glm.md "GLM chat format and loss
mask policy"); masks are checked token by token.
"""

from __future__ import annotations

import json

import pytest

from capture.chat import ChatEncoder, template_boilerplate
from capture.conversation import Conversation, iter_conversations
from capture.dataset import ReadStats, resolve_dataset
from glm_fixtures import build_tokenizer, glm_template

H = "[gMASK]<sop>"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def encoder(tok, **kw) -> ChatEncoder:
    end = frozenset(tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>"))
    return ChatEncoder(tok, glm_template(), end, boilerplate=template_boilerplate(tok, glm_template()), **kw)


def conv(*turns) -> Conversation:
    """turns: (role, content) or (role, content, extras)."""
    return Conversation("t:0", 0, "t", tuple((t[0], t[1]) for t in turns),
                        tuple(t[2] if len(t) > 2 else {} for t in turns))


def marked(enc: ChatEncoder, c: Conversation) -> str:
    """The rendering, token by token, with supervised tokens in [brackets] (decoded text of each token)."""
    r = enc.encode(c)
    assert not isinstance(r, str)
    pieces = [enc.tokenizer.decode([i]) for i in r.input_ids.tolist()]
    assert "".join(pieces) == enc._render(enc._messages(c), False)  # decoding each token loses nothing
    return "".join(f"[{p}]" if m else p for p, m in zip(pieces, r.loss_mask))


def spans(s: str) -> str:
    """Collapse the per-token brackets of :func:`marked` into one [span] per supervised run."""
    return s.replace("][", "")


CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
TOOL_CONV = conv(
    ("system", "Be brief."),
    ("user", "Weather in Paris?"),
    ("assistant", "", {"reasoning_content": "Need the tool.", "tool_calls": [CALL]}),
    ("tool", '{"temp": 18}'),
    ("assistant", "It is 18 degrees.", {"reasoning_content": "Got it."}),
    ("user", "Thanks"),
    ("assistant", "You are welcome."),
)


def test_multi_turn_without_reasoning(tok):
    enc = encoder(tok)
    c = conv(("user", "Hi"), ("assistant", "Hello!"), ("user", "2+2?"), ("assistant", "4"))
    text = enc._render(enc._messages(c), False)
    assert text == f"{H}<|user|>Hi<|assistant|><think></think>Hello!<|user|>2+2?<|assistant|><think></think>4<|user|>"
    # the empty think block is template boilerplate: never supervised; each answer and its closing <|user|> are
    assert spans(marked(enc, c)) == (f"{H}<|user|>Hi<|assistant|><think></think>[Hello!<|user|>]2+2?"
                                     "<|assistant|><think></think>[4<|user|>]")


def test_reasoning_tool_call_and_observation(tok):
    enc = encoder(tok)
    text = enc._render(enc._messages(TOOL_CONV), False)
    assert text == (
        f"{H}<|system|>Be brief.<|user|>Weather in Paris?"
        "<|assistant|><think>Need the tool.</think><tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call><|observation|>"
        '<tool_response>{"temp": 18}</tool_response>'
        "<|assistant|><think>Got it.</think>It is 18 degrees.<|user|>"
        "Thanks<|assistant|><think></think>You are welcome.<|user|>")
    assert spans(marked(enc, TOOL_CONV)) == (
        f"{H}<|system|>Be brief.<|user|>Weather in Paris?<|assistant|>"
        "[<think>Need the tool.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call><|observation|>]"
        '<tool_response>{"temp": 18}</tool_response><|assistant|>'
        "[<think>Got it.</think>It is 18 degrees.<|user|>]Thanks<|assistant|><think></think>[You are welcome.<|user|>]")


def test_mask_token_by_token(tok):
    """The same policy, asserted on ids: every supervised id and every unsupervised special token."""
    enc = encoder(tok)
    r = enc.encode(TOOL_CONV)
    ids, mask = r.input_ids.tolist(), r.loss_mask.tolist()
    t = {s: tok.convert_tokens_to_ids(s) for s in ("<|assistant|>", "<think>", "</think>", "<|observation|>",
                                                     "<|user|>", "<tool_response>", "</tool_response>")}
    # role tokens that open a turn, tool results and the prompt are never supervised
    assert not any(m for i, m in zip(ids, mask) if i in (t["<|assistant|>"], t["<tool_response>"], t["</tool_response>"]))
    first_user = ids.index(t["<|user|>"])
    assert not any(mask[: first_user + 1])
    # closing tokens: <|observation|> after the tool call and each <|user|> that ends an answer are supervised
    closing = [j for j, i in enumerate(ids) if i in (t["<|observation|>"], t["<|user|>"]) and j != first_user]
    assert [mask[j] for j in closing] == [True, True, True]
    # think tokens: supervised where reasoning is real (2 turns), not in the empty block of the last turn
    thinks = [j for j, i in enumerate(ids) if i in (t["<think>"], t["</think>"])]
    assert [mask[j] for j in thinks] == [True, True, True, True, False, False]
    assert r.num_loss_tokens == sum(mask) and ids[-1] == t["<|user|>"] and mask[-1]


def test_two_tool_results_and_non_string_arguments(tok):
    enc = encoder(tok)
    c = conv(("user", "Go"),
             ("assistant", "Checking.", {"tool_calls": [{"name": "a", "arguments": {"q": [1, "x"]}},
                                                         {"name": "b", "arguments": {}}]}),
             ("tool", "r1"), ("tool", "r2"), ("assistant", "Done", {"reasoning_content": "  both back  "}))
    assert spans(marked(enc, c)) == (
        f"{H}<|user|>Go<|assistant|><think></think>[Checking.<tool_call>a<arg_key>q</arg_key>"
        '<arg_value>[1, "x"]</arg_value></tool_call><tool_call>b</tool_call><|observation|>]'
        "<tool_response>r1</tool_response><tool_response>r2</tool_response>"
        "<|assistant|>[<think>both back</think>Done<|user|>]")


@pytest.mark.parametrize("effort,line", [("low", "Low"), ("HIGH", "High"), ("max", "Max"), ("medium", "Max")])
def test_reasoning_effort_and_tools_header(tok, effort, line):
    enc = encoder(tok, template_kwargs=(("reasoning_effort", effort),))
    c = conv(("user", "Hi"), ("assistant", "Hey"))
    assert enc._render(enc._messages(c), False) == (
        f"{H}<|system|>Reasoning Effort: {line}<|user|>Hi<|assistant|><think></think>Hey<|user|>")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tools=tools, tokenize=False,
                                   add_generation_prompt=True, chat_template=glm_template())
    assert text == (
        f"{H}<|system|># Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(tools[0], ensure_ascii=False) + "\n</tools>\n\n"
        "For each function call, output the function name and arguments in this format:\n"
        "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>...</tool_call>"
        "<|user|>Hi<|assistant|>")


def test_regenerate_prompt_carries_reasoning_effort(tok):
    """Regenerate mode renders through the same template kwargs: the effort line is in the prompt, the
    generation prompt ends at <|assistant|> (the model writes <think> itself), and with policy "every"
    the empty think block of a placeholder answer is not taken for answer text."""
    enc = encoder(tok, template_kwargs=(("reasoning_effort", "high"),))
    c = conv(("user", "Hi"), ("assistant", "Hello!"), ("user", "2+2?"), ("assistant", "4"))
    p = enc.encode_prompt(c, "every")
    dec = [tok.decode(s.tolist()) for s in p.segments]
    assert dec == [f"{H}<|system|>Reasoning Effort: High<|user|>Hi<|assistant|>", "2+2?<|assistant|>"]
    assert p.turn_ends == (tok.convert_tokens_to_ids("<|user|>"),)
    last = enc.encode_prompt(c, "last")
    assert tok.decode(last.segments[0].tolist()) == (
        f"{H}<|system|>Reasoning Effort: High<|user|>Hi<|assistant|><think></think>Hello!<|user|>2+2?<|assistant|>")


BAD_REASONING = conv(("user", "q"), ("assistant", "a", {"reasoning_content": "x</think>y"}))
BAD_ARGS = conv(("user", "q <|assistant|>"),
                ("assistant", "", {"tool_calls": [{"name": "f", "arguments": {"k": "<|user|>"}}]}))


def test_special_text_in_reasoning_or_tool_calls_is_dropped_under_drop(tok):
    enc = encoder(tok, special_text="drop")
    specials = enc.special_strings()
    assert enc.encode(BAD_REASONING, specials) == "special_token_text"
    assert enc.encode(BAD_ARGS, specials) == "special_token_text"


def test_special_text_in_reasoning_or_tool_calls_is_plain_text_by_default(tok):
    enc, keep = encoder(tok), encoder(tok, special_text="keep")
    specials = enc.special_strings()
    for c, typed in ((BAD_REASONING, "</think>"), (BAD_ARGS, "<|user|>"), (BAD_ARGS, "<|assistant|>")):
        rec, forged = enc.encode(c, specials), keep.encode(c, specials)
        token = tok.convert_tokens_to_ids(typed)
        assert int((forged.input_ids == token).sum()) == int((rec.input_ids == token).sum()) + 1, typed
        assert tok.decode(rec.input_ids.tolist()) == tok.decode(forged.input_ids.tolist())  # same text
        supervised = tok.decode(rec.input_ids[rec.loss_mask].tolist())
        assert supervised == tok.decode(forged.input_ids[forged.loss_mask].tolist()), typed  # same span
    text = enc._render(enc._messages(BAD_REASONING), generation_prompt=False)
    whole = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc._tokenize_pieces(text, specials) == (whole["input_ids"], [a for a, _ in whole["offset_mapping"]])


ROWS = [
    # 0: OpenAI messages with reasoning, a tool call (arguments as JSON text) and its result
    {"messages": [{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": None, "reasoning_content": "use tool",
                   "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{\"city\": \"Oslo\"}"}}]},
                  {"role": "tool", "content": "cold"},
                  {"role": "assistant", "content": "Cold."}]},
    # 1: tool result without a call before it
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"},
                  {"role": "tool", "content": "x"}, {"role": "assistant", "content": "b"}]},
    # 2: arguments that are not a JSON object
    {"messages": [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": "[1]"}}]}]},
    # 3: ends on a tool result: trailing turns dropped, the call turn ends the row
    {"messages": [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": "", "tool_calls": [{"name": "w", "arguments": {}}]},
                  {"role": "tool", "content": "x"}]},
    # 4: plain row (no reasoning / tools): the unchanged path, which merges same-role turns
    {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}, {"from": "gpt", "value": "c"}]},
    # 5: a call followed by a user turn instead of its result
    {"messages": [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": "", "tool_calls": [{"name": "w", "arguments": {}}]},
                  {"role": "user", "content": "hm"}, {"role": "assistant", "content": "b"}]},
]


def test_structured_rows(tmp_path):
    path = tmp_path / "agentic.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    stats = ReadStats()
    got = {c.row_index: c for c in iter_conversations(resolve_dataset(str(path)), stats)}
    assert sorted(got) == [0, 3, 4]
    assert stats.skipped == {"turn_order": 2, "malformed_tool_call": 1}
    assert stats.normalized == {"trailing_user_removed": 1, "same_role_merged": 1}
    assert got[0].messages == (("user", "Weather?"), ("assistant", ""), ("tool", "cold"), ("assistant", "Cold."))
    assert got[0].extras == ({}, {"reasoning_content": "use tool", "tool_calls": [{"name": "w", "arguments": {"city": "Oslo"}}]},
                             {}, {})
    assert got[3].messages == (("user", "q"), ("assistant", ""))
    assert got[4].messages == (("user", "a\n\nb"), ("assistant", "c")) and got[4].extras == ()
    stats = ReadStats()
    assert sorted(c.row_index for c in iter_conversations(resolve_dataset(str(path)), stats, alternation="skip")) == [0]


def test_structured_row_renders_and_masks(tmp_path, tok):
    path = tmp_path / "agentic.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    (c,) = iter_conversations(resolve_dataset(str(path)), ReadStats())
    assert spans(marked(encoder(tok), c)) == (
        f"{H}<|user|>Weather?<|assistant|>[<think>use tool</think><tool_call>w<arg_key>city</arg_key>"
        "<arg_value>Oslo</arg_value></tool_call><|observation|>]<tool_response>cold</tool_response>"
        "<|assistant|><think></think>[Cold.<|user|>]")


def test_glm_preset_uses_the_packaged_template(tmp_path):
    """``--target glm-5.3 --model-path DIR`` renders with capture/templates/glm.jinja even when the folder's
    tokenizer carries another template (a config-only folder of the preset's shape: nothing is loaded but
    the tokenizer); ``--chat-template`` still wins."""
    from capture.config import RunConfig
    from capture.plan import prepare

    folder = tmp_path / "GLM-5.3"
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.content }}<|user|>{% endfor %}"
    tok.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "num_hidden_layers": 78,
                                                    "hidden_size": 6144, "kv_lora_rank": 512}))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n")
    prep = prepare(RunConfig(out=str(tmp_path / "out"), target="glm-5.3", model_path=str(folder), dataset=str(data),
                             engine="hf"))
    assert prep.encoder.template == glm_template()
    assert prep.encoder.boilerplate == tuple(tok.convert_tokens_to_ids(["<think>", "</think>"]))
    other = tmp_path / "other.jinja"
    other.write_text(tok.chat_template)
    prep = prepare(RunConfig(out=str(tmp_path / "out"), target="glm-5.3", model_path=str(folder), dataset=str(data),
                             engine="hf", chat_template=str(other)))
    assert prep.encoder.template == tok.chat_template and prep.encoder.boilerplate == ()
