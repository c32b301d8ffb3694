"""The ``mmkv`` command (also ``python -m mmkv``): ``mmkv serve [MODEL] [options]``."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mmkv")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server over one engine")
    from mmkv.server import launch  # the server's dependencies load only for this command

    launch.add_arguments(serve)
    args = parser.parse_args(argv)
    launch.run(args)


if __name__ == "__main__":
    main()
