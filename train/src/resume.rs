//! Whether a checkpoint may be resumed under the current config: everything that changes
//! the math or the data order must be the same; logging, checkpointing, evaluation, loader
//! threads, `train.steps` (to extend a run), the parallel layout, the microbatches and
//! the device and precision may differ.

use toml::{Table, Value};

use crate::config::{RunConfig, invalid};
use crate::error::Result;

/// Keys free to change between a checkpoint and its resumption (a run folder may be moved
/// or renamed).
const FREE: [&str; 14] = [
    "run.name",
    "run.dir",
    "log",
    "checkpoint",
    "eval",
    "fault",
    "data.workers",
    "data.prefetch",
    "data.build",
    "data.demo",
    "train.steps",
    // Microbatches split the same global batch, and the loss is the mean over the whole
    // batch's targets, so the count changes only rounding, as a layout does; a plan file
    // for another world (`parallel.plan`) sets its own.
    "train.microbatches",
    // Checkpoints hold full tensors: any layout loads them (the math is the same).
    "parallel",
    // Checkpoints hold the f32 masters, so a bf16 run on a GPU resumes on the CPU in
    // f32 and back (the device, in `parallel`, decides the default precision).
    "train.precision",
];

fn strip(doc: &mut Table) {
    for key in FREE {
        match key.split_once('.') {
            None => {
                doc.remove(key);
            }
            Some((a, b)) => {
                if let Some(Value::Table(t)) = doc.get_mut(a) {
                    t.remove(b);
                }
            }
        }
    }
}

/// Errors naming the first key that differs between the checkpoint's config and `cfg`.
pub fn check_resumable(saved_toml: &str, cfg: &RunConfig) -> Result<()> {
    let mut saved: Table = saved_toml
        .parse()
        .map_err(|e| invalid("(checkpoint config.toml)", format!("cannot parse: {e}")))?;
    let mut now: Table = cfg
        .to_toml()?
        .parse()
        .map_err(|e| invalid("(config)", format!("cannot parse: {e}")))?;
    strip(&mut saved);
    strip(&mut now);
    let json = |t: Table| {
        serde_json::to_value(t).map_err(|e| invalid("(config)", format!("as JSON: {e}")))
    };
    if let Some(key) = first_difference(&json(saved)?, &json(now)?, "") {
        return Err(invalid(
            key,
            "differs from the checkpoint's config; a resumed run must keep the model, data, batch, optimizer and seed (only run.name/dir, log, checkpoint, eval, fault, data.workers/prefetch/build/demo, train.steps, train.microbatches, train.precision and parallel may change)",
        )
        .into());
    }
    Ok(())
}

/// Errors when the dataset under `data.path` was packed with other settings than the one
/// the checkpoint trained on (its `data.json`): the loader's position would index other
/// rows (a repack with the same pack counts passes every other check). Only what decides
/// the rows is compared, as `ensure_dataset` does (`template`, `image`, `audio`, `pack`):
/// paths as typed, pack threads and the like may differ. A `data.json` this version cannot
/// read (a newer one's) is not compared.
pub fn check_same_data(saved_json: &str, now_json: &str, checkpoint: &str) -> Result<()> {
    use braid_dataloader::config::DataConfig;
    let rows = |text: &str| -> Option<serde_json::Value> {
        // Through the typed config: fields an older data.json lacks take their defaults.
        let cfg: DataConfig = serde_json::from_str(text).ok()?;
        let v = serde_json::to_value(cfg).ok()?;
        let keep = ["template", "image", "audio", "pack"];
        Some(serde_json::Value::Object(
            (v.as_object()?.iter())
                .filter(|(k, _)| keep.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        ))
    };
    // Not JSON at all is damage (a cut or overwritten file), not a newer version's fields.
    if let Err(e) = serde_json::from_str::<serde_json::Value>(saved_json) {
        return Err(crate::error::TrainError::Checkpoint {
            path: std::path::Path::new(checkpoint).join(crate::checkpoint::DATA_FILE),
            reason: format!(
                "not JSON ({e}): the checkpoint is damaged, so whether the dataset is the one it trained on cannot be checked"
            ),
        });
    }
    let (Some(saved), Some(now)) = (rows(saved_json), rows(now_json)) else {
        return Ok(());
    };
    if let Some(key) = first_difference(&saved, &now, "") {
        return Err(invalid(
            "data.path",
            format!(
                "the dataset there was packed with other settings than the one {checkpoint} trained on (first difference: `{key}`): resume on the data the run started with, or start a new run"
            ),
        )
        .into());
    }
    Ok(())
}

/// Errors when the checkpoint carries a `tokenizer.json` other than the one the dataset
/// under `data.path` was tokenized with (its SHA-256 in `dataset.json`): the same ids would
/// stand for other tokens. Checkpoints without one, and byte-tokenized datasets, pass.
pub fn check_same_tokenizer(
    checkpoint: &std::path::Path,
    data: &braid_dataloader::dataset::DatasetInfo,
) -> Result<()> {
    use braid_dataloader::tokenize::files::{TOKENIZER_JSON, tokenizer_sha256};
    let carried = checkpoint.join(TOKENIZER_JSON);
    let (Some(want), true) = (&data.tokenizer.sha256, carried.is_file()) else {
        return Ok(());
    };
    let bytes = braid_nn::files::read_limited(&carried, 1 << 30)
        .map_err(crate::error::io_err(&carried, "read"))?;
    let got = tokenizer_sha256(&bytes);
    if &got != want {
        return Err(invalid(
            "data.path",
            format!(
                "the dataset there was tokenized with another tokenizer (sha256 {want}) than the one {} trained with (sha256 {got}): resume on the data the run started with, or start a new run",
                checkpoint.display()
            ),
        )
        .into());
    }
    Ok(())
}

/// The first dotted key where `a` and `b` differ (`(all)` when they are not both objects).
fn first_difference(a: &serde_json::Value, b: &serde_json::Value, path: &str) -> Option<String> {
    use serde_json::Value as J;
    match (a, b) {
        (J::Object(x), J::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                match (x.get(k), y.get(k)) {
                    (Some(u), Some(v)) => first_difference(u, v, &p),
                    _ => Some(p),
                }
            })
        }
        _ if a == b => None,
        _ => Some(if path.is_empty() {
            "(all)".into()
        } else {
            path.to_string()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::BASE;

    fn cfg(sets: &[&str]) -> RunConfig {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        RunConfig::from_toml(BASE, "base.toml", &sets).unwrap()
    }

    #[test]
    fn free_keys_may_change_the_rest_is_named() {
        let saved = cfg(&[]).to_toml().unwrap();
        check_resumable(
            &saved,
            &cfg(&[
                "run.dir=moved",
                "train.steps=50",
                "log.interval=1",
                "train.microbatches=2",
            ]),
        )
        .unwrap();
        for (set, key) in [
            ("optim.lr=0.5", "optim.lr"),
            ("run.seed=9", "run.seed"),
            ("train.batch_rows=2", "train.batch_rows"),
            ("model.llm.layers=3", "model.llm.layers"),
        ] {
            let e = check_resumable(&saved, &cfg(&[set]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{set}: {e}");
        }
    }

    #[test]
    fn a_dataset_packed_otherwise_is_named_by_its_first_differing_setting() {
        use braid_dataloader::config::DataConfig;
        let base = DataConfig::default();
        let json = |c: &DataConfig| serde_json::to_string_pretty(c).unwrap();
        let saved = json(&base);
        // What does not decide the rows may differ: paths as typed, pack threads.
        let mut other = base.clone();
        other.input.path = Some("./moved/train.jsonl".into());
        other.tokenizer.path = Some("../tok".into());
        other.shards.threads = base.shards.threads + 7;
        check_same_data(&saved, &json(&other), "ck").unwrap();
        // An older data.json without later fields reads with their defaults.
        check_same_data(r#"{"pack": {}}"#, &saved, "ck").unwrap();
        let mut packed = base.clone();
        packed.pack.window += 1;
        let e = check_same_data(&saved, &json(&packed), "ck")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`pack.window`") && e.contains("data.path"),
            "{e}"
        );
        let mut image = base.clone();
        image.image.size += 14;
        let e = check_same_data(&saved, &json(&image), "ck")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`image.size`"), "{e}");
        // JSON this version's data config does not read (a newer one's): not compared.
        check_same_data(r#"{"pack": {"window": "wide"}}"#, &saved, "ck").unwrap();
        // Not JSON at all (a cut file): damage, refused naming the file.
        for cut in ["not json", &saved[..40]] {
            let e = check_same_data(cut, &saved, "ck").unwrap_err().to_string();
            assert!(e.contains("data.json") && e.contains("damaged"), "{e}");
        }
    }
}
