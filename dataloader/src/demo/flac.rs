//! A minimal FLAC encoder for 16-bit mono PCM, so the demo dataset has real FLAC files without an
//! encoder dependency (flacenc 0.5 with default features off adds ~29 s of 2-core build for
//! itself and 12 crates the workspace does not otherwise use).
//!
//! What it writes: the `fLaC` marker, one STREAMINFO block (MD5 left as zeros, which the format
//! defines as "not computed"), then fixed-size frames of 4096 samples. Each frame holds one
//! FIXED subframe (polynomial predictor of order 0-4, the order with the smallest absolute
//! residual sum) whose residual is Rice coded in a single partition with the cheapest parameter;
//! a block shorter than 16 samples (only ever the last) is written VERBATIM. That is libFLAC's
//! `-0` tool set minus stereo decorrelation: lossless, ~2x smaller than WAV on tones, and every
//! conforming decoder reads it. Layout and CRCs per RFC 9639.

/// Samples per frame (the last frame may be shorter).
const BLOCK: usize = 4096;
/// Largest Rice parameter of residual coding method 0 (15 is the escape code).
const MAX_RICE: u32 = 14;

/// MSB-first bit writer.
struct Bits {
    out: Vec<u8>,
    acc: u64,
    /// Bits in `acc` not yet flushed to `out` (< 8 between calls).
    n: u32,
}

impl Bits {
    fn new() -> Self {
        Bits {
            out: Vec::new(),
            acc: 0,
            n: 0,
        }
    }

    /// Appends the low `bits` bits of `v` (`bits <= 32`).
    fn put(&mut self, v: u64, bits: u32) {
        debug_assert!(bits <= 32);
        if bits == 0 {
            return;
        }
        // Bits above the 8 + 32 we keep are shifted out: only the low `n` bits of `acc` are live.
        self.acc = (self.acc << bits) | (v & ((1u64 << bits) - 1));
        self.n += bits;
        while self.n >= 8 {
            self.n -= 8;
            self.out.push((self.acc >> self.n) as u8);
        }
    }

    /// `q` zero bits then a one (FLAC's unary code).
    fn unary(&mut self, mut q: u32) {
        while q >= 32 {
            self.put(0, 32);
            q -= 32;
        }
        self.put(1, q + 1);
    }

    /// Zero-pads to a byte boundary.
    fn align(&mut self) {
        if self.n > 0 {
            self.put(0, 8 - self.n);
        }
    }
}

/// CRC-8, polynomial x^8 + x^2 + x + 1, init 0 (frame headers).
fn crc8(bytes: &[u8]) -> u8 {
    let mut crc = 0u8;
    for &b in bytes {
        crc ^= b;
        for _ in 0..8 {
            crc = if crc & 0x80 != 0 {
                (crc << 1) ^ 0x07
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// CRC-16, polynomial x^16 + x^15 + x^2 + 1, init 0 (whole frames).
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc = 0u16;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x8005
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The frame number in FLAC's extended UTF-8 coding (up to 36 bits).
fn put_utf8(bits: &mut Bits, v: u64) {
    if v < 0x80 {
        bits.put(v, 8);
        return;
    }
    // Continuation bytes carry 6 bits each; the lead byte has (7 - len) payload bits.
    let mut len = 2u32;
    while len < 7 && v >= 1u64 << (5 * len + 1) {
        len += 1;
    }
    let lead_mask = (0xFF00u64 >> len) & 0xFF;
    bits.put(lead_mask | (v >> (6 * (len - 1))), 8);
    for i in (0..len - 1).rev() {
        bits.put(0x80 | ((v >> (6 * i)) & 0x3F), 8);
    }
}

/// Residual of the order-`order` fixed predictor for `x[order..]`.
fn fixed_residual(x: &[i32], order: usize) -> impl Iterator<Item = i32> + '_ {
    (order..x.len()).map(move |i| match order {
        0 => x[i],
        1 => x[i] - x[i - 1],
        2 => x[i] - 2 * x[i - 1] + x[i - 2],
        3 => x[i] - 3 * x[i - 1] + 3 * x[i - 2] - x[i - 3],
        _ => x[i] - 4 * x[i - 1] + 6 * x[i - 2] - 4 * x[i - 3] + x[i - 4],
    })
}

/// Zigzag: 0, -1, 1, -2, ... -> 0, 1, 2, 3, ...
fn zigzag(r: i32) -> u32 {
    ((r << 1) ^ (r >> 31)) as u32
}

/// One frame (header, subframe, padding, CRC-16) of `x` (16-bit samples widened to i32).
fn write_frame(out: &mut Vec<u8>, x: &[i32], frame_number: u64) {
    let mut b = Bits::new();
    // Sync code, reserved 0, fixed block size strategy.
    b.put(0xFFF8, 16);
    // Block size: 16-bit (size - 1) at the end of the header; sample rate: from STREAMINFO;
    // mono; 16 bits per sample; reserved 0.
    b.put(0b0111, 4);
    b.put(0b0000, 4);
    b.put(0b0000, 4);
    b.put(0b100, 3);
    b.put(0, 1);
    put_utf8(&mut b, frame_number);
    b.put((x.len() - 1) as u64, 16);
    let crc = crc8(&b.out);
    b.put(u64::from(crc), 8);

    if x.len() < 16 {
        // VERBATIM: too short for prediction to pay.
        b.put(0b0000_0010, 8);
        for &s in x {
            b.put(s as u16 as u64, 16);
        }
    } else {
        let cost = |order: usize| -> u64 {
            fixed_residual(x, order)
                .map(|r| u64::from(r.unsigned_abs()))
                .sum()
        };
        let order = (0..=4).min_by_key(|&o| cost(o)).unwrap_or(0);
        // (N - order,) zigzagged residuals
        let res: Vec<u32> = fixed_residual(x, order).map(zigzag).collect();
        let rice_bits = |k: u32| -> u64 {
            res.iter()
                .map(|&u| u64::from(u >> k) + 1 + u64::from(k))
                .sum()
        };
        let k = (0..=MAX_RICE).min_by_key(|&k| rice_bits(k)).unwrap_or(0);
        // Subframe header: pad 0, type FIXED (0b001xxx with the order), no wasted bits.
        b.put(((0b001000 | order as u64) << 1) & 0x7E, 8);
        for &s in &x[..order] {
            b.put(s as u16 as u64, 16);
        }
        // Residual coding method 0 (4-bit Rice parameters), partition order 0, parameter k.
        b.put(0b00, 2);
        b.put(0, 4);
        b.put(u64::from(k), 4);
        for &u in &res {
            b.unary(u >> k);
            b.put(u64::from(u), k);
        }
    }
    b.align();
    let crc = crc16(&b.out);
    b.put(u64::from(crc), 16);
    out.extend_from_slice(&b.out);
}

/// Encodes 16-bit mono PCM at `sample_rate` Hz (1..=655 350, the 20-bit STREAMINFO field) as a
/// complete FLAC file.
pub fn encode_flac(samples: &[i16], sample_rate: u32) -> Vec<u8> {
    let block = samples.len().clamp(16, BLOCK) as u64;
    let mut head = Bits::new();
    head.out.extend_from_slice(b"fLaC");
    // Metadata block header: last block, type 0 (STREAMINFO), 34 bytes.
    head.put(0x80, 8);
    head.put(34, 24);
    head.put(block, 16); // min block size
    head.put(block, 16); // max block size
    head.put(0, 24); // min frame size: unknown
    head.put(0, 24); // max frame size: unknown
    head.put(u64::from(sample_rate), 20);
    head.put(0, 3); // channels - 1
    head.put(15, 5); // bits per sample - 1
    head.put(samples.len() as u64 >> 32, 4); // total samples, 36 bits
    head.put(samples.len() as u64 & 0xFFFF_FFFF, 32);
    for _ in 0..4 {
        head.put(0, 32); // MD5: not computed
    }
    let mut out = head.out;
    // (N,) widened so the order-4 predictor (|residual| <= 16 * 32768) cannot overflow.
    let wide: Vec<i32> = samples.iter().map(|&s| i32::from(s)).collect();
    for (i, chunk) in wide.chunks(BLOCK).enumerate() {
        write_frame(&mut out, chunk, i as u64);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crcs_match_the_check_values() {
        // CRC-8/SMBUS and CRC-16/UMTS ("BUYPASS") check values for "123456789".
        assert_eq!(crc8(b"123456789"), 0xF4);
        assert_eq!(crc16(b"123456789"), 0xFEE8);
    }

    #[test]
    fn utf8_frame_numbers() {
        let enc = |v: u64| {
            let mut b = Bits::new();
            put_utf8(&mut b, v);
            b.out
        };
        assert_eq!(enc(0x41), vec![0x41]);
        assert_eq!(enc(0x80), vec![0xC2, 0x80]);
        assert_eq!(enc(0x7FF), vec![0xDF, 0xBF]);
        assert_eq!(enc(0x800), vec![0xE0, 0xA0, 0x80]);
        assert_eq!(enc(0x10000), vec![0xF0, 0x90, 0x80, 0x80]);
    }
}
