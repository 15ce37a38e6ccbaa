"""Tokenizers: the bundled GPT-2 BPE, a byte-level one, or any Hugging Face tokenizer.

The byte-level tokenizer is a real `PreTrainedTokenizerFast` (byte-level BPE with no merges: ids 0-255
are the bytes, 256 is `<|endoftext|>`), so it saves, exports and reloads like any HF tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from shardlm import ShardlmError
from shardlm.config import ModelConfig
from shardlm.hub import hub_kwargs, hub_reachable

ASSETS = Path(__file__).parent / "assets"
BUNDLED_GPT2 = ASSETS / "gpt2-tokenizer"
EOS = "<|endoftext|>"
GPT2_NAMES = {"gpt2", "openai-community/gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl",
              "openai-community/gpt2-medium", "openai-community/gpt2-large", "openai-community/gpt2-xl"}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the alphabet of byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab[EOS] = 256
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    tok.model_max_length = 1 << 30
    tok.name_or_path = "bytes"
    return tok


def load_tokenizer(spec: str, trust_remote_code: bool = False):
    """`bytes`, `gpt2` (bundled, identical to the hub's), a local folder, or a hub name."""
    from transformers import AutoTokenizer

    if spec == "bytes":
        return byte_tokenizer()
    folder = BUNDLED_GPT2 if spec in GPT2_NAMES else Path(spec).expanduser()
    source = str(folder) if folder.exists() else spec
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **hub_kwargs(source))
    except (OSError, ValueError) as e:
        if folder.exists() or hub_reachable():
            why = str(e).splitlines()[0]
        else:
            why = "not a local folder, the Hugging Face Hub cannot be reached and it is not in the local HF cache."
        raise ShardlmError(
            f"cannot load tokenizer '{spec}': {why} "
            "Use model.tokenizer=gpt2 (bundled), bytes, or a local folder holding tokenizer files."
        ) from None
    if tok.eos_token is None:
        raise ShardlmError(f"tokenizer '{spec}' has no EOS token; shardlm separates documents with it.")
    return tok


def tokenizer_spec(model: ModelConfig) -> str:
    """`model.tokenizer` with null resolved: the model's own when fine-tuning, bytes from scratch."""
    if model.tokenizer is not None:
        return model.tokenizer
    return model.name if model.name is not None else "bytes"


def model_tokenizer(model: ModelConfig):
    """The run's tokenizer. Unset, a pretrained model's own: training a BPE model on other ids would run
    without complaint and learn nothing, so the default is never a different tokenizer. A mistyped model
    path is reported as such first, not as a tokenizer that cannot be loaded."""
    from shardlm.hub import check_model_path

    if model.name is not None:
        check_model_path(model.name)
    spec = tokenizer_spec(model)
    try:
        tok = load_tokenizer(spec, model.trust_remote_code)
    except ShardlmError as e:
        if model.tokenizer is not None:
            raise
        raise ShardlmError(f"the tokenizer of model '{model.name}' (model.tokenizer is unset, so the model's own "
                           f"is used) could not be loaded: {str(e).split(': ', 1)[-1]} Set model.tokenizer to the "
                           "model's tokenizer (a folder or hub name).") from None
    set_chat_template(tok, model.chat_template)
    return tok


CHATML = ("{%- for message in messages -%}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
          "{%- endif -%}")
# No new tokens: for a pretrained model whose vocabulary has no room for ChatML's two
PLAIN = ("{%- for message in messages -%}{%- if message['role'] == 'system' -%}{{ message['content'] + '\n\n' }}"
         "{%- elif message['role'] == 'user' -%}{{ 'User: ' + message['content'] + '\n' }}"
         "{%- elif message['role'] == 'assistant' -%}{{ 'Assistant: ' + message['content'] + eos_token + '\n' }}"
         "{%- else -%}{{ raise_exception('the plain chat template has no role ' + message['role']) }}{%- endif -%}"
         "{%- endfor -%}{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}")
BUILTIN_TEMPLATES = {"chatml": (CHATML, ["<|im_start|>", "<|im_end|>"]), "plain": (PLAIN, [])}


def set_chat_template(tok, spec: str | None) -> None:
    """`model.chat_template`: a built-in (`chatml` adds its two special tokens when the tokenizer lacks them) or a
    Jinja file, set on the tokenizer so that checkpoints and exports carry it. None keeps the tokenizer's own."""
    if spec is None:
        return
    if spec in BUILTIN_TEMPLATES:
        text, tokens = BUILTIN_TEMPLATES[spec]
        missing = [t for t in tokens if t not in tok.get_vocab()]
        if missing:
            tok.add_special_tokens({"additional_special_tokens": missing})
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ShardlmError(f"model.chat_template={spec!r} is neither a built-in ({', '.join(BUILTIN_TEMPLATES)}) "
                               "nor a file. Give a .jinja file holding a chat template, or a built-in name.")
        text = path.read_text(encoding="utf-8")
    tok.chat_template = text


def end_of_turn_id(tok) -> int:
    """The token that ends an assistant turn under the chat template (`<|im_end|>`, `<|eot_id|>`,
    `<end_of_turn>`, ...): the first token the template writes after an answer, when it is a special token;
    else EOS. Generation of a chat answer stops there."""
    if not getattr(tok, "chat_template", None):
        return tok.eos_token_id
    marker = "\ue000answer\ue001"
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                                       tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe: fall back to EOS
        return tok.eos_token_id
    after = tok(text[text.find(marker) + len(marker):].lstrip(" "), add_special_tokens=False)["input_ids"]
    return after[0] if after and after[0] in tok.all_special_ids else tok.eos_token_id


def template_fingerprint(tok) -> str:
    """A hash of the chat template (keys the example cache: a new template renders other ids)."""
    return hashlib.sha256(str(getattr(tok, "chat_template", None) or "").encode()).hexdigest()[:16]


def fingerprint(tok) -> str:
    """A hash that changes when the tokenizer would produce different ids (keys the token cache)."""
    state = tok.backend_tokenizer.to_str() if hasattr(tok, "backend_tokenizer") else json.dumps(tok.get_vocab())
    return hashlib.sha256(state.encode()).hexdigest()[:16]
