//! braid-bridge: routing of modality embeddings from encoder ranks to LLM ranks, and of their grads back, for any pair of layouts.
