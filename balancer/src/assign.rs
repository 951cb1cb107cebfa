//! Where the samples of one global batch go: each packed row to an LLM data-parallel
//! replica and a microbatch, each image and clip to an encoder replica. Every rank
//! computes the same [`Assignment`] from the batch metadata it holds; the trainer's
//! bridge then routes embeddings for whatever the assignment says, so an [`Assigner`]
//! only balances work. [`RoundRobin`] is the default; a data-aware one lives here too.

/// An assignment that does not fit its batch or replica counts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("batch assignment: {0}")]
pub struct AssignError(pub String);

/// What an assigner sees of one global batch (all ranks hold the same).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchShape {
    /// Tokens of each packed row.
    pub row_tokens: Vec<usize>,
    /// Sum over each row's samples of (sample length)^2: the attention term.
    pub row_sq: Vec<u64>,
    /// Images of each row (in row order: the global image order).
    pub row_images: Vec<usize>,
    /// Each image's vision-encoder sequence length (global image order).
    pub image_tokens: Vec<usize>,
    /// Clips of each row, and each clip's mel frames (global clip order).
    pub row_clips: Vec<usize>,
    pub clip_frames: Vec<usize>,
}

impl BatchShape {
    pub fn num_images(&self) -> usize {
        self.row_images.iter().sum()
    }
    pub fn num_clips(&self) -> usize {
        self.row_clips.iter().sum()
    }
}

/// The replica counts an assignment fills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Replicas {
    pub llm_dp: usize,
    pub microbatches: usize,
    pub vision_dp: usize,
    pub audio_dp: usize,
}

/// One step's placement of rows, images and clips.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// Per row: (LLM dp replica, microbatch within the replica).
    pub rows: Vec<(usize, usize)>,
    /// Per image (global order): the vision dp replica that encodes it.
    pub images: Vec<usize>,
    /// Per clip (global order): the audio dp replica that encodes it.
    pub clips: Vec<usize>,
}

impl Assignment {
    /// Checks lengths and ranges against the batch and replica counts.
    pub fn validate(&self, b: &BatchShape, r: &Replicas) -> Result<(), AssignError> {
        let bad = |m: String| Err(AssignError(m));
        if self.rows.len() != b.row_tokens.len() {
            return bad(format!(
                "{} row places for {} rows",
                self.rows.len(),
                b.row_tokens.len()
            ));
        }
        if let Some((i, p)) = self
            .rows
            .iter()
            .enumerate()
            .find(|(_, p)| p.0 >= r.llm_dp || p.1 >= r.microbatches)
        {
            return bad(format!(
                "row {i} goes to replica {} microbatch {}, beyond llm dp = {} x {} microbatches",
                p.0, p.1, r.llm_dp, r.microbatches
            ));
        }
        if self.images.len() != b.num_images() || self.clips.len() != b.num_clips() {
            return bad(format!(
                "{} image and {} clip places for {} images and {} clips",
                self.images.len(),
                self.clips.len(),
                b.num_images(),
                b.num_clips()
            ));
        }
        if let Some(i) = self.images.iter().position(|&d| d >= r.vision_dp) {
            return bad(format!("image {i} goes beyond vision dp = {}", r.vision_dp));
        }
        if let Some(i) = self.clips.iter().position(|&d| d >= r.audio_dp) {
            return bad(format!("clip {i} goes beyond audio dp = {}", r.audio_dp));
        }
        Ok(())
    }

    /// Rows of replica `dp`, microbatch `mb`, in global row order.
    pub fn rows_of(&self, dp: usize, mb: usize) -> Vec<usize> {
        (0..self.rows.len())
            .filter(|&i| self.rows[i] == (dp, mb))
            .collect()
    }

    /// How many microbatches replica `dp` runs: one past the highest used (empty
    /// microbatches in between run as empty batches).
    pub fn microbatches_of(&self, dp: usize) -> usize {
        self.rows
            .iter()
            .filter(|p| p.0 == dp)
            .map(|p| p.1 + 1)
            .max()
            .unwrap_or(0)
    }
}

/// Decides one step's [`Assignment`] (the balancer provides a data-aware one).
pub trait Assigner: Send + Sync + std::fmt::Debug {
    fn assign(&self, batch: &BatchShape, replicas: &Replicas) -> Assignment;
}

/// The simple default: rows dealt round-robin to LLM replicas, each replica's rows split
/// into contiguous microbatches of near-equal row counts; images and clips dealt
/// round-robin to their encoder replicas. Balanced in counts, blind to lengths.
#[derive(Clone, Copy, Debug, Default)]
pub struct RoundRobin;

impl Assigner for RoundRobin {
    fn assign(&self, b: &BatchShape, r: &Replicas) -> Assignment {
        let n = b.row_tokens.len();
        let mut rows = vec![(0, 0); n];
        for dp in 0..r.llm_dp {
            let mine: Vec<usize> = (dp..n).step_by(r.llm_dp).collect();
            // Contiguous microbatches whose row counts differ by at most one.
            let parts = r.microbatches.clamp(1, mine.len().max(1));
            for mb in 0..parts {
                let range = (mb * mine.len() / parts)..((mb + 1) * mine.len() / parts);
                for &i in &mine[range] {
                    rows[i] = (dp, mb);
                }
            }
        }
        Assignment {
            rows,
            images: (0..b.num_images()).map(|i| i % r.vision_dp).collect(),
            clips: (0..b.num_clips()).map(|i| i % r.audio_dp).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_covers_every_row_and_item_once() {
        let b = BatchShape {
            row_tokens: vec![10; 7],
            row_sq: vec![100; 7],
            row_images: vec![1, 0, 2, 1, 0, 0, 1],
            image_tokens: vec![16; 5],
            row_clips: vec![0, 1, 0, 0, 2, 0, 0],
            clip_frames: vec![30, 40, 50],
        };
        let r = Replicas {
            llm_dp: 3,
            microbatches: 2,
            vision_dp: 2,
            audio_dp: 1,
        };
        let a = RoundRobin.assign(&b, &r);
        a.validate(&b, &r).unwrap();
        // Replica 0 holds rows 0, 3, 6: microbatches [0], [3, 6] (split_even).
        assert_eq!(a.rows_of(0, 0), vec![0]);
        assert_eq!(a.rows_of(0, 1), vec![3, 6]);
        assert_eq!(a.microbatches_of(2), 2);
        assert_eq!(a.images, vec![0, 1, 0, 1, 0]);
        assert_eq!(a.clips, vec![0, 0, 0]);
        let mut bad = a.clone();
        bad.rows[0] = (3, 0);
        assert!(bad.validate(&b, &r).is_err());
    }
}
