"""`pdserve` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.sampling import SamplingParams


def _add_model_args(p: argparse.ArgumentParser) -> None:
    model, sched = ModelConfig(), SchedulerConfig()
    g = p.add_argument_group("model")
    g.add_argument("--model", default=model.source,
                   help="'default' (SmolLM2-135M-Instruct), a HF model folder, a .gguf file, or dummy:<shape>")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size (default: from memory)")
    g.add_argument("--max-num-batched-tokens", type=int, default=sched.max_num_batched_tokens)
    g.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(source=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len),
        cache=CacheConfig(num_blocks=args.num_kv_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs),
    )


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop))


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.engine import Engine

    params = sampling_params_from_args(args)
    engine = Engine(engine_config_from_args(args))
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
               for p in args.prompts]
    if len(prompts) == 1:  # stream a single prompt as it is generated
        for delta in engine.generate_stream(prompts, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    for i, out in enumerate(engine.generate(prompts, params)):
        print(f"--- [{i}] ({len(out.token_ids)} tokens, {out.finish_reason.value})\n{out.text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from prompts (in-process engine)")
    gen.add_argument("prompts", nargs="+", help="prompt text (several run as one continuous batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
