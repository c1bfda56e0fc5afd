"""Reward-model stage: it learns a held-out preference, margins and centring act as the maths says,
SFT data fails early, checkpoints are usable reward models, resume is exact, encoders without eos work."""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import history, weights, write_jsonl
from trainer.data.preferences import reward_texts
from trainer.engine import checkpoint as ckpt
from trainer.engine.models import load_tokenizer
from trainer.rewards.scorer import RewardModelScorer
from trainer.stages import reward_model as reward
from trainer.stages.reward_model import RewardConfig, run_reward

FILLER = ("apple river stone cloud green music paper light table window garden silver orange yellow bread "
          "water horse chair ocean forest").split()


def agreement_pairs(n: int, seed: int) -> list[dict]:
    """The prompt asks for `yes` or `no`; both replies are the same random words with one of them
    inserted, the chosen one with the word asked for. Neither word nor length alone tells the pairs
    apart: the model has to relate the reply to the prompt."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.sample(FILLER, rng.randint(4, 8))
        want, other = rng.sample(["yes", "no"], 2)
        at = rng.randint(0, len(words))
        rows.append({"prompt": f"Answer {want}:",
                     "chosen": " " + " ".join(words[:at] + [want] + words[at:]),
                     "rejected": " " + " ".join(words[:at] + [other] + words[at:])})
    return rows


def rm_config(model: str, dataset: str, out: Path, **overrides) -> RewardConfig:
    values = dict(model=model, dataset=dataset, output_dir=str(out), max_steps=60, per_device_batch_size=16,
                  learning_rate=3e-3, logging_steps=10, max_length=64, disable_progress_bar=True)
    values.update(overrides)
    return RewardConfig(**values)


def ranking_accuracy(scorer: RewardModelScorer, rows: list[dict]) -> float:
    prompts = [r["prompt"] for r in rows]
    chosen = scorer(prompts, [r["chosen"] for r in rows])
    rejected = scorer(prompts, [r["rejected"] for r in rows])
    return sum(c > r for c, r in zip(chosen, rejected)) / len(rows)


@pytest.fixture(scope="module")
def agreement_data(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("agreement")
    train, test = agreement_pairs(256, seed=1), agreement_pairs(128, seed=2)
    assert not {json.dumps(r) for r in train} & {json.dumps(r) for r in test}, "held-out pairs must be unseen"
    return {"train": write_jsonl(folder / "train.jsonl", train), "test": write_jsonl(folder / "test.jsonl", test),
            "test_rows": test}


@pytest.fixture(scope="module")
def trained_rm(tiny_model, agreement_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rm") / "out"
    run_reward(rm_config(tiny_model, agreement_data["train"], out, eval_dataset=agreement_data["test"]))
    return out


# ----------------------------------------------------------------------------------------------
# Learning and the saved model


def test_learns_held_out_preferences_with_trl_metric_names(trained_rm):
    records = history(trained_rm)
    for key in ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "grad_norm",
                "learning_rate", "num_tokens"):
        assert key in records[0], key
    final = records[-1]
    assert final["eval_accuracy"] >= 0.9, final
    for key in ("eval_loss", "eval_margin", "eval_min_reward", "eval_mean_reward", "eval_max_reward"):
        assert key in final, key
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < 0.3 * losses[0], losses
    manifest = json.loads((trained_rm / ckpt.MANIFEST).read_text())
    assert manifest["stage"] == "reward" and manifest["step"] == 60
    assert manifest["datasets"]["eval"]["pairs"] == 128
    assert ckpt.is_complete(str(trained_rm))


def test_the_task_is_not_solved_before_training(tiny_model, agreement_data):
    """A fresh head on the untrained model ranks the held-out pairs near chance: the test above measures learning."""
    torch.manual_seed(0)
    assert ranking_accuracy(RewardModelScorer(tiny_model), agreement_data["test_rows"]) < 0.75


def test_checkpoint_is_a_plain_reward_model(trained_rm, agreement_data):
    """transformers alone loads it (head, pad id, tokenizer with pad) and scores like the scorer does."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(trained_rm)
    tokenizer = AutoTokenizer.from_pretrained(trained_rm)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id is not None
    assert tokenizer.chat_template and tokenizer.truncation_side == "left"
    row = agreement_data["test_rows"][0]
    texts = reward_texts(tokenizer, [row["prompt"]] * 2, [row["chosen"], row["rejected"]])
    assert texts[0].endswith(tokenizer.eos_token)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        plain = model(**batch).logits.squeeze(-1)
    scorer = RewardModelScorer(str(trained_rm))
    torch.testing.assert_close(plain, torch.tensor(scorer([row["prompt"]] * 2, [row["chosen"], row["rejected"]])),
                               atol=1e-4, rtol=1e-4)
    assert plain[0] > plain[1]


def test_causal_lm_without_pad_id_in_its_config_gets_the_tokenizers(tiny_model, agreement_data, tmp_path):
    """A causal LM's reward is read at the last non-pad token, which transformers finds through
    `config.pad_token_id`; without it, it refuses batches of more than one row."""
    base = tmp_path / "nopad"
    shutil.copytree(tiny_model, base)
    config = json.loads((base / "config.json").read_text())
    del config["pad_token_id"]
    (base / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    run_reward(rm_config(str(base), agreement_data["train"], out, max_steps=2))
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == load_tokenizer(str(base)).pad_token_id


def test_scorer_ranks_held_out_chosen_above_rejected(trained_rm, agreement_data):
    scorer = RewardModelScorer(str(trained_rm), batch_size=7)
    assert ranking_accuracy(scorer, agreement_data["test_rows"]) >= 0.9
    assert scorer.__name__ == trained_rm.name
    assert scorer.max_length == 64  # the RM's training max_length, from its manifest


# ----------------------------------------------------------------------------------------------
# Loss terms


def test_margin_is_subtracted_from_the_reward_difference_of_its_own_row(tiny_model, tmp_path):
    """One usable pair (row 1; row 0 has chosen == rejected and is dropped). The logged step-1 stats give
    d = r_chosen − r_rejected, so loss = −log σ(d) without a margin and −log σ(d − m) with one; reading the
    margin of row 0 (5.0) instead of row 1 (0.7) would give a different number."""
    rows = [{"prompt": "Q:", "chosen": " same", "rejected": " same", "margin": 5.0},
            {"prompt": "Q:", "chosen": " good answer", "rejected": " bad", "margin": 0.7}]
    with_margin = write_jsonl(tmp_path / "m.jsonl", rows)
    without = write_jsonl(tmp_path / "n.jsonl", [{k: v for k, v in r.items() if k != "margin"} for r in rows])
    first = {}
    for name, data in (("with", with_margin), ("without", without)):
        run_reward(rm_config(tiny_model, data, tmp_path / name, max_steps=1, logging_steps=1))
        first[name] = history(tmp_path / name)[0]
    d = first["without"]["margin"]
    assert first["with"]["margin"] == pytest.approx(d, abs=1e-6)  # same model, same pair: same rewards
    assert first["without"]["loss"] == pytest.approx(-math.log(torch.sigmoid(torch.tensor(d)).item()), rel=1e-4)
    assert first["with"]["loss"] == pytest.approx(-math.log(torch.sigmoid(torch.tensor(d - 0.7)).item()), rel=1e-4)


def test_centring_pulls_mean_reward_to_zero(trained_bert, agreement_data, tmp_path):
    """The trained tiny BERT's rewards average about 3: its head bias starts at 3 and Bradley–Terry, which only
    sees differences, gives a shared offset no gradient. Training on with the centring term (TRL's suggested
    c = 0.01) pulls the mean to 0 and keeps the ranking; training on without it leaves the mean where it is."""
    assert history(trained_bert)[-1]["eval_mean_reward"] > 2
    final = {}
    for name, coefficient in (("plain", None), ("centred", 0.01)):
        out = tmp_path / name
        run_reward(rm_config(str(trained_bert), agreement_data["train"], out, eval_dataset=agreement_data["test"],
                             max_steps=20, center_rewards_coefficient=coefficient))
        final[name] = history(out)[-1]
    assert final["plain"]["eval_mean_reward"] > 2, final
    assert abs(final["centred"]["eval_mean_reward"]) < 0.1 * final["plain"]["eval_mean_reward"], final
    assert final["centred"]["eval_accuracy"] >= 0.9, final


# ----------------------------------------------------------------------------------------------
# Data errors, resume, LoRA, CLI


def test_gradient_accumulation_equals_one_large_batch(tiny_model, agreement_data, tmp_path):
    """bs=8 x 1 and bs=4 x 2 see the same 8 pairs; each micro-batch's mean loss is weighted by its share,
    so the first step's loss and gradient norm (before any update) are the same."""
    runs = {}
    for name, batch, accumulation in (("a", 8, 1), ("b", 4, 2)):
        run_reward(rm_config(tiny_model, agreement_data["train"], tmp_path / name, max_steps=2, logging_steps=1,
                             per_device_batch_size=batch, gradient_accumulation_steps=accumulation))
        runs[name] = history(tmp_path / name)
    for key in ("loss", "grad_norm", "accuracy", "margin", "min_reward", "mean_reward", "max_reward"):
        assert runs["a"][0][key] == pytest.approx(runs["b"][0][key], rel=1e-4, abs=1e-6), key
    assert runs["a"][1]["loss"] == pytest.approx(runs["b"][1]["loss"], rel=1e-3)


@pytest.mark.parametrize("model,lora_r", [("tiny_model", 0), ("tiny_model", 8), ("tiny_bert", 0)])
def test_padding_free_batches_train_the_weights_of_padded_ones(model, agreement_data, tmp_path, monkeypatch,
                                                                lora_r, request):
    """`padding_free` (the default) on the CPU: each micro-batch's 2B texts packed into one row with their bounds,
    with the padded batches' losses and weights (float rounding apart) and the same real-token count: a causal LM
    in full and through LoRA's wrapper (adapters and the fully trained head), and a BERT encoder (reward at the
    pooled first token); the packed rewards alone: tests/unit/trainer/stages/test_reward_model.py."""
    tiny_model = request.getfixturevalue(model)
    trained_on, build = [], reward.collate
    monkeypatch.setattr(reward, "collate", lambda *args, **kw: trained_on.append(build(*args, **kw)) or trained_on[-1])
    runs = {}
    for free in (False, True):
        out = tmp_path / f"padding-free-{free}"
        trained_on.clear()
        # The stage's default learning rate: at 3e-3 Adam turns the rounding noise of near-zero gradients into
        # updates of ~1e-3 (its step is about lr x sign(g) there).
        run_reward(rm_config(tiny_model, agreement_data["train"], out, padding_free=free, max_steps=3,
                             per_device_batch_size=4, gradient_accumulation_steps=2, logging_steps=1,
                             learning_rate=1e-4, lora_r=lora_r))
        assert len(trained_on) == 6 + 2 * free  # padding-free first compares 4 pairs packed and padded
        micro = trained_on[-6:]
        assert all(b.num_pairs == 4 for b in micro)
        assert all(len(b.input_ids) == 1 and b.bounds is not None and b.attention_mask is None
                   for b in micro) if free else {len(b.input_ids) for b in micro} == {8}
        records = history(out)
        runs[free] = (weights(out), [r["loss"] for r in records], [r["num_tokens"] for r in records])
    trained = runs[True][0]
    if lora_r:
        assert any("score" in k for k in trained) and all(trained[k].any() for k in trained if "lora_B" in k)
    else:
        start = load_file(Path(tiny_model) / "model.safetensors")
        assert all(not torch.equal(trained[k], start[k]) for k in start), "every weight trains"
    for k in trained:
        torch.testing.assert_close(trained[k], runs[False][0][k], atol=1e-4, rtol=0, msg=k)
    assert runs[True][1] == pytest.approx(runs[False][1], rel=1e-5)
    assert runs[True][2] == runs[False][2]  # the same real tokens, none of them padding


@pytest.mark.parametrize("bf16", [False, True])
def test_padding_free_falls_back_when_attention_mixes_packed_texts(tiny_model, agreement_data, tmp_path,
                                                                    monkeypatch, caplog, bf16):
    """A model whose attention ignores both the bounds and the restarting position ids would let packed texts
    attend to each other: caught before the first step (under bf16 autocast too, where the check allows for
    rounding), and the run trains padded, with a warning naming the model and `padding_free: false` in its
    manifest."""
    import torch.nn.functional as F
    import transformers.masking_utils as masking

    from trainer.engine import attention

    def whole_row(module, query, key, value, bounds, dropout, scaling, longest=None):  # the row's causal attention, no bounds
        groups = query.shape[1] // key.shape[1]
        return F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1),
                                              value.repeat_interleave(groups, 1), is_causal=True,
                                              scale=scaling).transpose(1, 2)

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    monkeypatch.setattr(attention, "per_sequence_attention", whole_row)
    trained_on, build = [], reward.collate
    monkeypatch.setattr(reward, "collate", lambda *args, **kw: trained_on.append(build(*args, **kw)) or trained_on[-1])
    out = tmp_path / "mixed"
    with caplog.at_level(logging.WARNING):
        run_reward(rm_config(tiny_model, agreement_data["train"], out, max_steps=2, bf16=bf16))
    assert "padding_free is off: LlamaForSequenceClassification scores packed texts differently" in caplog.text
    assert trained_on[1].bounds is not None, "the check scored one packed row"
    assert len(trained_on) > 2 and all(b.attention_mask is not None for b in trained_on[2:]), "training is padded"
    assert json.loads((out / ckpt.MANIFEST).read_text())["config"]["padding_free"] is False


def test_padding_free_trains_under_bf16_autocast(tiny_model, agreement_data, tmp_path):
    """Under bf16 autocast packed and padded texts round differently; that is not attention mixing them."""
    out = run_reward(rm_config(tiny_model, agreement_data["train"], tmp_path / "bf16", padding_free=True, max_steps=2,
                               bf16=True))
    assert (Path(out) / "model.safetensors").exists()


def test_max_length_beyond_the_model_positions_names_the_field(tiny_bert, tmp_path):
    long = write_jsonl(tmp_path / "long.jsonl", [{"chosen": "apple " * 200 + "yes", "rejected": "apple " * 200 + "no"}])
    with pytest.raises(reward.ConfigError, match="max_length 128"):
        run_reward(rm_config(tiny_bert, long, tmp_path / "out", max_length=1024))


def test_resume_gives_the_same_model_as_an_uninterrupted_run(tiny_model, agreement_data, tmp_path):
    config = dict(max_steps=6, save_steps=3, save_total_limit=0, logging_steps=1, per_device_batch_size=8)
    full = tmp_path / "full"
    run_reward(rm_config(tiny_model, agreement_data["train"], full, **config))
    # A run that stopped after its step-3 checkpoint: only that checkpoint is in its output folder.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-3", resumed / "checkpoint-3")
    run_reward(rm_config(tiny_model, agreement_data["train"], resumed, resume_from_checkpoint="auto", **config))
    assert [r["step"] for r in history(resumed)] == list(range(1, 7))
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    start = load_file(full / "checkpoint-3" / "model.safetensors")
    for name in a:
        assert not torch.equal(a[name], start[name]), f"{name} did not train after step 3"
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)


def test_lora_trains_adapters_and_the_head(tiny_model, agreement_data, tmp_path):
    out = tmp_path / "lora"
    run_reward(rm_config(tiny_model, agreement_data["train"], out, eval_dataset=agreement_data["test"], lora_r=8,
                         lora_alpha=16, learning_rate=1e-2, max_steps=100, lora_merge_on_save=True))
    assert history(out)[-1]["eval_accuracy"] >= 0.9
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and "score" in adapter["modules_to_save"]
    saved = load_file(out / "adapter_model.safetensors")
    assert any("score" in name for name in saved), "the score head was not saved with the adapter"
    # The adapter folder and its merged copy are the same reward model.
    rows = agreement_pairs(16, seed=3)
    prompts, chosen = [r["prompt"] for r in rows], [r["chosen"] for r in rows]
    torch.testing.assert_close(torch.tensor(RewardModelScorer(str(out))(prompts, chosen)),
                               torch.tensor(RewardModelScorer(str(out / "merged"))(prompts, chosen)),
                               atol=1e-4, rtol=1e-4)


def test_mlflow_run_gets_params_step_metrics_and_the_manifest(tiny_model, agreement_data, tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_reward(rm_config(tiny_model, agreement_data["train"], tmp_path / "out", eval_dataset=agreement_data["test"],
                         max_steps=4, logging_steps=2, center_rewards_coefficient=0.01, mlflow_tracking_uri=uri))
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("alignflow").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["alignflow.stage"] == "reward"
    assert run.data.params["center_rewards_coefficient"] == "0.01"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "accuracy")] == [2, 4]
    assert "eval_accuracy" in run.data.metrics and "max_reward" in run.data.metrics
    manifest = json.loads(Path(client.download_artifacts(run.info.run_id, ckpt.MANIFEST, str(tmp_path))).read_text())
    assert manifest["stage"] == "reward"


def test_cli_runs_demo_config(tiny_model, tmp_path):
    from trainer.cli.main import main

    out = tmp_path / "cli"
    argv = ["train", "reward", "--config", "trainer/configs/reward_demo.yaml", "--model", tiny_model,
            "--output_dir", str(out), "--max_steps", "4", "--save_steps", "2"]
    assert main(argv) == 0
    assert ckpt.is_complete(str(out)) and ckpt.list_checkpoints(str(out))
    assert "eval_accuracy" in history(out)[-1]


# ----------------------------------------------------------------------------------------------
# An encoder without eos (BERT-style, like all-MiniLM-L6-v2), built offline


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> str:
    """A random 2-layer BertForSequenceClassification (head bias 3) and a WordPiece tokenizer with
    [CLS]/[SEP]/[PAD] and no eos or chat template, as all-MiniLM-L6-v2 has."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    # A fixed vocabulary (a trained one may number tied tokens differently from run to run).
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ":", ".", "answer", "yes", "no", "same", "good", "bad", "q",
             *FILLER, *"abcdefghijklmnopqrstuvwxyz", *[f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                        sep_token="[SEP]", mask_token="[MASK]", model_max_length=128)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, num_labels=1,
                        pad_token_id=tokenizer.pad_token_id,
                        initializer_range=0.1)  # BERT's 0.02 gives a random 32-wide model near-constant outputs
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    with torch.no_grad():
        model.classifier.bias.fill_(3.0)
    out = tmp_path_factory.mktemp("tiny-bert")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def trained_bert(tiny_bert, agreement_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bert-rm") / "out"
    run_reward(rm_config(tiny_bert, agreement_data["train"], out, eval_dataset=agreement_data["test"],
                         learning_rate=1e-2))
    return out


def test_encoder_without_eos_trains_and_scores(tiny_bert, trained_bert, agreement_data):
    tokenizer = load_tokenizer(tiny_bert)
    assert tokenizer.eos_token is None
    texts = reward_texts(tokenizer, ["Answer yes:"], [" yes apple"])
    assert texts == ["Answer yes: yes apple"]  # no eos appended; [CLS] … [SEP] come from the tokenizer
    ids = tokenizer(texts)["input_ids"][0]
    assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id

    assert history(trained_bert)[-1]["eval_accuracy"] >= 0.9
    scorer = RewardModelScorer(str(trained_bert))
    assert scorer.tokenizer.eos_token is None and scorer.tokenizer.truncation_side == "left"
    assert ranking_accuracy(scorer, agreement_data["test_rows"]) >= 0.9
