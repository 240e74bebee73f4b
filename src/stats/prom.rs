//! Prometheus text exposition (version 0.0.4, what node_exporter's textfile
//! collector reads): a writer for the per-process statistics file and the
//! small parser `rustnet stats` and the tests read it back with. No I/O.
use std::fmt::Write as _;

/// The last line of every file we write. A file without it was cut short
/// (copied while being written, a full disk) and is reported as such. To a
/// Prometheus parser it is a comment.
pub const END_MARKER: &str = "# EOF";

/// One metric family being written: its samples stay together, after one
/// `# HELP` and one `# TYPE` line, as the format requires.
pub struct Family {
    name: &'static str,
    help: &'static str,
    kind: &'static str,
    lines: String,
}

impl Family {
    /// A counter (`..._total`).
    pub fn counter(name: &'static str, help: &'static str) -> Family {
        Family { name, help, kind: "counter", lines: String::new() }
    }

    /// A gauge.
    pub fn gauge(name: &'static str, help: &'static str) -> Family {
        Family { name, help, kind: "gauge", lines: String::new() }
    }

    /// Add one sample.
    pub fn sample(&mut self, labels: &[(&str, &str)], value: f64) {
        self.lines += self.name;
        if !labels.is_empty() {
            self.lines.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.lines.push(',');
                }
                let _ = write!(self.lines, "{k}=\"{}\"", escape(v));
            }
            self.lines.push('}');
        }
        let _ = writeln!(self.lines, " {}", fmt_value(value));
    }

    /// Append the family to `out` (nothing when it has no sample).
    pub fn finish(self, out: &mut String) {
        if self.lines.is_empty() {
            return;
        }
        let _ = writeln!(out, "# HELP {} {}", self.name, self.help);
        let _ = writeln!(out, "# TYPE {} {}", self.name, self.kind);
        out.push_str(&self.lines);
    }
}

fn fmt_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else if v.fract() == 0.0 && v.abs() < 9.0e15 {
        // counters print as integers (exact up to 2^53)
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

/// A label value as the format writes it.
pub fn escape(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s += "\\\\",
            '"' => s += "\\\"",
            '\n' => s += "\\n",
            c => s.push(c),
        }
    }
    s
}

/// One sample read back.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name.
    pub name: String,
    /// Labels in file order.
    pub labels: Vec<(String, String)>,
    /// The value.
    pub value: f64,
}

impl Sample {
    /// The value of label `k`, if present.
    pub fn label(&self, k: &str) -> Option<&str> {
        self.labels.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str())
    }
}

/// A parsed file.
#[derive(Debug, Clone, Default)]
pub struct Exposition {
    /// Every sample, in file order.
    pub samples: Vec<Sample>,
    /// `# TYPE` lines: metric name and type.
    pub types: Vec<(String, String)>,
    /// The file ended with [`END_MARKER`].
    pub complete: bool,
}

impl Exposition {
    /// Samples of metric `name`.
    pub fn get<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// Sum of metric `name` over the samples whose labels include all of `want`.
    pub fn sum(&self, name: &str, want: &[(&str, &str)]) -> f64 {
        self.get(name).filter(|s| want.iter().all(|(k, v)| s.label(k) == Some(v))).map(|s| s.value).sum()
    }

    /// The first value of metric `name`.
    pub fn first(&self, name: &str) -> Option<f64> {
        self.get(name).next().map(|s| s.value)
    }
}

fn valid_name(n: &str) -> bool {
    let mut c = n.chars();
    matches!(c.next(), Some(x) if x.is_ascii_alphabetic() || x == '_' || x == ':')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
}

/// Parse the text format. An error names the line and what is wrong there.
pub fn parse(text: &str) -> Result<Exposition, String> {
    let mut e = Exposition::default();
    let mut last = "";
    for (i, raw) in text.lines().enumerate() {
        let no = i + 1;
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        last = line;
        if let Some(c) = line.strip_prefix('#') {
            let mut w = c.split_whitespace();
            if w.next() == Some("TYPE") {
                let (Some(n), Some(t)) = (w.next(), w.next()) else {
                    return Err(format!("line {no}: a TYPE line needs a metric name and a type"));
                };
                e.types.push((n.to_string(), t.to_string()));
            }
            continue;
        }
        e.samples.push(parse_sample(line).map_err(|w| format!("line {no}: {w}: {}", shorten(raw)))?);
    }
    e.complete = last == END_MARKER;
    Ok(e)
}

fn shorten(s: &str) -> String {
    if s.chars().count() > 80 {
        format!("{}...", s.chars().take(80).collect::<String>())
    } else {
        s.to_string()
    }
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace()).ok_or("a sample needs a value")?;
    let name = &line[..name_end];
    if !valid_name(name) {
        return Err(format!("{name:?} is not a metric name"));
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        let mut chars = r.char_indices().peekable();
        let end;
        loop {
            // skip separators
            while let Some(&(_, c)) = chars.peek() {
                if c == ',' || c.is_whitespace() {
                    chars.next();
                } else {
                    break;
                }
            }
            let Some(&(start, c)) = chars.peek() else { return Err("unterminated label set".into()) };
            if c == '}' {
                end = start + 1;
                break;
            }
            let mut eq = None;
            for (j, c) in chars.by_ref() {
                if c == '=' {
                    eq = Some(j);
                    break;
                }
            }
            let eq = eq.ok_or("a label without '='")?;
            let key = r[start..eq].trim();
            if !valid_name(key) {
                return Err(format!("{key:?} is not a label name"));
            }
            if chars.next().map(|x| x.1) != Some('"') {
                return Err(format!("label {key} has no quoted value"));
            }
            let mut val = String::new();
            let mut closed = false;
            while let Some((_, c)) = chars.next() {
                match c {
                    '"' => {
                        closed = true;
                        break;
                    }
                    '\\' => match chars.next().map(|x| x.1) {
                        Some('n') => val.push('\n'),
                        Some(x) => val.push(x),
                        None => break,
                    },
                    c => val.push(c),
                }
            }
            if !closed {
                return Err(format!("label {key}'s value is not closed"));
            }
            labels.push((key.to_string(), val));
        }
        rest = &r[end..];
    }
    let mut w = rest.split_whitespace();
    let v = w.next().ok_or("a sample needs a value")?;
    let value = match v {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse::<f64>().map_err(|_| format!("{v:?} is not a number"))?,
    };
    // an optional timestamp (milliseconds); nothing after it
    if let Some(ts) = w.next() {
        ts.parse::<i64>().map_err(|_| format!("{ts:?} after the value is not a timestamp"))?;
    }
    if w.next().is_some() {
        return Err("more than a value and a timestamp after the labels".into());
    }
    Ok(Sample { name: name.to_string(), labels, value })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_families_parse_back() {
        let mut out = String::new();
        let mut f = Family::counter("rustnet_x_total", "X.");
        f.sample(&[("a", "1"), ("b", "q\"uo\\te\nnl")], 42.0);
        f.sample(&[], 1.5);
        f.finish(&mut out);
        Family::gauge("rustnet_empty", "never written").finish(&mut out);
        out += END_MARKER;
        out.push('\n');
        assert!(!out.contains("rustnet_empty"));
        let e = parse(&out).unwrap();
        assert!(e.complete);
        assert_eq!(e.types, vec![("rustnet_x_total".to_string(), "counter".to_string())]);
        assert_eq!(e.samples.len(), 2);
        assert_eq!(e.samples[0].label("b"), Some("q\"uo\\te\nnl"));
        assert_eq!(e.samples[0].value, 42.0);
        assert_eq!(e.samples[1].value, 1.5);
        assert_eq!(e.sum("rustnet_x_total", &[("a", "1")]), 42.0);
    }

    #[test]
    fn bad_lines_are_named() {
        for (text, want) in [
            ("x{a=\"1\" 3\n", "line 1"),
            ("ok 1\n1bad 2\n", "line 2"),
            ("x{a=1} 2\n", "no quoted value"),
            ("x 12abc\n", "not a number"),
            ("x\n", "needs a value"),
            ("x{a=\"1\"} 2 3 4\n", "more than"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        // a timestamp and special values are fine; no end marker = incomplete
        let e = parse("x 1 1700000000000\ny NaN\nz +Inf\n").unwrap();
        assert_eq!(e.samples.len(), 3);
        assert!(!e.complete);
    }
}
