"""Llama-family model (Llama 2/3/3.1, Mistral, Qwen2) and its weight loading."""

from replica_worker.engine.model.llama import LlamaForCausalLM, LlamaShape
from replica_worker.engine.model.loader import DTYPES, get_model, load_hf_config, sliding_window_of

__all__ = ["DTYPES", "LlamaForCausalLM", "LlamaShape", "get_model", "load_hf_config", "sliding_window_of"]
