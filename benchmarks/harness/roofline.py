"""Hardware limits for a model shape and workload: bytes per decode step (weights +
KV read) and FLOPs per token (2 * params + attention), against a memory bandwidth
and a matmul rate, either given (H200: 4.3 TB/s, 790 TFLOP/s bf16; H100: 2.95 TB/s,
744 TFLOP/s) or measured here."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

H200 = {"bandwidth_Bps": 4.3e12, "flops": 790e12}
# An H100 80GB that the H200 scripts run on: the copy and matmul rates bench_engine measured
# on one (2.94-2.96 TB/s, 744 TFLOP/s bf16; README), below its datasheet as the H200's are.
H100 = {"bandwidth_Bps": 2.95e12, "flops": 744e12}


def gpu_card(name: str | None = None) -> str:
    """h100, h200, or gpu for any other card: the card nvidia-smi names (GPU 0),
    or `name`. It picks the roofline's rates (none are known for another card)
    and names the GPU scripts' result files. nvidia-smi, not torch: the load
    generator must not take a CUDA context on the GPU whose memory its
    replicas divide."""
    if name is None:
        import subprocess

        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=30).stdout
    return "h100" if "H100" in name else "h200" if "H200" in name else "gpu"


@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied_embeddings: bool = False
    dtype_bytes: int = 2

    @classmethod
    def from_config(cls, config: dict | str | Path, dtype_bytes: int | None = None) -> "Shape":
        if not isinstance(config, dict):
            p = Path(config)
            config = json.loads((p / "config.json" if p.is_dir() else p).read_text())
        heads = config["num_attention_heads"]
        if dtype_bytes is None:
            dt = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
            dtype_bytes = 4 if "32" in dt else 2
        return cls(vocab=config["vocab_size"], hidden=config["hidden_size"],
                   layers=config["num_hidden_layers"], heads=heads,
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   intermediate=config["intermediate_size"],
                   tied_embeddings=bool(config.get("tie_word_embeddings", False)), dtype_bytes=dtype_bytes)

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        mlp = 3 * h * self.intermediate
        return attn + mlp + 2 * h  # two RMSNorm weights

    @property
    def params(self) -> int:
        emb = self.vocab * self.hidden
        return self.layers * self.layer_params + self.hidden + emb * (1 if self.tied_embeddings else 2)

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies by (the embedding lookup is not a matmul)."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def flops_per_token(self, context: float) -> float:
        """2 * params, plus QK^T and AV over `context` earlier tokens (2 FLOPs per MAC)."""
        return 2 * self.matmul_params + 4 * self.layers * self.heads * self.head_dim * context

    def decode_step_bytes(self, batch: int, context: float) -> float:
        return self.weight_bytes + batch * context * self.kv_bytes_per_token


@dataclass(frozen=True)
class Hardware:
    bandwidth_Bps: float
    flops: float
    name: str = ""

    def decode_step_s(self, shape: Shape, batch: int, context: float) -> float:
        return max(shape.decode_step_bytes(batch, context) / self.bandwidth_Bps,
                   batch * shape.flops_per_token(context) / self.flops)


def measure_cpu(mb: int = 256, n: int = 1024, seconds: float = 0.5) -> Hardware:
    """memcpy bandwidth (read + write bytes) and float32 matmul rate with torch, quickly."""
    import torch

    src = torch.empty(mb * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best_bw = 0.0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        dst.copy_(src)
        best_bw = max(best_bw, 2 * src.numel() / (time.perf_counter() - t))
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best_fl = 0.0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        a @ b
        best_fl = max(best_fl, 2 * n**3 / (time.perf_counter() - t))
    return Hardware(best_bw, best_fl, f"cpu measured ({torch.get_num_threads()} threads)")


def workload_limit(shape: Shape, hw: Hardware, *, mean_prompt: float, mean_output: float,
                   batch: int, replicas: int = 1) -> dict:
    """Best case per replica: decode in full batches of `batch` at the mean context
    (prompt + output/2), prefill compute-bound at the matmul rate. Returns the request
    and token rates no scheduler can beat on this hardware."""
    ctx = mean_prompt + mean_output / 2
    step = hw.decode_step_s(shape, batch, ctx)
    decode_s_per_req = mean_output * step / batch
    prefill_s_per_req = mean_prompt * shape.flops_per_token(mean_prompt / 2) / hw.flops
    per_req = decode_s_per_req + prefill_s_per_req
    req_s = replicas / per_req
    return {
        "hardware": hw.__dict__,
        "shape": {**shape.__dict__, "params": shape.params, "weight_bytes": shape.weight_bytes},
        "assumed_batch": batch, "replicas": replicas, "mean_context": ctx,
        "decode_step_s": step,
        "decode_step_s_batch1": hw.decode_step_s(shape, 1, ctx),
        "bound": "memory" if shape.decode_step_bytes(batch, ctx) / hw.bandwidth_Bps
        >= batch * shape.flops_per_token(ctx) / hw.flops else "compute",
        "req_s": req_s,
        "output_tok_s": req_s * mean_output,
        "total_tok_s": req_s * (mean_prompt + mean_output),
    }


def attach(summary: dict, limit: dict) -> dict:
    """Adds the limit and how far the measured throughputs are from it."""
    summary["roofline"] = {
        **limit,
        "fraction_of_limit_req_s": summary["throughput_req_s"] / limit["req_s"],
        "fraction_of_limit_output_tok_s": summary["throughput_output_tok_s"] / limit["output_tok_s"],
    }
    return summary
