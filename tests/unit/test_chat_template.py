"""Chat templates: where they are found, how they render, continuation, and the sandbox."""

from __future__ import annotations

import json

import pytest

from kettle.router.chat_template import ChatTemplate
from kettle.router.errors import TemplateError
from tests.fixtures import CHATML_TEMPLATE

USER = [{"role": "user", "content": "Hi"}]


def test_chatml_rendering_with_generation_prompt():
    template = ChatTemplate(CHATML_TEMPLATE)
    assert template.render(USER) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_a_trailing_assistant_message_is_continued():
    template = ChatTemplate(CHATML_TEMPLATE)
    messages = [*USER, {"role": "assistant", "content": "Hello, I am"}]
    # No end-of-turn after the partial answer and no new assistant turn: the model goes on writing it.
    assert template.render(messages) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello, I am"


def test_special_tokens_and_helpers_are_available():
    source = "{{ bos_token }}{{ messages | tojson }}{{ strftime_now('%Y') | length }}{{ eos_token }}"
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    assert template.render([{"role": "user", "content": "é<"}]) == '<s>[{"role": "user", "content": "é<"}]4</s>'


def test_raise_exception_is_a_template_error():
    template = ChatTemplate("{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(TemplateError, match="Conversation roles must alternate") as caught:
        template.render(USER)
    assert caught.value.message == "Template error: Conversation roles must alternate"
    assert caught.value.status == 422 and caught.value.error_type == "template_error"


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__ }}",  # reaching Python internals
        "{{ messages.append(1) }}",  # mutating what the server passed in
        "{{ ''.__class__.__subclasses__() }}",
    ],
)
def test_the_sandbox_refuses_unsafe_access(source):
    with pytest.raises(TemplateError):
        ChatTemplate(source).render(USER)


def test_a_template_that_does_not_parse_fails_when_used():
    template = ChatTemplate("{% for %}")
    with pytest.raises(TemplateError):
        template.render(USER)


def test_load_order_and_missing_template(tmp_path):
    assert ChatTemplate.load(tmp_path) is None
    config = {"chat_template": "config", "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = ChatTemplate.load(tmp_path)
    assert loaded is not None and loaded.source == "config"
    assert (loaded.bos_token, loaded.eos_token) == ("<s>", "</s>")
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "json"}]
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": named}))
    assert ChatTemplate.load(tmp_path).source == "json"
    (tmp_path / "chat_template.jinja").write_text("jinja")
    assert ChatTemplate.load(tmp_path).source == "jinja"


def test_tokenizer_config_path_overrides_the_folder(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "folder"}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"chat_template": "override"}))
    assert ChatTemplate.load(tmp_path, str(other)).source == "override"
