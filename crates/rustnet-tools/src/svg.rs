//! Small SVG helpers shared by the tools that draw: the bisect heat map
//! (`rustnet bisect --svg`) and the soak's resource plot
//! (`crates/rustnet-rigs/src/soak/main.rs`). Plain strings, no dependency.

/// Escape text for an SVG/XML attribute or text node.
pub fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Three significant digits (0.00441, 0.000236, 11.3): small values stay
/// readable in the same unit as large ones.
pub fn sig3(v: f64) -> String {
    if !v.is_finite() || v <= 0.0 {
        return "0".into();
    }
    let decimals = (2 - v.log10().floor() as i32).clamp(0, 9) as usize;
    format!("{v:.decimals$}")
}

/// 1, 2 or 5 times a power of ten, at least `raw`: a tick step people read.
pub fn nice_step(raw: f64) -> f64 {
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * p).find(|&v| v >= raw * (1.0 - 1e-9)).unwrap_or(10.0 * p)
}

/// One line of a [`panels`] chart.
pub struct Series {
    /// Legend text.
    pub name: String,
    /// CSS colour.
    pub color: String,
    /// (x, y) points in x order; a gap in x larger than `gap` breaks the line.
    pub points: Vec<(f64, f64)>,
}

/// One panel: a y axis of its own, the x axis shared with the others.
pub struct Panel {
    /// Title above the panel (the unit belongs here).
    pub title: String,
    /// The lines.
    pub series: Vec<Series>,
}

/// A vertical mark across every panel at `x` (an event: a fault injected).
pub struct Marker {
    /// Where.
    pub x: f64,
    /// CSS colour; the legend lists each (label, colour) once.
    pub color: String,
    /// Legend text.
    pub label: String,
}

/// Stacked line charts over one x axis (`x_label`), with vertical markers.
/// Lines break where consecutive points are more than `gap` apart in x (a
/// process restarted, a series paused).
pub fn panels(title: &str, x_label: &str, panels: &[Panel], markers: &[Marker], gap: f64) -> String {
    let (w, left, right, ph, top) = (900.0f64, 70.0f64, 170.0f64, 130.0f64, 50.0f64);
    let pw = w - left - right;
    let h = top + panels.len() as f64 * (ph + 40.0) + 50.0;
    let xs = panels.iter().flat_map(|p| p.series.iter().flat_map(|s| s.points.iter().map(|q| q.0))).chain(markers.iter().map(|m| m.x));
    let (mut x0, mut x1) = (f64::INFINITY, f64::NEG_INFINITY);
    for x in xs {
        x0 = x0.min(x);
        x1 = x1.max(x);
    }
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let sx = |x: f64| left + pw * (x - x0) / (x1 - x0);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w:.0}\" height=\"{h:.0}\" viewBox=\"0 0 {w:.0} {h:.0}\" font-family=\"monospace\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"20\" font-size=\"14\" font-weight=\"bold\">{}</text>\n",
        xml(title)
    );
    for (k, p) in panels.iter().enumerate() {
        let y_top = top + k as f64 * (ph + 40.0) + 16.0;
        let ys = p.series.iter().flat_map(|s| s.points.iter().map(|q| q.1));
        let (mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY);
        for y in ys {
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
        if !y0.is_finite() {
            (y0, y1) = (0.0, 1.0);
        }
        // from zero when the data sits close to it or is flat (a constant
        // thread count); ends on round ticks
        if y0 >= 0.0 && (y0 < 0.5 * y1 || y1 - y0 < 1e-9) {
            y0 = 0.0;
        }
        if y1 - y0 < 1e-9 {
            y1 = y0 + 1.0;
        }
        let step = nice_step((y1 - y0).max(1e-9) / 4.0);
        y0 = (y0 / step).floor() * step;
        y1 = ((y1 / step).floor() + 1.0) * step;
        let ticks = ((y1 - y0) / step).round() as usize;
        let sy = |y: f64| y_top + ph - ph * (y - y0) / (y1 - y0);
        s += &format!("<text x=\"{left:.0}\" y=\"{:.1}\" font-weight=\"bold\">{}</text>\n", y_top - 5.0, xml(&p.title));
        s += &format!("<rect x=\"{left:.0}\" y=\"{y_top:.1}\" width=\"{pw:.0}\" height=\"{ph:.0}\" fill=\"none\" stroke=\"#999\"/>\n");
        for t in 0..=ticks {
            let v = y0 + step * t as f64;
            let y = sy(v);
            s += &format!("<line x1=\"{left:.0}\" y1=\"{y:.1}\" x2=\"{:.0}\" y2=\"{y:.1}\" stroke=\"#eee\"/>\n", left + pw);
            s += &format!(
                "<text x=\"{:.0}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
                left - 4.0,
                y + 4.0,
                if step >= 1.0 {
                    format!("{v:.0}")
                } else if v < 0.0 {
                    format!("-{}", sig3(-v))
                } else {
                    sig3(v)
                }
            );
        }
        for m in markers {
            let x = sx(m.x);
            s += &format!(
                "<line x1=\"{x:.1}\" y1=\"{y_top:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"{}\" stroke-opacity=\"0.45\"/>\n",
                y_top + ph,
                m.color
            );
        }
        for (i, se) in p.series.iter().enumerate() {
            let mut d = String::new();
            let mut last: Option<f64> = None;
            for &(x, y) in &se.points {
                let op = if last.is_some_and(|l| x - l <= gap) { 'L' } else { 'M' };
                d += &format!("{op}{:.1},{:.1} ", sx(x), sy(y));
                last = Some(x);
            }
            s += &format!("<path d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\"/>\n", d.trim_end(), se.color);
            let ly = y_top + 14.0 + 14.0 * i as f64;
            s += &format!(
                "<line x1=\"{:.0}\" y1=\"{:.1}\" x2=\"{:.0}\" y2=\"{:.1}\" stroke=\"{}\" stroke-width=\"2\"/><text x=\"{:.0}\" y=\"{:.1}\">{}</text>\n",
                left + pw + 10.0,
                ly - 4.0,
                left + pw + 28.0,
                ly - 4.0,
                se.color,
                left + pw + 32.0,
                ly,
                xml(&se.name)
            );
        }
    }
    // x axis under the last panel, and the marker legend
    let y_axis = top + panels.len() as f64 * (ph + 40.0) - 6.0;
    for t in 0..=5 {
        let v = x0 + (x1 - x0) * t as f64 / 5.0;
        s += &format!("<text x=\"{:.1}\" y=\"{y_axis:.1}\" text-anchor=\"middle\">{:.0}</text>\n", sx(v), v);
    }
    s += &format!("<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n", left + pw / 2.0, y_axis + 16.0, xml(x_label));
    let mut seen: Vec<(&str, &str)> = Vec::new();
    for m in markers {
        if !seen.iter().any(|(l, _)| *l == m.label) {
            seen.push((&m.label, &m.color));
        }
    }
    // marker legend: one row under the x axis
    let mut lx = left;
    let ly = y_axis + 34.0;
    for (l, c) in &seen {
        s += &format!(
            "<line x1=\"{lx:.0}\" y1=\"{:.1}\" x2=\"{lx:.0}\" y2=\"{:.1}\" stroke=\"{c}\" stroke-width=\"2\"/><text x=\"{:.0}\" y=\"{ly:.1}\">{}</text>\n",
            ly - 11.0,
            ly + 2.0,
            lx + 6.0,
            xml(l)
        );
        lx += 30.0 + 7.0 * l.len() as f64;
    }
    s += "</svg>\n";
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sig3_keeps_three_digits() {
        assert_eq!(sig3(0.000236), "0.000236");
        assert_eq!(sig3(0.0044123), "0.00441");
        assert_eq!(sig3(11.34), "11.3");
        assert_eq!(sig3(1234.0), "1234");
        assert_eq!(sig3(0.0), "0");
    }

    #[test]
    fn tick_steps_are_round() {
        assert_eq!(nice_step(0.7), 1.0);
        assert_eq!(nice_step(1.3), 2.0);
        assert_eq!(nice_step(3.0), 5.0);
        assert_eq!(nice_step(2000.0), 2000.0);
        assert_eq!(nice_step(0.03), 0.05);
    }

    #[test]
    fn panels_are_well_formed_with_breaks_and_markers() {
        let p = Panel {
            title: "fds <A&B>".into(),
            series: vec![Series { name: "A".into(), color: "blue".into(), points: vec![(0.0, 10.0), (5.0, 12.0), (60.0, 11.0)] }],
        };
        let m = [Marker { x: 30.0, color: "red".into(), label: "peer killed".into() }];
        let s = panels("t", "seconds", &[p], &m, 10.0);
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("fds &lt;A&amp;B&gt;"), "title escaped");
        // the 55 s gap breaks the line: two M commands
        let path = s.lines().find(|l| l.starts_with("<path")).unwrap();
        assert_eq!(path.matches('M').count(), 2, "{path}");
        assert!(s.contains("peer killed"));
        assert_eq!(s.matches("<svg").count(), 1);
    }

    #[test]
    fn a_flat_series_gets_an_axis_from_zero() {
        let p = Panel {
            title: "threads".into(),
            series: vec![Series { name: "A".into(), color: "blue".into(), points: vec![(0.0, 2.0), (9.0, 2.0)] }],
        };
        let s = panels("t", "s", &[p], &[], 10.0);
        // ticks from 0 past 2 (not "2.00" twice on a zero-height axis)
        assert!(s.contains("text-anchor=\"end\">0</text>") && s.contains("text-anchor=\"end\">2.00</text>"), "{s}");
        assert_eq!(s.matches("text-anchor=\"end\">2.00</text>").count(), 1, "{s}");
    }
}
