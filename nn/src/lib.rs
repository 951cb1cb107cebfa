//! braid-nn: layers shared by the encoders and the LLM, each a forward/backward pair with an explicit cache, tensor-parallel aware.
