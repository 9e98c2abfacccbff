"""Everything that touches tensors: checkpoints, the Llama-family model, paged
attention (torch and the native CPU kernel), the sampler and the model runner."""

# The model-family registry's entries register here, so every import of model/family.py
# (ModelConfig reads configs by them) finds them; torch-free, like family.py.
from tandem_engine.model import families as _families  # noqa: F401
