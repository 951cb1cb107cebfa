//! braid-dataloader: readers, media decoding, tokenization, per-sample cost metadata, packing, Parquet shards, the resumable loader.

pub mod config;
pub mod cost;
pub mod dataset;
pub mod demo;
pub mod guard;
pub mod job;
pub mod job_output;
pub mod loader;
pub mod media;
pub mod pack;
pub mod prepare;
pub mod read;
pub mod shard;
pub mod tokenize;
