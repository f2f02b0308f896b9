"""``convert --calibrate``: activation-aware (GPTQ-class) quantization inside the streaming pipeline.

Data flow (one decoder layer at a time, in order)::

    calibration text -> tokenizer -> windows -> embed -> state (x, blocks) per window batch
    for each layer i:
        attention of layer i on the state, every Linear input observed -> H (attention Linears)
        quantize + write the attention Linears (GPTQ with H)        -> re-run attention quantized
        MLP of layer i, observed -> H (dense / shared / latent Linears, routed experts of batch 0)
        quantize + write them; further expert batches: observed again, quantize + write
        output pass with the layer as written (dequantized, device activation fake-quant) -> next state
        checkpoint the state (resume point), journal the layer's shards
    head: lm_head's H from the final state (if lm_head is quantized at all)

* ``hessian``: the observer that turns Linear inputs into ``H = (1/n) sum x x^T`` (float64).
* ``layered``: the layer-ordered plan (same shard naming, index and description as ``convert``).
* ``run``: the driver (``device``: where its forward and Hessians run); ``layer_io``: the weights it reads and the shard writer it fills;
  ``jobs``: the GPTQ problems of a layer as jobs, run in this process or in local worker processes
  (``ray_jobs``: as Ray tasks); ``estimate``: ``plan --calibrate``'s time and memory estimate.

The forward is the validator's (:mod:`kimi_quant.runtime.forward`), reached through its generic
``observe_linear_inputs`` hook: one model implementation for validate and calibrate.
"""

from .config import CalibConfig

__all__ = ["CalibConfig"]
