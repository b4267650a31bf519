"""Replica worker: the Sarathi-Serve engine core and its gRPC client to the router."""

__all__ = ["LLM", "Logprob", "SamplingParams"]


def __getattr__(name):
    # Lazy so that `python -m replica_worker --help` does not import torch first.
    if name == "LLM":
        from replica_worker.engine.llm import LLM

        return LLM
    if name == "Logprob":
        from replica_worker.engine.outputs import Logprob

        return Logprob
    if name == "SamplingParams":
        from replica_worker.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
