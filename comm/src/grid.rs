//! `Grid`: one module's ranks laid out as named axes `tp, cp, dp, pp` (TP fastest, then
//! CP, DP, PP: Megatron's order, so a TP group is consecutive ranks, i.e. one node) at
//! a rank offset in the world.
//!
//! Local index `l = tp + TP * (cp + CP * (dp + DP * pp))`; world rank `offset + l`. A
//! grid with its stages reversed ([`Grid::with_stages_reversed`]) puts stage `pp` at
//! the slice `PP - 1 - pp` instead: where modules share GPUs, which of another module's
//! stages a stage sits beside.
//! A module's groups are the sets of its ranks that differ along some axes only:
//! [`Grid::group`] with `[Axis::Tp]` is a TP group, `[Axis::Cp, Axis::Dp]` the ranks
//! that hold the same parameter shard (the gradient all-reduce group), and so on.

use std::fmt;
use std::ops::Range;

use crate::{CommError, Result};

/// The sizes of a grid's axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GridDims {
    pub tp: usize,
    pub cp: usize,
    pub dp: usize,
    pub pp: usize,
}

impl GridDims {
    /// No parallelism: one rank.
    pub const ONE: GridDims = GridDims {
        tp: 1,
        cp: 1,
        dp: 1,
        pp: 1,
    };

    /// `tp * cp * dp * pp`, saturating (a hostile config's huge axes must not overflow
    /// before the world-size check rejects them).
    pub fn size(&self) -> usize {
        [self.cp, self.dp, self.pp]
            .iter()
            .fold(self.tp, |n, &k| n.saturating_mul(k))
    }
}

impl fmt::Display for GridDims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tp={} cp={} dp={} pp={}",
            self.tp, self.cp, self.dp, self.pp
        )
    }
}

/// One axis of a grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    Tp,
    Cp,
    Dp,
    Pp,
}

/// A rank's position in a grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Coord {
    pub tp: usize,
    pub cp: usize,
    pub dp: usize,
    pub pp: usize,
}

impl Coord {
    fn get(&self, a: Axis) -> usize {
        match a {
            Axis::Tp => self.tp,
            Axis::Cp => self.cp,
            Axis::Dp => self.dp,
            Axis::Pp => self.pp,
        }
    }

    fn set(&mut self, a: Axis, v: usize) {
        match a {
            Axis::Tp => self.tp = v,
            Axis::Cp => self.cp = v,
            Axis::Dp => self.dp = v,
            Axis::Pp => self.pp = v,
        }
    }
}

/// A module's ranks: `dims.size()` consecutive world ranks from `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Grid {
    pub dims: GridDims,
    pub offset: usize,
    /// Stage `pp` holds the ranks of PP slice `PP - 1 - pp` (the last slice of ranks runs
    /// the first stage).
    pub stages_reversed: bool,
}

impl Grid {
    /// A grid of `dims` at world rank `offset`; every axis must be at least 1.
    pub fn new(dims: GridDims, offset: usize) -> Result<Grid> {
        if dims.tp == 0 || dims.cp == 0 || dims.dp == 0 || dims.pp == 0 {
            return Err(CommError::Invalid {
                op: "Grid::new",
                rank: offset,
                size: dims.size(),
                msg: format!("every axis must be at least 1, got {dims}"),
            });
        }
        Ok(Grid {
            dims,
            offset,
            stages_reversed: false,
        })
    }

    /// This grid with its pipeline stages on its PP slices of ranks in reverse order.
    pub fn with_stages_reversed(self, reversed: bool) -> Grid {
        Grid {
            stages_reversed: reversed,
            ..self
        }
    }

    /// Stage `pp`'s PP slice of ranks (its own inverse).
    fn slice(&self, pp: usize) -> usize {
        if self.stages_reversed {
            self.dims.pp - 1 - pp
        } else {
            pp
        }
    }

    pub fn size(&self) -> usize {
        self.dims.size()
    }

    /// The world ranks of this grid.
    pub fn ranks(&self) -> Range<usize> {
        self.offset..self.offset + self.size()
    }

    pub fn contains(&self, world_rank: usize) -> bool {
        self.ranks().contains(&world_rank)
    }

    fn dim(&self, a: Axis) -> usize {
        match a {
            Axis::Tp => self.dims.tp,
            Axis::Cp => self.dims.cp,
            Axis::Dp => self.dims.dp,
            Axis::Pp => self.dims.pp,
        }
    }

    /// Where `world_rank` sits in the grid; `None` when it is not one of its ranks.
    pub fn coord(&self, world_rank: usize) -> Option<Coord> {
        if !self.contains(world_rank) {
            return None;
        }
        let GridDims { tp, cp, dp, .. } = self.dims;
        let l = world_rank - self.offset;
        Some(Coord {
            tp: l % tp,
            cp: (l / tp) % cp,
            dp: (l / (tp * cp)) % dp,
            pp: self.slice(l / (tp * cp * dp)),
        })
    }

    /// The world rank at `c` (each coordinate must be below its axis' size).
    pub fn rank(&self, c: Coord) -> usize {
        let GridDims { tp, cp, dp, .. } = self.dims;
        self.offset + c.tp + tp * (c.cp + cp * (c.dp + dp * self.slice(c.pp)))
    }

    /// The world ranks that share `world_rank`'s coordinates except along `axes`, in
    /// local-index order (the first listed axis varies fastest only if it is the
    /// faster axis of the grid). `None` when `world_rank` is not in the grid.
    pub fn group(&self, world_rank: usize, axes: &[Axis]) -> Option<Vec<usize>> {
        let base = self.coord(world_rank)?;
        let mut ranks = vec![self.rank(base)];
        for a in [Axis::Tp, Axis::Cp, Axis::Dp, Axis::Pp] {
            if !axes.contains(&a) {
                continue;
            }
            ranks = ranks
                .iter()
                .flat_map(|&r| {
                    let c = self.coord(r).unwrap_or(base);
                    (0..self.dim(a)).map(move |v| {
                        let mut c = c;
                        c.set(a, v);
                        c
                    })
                })
                .map(|c| self.rank(c))
                .collect();
        }
        // Axis by axis, the slower axis was expanded last: sort by local index.
        ranks.sort_unstable();
        Some(ranks)
    }

    /// The rank one pipeline stage away (`delta` = +1 next, -1 previous) from
    /// `world_rank`, same other coordinates; `None` past either end.
    pub fn pp_neighbor(&self, world_rank: usize, delta: isize) -> Option<usize> {
        let mut c = self.coord(world_rank)?;
        let pp = c.get(Axis::Pp).checked_add_signed(delta)?;
        if pp >= self.dims.pp {
            return None;
        }
        c.set(Axis::Pp, pp);
        Some(self.rank(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid(tp: usize, cp: usize, dp: usize, pp: usize, offset: usize) -> Grid {
        Grid::new(GridDims { tp, cp, dp, pp }, offset).unwrap()
    }

    #[test]
    fn coordinates_round_trip_tp_fastest() {
        let g = grid(2, 3, 2, 2, 5);
        assert_eq!(g.ranks(), 5..29);
        for r in g.ranks() {
            assert_eq!(g.rank(g.coord(r).unwrap()), r);
        }
        assert_eq!(
            g.coord(6),
            Some(Coord {
                tp: 1,
                cp: 0,
                dp: 0,
                pp: 0
            })
        );
        assert_eq!(g.coord(5 + 2 * 3 * 2).unwrap().pp, 1);
        assert_eq!(g.coord(4), None);
        assert_eq!(g.coord(29), None);
    }

    #[test]
    fn groups_vary_only_their_axes() {
        let g = grid(2, 2, 2, 2, 0);
        assert_eq!(g.group(5, &[Axis::Tp]).unwrap(), vec![4, 5]);
        assert_eq!(g.group(5, &[Axis::Cp]).unwrap(), vec![5, 7]);
        assert_eq!(g.group(5, &[Axis::Cp, Axis::Dp]).unwrap(), vec![1, 3, 5, 7]);
        assert_eq!(g.group(5, &[Axis::Pp]).unwrap(), vec![5, 13]);
        assert_eq!(g.group(5, &[]).unwrap(), vec![5]);
        assert_eq!(g.group(16, &[Axis::Tp]), None);
        // Every rank is in exactly one group along any set of axes.
        let mut seen = [0usize; 16];
        for r in 0..16 {
            if g.group(r, &[Axis::Dp, Axis::Pp]).unwrap()[0] == r {
                for m in g.group(r, &[Axis::Dp, Axis::Pp]).unwrap() {
                    seen[m] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&s| s == 1));
    }

    #[test]
    fn pipeline_neighbors_stop_at_the_ends() {
        let g = grid(2, 1, 1, 3, 4);
        assert_eq!(g.pp_neighbor(5, 1), Some(7));
        assert_eq!(g.pp_neighbor(7, -1), Some(5));
        assert_eq!(g.pp_neighbor(5, -1), None);
        assert_eq!(g.pp_neighbor(9, 1), None);
    }

    #[test]
    fn reversed_stages_put_stage_zero_on_the_last_slice() {
        for (tp, cp, dp, pp, offset) in [(2, 1, 2, 3, 4), (1, 2, 1, 4, 0), (1, 1, 1, 1, 3)] {
            let plain = grid(tp, cp, dp, pp, offset);
            let g = plain.with_stages_reversed(true);
            let slice = tp * cp * dp;
            assert_eq!(g.ranks(), plain.ranks());
            for r in g.ranks() {
                let c = g.coord(r).unwrap();
                assert_eq!(g.rank(c), r);
                assert_eq!(c.pp, pp - 1 - (r - offset) / slice);
                // Everything but the stage is where it was.
                let p = plain.coord(r).unwrap();
                assert_eq!((c.tp, c.cp, c.dp), (p.tp, p.cp, p.dp));
                // Groups within a stage are the plain grid's; the stage's neighbours
                // are one slice the other way.
                assert_eq!(
                    g.group(r, &[Axis::Cp, Axis::Dp]),
                    plain.group(r, &[Axis::Cp, Axis::Dp])
                );
                if c.pp + 1 < pp {
                    assert_eq!(g.pp_neighbor(r, 1), Some(r - slice));
                } else {
                    assert_eq!(g.pp_neighbor(r, 1), None);
                }
            }
        }
        assert_eq!(
            grid(1, 1, 1, 3, 0).with_stages_reversed(false),
            grid(1, 1, 1, 3, 0)
        );
    }

    #[test]
    fn zero_axes_are_refused() {
        let e = Grid::new(
            GridDims {
                tp: 2,
                cp: 0,
                dp: 1,
                pp: 1,
            },
            0,
        )
        .unwrap_err();
        assert!(e.to_string().contains("at least 1"), "{e}");
    }
}
