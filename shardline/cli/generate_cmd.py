"""`shardline generate` (one shot) and `shardline chat` (interactive), in-process or against a stack."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from shardline.cli.arg_types import at_least_one, non_negative, probability
from shardline.cli.one_line_errors import one_line_errors
from shardline.cli.serve_extra import require_serve

if TYPE_CHECKING:
    from shardline.cli.local_generator import LocalGenerator
    from shardline.client import ShardlineClient


def add_parsers(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate a completion and print it")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _common(g)
    g.set_defaults(func=run_generate, command="generate")
    c = sub.add_parser("chat", help="chat interactively (empty line or Ctrl-D to quit)")
    c.add_argument("--system", default=None, help="system prompt")
    _common(c)
    c.set_defaults(func=run_chat, command="chat")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="gateway gRPC address (host:port); default: run in-process")
    p.add_argument("--model", default=None, help="HF folder or .gguf (in-process) / served model name")
    p.add_argument("--tp", type=at_least_one, default=1, help="tensor-parallel size (in-process)")
    p.add_argument("--max-tokens", type=at_least_one, default=128)
    p.add_argument("--temperature", type=non_negative, default=0.0)
    p.add_argument("--top-p", type=probability, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("-v", "--verbose", action="store_true")


class _Backend:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.client: ShardlineClient | None = None
        self.local: LocalGenerator | None = None
        self.params: dict[str, Any] = {
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "seed": args.seed,
        }
        if args.url:
            from shardline.client import ShardlineClient

            self.client = ShardlineClient(args.url, api_key=args.api_key)
        else:
            require_serve(f"{args.command} without --url (the engine in this process)")
            from shardline.cli.local_generator import LocalGenerator

            self.local = LocalGenerator(args.model, args.tp)

    def stream(self, prompt: str | None = None, messages: list[dict[str, str]] | None = None) -> Iterator[str]:
        if self.local is not None:
            yield from self.local.stream(prompt, messages, **self.params)
            return
        assert self.client is not None  # one of the two is set, by --url
        model = {"model": self.args.model} if self.args.model else {}
        for chunk in self.client.stream(prompt, messages=messages, **model, **self.params):
            yield chunk.text

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        if self.client is not None:
            self.client.close()


def run_generate(args: argparse.Namespace) -> int:
    return one_line_errors("generate", _generate)(args)


def run_chat(args: argparse.Namespace) -> int:
    return one_line_errors("chat", _chat)(args)


def _generate(args: argparse.Namespace) -> int:
    backend = _Backend(args)
    try:
        messages = [{"role": "user", "content": args.prompt}] if args.chat else None
        for text in backend.stream(None if args.chat else args.prompt, messages):
            sys.stdout.write(text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        backend.close()
    return 0


def _chat(args: argparse.Namespace) -> int:
    backend = _Backend(args)
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    try:
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                sys.stdout.write("\n")  # leave the terminal on a fresh line
                break
            if not line:
                break
            history.append({"role": "user", "content": line})
            sys.stdout.write("assistant> ")
            reply = []
            for text in backend.stream(messages=history):
                reply.append(text)
                sys.stdout.write(text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            history.append({"role": "assistant", "content": "".join(reply)})
    finally:
        backend.close()
    return 0
