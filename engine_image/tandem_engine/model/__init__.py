"""Everything that touches tensors: checkpoints, the Llama-family model, paged
attention (torch and the native CPU kernel), the sampler and the model runner."""
