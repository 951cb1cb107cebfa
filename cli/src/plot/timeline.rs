//! A timeline as a picture (`braid trace --png`): a band per rank, a box per span of
//! work coloured by its kind (vision, audio, LLM, bridge, ...), time along x.

use image::RgbImage;

use super::{
    AXIS, Axis, Chart, Frame, GRID, PALETTE, PlotError, TEXT, WHITE, check_size, draw_text,
    fill_rect, text_width, widest,
};

/// A span of one row: start and end in seconds (any origin), and its kind's index into
/// [`Timeline::kinds`].
pub type Span = (f64, f64, usize);

/// Rows of spans, e.g. every rank of a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timeline {
    pub title: String,
    /// `(label, spans)`, top to bottom.
    pub rows: Vec<(String, Vec<Span>)>,
    /// The kinds' names, in colour order (the legend shows those that occur).
    pub kinds: Vec<String>,
}

impl Chart for Timeline {
    fn render(
        &self,
        path: &std::path::Path,
        width: u32,
        height: u32,
    ) -> Result<(RgbImage, Frame), PlotError> {
        check_size(path, width, height)?;
        let spans = self.rows.iter().flat_map(|r| r.1.iter());
        let finite: Vec<&Span> = spans
            .filter(|s| s.0.is_finite() && s.1.is_finite())
            .collect();
        let (Some(t0), Some(t1)) = (
            finite.iter().map(|s| s.0).reduce(f64::min),
            finite.iter().map(|s| s.1).reduce(f64::max),
        ) else {
            return Err(PlotError::no_data(path, "no spans".into()));
        };
        let length_ms = ((t1 - t0) * 1e3).max(1e-3);
        let axis = Axis::linear(0.0, length_ms, 8);
        let mut img = RgbImage::from_pixel(width, height, WHITE);
        let (w, h) = (width as i32, height as i32);
        let left = widest(self.rows.iter().map(|r| r.0.as_str())) + 14;
        let f = Frame {
            left,
            right: w - 20,
            top: 48,
            bottom: h - 52,
        };
        draw_text(
            &mut img,
            (w - text_width(&self.title, 2)) / 2,
            10,
            &self.title,
            2,
            TEXT,
        );
        let label = "time (ms)";
        let x = (f.left + f.right - text_width(label, 1)) / 2;
        draw_text(&mut img, x, f.bottom + 24, label, 1, TEXT);
        for (t, label) in axis.ticks.iter().zip(&axis.labels) {
            let px = f.px(axis.frac(*t));
            fill_rect(&mut img, px, f.top, 1, f.bottom - f.top, GRID);
            fill_rect(&mut img, px, f.bottom, 1, 4, AXIS);
            draw_text(
                &mut img,
                px - text_width(label, 1) / 2,
                f.bottom + 7,
                label,
                1,
                TEXT,
            );
        }
        // Row r spans [y(r), y(r + 1)): the bands fill the frame however many rows there
        // are (a 4,096-GPU plan's trace has thousands), padded, ruled and labelled only
        // where they are tall enough for it.
        let n = self.rows.len().max(1);
        let y = |r: usize| f.top + ((f.bottom - f.top) as f64 * r as f64 / n as f64).round() as i32;
        let mut used = vec![false; self.kinds.len()];
        let mut labelled: Option<i32> = None;
        for (r, (name, spans)) in self.rows.iter().enumerate() {
            let (top, band) = (y(r), (y(r + 1) - y(r)).max(1));
            let pad = match band {
                10.. => 2,
                4.. => 1,
                _ => 0,
            };
            if labelled.is_none_or(|l| top - l >= 10) {
                draw_text(&mut img, 6, top + band / 2 - 3, name, 1, TEXT);
                labelled = Some(top);
            }
            for &(a, b, kind) in spans.iter().filter(|s| s.0.is_finite() && s.1.is_finite()) {
                let x0 = f.px(axis.frac((a - t0) * 1e3));
                let x1 = f.px(axis.frac((b - t0) * 1e3));
                let colour = PALETTE[kind % PALETTE.len()];
                fill_rect(
                    &mut img,
                    x0,
                    top + pad,
                    (x1 - x0).max(1),
                    (band - 2 * pad).max(1),
                    colour,
                );
                if let Some(u) = used.get_mut(kind) {
                    *u = true;
                }
            }
            if band >= 6 {
                fill_rect(&mut img, f.left, top + band - 1, f.right - f.left, 1, GRID);
            }
        }
        fill_rect(&mut img, f.left, f.top, 1, f.bottom - f.top + 1, AXIS);
        fill_rect(&mut img, f.left, f.bottom, f.right - f.left + 1, 1, AXIS);
        // The legend: the kinds that occur, in a line under the title.
        let mut x = f.left;
        for (k, name) in self.kinds.iter().enumerate().filter(|(k, _)| used[*k]) {
            fill_rect(&mut img, x, 32, 10, 8, PALETTE[k % PALETTE.len()]);
            draw_text(&mut img, x + 14, 33, name, 1, TEXT);
            x += 14 + text_width(name, 1) + 12;
        }
        Ok((img, f))
    }
}
