"""relaytrain: train transformers that do not fit your GPU.

The pieces, in the order a run uses them: `config` (typed schema and checks), `models`
(Hugging Face model -> layered model), `data` (micro-batches), `strategies` (baseline, l2l,
pipelines), `metrics` and `report`. `train.run` ties them together.
"""

import logging

__version__ = "0.1.0"

# bitsandbytes (model.quantize=nf4) warns at import, on a CPU, that an optional kernel package
# is absent; peft imports it wherever it is installed, so every adapter run would print that line.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
# torchao (optim.state_bits=8|4) says at import, on a CPU or an older GPU, that its CUDA-only
# kernels did not load, and torch's pytree that torchao registers enums a deprecated way; where
# torchao is installed, transformers imports it for every model, so every run would print them.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
