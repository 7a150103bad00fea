"""Model FLOPs and memory-bandwidth utilisation (MFU/MBU) of one engine step.

Analytic, as in the PaLM paper's MFU: a step costs 2 FLOPs per weight per token
through the decoder layers, 2 per LM-head weight per sampled row (logits are
computed for each sequence's last token only) and 4 * head_dim per attention
(query, key) pair and head. It reads every weight once and each sequence's KV
context once. Utilisation is that work over the measured step time, divided by
the group's peak (one device's peak times tp_size).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker_svc.model.config import ModelConfig

CPU = "cpu"


@dataclass(slots=True, frozen=True)
class DevicePeak:
    flops_per_s: float  # dense matmul peak at the serving dtype
    bytes_per_s: float  # memory bandwidth


# H200 SXM datasheet: dense BF16 tensor-core throughput and HBM3e bandwidth.
H200 = DevicePeak(flops_per_s=989e12, bytes_per_s=4.8e12)


def device_peak(
    device: str, tflops: float | None, bandwidth_gbs: float | None, cpu_tflops: float, cpu_bandwidth_gbs: float
) -> DevicePeak:
    """One device's peak: explicit figures win, else H200 on CUDA and the CPU figures on CPU."""
    default = DevicePeak(cpu_tflops * 1e12, cpu_bandwidth_gbs * 1e9) if device == CPU else H200
    return DevicePeak(
        tflops * 1e12 if tflops else default.flops_per_s, bandwidth_gbs * 1e9 if bandwidth_gbs else default.bytes_per_s
    )


@dataclass(slots=True, frozen=True)
class StepCostModel:
    layer_params: int  # weights every token goes through (decoder layers and final norm)
    head_params: int  # LM-head weights, applied once per sampled row
    weight_bytes: int  # all weights, read once per step
    kv_bytes_per_token: int  # K and V of one position across all layers
    flops_per_pair: int  # attention FLOPs per causal (query, key) pair, all heads and layers
    peak: DevicePeak  # the whole tensor-parallel group's peak

    @classmethod
    def for_model(cls, cfg: ModelConfig, dtype_bytes: int, device_peak: DevicePeak, tp_size: int) -> StepCostModel:
        head = cfg.vocab_size * cfg.hidden_size
        # The embedding lookup is a gather, not a matmul; a tied head shares its weights.
        embed_params = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        return cls(
            layer_params=cfg.active_params - embed_params,  # a MoE token goes through its top-k experts only
            head_params=head,
            weight_bytes=cfg.num_params * dtype_bytes,
            kv_bytes_per_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes,
            flops_per_pair=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim,
            peak=DevicePeak(device_peak.flops_per_s * tp_size, device_peak.bytes_per_s * tp_size),
        )

    def flops(self, num_tokens: int, num_rows: int, attention_pairs: int) -> float:
        return (
            2.0 * (self.layer_params * num_tokens + self.head_params * num_rows)
            + float(self.flops_per_pair) * attention_pairs
        )

    def bytes(self, kv_tokens_read: int) -> float:
        return float(self.weight_bytes + self.kv_bytes_per_token * kv_tokens_read)

    def utilization(
        self, num_tokens: int, num_rows: int, attention_pairs: int, kv_tokens_read: int, step_time_s: float
    ) -> tuple[float, float]:
        """(MFU, MBU) of a step, each a fraction of the peak; zeros for an empty or unmeasured step."""
        if step_time_s <= 0 or num_tokens == 0:
            return 0.0, 0.0
        mfu = self.flops(num_tokens, num_rows, attention_pairs) / step_time_s / self.peak.flops_per_s
        mbu = self.bytes(kv_tokens_read) / step_time_s / self.peak.bytes_per_s
        return mfu, mbu
