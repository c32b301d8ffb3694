"""The ``mmkv`` command (also ``python -m mmkv``): ``mmkv serve [MODEL] [options]``, ``mmkv run-batch
-i IN -o OUT [MODEL] [options]``, ``mmkv --version``.

The arguments are parsed before torch, transformers and the server load, so ``--help``,
``--version`` and a mistyped flag answer at once; the server's dependencies load only to serve.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from mmkv.engine_args import add_engine_arguments, engine_from_args, engine_options


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """``mmkv serve``'s flags: the engine's, then the server's."""
    add_engine_arguments(p)
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    server.add_argument("--port", type=int, default=8000, help="the port to listen on")
    server.add_argument("--api-key",
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "(default: $MMKV_API_KEY, else no key); an empty key is an error")
    server.add_argument("--allowed-hosts", type=comma_list, default=[], metavar="NAMES",
                        help="without a key, requests are answered only when their Host is "
                             "localhost, a loopback address, --host, or one of these "
                             "comma-separated names ('*': any); others get 403 (default: none)")
    server.add_argument("--served-model-name",
                        help="the model's name in the API (default: the model directory's name)")
    server.add_argument("--no-ui", action="store_true", help="no web page at GET /")
    server.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"),
                        help="how tool calls are read out of answers (default: the chat template's own "
                             "format: hermes for Qwen2 / Qwen2.5 and Qwen-VL, llama3_json for Llama 3.x)")
    server.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="seconds open connections get after SIGTERM before they are closed")
    server.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="info logs the start, 'ready' and one line per request")
    limits = p.add_argument_group("limits and media")
    limits.add_argument("--max-waiting", type=int, default=256,
                        help="sequences (prompts x n) admitted beyond --max-num-seqs; more get 503 "
                             "with Retry-After")
    limits.add_argument("--allow-client-priority", type=int, nargs=2, metavar=("MIN", "MAX"),
                        help="let clients set a request's priority within [MIN, MAX] (lower runs "
                             "first; default: only 0, so clients cannot reorder the queue)")
    limits.add_argument("--max-body-bytes", type=int, default=16 * 2**20,
                        help="the largest request body, in bytes (413 beyond)")
    limits.add_argument("--max-images-per-request", type=int, default=8, help="images in one request")
    limits.add_argument("--max-image-bytes", type=int, default=10 * 2**20, help="one image's bytes")
    limits.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                        help="one image's width x height, read from its header before decoding")
    limits.add_argument("--media-timeout", type=float, default=5.0,
                        help="seconds one image may take to load, whatever its source")
    limits.add_argument("--allowed-local-media-path", type=Path,
                        help="file:// image URLs only from under this directory (default: refused)")
    limits.add_argument("--allowed-media-domains", nargs="*", default=[],
                        help="hosts whose https:// images may be fetched (default: none)")
    scale = p.add_argument_group("scale out (Ray Serve; needs the ray extra)")
    scale.add_argument("--replicas", type=int, default=1,
                       help="engine replicas on Ray Serve behind a cache-aware router; 1: one "
                            "process, no Ray")
    scale.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs each replica reserves")
    scale.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one)")
    scale.add_argument("--affinity-prefix-tokens", type=int, default=256,
                       help="how many first tokens of a text request the router reads: it goes to the replica "
                            "holding the longest prefix of them when that covers at least half")
    scale.add_argument("--route-imbalance-threshold", type=int, default=8,
                       help="route to the shortest queue once the longest exceeds it by this many "
                            "requests ...")
    scale.add_argument("--route-imbalance-ratio", type=float, default=1.5, help="... and by this factor")


def comma_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [item.strip() for item in text.split(",") if item.strip()]


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each flag's text with its default, unless it has none or says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def package_version() -> str:
    try:
        return version("mmkv")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mmkv", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"mmkv {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server over one engine",
                                description="An OpenAI-compatible HTTP server (docs/serving.md).",
                                formatter_class=DefaultsFormatter)
    add_serve_arguments(serve)
    batch = commands.add_parser("run-batch", help="an OpenAI batch file (JSON lines) through one engine",
                                description="Every request of an OpenAI batch file through one engine, "
                                            "one result line per input line, in order (docs/serving.md).",
                                formatter_class=DefaultsFormatter)
    add_batch_arguments(batch)
    args = parser.parse_args(argv)
    if args.command == "run-batch":
        run_batch_command(args)
        return
    from mmkv.server import launch  # torch, transformers and the server load only to serve

    launch.run(args)


def add_batch_arguments(p: argparse.ArgumentParser) -> None:
    """``mmkv run-batch``'s flags: input and output files, then the engine's."""
    p.add_argument("-i", "--input", required=True, help="the batch file (JSON lines); - reads standard input")
    p.add_argument("-o", "--output", required=True, help="where the results go (JSON lines); - writes "
                                                        "standard output")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on standard error")
    p.add_argument("--ray-replicas", type=int, default=0,
                   help="run the lines on N engine replicas on the Ray cluster (mmkv.distributed), "
                        "each image or shared prefix on one of them; 0: one engine here")
    add_engine_arguments(p)


def run_batch_command(args: argparse.Namespace) -> None:
    from mmkv.server.batch_file import run_batch  # torch and the engine load here

    source = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    with source:
        lines = source.readlines()
    if args.ray_replicas:
        from mmkv.distributed.batch import run_batch_on_replicas  # Ray loads only here

        results = run_batch_on_replicas(str(args.model), args.ray_replicas, engine_options(args), lines,
                                        progress=not args.no_progress)
    else:
        results = run_batch(engine_from_args(args), lines, progress=not args.no_progress)
    target = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    try:
        for result in results:
            target.write(json.dumps(result) + "\n")
    finally:
        if target is not sys.stdout:
            target.close()


if __name__ == "__main__":
    main()
