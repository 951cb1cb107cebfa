//! `braid inspect DIR`: the statistics of a packed dataset, checksums, and the length
//! histograms as PNG charts.

use std::path::PathBuf;

use braid_dataloader::dataset::DatasetInfo;
use braid_dataloader::pack::Histogram;
use clap::Args;

use crate::plot::{BarChart, Chart};

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// A `braid pack` output folder.
    dir: PathBuf,
    /// Write one PNG histogram per length distribution into this folder.
    #[arg(long)]
    plots: Option<PathBuf>,
    /// Recompute every shard's SHA-256 and open the pack index.
    #[arg(long)]
    verify: bool,
    /// Print dataset.json's statistics as JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(a: InspectArgs) -> u8 {
    match inspect(&a) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("braid inspect: error: {e}");
            1
        }
    }
}

fn inspect(a: &InspectArgs) -> Result<(), Box<dyn std::error::Error>> {
    let info = DatasetInfo::read(&a.dir)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&info)?);
    } else {
        crate::pack::print_summary(&info, &a.dir.display().to_string());
        for (name, hist) in histograms(&info) {
            if hist.count > 0 {
                println!(
                    "  {name:<13} mean {:>8.1}  min {:>6}  max {:>6}",
                    hist.mean(),
                    hist.min,
                    hist.max
                );
            }
        }
    }
    if a.verify {
        info.verify_checksums(&a.dir)?;
        let (_, ds) = DatasetInfo::open(&a.dir)?;
        println!(
            "  verified  {} shards (sha256), {} packs indexed",
            info.shards.len(),
            ds.packs().len()
        );
    }
    if let Some(dir) = &a.plots {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for (name, hist) in histograms(&info) {
            if hist.count == 0 {
                continue;
            }
            let path = dir.join(format!("{name}.png"));
            chart(name, hist).write_png(&path)?;
            println!("  wrote     {}", path.display());
        }
    }
    Ok(())
}

fn histograms(info: &DatasetInfo) -> [(&'static str, &Histogram); 5] {
    let h = &info.histograms;
    [
        ("llm_len", &h.llm_len),
        ("text_tokens", &h.text_tokens),
        ("image_tokens", &h.image_tokens),
        ("audio_tokens", &h.audio_tokens),
        ("pack_samples", &h.pack_samples),
    ]
}

/// What one entry of the histogram `name` counts: `pack_samples` has one entry per pack (the
/// samples in it); the others one per sample.
fn counted_unit(name: &str) -> &'static str {
    if name == "pack_samples" {
        "packs"
    } else {
        "samples"
    }
}

/// A log2-bucket histogram as a bar chart (buckets from the first to the last non-empty one).
fn chart(name: &str, h: &Histogram) -> BarChart {
    let unit = counted_unit(name);
    let first = h.counts.iter().position(|&c| c > 0).unwrap_or(0);
    let last = h.counts.iter().rposition(|&c| c > 0).unwrap_or(0);
    let bars = (first..=last)
        .map(|k| {
            let (lo, hi) = Histogram::bucket_bounds(k);
            let label = if hi - lo <= 1 {
                format!("{lo}")
            } else {
                format!("{lo}-{}", hi - 1)
            };
            (label, h.counts.get(k).copied().unwrap_or(0) as f64)
        })
        .collect();
    BarChart {
        title: format!("{name}: {} {unit}, mean {:.1}", h.count, h.mean()),
        x_label: format!("{name} (log2 buckets)"),
        y_label: unit.into(),
        bars,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pack_samples` has one entry per pack: its chart must say packs, not samples.
    #[test]
    fn pack_samples_chart_counts_packs() {
        let mut h = Histogram::default();
        for n in [1, 2, 2, 5] {
            h.record(n);
        }
        let c = chart("pack_samples", &h);
        assert_eq!(c.y_label, "packs");
        assert!(c.title.starts_with("pack_samples: 4 packs"), "{}", c.title);
        let c = chart("llm_len", &h);
        assert_eq!(c.y_label, "samples");
        assert!(c.title.starts_with("llm_len: 4 samples"), "{}", c.title);
    }
}
