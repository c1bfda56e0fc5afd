"""The RL stages' options: what GRPO and PPO share (prompts, rewards, sampling, the rollout engine), then each
stage's own (`trainer/stages/rl/grpo.py`, `trainer/stages/rl/ppo.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.algorithms.choices import AdvantageEstimator, GRPOLossType, ISMode, ScaleRewards
from trainer.config.options import TrainConfig, option
from trainer.errors import ConfigError


@dataclass
class RolloutConfig(TrainConfig):
    """What GRPO and PPO share: prompts, reward functions, sampling, and the rollout engine (TRL's names)."""

    reward_funcs: list[str] = option(["exact_answer"], "Reward functions: built-ins (exact_answer, accuracy_reward, "
                                     "answer_format, regex:<pattern>, length:<N>, "
                                     "soft_overlong_punishment:<max>:<cache>), import paths `pkg.module:fn` with "
                                     "TRL's signature, or reward models: checkpoint folders, s3:// URIs or hub ids "
                                     "(org/name, from the local HF cache or downloaded).")
    reward_weights: list[float] = option([], "One weight per reward function (default: all 1.0).")
    reward_label: str | None = option(None, "For reward models that are classifiers with several labels (e.g. a "
                                            "sentiment model): the label whose score is the reward, a name from the "
                                            "model's config.id2label (e.g. POSITIVE). One-label reward models ignore it.")
    reward_label_score: Literal["logit", "probability"] = option(
        "logit", "What `reward_label` scores: its logit, or its softmax probability over the model's labels.")
    max_prompt_length: int = option(512, "Longest prompt in tokens (see `truncation_mode`).")
    max_completion_length: int = option(256, "Most tokens generated per completion.",
                                         aliases=("response_length",))
    temperature: float = option(1.0, "Sampling temperature T. The trainer's log-probs, entropy and KL are those of "
                                     "softmax(logits / T), the distribution completions are drawn from (as in TRL).")
    top_p: float = option(1.0, "Nucleus sampling probability mass.")
    top_k: int = option(-1, "Sample from the top k tokens only (-1 = off).")
    rollout_engine: Literal["hf", "vllm", "vllm-server"] = option(
        "hf", "hf: transformers generate; vllm: vLLM in this process; vllm-server: one `alignflow rollout-server` "
              "for the whole job (a running one at vllm_server_host/port, or one the first rank starts).")
    vllm_gpu_memory_utilization: float = option(0.3, "Share of GPU memory vLLM may take (vllm engines on GPU).")
    vllm_server_devices: str | None = option(None, "CUDA_VISIBLE_DEVICES for the vllm-server the job starts itself "
                                                   "(e.g. '1').")
    vllm_server_host: str | None = option(None, "Host of a running `alignflow rollout-server` (TRL's name; port "
                                                "vllm_server_port). Unset with the port: the job starts one server, "
                                                "on its first rank.")
    vllm_server_port: int | None = option(None, "Port of that server (8000 when only the host is given).")
    vllm_server_base_url: str | None = option(None, "URL of that server, e.g. http://rollout:8000 (instead of host "
                                                    "and port).")
    vllm_server_timeout: float = option(240.0, "Seconds to wait for the rollout server to answer, and to form the "
                                               "weight group with it (TRL's default).")
    vllm_group_port: int = option(51216, "Port of the weight group on the rollout server's host (TRL's default): the "
                                         "pushing rank joins a torch.distributed group with the server's workers "
                                         "there and broadcasts the weights (gloo on CPU, NCCL on GPU), unless the "
                                         "server shares this node's /dev/shm. 0: weights go over HTTP instead.")
    vllm_enable_sleep_mode: bool = option(False, "rollout_engine vllm on a GPU: free vLLM's GPU memory (weights and KV "
                                                 "cache) after each rollout, for the update; the weight push and the "
                                                 "next rollout wake it (TRL's name). Slower steps, more room.")
    truncation_mode: Literal["keep_end", "keep_start", "drop"] = option(
        "keep_end", "Prompts longer than `max_prompt_length`: keep their end (left truncation, TRL's behaviour), "
                    "keep their start, or drop them. The count is logged.")
    log_completions_steps: int = option(10, "Log a table of sample prompts, completions and rewards every this many steps.")
    num_completions_to_log: int = option(8, "Rows in that table.")

    def validate(self) -> None:
        super().validate()
        for name in ("max_prompt_length", "max_completion_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        if self.temperature < 0:
            raise ConfigError(f"`temperature` must be >= 0, got {self.temperature}.")
        if not self.reward_funcs:
            raise ConfigError("`reward_funcs` is empty; give at least one reward function or reward model.")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(f"`reward_weights` has {len(self.reward_weights)} entries for "
                              f"{len(self.reward_funcs)} `reward_funcs`; give one weight per function.")
        check_server_options(self)
        if self.max_prompt_length + self.max_completion_length > self.max_length:
            raise ConfigError(f"max_prompt_length + max_completion_length = "
                              f"{self.max_prompt_length + self.max_completion_length} exceeds `max_length` "
                              f"({self.max_length}), the longest sequence; raise max_length or shorten one of them.")

    @property
    def prompts_per_cycle(self) -> int:
        """Prompts each rank rolls out per generation cycle (the stage says how its batch options give it)."""
        raise NotImplementedError


def check_server_options(config) -> None:
    """The rollout-server options of GRPO and PPO: only with rollout_engine vllm-server, one address at a time."""
    given = [f for f in ("vllm_server_host", "vllm_server_port", "vllm_server_base_url") if getattr(config, f)]
    if given and config.rollout_engine != "vllm-server":
        raise ConfigError(f"`{given[0]}` addresses a rollout server, but rollout_engine is {config.rollout_engine}: "
                          "set rollout_engine vllm-server (TRL: use_vllm true, vllm_mode server) or remove it.")
    if config.vllm_server_base_url and {"vllm_server_host", "vllm_server_port"} & set(given):
        raise ConfigError("Set either `vllm_server_base_url` or `vllm_server_host`/`vllm_server_port`, not both.")
    if config.vllm_server_port is not None and not 0 < config.vllm_server_port < 65536:
        raise ConfigError(f"`vllm_server_port` must be in 1..65535, got {config.vllm_server_port}.")
    if config.vllm_server_timeout <= 0:
        raise ConfigError(f"`vllm_server_timeout` must be > 0 seconds, got {config.vllm_server_timeout}.")
    if not 0 <= config.vllm_group_port < 65536:
        raise ConfigError(f"`vllm_group_port` must be in 1..65535 (0: weights over HTTP), got {config.vllm_group_port}.")
    if config.vllm_enable_sleep_mode and config.rollout_engine != "vllm":
        raise ConfigError(f"`vllm_enable_sleep_mode` frees the memory of vLLM inside the training process, but "
                          f"rollout_engine is {config.rollout_engine}: set rollout_engine vllm (TRL: vllm_mode "
                          "colocate), or remove it (a rollout server keeps its own GPUs).")
    if not 0 < config.vllm_gpu_memory_utilization <= 1:
        raise ConfigError("`vllm_gpu_memory_utilization` is the share of the rollout GPU's memory vLLM may take: "
                          f"give a number in (0, 1], got {config.vllm_gpu_memory_utilization}.")


@dataclass
class GRPOConfig(RolloutConfig):
    """Group relative policy optimisation with rule, Python or reward-model rewards."""

    learning_rate: float = option(1e-6, "Peak learning rate (AdamW); TRL's GRPO default.")
    per_device_batch_size: int = option(8, "Completions per forward/backward pass (as TRL counts it).",
                                        aliases=("per_device_train_batch_size",))
    max_steps: int = option(100, "Optimizer steps to run (-1 = `num_epochs` passes over the prompts).")
    logging_steps: int = option(1, "Log metrics every this many steps.")
    num_generations: int = option(8, "Completions per prompt (G); advantages are normalised within each group.")
    beta: float = option(0.0, "KL coefficient against the reference model (k3 estimator; 0 = no reference "
                              "model, TRL's default). https://arxiv.org/abs/2402.03300")
    use_bias_correction_kl: bool = option(True, "With beta > 0: multiply each token's KL by the importance ratio "
                                                "(trainer over old policy), which makes the KL gradient the unbiased "
                                                "reverse-KL gradient (DeepSeek-V3.2, https://arxiv.org/abs/2512.02556; "
                                                "TRL's default). false: the plain k3 KL of the GRPO paper.")
    epsilon: float = option(0.2, "Lower clipping range of the importance ratio (and upper when epsilon_high is unset).")
    epsilon_high: float | None = option(None, "Upper clipping range (DAPO's clip-higher, e.g. 0.28). "
                                              "https://arxiv.org/abs/2503.14476")
    num_iterations: int = option(1, "Optimizer steps per generation cycle (mu in the GRPO paper).")
    loss_type: GRPOLossType = option(
        "dapo", "Loss aggregation: grpo (mean per sequence, then batch), bnpo (tokens of the local batch), "
                "dr_grpo (divide by batch x max_completion_length), dapo (tokens of the whole cycle; TRL's default).")
    advantage_estimator: AdvantageEstimator = option(
        "grpo", "grpo: (r − group mean) / std (`scale_rewards`); rloo: r minus the mean of the group's other "
                "G − 1 rewards (REINFORCE leave-one-out, TRL's RLOOTrainer; `scale_rewards` unused). "
                "https://arxiv.org/abs/2402.14740")
    scale_rewards: ScaleRewards = option(
        "group", "Divide centred rewards by the group's std, the batch's std, or not at all (Dr. GRPO).")
    mask_truncated_completions: bool = option(False, "Exclude completions that hit max_completion_length from the loss.")
    importance_sampling_correction: bool = option(True, "Weight the loss by the truncated ratio of trainer to "
                                                         "rollout-engine probabilities (engine log-probs kept).",
                                                  aliases=("vllm_importance_sampling_correction",))
    importance_sampling_mode: ISMode = option(
        "token_truncate", "How that ratio weights the loss: per token, or per completion (its tokens' log-ratios "
                          "summed); clamped into [importance_sampling_min, importance_sampling_cap] (*_truncate) or "
                          "zero outside it (*_mask). TRL's default is sequence_mask.",
        aliases=("vllm_importance_sampling_mode",))
    importance_sampling_cap: float = option(3.0, "Upper bound of that importance ratio.",
                                            aliases=("vllm_importance_sampling_cap",
                                                     "vllm_importance_sampling_clip_max"))
    importance_sampling_min: float | None = option(None, "Lower bound of that importance ratio (unset = none).",
                                                   aliases=("vllm_importance_sampling_clip_min",))
    share_prompt: bool = option(True, "Run each group's prompt through the model once per micro-batch instead of "
                                      "once per completion (completions see it through a block attention mask; "
                                      "same log-probs); sdpa then attends block by block. Needs sdpa or eager "
                                      "attention; off for rows > 4096 tokens.")

    stage = "grpo"

    def validate(self) -> None:
        super().validate()
        total = self.per_device_batch_size * self.gradient_accumulation_steps
        if self.num_generations < 2:
            raise ConfigError(f"`num_generations` must be >= 2 to form groups, got {self.num_generations}.")
        if total % self.num_generations:
            raise ConfigError(f"per_device_batch_size x gradient_accumulation_steps = {total} must be divisible by "
                              f"num_generations = {self.num_generations}; change one of them.")
        if self.num_iterations < 1:
            raise ConfigError(f"`num_iterations` must be >= 1, got {self.num_iterations}.")
        low = self.importance_sampling_min
        if low is not None and not 0 <= low < self.importance_sampling_cap:
            raise ConfigError(f"`importance_sampling_min` must be in [0, importance_sampling_cap = "
                              f"{self.importance_sampling_cap}), got {low}.")
        if self.temperature == 0:
            raise ConfigError("`temperature` 0 samples greedily: every completion of a prompt is the same, so every "
                              "group advantage is 0 and GRPO learns nothing. Use a temperature > 0 (TRL's default "
                              "is 1.0).")

    @property
    def prompts_per_cycle(self) -> int:  # a step's completions, in groups of G
        return self.per_device_batch_size * self.gradient_accumulation_steps // self.num_generations


@dataclass
class PPOConfig(RolloutConfig):
    """PPO with a value head, GAE and adaptive KL control (RLHF: Ziegler et al. 2019, Ouyang et al. 2022)."""

    learning_rate: float = option(3e-6, "Peak learning rate (AdamW); TRL's PPO default.")
    per_device_batch_size: int = option(8, "Rollouts per forward/backward pass (micro-batch).",
                                        aliases=("per_device_train_batch_size",))
    max_steps: int = option(100, "Optimizer steps to run (-1 = `num_epochs` passes over the prompts); "
                                 "a PPO step takes ppo_epochs x batch_size / mini_batch_size of them.")
    logging_steps: int = option(1, "Log metrics every this many steps.")
    batch_size: int = option(16, "Rollouts (prompts, one completion each) per PPO step, on each rank.")
    mini_batch_size: int = option(8, "Rollouts per optimizer step; a multiple of per_device_batch_size "
                                     "(the quotient is the gradient accumulation).")
    ppo_epochs: int = option(4, "Passes over each PPO step's rollouts (in shuffled mini-batches).",
                             aliases=("num_ppo_epochs",))
    gamma: float = option(1.0, "Discount factor of GAE. https://arxiv.org/abs/1506.02438")
    lam: float = option(0.95, "Lambda of GAE (bias/variance trade-off of the advantages).")
    cliprange: float = option(0.2, "Clip range of the policy ratio (epsilon of PPO). https://arxiv.org/abs/1707.06347")
    cliprange_value: float = option(0.2, "Clip range of the value prediction around its rollout-time value.")
    vf_coef: float = option(0.1, "Weight of the value loss in the total loss.")
    whiten_rewards: bool = option(False, "Whiten the per-token rewards (keeping their mean) before GAE.")
    init_kl_coef: float = option(0.05, "KL coefficient beta of the per-token KL penalty (TRL PPOv2's `kl_coef`); "
                                       "the starting value when `adap_kl_ctrl`.", aliases=("kl_coef",))
    adap_kl_ctrl: bool = option(False, "Adapt beta towards `target_kl` (proportional controller of Ziegler et al. "
                                       "2019). https://arxiv.org/abs/1909.08593")
    target_kl: float = option(6.0, "Target KL (summed over a completion's tokens) of the adaptive controller.")
    horizon: int = option(10000, "Rollouts over which the adaptive controller corrects a KL error of 20 percent or more by e^0.2.")
    missing_eos_penalty: float | None = option(None, "Subtract this from the score of completions that end without "
                                                     "EOS (hit max_completion_length); TRL's `missing_eos_penalty`.")

    critic: Literal["value_head", "reward_model"] = option(
        "value_head", "The value function V_t. value_head: a zero-initialised scalar head on the policy's last hidden "
                      "state (TRL's AutoModelForCausalLMWithValueHead; policy and values share the network). "
                      "reward_model: a separate critic network initialised from a reward model, whose score head "
                      "reads every token's hidden state (TRL PPOv2's value_model, OpenRLHF's critic_pretrain); it "
                      "trains with the same optimizer and is saved as `critic/` next to the model.")
    critic_model: str | None = option(None, "With critic=reward_model: the checkpoint (folder, s3:// or hub id) of "
                                            "the critic's starting point; default: the one reward model in "
                                            "`reward_funcs`. A causal-LM sequence classifier with the policy's "
                                            "tokenizer.")

    stage = "ppo"

    def validate(self) -> None:
        super().validate()
        for name in ("batch_size", "mini_batch_size", "ppo_epochs", "horizon"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        if self.batch_size % self.mini_batch_size or self.mini_batch_size % self.per_device_batch_size:
            raise ConfigError(f"batch_size ({self.batch_size}) must be a multiple of mini_batch_size "
                              f"({self.mini_batch_size}), and that a multiple of per_device_batch_size "
                              f"({self.per_device_batch_size}); change one of them.")
        if self.gradient_accumulation_steps != 1:
            raise ConfigError("PPO accumulates mini_batch_size / per_device_batch_size micro-batches per optimizer "
                              "step; leave `gradient_accumulation_steps` at 1 and set `mini_batch_size` instead.")
        if self.critic_model and self.critic != "reward_model":
            raise ConfigError(f"`critic_model` ({self.critic_model!r}) is used with critic=reward_model only; set "
                              "`critic: reward_model` or drop `critic_model`.")
        if self.adap_kl_ctrl and self.target_kl <= 0:
            raise ConfigError(f"`target_kl` must be > 0 with adap_kl_ctrl, got {self.target_kl}.")

    @property
    def prompts_per_cycle(self) -> int:  # one completion per prompt
        return self.batch_size

    @property
    def updates_per_rollout(self) -> int:
        return self.ppo_epochs * self.batch_size // self.mini_batch_size
