"""Layers whose weights come in more than one format (vLLM's
``model_executor/layers``): a layer holds a method object that creates,
prepares and applies its weights, and the model never branches on format.

    base.py          LinearMethodBase (create_weights / process_weights_after_loading / apply),
                     LinearConfig (hands each layer its method), Linear (the layer)
    unquantized.py   the plain methods: oneDNN / small_gemm packed copies (the default) and the
                     batch-invariant one of --deterministic
    vocab.py         VocabEmbedding (the token embedding) and its methods' interface; the plain table
    gguf.py, int8.py the quantized ones: GGUF blocks (linear and embedding methods, GGUFConfig); int8 rows
                     with per-channel scales (W8A8)

    parallel.py      tensor-parallel shards: RowParallelLinear (all-reduces its method's product),
                     the vocabulary-parallel embedding and logits, TPShard (which slice a rank holds)

A quantized format (GGUF blocks, int8) or LoRA adds a method and a config
beside these; a tensor-parallel shard changes the layers' shapes, not their methods.
"""
from kvferry.model.layers.base import Linear, LinearConfig, LinearMethodBase, MatmulArgs
from kvferry.model.layers.unquantized import (BatchInvariantConfig, BatchInvariantLinearMethod, UnquantizedConfig,
                                              UnquantizedLinearMethod)

__all__ = ["BatchInvariantConfig", "BatchInvariantLinearMethod", "Linear", "LinearConfig", "LinearMethodBase",
           "MatmulArgs", "UnquantizedConfig", "UnquantizedLinearMethod"]
