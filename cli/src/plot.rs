//! Small PNG charts (bar and line) for `braid inspect` and `braid train`, drawn pixel by
//! pixel with a built-in 5x7 font so the CLI needs no plotting crate and no font files.
// Until `braid inspect` and `braid train` call it.
#![allow(dead_code)]

use std::ffi::OsString;
use std::fs;
use std::io::{Cursor, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use image::{ImageFormat, Rgb, RgbImage};

/// Default chart size in pixels.
pub const WIDTH: u32 = 800;
pub const HEIGHT: u32 = 480;

const WHITE: Rgb<u8> = Rgb([255, 255, 255]);
const AXIS: Rgb<u8> = Rgb([40, 40, 40]);
const GRID: Rgb<u8> = Rgb([228, 228, 228]);
const TEXT: Rgb<u8> = Rgb([20, 20, 20]);
const NOTE: Rgb<u8> = Rgb([190, 30, 30]);
const BAR: Rgb<u8> = Rgb([31, 119, 180]);
/// Series colours (matplotlib's tab10), cycled when there are more series.
const PALETTE: [Rgb<u8>; 8] = [
    Rgb([31, 119, 180]),
    Rgb([255, 127, 14]),
    Rgb([44, 160, 44]),
    Rgb([214, 39, 40]),
    Rgb([148, 103, 189]),
    Rgb([140, 86, 75]),
    Rgb([227, 119, 194]),
    Rgb([127, 127, 127]),
];

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("{}: nothing to plot ({what})", path.display())]
    NoData { path: PathBuf, what: String },
    #[error("{}: chart size {width}x{height} is outside 160x100 ..= 8192x8192", path.display())]
    Size {
        path: PathBuf,
        width: u32,
        height: u32,
    },
    #[error("{}: not a file path", path.display())]
    BadPath { path: PathBuf },
    #[error("{}: cannot encode the PNG: {source}", path.display())]
    Encode {
        path: PathBuf,
        source: image::ImageError,
    },
    #[error("{}: cannot {op}: {source}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
}

/// Vertical bars, one per `(label, value)`, e.g. a histogram with bucket names as labels.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BarChart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub bars: Vec<(String, f64)>,
}

/// One named polyline of `(x, y)` points, drawn in the order given.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// Lines over a numeric x axis, e.g. loss against step; a legend appears with > 1 series.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LineChart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Log-scale y axis; points with y <= 0 are skipped.
    pub log_y: bool,
}

impl BarChart {
    pub fn write_png(&self, path: &Path) -> Result<(), PlotError> {
        self.write_png_sized(path, WIDTH, HEIGHT)
    }

    pub fn write_png_sized(&self, path: &Path, width: u32, height: u32) -> Result<(), PlotError> {
        save_png_atomic(&self.render(path, width, height)?.0, path)
    }

    /// The image and its plot area; `path` only names errors.
    fn render(&self, path: &Path, width: u32, height: u32) -> Result<(RgbImage, Frame), PlotError> {
        check_size(path, width, height)?;
        let finite = self.bars.iter().map(|b| b.1).filter(|v| v.is_finite());
        // Bars grow from zero, so zero is always on the axis.
        let (lo, hi) = finite
            .clone()
            .fold((0.0f64, 0.0f64), |(l, h), v| (l.min(v), h.max(v)));
        let skipped = self.bars.len() - finite.count();
        if skipped == self.bars.len() {
            let what = format!("{} bars, none with a finite value", self.bars.len());
            return Err(PlotError::no_data(path, what));
        }
        let y = Axis::linear(lo, if lo == hi { 1.0 } else { hi }, 6);
        let note = (skipped > 0).then(|| format!("skipped {skipped} non-finite value(s)"));
        let mut img = RgbImage::from_pixel(width, height, WHITE);
        let texts = [&*self.title, &self.x_label, &self.y_label];
        let f = draw_frame(&mut img, texts, &y, note);

        let slot = f64::from(f.right - f.left) / self.bars.len() as f64;
        let y0 = f.py(y.frac(0.0));
        for (i, &(_, v)) in self.bars.iter().enumerate() {
            if !v.is_finite() || v == 0.0 {
                continue;
            }
            let x0 = f.left + 1 + ((i as f64 + 0.1) * slot) as i32;
            let x1 = (f.left + 1 + ((i as f64 + 0.9) * slot) as i32).max(x0 + 1);
            let yv = f.py(y.frac(v));
            // At least one pixel tall, so a count of 1 next to a million still shows.
            let (top, bot) = if v > 0.0 {
                (yv.min(y0 - 1), y0)
            } else {
                (y0 + 1, yv.max(y0 + 2))
            };
            fill_rect(&mut img, x0, top, x1 - x0, bot - top, BAR);
        }
        let at = |i: usize| f.left + ((i as f64 + 0.5) * slot) as i32;
        let labels = self.bars.iter().enumerate().map(|(i, b)| (at(i), &*b.0));
        draw_x_labels(&mut img, &f, labels.collect(), slot);
        Ok((img, f))
    }
}

impl LineChart {
    pub fn write_png(&self, path: &Path) -> Result<(), PlotError> {
        self.write_png_sized(path, WIDTH, HEIGHT)
    }

    pub fn write_png_sized(&self, path: &Path, width: u32, height: u32) -> Result<(), PlotError> {
        save_png_atomic(&self.render(path, width, height)?.0, path)
    }

    fn render(&self, path: &Path, width: u32, height: u32) -> Result<(RgbImage, Frame), PlotError> {
        check_size(path, width, height)?;
        let log = self.log_y;
        // None marks a skipped point: the line breaks there rather than bridging the gap.
        let keep = |&(x, y): &(f64, f64)| {
            let ok = x.is_finite() && y.is_finite() && (!log || y > 0.0);
            ok.then(|| (x, if log { y.log10() } else { y }))
        };
        let clean: Vec<Vec<_>> = self
            .series
            .iter()
            .map(|s| s.points.iter().map(keep).collect())
            .collect();
        let pts = || clean.iter().flatten().flatten();
        let Some(&(x, y)) = pts().next() else {
            let n: usize = self.series.iter().map(|s| s.points.len()).sum();
            let kind = if log { "finite positive" } else { "finite" };
            let what = format!("{} series, {n} points, none {kind}", self.series.len());
            return Err(PlotError::no_data(path, what));
        };
        let [mut xlo, mut xhi, mut ylo, mut yhi] = [x, x, y, y];
        for &(x, y) in pts() {
            [xlo, xhi, ylo, yhi] = [xlo.min(x), xhi.max(x), ylo.min(y), yhi.max(y)];
        }
        let xa = Axis::linear(xlo, xhi, 8);
        let ya = if log {
            Axis::log10(ylo, yhi, 6)
        } else {
            Axis::linear(ylo, yhi, 6)
        };
        let skipped = clean.iter().flatten().filter(|p| p.is_none()).count();
        let note = (skipped > 0).then(|| {
            let kind = if log {
                "non-finite or non-positive"
            } else {
                "non-finite"
            };
            format!("skipped {skipped} {kind} point(s)")
        });
        let mut img = RgbImage::from_pixel(width, height, WHITE);
        let texts = [&*self.title, &self.x_label, &self.y_label];
        let f = draw_frame(&mut img, texts, &ya, note);

        let mut labels = Vec::new();
        for (t, label) in xa.ticks.iter().zip(&xa.labels) {
            let px = f.px(xa.frac(*t));
            fill_rect(&mut img, px, f.top, 1, f.bottom - f.top, GRID);
            fill_rect(&mut img, px, f.bottom, 1, 4, AXIS);
            labels.push((px, label.as_str()));
        }
        fill_rect(&mut img, f.left, f.bottom, f.right - f.left + 1, 1, AXIS);
        let spacing = f64::from(f.right - f.left) / xa.ticks.len().max(1) as f64;
        draw_x_labels(&mut img, &f, labels, spacing);

        for (si, pts) in clean.iter().enumerate() {
            let c = PALETTE[si % PALETTE.len()];
            let at = |(x, y): (f64, f64)| (f.px(xa.frac(x)), f.py(ya.frac(y)));
            for (j, p) in pts.iter().enumerate() {
                let Some(p) = *p else { continue };
                let next = pts.get(j + 1).copied().flatten();
                if let Some(q) = next {
                    draw_line(&mut img, at(p), at(q), c);
                }
                let prev = j.checked_sub(1).and_then(|i| pts.get(i).copied().flatten());
                if prev.is_none() && next.is_none() {
                    // An isolated point has no segment: mark it.
                    let (x, y) = at(p);
                    fill_rect(&mut img, x - 2, y - 2, 5, 5, c);
                }
            }
        }
        if self.series.len() > 1 {
            draw_legend(&mut img, &f, &self.series);
        }
        Ok((img, f))
    }
}

/// Round tick values (1, 2 or 5 x 10^k apart) covering `lo..=hi` with at most about
/// `max_ticks` ticks; the first tick is <= lo and the last >= hi. Empty for non-finite input.
pub fn nice_ticks(lo: f64, hi: f64, max_ticks: usize) -> Vec<f64> {
    if !lo.is_finite() || !hi.is_finite() {
        return Vec::new();
    }
    let (mut lo, mut hi) = if lo <= hi { (lo, hi) } else { (hi, lo) };
    if lo == hi {
        let d = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        (lo, hi) = ((lo - d).max(f64::MIN), (hi + d).min(f64::MAX));
    }
    let n = max_ticks.max(2) as f64 - 1.0;
    // hi/n - lo/n rather than (hi - lo)/n: the difference of two huge values overflows.
    let step = nice_step(hi / n - lo / n);
    let (first, last) = ((lo / step).floor(), (hi / step).ceil());
    if !(last - first).is_finite() || last - first > 1000.0 {
        return vec![lo, hi];
    }
    let ticks = (0..=(last - first) as usize).map(|i| (first + i as f64) * step);
    ticks.filter(|t| t.is_finite()).collect()
}

/// The smallest of 1, 2, 5 x 10^k that is >= raw (1 for a raw that is not positive and finite).
fn nice_step(raw: f64) -> f64 {
    let base = 10f64.powf(raw.log10().floor());
    let m = [1.0, 2.0, 5.0]
        .into_iter()
        .find(|&m| raw / base <= m)
        .unwrap_or(10.0);
    Some(m * base)
        .filter(|s| *s > 0.0 && s.is_finite())
        .unwrap_or(1.0)
}

/// Compact tick label: k/M/G/T suffixes above 1000, decimals only as fine as `step` needs
/// (`fmt_num(1500.0, 500.0) == "1.5k"`), scientific for the very large and very small.
pub fn fmt_num(v: f64, step: f64) -> String {
    let a = v.abs();
    if !v.is_finite() {
        return format!("{v}");
    }
    if a == 0.0 || a < step.abs() * 1e-6 {
        return "0".into();
    }
    if !(1e-4..1e15).contains(&a) {
        return format!("{v:.1e}").replace(".0e", "e");
    }
    let suffixes = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")];
    let (div, suffix) = suffixes
        .into_iter()
        .find(|(d, _)| a >= *d)
        .unwrap_or((1.0, ""));
    let s = if step > 0.0 && step.is_finite() {
        step
    } else {
        a
    };
    let decimals = (-(s / div).log10()).ceil().clamp(0.0, 6.0) as usize;
    let mut out = format!("{:.*}", decimals, v / div);
    if out.contains('.') {
        out = out.trim_end_matches('0').trim_end_matches('.').to_string();
    }
    if out == "-0" {
        out = "0".into();
    }
    out + suffix
}

/// One axis: the data range widened to its outer ticks, with the tick labels.
struct Axis {
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
    labels: Vec<String>,
}

impl Axis {
    fn linear(lo: f64, hi: f64, max_ticks: usize) -> Axis {
        let ticks = nice_ticks(lo, hi, max_ticks);
        let step = if let [a, b, ..] = ticks[..] {
            b - a
        } else {
            0.0
        };
        let labels = ticks.iter().map(|&t| fmt_num(t, step)).collect();
        Axis::spanning(lo, hi, ticks, labels)
    }

    /// `lo`/`hi` are log10 of the data; ticks sit on whole decades.
    fn log10(lo: f64, hi: f64, max_ticks: usize) -> Axis {
        let (a, b) = (lo.floor(), hi.ceil().max(lo.floor() + 1.0));
        let step = ((b - a) / max_ticks.max(2) as f64).ceil().max(1.0);
        let count = ((b - a) / step).ceil().min(1000.0) as usize;
        let ticks: Vec<f64> = (0..=count).map(|i| a + i as f64 * step).collect();
        let decade = |t: f64| fmt_num(10f64.powf(t), 10f64.powf(t));
        let labels = ticks.iter().map(|&t| decade(t)).collect();
        Axis::spanning(a, b, ticks, labels)
    }

    fn spanning(lo: f64, hi: f64, ticks: Vec<f64>, labels: Vec<String>) -> Axis {
        let (lo, hi) = match (ticks.first(), ticks.last()) {
            (Some(&a), Some(&b)) if b > a => (a, b),
            _ => (lo, hi),
        };
        Axis {
            lo,
            hi,
            ticks,
            labels,
        }
    }

    /// Position of `v` along the axis, 0 at `lo` and 1 at `hi`.
    fn frac(&self, v: f64) -> f64 {
        let d = self.hi - self.lo;
        if d > 0.0 && d.is_finite() {
            (v - self.lo) / d
        } else {
            0.5
        }
    }
}

/// The plot area in pixels (inclusive edges).
#[derive(Debug, Clone, Copy)]
struct Frame {
    left: i32,
    right: i32,
    top: i32,
    bottom: i32,
}

// `frac` is within 0..=1 up to rounding; the clamp only keeps the i32 arithmetic in range.
impl Frame {
    fn px(&self, frac: f64) -> i32 {
        self.left + (frac.clamp(-1.0, 2.0) * f64::from(self.right - self.left)).round() as i32
    }
    fn py(&self, frac: f64) -> i32 {
        self.bottom - (frac.clamp(-1.0, 2.0) * f64::from(self.bottom - self.top)).round() as i32
    }
}

impl PlotError {
    fn no_data(path: &Path, what: String) -> PlotError {
        PlotError::NoData {
            path: path.to_path_buf(),
            what,
        }
    }
}

fn check_size(path: &Path, width: u32, height: u32) -> Result<(), PlotError> {
    if (160..=8192).contains(&width) && (100..=8192).contains(&height) {
        return Ok(());
    }
    Err(PlotError::Size {
        path: path.to_path_buf(),
        width,
        height,
    })
}

/// `[title, x_label, y_label]`, y ticks with grid lines, both axes and an optional note;
/// returns the plot area, whose left edge leaves room for the widest y tick label.
fn draw_frame(img: &mut RgbImage, texts: [&str; 3], y: &Axis, note: Option<String>) -> Frame {
    let [title, x_label, y_label] = texts;
    let (w, h) = (img.width() as i32, img.height() as i32);
    let left = (widest(y.labels.iter().map(String::as_str)) + 14).max(40);
    let f = Frame {
        left,
        right: w - 20,
        top: 48,
        bottom: h - 52,
    };
    draw_text(img, (w - text_width(title, 2)) / 2, 10, title, 2, TEXT);
    draw_text(img, 8, 32, y_label, 1, TEXT);
    let x = (f.left + f.right - text_width(x_label, 1)) / 2;
    draw_text(img, x, f.bottom + 24, x_label, 1, TEXT);
    if let Some(note) = note {
        draw_text(img, 8, h - 12, &note, 1, NOTE);
    }
    for (t, label) in y.ticks.iter().zip(&y.labels) {
        let py = f.py(y.frac(*t));
        fill_rect(img, f.left + 1, py, f.right - f.left, 1, GRID);
        fill_rect(img, f.left - 4, py, 4, 1, AXIS);
        draw_text(
            img,
            f.left - 7 - text_width(label, 1),
            py - 3,
            label,
            1,
            TEXT,
        );
    }
    fill_rect(img, f.left, f.top, 1, f.bottom - f.top + 1, AXIS);
    fill_rect(img, f.left, f.bottom, f.right - f.left + 1, 1, AXIS);
    f
}

/// Labels centred under the x axis at `(x, text)`, every k-th one so that none overlap.
fn draw_x_labels(img: &mut RgbImage, f: &Frame, labels: Vec<(i32, &str)>, spacing: f64) {
    let w = widest(labels.iter().map(|l| l.1));
    let k = ((f64::from(w) + 8.0) / spacing.max(1e-9)).ceil().max(1.0) as usize;
    for (x, label) in labels.into_iter().step_by(k) {
        draw_text(
            img,
            x - text_width(label, 1) / 2,
            f.bottom + 6,
            label,
            1,
            TEXT,
        );
    }
}

fn draw_legend(img: &mut RgbImage, f: &Frame, series: &[Series]) {
    let (w, h) = (
        widest(series.iter().map(|s| &*s.name)) + 30,
        12 * series.len().min(40) as i32 + 6,
    );
    let (x, y) = (f.right - w - 6, f.top + 6);
    fill_rect(img, x, y, w, h, AXIS);
    fill_rect(img, x + 1, y + 1, w - 2, h - 2, WHITE);
    for (i, s) in series.iter().take(40).enumerate() {
        let ry = y + 6 + 12 * i as i32;
        fill_rect(img, x + 6, ry + 2, 14, 3, PALETTE[i % PALETTE.len()]);
        draw_text(img, x + 24, ry, &s.name, 1, TEXT);
    }
}

fn fill_rect(img: &mut RgbImage, x: i32, y: i32, w: i32, h: i32, c: Rgb<u8>) {
    let (iw, ih) = (i64::from(img.width()), i64::from(img.height()));
    let (x0, y0) = (i64::from(x).clamp(0, iw), i64::from(y).clamp(0, ih));
    let x1 = (i64::from(x) + i64::from(w)).clamp(0, iw);
    let y1 = (i64::from(y) + i64::from(h)).clamp(0, ih);
    for py in y0..y1 {
        for px in x0..x1 {
            img.put_pixel(px as u32, py as u32, c);
        }
    }
}

/// A 2-pixel-wide Bresenham line.
fn draw_line(img: &mut RgbImage, (x0, y0): (i32, i32), (x1, y1): (i32, i32), c: Rgb<u8>) {
    // Clamp so a wild coordinate cannot make the loop long.
    let (w, h) = (img.width() as i32, img.height() as i32);
    let (mut x, mut y) = (x0.clamp(-2, w + 2), y0.clamp(-2, h + 2));
    let (x1, y1) = (x1.clamp(-2, w + 2), y1.clamp(-2, h + 2));
    let (dx, dy) = ((x1 - x).abs(), -(y1 - y).abs());
    let (sx, sy) = (if x < x1 { 1 } else { -1 }, if y < y1 { 1 } else { -1 });
    let mut err = dx + dy;
    loop {
        fill_rect(img, x, y, 2, 2, c);
        if x == x1 && y == y1 {
            break;
        }
        let e2 = 2 * err;
        if e2 >= dy {
            err += dy;
            x += sx;
        }
        if e2 <= dx {
            err += dx;
            y += sy;
        }
    }
}

fn widest<'a>(labels: impl Iterator<Item = &'a str>) -> i32 {
    labels.map(|l| text_width(l, 1)).max().unwrap_or(0)
}

/// Pixel width of `s` in the 5x7 font at `scale` (6 pixels a character with spacing).
fn text_width(s: &str, scale: i32) -> i32 {
    let n = i32::try_from(s.chars().count())
        .unwrap_or(i32::MAX / 64)
        .min(i32::MAX / 64);
    (6 * n - 1).max(0) * scale
}

fn draw_text(img: &mut RgbImage, x: i32, y: i32, s: &str, scale: i32, c: Rgb<u8>) {
    let mut cx = x;
    for ch in s.chars() {
        if cx >= img.width() as i32 {
            break;
        }
        // Anything outside printable ASCII draws as '?'.
        let glyph = FONT
            .get((ch as usize).wrapping_sub(0x20))
            .unwrap_or(&FONT[31]);
        for (col, bits) in (0..).zip(glyph) {
            for row in (0..7).filter(|r| bits >> r & 1 == 1) {
                fill_rect(img, cx + col * scale, y + row * scale, scale, scale, c);
            }
        }
        cx += 6 * scale;
    }
}

/// Saves to a temporary name next to `path`, then renames over it, so a reader never sees
/// half a PNG.
fn save_png_atomic(img: &RgbImage, path: &Path) -> Result<(), PlotError> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let owned = || path.to_path_buf();
    let mut bytes = Vec::new();
    img.write_to(&mut Cursor::new(&mut bytes), ImageFormat::Png)
        .map_err(|source| PlotError::Encode {
            path: owned(),
            source,
        })?;
    let name = path
        .file_name()
        .ok_or_else(|| PlotError::BadPath { path: owned() })?;
    let mut tmp_name = OsString::from(".");
    tmp_name.push(name);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    tmp_name.push(format!(".{}-{n}.tmp", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let write = || -> std::io::Result<()> {
        let mut file = fs::File::create(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()
    };
    let result = write()
        .map_err(|source| PlotError::Io {
            path: owned(),
            op: "write",
            source,
        })
        .and_then(|()| {
            fs::rename(&tmp, path).map_err(|source| PlotError::Io {
                path: owned(),
                op: "rename the temporary file into place",
                source,
            })
        });
    if result.is_err() {
        // Best effort: the error that matters is already in `result`.
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Classic 5x7 font for ASCII 0x20..=0x7E: five columns per glyph, bit r = row r from the top.
#[rustfmt::skip]
const FONT: [[u8; 5]; 95] = [
    [0x00, 0x00, 0x00, 0x00, 0x00], [0x00, 0x00, 0x5F, 0x00, 0x00], // ' ' !
    [0x00, 0x07, 0x00, 0x07, 0x00], [0x14, 0x7F, 0x14, 0x7F, 0x14], // " #
    [0x24, 0x2A, 0x7F, 0x2A, 0x12], [0x23, 0x13, 0x08, 0x64, 0x62], // $ %
    [0x36, 0x49, 0x55, 0x22, 0x50], [0x00, 0x05, 0x03, 0x00, 0x00], // & '
    [0x00, 0x1C, 0x22, 0x41, 0x00], [0x00, 0x41, 0x22, 0x1C, 0x00], // ( )
    [0x08, 0x2A, 0x1C, 0x2A, 0x08], [0x08, 0x08, 0x3E, 0x08, 0x08], // * +
    [0x00, 0x50, 0x30, 0x00, 0x00], [0x08, 0x08, 0x08, 0x08, 0x08], // , -
    [0x00, 0x60, 0x60, 0x00, 0x00], [0x20, 0x10, 0x08, 0x04, 0x02], // . /
    [0x3E, 0x51, 0x49, 0x45, 0x3E], [0x00, 0x42, 0x7F, 0x40, 0x00], // 0 1
    [0x42, 0x61, 0x51, 0x49, 0x46], [0x21, 0x41, 0x45, 0x4B, 0x31], // 2 3
    [0x18, 0x14, 0x12, 0x7F, 0x10], [0x27, 0x45, 0x45, 0x45, 0x39], // 4 5
    [0x3C, 0x4A, 0x49, 0x49, 0x30], [0x01, 0x71, 0x09, 0x05, 0x03], // 6 7
    [0x36, 0x49, 0x49, 0x49, 0x36], [0x06, 0x49, 0x49, 0x29, 0x1E], // 8 9
    [0x00, 0x36, 0x36, 0x00, 0x00], [0x00, 0x56, 0x36, 0x00, 0x00], // : ;
    [0x08, 0x14, 0x22, 0x41, 0x00], [0x14, 0x14, 0x14, 0x14, 0x14], // < =
    [0x00, 0x41, 0x22, 0x14, 0x08], [0x02, 0x01, 0x51, 0x09, 0x06], // > ?
    [0x32, 0x49, 0x79, 0x41, 0x3E], [0x7E, 0x11, 0x11, 0x11, 0x7E], // @ A
    [0x7F, 0x49, 0x49, 0x49, 0x36], [0x3E, 0x41, 0x41, 0x41, 0x22], // B C
    [0x7F, 0x41, 0x41, 0x22, 0x1C], [0x7F, 0x49, 0x49, 0x49, 0x41], // D E
    [0x7F, 0x09, 0x09, 0x01, 0x01], [0x3E, 0x41, 0x41, 0x51, 0x32], // F G
    [0x7F, 0x08, 0x08, 0x08, 0x7F], [0x00, 0x41, 0x7F, 0x41, 0x00], // H I
    [0x20, 0x40, 0x41, 0x3F, 0x01], [0x7F, 0x08, 0x14, 0x22, 0x41], // J K
    [0x7F, 0x40, 0x40, 0x40, 0x40], [0x7F, 0x02, 0x04, 0x02, 0x7F], // L M
    [0x7F, 0x04, 0x08, 0x10, 0x7F], [0x3E, 0x41, 0x41, 0x41, 0x3E], // N O
    [0x7F, 0x09, 0x09, 0x09, 0x06], [0x3E, 0x41, 0x51, 0x21, 0x5E], // P Q
    [0x7F, 0x09, 0x19, 0x29, 0x46], [0x46, 0x49, 0x49, 0x49, 0x31], // R S
    [0x01, 0x01, 0x7F, 0x01, 0x01], [0x3F, 0x40, 0x40, 0x40, 0x3F], // T U
    [0x1F, 0x20, 0x40, 0x20, 0x1F], [0x7F, 0x20, 0x18, 0x20, 0x7F], // V W
    [0x63, 0x14, 0x08, 0x14, 0x63], [0x03, 0x04, 0x78, 0x04, 0x03], // X Y
    [0x61, 0x51, 0x49, 0x45, 0x43], [0x00, 0x7F, 0x41, 0x41, 0x00], // Z [
    [0x02, 0x04, 0x08, 0x10, 0x20], [0x00, 0x41, 0x41, 0x7F, 0x00], // \ ]
    [0x04, 0x02, 0x01, 0x02, 0x04], [0x40, 0x40, 0x40, 0x40, 0x40], // ^ _
    [0x00, 0x01, 0x02, 0x04, 0x00], [0x20, 0x54, 0x54, 0x54, 0x78], // ` a
    [0x7F, 0x48, 0x44, 0x44, 0x38], [0x38, 0x44, 0x44, 0x44, 0x20], // b c
    [0x38, 0x44, 0x44, 0x48, 0x7F], [0x38, 0x54, 0x54, 0x54, 0x18], // d e
    [0x08, 0x7E, 0x09, 0x01, 0x02], [0x08, 0x54, 0x54, 0x54, 0x3C], // f g
    [0x7F, 0x08, 0x04, 0x04, 0x78], [0x00, 0x44, 0x7D, 0x40, 0x00], // h i
    [0x20, 0x40, 0x44, 0x3D, 0x00], [0x00, 0x7F, 0x10, 0x28, 0x44], // j k
    [0x00, 0x41, 0x7F, 0x40, 0x00], [0x7C, 0x04, 0x18, 0x04, 0x78], // l m
    [0x7C, 0x08, 0x04, 0x04, 0x78], [0x38, 0x44, 0x44, 0x44, 0x38], // n o
    [0x7C, 0x14, 0x14, 0x14, 0x08], [0x08, 0x14, 0x14, 0x18, 0x7C], // p q
    [0x7C, 0x08, 0x04, 0x04, 0x08], [0x48, 0x54, 0x54, 0x54, 0x20], // r s
    [0x04, 0x3F, 0x44, 0x40, 0x20], [0x3C, 0x40, 0x40, 0x20, 0x7C], // t u
    [0x1C, 0x20, 0x40, 0x20, 0x1C], [0x3C, 0x40, 0x30, 0x40, 0x3C], // v w
    [0x44, 0x28, 0x10, 0x28, 0x44], [0x0C, 0x50, 0x50, 0x50, 0x3C], // x y
    [0x44, 0x64, 0x54, 0x4C, 0x44], [0x00, 0x08, 0x36, 0x41, 0x00], // z {
    [0x00, 0x00, 0x7F, 0x00, 0x00], [0x00, 0x41, 0x36, 0x08, 0x00], // | }
    [0x08, 0x04, 0x08, 0x10, 0x08],                                 // ~
];

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn tmp() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    fn bars(values: &[f64]) -> BarChart {
        BarChart {
            title: "Lengths (tokens)".into(),
            x_label: "length".into(),
            y_label: "samples".into(),
            bars: values
                .iter()
                .enumerate()
                .map(|(i, &v)| (format!("<{}", 64 * (i + 1)), v))
                .collect(),
        }
    }

    fn line(series: Vec<Vec<(f64, f64)>>, log_y: bool) -> LineChart {
        let series = series
            .into_iter()
            .enumerate()
            .map(|(i, points)| Series {
                name: format!("run {i}"),
                points,
            })
            .collect();
        LineChart {
            title: "Loss".into(),
            x_label: "step".into(),
            y_label: "loss".into(),
            series,
            log_y,
        }
    }

    fn count(
        img: &RgbImage,
        x: std::ops::Range<u32>,
        y: std::ops::Range<u32>,
        c: Rgb<u8>,
    ) -> usize {
        y.flat_map(|py| x.clone().map(move |px| (px, py)))
            .filter(|&(px, py)| *img.get_pixel(px, py) == c)
            .count()
    }

    #[test]
    fn nice_ticks_are_round() {
        assert_eq!(nice_ticks(0.0, 37.0, 5), [0.0, 10.0, 20.0, 30.0, 40.0]);
        assert_eq!(nice_ticks(37.0, 0.0, 5), [0.0, 10.0, 20.0, 30.0, 40.0]);
        assert_eq!(
            nice_ticks(-3.0, 7.0, 6),
            [-4.0, -2.0, 0.0, 2.0, 4.0, 6.0, 8.0]
        );
        let t = nice_ticks(0.0, 1.0, 6);
        assert_eq!(t.len(), 6);
        assert!(
            t.iter()
                .zip([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
                .all(|(a, b)| (a - b).abs() < 1e-12)
        );
        assert_eq!(nice_ticks(0.0, 3.0e6, 4), [0.0, 1e6, 2e6, 3e6]);
        let t = nice_ticks(5.0, 5.0, 6);
        assert!(t.len() >= 2 && t[0] <= 5.0 && *t.last().unwrap() >= 5.0);
        assert!(nice_ticks(f64::NAN, 1.0, 5).is_empty());
        let t = nice_ticks(-f64::MAX, f64::MAX, 6);
        assert!(!t.is_empty() && t.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn fmt_num_is_compact() {
        assert_eq!(fmt_num(1500.0, 500.0), "1.5k");
        assert_eq!(fmt_num(2e6, 1e6), "2M");
        assert_eq!(fmt_num(3e9, 1e9), "3G");
        assert_eq!(fmt_num(250.0, 50.0), "250");
        assert_eq!(fmt_num(0.1 * 3.0, 0.1), "0.3");
        assert_eq!(fmt_num(-0.0, 1.0), "0");
        assert_eq!(fmt_num(1e-16, 0.1), "0");
        assert_eq!(fmt_num(1e-6, 1e-6), "1e-6");
        assert_eq!(fmt_num(1e20, 1e20), "1e20");
        assert_eq!(fmt_num(-1200.0, 200.0), "-1.2k");
    }

    #[test]
    fn bar_chart_draws_bars_where_they_belong() {
        let dir = tmp();
        let path = dir.path().join("hist.png");
        let chart = bars(&[10.0, 0.0, 5.0]);
        chart.write_png(&path).unwrap();
        let img = image::open(&path).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (WIDTH, HEIGHT));
        let (expected, f) = chart.render(&path, WIDTH, HEIGHT).unwrap();
        assert!(img == expected, "the PNG round-trips the rendered pixels");
        let slot = f64::from(f.right - f.left) / 3.0;
        let col = |i: usize| (f.left + ((i as f64 + 0.5) * slot) as i32) as u32;
        let (top, bottom) = (f.top as u32, f.bottom as u32);
        // The tallest bar reaches the top tick, the empty one has no bar, the half one half.
        assert_eq!(*img.get_pixel(col(0), top + 1), BAR);
        assert_eq!(count(&img, col(1)..col(1) + 1, top..bottom + 1, BAR), 0);
        assert_eq!(*img.get_pixel(col(2), bottom - 5), BAR);
        assert_ne!(*img.get_pixel(col(2), top + 5), BAR);
        let half = count(&img, col(2)..col(2) + 1, top..bottom, BAR) as f64;
        assert!(
            (half / f64::from(f.bottom - f.top) - 0.5).abs() < 0.02,
            "{half}"
        );
        // Title text (scale 2, rows 10..24) and the x tick labels under the axis.
        assert!(count(&img, 0..WIDTH, 10..24, TEXT) > 50);
        assert!(count(&img, 0..WIDTH, bottom + 6..bottom + 13, TEXT) > 20);
        assert_eq!(count(&img, 0..WIDTH, HEIGHT - 12..HEIGHT, NOTE), 0);
    }

    #[test]
    fn bar_chart_skips_non_finite_and_says_so() {
        let dir = tmp();
        let path = dir.path().join("nan.png");
        let chart = bars(&[3.0, f64::NAN, f64::INFINITY, -2.0]);
        let (img, _) = chart.render(&path, WIDTH, HEIGHT).unwrap();
        assert!(count(&img, 0..WIDTH, HEIGHT - 12..HEIGHT, NOTE) > 20);
        chart.write_png(&path).unwrap();
        for values in [&[][..], &[f64::NAN, f64::NEG_INFINITY]] {
            let err = bars(values).write_png(&path).unwrap_err();
            assert!(matches!(err, PlotError::NoData { .. }), "{err}");
            assert!(err.to_string().contains("nan.png"), "{err}");
        }
    }

    #[test]
    fn extreme_inputs_do_not_panic() {
        let dir = tmp();
        let path = dir.path().join("x.png");
        bars(&[f64::MAX, 1e300, 0.0, -f64::MAX])
            .write_png(&path)
            .unwrap();
        bars(&[0.0, 0.0]).write_png(&path).unwrap();
        let mut many = bars(&vec![1.0; 5000]);
        many.bars[0].0 = "a label much wider than any slot ".repeat(20);
        many.title = "\u{e9}\u{1F600} unicode falls back to ?".into();
        many.write_png(&path).unwrap();
        line(
            vec![vec![(0.0, f64::MAX), (1.0, -f64::MAX), (f64::MAX, 0.0)]],
            false,
        )
        .write_png(&path)
        .unwrap();
        line(vec![vec![(1.0, 1e-300), (2.0, 1e300)]], true)
            .write_png(&path)
            .unwrap();
        bars(&[1.0]).write_png_sized(&path, 160, 100).unwrap();
        let err = bars(&[1.0]).write_png_sized(&path, 10, 10).unwrap_err();
        assert!(matches!(err, PlotError::Size { .. }), "{err}");
    }

    #[test]
    fn line_chart_draws_each_series_with_a_legend() {
        let dir = tmp();
        let path = dir.path().join("loss.png");
        let a: Vec<_> = (0..200)
            .map(|i| (f64::from(i), 10.0 / (1.0 + f64::from(i))))
            .collect();
        let b: Vec<_> = (0..200)
            .map(|i| (f64::from(i), 5.0 / (1.0 + f64::from(i))))
            .collect();
        let chart = line(vec![a, b, vec![]], false);
        chart.write_png(&path).unwrap();
        let img = image::open(&path).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (WIDTH, HEIGHT));
        let (_, f) = chart.render(&path, WIDTH, HEIGHT).unwrap();
        let inside = |c| {
            count(
                &img,
                f.left as u32..f.right as u32,
                f.top as u32..f.bottom as u32,
                c,
            )
        };
        assert!(inside(PALETTE[0]) > 300 && inside(PALETTE[1]) > 300);
        // The empty series has only its legend swatch (14x3).
        assert_eq!(inside(PALETTE[2]), 42);
        assert!(count(&img, 0..WIDTH, 10..24, TEXT) > 20);
    }

    #[test]
    fn line_chart_single_points_gaps_and_log_scale() {
        let dir = tmp();
        let path = dir.path().join("one.png");
        let chart = line(vec![vec![(3.0, 2.5)]], false);
        chart.write_png(&path).unwrap();
        let (img, f) = chart.render(&path, WIDTH, HEIGHT).unwrap();
        let (cx, cy) = (f.px(0.5) as u32, f.py(0.5) as u32);
        assert_eq!(
            *img.get_pixel(cx, cy),
            PALETTE[0],
            "a lone point is marked mid-plot"
        );
        let gaps = line(
            vec![vec![(0.0, 1.0), (1.0, f64::NAN), (2.0, 3.0), (3.0, 0.5)]],
            true,
        );
        let (img, _) = gaps.render(&path, WIDTH, HEIGHT).unwrap();
        assert!(count(&img, 0..WIDTH, HEIGHT - 12..HEIGHT, NOTE) > 20);
        gaps.write_png(&path).unwrap();
        for chart in [
            line(vec![], false),
            line(vec![vec![], vec![]], false),
            line(vec![vec![(0.0, f64::NAN), (f64::INFINITY, 1.0)]], false),
            line(vec![vec![(0.0, 0.0), (1.0, -1.0)]], true),
        ] {
            let err = chart.write_png(&path).unwrap_err();
            assert!(matches!(err, PlotError::NoData { .. }), "{err}");
        }
    }

    #[test]
    fn writes_atomically_and_names_the_path_on_failure() {
        let dir = tmp();
        let path = dir.path().join("h.png");
        bars(&[1.0, 2.0]).write_png(&path).unwrap();
        bars(&[2.0, 1.0]).write_png(&path).unwrap();
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["h.png"], "no temporary file is left behind");
        let bad = dir.path().join("no/such/dir/h.png");
        let err = bars(&[1.0]).write_png(&bad).unwrap_err();
        assert!(matches!(err, PlotError::Io { .. }), "{err}");
        assert!(err.to_string().contains("no/such/dir/h.png"), "{err}");
        let err = bars(&[1.0]).write_png(Path::new("/")).unwrap_err();
        assert!(matches!(err, PlotError::BadPath { .. }), "{err}");
    }
}
