"""`tokenmill train-medusa` / `train-eagle`: Medusa heads or an EAGLE draft head for a model, trained on its own
answers to chat prompts; `tokenmill calibrate-smoothquant`: SmoothQuant's act scales, measured on the same kind of text."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from tokenmill.bench.datasets import CHAT_TRAIN_PROMPTS
from tokenmill.training.configs import EagleTrainingConfig, MedusaTrainingConfig



def add_train_medusa_parser(sub, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    defaults = MedusaTrainingConfig()
    parser = sub.add_parser("train-medusa", help="train Medusa heads for a model on its own generations (self-distillation)")
    parser.add_argument("--output", "-o", required=True, help="folder to write the heads to (config.json, medusa_lm_head.safetensors)")
    parser.add_argument("--prompts-file", default=None, help="prompts, one per line (default: the package's chat prompts)")
    parser.add_argument("--num-prompts", type=int, default=CHAT_TRAIN_PROMPTS, help="prompts to generate from")
    parser.add_argument("--num-heads", type=int, default=defaults.num_heads)
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers, help="residual blocks per head")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="tokens generated per prompt")
    parser.add_argument("--temperature", type=float, default=defaults.temperature, help="of the generation")
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="positions per optimizer step")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--own-lm-heads", action="store_true",
                        help="give each head an LM head of its own (Medusa's own layout; each read every step) "
                             "instead of sharing the target's")
    add_engine_args(parser)
    parser.set_defaults(func=cmd_train_medusa)


def cmd_train_medusa(args: argparse.Namespace) -> None:
    from tokenmill.loader.medusa import save_medusa_heads
    from tokenmill.training.medusa import chat_prompts, train_medusa_heads

    _check_at_least(("--num-prompts", args.num_prompts, 1), ("--num-heads", args.num_heads, 1), ("--num-layers", args.num_layers, 1),
                    ("--max-tokens", args.max_tokens, 3), ("--epochs", args.epochs, 1), ("--batch-size", args.batch_size, 1))
    config = MedusaTrainingConfig(num_heads=args.num_heads, num_layers=args.num_layers, max_tokens=args.max_tokens,
                                  temperature=args.temperature, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                                  shared_lm_head=not args.own_lm_heads)
    llm = _generating_llm(args, "train-medusa")
    prompts = chat_prompts(llm.get_tokenizer(), args.prompts_file, args.num_prompts)
    heads, report = train_medusa_heads(llm, prompts, config)
    save_medusa_heads(heads, args.output, base_model=llm.llm_engine.model_name)
    accuracy = ", ".join(f"head {i}: {a:.1%}" for i, a in enumerate(report.accuracy))
    print(f"trained {len(heads.heads)} Medusa heads on {report.num_positions} positions of {report.num_sequences} generated "
          f"sequences (generation {report.generate_s:.0f} s, training {report.train_s:.0f} s); held-out top-1 accuracy: "
          f"{accuracy or 'n/a'}; written to {args.output}")
    print(f"use them with --speculative-config '{{\"method\": \"medusa\", \"model\": \"{args.output}\", "
          f"\"num_speculative_tokens\": {len(heads.heads)}}}'")


def add_train_eagle_parser(sub, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    defaults = EagleTrainingConfig()
    parser = sub.add_parser("train-eagle", help="train an EAGLE draft head for a model on its own generations (self-distillation)")
    parser.add_argument("--output", "-o", required=True, help="folder to write the head to (config.json, model.safetensors)")
    parser.add_argument("--prompts-file", default=None, help="prompts, one per line (default: the package's chat prompts)")
    parser.add_argument("--num-prompts", type=int, default=CHAT_TRAIN_PROMPTS, help="prompts to generate from")
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers, help="decoder layers of the head")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="tokens generated per prompt")
    parser.add_argument("--temperature", type=float, default=defaults.temperature, help="of the generation")
    parser.add_argument("--extra-samples", type=int, default=defaults.extra_samples,
                        help="sampled continuations per prompt besides the one at --temperature (more, varied training data)")
    parser.add_argument("--sample-temperature", type=float, default=defaults.sample_temperature, help="of the extra samples")
    parser.add_argument("--self-prompts", type=int, default=defaults.self_prompts,
                        help="user messages the model writes itself (from its chat template's user turn), answered too (0: none)")
    parser.add_argument("--self-prompt-samples", type=int, default=defaults.self_prompt_samples,
                        help="sampled answers to each self-written prompt besides the one at --temperature")
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--tokens-per-step", type=int, default=defaults.tokens_per_step, help="positions per optimizer step")
    parser.add_argument("--draft-vocab", type=int, default=defaults.draft_vocab,
                        help="tokens the drafts may take, the model's most frequent choices in the generated text (0: the whole vocabulary)")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate (warm-up, then cosine decay)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    add_engine_args(parser)
    parser.set_defaults(func=cmd_train_eagle)


def cmd_train_eagle(args: argparse.Namespace) -> None:
    from tokenmill.loader.eagle import save_eagle_head
    from tokenmill.training.eagle import train_eagle_head
    from tokenmill.training.selfdistill import chat_prompts

    _check_at_least(("--num-prompts", args.num_prompts, 1), ("--num-layers", args.num_layers, 1), ("--max-tokens", args.max_tokens, 3),
                    ("--epochs", args.epochs, 1), ("--tokens-per-step", args.tokens_per_step, 1), ("--draft-vocab", args.draft_vocab, 0),
                    ("--extra-samples", args.extra_samples, 0), ("--self-prompts", args.self_prompts, 0),
                    ("--self-prompt-samples", args.self_prompt_samples, 0))
    config = EagleTrainingConfig(num_layers=args.num_layers, max_tokens=args.max_tokens, temperature=args.temperature,
                                 extra_samples=args.extra_samples, sample_temperature=args.sample_temperature,
                                 self_prompts=args.self_prompts, self_prompt_samples=args.self_prompt_samples, epochs=args.epochs,
                                 tokens_per_step=args.tokens_per_step, lr=args.lr, draft_vocab=args.draft_vocab, seed=args.seed)
    llm = _generating_llm(args, "train-eagle")
    prompts = chat_prompts(llm.get_tokenizer(), args.prompts_file, args.num_prompts)
    head, report = train_eagle_head(llm, prompts, config)
    save_eagle_head(head.eagle_state_dict(), {**head.eagle_config(), "base_model_name_or_path": llm.llm_engine.model_name}, args.output)
    accuracy = "n/a" if report.accuracy is None else f"{report.accuracy:.1%} (the draft vocabulary holds {report.vocab_coverage:.1%} of the tokens)"
    print(f"trained an EAGLE head ({args.num_layers} layer(s)) on {report.num_positions} positions of {report.num_sequences} generated "
          f"sequences ({len(prompts)} prompts, {report.num_self_prompts} written by the model; generation {report.generate_s:.0f} s, "
          f"training {report.train_s:.0f} s); held-out top-1 accuracy of the "
          f"first draft: {accuracy}; written to {args.output}")
    print(f"use it with --speculative-config '{{\"method\": \"eagle\", \"model\": \"{args.output}\", \"num_speculative_tokens\": 3}}'")


def add_calibrate_smoothquant_parser(sub, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    parser = sub.add_parser("calibrate-smoothquant",
                            help="measure each linear layer's input absmax per channel (SmoothQuant's act scales) for w8a8")
    parser.add_argument("--output", "-o", required=True, help="the act-scales file to write (.safetensors)")
    parser.add_argument("--prompts-file", default=None, help="prompts, one per line (default: the package's chat prompts)")
    parser.add_argument("--num-prompts", type=int, default=CHAT_TRAIN_PROMPTS, help="prompts to answer")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (greedy)")
    add_engine_args(parser)
    parser.set_defaults(func=cmd_calibrate_smoothquant)


def cmd_calibrate_smoothquant(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    from tokenmill.training.calibrate import calibrate_act_scales
    from tokenmill.training.selfdistill import chat_prompts

    _check_at_least(("--num-prompts", args.num_prompts, 1), ("--max-tokens", args.max_tokens, 1))
    if not args.output.endswith(".safetensors"):
        raise ValueError(f"--output: the act scales are written as safetensors; give a path ending in .safetensors, got {args.output!r}")
    llm = _generating_llm(args, "calibrate-smoothquant")
    prompts = chat_prompts(llm.get_tokenizer(), args.prompts_file, args.num_prompts)
    scales, report = calibrate_act_scales(llm, prompts, args.max_tokens)
    save_file({name: t.contiguous() for name, t in sorted(scales.items())}, args.output,
              metadata={"format": "tokenmill act scales", "base_model": str(llm.llm_engine.model_name)})
    print(f"measured {len(scales)} linear layers' input absmax on {report.num_positions} positions ({report.num_prompts} prompts and "
          f"the model's answers, {report.seconds:.0f} s); written to {args.output}")
    print(f"use them with --quantization w8a8 --quantization-options '{{\"smoothquant\": \"{args.output}\"}}'")


def _check_at_least(*flags: tuple[str, int, int]) -> None:
    for flag, value, low in flags:
        if value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")


def _generating_llm(args: argparse.Namespace, command: str):
    """The engine the training data comes from: one, without speculative decoding."""
    from tokenmill.entrypoints.cli import engine_config_from_args
    from tokenmill.llm import LLM

    engine_config = engine_config_from_args(args)
    if engine_config.speculative is not None or engine_config.parallel.data_parallel_size > 1:
        raise ValueError(f"{command} runs one engine without speculative decoding: drop --speculative-config and --data-parallel-size")
    return LLM.from_config(engine_config)
