"""Reward models in `reward_funcs`: classifiers with several labels score one named label (logit or
softmax probability), a bad label fails before the weights load, and hub ids load from the local HF cache.
A GRPO run rewarded by a label: tests/stage/test_grpo.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch

from tests.helpers import classifier_checkpoint
from trainer.data.preferences import reward_texts
from trainer.engine.models import load_reward_model, load_tokenizer
from trainer.errors import ConfigError, ModelError
from trainer.rewards.functions import load_reward_function
from trainer.rewards.scorer import RewardModelScorer

PROMPTS = ["What is 2 + 2?", "Name a colour.", "Write something about item 3."]
COMPLETIONS = [" 4", " Blue, or perhaps green.", " a a a"]
SENTIMENT = ["NEGATIVE", "POSITIVE"]
THREE = ["contradiction", "neutral", "entailment"]


@pytest.fixture(scope="module")
def three_labels(tiny_model, tmp_path_factory) -> str:
    return classifier_checkpoint(tiny_model, tmp_path_factory.mktemp("clf") / "nli", THREE, scale=5, seed=1)


def direct_logits(path: str, n_labels: int) -> torch.Tensor:
    """The classifier's logits for (PROMPTS, COMPLETIONS), [N, labels], computed without the scorer."""
    tokenizer = load_tokenizer(path)
    model = load_reward_model(path, tokenizer.pad_token_id, num_labels=n_labels).eval()
    texts = reward_texts(tokenizer, PROMPTS, COMPLETIONS)  # what the scorer builds for text pairs
    with torch.no_grad():
        return torch.cat([model(**tokenizer(t, return_tensors="pt")).logits for t in texts])


@pytest.mark.parametrize("fixture, labels", [("sentiment_checkpoint", SENTIMENT), ("three_labels", THREE)])
def test_a_named_label_scores_its_logit_or_probability(request, fixture, labels):
    """Every label, as logit and as probability, is the matching column of the model's own logits (or of
    their softmax); the probabilities of all labels of one text sum to 1."""
    path = request.getfixturevalue(fixture)
    logits = direct_logits(path, len(labels))
    probs = []
    for j, label in enumerate(labels):
        logit = load_reward_function(path, label=label)(PROMPTS, COMPLETIONS)
        prob = load_reward_function(path, label=label, label_score="probability")(PROMPTS, COMPLETIONS)
        torch.testing.assert_close(torch.tensor(logit), logits[:, j], atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(prob), logits.softmax(-1)[:, j], atol=1e-5, rtol=0)
        probs.append(prob)
    torch.testing.assert_close(torch.tensor(probs).sum(0), torch.ones(len(PROMPTS)), atol=1e-5, rtol=0)
    assert float(logits.std()) > 0.1, "random heads should spread the logits"


@pytest.mark.parametrize("label, message", [
    (None, r"has 3 labels; set `reward_label` to one of \['contradiction', 'neutral', 'entailment'\]"),
    ("positive", r"does not have the label 'positive'; set `reward_label` to one of \['contradiction'"),
])
def test_missing_or_unknown_label_is_a_one_line_error(three_labels, monkeypatch, label, message):
    """Raised from the config alone, before the weights load."""
    def no_weights(*args, **kwargs):
        raise AssertionError("the weights must not load before the label is checked")

    monkeypatch.setattr("trainer.rewards.scorer.load_reward_model", no_weights)
    with pytest.raises(ModelError, match=message) as err:
        load_reward_function(three_labels, label=label)
    assert "\n" not in str(err.value)


def test_one_label_reward_models_ignore_reward_label(reward_checkpoint):
    rm = reward_checkpoint
    plain = load_reward_function(rm)(PROMPTS, COMPLETIONS)
    assert load_reward_function(rm, label="POSITIVE", label_score="probability")(PROMPTS, COMPLETIONS) == plain
    torch.testing.assert_close(torch.tensor(plain), direct_logits(rm, 1)[:, 0], atol=1e-5, rtol=0)


def hub_cache(root: Path, repo_id: str, folder: str, revision: str = "0123456789abcdef0123456789abcdef01234567"):
    """`folder` laid out as huggingface_hub caches a download of `repo_id`: models--org--name/snapshots/<rev>/
    with refs/main naming the revision (blobs are left out; snapshots may hold plain files)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty HF cache in tmp_path, offline. huggingface_hub and transformers read the cache folder from
    `huggingface_hub.constants` at call time, which was set from the environment at import."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_loads_from_the_local_cache_offline(sentiment_checkpoint, offline_cache):
    hub_cache(offline_cache, "tiny-org/sentiment-rm", sentiment_checkpoint)
    fn = load_reward_function("tiny-org/sentiment-rm", label="POSITIVE")
    assert isinstance(fn, RewardModelScorer) and fn.__name__ == "sentiment-rm"
    assert fn(PROMPTS, COMPLETIONS) == load_reward_function(sentiment_checkpoint, label="POSITIVE")(PROMPTS, COMPLETIONS)


@pytest.mark.parametrize("spec", ["tiny-org/not-cached", "outputs/no-such-rm", "no_such_function"])
def test_unknown_reward_is_a_one_line_error(offline_cache, spec):
    with pytest.raises(ConfigError, match=r"neither a function .* nor a file .* nor a hub model in the local Hugging "
                                          "Face cache or downloadable") as err:
        load_reward_function(spec)
    assert "\n" not in str(err.value) and repr(spec) in str(err.value)
