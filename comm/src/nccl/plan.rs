//! The pure logic of `NcclComm`, testable without NCCL: store keys of communicator ids,
//! the tensor header sent before every point-to-point payload, the shape checks of the
//! collectives.

use braid_kernels::DType;

/// FNV-1a of a member list (world ranks): part of every store key of a group.
pub(crate) fn members_hash(members: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &m in members {
        for b in (m as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The store key under which member 0 of a group publishes the NCCL unique id of the
/// group's communicator. `generation` counts the earlier groups of the same members made
/// by this process (every member makes its groups in one program order, so the counts
/// agree); the key is readable (size, first and last rank) and unique (the hash).
pub(crate) fn group_key(members: &[usize], generation: usize) -> String {
    let first = members.first().copied().unwrap_or(0);
    let last = members.last().copied().unwrap_or(0);
    format!(
        "nccl/group/{}r-{first}-{last}/{:016x}/{generation}",
        members.len(),
        members_hash(members)
    )
}

/// The store key of the directed channel `src -> dst` (world ranks) of the group
/// `group_members`: a two-rank communicator that carries only `src`'s sends to `dst`,
/// so a channel is a FIFO and sends in opposite directions never wait for each other.
pub(crate) fn channel_key(group_members: &[usize], src: usize, dst: usize) -> String {
    format!(
        "nccl/p2p/{:016x}/{src}-to-{dst}",
        members_hash(group_members)
    )
}

/// Most dimensions a tensor header carries.
pub(crate) const MAX_DIMS: usize = 8;
/// Words (u32) of a header: magic, dtype, rank, then each dimension as (low, high).
pub(crate) const HEADER_WORDS: usize = 3 + 2 * MAX_DIMS;
const MAGIC: u32 = 0xb7a1_d001;

fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::U32 => 2,
    }
}

/// The header of a tensor of `dtype` and `dims`: what the receiver needs to allocate
/// the payload (NCCL's receives must match the send's count and type exactly).
pub(crate) fn encode_header(dtype: DType, dims: &[usize]) -> Result<[u32; HEADER_WORDS], String> {
    if dims.len() > MAX_DIMS {
        return Err(format!(
            "a tensor of {} dimensions (at most {MAX_DIMS} travel point to point)",
            dims.len()
        ));
    }
    let mut h = [0u32; HEADER_WORDS];
    h[0] = MAGIC;
    h[1] = dtype_code(dtype);
    h[2] = dims.len() as u32;
    for (i, &d) in dims.iter().enumerate() {
        let d = d as u64;
        h[3 + 2 * i] = d as u32;
        h[4 + 2 * i] = (d >> 32) as u32;
    }
    Ok(h)
}

/// The dtype and dims of a received header.
pub(crate) fn decode_header(h: &[u32]) -> Result<(DType, Vec<usize>), String> {
    if h.len() != HEADER_WORDS || h[0] != MAGIC {
        return Err(format!(
            "a malformed tensor header ({} words, magic {:#x}): the ranks disagree on the order of sends and receives",
            h.len(),
            h.first().copied().unwrap_or(0)
        ));
    }
    let dtype = match h[1] {
        0 => DType::F32,
        1 => DType::BF16,
        2 => DType::U32,
        other => return Err(format!("a tensor header with dtype code {other}")),
    };
    let rank = h[2] as usize;
    if rank > MAX_DIMS {
        return Err(format!("a tensor header of {rank} dimensions"));
    }
    let dims = (0..rank)
        .map(|i| (u64::from(h[3 + 2 * i]) | (u64::from(h[4 + 2 * i]) << 32)) as usize)
        .collect();
    Ok((dtype, dims))
}

/// The element count of each rank's slice in a reduce-scatter of `dims` over `n` ranks,
/// or why it does not split.
pub(crate) fn scatter_count(dims: &[usize], n: usize) -> Result<usize, String> {
    match dims.first() {
        Some(&d0) if n > 0 && d0 % n == 0 => Ok(dims.iter().product::<usize>() / n),
        _ => Err(format!(
            "dim 0 of {dims:?} does not split into {n} equal slices"
        )),
    }
}

/// The dims of an all-gather of `dims` over `n` ranks (dim 0 times `n`).
pub(crate) fn gathered_dims(dims: &[usize], n: usize) -> Result<Vec<usize>, String> {
    let mut out = dims.to_vec();
    match out.first_mut() {
        Some(d0) => *d0 *= n,
        None => return Err("cannot gather a scalar along dim 0".into()),
    }
    Ok(out)
}

/// The peers this rank exchanges with in an all-to-all of `n` ranks, in the order the
/// sends and receives are posted inside one NCCL group (every peer but itself, by rank;
/// within a group the order does not decide matching, only each pair's FIFO does).
pub(crate) fn exchange_peers(rank: usize, n: usize) -> Vec<usize> {
    (0..n).filter(|&p| p != rank).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_keys_depend_on_members_and_generation() {
        let a = group_key(&[0, 2, 4], 0);
        assert_eq!(a, group_key(&[0, 2, 4], 0));
        assert_ne!(a, group_key(&[0, 2, 4], 1));
        assert_ne!(a, group_key(&[0, 4, 2], 0));
        assert_ne!(a, group_key(&[0, 2, 5], 0));
        assert!(a.starts_with("nccl/group/3r-0-4/"), "{a}");
    }

    #[test]
    fn channel_keys_are_directed() {
        let g = [0, 1, 2, 3];
        assert_ne!(channel_key(&g, 1, 2), channel_key(&g, 2, 1));
        assert_ne!(channel_key(&g, 1, 2), channel_key(&[1, 2], 1, 2));
        assert_eq!(channel_key(&g, 1, 2), channel_key(&g, 1, 2));
    }

    #[test]
    fn headers_round_trip() {
        for (dt, dims) in [
            (DType::F32, vec![3, 4]),
            (DType::BF16, vec![]),
            (DType::U32, vec![5_000_000_000, 1, 2, 3, 4, 5, 6, 7]),
        ] {
            let h = encode_header(dt, &dims).unwrap();
            assert_eq!(decode_header(&h).unwrap(), (dt, dims));
        }
        assert!(encode_header(DType::F32, &[1; 9]).is_err());
        let mut bad = encode_header(DType::F32, &[2]).unwrap();
        bad[0] = 0;
        assert!(decode_header(&bad).unwrap_err().contains("malformed"));
        bad = encode_header(DType::F32, &[2]).unwrap();
        bad[1] = 7;
        assert!(decode_header(&bad).is_err());
    }

    #[test]
    fn shapes_of_the_collectives() {
        assert_eq!(scatter_count(&[6, 5], 3), Ok(10));
        assert!(scatter_count(&[5, 5], 3).is_err());
        assert!(scatter_count(&[], 3).is_err());
        assert_eq!(gathered_dims(&[2, 7], 4), Ok(vec![8, 7]));
        assert!(gathered_dims(&[], 4).is_err());
        assert_eq!(exchange_peers(1, 4), vec![0, 2, 3]);
        assert_eq!(exchange_peers(0, 1), Vec::<usize>::new());
    }
}
