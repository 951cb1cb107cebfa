//! `Rope` built from precomputed inverse frequencies: the attention factor scales the
//! tables, dynamic NTK switches frequencies past the pretraining length, and bad
//! inputs are configuration errors.

#![allow(clippy::unwrap_used)]

use braid_kernels::Device;
use braid_nn::{DynamicNtk, Error, Rope, RopeConfig};

#[test]
fn from_inv_freq_matches_new_and_scales_tables() {
    let plain = Rope::new(RopeConfig {
        theta: 10_000.0,
        rot_dim: 8,
    })
    .unwrap();
    let same = Rope::from_inv_freq(plain.inv_freq.clone(), 1.0).unwrap();
    assert_eq!(same, plain);
    let pos = [0u32, 3, 7];
    let (c1, s1) = plain.tables(&pos, Device::Cpu).unwrap();
    let scaled = Rope::from_inv_freq(plain.inv_freq.clone(), 1.5).unwrap();
    let (c2, s2) = scaled.tables(&pos, Device::Cpu).unwrap();
    let (c1, s1, c2, s2) = (
        c1.to_vec_f32().unwrap(),
        s1.to_vec_f32().unwrap(),
        c2.to_vec_f32().unwrap(),
        s2.to_vec_f32().unwrap(),
    );
    for i in 0..c1.len() {
        assert_eq!(c2[i], c1[i] * 1.5);
        assert_eq!(s2[i], s1[i] * 1.5);
    }
}

#[test]
fn dynamic_ntk_changes_frequencies_only_past_max_positions() {
    let base = Rope::new(RopeConfig {
        theta: 10_000.0,
        rot_dim: 8,
    })
    .unwrap();
    let ntk = DynamicNtk {
        theta: 10_000.0,
        factor: 2.0,
        max_positions: 16,
    };
    let rope = base.clone().with_dynamic_ntk(ntk);
    assert_eq!(*rope.inv_freq_for(16), base.inv_freq[..]);
    let long = rope.inv_freq_for(40);
    assert_eq!(long[0], 1.0);
    // A larger base: every other frequency is lower.
    assert!(
        long[1..]
            .iter()
            .zip(&base.inv_freq[1..])
            .all(|(l, b)| l < b)
    );
    // Tables follow the batch's largest position.
    let short: Vec<u32> = (0..16).collect();
    let (c_short, _) = rope.tables(&short, Device::Cpu).unwrap();
    let (c_base, _) = base.tables(&short, Device::Cpu).unwrap();
    assert_eq!(c_short.to_vec_f32().unwrap(), c_base.to_vec_f32().unwrap());
    let longpos: Vec<u32> = (0..40).collect();
    let (c_long, _) = rope.tables(&longpos, Device::Cpu).unwrap();
    let (c_base, _) = base.tables(&longpos, Device::Cpu).unwrap();
    assert_ne!(c_long.to_vec_f32().unwrap(), c_base.to_vec_f32().unwrap());
}

#[test]
fn bad_precomputed_frequencies_are_config_errors() {
    assert!(matches!(
        Rope::from_inv_freq(vec![], 1.0),
        Err(Error::Config { .. })
    ));
    assert!(matches!(
        Rope::from_inv_freq(vec![1.0, f32::NAN], 1.0),
        Err(Error::Config { .. })
    ));
    assert!(matches!(
        Rope::from_inv_freq(vec![1.0], 0.0),
        Err(Error::Config { .. })
    ));
}

/// The tables are cached (one computation per batch for every layer sharing the rope):
/// whatever the order of requests, each answer equals the tables made afresh.
#[test]
fn cached_tables_equal_fresh_ones_for_every_request() {
    let make = || {
        Rope::new(RopeConfig {
            theta: 10_000.0,
            rot_dim: 8,
        })
        .unwrap()
    };
    let shared = make();
    let layer2 = shared.clone(); // as the blocks of a stage hold it
    let fresh = |pos: &[u32], len: usize| {
        let (c, s) = make().tables_for_len(pos, len, Device::Cpu).unwrap();
        (c.to_vec_f32().unwrap(), s.to_vec_f32().unwrap())
    };
    let a = [0u32, 1, 2, 3, 0, 1];
    let b = [5u32, 6, 7];
    for (rope, pos, len) in [
        (&shared, &a[..], 4),
        (&layer2, &a[..], 4), // the cached tables
        (&layer2, &b[..], 8),
        (&shared, &a[..], 4),
        (&shared, &a[..], 9), // same positions, another batch length
        (&layer2, &a[..5], 4),
    ] {
        let (c, s) = rope.tables_for_len(pos, len, Device::Cpu).unwrap();
        let want = fresh(pos, len);
        assert_eq!(
            (c.to_vec_f32().unwrap(), s.to_vec_f32().unwrap()),
            want,
            "{pos:?} {len}"
        );
        assert_eq!(c.dims(), [pos.len(), 4]);
    }
    // A rope with dynamic NTK does not reuse tables made without it.
    let ntk = DynamicNtk {
        factor: 4.0,
        max_positions: 2,
        theta: 10_000.0,
    };
    let (c0, _) = shared.tables_for_len(&b, 8, Device::Cpu).unwrap();
    let scaled = shared.clone().with_dynamic_ntk(ntk);
    let (c1, _) = scaled.tables_for_len(&b, 8, Device::Cpu).unwrap();
    assert_ne!(c0.to_vec_f32().unwrap(), c1.to_vec_f32().unwrap());
}
