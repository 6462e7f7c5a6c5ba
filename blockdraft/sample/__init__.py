"""sample: position-keyed sampling (greedy, temperature, min-p, top-k, top-p) and log-probabilities.

See blockdraft.sample.sampler for the semantics: the sample at output position q is a pure function of
(request seed, q, logits), via Gumbel-max with counter-based hashed noise.
"""

from blockdraft.sample.sampler import (
    SamplingTensors,
    compute_logprobs,
    gumbel_noise,
    keyed_uniform,
    sample,
)

__all__ = ["SamplingTensors", "compute_logprobs", "gumbel_noise", "keyed_uniform", "sample"]
