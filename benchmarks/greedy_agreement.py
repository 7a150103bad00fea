"""Greedy tokens of each CPU weight format against fp32's, on the same prompts (the parity measure).

fp32 (the dequantized weights) is the reference. For each format the engine decodes the same text
prompts and random-token prompts greedily, ignore_eos, and the report gives, per prompt, how many
tokens match fp32's before the first difference, and the share of positions that match overall.
A greedy run diverges for good at its first near-tie, so the prefix is the stricter figure.

    python -m benchmarks.greedy_agreement --quantization gguf int8 --output-len 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.engine_vs_hf import random_prompts
from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.model.cpu_weight_formats import CPU_WEIGHT_FORMATS
from shardline.core.model_path import resolve_model_path
from shardline.core.text.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which plants",
    "Here is a short story about a robot who learns to paint:",
    "The three laws of thermodynamics state that",
    "Q: What is 17 times 23?\nA:",
]


def generate(quantization: str | None, model: str | None, prompts: list[list[int]], out_len: int) -> list[list[int]]:
    engine = LLMEngine(
        EngineConfig(
            runner=RunnerConfig(model=model, quantization=quantization, num_blocks=256),
            scheduler=SchedulerConfig(max_num_seqs=len(prompts)),
        )
    )
    try:
        greedy = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        return [r.token_ids for r in engine.generate(prompts, greedy)]
    finally:
        engine.shutdown()


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> dict:
    prefixes = [next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), len(r)) for r, t in zip(reference, tokens)]
    same = sum(a == b for r, t in zip(reference, tokens) for a, b in zip(r, t))
    return {
        "matching_prefix": prefixes,
        "identical_prompts": sum(p == len(r) for p, r in zip(prefixes, reference)),
        "positions_matching": same / sum(len(r) for r in reference),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf; default: the default model")
    ap.add_argument("--quantization", nargs="+", default=["gguf"], choices=CPU_WEIGHT_FORMATS)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument(
        "--random-prompts", type=int, default=4, help="random-token prompts of 128 tokens, besides the texts"
    )
    ap.add_argument("--out", default="results/greedy_agreement.json")
    args = ap.parse_args(argv)
    tokenizer = Tokenizer.from_model_path(resolve_model_path(args.model))
    prompts = tokenizer.encode_batch(TEXTS) + random_prompts(args.random_prompts, 128, tokenizer.vocab_size, seed=3)
    reference = generate(None, args.model, prompts, args.output_len)
    result: dict = {"args": vars(args), "prompts": len(prompts), "formats": {}}
    print(f"{len(TEXTS)} text and {args.random_prompts} random prompts, {args.output_len} greedy tokens, against fp32")
    for q in args.quantization:
        tokens = generate(q, args.model, prompts, args.output_len)
        n = len(TEXTS)
        text, rand = agreement(reference[:n], tokens[:n]), agreement(reference[n:], tokens[n:])
        result["formats"][q] = {"text": text, "random": rand}
        for kind, a in (("text", text), ("random", rand)):
            print(
                f"  {q:5s} {kind:6s}: {a['identical_prompts']} identical, matching prefixes {a['matching_prefix']}, "
                f"{a['positions_matching']:.1%} of positions"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
