//! braid-encoders: vision (CLIP/SigLIP ViT) and audio (Whisper-style) encoders, projectors, Hugging Face weight import.
