"""Token-level chat format of an episode: the prompt from the tokenizer's chat template, the
tool-response turns as the Qwen/Hermes template renders them, and the stop token.

Generated tokens are never decoded and re-encoded into the sequence: ``decode_turn`` turns them
into text only for the runtime to parse; the sequence keeps the engine's token IDs. Tool
responses are encoded here and appended with response mask 0.
"""

from __future__ import annotations

from functools import cached_property

# Qwen3 / Hermes ChatML: a tool result is a user turn wrapped in <tool_response> tags.
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"


class ChatFormat:
    """Wraps a Hugging Face tokenizer that has the ChatML special tokens."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        missing = [t for t in (IM_START, IM_END, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)
                   if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
        if missing:
            raise ValueError(f"tokenizer lacks the chat tokens {missing}: it cannot serve Hermes tool calls")

    def check_template(self) -> None:
        """The chat template renders a conversation with ``tools=`` and shows the tools in it;
        ``ValueError`` saying what it does otherwise (a template that fails to parse or render
        would stop the first rollout, one that drops the tools would train on prompts that never
        name them)."""
        tool = {"type": "function", "function": {"name": "template_check_tool", "description": "a check",
                                                 "parameters": {"type": "object", "properties": {}}}}
        try:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": "check"}], tools=[tool],
                                                      add_generation_prompt=True, tokenize=False)
        except Exception as err:  # jinja's or the tokenizer's error, whatever its type
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            raise ValueError(f"its chat template cannot render a conversation ({type(err).__name__}: {first})") from None
        if "template_check_tool" not in str(text):
            raise ValueError("its chat template does not render the tools passed as tools=: the prompts would not "
                             "name explore and submit (a Hermes tool-calling template, as Qwen3's, is needed)")
        # the tool responses are appended as ChatML turns (``tool_response_ids``): the prompt must be one too
        if f"{IM_START}user\n" not in str(text) or not str(text).rpartition(IM_START)[2].startswith("assistant\n"):
            raise ValueError(f"its chat template does not render ChatML turns ({IM_START}user ... and a last "
                             f"{IM_START}assistant header): the prompts would not match the tool responses the "
                             f"runtime appends (a Qwen3-style template is needed)")

    @cached_property
    def stop_token_ids(self) -> tuple[int, ...]:
        """A turn ends at ``<|im_end|>`` (and at the tokenizer's EOS where that differs)."""
        ids = {self.tokenizer.convert_tokens_to_ids(IM_END)}
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def prompt_ids(self, messages: list[dict], tools: list[dict]) -> list[int]:
        """The prompt up to and including the assistant header (``add_generation_prompt``)."""
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def decode_turn(self, token_ids: list[int]) -> str:
        """Text of one generated turn for the runtime's parser, without its final stop token.
        Invalid UTF-8 pieces become U+FFFD; special tokens the model typed stay visible as text."""
        if token_ids and token_ids[-1] in self.stop_token_ids:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def tool_response_ids(self, content: str, turn_closed: bool) -> list[int]:
        """Tokens that follow an assistant turn: the tool response as a user turn, then the next
        assistant header. ``turn_closed``: the turn ended with ``<|im_end|>`` already."""
        text = (
            ("" if turn_closed else IM_END)
            + f"\n{IM_START}user\n{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}{IM_END}\n"
            + f"{IM_START}assistant\n"
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))
