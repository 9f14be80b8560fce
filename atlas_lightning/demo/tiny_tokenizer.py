"""The tiny model's tokenizer: byte-level BPE trained locally, ChatML, Qwen3's tool-call template.

- Pre-tokenization as Qwen2/Qwen3 (the same split regex, digits one by one, then byte-level), so
  any text, any unicode, encodes; no normalizer, so ``decode(encode(text)) == text`` exactly.
- Special tokens (skipped by ``decode(..., skip_special_tokens=True)``): ``<|endoftext|>``
  (pad), ``<|im_start|>``, ``<|im_end|>`` (eos). Added, non-special tokens (kept when decoding,
  as in Qwen3, so the runtime can parse the decoded text): ``<tool_call>``, ``</tool_call>``,
  ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``. Each is one id.
- ``CHAT_TEMPLATE`` is Qwen3's Hermes template: the tools' JSON schemas inside
  ``<tools></tools>`` in the system turn, assistant ``tool_calls`` as ``<tool_call>`` JSON, tool
  results as a user turn wrapped in ``<tool_response>\\n...\\n</tool_response>``, and
  ``add_generation_prompt`` opening ``<|im_start|>assistant\\n``.

Who calls it: ``tiny_model.build_tiny_model``.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from atlas_lightning.demo.tiny_corpus import SPECIAL_TOKENS, TOOL_TOKENS, build_corpus

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
#: Total vocabulary, added tokens included (the model's embedding has exactly this many rows).
VOCAB_SIZE = 2048

# Qwen2/Qwen3's pre-tokenizer split: contractions, words with one leading non-letter, single
# digits, punctuation runs, newlines, other whitespace.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def train_tokenizer(seed: int = 0) -> Tokenizer:
    """Train the byte-level BPE on ``tiny_corpus.build_corpus(seed)`` and add the special tokens.

    Ids: the 256 byte symbols and the merges first, then ``SPECIAL_TOKENS`` and ``TOOL_TOKENS``
    in that order, ``VOCAB_SIZE`` in all. Deterministic in ``seed``. Raises ``RuntimeError`` if the
    corpus is too small to reach ``VOCAB_SIZE`` (the model's embedding must match exactly).
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    added = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - added,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(build_corpus(seed), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"tiny tokenizer has {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}: the corpus "
            "no longer supports enough merges (tiny_corpus.py)"
        )
    return tokenizer


def to_transformers(tokenizer: Tokenizer, model_max_length: int):
    """Wrap for ``save_pretrained``: eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos, the chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
