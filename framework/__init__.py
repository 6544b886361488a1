"""Multi-dimensional parallel training of transformer language models (docs/code-map.md)."""

import logging

# torchao, which transformers' quantizers import whenever it is installed (the fp8 extra),
# logs on every start that its CUDA-only extensions did not load and torch logs a deprecation
# of its enum registrations: neither concerns a run (FP8 runs torchao's Python paths,
# framework/models/fp8.py), and both would bury the banner and the config errors on stderr.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
