"""Online RL's prompt data (shardlm.data.prompts): records and chat data as PromptRows, the prompt cache, and the
run's prompt splits (build, its refusals)."""

from __future__ import annotations

import pytest

from shardlm.config import DataConfig
from shardlm.data.formats import BadExample
from shardlm.data.prompts import prompt_rows, prompt_token_ids
from shardlm.tokenizer import byte_tokenizer, set_chat_template

CHAT = [{"messages": [{"role": "user", "content": "Reverse: abc"}, {"role": "assistant", "content": "cba"}],
         "task": "reverse"},
        {"messages": [{"role": "user", "content": "Upper: ab"}, {"role": "assistant", "content": "AB"}],
         "task": "upper", "extra": 1}]


@pytest.fixture(scope="module")
def tok():
    t = byte_tokenizer()
    set_chat_template(t, "chatml")
    return t


def test_records_in_memory(tok):
    """Chat data's last answer becomes `answer`; the ids are the rendered prompt's with its generation prompt; the
    fields are those every record holds; a held-out share indexes the same set."""
    rows = prompt_rows(CHAT, tok, DataConfig(), where="mem")
    assert len(rows) == 2 and rows.field_names == ["task", "answer"]
    assert rows.prompt(1).fields == {"answer": "AB", "task": "upper", "extra": 1}
    assert rows.prompt(0).prompt == CHAT[0]["messages"][:1] and rows.where(1) == "mem:2"
    assert rows.token_ids(0) == prompt_token_ids(tok, rows.prompt(0))
    assert rows.max_prompt_tokens == max(len(rows.token_ids(i)) for i in range(2))
    tail = rows.share(1)
    assert len(tail) == 1 and tail.token_ids(0) == rows.token_ids(1) and tail.where(0) == "mem:2"
    with pytest.raises(BadExample, match="mem:2: no 'prompt'"):
        prompt_rows([CHAT[0], {"question": "x"}], tok, DataConfig(), where="mem")
    skipped = prompt_rows([CHAT[0], {"question": "x"}], tok, DataConfig(on_bad_example="skip"), where="mem")
    assert len(skipped) == 1
