"""Context policies on real tokenizers with Qwen2.5's ChatML-with-tools template: the tiny byte-level
tokenizer, and a byte-level BPE with merges trained here on ChatML conversations."""

import asyncio
import json

import pytest

from agent_r1.envs.context import (
    SUMMARY_KEY,
    ContextError,
    ContextRequest,
    PreviousTurn,
    get_context_policy,
    split_turns,
)
from agent_r1.models.tokens import encode_text, render_messages

TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string"}},
                "required": ["word"],
            },
        },
    },
)
SYSTEM = {"role": "system", "content": "You answer questions."}
USER = {"role": "user", "content": "What do 'cat' and 'dog' mean?"}


def call_text(*words: str) -> str:
    return "Let me look.\n" + "\n".join(
        f"<tool_call>\n{json.dumps({'name': 'lookup', 'arguments': {'word': w}})}\n</tool_call>"
        for w in words
    )


def tool_messages(*words: str) -> list[dict]:
    return [{"role": "tool", "name": "lookup", "content": f"{w}: an animal"} for w in words]


def build(policy, tokenizer, messages, previous=None, tools=TOOLS):
    return asyncio.run(policy.build(tokenizer, ContextRequest(tuple(messages), tools, previous)))


def full_ids(tokenizer, messages, tools=TOOLS):
    return encode_text(tokenizer, render_messages(tokenizer, messages, tools=tools))


def run_append_episode(tokenizer, responses, *, eos=True):
    """Drive ``append`` through several turns the way ToolEnv does; return (prompts, messages)."""
    policy = get_context_policy("append")
    messages = [SYSTEM, USER]
    prompt = build(policy, tokenizer, messages)
    prompts = [prompt.token_ids]
    for text, observations in responses:
        response_ids = tuple(encode_text(tokenizer, text)) + ((tokenizer.eos_token_id,) if eos else ())
        previous = PreviousTurn(prompt.token_ids, response_ids, num_messages=len(messages))
        messages = [*messages, {"role": "assistant", "content": text}, *observations]
        prompt = build(policy, tokenizer, messages, previous)
        assert prompt.token_ids[: len(prompts[-1]) + len(response_ids)] == prompts[-1] + response_ids
        prompts.append(prompt.token_ids)
    return prompts, messages


TURNS = [
    (call_text("cat", "dog"), tool_messages("cat", "dog")),
    (call_text("bird"), tool_messages("bird")),
    ("Thanks, and a follow-up?", [{"role": "user", "content": "Yes: what is a fish?"}]),
    (call_text("fish", "cat", "dog"), tool_messages("fish", "cat", "dog")),
]


# A response that starts with whitespace, right after the generation prompt's "assistant\n".
WHITESPACE_FIRST = [("\n\n Thanks.", [{"role": "user", "content": "And?"}])]


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A byte-level BPE (GPT-2 pre-tokeniser, ~230 learned merges) with the ChatML specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from agent_r1.models.chat_templates import QWEN25_CHATML_TOOLS
    from agent_r1.models.tiny import SPECIAL_TOKENS, build_tiny_tokenizer

    corpus = [
        render_messages(
            build_tiny_tokenizer(), run_append_episode(build_tiny_tokenizer(), turns)[1], tools=TOOLS
        )
        for turns in (TURNS, WHITESPACE_FIRST)
    ]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = QWEN25_CHATML_TOOLS
    return tokenizer


@pytest.fixture(params=["tiny_byte_level", "trained_bpe"])
def tokenizer(request):
    name = "tiny_tokenizer" if request.param == "tiny_byte_level" else "bpe_tokenizer"
    return request.getfixturevalue(name)


def test_the_trained_bpe_really_merges(bpe_tokenizer):
    text = render_messages(bpe_tokenizer, [SYSTEM, USER], tools=TOOLS)
    assert len(bpe_tokenizer.encode(text, add_special_tokens=False)) < len(text.encode()) / 3


@pytest.mark.parametrize("eos", [True, False], ids=["stopped_on_eos", "cut_by_length"])
def test_append_equals_tokenising_the_whole_rendering(tokenizer, eos):
    turns = TURNS
    prompts, messages = run_append_episode(tokenizer, turns, eos=eos)
    assert len(prompts) == 5
    # Each prompt equals tokenising the template's rendering of the whole conversation so far.
    assert list(prompts[-1]) == full_ids(tokenizer, messages)
    text = tokenizer.decode(list(prompts[-1]), skip_special_tokens=False)
    assert (
        text.count("<tool_response>") == 6 and "# Tools" in text and text.endswith("<|im_start|>assistant\n")
    )
    for n_turns in range(1, 4):
        _, partial = run_append_episode(tokenizer, turns[:n_turns], eos=eos)
        assert list(prompts[n_turns]) == full_ids(tokenizer, partial)


def test_append_with_bpe_where_full_tokenisation_merges_across_the_response_boundary(
    bpe_tokenizer, tiny_tokenizer
):
    # The documented exception: BPE merges the header's "\n" with a response's leading "\n\n" into
    # one token when the whole text is tokenised; the model, which sampled after the header's "\n"
    # token, never saw that merge, so append keeps what it saw. Same text, one token more.
    prompts, messages = run_append_episode(bpe_tokenizer, WHITESPACE_FIRST)
    assert bpe_tokenizer.decode(list(prompts[-1])) == render_messages(bpe_tokenizer, messages, tools=TOOLS)
    full = full_ids(bpe_tokenizer, messages)
    assert list(prompts[-1]) != full and len(prompts[-1]) == len(full) + 1
    # Byte-level without merges has no such boundary: equal.
    prompts, messages = run_append_episode(tiny_tokenizer, WHITESPACE_FIRST)
    assert list(prompts[-1]) == full_ids(tiny_tokenizer, messages)


def test_append_keeps_the_sampled_ids_even_when_they_are_not_canonical(tiny_tokenizer):
    # "<tool_call>" sampled as its 11 byte tokens instead of the single special token: the next prompt
    # must contain the ids the model actually produced (no retokenisation drift).
    policy = get_context_policy("append")
    messages = [SYSTEM, USER]
    prompt = build(policy, tiny_tokenizer, messages)
    text = "<tool_call>"
    byte_ids = tuple(tiny_tokenizer.convert_tokens_to_ids(list("<tool_call>")))
    assert byte_ids != tuple(encode_text(tiny_tokenizer, text))
    previous = PreviousTurn(prompt.token_ids, byte_ids, num_messages=2)
    nxt = build(
        policy,
        tiny_tokenizer,
        [*messages, {"role": "assistant", "content": text}, *tool_messages("x")],
        previous,
    )
    assert nxt.token_ids[: len(prompt.token_ids) + len(byte_ids)] == prompt.token_ids + byte_ids


# Like Qwen3's template: reasoning is stripped from assistant messages once they are not the last one.
THINK_STRIPPING_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and not loop.last %}{{- m.content.split('</think>')[-1].lstrip() }}"
    "{%- else %}{{- m.content }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_append_refuses_a_template_that_rewrites_history(tiny_checkpoint):
    from agent_r1.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_checkpoint)
    tokenizer.chat_template = THINK_STRIPPING_TEMPLATE
    policy = get_context_policy("append")
    prompt = build(policy, tokenizer, [USER], tools=None)
    text = "<think>hmm</think>It is 4."
    previous = PreviousTurn(prompt.token_ids, tuple(encode_text(tokenizer, text)), num_messages=1)
    later = [USER, {"role": "assistant", "content": text}, {"role": "user", "content": "Sure?"}]
    with pytest.raises(ContextError, match="rerender"):
        build(policy, tokenizer, later, previous, tools=None)
    # rerender handles it: the template's own rendering, reasoning stripped.
    rendered = build(get_context_policy("rerender"), tokenizer, later, tools=None)
    assert "hmm" not in tokenizer.decode(list(rendered.token_ids))


def test_rerender_applies_the_template_to_all_messages(tokenizer):
    messages = [SYSTEM, USER, {"role": "assistant", "content": call_text("cat")}, *tool_messages("cat")]
    prompt = build(get_context_policy("rerender"), tokenizer, messages)
    assert list(prompt.token_ids) == full_ids(tokenizer, messages)
    assert prompt.info == {"policy": "rerender", "dropped_turns": 0, "summarised": False}


def conversation(n_turns: int) -> list[dict]:
    messages = [SYSTEM, USER]
    for i in range(n_turns):
        messages += [{"role": "assistant", "content": call_text(f"w{i}")}, *tool_messages(f"w{i}")]
    return messages


def test_split_turns_groups_each_assistant_message_with_what_follows():
    head, summary, turns = split_turns(conversation(3))
    assert head == [SYSTEM, USER] and summary is None
    assert [len(t) for t in turns] == [2, 2, 2] and all(t[0]["role"] == "assistant" for t in turns)


def test_sliding_window_keeps_system_task_and_last_k_turns(tokenizer):
    messages = conversation(5)
    prompt = build(get_context_policy("sliding_window", k=2), tokenizer, messages)
    assert list(prompt.messages) == [SYSTEM, USER, *messages[-4:]]
    assert list(prompt.token_ids) == full_ids(tokenizer, prompt.messages)
    assert prompt.info == {"policy": "sliding_window", "dropped_turns": 3, "summarised": False}
    text = tokenizer.decode(list(prompt.token_ids))
    assert "w2" not in text and "w3" in text and "w4" in text and "'cat' and 'dog'" in text
    short = build(get_context_policy("sliding_window", k=8), tokenizer, messages)
    assert short.info["dropped_turns"] == 0 and list(short.messages) == messages


def test_token_budget_drops_the_fewest_oldest_turns_that_fit(tokenizer):
    messages = conversation(6)
    sizes = [len(full_ids(tokenizer, [SYSTEM, USER, *messages[2 + 2 * d :]])) for d in range(6)]
    budget = (sizes[2] + sizes[3]) // 2  # fits after dropping 3 turns, not after 2
    prompt = build(get_context_policy("token_budget", max_tokens=budget), tokenizer, messages)
    assert prompt.info["dropped_turns"] == 3
    assert len(prompt.token_ids) == sizes[3] <= budget
    assert list(prompt.messages) == [SYSTEM, USER, *messages[8:]]
    # Over budget even with one turn left: the newest turn is kept and the prompt returned as is.
    tiny = build(get_context_policy("token_budget", max_tokens=5), tokenizer, messages)
    assert tiny.info["dropped_turns"] == 5 and list(tiny.messages) == [SYSTEM, USER, *messages[-2:]]


def test_summarize_replaces_older_turns_and_rolls_the_summary_forward(tokenizer):
    seen = []

    def summarizer(msgs):
        seen.append(msgs)
        return f"{len(msgs)} messages about words"

    policy = get_context_policy("summarize", summarizer=summarizer, keep_last=1, max_turns=2)
    untouched = build(policy, tokenizer, conversation(2))
    assert not seen and untouched.info["summarised"] is False

    first = build(policy, tokenizer, conversation(3))
    assert first.info == {"policy": "summarize", "dropped_turns": 2, "summarised": True}
    head, summary, turns = split_turns(first.messages)
    assert head == [SYSTEM, USER] and summary[SUMMARY_KEY] == 2 and len(turns) == 1
    assert seen[0] == conversation(3)[2:6]
    assert list(first.token_ids) == full_ids(tokenizer, first.messages)
    assert "4 messages about words" in tokenizer.decode(list(first.token_ids))

    grown = [*first.messages, *conversation(5)[-4:]]  # two more turns arrive
    second = build(policy, tokenizer, grown)
    assert seen[1][0] is not None and seen[1][0]["content"] == summary["content"]
    assert split_turns(second.messages)[1][SUMMARY_KEY] == 4


def test_summarize_accepts_an_async_summarizer(tiny_tokenizer):
    async def summarizer(msgs):
        await asyncio.sleep(0)
        return "short"

    policy = get_context_policy("summarize", summarizer=summarizer, keep_last=1, max_turns=1)
    prompt = build(policy, tiny_tokenizer, conversation(2))
    assert prompt.info["summarised"] and "short" in tiny_tokenizer.decode(list(prompt.token_ids))


def test_unknown_policy_and_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"unknown context policy 'windowed'.*sliding_window"):
        get_context_policy("windowed")
    with pytest.raises(ValueError, match="k must be"):
        get_context_policy("sliding_window", k=0)
    with pytest.raises(TypeError, match="summarizer must be callable"):
        get_context_policy("summarize", summarizer="not a function")


def test_summarize_with_the_policy_model_through_an_engine(tiny_tokenizer):
    from doubles import ScriptedEngine

    from agent_r1.envs.context import engine_summarizer
    from agent_r1.types import SamplingParams

    engine = ScriptedEngine(tiny_tokenizer, ["Looked up w0 and w1: animals."])
    summarizer = engine_summarizer(engine, tiny_tokenizer, SamplingParams(max_tokens=64))
    policy = get_context_policy("summarize", summarizer=summarizer, keep_last=1, max_turns=2)
    prompt = build(policy, tiny_tokenizer, conversation(3))
    asked = tiny_tokenizer.decode(engine.calls[0][0])
    assert asked.startswith("<|im_start|>system") and "Summarise the conversation" in asked
    assert "assistant: Let me look." in asked and "tool: w1: an animal" in asked and "w2" not in asked
    summary = split_turns(prompt.messages)[1]
    assert summary["content"].endswith("\nLooked up w0 and w1: animals.")  # special tokens dropped


# Summaries are actions (the step-level MDP): a summary the policy samples is a Step of its own, and
# the prompt that shows it holds exactly the ids it sampled.

SUMMARY_TEXT = "Looked up <tool_call> w0 and w1: animals."


def byte_ids(tokenizer, text: str) -> tuple[int, ...]:
    """``text`` as one byte-level token per character (ASCII; the byte alphabet writes a space as 'Ġ'):
    a sample the tokenizer would never produce from the text, since "<tool_call>" is a special token
    for both tokenizers here and the trained BPE merges characters."""
    ids = tuple(tokenizer.convert_tokens_to_ids(["Ġ" if c == " " else c for c in text]))
    assert tokenizer.unk_token_id not in ids and tokenizer.decode(list(ids)) == text
    return ids


def sampled_summary_engine(tokenizer):
    from doubles import ScriptedEngine

    from agent_r1.types import Completion, StopReason

    ids = (*byte_ids(tokenizer, SUMMARY_TEXT), tokenizer.eos_token_id)
    logprobs = tuple(-0.01 * (i + 1) for i in range(len(ids)))
    return ScriptedEngine(tokenizer, [Completion(ids, logprobs, StopReason.STOP)]), ids, logprobs


def summarize_policy(tokenizer, engine, **kwargs):
    from agent_r1.envs.context import engine_summarizer
    from agent_r1.types import SamplingParams

    summarizer = engine_summarizer(engine, tokenizer, SamplingParams(max_tokens=64))
    return get_context_policy("summarize", summarizer=summarizer, keep_last=1, max_turns=2, **kwargs)


def test_a_sampled_summary_is_a_step_and_the_next_prompt_holds_its_exact_ids(tokenizer):
    from agent_r1.envs.context import SUMMARY_STEP_KEY

    engine, ids, logprobs = sampled_summary_engine(tokenizer)
    prompt = build(summarize_policy(tokenizer, engine), tokenizer, conversation(3))
    (step,) = prompt.steps
    assert step.prompt_ids == tuple(engine.calls[0][0]) and "Summarise the conversation" in tokenizer.decode(
        list(step.prompt_ids)
    )
    assert step.response_ids == ids and step.logprobs == logprobs and step.reward == 0.0
    assert step.info == {SUMMARY_STEP_KEY: {"turns": 2}} and not step.terminated
    # The prompt: the template's tokens before the summary, the sampled ids (less the end-of-turn
    # token, which the template writes itself), the template's tokens after.
    summary = split_turns(prompt.messages)[1]
    assert summary["content"] == "Summary of the earlier conversation:\n" + SUMMARY_TEXT
    rendered = render_messages(tokenizer, prompt.messages, tools=TOOLS)
    before = encode_text(tokenizer, rendered[: rendered.index(SUMMARY_TEXT)])
    after = encode_text(tokenizer, rendered[rendered.index(SUMMARY_TEXT) + len(SUMMARY_TEXT) :])
    assert prompt.token_ids == (*before, *ids[:-1], *after)
    assert tokenizer.decode(list(prompt.token_ids)) == rendered
    assert list(prompt.token_ids) != full_ids(tokenizer, prompt.messages)  # no re-tokenisation


def test_between_summaries_the_prompt_extends_the_summarised_one(tokenizer):
    engine, ids, _ = sampled_summary_engine(tokenizer)
    policy = summarize_policy(tokenizer, engine)
    summarised = build(policy, tokenizer, conversation(3))
    response = tuple(encode_text(tokenizer, call_text("w9"))) + (tokenizer.eos_token_id,)
    previous = PreviousTurn(summarised.token_ids, response, num_messages=len(summarised.messages))
    grown = [*summarised.messages, {"role": "assistant", "content": call_text("w9")}, *tool_messages("w9")]
    nxt = build(policy, tokenizer, grown, previous)
    assert not nxt.steps and nxt.info == {"policy": "summarize", "dropped_turns": 0, "summarised": False}
    assert nxt.token_ids[: len(summarised.token_ids) + len(response)] == summarised.token_ids + response
    # "rerender" between summaries re-tokenises the whole conversation (templates that rewrite turns).
    rerendered = build(summarize_policy(tokenizer, engine, between="rerender"), tokenizer, grown, previous)
    assert list(rerendered.token_ids) == full_ids(tokenizer, grown)


def test_train_summaries_false_keeps_the_summary_out_of_training(tokenizer):
    engine, _, _ = sampled_summary_engine(tokenizer)
    prompt = build(summarize_policy(tokenizer, engine, train_summaries=False), tokenizer, conversation(3))
    assert prompt.steps == () and prompt.info["summarised"]
    # The text (special tokens dropped: the end-of-turn one) rendered and re-tokenised like any message.
    assert (
        split_turns(prompt.messages)[1]["content"] == "Summary of the earlier conversation:\n" + SUMMARY_TEXT
    )
    assert list(prompt.token_ids) == full_ids(tokenizer, prompt.messages)


def test_summarizer_policy_asks_the_lent_policy_and_needs_one(tiny_tokenizer):
    from agent_r1.envs.base import LentPolicy
    from agent_r1.envs.context import SUMMARY_INSTRUCTION
    from agent_r1.types import SamplingParams

    policy = get_context_policy("summarize", keep_last=1, max_turns=2, instruction="Sum up.")
    with pytest.raises(ContextError, match="no policy was lent"):
        build(policy, tiny_tokenizer, conversation(3))
    engine, ids, _ = sampled_summary_engine(tiny_tokenizer)
    lent = LentPolicy(lambda prompt_ids: engine.generate(prompt_ids, SamplingParams()))
    request = ContextRequest(tuple(conversation(3)), TOOLS, policy=lent)
    prompt = asyncio.run(policy.build(tiny_tokenizer, request))
    assert prompt.steps[0].response_ids == ids
    asked = tiny_tokenizer.decode(list(prompt.steps[0].prompt_ids))
    assert "Sum up.\n\nassistant: Let me look." in asked and SUMMARY_INSTRUCTION not in asked
    with pytest.raises(ValueError, match="instruction applies to summarizer='policy' only"):
        get_context_policy("summarize", summarizer=str, instruction="Sum up.")


def test_a_template_that_rewrites_message_content_cannot_take_spliced_ids(tiny_checkpoint):
    from agent_r1.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_checkpoint)
    tokenizer.chat_template = THINK_STRIPPING_TEMPLATE.replace("{{- m.content }}", "{{- m.content | upper }}")
    engine, _, _ = sampled_summary_engine(tokenizer)
    with pytest.raises(ContextError, match="train_summaries=False"):
        build(summarize_policy(tokenizer, engine), tokenizer, conversation(3), tools=None)
