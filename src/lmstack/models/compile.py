"""Regional torch.compile (`torch_compile: true`, for speed): each decoder layer is compiled on its own,
not the whole model (torchtitan's per-block compile).

Every layer runs the same code, so one compiled graph serves them all (torch inlines the layer's
parameters as graph inputs): compile time is one layer's, not the model's. What runs outside the layers
(embedding, mask construction, the fused or chunked loss, the optimizer) stays eager, so the loss kernel,
the packed-row BlockMask and the optimizer keep working as they are. Inside a layer inductor fuses the
norm / rope / SwiGLU / residual elementwise work around the GEMMs; the fused LoRA and FP8 autograd
functions are traced as they are. Gradient checkpointing wraps each compiled layer (the recompute runs
the compiled forward again).
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's stack of decoder blocks: the ModuleList of at least two like blocks holding the most
    parameters (model.model.layers for the transformers causal LMs, also under PEFT's wrapper)."""
    best, best_size = None, 0
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(block) for block in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = module, size
    return best


def compile_regions(model: nn.Module, backend: str, dynamic: bool | None, fullgraph: bool) -> str:
    """Compile each decoder layer in place (`module.compile`); returns what was compiled. A model without
    a list of decoder layers is compiled whole, and the log says so."""
    layers = decoder_layers(model)
    options = {"backend": backend, "dynamic": dynamic, "fullgraph": fullgraph}
    if layers is None:
        model.compile(**options)
        what = "the whole model (no list of decoder layers found)"
    else:
        for block in layers:
            block.compile(**options)
        what = f"{len(layers)} decoder layers ({type(layers[0]).__name__}), one at a time"
    logger.info(
        "torch_compile: %s compiled with %s (dynamic=%s, fullgraph=%s)", what, backend, dynamic, fullgraph
    )
    return what
