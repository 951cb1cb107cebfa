//! Small PNG charts (bar and line) for `braid inspect` and `braid train`, drawn pixel by
//! pixel with a built-in 5x7 font so the CLI needs no plotting crate and no font files.
// Until `braid inspect` and `braid train` call it.
#![allow(dead_code)]

use std::fs;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use image::{ImageFormat, Rgb, RgbImage};

mod font;
pub mod timeline;
use font::{draw_text, text_width, widest};

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

/// A chart drawn to a PNG, written atomically.
pub(crate) trait Chart {
    /// The image and its plot area; `path` only names errors.
    fn render(&self, path: &Path, width: u32, height: u32) -> Result<(RgbImage, Frame), PlotError>;

    fn write_png(&self, path: &Path) -> Result<(), PlotError> {
        self.write_png_sized(path, WIDTH, HEIGHT)
    }

    fn write_png_sized(&self, path: &Path, width: u32, height: u32) -> Result<(), PlotError> {
        save_png_atomic(&self.render(path, width, height)?.0, path)
    }
}

impl Chart for BarChart {
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

impl Chart for LineChart {
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
pub(crate) struct Frame {
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

/// Saves to a temporary name next to `path`, then renames over it, so a reader never sees
/// half a PNG.
fn save_png_atomic(img: &RgbImage, path: &Path) -> Result<(), PlotError> {
    let owned = || path.to_path_buf();
    let mut bytes = Vec::new();
    img.write_to(&mut Cursor::new(&mut bytes), ImageFormat::Png)
        .map_err(|source| PlotError::Encode {
            path: owned(),
            source,
        })?;
    if path.file_name().is_none() {
        return Err(PlotError::BadPath { path: owned() });
    }
    // Written through a symlink, never over a device; the temporary file removed on error.
    braid_nn::hf::write_atomic(path, |tmp| {
        fs::write(tmp, &bytes).map_err(|e| braid_nn::Error::io(tmp, "write", e))
    })
    .map_err(|e| PlotError::Io {
        path: owned(),
        op: "write",
        source: std::io::Error::other(e.to_string()),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
