"""One-shot checks of the CUDA path, for a scarce GPU lease (also runs on CPU as a dry run).

1. A small random Llama saved in HF format: greedy decoding with and without CUDA
   graphs equals HF transformers' greedy `generate()`.
2. The engine-vs-HF benchmark with dummy weights in the Llama-3.2-1B shape.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import engine_vs_hf
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams


def correctness(device: str, out: dict) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        prompts = torch.randint(0, 1000, (3, 21)).tolist()
        hf = hf.to(device)
        results = {}
        # (CUDA graphs, async scheduling): async is the default on CUDA (lookahead.py)
        for graphs, lookahead in ((False, False), (True, False), (True, True), (False, True)):
            e = LLMEngine(
                EngineConfig(
                    runner=RunnerConfig(model=tmp, device=device, dtype="float32", cuda_graphs=graphs, num_blocks=64),
                    async_scheduling=lookahead,
                )
            )
            # Different lengths, so that requests finish under a launched step.
            params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 40, 40)]
            gen = e.generate(prompts, params)
            results[graphs, lookahead] = [r.token_ids for r in gen]
            if lookahead:
                out[f"lookahead_used_graphs_{graphs}"] = e.lookahead.num_used
            e.shutdown()
        with_lengths = {}
        for lookahead in (False, True):
            e = LLMEngine(
                EngineConfig(
                    runner=RunnerConfig(model=tmp, device=device, dtype="float32", num_blocks=64),
                    async_scheduling=lookahead,
                )
            )
            params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (13, 40, 27)]
            with_lengths[lookahead] = [r.token_ids for r in e.generate(prompts, params)]
            e.shutdown()
        out["async_equal_sync_with_finishes"] = with_lengths[True] == with_lengths[False]
        out["async_equal_sync"] = results[True, True] == results[True, False]
        out["async_eager_equal_sync"] = results[False, True] == results[False, False]
        results = {graphs: results[graphs, False] for graphs in (False, True)}
        with torch.no_grad():
            hf_greedy = (
                hf.generate(
                    torch.tensor(prompts, device=device),
                    max_new_tokens=40,
                    do_sample=False,
                    min_new_tokens=40,
                    pad_token_id=0,
                )
                .cpu()[:, 21:]
                .tolist()
            )
    out["graphs_equal_eager"] = results[True] == results[False]
    out["eager_equal_hf_greedy"] = results[False] == hf_greedy
    out["graphs_equal_hf_greedy"] = results[True] == hf_greedy


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="results/gpu_check.json")
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args()
    out: dict = {"device": args.device, "torch": torch.__version__}
    t0 = time.time()
    correctness(args.device, out)
    out["correctness_s"] = time.time() - t0
    print(json.dumps(out, indent=1), flush=True)
    if not args.skip_bench:
        for model, conc in (("dummy:llama-3.2-1b", [1, 64]), ("dummy:smollm2-135m", [1, 64])):
            engine_vs_hf.main(
                [
                    "--device",
                    args.device,
                    "--model",
                    model,
                    "--concurrency",
                    *map(str, conc),
                    "--out",
                    f"{Path(args.out).parent}/bench_{model.split(':')[1]}.json",
                ]
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
