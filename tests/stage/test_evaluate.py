"""Evaluation: rule rewards and accuracy on a model whose output is known, win rate, KL, outputs, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import slow_bf16_kernels, write_jsonl
from trainer.engine.models import load_reward_model, load_tokenizer
from trainer.errors import ModelError
from trainer.rollout import Completion
from trainer.stages.evaluate import EvalConfig, mean_kl, run_evaluate

# ----------------------------------------------------------------------------------------------
# Models whose behaviour is known


def _save(model, tokenizer, folder: Path) -> str:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def answers_seven(tiny_model, tmp_path_factory) -> str:
    """The tiny model rewired into a bigram table that greedily answers ":" with " #### 7" and eos.

    With every attention output and MLP down-projection zeroed, the final hidden state at a
    position is norm(embedding of the token there), so the (untied) LM head alone picks the next
    token: row `next` of the head is 10·h(cur) for each (cur -> next) link of the chain, which
    gives logit ≈ 10·|h(cur)| ≈ 80 to `next` and small values to everything else.
    """
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    chain = [tokenizer(":")["input_ids"][-1], *tokenizer(" #### 7")["input_ids"], tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), f"a bigram chain needs distinct tokens, got {chain}"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hidden = model.model.norm(model.model.embed_tokens.weight.detach().clone())  # [V, H]
        head = torch.zeros_like(hidden)
        for cur, nxt in zip(chain, chain[1:]):
            head[nxt] = 10 * hidden[cur] / hidden[cur].norm()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(head)
    return _save(model, tokenizer, tmp_path_factory.mktemp("answers-seven"))


@pytest.fixture(scope="module")
def sharpened(tiny_model, tmp_path_factory) -> str:
    """The tiny model with its (tied) embeddings scaled up 6x and shaken: sharper logits and other
    greedy answers, so it is far from the tiny model as a distribution."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    torch.manual_seed(0)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(6).add_(0.2 * torch.randn_like(model.model.embed_tokens.weight))
    return _save(model, tokenizer, tmp_path_factory.mktemp("sharpened"))


@pytest.fixture(scope="module")
def judge(tiny_model, tmp_path_factory) -> str:
    """A reward model: the tiny model with a random scalar head (as the RM stage would save it)."""
    tokenizer = load_tokenizer(tiny_model)
    torch.manual_seed(0)
    model = load_reward_model(tiny_model, tokenizer.pad_token_id)
    with torch.no_grad():
        model.score.weight.mul_(50)  # spread the scores so that different texts rarely tie
    return _save(model, tokenizer, tmp_path_factory.mktemp("judge"))


@pytest.fixture(scope="module")
def gsm_like(tmp_path_factory) -> str:
    rows = [{"prompt": "Q1 Answer:", "answer": "so 7\n#### 7"},
            {"prompt": "Q2 Answer:", "answer": "#### 8"},
            {"prompt": "Q3 Answer:", "answer": "#### 7"}]
    return write_jsonl(tmp_path_factory.mktemp("data") / "gsm.jsonl", rows)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    rows = [{"prompt": p} for p in ("Hello there", "Name a colour.", "What is 2 + 2?", "Tell me about rivers")]
    return write_jsonl(tmp_path_factory.mktemp("data") / "prompts.jsonl", rows)


# Reward functions imported by path (TRL signature), as a user's own module would provide them.


def final_token_matches(prompts, completions, answer, **kwargs):
    """1 when the completion's last word is the answer's last word, 0 otherwise."""
    return [float(c.split()[-1] == a.split()[-1]) if c.split() else 0.0 for c, a in zip(completions, answer)]


def skips_second(prompts, completions, **kwargs):
    """0.5 for every completion but the second, which it cannot score (None)."""
    return [None if i == 1 else 0.5 for i in range(len(completions))]


SEEN: list = []


def record_completions(prompts, completions, **kwargs):
    """Keeps what it was given (in SEEN) and scores 0."""
    SEEN.extend(completions)
    return [0.0] * len(completions)


def _config(tmp_path: Path, **overrides) -> EvalConfig:
    overrides.setdefault("output_dir", str(tmp_path / "eval"))
    overrides.setdefault("max_completion_length", 8)
    return EvalConfig(**overrides)


# ----------------------------------------------------------------------------------------------
# Rewards, accuracy, outputs


def test_rewards_and_accuracy_on_a_model_with_known_answers(answers_seven, gsm_like, tmp_path):
    """The model answers " #### 7" to all three prompts; the answers are 7, 8, 7.

    exact_answer: 1, 0, 1 -> accuracy 2/3. final_token_matches: 1, 0, 1. skips_second: 0.5, None, 0.5.
    reward with weights (1, 2, 4): rows 1 + 2 + 2 = 5, 0 + 0 (+ nothing) = 0, 5 -> mean 10/3.
    """
    config = _config(tmp_path, model=answers_seven, dataset=gsm_like,
                     reward_funcs=["tests.stage.test_evaluate:final_token_matches", "exact_answer",
                                   "tests.stage.test_evaluate:skips_second"],
                     reward_weights=[1.0, 2.0, 4.0])
    metrics = run_evaluate(config)

    assert metrics["accuracy"] == pytest.approx(2 / 3)
    assert metrics["rewards/final_token_matches/mean"] == pytest.approx(2 / 3)
    assert metrics["rewards/exact_answer/mean"] == pytest.approx(2 / 3)
    assert metrics["rewards/skips_second/mean"] == pytest.approx(0.5)
    assert metrics["reward"] == pytest.approx(10 / 3)
    assert metrics["completions/mean_length"] == 3  # " ####", " 7", eos
    assert metrics["completions/clipped_ratio"] == 0
    assert metrics["num_samples"] == 3
    assert "win_rate" not in metrics and "kl" not in metrics and "rm_score" not in metrics

    out = Path(config.output_dir)
    assert json.loads((out / "metrics.json").read_text()) == pytest.approx(metrics)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["completion"] for s in samples] == [" #### 7"] * 3
    assert [s["accuracy"] for s in samples] == [1.0, 0.0, 1.0]
    assert samples[1]["rewards"] == {"final_token_matches": 0.0, "exact_answer": 0.0, "skips_second": None}
    assert samples[1]["answer"] == "#### 8" and samples[0]["prompt"] == "Q1 Answer:"


def test_max_samples_and_no_reward_functions(answers_seven, gsm_like, tmp_path):
    metrics = run_evaluate(_config(tmp_path, model=answers_seven, dataset=gsm_like, max_samples=2))
    assert metrics["num_samples"] == 2
    assert metrics["accuracy"] == pytest.approx(0.5)  # the `answer` column alone turns accuracy on
    assert "reward" not in metrics


def test_generation_reports_progress_off_a_terminal(answers_seven, gsm_like, tmp_path, caplog):
    """Off a terminal a line every 25 % of the prompts (or 30 s), and one at the end: 1/3, 2/3, 3/3."""
    import logging

    with caplog.at_level(logging.INFO, logger="trainer.stages.evaluate"):
        run_evaluate(_config(tmp_path, model=answers_seven, dataset=gsm_like, batch_size=1))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("generating")]
    assert [line.split(",")[0] for line in lines] == ["generating: 1/3 prompts (33%)", "generating: 2/3 prompts (67%)",
                                                      "generating: 3/3 prompts (100%)"], lines
    assert all("ETA" in line for line in lines)


def test_bfloat16_where_the_cpu_has_slow_bf16_kernels_warns_and_evaluates(answers_seven, gsm_like, tmp_path,
                                                                          monkeypatch, caplog):
    """`dtype bfloat16` on a CPU whose bfloat16 matmuls are slow (faked: the probe measures the hardware) gets a
    warning naming `--dtype float32`; the evaluation still runs in bfloat16."""
    import logging

    slow_bf16_kernels(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="trainer.stages.evaluate"):
        metrics = run_evaluate(_config(tmp_path, model=answers_seven, dataset=gsm_like, dtype="bfloat16"))
    assert "bfloat16 is slow on this CPU" in caplog.text and "(`--dtype float32`)" in caplog.text
    assert metrics["num_samples"] == 3


def test_chat_prompts_get_chat_completions(answers_seven, tmp_path):
    """A chat prompt is rendered with the template, and reward functions receive
    [{"role": "assistant", "content": ...}] completions, as in TRL."""
    SEEN.clear()
    data = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "Hi"}]}])
    run_evaluate(_config(tmp_path, model=answers_seven, dataset=data, max_completion_length=2,
                         reward_funcs=["tests.stage.test_evaluate:record_completions"]))
    assert len(SEEN) == 1 and SEEN[0][0]["role"] == "assistant" and isinstance(SEEN[0][0]["content"], str)


# ----------------------------------------------------------------------------------------------
# Judge: RM score and win rate


def test_win_rate_against_itself_is_one_half(tiny_model, judge, prompts_file, tmp_path):
    metrics = run_evaluate(_config(tmp_path, model=tiny_model, dataset=prompts_file, reward_model=judge,
                                   baseline_model=tiny_model))
    assert metrics["win_rate"] == 0.5
    assert metrics["rm_score"] == pytest.approx(metrics["baseline/rm_score"])
    samples = [json.loads(line) for line in Path(tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert all(s["completion"] == s["baseline_completion"] and s["win"] == 0.5 for s in samples)


def test_win_rates_of_two_models_are_complementary(tiny_model, answers_seven, judge, prompts_file, tmp_path):
    """(A vs B) + (B vs A) = 1. The random tiny model repeats the prompt's last token; the bigram
    model says something else, so the judge decides (ties only where it scores equal)."""
    a_vs_b = run_evaluate(_config(tmp_path / "ab", model=answers_seven, dataset=prompts_file, reward_model=judge,
                                  baseline_model=tiny_model))
    b_vs_a = run_evaluate(_config(tmp_path / "ba", model=tiny_model, dataset=prompts_file, reward_model=judge,
                                  baseline_model=answers_seven))
    samples = [json.loads(line) for line in Path(tmp_path / "ab" / "eval" / "samples.jsonl").read_text().splitlines()]
    assert any(s["completion"] != s["baseline_completion"] for s in samples), "the models should answer differently"
    for s in samples:
        expected = 0.5 if s["rm_score"] == s["baseline_rm_score"] else float(s["rm_score"] > s["baseline_rm_score"])
        assert s["win"] == expected
    assert a_vs_b["win_rate"] + b_vs_a["win_rate"] == pytest.approx(1.0)
    assert a_vs_b["rm_score"] == pytest.approx(b_vs_a["baseline/rm_score"])


# ----------------------------------------------------------------------------------------------
# KL


def test_kl_to_itself_is_zero_and_positive_to_the_starting_model(tiny_model, sharpened, prompts_file, tmp_path):
    same = run_evaluate(_config(tmp_path / "same", model=tiny_model, dataset=prompts_file, reference_model=tiny_model))
    moved = run_evaluate(_config(tmp_path / "moved", model=sharpened, dataset=prompts_file,
                                 reference_model=tiny_model))
    assert same["kl"] == pytest.approx(0.0, abs=1e-6)
    assert moved["kl"] > 0.5


def test_mean_kl_matches_a_direct_computation(tiny_model, sharpened):
    """Prompts of different lengths (left padding) and completions of different lengths (right padding)
    give the same per-token mean as scoring each sequence on its own, unpadded."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(sharpened).eval()
    ref = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    completions = [Completion([20, 21, 22], [0.0] * 3, "length"), Completion([30], [0.0], "stop")]

    diffs = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            ids = torch.tensor([p + c.token_ids])
            targets = ids[0, len(p):]
            lp = torch.log_softmax(policy(ids).logits[0, len(p) - 1:-1], -1).gather(-1, targets[:, None])
            lr = torch.log_softmax(ref(ids).logits[0, len(p) - 1:-1], -1).gather(-1, targets[:, None])
            diffs += (lp - lr).squeeze(-1).tolist()
    expected = sum(diffs) / len(diffs)  # 4 tokens
    assert mean_kl(policy, ref, prompts, completions, pad_id=3, batch_size=2) == pytest.approx(expected, abs=1e-4)
    assert mean_kl(policy, ref, prompts, completions, pad_id=3, batch_size=1) == pytest.approx(expected, abs=1e-4)
    assert abs(expected) > 0.1


# ----------------------------------------------------------------------------------------------
# Bad input fails before any generation


@pytest.fixture
def no_generation(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("generation started before the inputs were checked")

    monkeypatch.setattr("trainer.stages.evaluate.generate", fail)


def test_missing_baseline_and_reference_paths(tiny_model, judge, prompts_file, tmp_path, no_generation):
    with pytest.raises(ModelError, match="nope"):
        run_evaluate(_config(tmp_path, model=tiny_model, dataset=prompts_file, reward_model=judge,
                             baseline_model=str(tmp_path / "nope")))
    with pytest.raises(ModelError, match="nope"):
        run_evaluate(_config(tmp_path, model=tiny_model, dataset=prompts_file, reference_model=str(tmp_path / "nope")))


# ----------------------------------------------------------------------------------------------
# MLflow child run and the command line


def test_cli_eval_logs_a_child_run(answers_seven, gsm_like, tmp_path, capsys, monkeypatch):
    from mlflow import MlflowClient

    from trainer.cli.main import main

    uri = f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    (tmp_path / "mlflow").mkdir()
    client = MlflowClient(uri)
    parent = client.create_run(client.create_experiment("pipeline", artifact_location=(tmp_path / "art").as_uri()))
    monkeypatch.setenv("MLFLOW_PARENT_RUN_ID", parent.info.run_id)
    out = tmp_path / "cli-eval"
    code = main(["eval", "--model", answers_seven, "--dataset", gsm_like, "--max_completion_length", "4",
                 "--output_dir", str(out), "--mlflow_tracking_uri", uri])
    assert code == 0
    printed = capsys.readouterr().out
    assert json.loads(printed[:printed.rindex("}") + 1])["accuracy"] == pytest.approx(2 / 3)
    assert (out / "metrics.json").exists() and (out / "samples.jsonl").exists()

    (child,) = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert child.info.status == "FINISHED" and child.data.tags["alignflow.stage"] == "eval"
    assert child.data.metrics["accuracy"] == pytest.approx(2 / 3)
    assert {a.path for a in client.list_artifacts(child.info.run_id)} == {"metrics.json", "samples.json"}
    table = json.loads(Path(client.download_artifacts(child.info.run_id, "samples.json", str(tmp_path))).read_text())
    assert "completion" in table["columns"] and len(table["data"]) == 3


def test_a_multi_label_judge_scores_the_named_label(tiny_model, prompts_file, tmp_path):
    from tests.helpers import classifier_checkpoint

    judge = classifier_checkpoint(tiny_model, tmp_path / "sentiment", labels=["NEGATIVE", "POSITIVE"], scale=20.0)
    logit = run_evaluate(_config(tmp_path / "logit", model=tiny_model, dataset=prompts_file, reward_model=judge,
                                 reward_label="POSITIVE"))["rm_score"]
    probability = run_evaluate(_config(tmp_path / "p", model=tiny_model, dataset=prompts_file, reward_model=judge,
                                       reward_label="POSITIVE", reward_label_score="probability",
                                       reward_funcs=[judge]))
    assert 0.0 < probability["rm_score"] < 1.0 and probability["rm_score"] != pytest.approx(logit)
    assert probability["reward"] == pytest.approx(probability["rm_score"])  # the same scorer, as a reward function
