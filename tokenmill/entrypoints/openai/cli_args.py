"""`tokenmill serve` options. (Placeholder until the server lands.)"""

from __future__ import annotations

import argparse


def add_serve_parser(sub) -> None:
    from tokenmill.entrypoints.cli import add_engine_args

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(serve)

    def run(args: argparse.Namespace) -> None:
        raise NotImplementedError("tokenmill serve is not implemented yet")

    serve.set_defaults(func=run)
