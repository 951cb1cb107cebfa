//! The socket transport's wire format: a frame is a tensor's group key, dtype, shape and
//! little-endian data; a peer's frame is checked before anything is allocated for it.

use std::io::Read;

use braid_kernels::tensor::CpuStorage;
use half::bf16;

/// A tensor on the wire: its host data and shape, and the group it belongs to.
pub(super) struct Frame {
    pub group: u64,
    pub dims: Vec<usize>,
    pub data: CpuStorage,
}

/// The largest frame a peer may send (a tensor of 16 GiB): the CPU transport's messages
/// are activations and gradient buckets, far below it.
const MAX_FRAME_BYTES: u64 = 1 << 34;

const DT_F32: u8 = 0;
const DT_BF16: u8 = 1;
const DT_U32: u8 = 2;

pub(super) fn read_frame(r: &mut impl Read) -> std::io::Result<Frame> {
    let mut h = [0u8; 8 + 1 + 4];
    r.read_exact(&mut h)?;
    let group = u64::from_le_bytes(h[0..8].try_into().unwrap_or_default());
    let dtype = h[8];
    let rank = u32::from_le_bytes(h[9..13].try_into().unwrap_or_default()) as usize;
    if rank > 16 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a tensor of rank {rank}"),
        ));
    }
    let mut dims = Vec::with_capacity(rank);
    for _ in 0..rank {
        let mut d = [0u8; 8];
        r.read_exact(&mut d)?;
        dims.push(u64::from_le_bytes(d) as usize);
    }
    let bad = |msg: String| std::io::Error::new(std::io::ErrorKind::InvalidData, msg);
    let elem: u64 = match dtype {
        DT_BF16 => 2,
        DT_F32 | DT_U32 => 4,
        other => return Err(bad(format!("a frame of unknown dtype {other}"))),
    };
    // The sender's dimensions are checked before anything is allocated, and the payload is
    // read as it arrives: a malformed or hostile frame is an error naming its size, never
    // a wrapped length or an allocation the bytes on the wire do not back.
    let len = dims
        .iter()
        .try_fold(elem, |a, &d| a.checked_mul(d as u64))
        .filter(|&b| b <= MAX_FRAME_BYTES)
        .ok_or_else(|| {
            bad(format!(
                "a malformed frame: dims {dims:?} (at most {MAX_FRAME_BYTES} bytes)"
            ))
        })?;
    // Room for up to 64 MiB at once (no regrowth for an ordinary frame); past that it grows
    // only as the bytes arrive.
    let mut bytes = Vec::with_capacity(len.min(64 << 20) as usize);
    r.take(len).read_to_end(&mut bytes)?;
    if bytes.len() as u64 != len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the connection closed inside a frame",
        ));
    }
    // `dtype` is one of the three (checked with the size above).
    let data = match dtype {
        DT_U32 => CpuStorage::U32(
            bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        DT_BF16 => CpuStorage::BF16(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
        ),
        _ => CpuStorage::F32(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
    };
    Ok(Frame { group, dims, data })
}

pub(super) fn encode_frame(group: u64, dims: &[usize], data: &CpuStorage) -> Vec<u8> {
    let (dt, n) = match data {
        CpuStorage::F32(v) => (DT_F32, v.len() * 4),
        CpuStorage::BF16(v) => (DT_BF16, v.len() * 2),
        CpuStorage::U32(v) => (DT_U32, v.len() * 4),
    };
    let mut out = Vec::with_capacity(13 + 8 * dims.len() + n);
    out.extend_from_slice(&group.to_le_bytes());
    out.push(dt);
    out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
    for &d in dims {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    match data {
        CpuStorage::F32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        CpuStorage::U32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        CpuStorage::BF16(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes())),
    }
    out
}
