"""Decode throughput of each Mixture-of-Experts family against HF transformers `generate()`, side by side.

For Mixtral, Qwen3-MoE and Qwen2-MoE, a random model of one small shape (8 experts, top-2; Qwen2-MoE with
its shared expert) is built by transformers and saved as safetensors; benchmarks/engine_vs_hf.py then runs
the engine and HF on it at each concurrency, alternating, and this prints one table of all three.

    python -m benchmarks.moe_vs_hf                                  # CPU, concurrency 1 and 16
    python -m benchmarks.moe_vs_hf --rounds 2 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig

from benchmarks import engine_vs_hf

_SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES: dict[str, PretrainedConfig] = {
    "mixtral": MixtralConfig(num_local_experts=8, intermediate_size=512, **_SHAPE),
    "qwen3-moe": Qwen3MoeConfig(
        num_experts=8, moe_intermediate_size=512, intermediate_size=1024, head_dim=64, norm_topk_prob=True, **_SHAPE
    ),
    "qwen2-moe": Qwen2MoeConfig(
        num_experts=8, moe_intermediate_size=512, shared_expert_intermediate_size=1024, intermediate_size=1024, **_SHAPE
    ),
}


def save_random(config: PretrainedConfig, folder: Path, seed: int) -> None:
    """A random model of `config` (std 1 / sqrt(fan_in), so routing spreads over the experts) saved to `folder`."""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.dim() > 1:
                p.copy_(noise * p.shape[-1] ** -0.5)
            else:  # biases
                p.zero_()
    model.save_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="results/moe_vs_hf.json")
    args = ap.parse_args(argv)
    table: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed, family in enumerate(args.families):
            folder = Path(tmp) / family
            save_random(FAMILIES[family], folder, seed)
            out = Path(tmp) / f"{family}.json"
            engine_vs_hf.main(
                [
                    "--model",
                    str(folder),
                    "--concurrency",
                    *map(str, args.concurrency),
                    "--input-len",
                    str(args.input_len),
                    "--output-len",
                    str(args.output_len),
                    "--rounds",
                    str(args.rounds),
                    "--out",
                    str(out),
                ]
            )
            table[family] = json.loads(out.read_text())["rows"]
    print(f"\nMoE families, decode tok/s (in={args.input_len} out={args.output_len}, medians of {args.rounds})")
    print(f"{'family':>10} {'conc':>5} {'shardline tok/s':>16} {'HF tok/s':>10} {'ratio':>7} {'decode step ms':>15}")
    for family, rows in table.items():
        for r in rows:
            step = r["shardline"]["decode_step_ms_p50"]
            print(
                f"{family:>10} {r['concurrency']:>5} {r['shardline']['tok_s']:>16.1f} {r['hf']['tok_s']:>10.1f} "
                f"{r['ratio']:>6.2f}x {'-' if step is None else f'{step:.2f}':>15}"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "families": table}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
