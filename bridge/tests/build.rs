//! `routes_for` on random encoder and LLM layouts (TP/CP/DP on either side, colocated or disjoint, uneven DP, frozen encoders): the table it builds, and forward/backward through it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use braid_bridge::{ItemPlacement, routes_for};
use common::*;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A module's ranks as plain numbers: (tp, cp, dp, pp) axes, TP fastest, after `offset`.
#[derive(Clone, Copy, Debug)]
struct Layout {
    tp: usize,
    cp: usize,
    dp: usize,
    pp: usize,
    offset: usize,
}

impl Layout {
    fn size(&self) -> usize {
        self.tp * self.cp * self.dp * self.pp
    }
    fn rank(&self, tp: usize, cp: usize, dp: usize, pp: usize) -> usize {
        self.offset + tp + self.tp * (cp + self.cp * (dp + self.dp * pp))
    }
    fn random(rng: &mut ChaCha8Rng, max: usize, cp_ok: bool) -> Layout {
        loop {
            let l = Layout {
                tp: rng.random_range(1..=3),
                cp: if cp_ok { rng.random_range(1..=3) } else { 1 },
                dp: rng.random_range(1..=3),
                pp: rng.random_range(1..=2),
                offset: 0,
            };
            if l.size() <= max {
                return l;
            }
        }
    }
}

/// A random step: an encoder and an LLM layout, colocated (both from rank 0) or
/// disjoint, and items placed on random encoder and LLM replicas.
fn random_step(rng: &mut ChaCha8Rng) -> (Vec<ItemPlacement>, usize, Layout, Layout) {
    let world = rng.random_range(1..=8);
    let colocated = world == 1 || rng.random_bool(0.5);
    let mut enc = Layout::random(rng, if colocated { world } else { world / 2 }, false);
    let mut llm = Layout::random(
        rng,
        if colocated { world } else { world - enc.size() },
        true,
    );
    if !colocated {
        llm.offset = enc.size();
        if rng.random_bool(0.5) {
            // LLM first, encoder after it.
            (enc.offset, llm.offset) = (llm.size(), 0);
        }
    }
    let frozen = [rng.random_bool(0.3), rng.random_bool(0.3)]; // vision, audio
    let items = (0..rng.random_range(0..=8))
        .map(|_| {
            let rows = rng.random_range(0..=9);
            let e = rng.random_range(0..enc.dp);
            let j = rng.random_range(0..llm.dp);
            // Either a block split (a contiguous image over shards) or scattered rows.
            let mut row_cp: Vec<usize> = (0..rows).map(|_| rng.random_range(0..llm.cp)).collect();
            if rng.random_bool(0.5) {
                row_cp.sort_unstable();
            }
            ItemPlacement {
                encoder_ranks: (0..enc.tp).map(|t| enc.rank(t, 0, e, enc.pp - 1)).collect(),
                frozen: frozen[rng.random_range(0..2)],
                row_cp,
                llm_ranks: (0..llm.cp)
                    .map(|k| (0..llm.tp).map(|t| llm.rank(t, k, j, 0)).collect())
                    .collect(),
            }
        })
        .collect();
    (items, world, enc, llm)
}

#[test]
fn routes_for_random_layouts() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x1a70);
    for case in 0..200 {
        let (items, world, _enc, llm) = random_step(&mut rng);
        let width = rng.random_range(1..=4);
        let routes = routes_for(&items, width, world).unwrap();

        // The table says what the placement means.
        for (i, (p, it)) in items.iter().zip(routes.items()).enumerate() {
            assert_eq!(it.rows, p.row_cp.len(), "case {case} item {i}");
            assert_eq!(it.src, p.encoder_ranks[0], "case {case} item {i}");
            let want_grad_to = if p.frozen {
                vec![]
            } else {
                p.encoder_ranks.clone()
            };
            assert_eq!(it.grad_to, want_grad_to, "case {case} item {i}");
            for (k, tp_ranks) in p.llm_ranks.iter().enumerate() {
                let rows: Vec<u32> = (0..it.rows as u32)
                    .filter(|&r| p.row_cp[r as usize] == k)
                    .collect();
                for (t, &rank) in tp_ranks.iter().enumerate() {
                    let d = it.dst.iter().find(|d| d.rank == rank);
                    if rows.is_empty() {
                        assert!(
                            d.is_none(),
                            "case {case} item {i}: empty shard {k} gets a dest"
                        );
                        continue;
                    }
                    let d = d.unwrap();
                    assert_eq!(d.rows, rows, "case {case} item {i} shard {k} tp {t}");
                    assert_eq!(
                        d.grad,
                        t == 0 && !p.frozen,
                        "case {case} item {i} shard {k} tp {t}"
                    );
                }
            }
            assert_eq!(
                it.dst.len(),
                llm.tp * (0..llm.cp).filter(|&k| p.row_cp.contains(&k)).count()
            );
        }

        // And forward/backward through it match the reference.
        let emb = random_embeddings(&mut rng, &routes);
        let grads = random_grads(&mut rng, &routes);
        check_case(case, &routes, &emb, &grads);
    }
}

/// The transpose in layout terms: with disjoint CP shards each row has one grad copy,
/// so an encoder rank gets back exactly the grad that shard's first TP rank holds.
#[test]
fn grads_come_from_each_rows_shard() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for case in 0..50 {
        let (items, world, ..) = random_step(&mut rng);
        let routes = routes_for(&items, 3, world).unwrap();
        let emb = random_embeddings(&mut rng, &routes);
        let grads = random_grads(&mut rng, &routes);
        let results = run_bridge(&routes, &emb, &grads);
        for (i, p) in items.iter().enumerate().filter(|(_, p)| !p.frozen) {
            for &g in &p.encoder_ranks {
                let (_, _, got) = results[g].2.iter().find(|(j, ..)| *j == i).unwrap();
                for (r, &k) in p.row_cp.iter().enumerate() {
                    let owner = p.llm_ranks[k][0];
                    let m = routes
                        .received(owner)
                        .iter()
                        .position(|&x| x == (i, r as u32))
                        .unwrap();
                    assert_eq!(
                        got[r * 3..r * 3 + 3],
                        grads[owner][m * 3..m * 3 + 3],
                        "case {case} item {i} row {r}"
                    );
                }
            }
        }
    }
}

#[test]
fn routes_for_rejects_bad_placements() {
    let ok = ItemPlacement {
        encoder_ranks: vec![0, 1],
        frozen: false,
        row_cp: vec![0, 1, 1],
        llm_ranks: vec![vec![2, 3], vec![4, 5]],
    };
    assert!(routes_for(std::slice::from_ref(&ok), 8, 6).is_ok());
    let cases: Vec<(ItemPlacement, usize, &str)> = vec![
        (
            ItemPlacement {
                encoder_ranks: vec![],
                ..ok.clone()
            },
            6,
            "encoder_ranks is empty",
        ),
        (
            ItemPlacement {
                llm_ranks: vec![vec![2], vec![]],
                ..ok.clone()
            },
            6,
            "llm_ranks[1] (CP shard 1) lists no TP ranks",
        ),
        (
            ItemPlacement {
                row_cp: vec![0, 2],
                ..ok.clone()
            },
            6,
            "row 1 is placed on CP shard 2 but llm_ranks has 2 shards",
        ),
        (
            ItemPlacement {
                llm_ranks: vec![vec![2, 9], vec![4]],
                ..ok.clone()
            },
            6,
            "dest rank 9 is outside the world of 6 ranks",
        ),
        (
            ItemPlacement {
                llm_ranks: vec![vec![2, 3], vec![3]],
                ..ok.clone()
            },
            6,
            "rank 3 appears in two dests",
        ),
    ];
    for (p, world, want) in cases {
        let mut items = vec![ok.clone(); 2];
        items.push(p);
        let e = routes_for(&items, 8, world).unwrap_err().to_string();
        assert!(
            e.contains("item 2") && e.contains(want),
            "{e:?} should say item 2: {want}"
        );
    }
    // Shuffled TP lists keep their first rank as the grad copy.
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut tp = vec![2, 3, 4];
    tp.shuffle(&mut rng);
    let p = ItemPlacement {
        encoder_ranks: vec![0],
        frozen: false,
        row_cp: vec![0],
        llm_ranks: vec![tp.clone()],
    };
    let routes = routes_for(&[p], 4, 5).unwrap();
    let grad: Vec<usize> = routes.items()[0]
        .dst
        .iter()
        .filter(|d| d.grad)
        .map(|d| d.rank)
        .collect();
    assert_eq!(grad, vec![tp[0]]);
}
