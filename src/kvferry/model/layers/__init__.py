"""Layers whose weights come in more than one format (vLLM's
``model_executor/layers``): a layer holds a method object that creates,
prepares and applies its weights, and the model never branches on format.

    base.py          LinearMethodBase (create_weights / process_weights_after_loading / apply),
                     LinearConfig (hands each layer its method), Linear (the layer)
    unquantized.py   the plain methods: oneDNN / small_gemm packed copies (the default) and the
                     batch-invariant one of --deterministic
    vocab.py         VocabEmbedding (the token embedding) and its methods' interface; the plain table
    gguf.py          GGUF blocks: the linear method, the embedding method, GGUFConfig

A quantized format (GGUF blocks, int8), LoRA or a tensor-parallel shard adds
a method and a config beside these.
"""
from kvferry.model.layers.base import Linear, LinearConfig, LinearMethodBase, MatmulArgs
from kvferry.model.layers.unquantized import (BatchInvariantConfig, BatchInvariantLinearMethod, UnquantizedConfig,
                                              UnquantizedLinearMethod)

__all__ = ["BatchInvariantConfig", "BatchInvariantLinearMethod", "Linear", "LinearConfig", "LinearMethodBase",
           "MatmulArgs", "UnquantizedConfig", "UnquantizedLinearMethod"]
