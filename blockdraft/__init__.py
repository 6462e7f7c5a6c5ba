"""blockdraft: an LLM inference engine built around DFlash block-diffusion speculative decoding."""

from blockdraft.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: importing the package must not import torch-heavy modules.
    if name == "LLM":
        from blockdraft.llm import LLM

        return LLM
    raise AttributeError(name)
