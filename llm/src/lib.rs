//! braid-llm: the decoder backbone (Llama/Qwen2 family), modality-embedding scatter, vocab-parallel cross-entropy, pipeline stages.
