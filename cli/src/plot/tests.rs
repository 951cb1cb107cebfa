//! Unit tests for the PNG charts: tick choice, number formatting, rendering and atomic saves.

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

fn count(img: &RgbImage, x: std::ops::Range<u32>, y: std::ops::Range<u32>, c: Rgb<u8>) -> usize {
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

#[test]
fn a_timeline_draws_each_span_in_its_row_and_colour() {
    let dir = tmp();
    let path = dir.path().join("t.png");
    let chart = timeline::Timeline {
        title: "timeline".into(),
        rows: vec![
            ("rank 0".into(), vec![(10.0, 10.5, 1)]),
            ("rank 1".into(), vec![(10.5, 11.0, 2)]),
        ],
        kinds: vec!["a".into(), "b".into(), "c".into()],
    };
    let (img, f) = chart.render(&path, 800, 300).unwrap();
    let band = (f.bottom - f.top) / 2;
    let mid = |row: i32| (f.top + band * row + band / 2) as u32;
    let quarter = (f.left + (f.right - f.left) / 4) as u32;
    let three_quarters = (f.left + 3 * (f.right - f.left) / 4) as u32;
    // Rank 0 works in the first half (kind 1), rank 1 in the second (kind 2).
    assert_eq!(*img.get_pixel(quarter, mid(0)), PALETTE[1]);
    assert_eq!(*img.get_pixel(three_quarters, mid(1)), PALETTE[2]);
    assert_ne!(*img.get_pixel(three_quarters, mid(0)), PALETTE[1]);
    assert_ne!(*img.get_pixel(quarter, mid(1)), PALETTE[2]);
    let empty = timeline::Timeline::default();
    assert!(matches!(
        empty.render(&path, 800, 300),
        Err(PlotError::NoData { .. })
    ));
}

/// Thousands of rows (a 4,096-GPU plan's trace) fill the frame to its bottom: the last
/// row's span is drawn next to the frame's lower edge, the first's at its top.
#[test]
fn a_timeline_of_many_rows_fills_the_frame() {
    let dir = tmp();
    let path = dir.path().join("many.png");
    let n = 1666;
    let chart = timeline::Timeline {
        title: "timeline".into(),
        rows: (0..n)
            .map(|r| (format!("lane {r}"), vec![(0.0, 1.0, r % 2)]))
            .collect(),
        kinds: vec!["a".into(), "b".into()],
    };
    let (img, f) = chart.render(&path, 800, 2000).unwrap();
    let x = ((f.left + f.right) / 2) as u32;
    // The last row (kind 1) ends at the frame's bottom; the first (kind 0) starts at its top.
    assert_eq!(*img.get_pixel(x, (f.bottom - 1) as u32), PALETTE[1]);
    assert_eq!(*img.get_pixel(x, f.top as u32), PALETTE[0]);
}
