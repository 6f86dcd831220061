"""Generation: sampling parameters, the sampler, and the generation loop."""

from llmopt.runtime.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
