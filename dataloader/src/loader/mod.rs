//! The resumable, data-parallel loader: packed rows from the shards into host batches.
//!
//! Order: each epoch visits every pack once, in a permutation drawn from `(seed, epoch)`
//! (Fisher-Yates on SplitMix64); global batch `b` of the epoch is packs
//! `perm[b * R .. (b + 1) * R]` (`R = batch_rows`; the `packs mod R` packs left at the end of
//! an epoch's permutation are skipped that epoch, a different random set each time). Every rank computes the same order from the same metadata, takes its share
//! of each global batch ([`dp_rows`]: contiguous, sizes differ by at most one), and decodes only
//! its own rows.
//!
//! Position: `(epoch, batch)` of the next batch to hand out. [`Loader::state`] saves it,
//! [`Loader::new`] with that state restarts exactly there: the order is a pure function of the
//! seed, the epoch and the pack count, so nothing else needs saving, and a resumed loader with
//! a different `dp_size` still sees the same global batches.
//!
//! Decoding runs ahead on a producer thread that fans each batch's media out to `workers`
//! threads; at most `prefetch` decoded batches wait in the channel (bounded memory).

mod decode;

use std::ops::Range;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};

pub use decode::{AudioItem, ImageItem, MediaFilter, Row, WantedMedia};

use crate::cost::SampleCost;
use crate::dataset::{DatasetError, DatasetInfo};
use crate::pack::synth::SplitMix64;
use crate::shard::{Dataset, PackEntry};

/// `[data]` loader settings of a run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoaderConfig {
    /// Shuffle seed (the run's seed by default).
    pub seed: u64,
    /// Packed rows per global batch, across all data-parallel ranks.
    pub batch_rows: usize,
    /// Decoding threads per rank.
    pub workers: usize,
    /// Decoded batches kept ready ahead of the consumer.
    pub prefetch: usize,
    /// `false`: packs in stored order every epoch.
    pub shuffle: bool,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig {
            seed: 0,
            batch_rows: 8,
            workers: 2,
            prefetch: 2,
            shuffle: true,
        }
    }
}

/// Where a loader stands: the next batch it hands out. Saved in checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoaderState {
    pub epoch: u64,
    /// Batches of `epoch` already handed out.
    pub batch: u64,
    /// What the order depends on, checked on restore.
    pub seed: u64,
    pub batch_rows: u64,
    pub packs: u64,
    pub shuffle: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    #[error("loader config: {0}")]
    Config(String),
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error("cannot resume: {0}")]
    Resume(String),
    #[error("decoding batch {batch} of epoch {epoch}: {reason}")]
    Decode {
        epoch: u64,
        batch: u64,
        reason: String,
    },
    #[error("the loader's decoding thread stopped")]
    Stopped,
}

/// What every rank knows about one row of the global batch.
#[derive(Clone, Debug, PartialEq)]
pub struct GlobalRow {
    pub pack: usize,
    pub samples: usize,
    pub tokens: u64,
    pub cost: SampleCost,
}

/// One global batch, as this rank sees it.
#[derive(Clone, Debug)]
pub struct Batch {
    pub epoch: u64,
    /// Index inside the epoch.
    pub batch: u64,
    /// Every row of the global batch (metadata only), in order.
    pub global: Vec<GlobalRow>,
    /// Which rows of `global` this rank holds.
    pub rows_range: Range<usize>,
    /// This rank's rows, decoded.
    pub rows: Vec<Row>,
}

impl Batch {
    /// Loss targets in this rank's rows (tokens whose loss-mask bit is set).
    pub fn loss_tokens(&self) -> usize {
        self.rows.iter().map(Row::loss_tokens).sum()
    }
}

/// Rows `[start, end)` of a global batch of `rows` that data-parallel rank `rank` of `dp`
/// takes: contiguous, sizes `floor` or `ceil` of `rows / dp`.
pub fn dp_rows(rows: usize, dp: usize, rank: usize) -> Range<usize> {
    let dp = dp.max(1);
    (rank * rows / dp)..((rank + 1) * rows / dp)
}

/// The pack order of `epoch`: a permutation of `0..packs`.
pub fn epoch_order(packs: usize, seed: u64, epoch: u64, shuffle: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..packs).collect();
    if shuffle {
        let mut rng = SplitMix64::new(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        for i in (1..packs).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
    }
    order
}

/// The loader of one data-parallel rank.
pub struct Loader {
    state: LoaderState,
    rx: Option<Receiver<Result<Batch, LoaderError>>>,
    producer: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("state", &self.state)
            .finish()
    }
}

impl Loader {
    /// Opens `dir` for rank `dp_rank` of `dp_size`, at the beginning or at `resume`.
    pub fn open(
        dir: &std::path::Path,
        cfg: &LoaderConfig,
        dp_rank: usize,
        dp_size: usize,
        resume: Option<LoaderState>,
    ) -> Result<Loader, LoaderError> {
        Self::open_filtered(dir, cfg, dp_rank, dp_size, resume, None)
    }

    /// [`Loader::open`] that decodes only the media `filter` wants of each batch (see
    /// [`MediaFilter`]); the other items keep their shape with empty `pixels` / `mel`.
    pub fn open_filtered(
        dir: &std::path::Path,
        cfg: &LoaderConfig,
        dp_rank: usize,
        dp_size: usize,
        resume: Option<LoaderState>,
        filter: Option<MediaFilter>,
    ) -> Result<Loader, LoaderError> {
        let (info, ds) = DatasetInfo::open(dir)?;
        let (info, ds) = (Arc::new(info), Arc::new(ds));
        Loader::new_filtered(info, ds, cfg, dp_rank, dp_size, resume, filter)
    }

    /// A loader over an opened dataset.
    pub fn new(
        info: Arc<DatasetInfo>,
        ds: Arc<Dataset>,
        cfg: &LoaderConfig,
        dp_rank: usize,
        dp_size: usize,
        resume: Option<LoaderState>,
    ) -> Result<Loader, LoaderError> {
        Self::new_filtered(info, ds, cfg, dp_rank, dp_size, resume, None)
    }

    /// [`Loader::new`] with a [`MediaFilter`].
    pub fn new_filtered(
        info: Arc<DatasetInfo>,
        ds: Arc<Dataset>,
        cfg: &LoaderConfig,
        dp_rank: usize,
        dp_size: usize,
        resume: Option<LoaderState>,
        filter: Option<MediaFilter>,
    ) -> Result<Loader, LoaderError> {
        let bad = |s: String| Err(LoaderError::Config(s));
        let packs = ds.packs().len();
        if dp_size == 0 || dp_rank >= dp_size {
            return bad(format!("dp_rank {dp_rank} of dp_size {dp_size}"));
        }
        if cfg.batch_rows < dp_size {
            return bad(format!(
                "batch_rows {} < dp_size {dp_size}: every data-parallel rank needs a row",
                cfg.batch_rows
            ));
        }
        if cfg.workers == 0 || cfg.prefetch == 0 {
            return bad("workers and prefetch must be >= 1".into());
        }
        if packs < cfg.batch_rows {
            return bad(format!(
                "the dataset has {packs} packs, fewer than batch_rows {}",
                cfg.batch_rows
            ));
        }
        let fresh = LoaderState {
            epoch: 0,
            batch: 0,
            seed: cfg.seed,
            batch_rows: cfg.batch_rows as u64,
            packs: packs as u64,
            shuffle: cfg.shuffle,
        };
        let state = match resume {
            None => fresh,
            Some(s) => {
                let same = (s.seed, s.batch_rows, s.packs, s.shuffle)
                    == (fresh.seed, fresh.batch_rows, fresh.packs, fresh.shuffle);
                if !same {
                    return Err(LoaderError::Resume(format!(
                        "saved position {s:?} was for a different order than this loader ({fresh:?}): \
                         seed, batch_rows, shuffle and the dataset's pack count must match"
                    )));
                }
                if s.batch >= packs as u64 / cfg.batch_rows as u64 {
                    return Err(LoaderError::Resume(format!(
                        "saved batch {} is past the epoch's {} batches",
                        s.batch,
                        packs / cfg.batch_rows
                    )));
                }
                s
            }
        };
        let (tx, rx) = sync_channel(cfg.prefetch);
        let producer = Producer {
            info,
            ds,
            cfg: cfg.clone(),
            dp_rank,
            dp_size,
            start: state,
            filter,
        };
        let handle = std::thread::Builder::new()
            .name(format!("braid-loader-{dp_rank}"))
            .spawn(move || producer.run(tx))
            .map_err(|e| LoaderError::Config(format!("cannot start the loader thread: {e}")))?;
        Ok(Loader {
            state,
            rx: Some(rx),
            producer: Some(handle),
        })
    }

    /// The position to save: restoring it yields the batch the next `next_batch` would.
    pub fn state(&self) -> LoaderState {
        self.state
    }

    /// Batches in one epoch.
    pub fn batches_per_epoch(&self) -> u64 {
        self.state.packs / self.state.batch_rows
    }

    /// The next batch (blocks until decoded). The loader never ends: epochs follow each other.
    pub fn next_batch(&mut self) -> Result<Batch, LoaderError> {
        let rx = self.rx.as_ref().ok_or(LoaderError::Stopped)?;
        let batch = rx.recv().map_err(|_| LoaderError::Stopped)??;
        debug_assert_eq!(
            (batch.epoch, batch.batch),
            (self.state.epoch, self.state.batch)
        );
        self.state.batch += 1;
        if self.state.batch == self.batches_per_epoch() {
            // Saturating: a state read from a damaged checkpoint must not overflow here.
            self.state.epoch = self.state.epoch.saturating_add(1);
            self.state.batch = 0;
        }
        Ok(batch)
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        // Closing the channel makes the producer's next send fail, so it exits.
        drop(self.rx.take());
        if let Some(h) = self.producer.take() {
            let _ = h.join();
        }
    }
}

struct Producer {
    info: Arc<DatasetInfo>,
    ds: Arc<Dataset>,
    cfg: LoaderConfig,
    dp_rank: usize,
    dp_size: usize,
    start: LoaderState,
    filter: Option<MediaFilter>,
}

impl Producer {
    fn run(self, tx: SyncSender<Result<Batch, LoaderError>>) {
        let pool = match rayon::ThreadPoolBuilder::new()
            .num_threads(self.cfg.workers)
            .thread_name(|i| format!("braid-decode-{i}"))
            .build()
        {
            Ok(p) => p,
            Err(e) => {
                let _ = tx.send(Err(LoaderError::Config(format!("decode pool: {e}"))));
                return;
            }
        };
        let r = self.cfg.batch_rows;
        let per_epoch = self.ds.packs().len() / r;
        let (mut epoch, mut b) = (self.start.epoch, self.start.batch as usize);
        loop {
            let order = epoch_order(
                self.ds.packs().len(),
                self.cfg.seed,
                epoch,
                self.cfg.shuffle,
            );
            while b < per_epoch {
                let batch = self.batch(&pool, &order[b * r..(b + 1) * r], epoch, b as u64);
                let failed = batch.is_err();
                if tx.send(batch).is_err() || failed {
                    return;
                }
                b += 1;
            }
            epoch = epoch.saturating_add(1);
            b = 0;
        }
    }

    fn batch(
        &self,
        pool: &rayon::ThreadPool,
        packs: &[usize],
        epoch: u64,
        batch: u64,
    ) -> Result<Batch, LoaderError> {
        let global: Vec<GlobalRow> = packs
            .iter()
            .map(|&p| {
                let e: &PackEntry = &self.ds.packs()[p];
                GlobalRow {
                    pack: p,
                    samples: e.samples,
                    tokens: e.tokens,
                    cost: e.cost,
                }
            })
            .collect();
        let rows_range = dp_rows(packs.len(), self.dp_size, self.dp_rank);
        let mine = &packs[rows_range.clone()];
        let rows = pool
            .install(|| {
                decode::decode_rows(&self.ds, &self.info.settings, mine, self.filter.as_ref())
            })
            .map_err(|reason| LoaderError::Decode {
                epoch,
                batch,
                reason,
            })?;
        Ok(Batch {
            epoch,
            batch,
            global,
            rows_range,
            rows,
        })
    }
}
