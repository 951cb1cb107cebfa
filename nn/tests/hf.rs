//! Hugging Face checkpoint IO: safetensors round trip, f16/bf16/i64 decoding, sharded
//! index, and errors that name the file, the tensor and both shapes.

// Helpers below are plain functions, outside clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::Path;

use braid_kernels::{Device, Tensor};
use braid_nn::hf::{WeightFiles, read_json, save_safetensors, write_json};
use half::{bf16, f16};
use safetensors::tensor::{Dtype, TensorView};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("braid-hf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes raw tensors of any dtype, as another tool would.
fn write_raw(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn f32_round_trip_is_exact_and_atomic() -> TestResult {
    let dir = tmpdir("roundtrip");
    let a = Tensor::from_vec(vec![1.5, -2.0, 3.25, 1e-7, 0.0, 7.0], [2, 3], Device::Cpu)?;
    let b = Tensor::from_vec(vec![42.0], [1], Device::Cpu)?;
    let path = dir.join("model.safetensors");
    save_safetensors(&path, &[("a.weight".into(), &a), ("b".into(), &b)])?;
    // Only the final file exists: the temporary was renamed into place.
    let files: Vec<_> = std::fs::read_dir(&dir)?
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(files, vec![std::ffi::OsString::from("model.safetensors")]);
    // Readable as any new file here is (the umask's mode), not safetensors' 0600 temp
    // file: a team's other accounts read a shared run's checkpoints.
    let plain = dir.join("plain");
    std::fs::write(&plain, b"x")?;
    assert_eq!(
        std::fs::metadata(&path)?.permissions(),
        std::fs::metadata(&plain)?.permissions()
    );
    std::fs::remove_file(&plain)?;
    let w = WeightFiles::open_dir(&dir)?;
    assert_eq!(w.names().collect::<Vec<_>>(), vec!["a.weight", "b"]);
    assert_eq!(w.shape("a.weight"), Some(&[2usize, 3][..]));
    assert_eq!(
        w.load("a.weight", &[2, 3], Device::Cpu)?.to_vec_f32()?,
        a.to_vec_f32()?
    );
    assert_eq!(w.load_any("b", Device::Cpu)?.to_vec_f32()?, vec![42.0]);
    Ok(())
}

#[test]
fn half_precision_and_ids_decode() -> TestResult {
    let dir = tmpdir("dtypes");
    let vals = [1.0f32, -0.5, 3.140625, 65280.0]; // exact in both f16 and bf16
    let bf: Vec<u8> = vals
        .iter()
        .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
        .collect();
    let hf: Vec<u8> = vals
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect();
    let ids: Vec<u8> = [0i64, 5, 151_643]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let neg: Vec<u8> = [-1i64].iter().flat_map(|v| v.to_le_bytes()).collect();
    write_raw(
        &dir.join("model.safetensors"),
        &[
            ("bf", Dtype::BF16, vec![4], bf),
            ("hf", Dtype::F16, vec![2, 2], hf),
            ("input_ids", Dtype::I64, vec![1, 3], ids),
            ("neg", Dtype::I64, vec![1], neg),
        ],
    );
    let w = WeightFiles::open_dir(&dir)?;
    assert_eq!(w.load("bf", &[4], Device::Cpu)?.to_vec_f32()?, vals);
    assert_eq!(w.load("hf", &[2, 2], Device::Cpu)?.to_vec_f32()?, vals);
    let t = w.load_ids("input_ids", Device::Cpu)?;
    assert_eq!(t.dims(), &[1, 3]);
    assert_eq!(t.to_vec_u32()?, vec![0, 5, 151_643]);
    let e = w.load_ids("neg", Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("`neg`") && e.contains("-1"), "{e}");
    let e = w.load_ids("bf", Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("not an integer id type"), "{e}");
    let e = w
        .load("input_ids", &[1, 3], Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a float type"), "{e}");
    Ok(())
}

#[test]
fn sharded_index_reads_every_shard() -> TestResult {
    let dir = tmpdir("sharded");
    let a = Tensor::from_vec(vec![1.0, 2.0], [2], Device::Cpu)?;
    let b = Tensor::from_vec(vec![3.0, 4.0, 5.0], [3], Device::Cpu)?;
    save_safetensors(
        &dir.join("model-00001-of-00002.safetensors"),
        &[("a".into(), &a)],
    )?;
    save_safetensors(
        &dir.join("model-00002-of-00002.safetensors"),
        &[("b".into(), &b)],
    )?;
    let index = serde_json::json!({
        "metadata": {"total_size": 20},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    });
    write_json(&dir.join("model.safetensors.index.json"), &index)?;
    let w = WeightFiles::open_dir(&dir)?;
    assert_eq!(
        w.load("a", &[2], Device::Cpu)?.to_vec_f32()?,
        vec![1.0, 2.0]
    );
    assert_eq!(
        w.load("b", &[3], Device::Cpu)?.to_vec_f32()?,
        vec![3.0, 4.0, 5.0]
    );
    let back: HashMap<String, serde_json::Value> =
        read_json(&dir.join("model.safetensors.index.json"))?;
    assert!(back.contains_key("weight_map"));
    // An index that lists nothing, or names a file outside the model's folder, is refused
    // naming the index; a shard that is not a regular file (a FIFO would block) too.
    for (map, needle) in [
        (serde_json::json!({}), "lists no files"),
        (
            serde_json::json!({"a": "../sharded/model-00001-of-00002.safetensors"}),
            "not a file inside",
        ),
        (serde_json::json!({"a": "/etc/passwd"}), "not a file inside"),
        (serde_json::json!({"a": "."}), "not a file inside"),
    ] {
        write_json(
            &dir.join("model.safetensors.index.json"),
            &serde_json::json!({ "weight_map": map }),
        )?;
        let e = WeightFiles::open_dir(&dir).unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors.index.json") && e.contains(needle),
            "{e}"
        );
    }
    write_json(
        &dir.join("model.safetensors.index.json"),
        &serde_json::json!({ "weight_map": {"a": "sub"} }),
    )?;
    std::fs::create_dir_all(dir.join("sub"))?;
    let e = WeightFiles::open_dir(&dir).unwrap_err().to_string();
    assert!(e.contains("not a regular file"), "{e}");
    Ok(())
}

#[test]
fn errors_name_file_tensor_and_shapes() -> TestResult {
    let dir = tmpdir("errors");
    let a = Tensor::from_vec(vec![0.0; 6], [2, 3], Device::Cpu)?;
    save_safetensors(
        &dir.join("model.safetensors"),
        &[("layers.0.q_proj.weight".into(), &a)],
    )?;
    let w = WeightFiles::open_dir(&dir)?;
    let e = w
        .load("layers.0.q_proj.weight", &[3, 2], Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.safetensors")
            && e.contains("layers.0.q_proj.weight")
            && e.contains("[2, 3]")
            && e.contains("[3, 2]"),
        "{e}"
    );
    let e = w
        .load("layers.0.k_proj.weight", &[2, 3], Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layers.0.k_proj.weight") && e.contains("no such tensor"),
        "{e}"
    );
    let empty = tmpdir("empty");
    let e = WeightFiles::open_dir(&empty).unwrap_err().to_string();
    assert!(e.contains("no model.safetensors"), "{e}");
    std::fs::write(empty.join("model.safetensors"), b"not a safetensors file")?;
    let e = WeightFiles::open_dir(&empty).unwrap_err().to_string();
    assert!(e.contains("bad safetensors header"), "{e}");
    Ok(())
}

/// A NaN or an infinity in a stored float (f32, bf16, or an f64 beyond f32's range) is
/// refused on every read path, naming the file and the tensor; finite neighbours load.
#[test]
fn non_finite_values_are_refused_on_every_read() -> TestResult {
    use braid_nn::Shard;
    let dir = tmpdir("nonfinite");
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let bf16s = |v: &[f32]| {
        v.iter()
            .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    write_raw(
        &dir.join("model.safetensors"),
        &[
            ("ok", Dtype::F32, vec![2, 2], f32s(&[1.0, 2.0, 3.0, 4.0])),
            (
                "nan",
                Dtype::F32,
                vec![2, 2],
                f32s(&[1.0, 2.0, 3.0, f32::NAN]),
            ),
            (
                "inf",
                Dtype::BF16,
                vec![2, 2],
                bf16s(&[f32::NEG_INFINITY, 0.0, 0.0, 0.0]),
            ),
            ("big", Dtype::F64, vec![1], 1e300f64.to_le_bytes().to_vec()),
        ],
    );
    let w = WeightFiles::open_dir(&dir)?;
    assert_eq!(
        w.load("ok", &[2, 2], Device::Cpu)?.to_vec_f32()?,
        [1.0, 2.0, 3.0, 4.0]
    );
    let refused = |e: braid_nn::Error, name: &str, what: &str| {
        let e = e.to_string();
        assert!(
            e.contains("model.safetensors") && e.contains(name) && e.contains(what),
            "{e}"
        );
    };
    refused(
        w.load("nan", &[2, 2], Device::Cpu).unwrap_err(),
        "nan",
        "NaN",
    );
    refused(
        w.load("inf", &[2, 2], Device::Cpu).unwrap_err(),
        "inf",
        "-inf",
    );
    refused(w.load("big", &[1], Device::Cpu).unwrap_err(), "big", "inf");
    // The slice holding the NaN is refused; the other slice is clean and loads.
    let row = |rank| Shard::Split {
        dim: 0,
        rank,
        size: 2,
    };
    refused(
        w.load_shard("nan", &[2, 2], row(1), Device::Cpu)
            .unwrap_err(),
        "nan",
        "NaN",
    );
    assert_eq!(
        w.load_shard("nan", &[2, 2], row(0), Device::Cpu)?
            .to_vec_f32()?,
        [1.0, 2.0]
    );
    let mut out = Vec::new();
    refused(
        w.read_f32_into("nan", 2..4, &mut out).unwrap_err(),
        "nan",
        "NaN",
    );
    w.read_f32_into("nan", 0..3, &mut out)?;
    assert_eq!(out, [1.0, 2.0, 3.0]);
    Ok(())
}

/// `load_shard` reads exactly the slice `cut_shard` cuts from the full tensor, for every
/// dimension and group size of several shapes, in f32 and bf16 on disk; bad requests name
/// the tensor.
#[test]
fn load_shard_reads_the_slice_cut_shard_cuts() -> TestResult {
    use braid_nn::Shard;
    use braid_nn::param::cut_shard;
    let dir = tmpdir("load-shard");
    let shapes: [&[usize]; 4] = [&[12], &[8, 6], &[4, 6, 10], &[2, 4, 3, 4]];
    for (i, full) in shapes.iter().enumerate() {
        let n: usize = full.iter().product();
        // bf16-exact values, so both dtypes compare exactly.
        let data: Vec<f32> = (0..n).map(|x| (x as f32) * 0.5 - 7.0).collect();
        let f32_bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bf_bytes: Vec<u8> = data
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect();
        let path = dir.join(format!("s{i}.safetensors"));
        write_raw(
            &path,
            &[
                ("f", Dtype::F32, full.to_vec(), f32_bytes),
                ("b", Dtype::BF16, full.to_vec(), bf_bytes),
            ],
        );
        let w = WeightFiles::open_files(&[path])?;
        for dim in 0..full.len() {
            for size in [1, 2, 3, 4, 6] {
                if full[dim] % size != 0 {
                    continue;
                }
                for rank in 0..size {
                    let shard = Shard::Split { dim, rank, size };
                    let (want, dims) = cut_shard("w", data.clone(), full, shard)?;
                    for name in ["f", "b"] {
                        let got = w.load_shard(name, full, shard, Device::Cpu)?;
                        assert_eq!(got.dims(), &dims[..], "{name} {full:?} {shard:?}");
                        assert_eq!(got.to_vec_f32()?, want, "{name} {full:?} {shard:?}");
                    }
                }
            }
        }
        let whole = w.load_shard("f", full, Shard::Full, Device::Cpu)?;
        assert_eq!(whole.to_vec_f32()?, data);
    }
    let w = WeightFiles::open_files(&[dir.join("s1.safetensors")])?;
    let uneven = Shard::Split {
        dim: 1,
        rank: 0,
        size: 4,
    };
    let e = w
        .load_shard("f", &[8, 6], uneven, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`f`") || e.contains("f:") || e.contains(" f "),
        "{e}"
    );
    assert!(e.contains("slice 0 of 4"), "{e}");
    let even = Shard::Split {
        dim: 0,
        rank: 0,
        size: 2,
    };
    let e = w
        .load_shard("f", &[6, 8], even, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("[8, 6]") && e.contains("[6, 8]"), "{e}");
    Ok(())
}

/// Atomic writes go through a symlink (the link kept, its target replaced), refuse to
/// replace what is not a regular file (a folder here; a device the same way), and leave
/// no temporary file behind when the write fails.
#[test]
fn atomic_writes_follow_links_refuse_non_files_and_clean_up() -> TestResult {
    use braid_nn::hf::write_atomic;
    let d = tmpdir("atomic");
    let real = d.join("real.json");
    std::fs::write(&real, "old")?;
    let link = d.join("link.json");
    std::os::unix::fs::symlink("real.json", &link)?;
    write_json(&link, &serde_json::json!({"a": 1}))?;
    assert!(std::fs::symlink_metadata(&link)?.file_type().is_symlink());
    assert!(std::fs::read_to_string(&real)?.contains("\"a\": 1"));

    let folder = d.join("folder.json");
    std::fs::create_dir(&folder)?;
    let e = write_json(&folder, &1).unwrap_err().to_string();
    assert!(e.contains("not a regular file"), "{e}");
    assert!(folder.is_dir());

    let e = write_atomic(&d.join("fails.json"), |tmp| {
        std::fs::write(tmp, "partial").map_err(|e| braid_nn::Error::io(tmp, "write", e))?;
        Err(braid_nn::Error::io(
            tmp,
            "write",
            std::io::Error::other("disk full"),
        ))
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("disk full"), "{e}");
    let left: Vec<_> = std::fs::read_dir(&d)?
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(&d)?;
    Ok(())
}

/// `read_limited` refuses a device (`/dev/zero` would never end), a folder and a file past
/// its limit, naming why, and reads a file within it whole.
#[test]
fn read_limited_refuses_what_would_never_end_or_is_too_large() -> TestResult {
    let dir = tmpdir("limited");
    let small = dir.join("small.json");
    std::fs::write(&small, b"{\"a\": 1}")?;
    assert_eq!(braid_nn::files::read_limited(&small, 8)?, b"{\"a\": 1}");
    let e = braid_nn::files::read_limited(&small, 7)
        .unwrap_err()
        .to_string();
    assert!(e.contains("8 bytes, more than the 7"), "{e}");
    for p in [Path::new("/dev/zero"), dir.as_path()] {
        let e = braid_nn::files::read_limited(p, 1 << 20)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a regular file"), "{p:?}: {e}");
    }
    let e = read_json::<serde_json::Value>(Path::new("/dev/zero"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/dev/zero") && e.contains("not a regular file"),
        "{e}"
    );
    Ok(())
}
