"""Chat templates render exactly as transformers' apply_chat_template, and reject bad messages clearly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardline.core.text.chat_template import ChatTemplate, ChatTemplateError

CONVERSATIONS = {
    "system_and_user": [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Where is the treasure? <b>&</b>"},
    ],
    "user_only": [{"role": "user", "content": "Hello! 你好 😀"}],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And\n\ttimes 3?"},
    ],
}


@pytest.fixture(scope="module")
def template(tokenizer) -> ChatTemplate:
    return ChatTemplate(tokenizer.chat_template, tokenizer.backend.id_to_token(1), tokenizer.backend.id_to_token(2))


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_model_matches_transformers(template, hf_tokenizer, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_default_model_prompt_text(template):
    assert template.render(CONVERSATIONS["user_only"]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHello! 你好 😀<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_features_match_transformers(hf_tokenizer):
    # trim_blocks/lstrip_blocks, bos/eos, tojson without HTML escaping, loop controls,
    # {% generation %}, extra keyword arguments and the tools default.
    source = (
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "  {% generation %}[{{ m.role }}] {{ m | tojson }}{% endgeneration %}\n"
        "{% endfor %}\n"
        "{% if tools is none %}no tools{% endif %}{{ greeting | default('') }}{{ eos_token }}"
    )
    messages = [*CONVERSATIONS["system_and_user"], {"role": "assistant", "content": "Arr"}]
    ours = ChatTemplate(source, "<|im_start|>", "<|im_end|>").render(messages, greeting="ahoy")
    expected = hf_tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False, greeting="ahoy")
    assert ours == expected
    assert ours.startswith('<|im_start|>[system] {"role": "system"')  # blocks left no blank or newline
    assert "<b>&</b>" in ours and "Arr" not in ours  # not HTML-escaped; the third message cut by {% break %}
    assert ours.endswith("no toolsahoy<|im_end|>")


def test_strftime_now_is_available():
    rendered = ChatTemplate("{{ strftime_now('%Y') }}", None, None).render(CONVERSATIONS["user_only"])
    assert re.fullmatch(r"\d{4}", rendered)


def test_raise_exception_becomes_chat_template_error():
    source = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="Conversation must start with user"):
        ChatTemplate(source, None, None).render(CONVERSATIONS["system_and_user"])


def test_sandbox_blocks_python_internals():
    source = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source, None, None).render(CONVERSATIONS["user_only"])


@pytest.mark.parametrize("template_source", [None, ""])
def test_model_without_template(template_source):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate(template_source, None, None)


def test_template_that_does_not_compile():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", None, None)


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be an object"),
        ([{"content": "a"}], r"messages\[0\]\.role is missing"),
        ([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}], r"messages\[1\]\.role .* not a string"),
        ([{"role": "user"}], r"messages\[0\]\.content is missing"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content must be a string"),
    ],
)
def test_malformed_messages(template, messages, error):
    with pytest.raises(ChatTemplateError, match=error):
        template.render(messages)


def test_assistant_tool_call_may_have_null_content():
    source = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": []}]
    assert ChatTemplate(source, None, None).render(messages) == "user:hi;assistant:None;"


def test_tool_call_format_is_read_off_the_template(template):
    folder = Path(__file__).parent
    hermes = ChatTemplate((folder / "hermes_tool_template.jinja").read_text(), "<s>", "</s>")
    llama3 = ChatTemplate((folder / "llama3_tool_template.jinja").read_text(), "<|begin_of_text|>", "<|eot_id|>")
    assert (hermes.tool_call_format, llama3.tool_call_format, template.tool_call_format) == (
        "hermes",
        "llama3_json",
        "",
    )
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}
            ],
        },
        {"role": "tool", "content": "12:00", "tool_call_id": "c1"},
        {"role": "user", "content": "And now?"},
    ]
    prompt = llama3.render(messages, tools=tools)
    assert '{"name": "get_time", "parameters": {"tz": "UTC"}}<|eot_id|>' in prompt and '"name": "get_time"' in prompt


@pytest.mark.parametrize("content", ["Twelve, because", "Step 1:\n", "The red ", "end", ">", "", "2+2?"])
def test_continue_final_message_matches_transformers(template, hf_tokenizer, content):
    """Trailing blanks kept, text the template also writes after it ("end" of "<|im_end|>"), empty
    content, text said earlier in the conversation: cut where transformers cuts."""
    messages = [*CONVERSATIONS["multi_turn"], {"role": "assistant", "content": content}]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert template.render(messages, add_generation_prompt=False, continue_final_message=True) == expected
    assert expected.endswith("<|im_start|>assistant\n" + content)
    with pytest.raises(ChatTemplateError, match="continue_final_message"):
        ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}", None, None).render(
            messages, add_generation_prompt=False, continue_final_message=True
        )


def test_template_failures_on_odd_variables_are_chat_template_errors():
    source = "{{ 'Today: ' + date_string }}{% for d in documents %}{{ d.title + '!' }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate(source, None, None).render([{"role": "user", "content": "x"}], variables={"date_string": 5})
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate(source, None, None).render(
            [{"role": "user", "content": "x"}], variables={"date_string": "now", "documents": [{"title": 1}]}
        )
    # A variable named like render's own parameters ("self") breaks nothing.
    assert (
        ChatTemplate("{{ greeting }}", None, None).render(
            [{"role": "user", "content": "x"}], variables={"self": 1, "greeting": "hi"}
        )
        == "hi"
    )
