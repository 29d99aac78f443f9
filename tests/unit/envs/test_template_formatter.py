"""Episodes rendered with the model's own chat template (``environment.formatter: template``).

The templates below are written in the spirit of real ones (Qwen2.5's ChatML with
``<tool_response>``, Llama-3.1's headers and default system block, a Zephyr-style
template with a default system prompt, Gemma's, Qwen3's reasoning handling, and
templates that rewrite earlier turns); tokenizers are built in code, nothing is
downloaded. The key property: the template's rendering of a whole conversation is
exactly the prompt, the model's turns and the formatter's replies concatenated, as
the rollout driver builds them.
"""

from __future__ import annotations

import json
import string

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asyncrl.config.environment import EnvironmentConfig
from asyncrl.generation.envs import (
    ChatMLFormatter,
    Codec,
    PlainTextFormatter,
    ToolEnvironment,
    run_episode,
)
from asyncrl.generation.envs.formatting import (
    TemplateFormatError,
    TemplateFormatter,
    build_formatter,
)
from asyncrl.generators.episodes import Episodes

QWEN25 = """\
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3 = """\
{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: " + date_string + "\\n\\n" }}
{{- system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + \
message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

DEFAULT_SYSTEM = """\
{%- if messages[0]['role'] != 'system' %}
    {{- '<|system|>\\nYou are a friendly assistant.' + eos_token + '\\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}
"""

GEMMA = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {{- raise_exception('System role not supported') }}
{%- endif %}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/...') }}
    {%- endif %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}
"""

QWEN3 = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')\
.split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

SYSTEM_FOLDED_INTO_LAST_USER = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' and loop.last and system_message is defined %}
        {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'tool' %}
        {{- '[TOOL_RESULTS] ' + message['content'] + '[/TOOL_RESULTS]' }}
    {%- else %}
        {{- message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""

EARLIER_ANSWERS_HIDDEN = """\
{%- for message in messages %}
    {%- if message.role == 'assistant' and not loop.last %}
        {{- '<|im_start|>assistant\\n(earlier answer)<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

SPECIAL_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<start_of_turn>",
    "<end_of_turn>",
]


def chat_tokenizer(template: str | None, bos: str = "<s>") -> PreTrainedTokenizerFast:
    """Printable ASCII one token per character, the chat markers one token each."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", *string.printable])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token=bos, eos_token="</s>"
    )
    tokenizer.chat_template = template
    return tokenizer


QWEN = chat_tokenizer(QWEN25)
LLAMA = chat_tokenizer(LLAMA3, bos="<|begin_of_text|>")
ZEPHYR = chat_tokenizer(DEFAULT_SYSTEM)

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Use the tools."}
QUESTION = {"role": "user", "content": "What is 6 * 7, and 2 + 2?"}


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def tools(*outputs):
    return [{"role": "tool", "content": output} for output in outputs]


EXCHANGES = [  # (the model's turn, the environment's reply)
    (
        call("calculator", expression="6 * 7") + "\n" + call("calculator", expression="2+2"),
        tools("42", "4"),
    ),
    ("Both done. Anything else?", [{"role": "user", "content": "Say it in words."}]),
    (call("calculator", expression="40 + 2"), tools("42")),
]


def driver_text(formatter, prompt, exchanges, closed_by_model):
    """Prompt, turns and replies, concatenated as the rollout driver builds them.

    ``closed_by_model[i]``: turn i's tokens end with the end-of-turn marker (the
    backend kept it); else the stop string was cut and the reply must close the turn."""
    text = formatter.render_prompt(prompt)
    for (turn, reply), closed in zip(exchanges, closed_by_model, strict=True):
        generated = turn + formatter.end_of_turn if closed else turn
        text += generated + formatter.render_reply(reply, generated)
    return text


def template_text(tokenizer, prompt, exchanges):
    """The whole conversation rendered by the template, ending with the next turn's cue."""
    messages = list(prompt)
    for turn, reply in exchanges:
        messages += [{"role": "assistant", "content": turn}, *reply]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize(
    ("tokenizer", "end_of_turn"),
    [(QWEN, "<|im_end|>"), (LLAMA, "<|eot_id|>"), (ZEPHYR, "</s>")],
    ids=["qwen2.5", "llama3", "default-system"],
)
@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
def test_a_whole_conversation_is_the_prompt_turns_and_replies_concatenated(
    tokenizer, end_of_turn, system
):
    formatter = TemplateFormatter(tokenizer)
    assert formatter.end_of_turn == end_of_turn
    prompt = [SYSTEM, QUESTION] if system else [QUESTION]
    expected = template_text(tokenizer, prompt, EXCHANGES)
    for closed in ([True, True, True], [False, False, False], [True, False, True]):
        assert driver_text(formatter, prompt, EXCHANGES, closed) == expected


def test_the_template_supplies_its_default_system_prompt_and_turn_markers():
    prompt = TemplateFormatter(ZEPHYR).render_prompt([QUESTION])
    assert prompt.startswith("<|system|>\nYou are a friendly assistant.</s>\n<|user|>\n")
    llama = TemplateFormatter(LLAMA)
    assert llama.render_prompt([QUESTION]).startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge"
    )
    reply = llama.render_reply(tools("42"), "x<|eot_id|>")
    assert reply == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert llama.render_reply(tools("42"), "x") == "<|eot_id|>" + reply


def test_qwen25_template_agrees_with_chatml_when_the_prompt_has_a_system_message():
    """The built-in tool environment always starts with a system message: there the
    two formatters give the same text, tool responses grouped in one user turn.
    Without one, the template adds Qwen's default system prompt and ChatML does not."""
    template, chatml = TemplateFormatter(QWEN), ChatMLFormatter()
    prompt = ToolEnvironment(["calculator"]).reset({"prompt": [QUESTION]})
    assert template.render_prompt(prompt) == chatml.render_prompt(prompt)
    for _, reply in EXCHANGES:
        for turn in ("x<|im_end|>", "x"):
            assert template.render_reply(reply, turn) == chatml.render_reply(reply, turn)
    assert chatml.render_prompt([QUESTION]) == (
        "<|im_start|>user\nWhat is 6 * 7, and 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert template.render_prompt([QUESTION]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n" + chatml.render_prompt([QUESTION])
    )


def test_qwen3_keeps_reasoning_in_tool_loops_and_the_driver_keeps_it_after_user_replies():
    """Qwen3's template keeps an assistant turn's <think> block while tool results come
    back (the rendering matches the driver's), but drops it from turns before a new user
    message: the driver never re-renders, so there it keeps what the model generated."""
    qwen3 = chat_tokenizer(QWEN3)
    formatter = TemplateFormatter(qwen3)
    think = "<think>\nMultiply first.\n</think>\n\n"
    tool_loop = [(think + call("calculator", expression="6*7"), tools("42"))]
    expected = template_text(qwen3, [SYSTEM, QUESTION], tool_loop)
    assert driver_text(formatter, [SYSTEM, QUESTION], tool_loop, [True]) == expected
    assert "Multiply first." in expected

    feedback = [(think + "42", [{"role": "user", "content": "And 2 + 2?"}])]
    ours = driver_text(formatter, [SYSTEM, QUESTION], feedback, [True])
    assert "Multiply first." in ours
    assert "Multiply first." not in template_text(qwen3, [SYSTEM, QUESTION], feedback)


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_setting():
    for template, what in [
        (SYSTEM_FOLDED_INTO_LAST_USER, "[INST]"),
        (EARLIER_ANSWERS_HIDDEN, "(earlier answer)"),
    ]:
        tokenizer = chat_tokenizer(template)
        tokenizer.name_or_path = "acme/rewriter-7b"
        with pytest.raises(TemplateFormatError) as caught:
            TemplateFormatter(tokenizer)
        message = str(caught.value)
        assert "environment.formatter" in message and "acme/rewriter-7b" in message
        assert "the prefix changed" in message and what in message


def test_no_chat_template_is_refused_and_auto_falls_back_to_chatml():
    tokenizer = chat_tokenizer(None)
    with pytest.raises(TemplateFormatError, match=r"environment\.formatter.*no chat template"):
        TemplateFormatter(tokenizer)
    with pytest.raises(TemplateFormatError, match="no chat template"):
        build_formatter("template", tokenizer)
    assert isinstance(build_formatter("auto", tokenizer), ChatMLFormatter)
    assert isinstance(build_formatter("auto", QWEN), TemplateFormatter)
    assert isinstance(build_formatter("plain"), PlainTextFormatter)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        build_formatter("template")


def test_a_template_without_an_end_of_turn_marker_is_refused():
    tokenizer = chat_tokenizer(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(TemplateFormatError, match="no end-of-turn marker"):
        TemplateFormatter(tokenizer)


def test_a_template_that_refuses_tool_messages_fails_only_on_a_tool_reply():
    """Gemma's template takes no system message and only alternating user/model turns:
    user feedback works, a tool reply is an error that names the role."""
    formatter = TemplateFormatter(chat_tokenizer(GEMMA))
    assert formatter.end_of_turn == "<end_of_turn>"
    reply = formatter.render_reply([{"role": "user", "content": "Lower."}], "50<end_of_turn>")
    assert reply == "\n<start_of_turn>user\nLower.<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(TemplateFormatError, match=r"'tool' message.*must alternate"):
        formatter.render_reply(tools("42"), "x<end_of_turn>")


def test_a_generator_replica_takes_the_end_of_turn_from_the_template_or_refuses_at_start():
    config = EnvironmentConfig(name="tools", tools=["calculator"], formatter="template")
    episodes = Episodes(config, LLAMA, max_tokens_per_turn=16)
    try:
        assert episodes.end_of_turn == "<|eot_id|>"
    finally:
        episodes.close()
    auto = Episodes(config.model_copy(update={"formatter": "auto"}), ZEPHYR, 16)
    try:
        assert auto.end_of_turn == "</s>"
    finally:
        auto.close()
    with pytest.raises(TemplateFormatError, match="the prefix changed"):
        Episodes(config, chat_tokenizer(EARLIER_ANSWERS_HIDDEN), max_tokens_per_turn=16)


class Scripted:
    """Says its turns in order (closing each with the end marker, as a backend that
    keeps the stop string does); its weights get one version newer per turn."""

    def __init__(self, turns, codec, end):
        self.turns, self.codec, self.end = list(turns), codec, end
        self.outputs: list[list[int]] = []

    def __call__(self, token_ids, max_new_tokens, stop):
        assert self.end in stop
        ids = self.codec.encode(self.turns.pop(0) + self.end)[:max_new_tokens]
        self.outputs.append(ids)
        return ids, [-0.5] * len(ids), [len(self.outputs) - 1] * len(ids)


@pytest.mark.parametrize("tokenizer", [QWEN, LLAMA], ids=["qwen2.5", "llama3"])
def test_an_episode_through_run_episode_is_the_template_rendering_token_for_token(tokenizer):
    formatter = TemplateFormatter(tokenizer)
    codec = Codec.from_hf(tokenizer)
    turns = [call("calculator", expression="6 * 7"), "It is \\boxed{42}."]
    model = Scripted(turns, codec, formatter.end_of_turn)
    env = ToolEnvironment(["calculator"])
    row = {"prompt": [QUESTION], "reward_model": {"ground_truth": "42"}}
    trajectory = run_episode(env, row, model, codec, formatter, max_turns=4)

    assert (trajectory.finish_reason, trajectory.reward, trajectory.num_turns) == ("stop", 1, 2)
    prompt = ToolEnvironment(["calculator"]).reset(row)
    exchanges = [(turns[0], tools("42"))]
    expected = template_text(tokenizer, prompt, exchanges) + turns[1] + formatter.end_of_turn
    assert codec.decode(trajectory.token_ids) == expected
    assert [kind for _, _, kind in trajectory.spans] == ["model", "env", "model"]
    for index, (start, end, kind) in enumerate(trajectory.spans):
        a, b = start - trajectory.prompt_len, end - trajectory.prompt_len
        if kind == "model":
            assert trajectory.token_ids[start:end] == model.outputs[index // 2]
            assert set(trajectory.loss_mask[a:b]) == {1}
            assert set(trajectory.logprobs[a:b]) == {-0.5}
            assert set(trajectory.versions[a:b]) == {index // 2}
        else:
            assert set(trajectory.loss_mask[a:b]) == {0}
            assert set(trajectory.logprobs[a:b]) == {0.0}
            assert set(trajectory.versions[a:b]) == {-1}
            assert codec.decode(trajectory.token_ids[start:end]).startswith(
                "\n" if formatter.end_of_turn == "<|im_end|>" else "<|start_header_id|>"
            )


# ---------------------------------------------------------------- single-turn stop


def test_single_turn_generation_stops_at_the_template_s_turn_marker_when_it_is_not_eos():
    from asyncrl.generators.main import template_end_of_turn

    assert template_end_of_turn(LLAMA) == ["<|eot_id|>"]  # EOS is </s>: the marker is needed
    assert template_end_of_turn(ZEPHYR) == []  # its turns end with EOS itself
    qwen_eos = chat_tokenizer(QWEN25)
    qwen_eos.eos_token = "<|im_end|>"  # as SmolLM2 and Qwen ship it
    assert template_end_of_turn(qwen_eos) == []
    assert template_end_of_turn(chat_tokenizer(None)) == []  # no template: nothing to stop at
    refused = chat_tokenizer(SYSTEM_FOLDED_INTO_LAST_USER)
    assert template_end_of_turn(refused) == []  # turns cannot be told apart: EOS only
