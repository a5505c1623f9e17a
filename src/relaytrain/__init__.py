"""relaytrain: train transformers that do not fit your GPU.

The pieces, in the order a run uses them: `config` (typed schema and checks), `models`
(Hugging Face model -> layered model), `data` (micro-batches), `strategies` (baseline, l2l,
pipelines), `metrics` and `report`. `train.run` ties them together.
"""

__version__ = "0.1.0"
