//! braid-dataloader: readers, media decoding, tokenization, per-sample cost metadata, packing, Parquet shards, the resumable loader.

pub mod media;
