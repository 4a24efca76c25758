"""The training commands' settings, apart from the training code: `tokenmill --help` and the command line's
parser read their defaults without importing torch (which the training modules need)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MedusaTrainingConfig:
    num_heads: int = 3
    num_layers: int = 1
    max_tokens: int = 192  # generated per prompt
    temperature: float = 0.0  # of the generation (0: greedy, what a greedy deployment will see)
    epochs: int = 4
    batch_size: int = 256  # positions per optimizer step
    lr: float = 1e-3  # the residual blocks'; the LM heads' is a tenth of it
    head_decay: float = 0.8  # head i's loss weight is head_decay ** i
    # The heads use the target's LM head (trained: their blocks only), which the runner reads once per step
    # for the target and all heads; False: each head an LM head of its own (Medusa's layout), a copy of the
    # target's at the start, trained at a tenth of lr, and read on every step besides the target's.
    shared_lm_head: bool = True
    held_out: float = 0.1  # the fraction of sequences kept for the accuracy estimate
    seed: int = 0


@dataclass
class EagleTrainingConfig:
    num_layers: int = 1
    max_tokens: int = 192  # generated per prompt
    temperature: float = 0.0  # of the generation (0: greedy, what a greedy deployment will see)
    # Sampled continuations per prompt besides the one at `temperature`: more, varied data. On held-out prompts 4
    # answers gave 41.2% top-1 in 1,200 steps, 12 answers 45.5%, and with the self-written prompts below 48.1%.
    extra_samples: int = 11
    sample_temperature: float = 0.8  # of those
    # User messages the model writes itself (selfdistill.self_written_prompts), each answered at `temperature` and
    # self_prompt_samples more times: new topics, where more answers to the same prompts repeat them. The defaults
    # (~260k positions, 8 epochs: ~2,000 steps) fit SmolLM2's head into ~20 minutes of two cores.
    self_prompts: int = 384
    self_prompt_samples: int = 1
    epochs: int = 8
    tokens_per_step: int = 1024  # rows per optimizer step (whole sequences packed together)
    lr: float = 1e-3  # the peak: linear warm-up over warmup_frac of the steps, then cosine decay to min_lr_frac of it
    warmup_frac: float = 0.05
    min_lr_frac: float = 0.1
    grad_clip: float = 0.5  # max gradient norm (EAGLE's); a constant lr with no clipping diverged in long runs
    token_loss_weight: float = 0.1  # EAGLE's: the regression loss weighs 1, the token loss 0.1
    noise: float = 0.1  # uniform noise on the input states, times their RMS
    held_out: float = 0.1  # the fraction of sequences kept for the accuracy estimate
    draft_vocab: int = 8192  # tokens the drafts may take (the most frequent in the generated text); 0: all
    seed: int = 0
