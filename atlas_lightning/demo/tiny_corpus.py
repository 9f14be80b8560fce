"""The text the tiny tokenizer's BPE is trained on, built deterministically from a seed.

It holds what the tiny orchestrator will read and write: the sample's problems, candidate
answers and programs (``sample.generate_questions``), and the runtime's own text, rendered by
``atlas_lightning.env`` for simulated episodes on those questions: system and user prompts, the
tools' JSON schemas, Hermes tool calls (``{"name": "explore", "arguments": {}}``,
``{"name": "submit", "arguments": {"answer": "B"}}``), tool responses with costs (``$0.042``)
and budget lines (``Explore budget: 3/8 used, 5 remaining.``), short reasoning. Frequent strings
therefore become few tokens. When the runtime's wording changes, a rebuilt tokenizer follows it;
an older one still encodes everything (byte-level), only less compactly.

Special and added tokens (``<|im_start|>``, ``<tool_call>``...) are cut out of every text: they
are added to the tokenizer after training, so no merge is spent on them.

Who calls it: ``tiny_tokenizer.train_tokenizer``.
"""

from __future__ import annotations

import json
import random
import re

from atlas_lightning.demo.sample import SAMPLE_COUNTS, generate_questions
from atlas_lightning.questions.schema import Question
from atlas_lightning.env.prompts import system_message, user_message
from atlas_lightning.env.render import budget_line, render_candidate, render_quota_spent
from atlas_lightning.env.tools import tool_schemas

#: Tokens the tokenizer adds after training (``tiny_tokenizer`` imports these).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
_ADDED = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TOOL_TOKENS))
_QUOTA, _MAX_TURNS = 8, 9

_THOUGHTS = (
    "The first candidate is cheap and not very confident. I will explore once more.",
    "Two candidates agree and one of them is expensive and confident, so I will submit.",
    "The cheap answers disagree with each other; an expensive candidate is worth its cost here.",
    "This candidate is confident and the approach looks right. Submitting now saves money.",
    "Nothing revealed so far looks reliable. One more explore.",
    "The budget is almost spent; I will submit the most confident answer.",
    "Both programs handle the edge cases differently; the reviewed one is safer.",
    "The quota is spent, so exploring again reveals nothing. I must submit.",
)


# Everyday words and Python vocabulary, so that text the corpus does not foresee (a user's own
# system prompt, new runtime wording) still tokenizes into whole words.
_COMMON_WORDS = """
the of and to a in is it you that he was for on are with as his they be at one have this from
or had by not word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name
very through just form sentence great think say help low line differ turn cause much mean before
move right boy old too same tell does set three want air well also play small end put home read
hand port large spell add even land here must big high such follow act why ask men change went
light kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn plant cover
food sun four between state keep eye never last let thought city tree cross farm hard start might
story saw far sea draw left late run while press close night real life few north open seem
together next white children begin got walk example ease paper group always music those both mark
often letter until mile river car feet care second book carry took science eat room friend began
idea fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl
usual young ready above ever red list though feel talk bird soon body dog family direct pose leave
song measure door product black short numeral class wind question happen complete ship area half
rock order fire south problem piece told knew pass since top whole king space heard best hour
better true during hundred five remember step early hold west ground interest reach fast verb sing
listen six table travel less morning ten simple several vowel toward war lay against pattern slow
center love person money serve appear road map rain rule govern pull cold notice voice unit power
town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest
correct able pound done beauty drive stood contain front teach week final gave green oh quick
develop ocean warm free minute strong special mind behind clear tail produce fact street inch
multiply nothing course stay wheel full force blue object decide surface deep moon island foot
system busy test record boat common gold possible plane stead dry wonder laugh thousand ago ran
check game shape equate hot miss brought heat snow tire bring yes distant fill east paint language
among candidate solver model cost budget explore submit reveal cheap expensive confident confidence
approach reasoning evidence agree disagree verify estimate probability accuracy reward dollar
def return import for while if elif else print range len list dict set int str float input split
map sorted max min sum enumerate zip append True False None class self lambda yield try except
raise with as from in not and or is pass break continue global assert
"""


def _tool_call(name: str, arguments: dict) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def _episode(rng: random.Random, question: Question) -> list[str]:
    """The texts of one plausible trajectory on ``question``, as the runtime would render them."""
    benchmark = question.benchmark
    texts = [system_message(benchmark, _QUOTA, _MAX_TURNS), user_message(benchmark, question.problem, _QUOTA)]
    order = question.permutations[rng.randrange(len(question.permutations))] if question.permutations else range(len(question.candidates))
    explores = rng.randint(1, min(_QUOTA, len(question.candidates)))
    for k, index in enumerate(list(order)[:explores], start=1):
        if rng.random() < 0.3:
            texts.append(rng.choice(_THOUGHTS))
        texts.append(_tool_call("explore", {}))
        texts.append(render_candidate(benchmark, k, question.candidates[index], k, _QUOTA))
    if explores == _QUOTA and rng.random() < 0.5:
        texts.append(_tool_call("explore", {}))
        texts.append(render_quota_spent(_QUOTA))
    answer = question.ground_truth if benchmark == "gpqa" else f"#{rng.randint(1, explores)}"
    texts.append(_tool_call("submit", {"answer": answer}))
    return texts


def _fixed_texts() -> list[str]:
    """Strings the chat template and the runtime always emit."""
    texts = [
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n",
        '{"name": <function-name>, "arguments": <args-json-object>}',
        "system\n", "user\n", "assistant\n",
    ]
    for benchmark in ("gpqa", "lcb"):
        texts += [json.dumps(schema) for schema in tool_schemas(benchmark)]
    texts += [budget_line(used, _QUOTA) for used in range(_QUOTA + 1)]
    texts += [_tool_call("submit", {"answer": letter}) for letter in "ABCD"]
    texts += [_tool_call("submit", {"answer": f"#{k}"}) for k in range(1, _QUOTA + 1)]
    words = _COMMON_WORDS.split()
    # Twice, with and without a leading space, so every word clears the BPE's min_frequency of 2.
    texts += [" ".join(words), " ".join(words), "\n".join(words), "\n".join(words)]
    return texts


def build_corpus(seed: int = 0, episodes_per_question: int = 2) -> list[str]:
    """Corpus texts in a fixed order: fixed strings, the sample's questions, simulated episodes.

    Deterministic in ``seed`` (the same seed as the sample it is built beside). Added tokens are
    cut out: a text containing ``<tool_call>`` contributes the pieces around it.
    """
    rng = random.Random(f"atlas-corpus/{seed}")
    texts = _fixed_texts()
    for (benchmark, split), count in SAMPLE_COUNTS.items():
        for question in generate_questions(benchmark, split, count, seed):
            texts.append(question.problem)
            texts.extend(candidate.answer for candidate in question.candidates)
            for _ in range(episodes_per_question):
                texts.extend(_episode(rng, question))
    return [piece for text in texts for piece in _ADDED.split(text) if piece]
