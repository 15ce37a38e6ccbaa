"""What the config layer, and the layers below the objectives (data, models, distributed), know of each value of
`train.objective`: one `Spec` per name. The only other module that names objectives is the registry of their
homes, shardlm.objectives; every other module asks one of the two.

Why a table here and not methods of the families: config checks, fine-tuning defaults, `shardlm prepare`, the
parallel plan and the model's checks run in layers below shardlm.objectives (they cannot import it), and they
need facts, not code: what the objective reads, whether its rows may be split by context, its section's checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shardlm import ShardlmError
from shardlm.config.distill import check_distill
from shardlm.config.grpo import check_grpo
from shardlm.config.schema import Config


def _no_dropout(cfg: Config) -> None:
    """Completions are sampled without dropout, so training with it scores another policy than the one sampled
    (the ratio at grpo.num_iterations=1 would not be 1)."""
    for name, p in (("model.dropout", cfg.model.dropout), ("lora.dropout", cfg.lora.dropout if cfg.lora.r else 0)):
        if p > 0:
            raise ShardlmError(f"{name}={p} with train.objective={cfg.train.objective}: dropout makes the trained "
                               "policy differ from the sampled one (the ratio at grpo.num_iterations=1 would not "
                               f"be 1). Set {name}=0.")


def _check_rl(cfg: Config) -> None:
    _no_dropout(cfg)
    check_grpo(cfg)


def _nothing(cfg: Config) -> None:  # noqa: ARG001 (a Spec's check)
    pass


def _never(cfg: Config) -> str | None:  # noqa: ARG001 (a Spec's sampling)
    return None


@dataclass(frozen=True)
class Spec:
    """One value of train.objective as the lower layers see it."""

    family: str  # its home in shardlm.objectives: lm, preference, rl, distill
    reads: str = "blocks"  # "blocks" (text or examples), "pairs" (chosen/rejected), "unpaired" (labelled
    # examples, KTO), "prompts" (online RL)
    reference: bool = False  # scored against the initial model's values, which a resume must find again
    context_split: bool = False  # parallel.context may split its rows (the next-token and pair losses)
    router_loss: bool = False  # adds a mixture of experts' load-balancing loss (output_router_logits)
    rpo: bool = False  # takes preference.rpo_alpha (TRL's RPO: the chosen answers' cross-entropy added)
    nll: bool = False  # has a cross-entropy term of its own (orpo), which rpo_alpha would repeat
    check: Callable[[Config], None] = _nothing  # its config section's checks, at load
    samples: Callable[[Config], str | None] = _never  # the setting that makes it sample during training, if any
    peer: str = ""  # TRL's config whose defaults it takes (the run header names it)
    defaults: dict[str, float] = field(default_factory=dict)  # beyond the dataclass's (TRL's)
    lr: float | None = None  # train.lr for a pretrained model, where it is not fine-tuning's
    section: str | None = None  # its config section: a resume that changes it changes what the run optimizes
    identified: tuple[str, ...] = ()  # keys of the section a resume checks by identity instead (a teacher's files)


# Online RL takes TRL's: GRPOConfig's and RLOOConfig's learning rate (LoRA or not), and RLOOConfig's group and KL
# coefficient for rloo (the grpo section's own defaults are GRPOConfig's: group 8, beta 0).
RL_LR = 1e-6
# data.seq_len holds a prompt and its completion: TRL's max_prompt_length (512) and grpo.max_completion_length (512)
RL_SEQ_LEN = 1024
_RL = {"family": "rl", "reads": "prompts", "check": _check_rl, "lr": RL_LR, "section": "grpo",
       "samples": lambda cfg: f"train.objective={cfg.train.objective}"}

SPECS: dict[str, Spec] = {
    "sft": Spec("lm", context_split=True, router_loss=True),
    "dpo": Spec("preference", reads="pairs", reference=True, context_split=True, rpo=True, peer="DPOConfig",
                section="preference"),
    "ipo": Spec("preference", reads="pairs", reference=True, context_split=True, rpo=True, peer="DPOConfig",
                section="preference"),
    "simpo": Spec("preference", reads="pairs", context_split=True, peer="CPOConfig", section="preference"),
    "orpo": Spec("preference", reads="pairs", context_split=True, nll=True, peer="ORPOConfig", section="preference"),
    "grpo": Spec(**_RL, peer="GRPOConfig", defaults={"data.seq_len": RL_SEQ_LEN}),  # type: ignore[arg-type]
    "rloo": Spec(**_RL, peer="RLOOConfig",  # type: ignore[arg-type]
                 defaults={"grpo.group": 2, "grpo.beta": 0.05, "data.seq_len": RL_SEQ_LEN}),
    "kto": Spec("kto", reads="unpaired", reference=True, peer="KTOConfig", section="preference"),
    "distill": Spec("distill", check=check_distill, peer="GKDConfig", section="distill", identified=("teacher",),
                    samples=lambda cfg: f"distill.on_policy={cfg.distill.on_policy:g}" if cfg.distill.on_policy > 0
                    else None),
}
OBJECTIVES = tuple(SPECS)


def spec(cfg: Config) -> Spec:
    """The run's objective as the lower layers see it (its name was checked against OBJECTIVES at load)."""
    return SPECS[cfg.train.objective]


def check(cfg: Config) -> None:
    """The objective's own settings: its section's checks, and preference.rpo_alpha only where it applies."""
    s = spec(cfg)
    if cfg.preference.rpo_alpha and not s.rpo:
        name = cfg.train.objective
        raise ShardlmError(f"preference.rpo_alpha adds the chosen answers' cross-entropy to dpo or ipo; "
                           f"train.objective={name} " + (f"has its own ({name})." if s.nll else "does not take it.")
                           + " Set preference.rpo_alpha=0 or train.objective=dpo.")
    s.check(cfg)


def changes(saved: Config, cfg: Config) -> list[str]:
    """What a resume would change of what the run optimizes: its objective, or a key of its section."""
    if saved.train.objective != cfg.train.objective:
        return [f"train.objective {saved.train.objective} -> {cfg.train.objective}"]
    section = spec(cfg).section
    if section is None:
        return []
    before, now = vars(getattr(saved, section)), vars(getattr(cfg, section))
    return [f"{section}.{k} {before.get(k)!r} -> {v!r}" for k, v in now.items()
            if before.get(k) != v and k not in spec(cfg).identified]


def names(family: str) -> tuple[str, ...]:
    """The values of train.objective one family of shardlm.objectives trains."""
    return tuple(name for name, s in SPECS.items() if s.family == family)
