"""`pdserve` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.engine.config import (
    SPEC_METHODS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpecConfig,
)
from pdserve.engine.sampling import SamplingParams, StructuredOutput


def _add_model_args(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    """Model and engine flags; without defaults, unset flags leave the config file's values."""
    model, sched = ModelConfig(), SchedulerConfig()

    def default(value: object) -> object:
        return value if defaults else None

    g = p.add_argument_group("model")
    g.add_argument("--model", default=default(model.source),
                   help="'default' (SmolLM2-135M-Instruct), a HF model folder, a .gguf file, or dummy:<shape>")
    g.add_argument("--device", default=default("auto"), help="auto, cpu, cuda or cuda:N")
    g.add_argument("--dtype", default=default("auto"), help="auto, float32, float16 or bfloat16")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size (default: from memory)")
    g.add_argument("--max-num-batched-tokens", type=int, default=default(sched.max_num_batched_tokens))
    g.add_argument("--max-num-seqs", type=int, default=default(sched.max_num_seqs))
    g.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="split the model over this many GPUs (CPU: processes) per worker (default 1)")
    g.add_argument("--spec-method", default=None,
                   help=f"speculative decoding drafter: {', '.join(SPEC_METHODS)} (default: none)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, help="K, tokens proposed per step")
    g.add_argument("--draft-model", default=None, help="draft model source (--spec-method draft_model)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json-schema", default=None,
                   help="structured output: JSON that follows this JSON schema (JSON text, or @file)")
    g.add_argument("--json-object", action="store_true", help="structured output: any JSON object")


def _spec_overrides(args: argparse.Namespace) -> dict[str, object]:
    return {"method": args.spec_method, "num_speculative_tokens": args.num_speculative_tokens,
            "draft_model": args.draft_model}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    spec = SpecConfig(**{k: v for k, v in _spec_overrides(args).items() if v is not None})
    return EngineConfig(
        model=ModelConfig(source=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len),
        cache=CacheConfig(num_blocks=args.num_kv_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs),
        spec=spec,
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size or 1),
    )


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
                          structured=_structured_from_args(args))


def _structured_from_args(args: argparse.Namespace) -> StructuredOutput | None:
    if args.json_schema is not None and args.json_object:
        raise ValueError("give one of --json-schema and --json-object")
    if args.json_object:
        return StructuredOutput("json_object")
    if args.json_schema is None:
        return None
    schema = args.json_schema
    if schema.startswith("@"):
        schema = Path(schema[1:]).read_text()
    return StructuredOutput.from_schema(schema)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)
    if args.target:
        return _generate_remote(args, params)
    from pdserve.decode_node.spec import speculative_engine

    engine = speculative_engine(engine_config_from_args(args))
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


def _generate_remote(args: argparse.Namespace, params: SamplingParams) -> int:
    if args.target.startswith(("http://", "https://")):
        return _generate_http(args, params)
    import grpc

    with _client(args) as client:
        for i, prompt in enumerate(args.prompts):
            if len(args.prompts) > 1:
                print(f"--- [{i}]")
            messages = [{"role": "user", "content": prompt}] if args.chat else None
            try:
                for resp in client.generate(None if args.chat else prompt, params, messages, args.timeout):
                    sys.stdout.write(resp.text)
                    sys.stdout.flush()
            except grpc.RpcError as e:
                print(f"\npdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
                return 1
            sys.stdout.write("\n")
    return 0


def _client(args: argparse.Namespace):  # -> pdserve.cluster.client.Client
    """A gRPC client for --target with the credentials its flags name (credentials.from_args)."""
    from pdserve.cluster.client import Client
    from pdserve.cluster.credentials import from_args

    return Client(args.target, from_args(args))


def _generate_http(args: argparse.Namespace, params: SamplingParams) -> int:
    from pdserve.cluster.credentials import from_args
    from pdserve.cluster.http_client import HttpApiError, stream_text

    credentials = from_args(args)
    for i, prompt in enumerate(args.prompts):
        if len(args.prompts) > 1:
            print(f"--- [{i}]")
        try:
            for text in stream_text(args.target, prompt, params, args.chat, args.timeout, credentials):
                sys.stdout.write(text)
                sys.stdout.flush()
        except HttpApiError as e:
            print(f"\npdserve: error: {e}", file=sys.stderr)
            return 1
        sys.stdout.write("\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.cluster.config import ServeConfig, load_config, with_overrides
    from pdserve.cluster.server import serve_forever

    config = load_config(args.config) if args.config else ServeConfig()
    config = with_overrides(
        config,
        model={"source": args.model, "device": args.device, "dtype": args.dtype, "max_model_len": args.max_model_len},
        cache={"num_blocks": args.num_kv_blocks},
        scheduler={"max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs},
        spec=_spec_overrides(args),
        parallel={"tensor_parallel_size": args.tensor_parallel_size},
        server={"host": args.host, "port": args.port, "metrics_port": args.metrics_port,
                "http_port": args.http_port, "http": False if args.no_http else None,
                "tls_cert": args.tls_cert, "tls_key": args.tls_key, "tls_client_ca": args.tls_client_ca,
                "api_key_file": args.api_key_file},
        pools={"mode": args.mode, "num_prefill": args.num_prefill, "num_decode": args.num_decode,
               "routing": args.routing, "gpus_per_worker": args.gpus_per_worker, "prefill_tp": args.prefill_tp,
               "decode_tp": args.decode_tp},
        ray={"address": args.address},
        health={"interval_s": args.health_interval_s, "ping_timeout_s": args.ping_timeout_s,
                "unresponsive_after_s": args.unresponsive_after_s, "stuck_after_s": args.stuck_after_s},
        admission={"max_waiting_per_worker": args.max_waiting_per_worker, "retry_after_s": args.retry_after_s},
        coordinator={"max_migrations": args.max_migrations, "migration_wait_s": args.migration_wait_s},
        kv_transport={"transfer_timeout_s": args.transfer_timeout_s, "require": args.kv_require},
    )
    if args.check_config:
        print(config)
        return 0
    import uvloop

    uvloop.run(serve_forever(config))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = client.server_info()
        print(f"pdserve {info.version}, {info.mode}, model {info.model}")
        for w in info.workers:
            print(f"  {w.id:<12} {w.role:<8} {'healthy' if w.healthy else 'LOST':<8} running {w.running:>4}  "
                  f"waiting {w.waiting:>4}  free KV blocks {w.free_kv_blocks}/{w.total_kv_blocks}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pdserve.cluster.config import (
        MODES,
        POLICIES,
        AdmissionConfig,
        CoordinatorConfig,
        PoolConfig,
    )
    from pdserve.cluster.credentials import add_credential_args
    from pdserve.kv_transport.config import TRANSPORT_CLASSES, TransportSettings

    admission, coordinator, kv, pools = AdmissionConfig(), CoordinatorConfig(), TransportSettings(), PoolConfig()

    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from prompts (in-process engine)")
    gen.add_argument("prompts", nargs="+", help="prompt text (several run as one continuous batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--target", help="host:port of a pdserve server's gRPC API, or http://host:port of its "
                                      "OpenAI HTTP API (default: run the engine in-process)")
    gen.add_argument("--timeout", type=float, default=None, help="deadline per request, seconds (--target)")
    add_credential_args(gen)
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve the gRPC and OpenAI HTTP APIs from Ray prefill and decode pools")
    serve.add_argument("--config", help="YAML config file (the one the Helm chart renders)")
    serve.add_argument("--address", default=None, help="join this Ray cluster (default: start a local one)")
    serve.add_argument("--host", default=None, help="gRPC, HTTP and metrics bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="gRPC port (default 50051)")
    serve.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP API port (default 8000)")
    serve.add_argument("--no-http", action="store_true", help="serve gRPC only")
    serve.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (default 9400, 0 = off)")
    a = serve.add_argument_group("client authentication (off by default; see ServerConfig)")
    a.add_argument("--tls-cert", default=None, help="PEM certificate (chain): gRPC and HTTP speak TLS only")
    a.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    a.add_argument("--tls-client-ca", default=None,
                   help="PEM CA (bundle) whose certificates clients must present (mutual TLS; needs --tls-cert)")
    a.add_argument("--api-key-file", default=None, help="file with the bearer token every client must send "
                                                        "(default: $PDSERVE_API_KEY; unset: none asked)")
    serve.add_argument("--check-config", action="store_true", help="print the resulting config and exit")
    serve.add_argument("--mode", default=None, help=f"{' or '.join(MODES)} (default {pools.mode})")
    serve.add_argument("--num-prefill", type=int, default=None)
    serve.add_argument("--num-decode", type=int, default=None)
    serve.add_argument("--gpus-per-worker", type=float, default=None, help="GPUs per rank of a worker")
    serve.add_argument("--prefill-tp", type=int, default=None, help="tensor-parallel size of the prefill workers")
    serve.add_argument("--decode-tp", type=int, default=None,
                       help="tensor-parallel size of the decode (colocated: mixed) workers")
    serve.add_argument("--routing", default=None, help=f"{', '.join(POLICIES)} (default {pools.routing})")
    r = serve.add_argument_group("admission, migration and KV transfer (see AdmissionConfig, CoordinatorConfig)")
    r.add_argument("--max-waiting-per-worker", type=int, default=None,
                   help=f"requests queued per decode worker beyond its running seats (default "
                        f"{admission.max_waiting_per_worker}); beyond them RESOURCE_EXHAUSTED")
    r.add_argument("--retry-after-s", type=float, default=None,
                   help=f"retry hint of a refused request (default {admission.retry_after_s:g})")
    r.add_argument("--max-migrations", type=int, default=None,
                   help=f"times a request may continue elsewhere after losing its worker (default "
                        f"{coordinator.max_migrations}; 0 = fail it)")
    r.add_argument("--migration-wait-s", type=float, default=None,
                   help=f"a request waits this long for a lost worker's replacement (default "
                        f"{coordinator.migration_wait_s:g})")
    r.add_argument("--transfer-timeout-s", type=float, default=None,
                   help="bound on a KV transfer from its sender's last sign of life (default "
                        f"{kv.transfer_timeout_s:g})")
    r.add_argument("--kv-require", default=None,
                   help=f"the slowest KV transport a prefill/decode pair may use: any or one of "
                        f"{', '.join(TRANSPORT_CLASSES)} (default {kv.require}); a slower pair fails its "
                        "requests with FAILED_PRECONDITION")
    h = serve.add_argument_group("worker health (a busy worker is alive; see HealthConfig)")
    h.add_argument("--health-interval-s", type=float, default=None, help="ping every worker this often (default 2)")
    h.add_argument("--ping-timeout-s", type=float, default=None, help="bound on one ping (default 5)")
    h.add_argument("--unresponsive-after-s", type=float, default=None,
                   help="replace a worker that answered no ping this long (default 60)")
    h.add_argument("--stuck-after-s", type=float, default=None,
                   help="replace a worker whose engine made no progress this long (default 1800)")
    _add_model_args(serve, defaults=False)
    serve.set_defaults(func=cmd_serve)

    from pdserve.cluster.bench import add_parser as add_bench_parser
    from pdserve.cluster.spec_sim import add_parser as add_spec_sim_parser

    add_spec_sim_parser(sub)
    add_bench_parser(sub)

    info = sub.add_parser("info", help="show a server's mode, model and workers")
    info.add_argument("--target", default="127.0.0.1:50051")
    add_credential_args(info)
    info.set_defaults(func=cmd_info)
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
