//! Small SVG line charts for `rustnet bench`: panels of a value against
//! message size (log scale, one tick per measured size), one line per
//! network, with the min-max range of every point as a bar. `step|ring` draw
//! busbw and CPU s/GB per ring size; the default comparison draws NCCL's
//! pattern, one-way and bidirectional bandwidth. (bisect.rs draws a heat map.)
use crate::samples::{human as size_label, Row, Stat};
use rustnet_tools::svg::xml as esc;

const COLORS: [&str; 6] = ["#d62728", "#1f77b4", "#2ca02c", "#7f7f7f", "#9467bd", "#ff7f0e"];

/// One panel: a title (with the unit) and its lines, each a network's
/// (size, samples) points.
pub struct Panel {
    pub title: String,
    pub lines: Vec<(String, Vec<(usize, Stat)>)>,
}

/// `step|ring`: per ring size, busbw and CPU s/GB against message size.
pub fn svg(rows: &[Row], title: &str) -> String {
    let mut ranks: Vec<usize> = rows.iter().map(|r| r.ranks).collect();
    ranks.sort_unstable();
    ranks.dedup();
    let mut panels = Vec::new();
    for &n in &ranks {
        for (what, cpu) in [("busbw GB/s", false), ("CPU s/GB", true)] {
            let mut lines: Vec<(String, Vec<(usize, Stat)>)> = Vec::new();
            for r in rows.iter().filter(|r| r.ranks == n) {
                let st = if cpu { r.cpu.clone() } else { r.busbw.clone() };
                match lines.iter_mut().find(|l| l.0 == r.net) {
                    Some(l) => l.1.push((r.size, st)),
                    None => lines.push((r.net.clone(), vec![(r.size, st)])),
                }
            }
            panels.push(Panel { title: format!("N={n}: {what}"), lines });
        }
    }
    grid(title, &panels)
}

/// The panels two to a row, one colour per network name across all of them.
pub fn grid(title: &str, panels: &[Panel]) -> String {
    let mut nets: Vec<&str> = Vec::new();
    for p in panels {
        for (net, _) in &p.lines {
            if !nets.contains(&net.as_str()) {
                nets.push(net);
            }
        }
    }
    let mut sizes: Vec<usize> = panels.iter().flat_map(|p| p.lines.iter().flat_map(|l| l.1.iter().map(|q| q.0))).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let (pw, ph, m) = (420.0, 240.0, 55.0);
    let nrows = panels.len().div_ceil(2);
    let w = 2.0 * (pw + m) + m;
    let h = nrows as f64 * (ph + m) + 60.0 + 18.0 * nets.len() as f64;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w:.0}\" height=\"{h:.0}\" viewBox=\"0 0 {w:.0} {h:.0}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{m}\" y=\"20\" font-size=\"14\">{}</text>\n",
        esc(title)
    );
    for (pi, p) in panels.iter().enumerate() {
        // each panel's own sizes, spread over its width
        let mut psz: Vec<usize> = p.lines.iter().flat_map(|l| l.1.iter().map(|q| q.0)).collect();
        psz.sort_unstable();
        psz.dedup();
        let lx = |sz: usize| {
            let i = psz.iter().position(|&x| x == sz).unwrap_or(0);
            if psz.len() <= 1 {
                0.5
            } else {
                i as f64 / (psz.len() - 1) as f64
            }
        };
        let x0 = m + (pi % 2) as f64 * (pw + m);
        let y0 = 40.0 + (pi / 2) as f64 * (ph + m);
        let ymax =
            p.lines.iter().flat_map(|l| l.1.iter().map(|q| q.1.max())).filter(|v| v.is_finite()).fold(0.0f64, f64::max).max(1e-9) * 1.1;
        s += &format!("<rect x=\"{x0}\" y=\"{y0}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#444\"/>\n");
        s += &format!("<text x=\"{}\" y=\"{}\">{}</text>\n", x0 + 4.0, y0 - 4.0, esc(&p.title));
        for t in 0..=4 {
            let v = ymax * t as f64 / 4.0;
            let y = y0 + ph - ph * t as f64 / 4.0;
            s += &format!("<line x1=\"{x0}\" y1=\"{y:.1}\" x2=\"{}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\n", x0 + pw);
            s += &format!("<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{v:.2}</text>\n", x0 - 3.0, y + 4.0);
        }
        for &sz in &psz {
            let x = x0 + 10.0 + (pw - 20.0) * lx(sz);
            s += &format!("<text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", y0 + ph + 14.0, size_label(sz));
        }
        for (net, pts) in &p.lines {
            let k = nets.iter().position(|n| n == net).unwrap_or(0);
            let col = COLORS[k % COLORS.len()];
            let mut line = Vec::new();
            for (sz, st) in pts {
                let x = x0 + 10.0 + (pw - 20.0) * lx(*sz);
                let y = |v: f64| y0 + ph - ph * (v / ymax).clamp(0.0, 1.0);
                if st.med().is_finite() {
                    line.push(format!("{x:.1},{:.1}", y(st.med())));
                    s += &format!(
                        "<line x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"{col}\"/>\n<circle cx=\"{x:.1}\" cy=\"{:.1}\" r=\"2.5\" fill=\"{col}\"/>\n",
                        y(st.min()),
                        y(st.max()),
                        y(st.med())
                    );
                }
            }
            s += &format!("<polyline points=\"{}\" fill=\"none\" stroke=\"{col}\" stroke-width=\"1.5\"/>\n", line.join(" "));
        }
    }
    let ly = 40.0 + nrows as f64 * (ph + m);
    for (k, net) in nets.iter().enumerate() {
        let y = ly + 18.0 * k as f64;
        s += &format!(
            "<line x1=\"{m}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"{}\" stroke-width=\"3\"/><text x=\"{}\" y=\"{}\">{}</text>\n",
            m + 24.0,
            COLORS[k % COLORS.len()],
            m + 30.0,
            y + 4.0,
            esc(net)
        );
    }
    s += "</svg>\n";
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_is_well_formed_and_names_every_net() {
        let rows: Vec<Row> = [(2, 4096, "a<b"), (2, 8192, "a<b"), (2, 4096, "c"), (4, 4096, "c")]
            .into_iter()
            .map(|(n, s, net)| Row { ranks: n, size: s, net: net.into(), busbw: Stat(vec![1.0, 2.0]), cpu: Stat(vec![0.5]) })
            .collect();
        let s = svg(&rows, "t & t");
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("a&lt;b") && s.contains("t &amp; t") && s.contains("N=4"));
        assert_eq!(s.matches("<svg").count(), 1);
    }

    #[test]
    fn grid_keeps_one_colour_per_net_across_panels() {
        let line = |net: &str| (net.to_string(), vec![(1 << 20, Stat(vec![1.0, 1.5])), (4 << 20, Stat(vec![2.0]))]);
        let panels = [
            Panel { title: "one".into(), lines: vec![line("plugin"), line("raw")] },
            Panel { title: "two".into(), lines: vec![line("raw")] },
            Panel { title: "three".into(), lines: vec![line("plugin")] },
        ];
        let s = grid("g", &panels);
        // raw is the second net: its colour everywhere, the plugin's (first) never on panel two's line
        assert_eq!(s.matches("stroke=\"#1f77b4\" stroke-width=\"1.5\"").count(), 2, "{s}");
        assert_eq!(s.matches("stroke=\"#d62728\" stroke-width=\"1.5\"").count(), 2, "{s}");
        assert!(s.contains(">three<") && s.contains(">1M<") && s.contains(">4M<"));
    }
}
