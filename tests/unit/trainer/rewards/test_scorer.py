"""RewardModelScorer: batching changes no score, chat is rendered with the RM's own template, TRL's signature."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.data.chat_templates import render_chat
from trainer.engine.models import load_reward_model, load_tokenizer
from trainer.rewards.scorer import RewardModelScorer, plain_chat


@pytest.fixture(scope="module")
def scorer_checkpoint(tiny_model, tmp_path_factory) -> str:
    """The tiny model with a random scalar head, saved as a sequence-classification folder."""
    tokenizer = load_tokenizer(tiny_model)
    torch.manual_seed(0)
    model = load_reward_model(tiny_model, tokenizer.pad_token_id)
    with torch.no_grad():
        model.score.weight.mul_(50)  # spread the random rewards so that batching errors would show
    out = Path(tmp_path_factory.mktemp("scorer")) / "my-rm"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


PROMPTS = ["What is 2 + 2?", "Name a colour.", "Q", "Write a long sentence about rivers, stones and clouds please."]
COMPLETIONS = [" 4", " Blue, or perhaps a deep shade of green.", " A", " Rivers run."]


def test_batched_scores_equal_one_by_one_scores(scorer_checkpoint):
    batched = RewardModelScorer(scorer_checkpoint, batch_size=3)
    single = RewardModelScorer(scorer_checkpoint, batch_size=1)
    prompts, completions = PROMPTS * 2, COMPLETIONS + COMPLETIONS[::-1]  # 8 texts, lengths mixed
    one_by_one = [single([p], [c])[0] for p, c in zip(prompts, completions)]
    scores = batched(prompts, completions)
    assert len(scores) == 8 and all(isinstance(s, float) for s in scores)
    assert max(scores) - min(scores) > 0.1, "texts should get different rewards"
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(one_by_one), atol=1e-5, rtol=1e-5)
    assert batched([], []) == []


def test_trl_signature_and_name(scorer_checkpoint):
    scorer = RewardModelScorer(scorer_checkpoint)
    assert scorer.__name__ == "my-rm"
    # Extra dataset columns arrive as keyword arguments, as in TRL's GRPOTrainer.
    assert scorer(PROMPTS[:2], COMPLETIONS[:2], answer=["4", "blue"], trainer_state=None) == scorer(PROMPTS[:2],
                                                                                                    COMPLETIONS[:2])
    with pytest.raises(ValueError):
        scorer(PROMPTS[:2], COMPLETIONS[:1])


def test_chat_is_rendered_with_the_reward_models_template(scorer_checkpoint):
    scorer = RewardModelScorer(scorer_checkpoint)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    completion = [{"role": "assistant", "content": "Blue."}]
    conversation = render_chat(scorer.tokenizer, prompt + completion)
    assert conversation.endswith("<|im_start|>assistant\nBlue.<|im_end|>\n")
    # Chat templates close each turn with eos: no second one is added.
    assert scorer.texts([prompt], [completion]) == [conversation]
    # A text prompt before a chat completion is the user's turn; a text completion after chat messages
    # is the assistant's.
    assert scorer.texts(["Name a colour."], [completion]) == [
        render_chat(scorer.tokenizer, [{"role": "user", "content": "Name a colour."}] + completion)]
    assert scorer.texts([prompt], ["Blue."]) == [conversation]
    # And the score is the score of that rendered conversation.
    assert scorer([prompt], [completion]) == scorer.score_texts([conversation])
    assert scorer([prompt], [completion]) != scorer.score_texts([plain_chat(prompt + completion)])


def test_text_pairs_are_joined_and_closed_with_eos(scorer_checkpoint):
    scorer = RewardModelScorer(scorer_checkpoint)
    assert scorer.texts(["Q:"], [" A"]) == ["Q: A<|im_end|>"]


def test_chat_without_a_template_falls_back_to_plain_text(scorer_checkpoint):
    scorer = RewardModelScorer(scorer_checkpoint)
    scorer.tokenizer.chat_template = None  # as for BERT-style encoders
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert scorer.texts([messages[:1]], [messages[1:]]) == ["\n\nUser: Hi\n\nAssistant: Hello<|im_end|>"]


def test_long_texts_keep_their_end(scorer_checkpoint):
    """The RM stage saves truncation_side=left for keep_end; a scorer honours the saved side."""
    scorer = RewardModelScorer(scorer_checkpoint, max_length=8)
    scorer.tokenizer.truncation_side = "left"
    long_prompt = "apple river stone cloud green music paper light table window garden " * 3
    a, b = scorer([long_prompt, "x"], [" yes", " no"])[0], scorer(["y " + long_prompt], [" yes"])[0]
    assert a == pytest.approx(b, abs=1e-6)  # only the last 8 tokens count
    assert a != pytest.approx(scorer([long_prompt], [" no"])[0], abs=1e-3)


def test_the_loader_itself_holds_import_paths_to_the_allow_list(tmp_path, monkeypatch):
    """A stage started as a library call (not through the CLI) must not import a module outside
    ALIGNFLOW_ALLOWED_REWARD_MODULES: the module's code would run before any check."""
    import sys

    from trainer.errors import ConfigError
    from trainer.rewards.functions import load_reward_function

    (tmp_path / "sneaky_rewards.py").write_text("import pathlib\npathlib.Path(__file__).with_name('ran').touch()\n"
                                               "def score(prompts, completions, **_):\n    return [1.0] * len(prompts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ALIGNFLOW_ALLOWED_REWARD_MODULES", "tests.helpers")
    with pytest.raises(ConfigError, match="not in ALIGNFLOW_ALLOWED_REWARD_MODULES"):
        load_reward_function("sneaky_rewards:score")
    assert not (tmp_path / "ran").exists() and "sneaky_rewards" not in sys.modules
    assert load_reward_function("tests.helpers:target_frequency")([""], ["aa"]) == [1.0]
    monkeypatch.delenv("ALIGNFLOW_ALLOWED_REWARD_MODULES")
    assert load_reward_function("sneaky_rewards:score")(["p"], ["c"]) == [1.0]
    assert (tmp_path / "ran").exists()


def test_accuracy_reward_takes_trls_name_and_columns():
    """TRL's `accuracy_reward` (reward_funcs: [accuracy_reward] in a TRL config): the last \\boxed{} or
    final number against the `solution` column (TRL's) or `answer`; None where the gold has no answer."""
    from trainer.rewards.functions import load_reward_function

    reward = load_reward_function("accuracy_reward")
    chat = [[{"role": "assistant", "content": r"So \boxed{\frac{1}{3}}"}], [{"role": "assistant", "content": r"\boxed{ \frac{1}{2} }"}]]
    assert reward(None, chat, solution=[r"\frac{1}{3}", r"$\frac{1}{3}$"]) == [1.0, 0.0]
    assert reward(None, ["it is 1,000.", "7", r"\boxed{7}", "no idea"], answer=["#### 1000", "#### 7", "7", "#### 7"]) == [
        1.0, 1.0, 1.0, 0.0]
    assert reward(None, ["42"], solution=["we cannot say"]) == [None]
    with pytest.raises(ValueError, match="`solution`"):
        reward(None, ["42"])


def test_soft_overlong_punishment_is_dapos_length_budget():
    """TRL's get_soft_overlong_punishment under a built-in name: 0 up to max − cache tokens, linear to −1 at max."""
    from trainer.errors import ConfigError
    from trainer.rewards.functions import load_reward_function
    from trainer.rewards.specs import check_reward_spec

    reward = load_reward_function("soft_overlong_punishment:100:20")
    ids = [[7] * n for n in (0, 50, 80, 90, 95, 100, 130)]
    assert reward(None, ["x"] * len(ids), completion_ids=ids) == pytest.approx([0, 0, 0, -0.5, -0.75, -1, -1])
    with pytest.raises(ValueError, match="completion_ids"):
        reward(None, ["x"])
    for bad in ("soft_overlong_punishment:100", "soft_overlong_punishment:20:100", "soft_overlong_punishment:a:b"):
        with pytest.raises(ConfigError, match=r"0 < cache <= max"):
            check_reward_spec(bad)


def test_repeated_reward_names_get_a_suffix():
    """Two `regex:` rewards (or two reward models) log under distinct names, not over each other."""
    from trainer.rewards.functions import load_reward_function, reward_names

    funcs = [load_reward_function(s) for s in ("regex:a", "exact_answer", "regex:b", "regex:c")]
    assert reward_names(funcs) == ["regex", "exact_answer", "regex_2", "regex_3"]
