"""The online-RL decisions of the run plan (stages grpo / rloo): the loss, the clip range, the advantage
scaling, the KL reference, the rewards and their weights, and whether rollouts are reused or stale (and
so corrected by the importance ratio). Taken once here; the stage hands them to TRL as they are.

TRL 1.16 evidence for each (trl/trainer/grpo_trainer.py, rloo_trainer.py):
- beta == 0: `self.ref_model = None` and the reference log-probs are never computed (no copy loaded,
  no adapter-off forward); beta > 0 with LoRA: the adapter-off base (a fresh adapter) or a frozen "ref"
  copy of a resumed adapter; full/freeze: TRL loads a frozen copy of model_name_or_path.
- stale rollouts: `old_per_token_logps` is computed at generation time whenever
  gradient_accumulation_steps % (steps_per_generation x num_iterations) != 0, and the clipped ratio
  exp(logp - old_logp) is the importance weight; on-policy it is 1 (logp.detach()).
- RLOO's loss is sequence-level (the answer's summed log-ratio), averaged over answers, and its KL
  goes into the reward; it has no loss_type / scale_rewards / importance_sampling_level."""

from __future__ import annotations

from dataclasses import dataclass

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config, FinetuningArgs
from lmstack.config.stages import StageSpec

RL_STAGES = ("grpo", "rloo")
SHIPPED_REWARDS = ("accuracy", "format", "length")  # train/rewards.py
# knobs GRPOConfig has and RLOOConfig lacks (RLOO scales its advantages with ppo_score_norm)
GRPO_ONLY = (
    "loss_type",
    "scale_rewards",
    "importance_sampling_level",
    "tool_funcs",
    "max_tool_calling_iterations",
)
RL_KNOBS = (
    *GRPO_ONLY,
    "epsilon",
    "epsilon_high",
    "mask_truncated_completions",
    "num_iterations",
    "steps_per_generation",
    "reward_weights",
    "tool_funcs",
    "max_tool_calling_iterations",
    "rollout_engine",
)
REWARD_MODEL_NAME = "reward_model"  # the reward function TRL logs as rewards/reward_model/mean


@dataclass(frozen=True)
class RLPlan:
    loss_type: str  # grpo | bnpo | dr_grpo | dapo; "rloo" for stage rloo (its own sequence-level loss)
    epsilon: float  # ratio clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float
    scale_rewards: str  # group | batch | none (rloo: "ppo_score_norm" or "none")
    importance_sampling_level: str  # token | sequence
    mask_truncated_completions: bool
    beta: float
    reference: str  # what the KL is measured to (or "none")
    rewards: tuple[str, ...]  # as TRL names them in rewards/<name>/mean
    reward_weights: tuple[float, ...]
    num_iterations: int
    steps_per_generation: int
    stale: bool  # rollouts reused or from an older policy: the ratio to the sampling-time policy applies
    tools: tuple[str, ...] = ()  # tool_funcs: multi-turn rollouts calling them (train/tool_rollout.py)
    max_tool_calls: int | None = None
    rollout_engine: str = "generate"  # continuous_batching | generate (train/rollout_engine.py)
    rollout_why: str = ""

    def label(self) -> str:
        clip = (
            f"{self.epsilon:g}"
            if self.epsilon_high == self.epsilon
            else f"{self.epsilon:g}/{self.epsilon_high:g}"
        )
        weights = ",".join(f"{w:g}" for w in self.reward_weights)
        return (
            f"{self.loss_type}, clip {clip}, scale {self.scale_rewards}, {self.importance_sampling_level} ratio, "
            f"beta {self.beta:g}, rewards {'+'.join(self.rewards)} x ({weights})"
            + (", masks truncated" if self.mask_truncated_completions else "")
            + (
                f", tools {'+'.join(self.tools)} (at most {self.max_tool_calls or 'max_new_tokens'})"
                if self.tools
                else ""
            )
            + f", rollouts {self.rollout_engine}"
        )

    def reason(self) -> str:
        ref = f"KL to {self.reference}" if self.beta > 0 else "pref_beta: 0, no KL term: no reference forward"
        if self.stale:
            ratio = (
                f"rollouts serve {self.steps_per_generation} micro-steps x {self.num_iterations} passes: the ratio "
                "to the sampling-time log-probs (recorded at generation) corrects the stale ones"
            )
        else:
            ratio = "on-policy (each rollout used once in its own step): the ratio is 1"
        tools = (
            "; tool answers are observation turns in the template's format, masked from the loss"
            if self.tools
            else ""
        )
        return f"{ref}; {ratio}{tools}; rollouts: {self.rollout_why}"


def reward_names(ft: FinetuningArgs) -> tuple[str, ...]:
    """The rewards in TRL's order (reward_funcs as listed, then the reward model), as TRL logs them:
    a function by its __name__ (the shipped ones are named accuracy / format / length)."""
    names = []
    for spec in [s.strip() for s in (ft.reward_funcs or "").split(",") if s.strip()]:
        names.append(spec if spec in SHIPPED_REWARDS else spec.rpartition(":")[2] or spec)
    if ft.reward_model:
        names.append(REWARD_MODEL_NAME)
    return tuple(names)


def reference(cfg: Config, stage: str) -> str:
    ft = cfg.finetuning
    if ft.pref_beta == 0:
        return "none"
    if ft.finetuning_type == "lora":
        if cfg.model.adapter_name_or_path and stage in RL_STAGES:
            return "the resumed adapter's frozen copy ('ref' adapter)"
        return "the base model with the adapter disabled (no copy)"
    return f"a frozen copy of {cfg.model.model_name_or_path}"


CB_MIN_TRANSFORMERS = "5.8.0"  # TRL 1.16 refuses use_transformers_continuous_batching below it


def rollout_engine(cfg: Config, sharded: bool, vision: bool, attention: str = "sdpa") -> tuple[str, str]:
    """How answers are sampled. Continuous batching (transformers' generate_batch: a paged KV cache,
    requests join and leave the running batch as they finish, decode steps replayed as CUDA graphs on a
    GPU) runs on the trained module itself, LoRA applied in place, no weight copy; it needs
    transformers >= 5.8, text prompts (the paged engine takes token ids only, no image features) and
    whole weights on each process (ZeRO-3 / FSDP shards are gathered only by the plain generate path)
    and an attention it runs paged (sdpa, eager, flash; transformers refuses flex_attention).
    Else (or `rollout_engine: generate`) one padded model.generate batch, TRL's default."""
    asked = cfg.finetuning.rollout_engine
    blockers = []
    if vision:
        blockers.append("image prompts (the paged engine takes token ids only, no image features)")
    if sharded:
        blockers.append("sharded weights (ZeRO-3 / FSDP gather them for model.generate only)")
    if attention == "flex_attention":
        blockers.append("flash_attn: flex (the paged engine runs sdpa, eager or flash attention)")
    if not _transformers_at_least(CB_MIN_TRANSFORMERS):
        blockers.append(f"transformers < {CB_MIN_TRANSFORMERS} (no generate_batch)")
    if asked == "generate":
        return "generate", "rollout_engine: generate (one padded model.generate batch per rollout)"
    if asked == "continuous_batching" and blockers:
        raise ConfigError(
            f"rollout_engine: continuous_batching does not support {'; '.join(blockers)}; "
            "use rollout_engine: generate (or auto)"
        )
    if blockers:
        return "generate", f"model.generate: continuous batching does not fit {'; '.join(blockers)}"
    if asked == "auto":  # measured slower on the H200 (bench/results/rl.jsonl): not the default until faster
        return "generate", (
            "model.generate (TRL's padded batch): continuous batching measured slower on an H200 "
            "(1.5B LoRA, 8 x 256 tokens: 168 vs 203 rollout tokens/s); rollout_engine: continuous_batching "
            "asks for it"
        )
    return "continuous_batching", (
        "transformers continuous batching (paged KV cache, finished answers leave the batch, decode as "
        "CUDA graphs on a GPU) on the trained weights in place"
    )


def _transformers_at_least(version: str) -> bool:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    from packaging.version import Version

    try:
        return Version(installed("transformers")) >= Version(version)
    except PackageNotFoundError:
        return False


def rl_plan(
    cfg: Config, spec: StageSpec, sharded: bool = False, attention: str = "sdpa"
) -> tuple[RLPlan | None, str]:
    """The RL decisions of a grpo / rloo run (None for the other stages, whose fields rules.py checks)."""
    if spec.name not in RL_STAGES:
        return None, ""
    ft, t = cfg.finetuning, cfg.training
    names = reward_names(ft)
    weights = tuple(ft.reward_weights) if ft.reward_weights else (1.0,) * len(names)
    if ft.reward_weights and len(ft.reward_weights) != len(names):
        raise ConfigError(
            f"reward_weights: {len(ft.reward_weights)} weights for {len(names)} rewards "
            f"({', '.join(names) or 'none'}); give one per reward_funcs entry, then one for reward_model"
        )
    steps = ft.steps_per_generation or t.gradient_accumulation_steps
    from lmstack.models.vision import vision_model_type

    vision = vision_model_type(cfg.model.model_name_or_path) is not None
    engine, engine_why = rollout_engine(cfg, sharded, vision, attention)
    rloo = spec.name == "rloo"
    plan = RLPlan(
        loss_type="rloo" if rloo else ft.loss_type,
        epsilon=ft.epsilon,
        epsilon_high=ft.epsilon_high if ft.epsilon_high is not None else ft.epsilon,
        scale_rewards=("ppo_score_norm" if ft.ppo_score_norm else "none") if rloo else ft.scale_rewards,
        importance_sampling_level="sequence" if rloo else ft.importance_sampling_level,
        mask_truncated_completions=ft.mask_truncated_completions,
        beta=ft.pref_beta,
        reference=reference(cfg, spec.name),
        rewards=names,
        reward_weights=weights,
        num_iterations=ft.num_iterations,
        steps_per_generation=steps,
        stale=t.gradient_accumulation_steps % (steps * ft.num_iterations) != 0,
        tools=tuple(s.strip().rpartition(":")[2] for s in (ft.tool_funcs or "").split(",") if s.strip()),
        max_tool_calls=ft.max_tool_calling_iterations,
        rollout_engine=engine,
        rollout_why=engine_why,
    )
    return plan, plan.reason()
