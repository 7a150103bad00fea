"""`shardline serve tokenizer`: run the Tokenizer gRPC service until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from shardline.core.model_path import ModelNotFoundError
from shardline.core.service_main import run_service
from shardline.core.text.tokenizer import TokenizerError
from tokenizer_svc.server import serve
from tokenizer_svc.settings import TokenizerSettings


def parse_settings(argv: list[str] | None) -> TokenizerSettings:
    """Settings from the environment, with the command-line flags that were given on top."""
    parser = argparse.ArgumentParser(prog="shardline serve tokenizer", description=__doc__)
    parser.add_argument("--port", type=int, help="gRPC port (default 50052; 0 picks a free one)")
    parser.add_argument("--model", help="Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--chat-template", help="a Jinja chat template file (or the template itself) to use instead of the model's"
    )
    args = parser.parse_args(argv)
    return TokenizerSettings(**{key: value for key, value in vars(args).items() if value is not None})


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_service(
        "tokenizer",
        lambda: asyncio.run(serve(parse_settings(argv))),
        startup_errors=(ModelNotFoundError, TokenizerError),
    )


if __name__ == "__main__":
    sys.exit(main())
