//! A small SVG line chart for `rustnet bench step|ring`: per ring size, busbw
//! and CPU s/GB against message size (log scale), one line per network, with
//! the min-max range as a bar. (bisect.rs draws a heat map, not lines.)
use crate::samples::{human as size_label, Row};
use rustnet_tools::svg::xml as esc;

const COLORS: [&str; 6] = ["#d62728", "#1f77b4", "#2ca02c", "#7f7f7f", "#9467bd", "#ff7f0e"];

/// The chart as an SVG document.
pub fn svg(rows: &[Row], title: &str) -> String {
    let mut ranks: Vec<usize> = rows.iter().map(|r| r.ranks).collect();
    ranks.dedup();
    ranks.sort_unstable();
    ranks.dedup();
    let mut nets: Vec<&str> = Vec::new();
    for r in rows {
        if !nets.contains(&r.net.as_str()) {
            nets.push(&r.net);
        }
    }
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let (pw, ph, m) = (420.0, 240.0, 55.0);
    let w = 2.0 * (pw + m) + m;
    let h = ranks.len() as f64 * (ph + m) + 60.0 + 18.0 * nets.len() as f64;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w:.0}\" height=\"{h:.0}\" viewBox=\"0 0 {w:.0} {h:.0}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{m}\" y=\"20\" font-size=\"14\">{}</text>\n",
        esc(title)
    );
    let lx = |i: usize| if sizes.len() <= 1 { 0.5 } else { i as f64 / (sizes.len() - 1) as f64 };
    for (ri, &n) in ranks.iter().enumerate() {
        for (ci, (what, get)) in [("busbw GB/s", 0usize), ("CPU s/GB", 1usize)].into_iter().enumerate() {
            let x0 = m + ci as f64 * (pw + m);
            let y0 = 40.0 + ri as f64 * (ph + m);
            fn pick(r: &Row, get: usize) -> &crate::samples::Stat {
                if get == 0 {
                    &r.busbw
                } else {
                    &r.cpu
                }
            }
            let ymax =
                rows.iter().filter(|r| r.ranks == n).map(|r| pick(r, get).max()).filter(|v| v.is_finite()).fold(0.0f64, f64::max).max(1e-9)
                    * 1.1;
            s += &format!("<rect x=\"{x0}\" y=\"{y0}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#444\"/>\n");
            s += &format!("<text x=\"{}\" y=\"{}\">N={n}: {what}</text>\n", x0 + 4.0, y0 - 4.0);
            for t in 0..=4 {
                let v = ymax * t as f64 / 4.0;
                let y = y0 + ph - ph * t as f64 / 4.0;
                s += &format!("<line x1=\"{x0}\" y1=\"{y:.1}\" x2=\"{}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\n", x0 + pw);
                s += &format!("<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{v:.2}</text>\n", x0 - 3.0, y + 4.0);
            }
            for (i, &sz) in sizes.iter().enumerate() {
                let x = x0 + 10.0 + (pw - 20.0) * lx(i);
                s += &format!("<text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", y0 + ph + 14.0, size_label(sz));
            }
            for (k, net) in nets.iter().enumerate() {
                let col = COLORS[k % COLORS.len()];
                let mut pts = Vec::new();
                for (i, &sz) in sizes.iter().enumerate() {
                    if let Some(r) = rows.iter().find(|r| r.ranks == n && r.size == sz && r.net == *net) {
                        let st = pick(r, get);
                        let x = x0 + 10.0 + (pw - 20.0) * lx(i);
                        let y = |v: f64| y0 + ph - ph * (v / ymax).clamp(0.0, 1.0);
                        if st.med().is_finite() {
                            pts.push(format!("{x:.1},{:.1}", y(st.med())));
                            s += &format!(
                                "<line x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"{col}\"/>\n<circle cx=\"{x:.1}\" cy=\"{:.1}\" r=\"2.5\" fill=\"{col}\"/>\n",
                                y(st.min()),
                                y(st.max()),
                                y(st.med())
                            );
                        }
                    }
                }
                s += &format!("<polyline points=\"{}\" fill=\"none\" stroke=\"{col}\" stroke-width=\"1.5\"/>\n", pts.join(" "));
            }
        }
    }
    let ly = 40.0 + ranks.len() as f64 * (ph + m);
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
    use crate::samples::Stat;

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
}
