"""A tiny chat model for tests of ``vllm serve``: the engine tests' seeded random
Llama (``engine_support.make_model``) plus a byte-level tokenizer and a chat
template written here, so that the OpenAI chat, Anthropic Messages and
tool-calling endpoints run on it.

The tokenizer has exactly the model's 1,000 ids: ``<unk>`` 0, ``<s>`` 1, ``</s>``
2, the 256 bytes (byte-level, no merges), the role markers, the two tokens
vLLM's ``hermes`` tool parser looks for, and filler tokens for
the rest, so that any id the random model samples decodes. Tool calls come from
vLLM's structured output (``tool_choice="required"`` or a named tool): the
grammar masks every id but the bytes of valid JSON, so the random model still
writes a well-formed call.

Owns: the tokenizer, the template and the model directory.
Must not: depend on vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

from .engine_support import TINY_LLAMA, make_model

ROLES = ("system", "developer", "user", "assistant", "tool")

# Messages as "<|role|>text"; an assistant's tool calls as "<call>name args</call>";
# the tools offered, by name, before the first message.
CHAT_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t['function']['name'] if 'function' in t else t['name'] }};"
    "{% endfor %}</tools>{% endif -%}"
    "{%- for m in messages -%}<|{{ m['role'] }}|>"
    "{%- if m['content'] is string %}{{ m['content'] }}"
    "{%- elif m['content'] %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif -%}"
    "{%- if m.get('tool_calls') %}{% for t in m['tool_calls'] %}<call>{{ t['function']['name'] }} "
    "{{ t['function']['arguments'] }}</call>{% endfor %}{% endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt %}<|assistant|>{% endif -%}"
)


def make_chat_model(directory: Path, config: dict | None = None) -> Path:
    """The random tiny Llama in ``directory`` with a tokenizer and chat template (reused when there).
    ``config``: another Llama shape with the same ``vocab_size`` (default: ``TINY_LLAMA``)."""
    if (directory / "tokenizer.json").exists():
        return directory
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if config is not None and config.get("vocab_size") != TINY_LLAMA["vocab_size"]:
        raise ValueError(f"chat model config: vocab_size must be {TINY_LLAMA['vocab_size']} (the tokenizer's)")
    make_model(directory, config=config)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in pre_tokenizers.ByteLevel.alphabet():
        vocab[ch] = len(vocab)
    specials = [f"<|{r}|>" for r in ROLES] + ["<tool_call>", "</tool_call>"]  # vLLM's hermes tool parser wants these
    for tok in specials:
        vocab[tok] = len(vocab)
    while len(vocab) < TINY_LLAMA["vocab_size"]:
        vocab[f"<x{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   additional_special_tokens=specials)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return directory


if __name__ == "__main__":
    import sys

    print(make_chat_model(Path(sys.argv[1])))
