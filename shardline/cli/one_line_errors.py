"""A CLI command's failures as one line on stderr, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import grpc
from pydantic import ValidationError

from shardline.core.service_main import settings_problems


def one_line_errors(command: str, run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`run` with its failures as one line on stderr (exit 2 for a bad value, 1 otherwise), not a traceback."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
        except BrokenPipeError:  # `| head`: the reader is gone; say nothing more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        except grpc.RpcError as exc:
            code = exc.code()
            print(f"shardline {command}: {code.name}: {exc.details()}", file=sys.stderr)
            return 2 if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND) else 1
        except ValidationError as exc:  # a bad SHARDLINE_* variable, which the in-process engine reads
            print(f"shardline {command}: bad settings: {settings_problems(exc)}", file=sys.stderr)
            return 2
        except (ValueError, OSError) as exc:  # a bad model path or config, a value the engine refuses
            print(f"shardline {command}: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, (ValueError, FileNotFoundError)) else 1

    return wrapped
