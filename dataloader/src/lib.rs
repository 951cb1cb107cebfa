//! braid-dataloader: readers, media decoding, tokenization, per-sample cost metadata, packing, Parquet shards, the resumable loader.

pub mod cost;
pub mod demo;
pub mod media;
pub mod pack;
pub mod read;
pub mod tokenize;
