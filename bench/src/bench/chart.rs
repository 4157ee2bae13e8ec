//! The latency chart: one hand-written SVG panel per distribution, the CDF of each arm.

use std::fmt::Write;

/// Arm colours, in the table's order: direct, serve, nginx.
const COLOURS: [&str; 3] = ["#555555", "#d62728", "#1f77b4"];
const PANEL_W: f64 = 420.0;
const PANEL_H: f64 = 300.0;
const MARGIN_L: f64 = 55.0;
const MARGIN_B: f64 = 45.0;
const MARGIN_T: f64 = 40.0;

/// One panel: a title and, per arm, its name and sorted samples (µs).
pub struct Panel<'a> {
    pub title: String,
    pub arms: Vec<(&'a str, &'a [f64])>,
}

/// The SVG text of `panels` side by side; the x axis of each runs to its slowest arm's p99.
pub fn svg(caption: &str, panels: &[Panel]) -> String {
    let width = PANEL_W * panels.len() as f64 + 20.0;
    let height = PANEL_H + 30.0;
    let mut s = opening(width, height, caption);
    for (i, panel) in panels.iter().enumerate() {
        panel_svg(&mut s, 10.0 + PANEL_W * i as f64, 25.0, panel);
    }
    s.push_str("</svg>\n");
    s
}

fn panel_svg(s: &mut String, x0: f64, y0: f64, panel: &Panel) {
    let plot_w = PANEL_W - MARGIN_L - 20.0;
    let plot_h = PANEL_H - MARGIN_T - MARGIN_B;
    let left = x0 + MARGIN_L;
    let top = y0 + MARGIN_T;
    let x_max = panel
        .arms
        .iter()
        .filter(|(_, d)| !d.is_empty())
        .map(|(_, d)| super::percentile(d, 0.99))
        .fold(0.0, f64::max)
        .max(1.0)
        * 1.1;
    let x_max = nice_ceiling(x_max);
    let px = |v: f64| left + (v / x_max).min(1.0) * plot_w;
    let py = |q: f64| top + (1.0 - q) * plot_h;
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" font-size="12" text-anchor="middle">{}</text>"#,
        left + plot_w / 2.0,
        y0 + 18.0,
        escape(&panel.title)
    );
    // Grid and axes.
    for k in 0..=5 {
        let v = x_max * k as f64 / 5.0;
        let x = px(v);
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{top:.1}" x2="{x:.1}" y2="{:.1}" stroke="#e5e5e5"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{v:.0}</text>"##,
            top + plot_h,
            top + plot_h + 14.0
        );
    }
    for k in 0..=4 {
        let q = k as f64 / 4.0;
        let y = py(q);
        let _ = writeln!(
            s,
            r##"<line x1="{left:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{q:.2}</text>"##,
            left + plot_w,
            left - 5.0,
            y + 4.0
        );
    }
    let _ = writeln!(
        s,
        r#"<rect x="{left:.1}" y="{top:.1}" width="{plot_w:.1}" height="{plot_h:.1}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">µs (axis ends past the slowest arm's p99)</text>"#,
        left + plot_w / 2.0,
        top + plot_h + 30.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate({:.1},{:.1}) rotate(-90)" text-anchor="middle">fraction of requests ≤ x</text>"#,
        x0 + 14.0,
        top + plot_h / 2.0
    );
    // One CDF per arm, drawn through 400 quantiles.
    for (i, (name, data)) in panel.arms.iter().enumerate() {
        if data.is_empty() {
            continue;
        }
        let colour = COLOURS[i % COLOURS.len()];
        let mut points = String::new();
        for k in 0..=400 {
            let q = k as f64 / 400.0;
            let v = super::percentile(data, q);
            let _ = write!(points, "{:.1},{:.1} ", px(v), py(q));
        }
        let _ = writeln!(
            s,
            r#"<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="1.6"/>"#
        );
        let ly = top + plot_h - 12.0 - 14.0 * (panel.arms.len() - 1 - i) as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{colour}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{} (p50 {:.0})</text>"#,
            left + plot_w - 150.0,
            left + plot_w - 130.0,
            left + plot_w - 125.0,
            ly + 4.0,
            escape(name),
            super::percentile(data, 0.5)
        );
    }
}

/// The next 1, 2 or 5 times a power of ten at or above `v` (1 for nothing to draw).
pub fn nice_ceiling(v: f64) -> f64 {
    if !v.is_finite() || v <= 0.0 {
        return 1.0;
    }
    let power = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * power)
}

/// An SVG document's start: its size, a white ground, the caption on top.
pub fn opening(width: f64, height: f64, caption: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="10" y="18" font-size="13">{}</text>"#,
        escape(caption)
    );
    s
}

/// `text` safe inside SVG text.
pub fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_axis_ends_on_a_round_number() {
        assert_eq!(nice_ceiling(0.013), 0.02);
        assert_eq!(nice_ceiling(4.2), 5.0);
        assert_eq!(nice_ceiling(0.0), 1.0);
    }
}
