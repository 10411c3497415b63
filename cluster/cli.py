"""`pdserve` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.cluster.settings.flags import engine_config_from_args
from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling import SamplingParams, StructuredOutput


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
    from pdserve.engine.engine import Engine

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


def _client(args: argparse.Namespace):  # -> pdserve.cluster.clients.grpc_client.Client
    """A gRPC client for --target with the credentials its flags name (credentials.from_args)."""
    from pdserve.cluster.clients.credentials import from_args
    from pdserve.cluster.clients.grpc_client import Client

    return Client(args.target, from_args(args))


def _generate_http(args: argparse.Namespace, params: SamplingParams) -> int:
    from pdserve.cluster.clients.credentials import from_args
    from pdserve.cluster.clients.http_client import HttpApiError, stream_text

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
    from pdserve.cluster.server import serve_forever
    from pdserve.cluster.settings.config import ServeConfig, load_config
    from pdserve.cluster.settings.flags import apply_flags

    # Defaults < the config file < the flags. The environment overrides no field: it
    # holds the cluster secret and the fallbacks of fields left unset (see engine/env.py).
    config = load_config(args.config) if args.config else ServeConfig()
    config = apply_flags(config, args)
    if args.check_config:
        print(config)
        return 0
    import uvloop

    from pdserve.cluster.ray_driver import ray_ending_with

    # Nothing of the server's is left running, wherever it stopped (SIGTERM during the start is
    # Ray's handler's, once Ray is up: a SystemExit that passes through here too).
    with ray_ending_with():
        try:
            if config.server.scaled_out:
                from pdserve.cluster.scale_out import serve_scaled_out_forever

                uvloop.run(serve_scaled_out_forever(config))
            else:
                uvloop.run(serve_forever(config))
        except KeyboardInterrupt:  # Ctrl-C before the server was up: the start was cancelled
            print("pdserve: interrupted while starting; stopped", file=sys.stderr)
            return 130
    return 0


def cmd_frontend(args: argparse.Namespace) -> int:
    """One more frontend for a running scaled-out server (its control plane found by name)."""
    import uvloop

    from pdserve.cluster.ray_driver import ray_ending_with
    from pdserve.cluster.scale_out import join_forever

    overrides = {"host": args.host, "port": args.port, "http_port": args.http_port, "metrics_port": args.metrics_port}
    with ray_ending_with():
        uvloop.run(join_forever(args.join, args.namespace, args.node_ip_address, overrides))
    return 0


def cmd_kv_wipe(args: argparse.Namespace) -> int:
    """Delete a disk tier's files, offline (a running worker's tiers: `engine.kv_tiers.disk_persist`
    false at its start, or `Engine.wipe_kv_tiers`)."""
    from pdserve.engine.kv.disk import wipe_folder

    root = Path(args.kv_disk_dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"--kv-disk-dir {str(root)!r} is not a folder")
    if args.slot is not None and ("/" in args.slot or args.slot in ("", ".", "..")):
        raise ValueError(f"--slot must be a plain folder name, got {args.slot!r}")
    folders = [root / args.slot] if args.slot else [p for p in root.iterdir() if p.is_dir()]
    for folder in folders:
        wipe_folder(folder)
        print(f"wiped {folder}")
    return 0


def _kv_kind(layout: str, bytes_per_token: int) -> str:
    """A worker's KV layout for `info`: "mla (latent), 31,104 B/token"."""
    if not layout:
        return "unknown"
    name = {"mla": "mla (latent)", "kv": "K/V per head"}.get(layout, layout)
    return f"{name}, {bytes_per_token:,} B/token"


def cmd_info(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = client.server_info()
        print(f"pdserve {info.version}, {info.mode}, model {info.model}")
        for w in info.workers:
            cached = ", ".join(f"{tier} {n}" for tier, n in sorted(w.cached_blocks.items())) or "none"
            print(f"  {w.id:<12} {w.role:<8} {'healthy' if w.healthy else 'LOST':<8} running {w.running:>4}  "
                  f"waiting {w.waiting:>4}  free KV blocks {w.free_kv_blocks}/{w.total_kv_blocks}  "
                  f"cached blocks: {cached}  KV {_kv_kind(w.kv_layout, w.kv_bytes_per_token)}")
    return 0


def _admin(args: argparse.Namespace):  # -> pdserve.cluster.clients.admin_client.AdminClient
    """An admin client for --target with the TLS files and admin token its flags name."""
    from pdserve.cluster.clients.admin_client import AdminClient
    from pdserve.cluster.clients.credentials import admin_from_args

    return AdminClient(args.target, admin_from_args(args))


def _admin_call(call) -> int:  # call: () -> None
    """Run an admin call; a refused one is one line on stderr, exit status 1."""
    import grpc

    try:
        call()
    except grpc.RpcError as e:
        print(f"pdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0


def _print_worker(w) -> None:  # w: admin_pb2.WorkerStatus
    from pdserve.cluster.clients.admin_client import PHASE_NAMES

    print(f"  {w.name:<12} {w.role:<8} {PHASE_NAMES.get(w.phase, '?'):<9} running {w.running:>4}  "
          f"queued {w.queued:>4}  in flight {w.inflight:>4}")


def cmd_workers(args: argparse.Namespace) -> int:
    def show() -> None:
        listing = admin.listing()
        for w in listing.workers:
            _print_worker(w)
        for f in listing.frontends:
            print(f"  {f.id:<12} frontend pid {f.pid:<7} host {f.host}  gRPC {f.port}  HTTP {f.http_port or 'off'}  "
                  f"metrics {f.metrics_port or 'off'}")

    with _admin(args) as admin:
        return _admin_call(show)


def cmd_drain(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        return _admin_call(lambda: _print_worker(admin.drain(args.worker, args.deadline, not args.no_wait,
                                                             args.timeout)))


def cmd_scale(args: argparse.Namespace) -> int:
    if args.move_to is not None:
        return _move(args)
    if args.role is None:
        raise ValueError("give --role with --add N or --remove N (or --move-to ROLE [WORKER])")
    if (args.add is None) == (args.remove is None) or (args.add or args.remove or 0) < 1:
        raise ValueError("give one of --add N and --remove N, N >= 1")

    def scale() -> None:
        for _ in range(args.add or 0):
            _print_worker(admin.add_worker(args.role, args.timeout))
        for _ in range(args.remove or 0):
            _print_worker(admin.remove_worker(args.role, "", args.deadline, not args.no_wait, args.timeout))

    with _admin(args) as admin:
        return _admin_call(scale)


def _move(args: argparse.Namespace) -> int:
    if args.add is not None or args.remove is not None:
        raise ValueError("--move-to changes a worker's role: give it without --add and --remove")

    def move() -> None:
        drained, started = admin.change_role(args.worker or "", args.move_to, args.deadline, args.timeout)
        _print_worker(drained)
        _print_worker(started)

    with _admin(args) as admin:
        return _admin_call(move)


def _add_admin_parsers(sub) -> None:  # sub: the subparsers of build_parser
    from pdserve.cluster.clients.credentials import add_admin_credential_args

    def admin_parser(name: str, help_text: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server's gRPC API")
        p.add_argument("--timeout", type=float, default=900.0, help="bound on the call, seconds")
        add_admin_credential_args(p)
        p.set_defaults(func=func)
        return p

    def drain_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--deadline", type=float, default=None,
                       help="seconds its requests may run on before they move to another worker "
                            "(default: the server's drain.deadline_s)")
        p.add_argument("--no-wait", action="store_true", help="answer once the drain has begun, not once it is gone")

    admin_parser("workers", "list a server's workers: role, phase (serving, draining, gone), load (admin API)",
                 cmd_workers)
    drain = admin_parser("drain", "drain a worker and stop it: its requests finish, or move past the deadline "
                                  "(admin API)", cmd_drain)
    drain.add_argument("worker", help="the worker's name, as `pdserve workers` lists it")
    drain_args(drain)
    scale = admin_parser("scale", "add or remove workers of a role, or move one to the other role, at run time "
                                  "(admin API)", cmd_scale)
    scale.add_argument("--role", default=None, help="prefill or decode (mixed on a colocated server)")
    scale.add_argument("--move-to", default=None, metavar="ROLE",
                       help="drain a worker (WORKER, or the least loaded of the other role), stop it and start a "
                            "ROLE worker on its resources")
    scale.add_argument("worker", nargs="?", default=None, help="with --move-to: the worker to move")
    scale.add_argument("--add", type=int, default=None, metavar="N", help="start N more workers")
    scale.add_argument("--remove", type=int, default=None, metavar="N",
                       help="drain and stop N workers, the least loaded first")
    drain_args(scale)


def build_parser() -> argparse.ArgumentParser:
    from pdserve.cluster.clients.credentials import add_credential_args
    from pdserve.cluster.settings.config_tree import config_fields
    from pdserve.cluster.settings.flags import add_config_flags

    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from prompts (in-process engine)",
                         usage="%(prog)s [options] [--engine.<section>.<field> VALUE ...] PROMPT [PROMPT ...]")
    gen.add_argument("prompts", nargs="+", help="prompt text (several run as one continuous batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--target", help="host:port of a pdserve server's gRPC API, or http://host:port of its "
                                      "OpenAI HTTP API (default: run the engine in-process)")
    gen.add_argument("--timeout", type=float, default=None, help="deadline per request, seconds (--target)")
    add_credential_args(gen)
    _add_sampling_args(gen)
    add_config_flags(gen, config_fields(EngineConfig, "engine."))
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve the gRPC and OpenAI HTTP APIs from Ray prefill and decode pools",
                           usage="%(prog)s [--config FILE] [--check-config] [--<section>.<field> VALUE ...]",
                           description="Every field of the serve config (cluster/settings/config.py) is a flag "
                                       "--<section>.<field>; a flag overrides --config's file, which overrides "
                                       "the defaults.")
    serve.add_argument("--config", help="YAML config file (the one the Helm chart renders)")
    serve.add_argument("--check-config", action="store_true", help="print the resulting config and exit")
    add_config_flags(serve, config_fields())
    serve.set_defaults(func=cmd_serve)

    front = sub.add_parser("frontend", help="join a running scaled-out server (pdserve serve --frontends N or "
                                            "--control-plane) as one more frontend process")
    front.add_argument("--join", required=True, metavar="ADDRESS", help="the Ray cluster's address (host:port, auto)")
    front.add_argument("--namespace", default="pdserve", help="the server's Ray namespace (its --namespace)")
    front.add_argument("--node-ip-address", default="127.0.0.1", help="this node's address in Ray")
    front.add_argument("--host", default="127.0.0.1")
    front.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one)")
    front.add_argument("--http-port", type=int, default=0, help="HTTP API port (0: a free one)")
    front.add_argument("--metrics-port", type=int, default=0, help="/metrics port (0: none)")
    front.set_defaults(func=cmd_frontend)

    from pdserve.cluster.bench import add_parser as add_bench_parser
    from pdserve.cluster.sim.profile_cmd import add_parser as add_profile_parser
    from pdserve.cluster.sim.simulate_cmd import add_parser as add_simulate_parser
    from pdserve.cluster.sim.spec_sim_cmd import add_parser as add_spec_sim_parser

    add_spec_sim_parser(sub)
    add_simulate_parser(sub)
    add_profile_parser(sub)
    add_bench_parser(sub)

    wipe = sub.add_parser("kv-wipe", help="delete a KV disk tier's blocks (every worker slot, or --slot's)")
    wipe.add_argument("--kv-disk-dir", required=True, help="the disk tier's root (engine.kv_tiers.disk_dir)")
    wipe.add_argument("--slot", help="one worker's slot, e.g. prefill-0 (default: all of them)")
    wipe.set_defaults(func=cmd_kv_wipe)

    info = sub.add_parser("info", help="show a server's mode, model and workers")
    info.add_argument("--target", default="127.0.0.1:50051")
    add_credential_args(info)
    info.set_defaults(func=cmd_info)
    _add_admin_parsers(sub)
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
